"""Where each checkpoint tensor goes on this rank: the parameter (or slice of a fused parameter)
it fills, and which slice of the checkpoint tensor that is under tensor parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightTarget:
    """One checkpoint tensor's destination on this rank."""

    tensor: torch.Tensor
    """The parameter, or the view of a fused parameter, that receives the data."""
    dim: int | None = None
    """Dimension of the checkpoint tensor this rank takes a slice of; None: the whole tensor."""
    start: int = 0
    """First index of the slice along `dim`."""
    full: int = 0
    """Length of the checkpoint tensor along `dim` (the model's unsharded size)."""
    zero: bool = False
    """Filled with zeros instead of read: a row-parallel bias on ranks other than 0 (the bias is
    added once, after the all-reduce)."""

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape the checkpoint tensor must have."""
        shape = list(self.tensor.shape)
        if self.dim is not None:
            shape[self.dim] = self.full
        return tuple(shape)

    @property
    def length(self) -> int:
        """Indices this rank reads along `dim`; the last vocabulary shard may run past the end, and
        its padding rows stay zero."""
        if self.dim is None:
            return 0
        return max(0, min(self.tensor.shape[self.dim], self.full - self.start))

    def destination(self) -> torch.Tensor:
        """The part of `tensor` the read fills (all of it, unless a shard holds padding rows)."""
        if self.dim is None:
            return self.tensor
        return self.tensor.narrow(self.dim, 0, self.length)


def whole(tensor: torch.Tensor) -> WeightTarget:
    return WeightTarget(tensor)


def sliced(tensor: torch.Tensor, dim: int, start: int, full: int) -> WeightTarget:
    return WeightTarget(tensor, dim, start, full)
