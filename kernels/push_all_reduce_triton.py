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


@triton.jit
def _exchange(
    part, offs, mask, region, buffer_ptrs, counts_ptr, MAX_NUMEL: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr
):
    """This program's share of one call: pushes `part` (at `offs`, where `mask`) to every peer, waits for
    theirs, returns the rank-order fp32 sum, and sets the program's previous slot back to the sentinel over
    `region` (every offset the program may ever use)."""
    pid = tl.program_id(0)
    count = tl.load(counts_ptr + pid)
    slot = count % 3
    bits = part.to(tl.int16, bitcast=True)
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer = tl.load(buffer_ptrs + p).to(tl.pointer_type(tl.int16))
            tl.store(peer + (slot * WORLD + RANK) * MAX_NUMEL + offs, bits, mask=mask)
    own = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(tl.int16))
    acc = tl.zeros(part.shape, dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            acc += part.to(tl.float32)
        else:
            src = own + (slot * WORLD + p) * MAX_NUMEL + offs
            got = tl.load(src, mask=mask, other=0, volatile=True)
            while tl.max((got == _SENTINEL).to(tl.int32)) > 0:
                got = tl.load(src, mask=mask, other=0, volatile=True)
            acc += got.to(part.dtype, bitcast=True).to(tl.float32)
    # The previous call's slot: no peer writes it before this program's next-but-one call.
    prev = (count + 2) % 3
    sentinel = tl.full(part.shape, _SENTINEL, dtype=tl.int16)
    for p in tl.static_range(WORLD):
        if p != RANK:
            tl.store(own + (prev * WORLD + p) * MAX_NUMEL + offs, sentinel, mask=region)
    tl.store(counts_ptr + pid, count + 1)
    return acc


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
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    pdl_start(USE_PDL)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    # -0.0 is the sentinel: send +0.0 instead (the same in any sum).
    part = tl.where(x == 0, tl.zeros_like(x), x)
    acc = _exchange(part, offs, mask, offs < MAX_NUMEL, buffer_ptrs, counts_ptr, MAX_NUMEL, RANK, WORLD)
    tl.store(out_ptr + offs, round_to_dtype(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _push_all_reduce_add_rms_norm_kernel(
    x_ptr,
    x_stride,
    res_ptr,
    res_stride,
    w_ptr,
    out_ptr,
    res_out_ptr,
    buffer_ptrs,
    counts_ptr,
    num_rows,
    H,
    eps,
    MAX_NUMEL: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # The tile and the math of kernels/fused_add_rms_norm_triton.py, so that the numbers are those of the
    # all-reduce followed by that kernel.
    cols = tl.arange(0, BLOCK_H)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < H)
    offs = rows[:, None] * H + cols[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + cols[None, :], mask=mask, other=0.0)
    part = tl.where(x == 0, tl.zeros_like(x), x)
    region = (cols[None, :] < H) & (offs < MAX_NUMEL)
    acc = _exchange(part, offs, mask, region, buffer_ptrs, counts_ptr, MAX_NUMEL, RANK, WORLD)
    reduced = round_to_dtype(acc, x_ptr.dtype.element_ty)
    r = tl.load(res_ptr + rows[:, None].to(tl.int64) * res_stride + cols[None, :], mask=mask, other=0.0)
    summed = round_to_dtype(reduced.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
    tl.store(res_out_ptr + offs, summed, mask=mask)
    h = summed.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=1) / H
    h = h * tl.math.rsqrt(mean_sq + eps)[:, None]
    y = round_to_dtype(h, x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(out_ptr + offs, round_to_dtype(y, out_ptr.dtype.element_ty), mask=mask)


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


def norm_tile(hidden: int) -> tuple[int, int, int]:
    """(rows per program, padded hidden, warps): kernels/fused_add_rms_norm_triton.py's tile for `hidden`."""
    block_h = triton.next_power_of_2(hidden)
    block_t = max(1, min(16, 4096 // block_h))
    return block_t, block_h, min(max(block_t * block_h // 512, 1), 16)


def push_all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buffer_ptrs: torch.Tensor,
    counts: torch.Tensor,
    max_numel: int,
    rank: int,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(sum + residual) * weight, sum + residual) where sum is `x` [T, H] summed over the ranks: the
    all-reduce and kernels/fused_add_rms_norm_triton.py's residual add and RMSNorm in one kernel, with the
    same numbers. A collective like `push_all_reduce`, with buffers and counts of its own: a program's
    receive region is fixed by H, so one set of buffers serves one hidden size (counts: int32, at least
    cdiv(T, rows per program) long)."""
    if x.dtype not in DTYPES or residual.dtype != x.dtype:
        raise ValueError(f"push_all_reduce_add_rms_norm takes {DTYPES} (x and residual alike), not {x.dtype}")
    if x.dim() != 2 or residual.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"push_all_reduce_add_rms_norm: shapes {x.shape}, {residual.shape}, {weight.shape}")
    if x.numel() > max_numel:
        raise ValueError(f"push_all_reduce_add_rms_norm: {x.numel()} elements exceed the buffers' {max_numel}")
    num_rows, hidden = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x)
    if num_rows == 0:
        return out, residual_out
    block_t, block_h, num_warps = norm_tile(hidden)
    pdl = pdl_enabled(x.device)
    _push_all_reduce_add_rms_norm_kernel[(triton.cdiv(num_rows, block_t),)](
        x,
        x.stride(0),
        residual,
        residual.stride(0),
        weight,
        out,
        residual_out,
        buffer_ptrs,
        counts,
        num_rows,
        hidden,
        eps,
        MAX_NUMEL=max_numel,
        RANK=rank,
        WORLD=world,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        USE_PDL=pdl,
        num_warps=num_warps,
        **pdl_launch_options(pdl),
    )
    return out, residual_out
