"""Experiment: a persistent MLP whose weights keep streaming through its grid barriers (Gluon, TMA, Hopper).

Session 22's persistent MLP (`persistent_mlp.py`, plain Triton) lost to the engine's chain of kernels by 8 %:
a grid barrier cost about as much as a kernel boundary under PDL (~1.9 us), because a program can only load
what its registers hold, so DRAM idles while it waits. Weights are constant through a step, so nothing stops a
program from loading the next phase's weights before it enters a barrier, if the loads land in shared memory
and do not need registers. This kernel does that with TMA: each program walks one ring of STAGES shared-memory
slots (16 rows x 256 columns of bf16 each) over its whole schedule (every layer's gate|up tiles, then its down
tiles), and the copy for chunk g + STAGES is issued as chunk g is consumed, whatever phase or layer it belongs
to. A barrier therefore stalls a program's arithmetic but not its copies, until the ring is full.

Same layers, reference and harness as `persistent_mlp.py` (batch 1, Llama-1B MLP shapes, 16 layers in one CUDA
graph, the chain of the engine's kernels rerun in the same process). gate|up rows are interleaved on the host
(8 gate rows, then their 8 up rows) so that one 16-row box holds a tile of both. Variants:
  full          barriers and work;
  no_barrier    the same copies and arithmetic without the barriers (its numbers are wrong): the ceiling of
                this schedule's streaming, so full - no_barrier is what the barriers still cost;
  barriers_only the barriers alone (no copies, no arithmetic).

  python3 benchmarks/gluon_mlp.py --output out.json              # on a Hopper GPU
  python3 benchmarks/gluon_mlp.py --compile-only                  # compiles every variant for sm_90 (no GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

REPO = Path(__file__).resolve().parents[1]
for path in (str(REPO), str(REPO / "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

BR = 16  # rows of a ring slot: a gate|up tile (8 activation columns) or a down tile
BK = 256  # columns of a ring slot (the widest TMA box)
SLOT_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@gluon.jit
def _flag_barrier(flags_ptr, pid, epoch, NUM_PROGS: gl.constexpr, NP2: gl.constexpr, WARPS: gl.constexpr):
    """Each program stores its epoch in its own flag (release), polls every flag in one load, then fences
    (acquire): the polls are relaxed reads (persistent_mlp.py's barrier, session 23's fenced form)."""
    gl.thread_barrier()
    gl.atomic_xchg(flags_ptr + pid, epoch, sem="release", scope="gpu")
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    offs = gl.arange(0, NP2, layout=layout)
    live = offs < NUM_PROGS
    seen = gl.min(gl.load(flags_ptr + offs, mask=live, other=epoch, volatile=True), axis=0)
    while seen < epoch:
        seen = gl.min(gl.load(flags_ptr + offs, mask=live, other=epoch, volatile=True), axis=0)
    gl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [seen], dtype=gl.int32, is_pure=False, pack=1
    )
    gl.thread_barrier()


@gluon.jit
def _issue(
    wgu_desc,
    wd_desc,
    ring,
    bars,
    g,
    total,
    per_layer,
    num_a,
    pid,
    STAGES: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    H: gl.constexpr,
    INTER: gl.constexpr,
):
    """Starts the copy of this program's chunk g (if g < total) into ring slot g % STAGES: the chunk's layer,
    phase (gate|up while j < num_a * H / BK, then down), tile and column from g alone."""
    CA: gl.constexpr = H // 256
    CB: gl.constexpr = INTER // 256
    live = g < total
    layer = g // per_layer
    j = g % per_layer
    is_a = j < num_a * CA
    ja = gl.minimum(j, num_a * CA - 1)
    jb = gl.maximum(j - num_a * CA, 0)
    row_a = layer * (2 * INTER) + 16 * (pid + (ja // CA) * NUM_PROGS)
    row_b = layer * H + 16 * (pid + (jb // CB) * NUM_PROGS)
    s = g % STAGES
    bar = bars.index(s)
    slot = ring.index(s)
    mbarrier.expect(bar, 16 * 256 * 2, pred=live)
    tma.async_copy_global_to_shared(wgu_desc, [row_a, (ja % CA) * 256], bar, slot, pred=live & is_a)
    tma.async_copy_global_to_shared(wd_desc, [row_b, (jb % CB) * 256], bar, slot, pred=live & (not is_a))


@gluon.jit
def _gluon_mlp_kernel(
    wgu_desc,  # [L * 2 I, H] bf16, gate|up rows interleaved by 8, box [16, 256]
    wd_desc,  # [L * H, I] bf16, box [16, 256]
    res_ptr,  # [H] bf16 residual stream, updated in place layer by layer
    xw_ptr,  # [H] fp32: norm weight * residual for the coming layer, written by the down phase
    sumsq_ptr,  # [L + 1] fp32: sum of squares of the residual entering each layer (entry 0 set before launch)
    nw_ptr,  # [L + 1, H] bf16 norm weights (row L: ones)
    gu_ptr,  # [2 I] fp32 scratch: the gate|up phase's rounded outputs, interleaved as the rows
    flags_ptr,  # [NUM_PROGS] int32 epochs, zeroed before launch
    eps,
    NUM_LAYERS: gl.constexpr,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    NP2: gl.constexpr,
    STAGES: gl.constexpr,
    BARRIERS: gl.constexpr,  # False: no barriers (timing only, wrong numbers)
    WORK: gl.constexpr,  # False: barriers alone
    WARPS: gl.constexpr,
):
    CA: gl.constexpr = H // 256
    CB: gl.constexpr = INTER // 256
    TA: gl.constexpr = INTER // 8  # gate|up tiles of 16 interleaved rows
    TB: gl.constexpr = H // 16  # down tiles of 16 rows
    pid = gl.program_id(0)
    num_a = (TA - pid + NUM_PROGS - 1) // NUM_PROGS
    num_b = gl.maximum((TB - pid + NUM_PROGS - 1) // NUM_PROGS, 0)
    per_layer = num_a * CA + num_b * CB
    total = per_layer * NUM_LAYERS
    if not WORK:
        total = 0

    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, w_layout)
    vec_layout: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 16, 256], SLOT_LAYOUT)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x_smem = gl.allocate_shared_memory(gl.float32, [H], flat)
    a_smem = gl.allocate_shared_memory(gl.float32, [INTER], flat)
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()
    for st in gl.static_range(STAGES):
        _issue(wgu_desc, wd_desc, ring, bars, st, total, per_layer, num_a, pid, STAGES, NUM_PROGS, H, INTER)

    offs_r = gl.arange(0, 16, layout=row_layout)
    xa_cols = gl.arange(0, H, layout=vec_layout)
    xb_cols = gl.arange(0, INTER, layout=vec_layout)
    g = pid * 0  # the next chunk this program consumes
    for layer in range(NUM_LAYERS):
        # gate|up: the normalised x is rstd * (norm weight * residual); rstd multiplies the sums.
        if WORK:
            rstd = gl.rsqrt(gl.load(sumsq_ptr + layer, volatile=True) / H + eps)
            x_smem.store(gl.load(xw_ptr + xa_cols, cache_modifier=".cg"))
            gl.thread_barrier()
            for i in range(num_a):
                tile = pid + i * NUM_PROGS
                acc = gl.zeros([16, 256], gl.float32, w_layout)
                for kc in gl.static_range(CA):
                    s = g % STAGES
                    mbarrier.wait(bars.index(s), (g // STAGES) & 1)
                    w = ring.index(s).load(w_layout).to(gl.float32)
                    x = x_smem.slice(kc * 256, 256).load(col_layout)
                    acc += w * x[None, :]
                    # Every warp has read slot s before its next copy is issued into it.
                    fence_async_shared()
                    gl.thread_barrier()
                    _issue(
                        wgu_desc,
                        wd_desc,
                        ring,
                        bars,
                        g + STAGES,
                        total,
                        per_layer,
                        num_a,
                        pid,
                        STAGES,
                        NUM_PROGS,
                        H,
                        INTER,
                    )
                    g += 1
                out = (gl.sum(acc, axis=1) * rstd).to(gl.bfloat16).to(gl.float32)
                gl.store(gu_ptr + 16 * tile + offs_r, out)
        if BARRIERS:
            _flag_barrier(flags_ptr, pid, 2 * layer + 1, NUM_PROGS, NP2, WARPS)
        # down, the residual add, and the next layer's norm inputs.
        if WORK:
            gate_at = 16 * (xb_cols // 8) + xb_cols % 8  # the activation columns' gate rows
            gate = gl.load(gu_ptr + gate_at, cache_modifier=".cg")
            up = gl.load(gu_ptr + gate_at + 8, cache_modifier=".cg")
            silu = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
            a_smem.store((silu * up).to(gl.bfloat16).to(gl.float32))
            gl.thread_barrier()
            sumsq = gl.sum(gl.zeros([16], gl.float32, row_layout), axis=0)
            for i in range(num_b):
                tile = pid + i * NUM_PROGS
                acc = gl.zeros([16, 256], gl.float32, w_layout)
                for kc in gl.static_range(CB):
                    s = g % STAGES
                    mbarrier.wait(bars.index(s), (g // STAGES) & 1)
                    w = ring.index(s).load(w_layout).to(gl.float32)
                    a = a_smem.slice(kc * 256, 256).load(col_layout)
                    acc += w * a[None, :]
                    fence_async_shared()
                    gl.thread_barrier()
                    _issue(
                        wgu_desc,
                        wd_desc,
                        ring,
                        bars,
                        g + STAGES,
                        total,
                        per_layer,
                        num_a,
                        pid,
                        STAGES,
                        NUM_PROGS,
                        H,
                        INTER,
                    )
                    g += 1
                out = gl.sum(acc, axis=1).to(gl.bfloat16).to(gl.float32)
                rows = 16 * tile + offs_r
                summed = (out + gl.load(res_ptr + rows).to(gl.float32)).to(gl.bfloat16)
                gl.store(res_ptr + rows, summed)
                sf = summed.to(gl.float32)
                sumsq += gl.sum(sf * sf, axis=0)
                gl.store(xw_ptr + rows, gl.load(nw_ptr + (layer + 1) * H + rows).to(gl.float32) * sf)
            gl.atomic_add(sumsq_ptr + layer + 1, sumsq, sem="relaxed", scope="gpu")
        if BARRIERS:
            _flag_barrier(flags_ptr, pid, 2 * layer + 2, NUM_PROGS, NP2, WARPS)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))


@gluon.jit
def _ring_next(s, ph, STAGES: gl.constexpr):
    """The ring slot after s, and the mbarrier parity that slot's next fill completes."""
    s += 1
    if s == STAGES:
        s = 0
        ph ^= 1
    return s, ph


