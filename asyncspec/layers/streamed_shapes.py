"""The weight shapes the streamed kernels' `auto` settings take (ASYNCSPEC_STREAMED_DOWN_PROJ and
ASYNCSPEC_STREAMED_MLP: `one_tile_per_sm`; ASYNCSPEC_STREAMED_O_PROJ: `share_fits_ring`): the rules read off the
GPUs' measurements."""

from __future__ import annotations

from collections.abc import Callable

import torch

TILE_ROWS = 16
"""Rows of a weight tile the streamed kernels take (a TMA box's height)."""
BF16_BYTES = 2
MIN_STREAMED_TILE_COLUMNS = 4096
"""auto's least K: a 16-row tile of at least 128 KiB, so that the deep ring (208 KiB) has bytes to keep in flight."""


def one_tile_per_sm(shapes: set[tuple[int, int]], num_sms: int) -> bool:
    """Whether every weight [N, K] of `shapes` has between `num_sms` / 2 and `num_sms` 16-row tiles of at least
    `MIN_STREAMED_TILE_COLUMNS` columns: one program an SM then streams a tile's whole K, and most SMs read.
    Measured on three down projections (an H100, 2026-12-05): the 1B's [2048, 8192], 128 tiles, read at 0.965
    of the card streamed against `skinny_linear`'s 0.83, and the step ran 2.2-2.8 % faster (3.0-3.1 % on an
    H200); the 8B's [4096, 14336], 256 tiles, and the bundled target's [384, 1024], 24 tiles, made theirs slower
    (0.7 %, 5 %). The bounds between those shapes are not measured."""
    return bool(shapes) and all(
        num_sms <= 2 * -(-n // 16) <= 2 * num_sms and k >= MIN_STREAMED_TILE_COLUMNS for n, k in shapes
    )


def share_fits_ring(shapes: set[tuple[int, int]], num_sms: int, ring_bytes: Callable[[int], int]) -> bool:
    """Whether, for every weight [N, K] of `shapes`, the busiest of `num_sms` programs' 16-row tiles (tile i goes
    to program i mod `num_sms`) fit `ring_bytes(K)` bytes of ring: a program then holds all its weight in shared
    memory by the time its PDL wait returns, having loaded it while the kernels ahead (the attention) ran.
    Measured on two o projections (an H100, 2026-12-06, small graphs triggering their successors first): the 1B's
    [2048, 2048], one 64 KiB tile a program, made the step 0.5-1.2 % faster; the 8B's [4096, 4096], 256 KiB a program
    against a 64 KiB ring, 3.6 % slower. The shapes between are not measured."""
    return bool(shapes) and all(
        _ceil_div(_ceil_div(n, TILE_ROWS), num_sms) * TILE_ROWS * k * BF16_BYTES <= ring_bytes(k) for n, k in shapes
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """The SM count of CUDA `device` (host-side, no sync)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
