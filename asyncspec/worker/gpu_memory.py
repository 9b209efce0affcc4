"""The KV pool's share of GPU memory: what `gpu_memory_utilization` allows this engine, less what it uses.

The fraction is of the card's total memory and is this engine's own, as in vLLM: memory that other processes
(another engine on the same card, say) already held when the engine started is not counted against it. It must
be free at start-up, though: an engine that cannot have its share fails at once, with the numbers.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from asyncspec.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class MemorySnapshot:
    """One device's memory at one moment, in bytes."""

    total: int
    """The card's memory."""
    free: int
    """Free on the card (every process counted)."""
    torch_reserved: int
    """Held by this process's torch caching allocator."""
    torch_allocated: int = 0
    """Of that, in live tensors (the rest is cached and reusable)."""

    @property
    def non_torch(self) -> int:
        """Used on the card but not through this process's allocator: other processes, this process's CUDA
        context, NCCL buffers."""
        return self.total - self.free - self.torch_reserved

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            total=total,
            free=free,
            torch_reserved=torch.cuda.memory_reserved(device),
            torch_allocated=torch.cuda.memory_allocated(device),
        )

    @property
    def available(self) -> int:
        """Free on the card, plus what this process's allocator caches without using."""
        return self.free + self.torch_reserved - self.torch_allocated


def snapshot_at_start(device: torch.device) -> MemorySnapshot:
    """The card before this engine loads anything, with Python's cyclic garbage (an engine the caller dropped in a
    reference cycle) and this process's allocator cache freed first. An engine dropped earlier in the process leaves
    its KV pool cached as a few segments of gigabytes each: this engine's weights would be carved out of one of them,
    which could then never be released, and a pool as large as the last one would no longer fit beside it."""
    gc.collect()
    torch.cuda.empty_cache()
    return MemorySnapshot.take(device)


def check_free_at_start(start: MemorySnapshot, utilization: float) -> None:
    """Raises ConfigError when the card has less free memory than this engine's share."""
    requested = int(start.total * utilization)
    if start.available < requested:
        raise ConfigError(
            f"gpu_memory_utilization={utilization} asks for {requested / GIB:.2f} GiB of the GPU's "
            f"{start.total / GIB:.2f} GiB, but only {start.available / GIB:.2f} GiB are free "
            f"({(start.total - start.available) / GIB:.2f} GiB are in use by other processes, CUDA contexts or "
            "this process's tensors); lower "
            "gpu_memory_utilization or free the GPU"
        )


def kv_cache_budget(
    start: MemorySnapshot, now: MemorySnapshot, utilization: float, peak_torch: int, reserved_after: int
) -> int:
    """Bytes left for the KV pool: this engine's share, less its peak torch memory beyond the tensors that were
    live at the start (weights and one forward at the full token budget), what it holds outside torch beyond
    the start (NCCL, graphs' private memory) and `reserved_after` (allocations made after the pool: graphs,
    penalty and draft tables). Negative when nothing is left."""
    own_peak = max(peak_torch - start.torch_allocated, 0)
    grown_outside_torch = max(now.non_torch - start.non_torch, 0)
    return int(start.total * utilization) - own_peak - grown_outside_torch - reserved_after
