"""The pieces every streamed kernel shares (Gluon, Hopper): a ring of shared-memory slots that a loader warp fills
by TMA and consumer warps drain, the tile that multiplies a staged vector by a ring's slots, PTX without operands,
and a grid barrier whose flags need no reset.

A slot holds `D` boxes of [16, 256] bf16. The loader waits on a slot's `empty` mbarrier, copies into it and the
copy completes its `ready` mbarrier; the consumer waits on `ready`, reads the slot into registers and arrives on
`empty`. Loader and consumer walk the slots in the same order, so neither needs the other's position.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

SLOT_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
LOADER_REGISTERS = gl.constexpr(40)  # the loader warp holds loop counters and coordinates only


@gluon.jit
def _ring_next(s, ph, STAGES: gl.constexpr):
    """The slot after s, and the parity that slot's next fill completes."""
    s += 1
    if s == STAGES:
        s = 0
        ph ^= 1
    return s, ph


@gluon.jit
def _asm(x, op: gl.constexpr):
    """An instruction without operands, kept in place (x: any scalar, for the asm's one operand)."""
    return gl.inline_asm_elementwise(op + ";\n\tmov.u32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pdl_start(pid, USE_PDL: gl.constexpr):
    """pdl.pdl_start's contract: wait for the predecessor grid to complete, then let the successor launch (with
    USE_PDL == pdl.TRIGGER_FIRST, the other way round)."""
    if USE_PDL == 2:
        _asm(pid, "griddepcontrol.launch_dependents")
        _asm(pid, "griddepcontrol.wait")
    elif USE_PDL:
        _asm(pid, "griddepcontrol.wait")
        _asm(pid, "griddepcontrol.launch_dependents")


@gluon.jit
def _grid_barrier(flags_ptr, pid, NUM_PROGS: gl.constexpr, NP2: gl.constexpr, WARPS: gl.constexpr):
    """Each program moves its own flag one past the epoch all programs last reached (release), polls every flag
    in one load until none is behind, then fences (acquire): the polls are relaxed reads."""
    gl.thread_barrier()
    # One atomic both moves this program's flag on and tells every thread the epoch: a separate read of the flag
    # by each thread could land after the update in some warp and wait for an epoch no program will reach.
    epoch = gl.atomic_add(flags_ptr + pid, 1, sem="release", scope="gpu") + 1
    offs = gl.arange(0, NP2, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    live = offs < NUM_PROGS
    behind = gl.min(gl.load(flags_ptr + offs, mask=live, other=epoch, volatile=True) - epoch, axis=0)
    while behind < 0:
        behind = gl.min(gl.load(flags_ptr + offs, mask=live, other=epoch, volatile=True) - epoch, axis=0)
    _asm(behind, "fence.acq_rel.gpu")
    gl.thread_barrier()


@gluon.jit
def _tile(
    ring,
    ready,
    empty,
    v_smem,
    s,
    ph,
    NUM_CHUNKS: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
    VR: gl.constexpr,
    w_layout: gl.constexpr,
):
    """One 16-row tile: NUM_CHUNKS slots times the staged vector v_smem (NUM_CHUNKS * D rows of 256 in blocks of
    VR); the row sums."""
    acc = gl.zeros([16, 256], gl.float32, w_layout)
    for kc in gl.static_range(NUM_CHUNKS):
        mbarrier.wait(ready.index(s), ph)
        for d in gl.static_range(D):
            w = ring.index(s * D + d).load(w_layout).to(gl.float32)
            v = v_smem.index((kc * D + d) // VR).slice((kc * D + d) % VR, 1)
            acc += w * v.load(w_layout).to(gl.float32)
        # Every warp holds its rows of the slot before the loader may refill it.
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        s, ph = _ring_next(s, ph, STAGES)
    return gl.sum(acc, axis=1), s, ph


@gluon.jit
def _normalise_row(
    x_smem,
    x_ptr,
    res_ptr,
    nw_ptr,
    res_out_ptr,
    eps,
    pid,
    at,
    H: gl.constexpr,
    VR: gl.constexpr,
    HAS_RESIDUAL: gl.constexpr,
    w_layout: gl.constexpr,
    r_layout: gl.constexpr,
):
    """One row's residual add and RMSNorm into x_smem ([H / (256 VR), VR, 256] fp32), with fused_add_rms_norm's
    roundings: the sum, the normalised row, the weight's product. Every program normalises the whole row itself (no
    barrier); program 0 stores the sum, the new residual stream. Without a residual the sum is x itself, which the
    caller returns: nothing to store. `at` is a block's offsets [VR, 256] in w_layout."""
    sumsq = gl.sum(gl.zeros([16], gl.float32, r_layout), axis=0)
    for c in gl.static_range(H // (256 * VR)):
        off = c * 256 * VR
        if HAS_RESIDUAL:
            x = gl.load(x_ptr + off + at).to(gl.float32)
            summed = (x + gl.load(res_ptr + off + at).to(gl.float32)).to(gl.bfloat16)
            if pid == 0:
                gl.store(res_out_ptr + off + at, summed)
        else:
            summed = gl.load(x_ptr + off + at)
        h = summed.to(gl.float32)
        sumsq += gl.sum(gl.sum(h * h, axis=1), axis=0)
        x_smem.index(c).store(h)
    rstd = gl.rsqrt(sumsq / H + eps)
    gl.thread_barrier()
    for c in gl.static_range(H // (256 * VR)):
        h = x_smem.index(c).load(w_layout)
        nw = gl.load(nw_ptr + c * 256 * VR + at).to(gl.float32)
        x_smem.index(c).store(((h * rstd).to(gl.bfloat16).to(gl.float32) * nw).to(gl.bfloat16).to(gl.float32))
    gl.thread_barrier()


@gluon.jit
def _load_tiles(
    desc,
    ring,
    ready,
    empty,
    s,
    ph,
    num_t,
    K: gl.constexpr,
    NUM_PROGS: gl.constexpr,
    STAGES: gl.constexpr,
    D: gl.constexpr,
):
    """The loader's walk over this program's 16-row tiles of a weight [N, K] (box [16, 256]), D column boxes a slot,
    each slot filled as soon as it is free; returns the ring position after them."""
    pid = gl.program_id(0)
    for i in range(num_t):
        row = (pid + i * NUM_PROGS) * 16
        for kc in range(K // (256 * D)):
            mbarrier.wait(empty.index(s), ph ^ 1)
            mbarrier.expect(ready.index(s), D * 16 * 256 * 2)
            for d in gl.static_range(D):
                tma.async_copy_global_to_shared(desc, [row, (kc * D + d) * 256], ready.index(s), ring.index(s * D + d))
            s, ph = _ring_next(s, ph, STAGES)
    return s, ph
