"""Reference (pure torch) and rules of the streamed MLP: one row's post-attention residual add, RMSNorm, gate|up,
SiLU-and-multiply and down projection, as `streamed_mlp_gluon.py` computes them in one kernel on Hopper."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.kernels.skinny_linear import skinny_linear_gated_ref, skinny_linear_ref

SHARED_MEMORY_BYTES = 232_448
"""Shared memory one program may hold on compute capability 9.0 (227 KiB)."""
BOX_BYTES = 16 * 256 * 2
"""One TMA box: 16 rows x 256 columns of bf16."""


class StreamedMLPError(ValueError):
    """A streamed-MLP setting or call that cannot run, with what to change."""


@dataclass(frozen=True)
class StreamedMLPConfig:
    stages: int = 12
    """Ring slots a program streams its weights through (fewer where the shape's vectors need the room)."""
    boxes: int = 2
    """Boxes of 16 rows x 256 columns a slot: consecutive column chunks of the same rows."""
    warps: int = 8
    """Consumer warps a program (one loader warp more)."""
    registers: int = 64
    """Registers a thread at launch, so that other kernels' programs can share an SM with one of these."""

    def __post_init__(self) -> None:
        if self.stages < 2:
            raise StreamedMLPError(f"stages={self.stages}: the ring needs at least 2 slots")
        if self.boxes not in (1, 2, 4):
            raise StreamedMLPError(f"boxes={self.boxes}: use 1, 2 or 4")
        if self.warps not in (4, 8):
            raise StreamedMLPError(f"warps={self.warps}: use 4 or 8")
        if self.registers % 8 or not 40 <= self.registers <= 256:
            raise StreamedMLPError(f"registers={self.registers}: a multiple of 8 from 40 to 256")


def vectors_bytes(hidden: int, intermediate: int) -> int:
    """Shared memory a program holds besides its ring: the normalised row (fp32) and the activations (bf16)."""
    return hidden * 4 + intermediate * 2 + 1024  # and the ring's mbarriers, rounded up


def stages_for(config: StreamedMLPConfig, hidden: int, intermediate: int) -> int:
    """The config's ring depth, reduced until the ring and the vectors fit one program's shared memory."""
    room = SHARED_MEMORY_BYTES - vectors_bytes(hidden, intermediate)
    return min(config.stages, room // (config.boxes * BOX_BYTES))


def vector_rows(hidden: int, intermediate: int) -> int:
    """Rows of 256 a block of the normalised row and the activations moves in: the largest power of two up to 8
    dividing both widths' row counts (8: one row a consumer warp, no warp holding another's copy)."""
    rows = 8
    while (hidden // 256) % rows or (intermediate // 256) % rows:
        rows //= 2
    return rows


def shape_supported(config: StreamedMLPConfig, hidden: int, intermediate: int) -> bool:
    """Whether the kernel takes an MLP of this shape: whole slots along both projections' columns, and a ring of
    at least 2 slots beside the vectors."""
    width = 256 * config.boxes
    return (
        hidden % width == 0
        and intermediate % width == 0
        and hidden >= 256
        and stages_for(config, hidden, intermediate) >= 2
    )


def streamed_mlp_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down(silu(gate) * up), x + residual) for x, residual [T, H], gate_up_weight [2 I, H] (gate rows, then up
    rows), down_weight [H, I]: the engine's chain of fused_add_rms_norm, the gated projection and the down
    projection, each result rounded to x.dtype as those kernels round it (fp32 sums)."""
    normed, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return skinny_linear_ref(skinny_linear_gated_ref(normed, gate_up_weight), down_weight), summed
