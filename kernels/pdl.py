"""Programmatic dependent launch (PDL) for the decode path's Triton kernels.

A batch-1 decode step is a chain of ~10 small kernels per layer, each a few microseconds; between two of
them the GPU drains the first grid, then launches and ramps up the second. On compute capability 9.0+ a
kernel launched with PDL may be scheduled while its predecessor is still running: its programs start,
wait in `griddepcontrol.wait` until the predecessor has completed and flushed its memory, and then run,
so the launch and ramp-up overlap the predecessor's tail. CUDA-graph capture keeps the launches as
programmatic edges.

The contract that keeps it correct: every kernel launched with PDL calls `pdl_start(USE_PDL)` before it
reads or writes anything a predecessor may touch, so nothing it does overlaps another kernel's writes; the
wait is transitive, since a predecessor only completes after its own wait. Every program waits before it lets
its successor launch (`pdl_start` does both, in that order) and before it returns: so when a kernel's programs
run, every kernel two or more launches back has completed. Only what no kernel of a step writes, the weights, is
read before the wait (the skinny linear kernel's first chunks of W, the norm's weight): those loads then overlap
the predecessor's tail. The one exception, opt-in, is the attention's `early_kv`: step inputs and keys of earlier
steps, which only kernels two or more launches back write, read through L2. Kernels without PDL (torch's,
cuBLAS's) keep ordinary stream order on both sides.
`ASYNCSPEC_PDL=0` turns it off (an A/B, or a driver that mishandles it); the interpreter never uses it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

PDL_ENV = "ASYNCSPEC_PDL"


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA, compute capability 9.0+, not the interpreter,
    and ASYNCSPEC_PDL not set to 0 (read at each launch, so it can be switched per engine)."""
    if device.type != "cuda" or triton.knobs.runtime.interpret or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch_options(enabled: bool) -> dict[str, bool]:
    """Launch keyword arguments of a kernel call (empty without PDL, which the interpreter needs)."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Waits for the predecessor grid to complete (its writes visible), then lets the successor launch:
    its programs may then be scheduled as this grid's programs finish, and wait in turn."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
