"""Tensor parallelism inside one host: which slice of each weight a rank holds, and the two
collectives a sharded decoder needs (all-reduce after the row-parallel projections and the
vocabulary-parallel embedding, all-gather of the vocabulary-parallel logits).

Megatron's layout: q/k/v and gate/up are split by output rows (column-parallel), o_proj and
down_proj by input columns (row-parallel, one all-reduce each), the embedding and the LM head by
vocabulary rows. KV heads are split across ranks; when a model has fewer KV heads than ranks each
head is replicated on `size // num_kv_heads` consecutive ranks, so that every rank holds whole heads
and its query heads find their KV head locally.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncspec.errors import ConfigError


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group (size 1: no group, no collectives)."""

    rank: int = 0
    """Rank inside the group, 0 to size - 1."""
    size: int = 1
    """Number of ranks sharing one model."""
    group: Any = None
    """The torch.distributed process group (None when size is 1)."""
    small_all_reduce: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    """A faster all-reduce for small messages (the worker's push kernel over symmetric memory); it returns
    None for a message it does not take, which then goes through the group's backend."""
    graph_group: Any = None
    """The group of the collectives captured in CUDA graphs, a communicator of their own (None: `group`
    for every collective). NCCL communicators that see both graphed and eager launches pay for it in every
    graphed collective unless NCCL_GRAPH_MIXING_SUPPORT=0, which is correct only for a communicator that
    never mixes them; with graphed and eager collectives on separate communicators the worker sets it."""

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # -- layout ---------------------------------------------------------------------------------
    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total`; ConfigError when it does not divide."""
        if total % self.size:
            raise ConfigError(
                f"{what}={total} is not divisible by tensor_parallel_size={self.size}; choose a size that divides it"
            )
        share = total // self.size
        return self.rank * share, share

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads held) on this rank: an equal share, or one replicated head when
        the model has fewer KV heads than ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ConfigError(
                f"num_key_value_heads={num_kv_heads} is below tensor_parallel_size={self.size} and does not divide "
                "it: each KV head must be replicated on a whole number of ranks"
            )
        return self.rank // (self.size // num_kv_heads), 1

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows) of the vocabulary-parallel embedding and LM head: the vocabulary padded
        up to a multiple of size; the last rank's padding rows are zero and never sampled."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    # -- collectives ----------------------------------------------------------------------------
    def _group_now(self) -> Any:
        """The group for a collective issued now: graph_group while a CUDA graph is being captured."""
        if self.graph_group is not None and torch.cuda.is_current_stream_capturing():
            return self.graph_group
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed across the ranks (`x` itself for size 1; maybe a new tensor otherwise)."""
        if self.size == 1:
            return x
        if self.small_all_reduce is not None:
            reduced = self.small_all_reduce(x)
            if reduced is not None:
                return reduced
        dist.all_reduce(x, group=self._group_now())
        return x

    def all_gather_rows(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenates each rank's [N, shard] along the last dimension and keeps the first `total`
        columns (the vocabulary without its padding)."""
        if self.size == 1:
            return x
        n, shard = x.shape
        gathered = torch.empty((self.size * n, shard), dtype=x.dtype, device=x.device)
        # all_gather_single is the name from torch 2.13 on (all_gather_into_tensor before it).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, x.contiguous(), group=self._group_now())
        return gathered.view(self.size, n, shard).permute(1, 0, 2).reshape(n, self.size * shard)[:, :total]


def check_divisible(tp: TensorParallel, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raises ConfigError naming the first model dimension that `tp.size` cannot split."""
    if not tp.enabled:
        return
    tp.split(num_heads, "num_attention_heads")
    tp.kv_heads(num_kv_heads)
    tp.split(intermediate_size, "intermediate_size")
