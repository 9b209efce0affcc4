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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

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
    """pdl.pdl_start's contract: wait for the predecessor grid to complete, then let the successor launch."""
    if USE_PDL:
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
