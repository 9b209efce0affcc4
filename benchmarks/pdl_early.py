"""PDL starts that let the successor launch before their own wait (`graph_replay.py`'s `pdl_early_attention` and
`pdl_early_all` patches): the successor's programs can then start, and load what precedes their own wait, while this
kernel still waits for its predecessor. No number can change: every kernel still waits for its predecessor's
completion before it reads or writes anything a step writes."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from asyncspec.kernels.streamed_ring_gluon import _asm


@triton.jit
def pdl_start_early(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@gluon.jit
def gluon_pdl_start_early(pid, USE_PDL: gl.constexpr):
    if USE_PDL:
        _asm(pid, "griddepcontrol.launch_dependents")
        _asm(pid, "griddepcontrol.wait")
