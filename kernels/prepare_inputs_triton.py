"""Triton construction of a step's model inputs in one launch (contract of `prepare_inputs_ref`).

Every program holds all requests' scheduled counts (at most a few hundred) and their running sum in
registers, finds the request of each of its tokens by counting the request ends at or before it, and
gathers that request's counts, token ids and block-table entries from memory. Program 0 also writes
query_start_loc and seq_lens. The launch reads only host-known sizes: no sync, and it can sit inside
a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Per-step sizes, and the meta / capacity views (slices of one packed host copy, at any offset and
# row stride) would otherwise compile a kernel variant per batch shape mid-run.
@triton.jit(
    do_not_specialize=[
        "meta_stride",
        "token_stride",
        "token_cols",
        "bt_stride",
        "bt_cols",
        "num_reqs",
        "num_tokens",
        "num_resolve",
    ],
    do_not_specialize_on_alignment=["meta_ptr", "capacity_ptr", "counts_ptr"],
)
def _prepare_inputs_kernel(
    meta_ptr,
    meta_stride,
    token_ids_ptr,
    token_stride,
    token_cols,
    block_tables_ptr,
    bt_stride,
    bt_cols,
    input_ids_ptr,
    positions_ptr,
    slot_mapping_ptr,
    qsl_ptr,
    seq_lens_ptr,
    capacity_ptr,
    counts_ptr,
    num_reqs,
    num_tokens,
    num_resolve,
    block_size,
    HAS_CAPACITY: tl.constexpr,
    RESOLVE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < num_reqs
    num_sched = tl.load(meta_ptr + 2 * meta_stride + r, mask=r_ok, other=0)
    if RESOLVE:
        # resolve_computed first (launched with a single program, so no other program reads row 1 early).
        resolving = (r < num_resolve) & (num_sched > 0)  # padding requests are left alone
        row_r = tl.load(meta_ptr + r, mask=resolving, other=0)
        host = tl.load(meta_ptr + meta_stride + r, mask=resolving, other=0)
        from_host = tl.load(meta_ptr + 4 * meta_stride + r, mask=resolving, other=0)
        device = tl.load(counts_ptr + row_r, mask=resolving & (from_host == 0), other=0)
        computed = tl.where(from_host != 0, host, device)
        tl.store(meta_ptr + meta_stride + r, computed, mask=resolving)
        tl.store(counts_ptr + row_r, computed + num_sched, mask=resolving)
        tl.debug_barrier()  # the gathers below read row 1 from other threads' stores
    ends = tl.cumsum(num_sched, axis=0)
    if pid == 0:
        num_computed = tl.load(meta_ptr + meta_stride + r, mask=r_ok, other=0)
        tl.store(qsl_ptr + r + 1, ends.to(tl.int32), mask=r_ok)
        tl.store(qsl_ptr + r, tl.zeros_like(r), mask=r == 0)
        seq_len = tl.where(num_sched > 0, num_computed + num_sched, 0)
        tl.store(seq_lens_ptr + r, seq_len.to(tl.int32), mask=r_ok)

    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    # Ends at or before t (padding requests end where their predecessor does): the owner's index,
    # and the largest such end is the owner's start.
    before = (ends[None, :] <= t[:, None]) & r_ok[None, :]
    req = tl.sum(before.to(tl.int32), axis=1)
    start = tl.max(tl.where(before, ends[None, :], 0), axis=1)
    valid = t_ok & (req < num_reqs)
    req = tl.where(valid, req, 0)
    num_computed_t = tl.load(meta_ptr + meta_stride + req, mask=valid, other=0)
    row = tl.load(meta_ptr + req, mask=valid, other=0)
    pos = tl.where(valid, num_computed_t + t - start, 0)
    ids = tl.load(token_ids_ptr + row * token_stride + tl.minimum(pos, token_cols - 1), mask=valid, other=0)
    block_idx = tl.minimum(pos // block_size, bt_cols - 1)
    block = tl.load(block_tables_ptr + req.to(tl.int64) * bt_stride + block_idx, mask=valid, other=0)
    writes = valid
    if HAS_CAPACITY:
        writes = writes & (pos < tl.load(capacity_ptr + req, mask=valid, other=0))
    slot = tl.where(writes, block.to(tl.int64) * block_size + pos % block_size, -1)
    tl.store(input_ids_ptr + t, ids, mask=t_ok)
    tl.store(positions_ptr + t, pos, mask=t_ok)
    tl.store(slot_mapping_ptr + t, slot, mask=t_ok)


def prepare_inputs(
    meta: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    token_ids: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    capacity: torch.Tensor | None = None,
    resolve: tuple[int, torch.Tensor] | None = None,
) -> None:
    """See `prepare_inputs_ref`: same arguments, same writes. With `resolve`, one launch where one program
    holds every token (a decode batch), two otherwise."""
    if num_reqs == 0:
        return
    assert meta.stride(1) == 1 and token_ids.stride(1) == 1 and block_tables.stride(1) == 1
    assert meta.dtype == token_ids.dtype == torch.int64 and block_tables.dtype == torch.int32
    block_r = max(16, triton.next_power_of_2(num_reqs))
    # The [BLOCK_T, BLOCK_R] comparison lives in registers: fewer tokens per program for big batches.
    block_t = min(128, max(16, 8192 // block_r))
    grid = (max(1, triton.cdiv(num_tokens, block_t)),)
    if resolve is not None and (resolve[0] == 0 or grid[0] > 1):
        # Several programs would read row 1 before program 0 resolved it: a launch of its own first.
        resolve_computed(meta, resolve[0], resolve[1])
        resolve = None
    counts = resolve[1] if resolve is not None else meta  # never read without RESOLVE
    if resolve is not None:
        assert resolve[0] <= num_reqs and counts.dtype == torch.int64
    _prepare_inputs_kernel[grid](
        meta,
        meta.stride(0),
        token_ids,
        token_ids.stride(0),
        token_ids.shape[1],
        block_tables,
        block_tables.stride(0),
        block_tables.shape[1],
        input_ids,
        positions,
        slot_mapping,
        query_start_loc,
        seq_lens,
        capacity if capacity is not None else seq_lens,  # never read without HAS_CAPACITY
        counts,
        num_reqs,
        num_tokens,
        resolve[0] if resolve is not None else 0,
        block_size,
        HAS_CAPACITY=capacity is not None,
        RESOLVE=resolve is not None,
        BLOCK_R=block_r,
        BLOCK_T=block_t,
    )


@triton.jit(do_not_specialize=["meta_stride", "num_reqs"], do_not_specialize_on_alignment=["meta_ptr"])
def _resolve_computed_kernel(meta_ptr, meta_stride, counts_ptr, num_reqs, BLOCK_R: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    scheduled = tl.load(meta_ptr + 2 * meta_stride + r, mask=r < num_reqs, other=0)
    ok = (r < num_reqs) & (scheduled > 0)  # padding requests are left alone
    row = tl.load(meta_ptr + r, mask=ok, other=0)
    host = tl.load(meta_ptr + meta_stride + r, mask=ok, other=0)
    from_host = tl.load(meta_ptr + 4 * meta_stride + r, mask=ok, other=0)
    device = tl.load(counts_ptr + row, mask=ok & (from_host == 0), other=0)
    computed = tl.where(from_host != 0, host, device)
    tl.store(meta_ptr + meta_stride + r, computed, mask=ok)
    tl.store(counts_ptr + row, computed + scheduled, mask=ok)


def resolve_computed(meta: torch.Tensor, num_reqs: int, device_counts: torch.Tensor) -> None:
    """See `resolve_computed_ref`: one program over every request."""
    if num_reqs == 0:
        return
    assert meta.stride(1) == 1 and meta.dtype == device_counts.dtype == torch.int64
    block_r = max(16, triton.next_power_of_2(num_reqs))
    _resolve_computed_kernel[(1,)](meta, meta.stride(0), device_counts, num_reqs, BLOCK_R=block_r)
