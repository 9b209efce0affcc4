"""Programmatic dependent launch (PDL) for the decode path's Triton kernels.

A batch-1 decode step is a chain of ~10 small kernels per layer, each a few microseconds; between two of
them the GPU drains the first grid, then launches and ramps up the second. On compute capability 9.0+ a
kernel launched with PDL may be scheduled while its predecessor is still running: its programs start,
wait in `griddepcontrol.wait` until the predecessor has completed and flushed its memory, and then run,
so the launch and ramp-up overlap the predecessor's tail. CUDA-graph capture keeps the launches as
programmatic edges.

The contract that keeps it correct: every kernel launched with PDL calls `pdl_start(USE_PDL)` before it
reads or writes anything a predecessor may touch, so nothing it does overlaps another kernel's writes; the
wait is transitive, since a predecessor only completes after its own wait, and every program waits before it
returns. Only what no kernel of a step writes, the weights, is read before the wait (the skinny linear kernel's
first chunks of W, the norm's weight, the streamed kernels' rings): those loads then overlap the predecessor.

Where a program lets its successor launch is a choice (`pdl_mode`). By default it waits first (`pdl_start` does
both, in that order), so when a kernel's programs run, every kernel two or more launches back has completed. The
decode graphs' small launches (at most ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS rows, default 8) trigger first: their
successor's programs start as soon as all of theirs have, and stream weights while the chain ahead still runs;
that holds nothing up, since a grid launches only once its predecessor's programs are all resident. Kernels
without PDL (torch's, cuBLAS's) keep ordinary stream order on both sides and so end any such run-ahead: a model's
forward pass begins with one (the token embedding's gather), so everything written before the pass is complete
before any of its kernels starts, whichever way their launches trigger. The attention's opt-in `early_kv` reads
step inputs and keys of earlier passes before its wait on that promise.
`ASYNCSPEC_PDL=0` turns PDL off (an A/B, or a driver that mishandles it); the interpreter never uses it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "ASYNCSPEC_PDL"
EARLY_TRIGGER_ROWS_ENV = "ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS"
DEFAULT_EARLY_TRIGGER_ROWS = 8
WAIT_FIRST = 1
TRIGGER_FIRST = 2


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability 9.0+, not the interpreter,
    and ASYNCSPEC_PDL not set to 0 (read at each launch, so it can be switched per engine)."""
    if device.type != "cuda" or triton.knobs.runtime.interpret or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_options(enabled: bool | int) -> dict[str, bool]:
    """Launch keyword arguments of a kernel call (empty without PDL, which the interpreter needs); `enabled` may
    be a `pdl_mode`."""
    return {"launch_pdl": True} if enabled else {}


def early_trigger_rows() -> int:
    """ASYNCSPEC_PDL_EARLY_TRIGGER_ROWS (read at each captured launch): captured launches of at most this many
    rows let their successor launch before their own wait; 0 never does."""
    raw = os.environ.get(EARLY_TRIGGER_ROWS_ENV, str(DEFAULT_EARLY_TRIGGER_ROWS)).strip()
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{EARLY_TRIGGER_ROWS_ENV} must be a row count >= 0 (0: never), got {raw!r}")
    return int(raw)


def pdl_mode(device: torch.device, rows: int) -> int:
    """USE_PDL for a launch of `rows` rows (tokens): 0 without PDL; TRIGGER_FIRST for a launch captured into a
    CUDA graph with at most `early_trigger_rows()` rows, so that its successor's programs start (and load their
    weights) while this kernel still waits; WAIT_FIRST otherwise. On an H100 (2026-12-06) trigger-first took the
    Llama-1B's batch-1 step from 1.055 to 0.995 ms (its forward at 2 / 4 / 8 rows 2.9 / 0 / 1.9 % faster; the 8B's
    step 5.316 to 5.282 ms, 0.5-0.9 % at 2 to 8 rows), but made 16, 24 and 32 rows 8 %, 3 % and 1.5 % slower,
    hence the limit. Eager launches keep WAIT_FIRST, so that no variant compiles mid-run for them: the
    trigger-first variants compile during the graphs' capture at start-up."""
    if not pdl_enabled(device):
        return 0
    if not torch.cuda.is_current_stream_capturing():
        return WAIT_FIRST
    return TRIGGER_FIRST if rows <= early_trigger_rows() else WAIT_FIRST


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Waits for the predecessor grid to complete (its writes visible), then lets the successor launch:
    its programs may then be scheduled as this grid's programs finish, and wait in turn. With USE_PDL ==
    TRIGGER_FIRST (2) the successor may launch first: its programs start once all of this grid's have, and run
    up to their own wait."""
    if USE_PDL == 2:  # TRIGGER_FIRST (a jit function reads no plain module constant)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