@gluon.jit
def _ws_loader(
    wgu_desc,
    wd_desc,
    ring,
    ready,
    empty,
    num_a,
    num_b,
    NUM_LAYERS: gl.constexpr,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
):
    """One warp: copies this program's whole schedule, slot by slot, as the consumer frees slots. It never
    waits on a grid barrier, so the next phase's first STAGES slots land while the consumer waits on one."""
    CA: gl.constexpr = H // (256 * D)
    CB: gl.constexpr = INTER // (256 * D)
    pid = gl.program_id(0)
    s = pid * 0
    ph = pid * 0
    for layer in range(NUM_LAYERS):
        for i in range(num_a):
            row = layer * (2 * INTER) + (pid + i * NUM_PROGS) * 16
            for kc in range(CA):
                mbarrier.wait(empty.index(s), ph ^ 1)
                mbarrier.expect(ready.index(s), D * 16 * 256 * 2)
                for d in gl.static_range(D):
                    tma.async_copy_global_to_shared(
                        wgu_desc, [row, (kc * D + d) * 256], ready.index(s), ring.index(s * D + d)
                    )
                s, ph = _ring_next(s, ph, STAGES)
        for i in range(num_b):
            row = layer * H + (pid + i * NUM_PROGS) * 16
            for kc in range(CB):
                mbarrier.wait(empty.index(s), ph ^ 1)
                mbarrier.expect(ready.index(s), D * 16 * 256 * 2)
                for d in gl.static_range(D):
                    tma.async_copy_global_to_shared(
                        wd_desc, [row, (kc * D + d) * 256], ready.index(s), ring.index(s * D + d)
                    )
                s, ph = _ring_next(s, ph, STAGES)


