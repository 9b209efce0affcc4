"""The engine's start-up objects and Python's cyclic garbage collector.

A full collection scans every object the collector tracks: after start-up that is hundreds of thousands (torch, the
models, the engine's tables), and the pass takes tens of milliseconds (150 ms with the bundled pair on the
development machine's CPU), inside whatever step it lands in. On an H100 (2026-12-07) a 13.9 ms collection made one
closed batch of 32 of the bundled pair take 46.9 ms instead of 34 (`benchmarks/plan_trace.py` records the collector's
pauses). Freezing the start-up objects (as vLLM's engine core does) leaves a full pass only the objects made since,
which the steps' own garbage keeps few: with it no pause was longer than 0.23 ms there.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collects what start-up left behind, then moves every object alive out of the collector's scans
    (gc.freeze): they are still freed when their reference count drops to zero, but a reference cycle among them
    only after `release_frozen_objects`."""
    gc.collect()
    gc.freeze()


def release_frozen_objects(collect: bool = False) -> None:
    """Gives every frozen object back to the collector (gc.unfreeze): a shut-down or dropped engine's reference
    cycles can then be freed, its device memory with them. `collect`: and free them now, where any were frozen."""
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    if collect and was_frozen:
        gc.collect()
