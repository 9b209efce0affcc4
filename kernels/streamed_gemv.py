"""Reference (pure torch) and rules of the streamed GEMV: one row times a bias-free weight [N, K] (x @ W^T), as
`streamed_gemv_gluon.py` computes it on Hopper, the weight streamed into shared memory by a loader warp from the
kernel's first instruction, before its PDL wait. Also the rules every streamed kernel's config shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncspec.kernels.skinny_linear import skinny_linear_ref

SHARED_MEMORY_BYTES = 232_448
"""Shared memory one program may hold on compute capability 9.0 (227 KiB)."""
SM_SHARED_MEMORY_BYTES = 233_472
"""Shared memory of one SM on compute capability 9.0 (228 KiB), which the programs resident on it share."""
PROGRAM_RESERVED_BYTES = 1024
"""Shared memory the hardware reserves for each resident program on compute capability 9.0."""
BOX_BYTES = 16 * 256 * 2
"""One TMA box: 16 rows x 256 columns of bf16."""
MBARRIER_BYTES = 1024
"""Room for a ring's mbarriers and the allocator's alignment, rounded up."""


class StreamedKernelError(ValueError):
    """A streamed kernel's setting or call that cannot run, with what to change."""


class StreamedGemvError(StreamedKernelError):
    """A streamed-GEMV setting or call that cannot run, with what to change."""


def check_stream_config(stages: int, boxes: int, warps: int, registers: int, error: type[StreamedKernelError]) -> None:
    """Raises `error` for a ring, slot, warp or register count a streamed kernel cannot launch with."""
    if stages < 2:
        raise error(f"stages={stages}: the ring needs at least 2 slots")
    if boxes not in (1, 2, 4):
        raise error(f"boxes={boxes}: use 1, 2 or 4")
    if warps not in (4, 8):
        raise error(f"warps={warps}: use 4 or 8")
    if registers % 8 or not 40 <= registers <= 256:
        raise error(f"registers={registers}: a multiple of 8 from 40 to 256")


@dataclass(frozen=True)
class StreamedGemvConfig:
    stages: int = 8
    """Ring slots a program streams its weight rows through (fewer where the vector needs the room)."""
    boxes: int = 1
    """Boxes of 16 rows x 256 columns a slot: consecutive column chunks of the same rows."""
    warps: int = 4
    """Consumer warps a program (one loader warp more)."""
    registers: int = 64
    """Registers a thread at launch, so that other kernels' programs can share an SM with one of these."""

    def __post_init__(self) -> None:
        check_stream_config(self.stages, self.boxes, self.warps, self.registers, StreamedGemvError)


def vector_rows(*widths: int) -> int:
    """Rows of 256 a block of a staged vector moves in: the largest power of two up to 8 dividing every width's
    row count (8: one row a consumer warp, no warp holding another's copy)."""
    rows = 8
    while any((width // 256) % rows for width in widths):
        rows //= 2
    return rows


def gemv_vector_bytes(k: int) -> int:
    """Shared memory a program holds besides its ring: the input row (bf16) and the mbarriers."""
    return k * 2 + MBARRIER_BYTES


def gemv_stages_for(config: StreamedGemvConfig, k: int, room: int = SHARED_MEMORY_BYTES) -> int:
    """The config's ring depth, reduced until the ring and the row fit `room` bytes of shared memory."""
    return min(config.stages, (room - gemv_vector_bytes(k)) // (config.boxes * BOX_BYTES))


def gemv_shape_supported(config: StreamedGemvConfig, n: int, k: int, room: int = SHARED_MEMORY_BYTES) -> bool:
    """Whether the kernel takes a weight [n, k]: whole 16-row tiles, whole slots along k, and a ring of at least
    2 slots beside the row."""
    return (
        n > 0 and n % 16 == 0 and k >= 256 and k % (256 * config.boxes) == 0 and gemv_stages_for(config, k, room) >= 2
    )


def streamed_gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for x [T, K], weight [N, K], rounded to x.dtype from fp32 sums: the engine's skinny linear."""
    return skinny_linear_ref(x, weight)