@gluon.jit
def _ws_tile(
    ring,
    ready,
    empty,
    v_smem,
    s,
    ph,
    NUM_CHUNKS: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
    w_layout: gl.constexpr,
):
    """One 16-row tile: NUM_CHUNKS slots of D boxes each, multiplied by the staged vector v_smem
    [NUM_CHUNKS * D, 256]; returns the row sums and the ring position after the tile."""
    acc = gl.zeros([16, 256], gl.float32, w_layout)
    for kc in gl.static_range(NUM_CHUNKS):
        mbarrier.wait(ready.index(s), ph)
        for d in gl.static_range(D):
            w = ring.index(s * D + d).load(w_layout).to(gl.float32)
            v = v_smem.slice(kc * D + d, 1).load(w_layout).to(gl.float32)
            acc += w * v
        # Every warp has its rows of the slot in registers before the loader may refill it.
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        s, ph = _ring_next(s, ph, STAGES)
    return gl.sum(acc, axis=1), s, ph


@gluon.jit
def _ws_consumer(
    ring,
    ready,
    empty,
    x_smem,
    a_smem,
    res_ptr,
    xw_ptr,
    sumsq_ptr,
    nw_ptr,
    gu_ptr,
    act_ptr,
    flags_ptr,
    eps,
    num_a,
    num_b,
    NUM_LAYERS: gl.constexpr,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    NP2: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
    BARRIERS: gl.constexpr,
    WARPS: gl.constexpr,
):
    """The default partition: waits for a slot, multiplies it into the accumulators, frees it; the grid
    barriers, the activation and the residual add happen here."""
    pid = gl.program_id(0)
    # Each warp owns whole rows of a box; each thread 8 columns of them (one 16-byte shared load).
    w_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    r_layout: gl.constexpr = gl.SliceLayout(1, w_layout)
    offs_r = gl.arange(0, 16, layout=r_layout)
    v_rows = gl.arange(0, INTER // 256, layout=r_layout)
    v_cols = gl.arange(0, 256, layout=gl.SliceLayout(0, w_layout))
    x_rows = gl.arange(0, H // 256, layout=r_layout)
    x_at = x_rows[:, None] * 256 + v_cols[None, :]
    a_at = v_rows[:, None] * 256 + v_cols[None, :]
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    act_cols = gl.arange(0, 8, layout=vec_layout)  # a gate|up tile's 8 activation columns
    s = pid * 0
    ph = pid * 0
    for layer in range(NUM_LAYERS):
        rstd = gl.rsqrt(gl.load(sumsq_ptr + layer, volatile=True) / H + eps)
        x_smem.store(gl.load(xw_ptr + x_at, cache_modifier=".cg"))
        gl.thread_barrier()
        for i in range(num_a):
            tile = pid + i * NUM_PROGS
            out, s, ph = _ws_tile(ring, ready, empty, x_smem, s, ph, H // (256 * D), STAGES, D, w_layout)
            gl.store(gu_ptr + tile * 16 + offs_r, (out * rstd).to(gl.bfloat16).to(gl.float32))
        # This program's activations (8 a tile) from its own gate|up rows, rounded as the chain's.
        gl.thread_barrier()
        for i in range(num_a):
            tile = pid + i * NUM_PROGS
            gate = gl.load(gu_ptr + tile * 16 + act_cols)
            up = gl.load(gu_ptr + tile * 16 + 8 + act_cols)
            silu = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
            gl.store(act_ptr + tile * 8 + act_cols, (silu * up).to(gl.bfloat16))
        if BARRIERS:
            _flag_barrier(flags_ptr, pid, 2 * layer + 1, NUM_PROGS, NP2, WARPS)
        a_smem.store(gl.load(act_ptr + a_at, cache_modifier=".cg"))
        gl.thread_barrier()
        sumsq = gl.sum(gl.zeros([16], gl.float32, r_layout), axis=0)
        for i in range(num_b):
            tile = pid + i * NUM_PROGS
            out, s, ph = _ws_tile(ring, ready, empty, a_smem, s, ph, INTER // (256 * D), STAGES, D, w_layout)
            rows = 16 * tile + offs_r
            summed = (out.to(gl.bfloat16).to(gl.float32) + gl.load(res_ptr + rows).to(gl.float32)).to(gl.bfloat16)
            gl.store(res_ptr + rows, summed)
            sf = summed.to(gl.float32)
            sumsq += gl.sum(sf * sf, axis=0)
            gl.store(xw_ptr + rows, gl.load(nw_ptr + (layer + 1) * H + rows).to(gl.float32) * sf)
        gl.atomic_add(sumsq_ptr + layer + 1, sumsq, sem="relaxed", scope="gpu")
        if BARRIERS:
            _flag_barrier(flags_ptr, pid, 2 * layer + 2, NUM_PROGS, NP2, WARPS)


@gluon.jit
def _ws_mlp_kernel(
    wgu_desc,  # [L * 2 I, H] bf16, gate|up rows interleaved by 8, box [16, 256]
    wd_desc,  # [L * H, I] bf16, box [16, 256]
    res_ptr,  # [H] bf16 residual stream, updated in place layer by layer
    xw_ptr,  # [H] fp32: norm weight * residual for the coming layer, written by the down phase
    sumsq_ptr,  # [L + 1] fp32: sum of squares of the residual entering each layer (entry 0 set before launch)
    nw_ptr,  # [L + 1, H] bf16 norm weights (row L: ones)
    gu_ptr,  # [2 I] fp32 scratch: the gate|up phase's rounded outputs, interleaved as the rows
    act_ptr,  # [I] bf16: the activations, written by the gate|up phase
    flags_ptr,  # [NUM_PROGS] int32 epochs, zeroed before launch
    eps,
    NUM_LAYERS: gl.constexpr,
    H: gl.constexpr,
    INTER: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    NP2: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,  # boxes a slot: D column chunks of 256 of the same 16 rows
    BARRIERS: gl.constexpr,  # False: no barriers (timing only, wrong numbers)
    WARPS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    """Warp-specialised: a loader warp streams every slot by TMA, the default warps compute."""
    TA: gl.constexpr = (2 * INTER) // 16
    TB: gl.constexpr = H // 16
    pid = gl.program_id(0)
    num_a = (TA - pid + NUM_PROGS - 1) // NUM_PROGS
    num_b = gl.maximum((TB - pid + NUM_PROGS - 1) // NUM_PROGS, 0)
    flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES * D, 16, 256], SLOT_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # The vectors, as rows of 256.
    x_smem = gl.allocate_shared_memory(gl.float32, [H // 256, 256], flat2)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [INTER // 256, 256], flat2)
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (
                _ws_consumer,
                (
                    ring,
                    ready,
                    empty,
                    x_smem,
                    a_smem,
                    res_ptr,
                    xw_ptr,
                    sumsq_ptr,
                    nw_ptr,
                    gu_ptr,
                    act_ptr,
                    flags_ptr,
                    eps,
                    num_a,
                    num_b,
                    NUM_LAYERS,
                    H,
                    INTER,
                    NUM_PROGS,
                    NP2,
                    STAGES,
                    D,
                    BARRIERS,
                    WARPS,
                ),
            ),
            (
                _ws_loader,
                (wgu_desc, wd_desc, ring, ready, empty, num_a, num_b, NUM_LAYERS, H, INTER, NUM_PROGS, STAGES, D),
            ),
        ],
        [1],
        [LOADER_REGS],
    )


def _compile_only(ptx_dir: str = "") -> None:
    """Compiles every variant for sm_90 without a GPU (ptxas ships with Triton); `ptx_dir` keeps their PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    desc = f"tensordesc<bf16[16,256],{SLOT_LAYOUT!r}>"
    base = {
        "wgu_desc": desc,
        "wd_desc": desc,
        "res_ptr": "*bf16",
        "xw_ptr": "*fp32",
        "sumsq_ptr": "*fp32",
        "nw_ptr": "*bf16",
        "gu_ptr": "*fp32",
    }
    shapes = {"NUM_LAYERS": 16, "H": 2048, "INTER": 8192, "NUM_PROGS": 132, "NP2": 256}
    for variant, stages, warps, d in VARIANTS:
        name = f"{variant} s{stages} w{warps} d{d}"
        if variant.startswith("ws"):
            fn = _ws_mlp_kernel
            signature = {**base, "act_ptr": "*bf16", "flags_ptr": "*i32", "eps": "fp32"}
            constexprs = {
                **shapes,
                "STAGES": stages,
                "D": d,
                "BARRIERS": variant != "ws_no_barrier",
                "WARPS": warps,
                "LOADER_REGS": LOADER_REGS,
            }
        else:
            fn = _gluon_mlp_kernel
            signature = {**base, "flags_ptr": "*i32", "eps": "fp32"}
            constexprs = {
                **shapes,
                "STAGES": stages,
                "BARRIERS": variant != "no_barrier",
                "WORK": variant != "barriers_only",
                "WARPS": warps,
            }
        src = GluonASTSource(fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        print(f"{name}: shared {kernel.metadata.shared} B")
        if ptx_dir:
            Path(ptx_dir).mkdir(parents=True, exist_ok=True)
            Path(ptx_dir, name.replace(" ", "_") + ".ptx").write_text(kernel.asm["ptx"])


class GluonMLP:
    """The kernel's buffers, descriptors and launch for one stack of MLP layers (batch 1). `variant` is one of
    VARIANTS' names: `full`, `no_barrier`, `barriers_only` (the inline kernel) or `ws`, `ws_no_barrier`."""

    def __init__(self, nw, wgu, wd, eps: float, *, variant: str, stages: int, warps: int, d: int = 1):
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        self.num_layers, self.hidden, self.inter = wd.shape
        L, H, inter = self.num_layers, self.hidden, self.inter
        if H % 256 or inter % (256 * d) or (2 * inter) % (16 * d):
            raise ValueError(f"H={H} and I={inter} must be multiples of 256 (I of 256 * D, D={d})")
        self.ws = variant.startswith("ws")
        if not self.ws and d != 1:
            raise ValueError("the inline kernel takes one box a slot")
        # 8 gate rows, then the same 8 columns' up rows: one 16-row box holds a tile of both.
        self.wgu_il = wgu.view(L, 2, inter // 8, 8, H).permute(0, 2, 1, 3, 4).reshape(L * 2 * inter, H).contiguous()
        self.wd2 = wd.reshape(L * H, inter)
        self.wgu_desc = TensorDescriptor.from_tensor(self.wgu_il, [BR, BK], SLOT_LAYOUT)
        self.wd_desc = TensorDescriptor.from_tensor(self.wd2, [BR, BK], SLOT_LAYOUT)
        self.nw = torch.cat([nw, torch.ones_like(nw[:1])])
        dev = wd.device
        self.eps = eps
        self.num_progs = torch.cuda.get_device_properties(dev).multi_processor_count
        self.xw = torch.empty(H, dtype=torch.float32, device=dev)
        self.sumsq = torch.zeros(L + 1, dtype=torch.float32, device=dev)
        self.gu = torch.empty(2 * inter, dtype=torch.float32, device=dev)
        self.act = torch.empty(inter, dtype=torch.bfloat16, device=dev)
        self.flags = torch.zeros(self.num_progs, dtype=torch.int32, device=dev)
        self.meta = dict(
            NUM_LAYERS=L,
            H=H,
            INTER=inter,
            NUM_PROGS=self.num_progs,
            NP2=triton.next_power_of_2(self.num_progs),
            STAGES=stages,
            WARPS=warps,
            num_warps=warps,
        )
        if self.ws:
            self.meta.update(D=d, BARRIERS=variant != "ws_no_barrier", LOADER_REGS=LOADER_REGS)
        else:
            self.meta.update(BARRIERS=variant != "no_barrier", WORK=variant != "barriers_only")

    def __call__(self, residual: torch.Tensor) -> torch.Tensor:
        """Runs every layer on `residual` [H] bf16 in place (graph-capturable: the zeroing is captured too)."""
        self.sumsq.zero_()
        self.flags.zero_()
        s = residual.float()
        torch.mul(self.nw[0].float(), s, out=self.xw)
        self.sumsq[0:1].copy_((s * s).sum().reshape(1))
        common = (self.wgu_desc, self.wd_desc, residual, self.xw, self.sumsq, self.nw, self.gu)
        if self.ws:
            _ws_mlp_kernel[(self.num_progs,)](*common, self.act, self.flags, self.eps, **self.meta)
        else:
            _gluon_mlp_kernel[(self.num_progs,)](*common, self.flags, self.eps, **self.meta)
        return residual


LOADER_REGS = 40  # the loader warp's registers (setmaxnreg): it holds loop counters and coordinates only
# (variant, stages, consumer warps, boxes a slot)
VARIANTS = [
    ("full", 12, 8, 1),
    ("ws", 12, 4, 1),
    ("ws", 16, 4, 1),
    ("ws", 12, 8, 1),
    ("ws", 16, 8, 1),
    ("ws", 8, 8, 2),
    ("ws", 12, 8, 2),
    ("ws_no_barrier", 16, 8, 1),
    ("barriers_only", 12, 4, 1),
]


def _wait_or_exit(name: str, limit_s: float) -> None:
    """Waits for the stream; a kernel still running after limit_s is taken for a deadlock (a grid barrier
    that not every program reached), and the process exits so that the driver kills the kernel."""
    done = torch.cuda.Event()
    done.record()
    t0 = time.perf_counter()
    while not done.query():
        if time.perf_counter() - t0 > limit_s:
            print(f"{name}: still running after {limit_s} s, taken for a deadlock; exiting", flush=True)
            os._exit(3)
        time.sleep(0.01)


def run_gpu(args) -> dict:
    from persistent_mlp import PersistentMLP, chain_mlp, close, graph_ms, make_layers, reference_mlp
    from skinny_linear import reference_bandwidths

    from asyncspec.kernels.skinny_linear_triton import make_split_counters

    layers, hidden, inter = args.layers, 2048, 8192
    residual, nw, wgu, wd = make_layers(layers, hidden, inter, "cuda")
    eps = 1e-5
    ref = reference_mlp(residual, nw, wgu, wd, eps)
    ref_unrounded = reference_mlp(residual, nw, wgu, wd, eps, round_normed=False)
    counters = make_split_counters("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "sms": sms,
        "layers": layers,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "read_GBps": reference_bandwidths()["read_GBps"],
    }
    result["floor_us_per_layer"] = 3 * hidden * inter * 2 / result["read_GBps"] / 1e3
    work = residual.clone()
    result["chain_check"] = close(chain_mlp(work, nw, wgu, wd, eps, counters), ref)
    limit = max(2 * result["chain_check"]["rel_l2_err"], 5e-3)
    triton_best = PersistentMLP(
        nw, wgu, wd, eps, num_progs=2 * sms, bp=8, bk1=2048, bn2=8, bk2=2048, num_warps=8, flags=True
    )
    rows = []
    for rnd in range(args.rounds):
        ms = graph_ms(lambda: chain_mlp(work, nw, wgu, wd, eps, counters))
        rows.append({"variant": "chain", "round": rnd, "us_per_layer": ms * 1e3 / layers})
        ms = graph_ms(lambda: triton_best(work))
        rows.append(
            {"variant": "triton persistent flags 2/SM 8x2048 w8", "round": rnd, "us_per_layer": ms * 1e3 / layers}
        )
        for variant, stages, warps, d in VARIANTS:
            name = f"gluon {variant} s{stages} w{warps} d{d}"
            if args.only and name.removeprefix("gluon ").replace(" ", "_") not in args.only.split(","):
                continue
            row: dict = {"variant": name, "round": rnd}
            try:
                mlp = GluonMLP(nw, wgu, wd, eps, variant=variant, stages=stages, warps=warps, d=d)
                if rnd == 0:
                    t0 = time.perf_counter()
                    got = mlp(residual.clone())
                    _wait_or_exit(name, args.hang_s)
                    row["first_call_s"] = time.perf_counter() - t0
                    if variant in ("full", "ws"):
                        row["check"] = close(got, ref_unrounded)
                        row["wrong"] = row["check"]["rel_l2_err"] > limit
                        row["arrivals"] = int(mlp.flags.min().item())
                ms = graph_ms(lambda mlp=mlp: mlp(work))
            except Exception as exc:  # a variant that fails costs its row, not the call
                row["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{name}: failed, {row['failed']}")
                rows.append(row)
                continue
            row["us_per_layer"] = ms * 1e3 / layers
            rows.append(row)
    result["rows"] = rows
    print(
        f"{result['device']}, read {result['read_GBps']:.0f} GB/s, floor {result['floor_us_per_layer']:.2f} us/layer,"
        f" chain check {result['chain_check']}"
    )
    for row in rows:
        if "failed" in row:
            continue
        extra = (
            f" {'WRONG ' if row.get('wrong') else ''}check {row['check']} arrivals {row['arrivals']}"
            if "check" in row
            else ""
        )
        print(
            f"{row['variant']:<44} r{row['round']} {row['us_per_layer']:7.2f} us/layer "
            f"({row['us_per_layer'] / result['floor_us_per_layer']:.2f}x floor){extra}"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--ptx-dir", default="", help="with --compile-only: write each variant's PTX here")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default="")
    parser.add_argument("--hang-s", type=float, default=20.0, help="a first call longer than this is a deadlock")
    parser.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    args = parser.parse_args()
    if args.compile_only:
        _compile_only(args.ptx_dir)
        return
    result = run_gpu(args)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
