"""A one-shot all-reduce for the small messages of decode steps, pushed over NVLink with no barrier.

NCCL's all-reduce of a batch-1 decode message (8 KiB) costs about 8 us inside a CUDA graph and is not
launched with PDL, so the GPU also idles before each one; a tensor-parallel decode step makes two per layer.
Here every rank stores its part straight into each peer's receive buffer (symmetric memory, mapped into this
process) and polls its own buffer until every peer's part has landed: one NVLink write and a local read, no
flag exchange. Each element is its own arrival flag: receive buffers hold a sentinel bit pattern (negative
zero) that no sent element has, since a sender turns -0.0 into +0.0, which the sum does not see.

Receive buffers rotate over three slots, per program: the slot of a program's call c is read in call c, set
back to the sentinel by the same program in call c + 1, and written by peers again in call c + 3 at the
earliest, because a peer never runs more than one call ahead (it cannot finish a call without this rank's
part, sent only after this rank's previous call completed). Every rank runs the same sequence of calls (the
contract of any collective), so each program's call count is the same on every rank. Every rank sums the
parts in rank order in fp32, so all ranks get the same bits.

Layout of a rank's receive buffer (int16 view of the 16-bit dtype): [3 slots][world sources][max_numel].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncspec.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
from asyncspec.kernels.triton_rounding import round_to_dtype

BLOCK = 1024
"""Elements per program: 16 bytes per thread at 4 warps; a program always covers the same elements."""
NUM_SLOTS = 3
SENTINEL = -32768
"""Bit pattern of -0.0 in bf16 and fp16, seen as int16."""
_SENTINEL = tl.constexpr(SENTINEL)
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["numel"])
def _push_all_reduce_kernel(
    x_ptr,
    out_ptr,
    buffer_ptrs,
    counts_ptr,
    numel,
    MAX_NUMEL: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    pdl_start(USE_PDL)
    count = tl.load(counts_ptr + pid)
    slot = count % 3
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    # -0.0 is the sentinel: send +0.0 instead (the same in any sum).
    part = tl.where(x == 0, tl.zeros_like(x), x)
    bits = part.to(tl.int16, bitcast=True)
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer = tl.load(buffer_ptrs + p).to(tl.pointer_type(tl.int16))
            tl.store(peer + (slot * WORLD + RANK) * MAX_NUMEL + offs, bits, mask=mask)
    own = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(tl.int16))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            acc += part.to(tl.float32)
        else:
            src = own + (slot * WORLD + p) * MAX_NUMEL + offs
            got = tl.load(src, mask=mask, other=0, volatile=True)
            while tl.max((got == _SENTINEL).to(tl.int32), axis=0) > 0:
                got = tl.load(src, mask=mask, other=0, volatile=True)
            acc += got.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    # The previous call's slot: no peer writes it before this program's next-but-one call.
    prev = (count + 2) % 3
    sentinel = tl.full([BLOCK], _SENTINEL, dtype=tl.int16)
    for p in tl.static_range(WORLD):
        if p != RANK:
            tl.store(own + (prev * WORLD + p) * MAX_NUMEL + offs, sentinel, mask=offs < MAX_NUMEL)
    tl.store(out_ptr + offs, round_to_dtype(acc, out_ptr.dtype.element_ty), mask=mask)
    tl.store(counts_ptr + pid, count + 1)


def receive_buffer_numel(max_numel: int, world: int) -> int:
    """int16 elements of one rank's receive buffer for messages of up to `max_numel` elements."""
    return NUM_SLOTS * world * max_numel


def num_programs(max_numel: int) -> int:
    """Length of the per-program call counts (int32, zero at start) for messages of up to `max_numel`."""
    return triton.cdiv(max_numel, BLOCK)


def push_all_reduce(
    x: torch.Tensor, buffer_ptrs: torch.Tensor, counts: torch.Tensor, max_numel: int, rank: int, world: int
) -> torch.Tensor:
    """The sum of `x` over the ranks, as a new tensor. A collective: every rank calls it in the same order
    with the same shape.

    buffer_ptrs: int64 [world], each rank's receive buffer address as mapped in this process (entry `rank` is
    this rank's own), each of `receive_buffer_numel(max_numel, world)` int16 elements filled with SENTINEL
    before any rank's first call. counts: int32 [num_programs(max_numel)], zeros at start, used by no one else.
    """
    if x.dtype not in DTYPES:
        raise ValueError(f"push_all_reduce takes {DTYPES}, not {x.dtype}")
    if x.numel() > max_numel:
        raise ValueError(f"push_all_reduce: {x.numel()} elements exceed the buffers' {max_numel}")
    x = x.contiguous()
    out = torch.empty_like(x)
    numel = x.numel()
    if numel == 0:
        return out
    pdl = pdl_enabled(x.device)
    _push_all_reduce_kernel[(triton.cdiv(numel, BLOCK),)](
        x,
        out,
        buffer_ptrs,
        counts,
        numel,
        MAX_NUMEL=max_numel,
        RANK=rank,
        WORLD=world,
        BLOCK=BLOCK,
        USE_PDL=pdl,
        num_warps=4,
        **pdl_launch_options(pdl),
    )
    return out
