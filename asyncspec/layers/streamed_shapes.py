"""The weight shapes the streamed kernels' `auto` settings take (ASYNCSPEC_STREAMED_DOWN_PROJ and
ASYNCSPEC_STREAMED_MLP): the rule read off the GPUs' measurements, shared by both."""

from __future__ import annotations

import torch

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


def num_sms(device: torch.device) -> int:
    """The SM count of CUDA `device` (host-side, no sync)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)
