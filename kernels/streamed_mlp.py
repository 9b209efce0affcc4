"""Reference (pure torch) and rules of the streamed MLP: one row's post-attention residual add, RMSNorm, gate|up,
SiLU-and-multiply and down projection, as `streamed_mlp_gluon.py` computes them on Hopper: in one kernel with a
grid barrier, or split in two (gate|up, then the down projection as a streamed GEMV) without one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.kernels.skinny_linear import skinny_linear_gated_ref, skinny_linear_ref
from asyncspec.kernels.streamed_gemv import (
    BOX_BYTES,
    MBARRIER_BYTES,
    PROGRAM_RESERVED_BYTES,
    SHARED_MEMORY_BYTES,
    SM_SHARED_MEMORY_BYTES,
    StreamedKernelError,
    check_stream_config,
    gemv_vector_bytes,
    vector_rows,
)

__all__ = [
    "BOX_BYTES",
    "SHARED_MEMORY_BYTES",
    "StreamedMLPConfig",
    "StreamedMLPError",
    "down_stages_for",
    "shape_supported",
    "split_down_room",
    "split_stages",
    "stages_for",
    "streamed_mlp_ref",
    "vector_rows",
    "vectors_bytes",
]


class StreamedMLPError(StreamedKernelError):
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
    grid_barrier: bool = True
    """True: one kernel, whose programs meet at a grid barrier between gate|up and down (every program must be
    resident at once). False: two kernels, gate|up then down as a streamed GEMV (whose loader starts during the
    first kernel's tail where `co_resident`); no barrier, so nothing can hang where an SM is kept from it."""
    co_resident: bool = True
    """Split form only. True: both kernels' rings fit one SM together, so the down projection's loader streams
    during the gate|up kernel's tail. False: each kernel's ring takes a program's whole shared memory (the bytes in
    flight that set a stream's rate: docs/benchmarks.md, 2026-12-05), and the down projection starts after."""

    def __post_init__(self) -> None:
        check_stream_config(self.stages, self.boxes, self.warps, self.registers, StreamedMLPError)
        if self.grid_barrier and not self.co_resident:
            raise StreamedMLPError(
                "co_resident=False sizes the split form's two kernels; with grid_barrier=True there is one kernel: "
                "set grid_barrier=False too, or leave co_resident at True"
            )


def vectors_bytes(hidden: int, intermediate: int, grid_barrier: bool = True) -> int:
    """Shared memory a program holds besides its ring: the normalised row (fp32), the activations (bf16; one
    block when the down projection is a kernel of its own) and the mbarriers."""
    activations = intermediate * 2 if grid_barrier else vector_rows(hidden, intermediate) * 256 * 2
    return hidden * 4 + activations + MBARRIER_BYTES


def split_stages(config: StreamedMLPConfig, hidden: int, intermediate: int) -> tuple[int, int]:
    """Ring depths of the split form's two kernels (gate|up, down) such that a program of each fits one SM
    together, so the down projection's loader can stream while the gate|up kernel finishes."""
    both = SM_SHARED_MEMORY_BYTES - 2 * PROGRAM_RESERVED_BYTES
    room = both - vectors_bytes(hidden, intermediate, False) - gemv_vector_bytes(intermediate)
    stages = min(config.stages, max(room, 0) // (2 * config.boxes * BOX_BYTES))
    return stages, stages


def split_down_room(config: StreamedMLPConfig, hidden: int, intermediate: int) -> int:
    """Shared memory the split form's down-projection program may hold: what an SM has left beside a gate|up
    program, or a program's whole share where the two need not be co-resident."""
    if not config.co_resident:
        return SHARED_MEMORY_BYTES
    gate_up = stages_for(config, hidden, intermediate) * config.boxes * BOX_BYTES
    return SM_SHARED_MEMORY_BYTES - 2 * PROGRAM_RESERVED_BYTES - gate_up - vectors_bytes(hidden, intermediate, False)


def stages_for(config: StreamedMLPConfig, hidden: int, intermediate: int) -> int:
    """The (gate|up) kernel's ring depth: the config's, reduced until the ring and the vectors fit one program's
    shared memory, or, split and co-resident, until both kernels' programs fit an SM."""
    if not config.grid_barrier and config.co_resident:
        return split_stages(config, hidden, intermediate)[0]
    room = SHARED_MEMORY_BYTES - vectors_bytes(hidden, intermediate, config.grid_barrier)
    return min(config.stages, room // (config.boxes * BOX_BYTES))


def down_stages_for(config: StreamedMLPConfig, hidden: int, intermediate: int) -> int:
    """The split form's down-projection ring depth (its own kernel, a streamed GEMV over the activations)."""
    if config.co_resident:
        return split_stages(config, hidden, intermediate)[1]
    room = SHARED_MEMORY_BYTES - gemv_vector_bytes(intermediate)
    return min(config.stages, room // (config.boxes * BOX_BYTES))


def shape_supported(config: StreamedMLPConfig, hidden: int, intermediate: int) -> bool:
    """Whether the kernel takes an MLP of this shape: whole slots along both projections' columns, and rings of
    at least 2 slots beside the vectors (split: both kernels' rings, which share an SM where co-resident)."""
    width = 256 * config.boxes
    if hidden % width or intermediate % width or hidden < 256:
        return False
    if config.grid_barrier:
        return stages_for(config, hidden, intermediate) >= 2
    return min(stages_for(config, hidden, intermediate), down_stages_for(config, hidden, intermediate)) >= 2


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
