"""Triton computation of each token's flat KV-cache slot (same contract as `compute_slot_mapping_ref`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_T = 256


@triton.jit(do_not_specialize=["bt_stride", "num_tokens", "num_reqs", "max_blocks"])
def _slot_mapping_kernel(
    block_tables_ptr,  # [R, M] int32
    bt_stride,
    query_start_loc_ptr,  # [R + 1] int32
    positions_ptr,  # [T_pad] int64
    out_ptr,  # [T_pad] int64
    num_tokens,
    num_reqs,
    max_blocks,
    block_size,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = t < num_tokens
    total = tl.load(query_start_loc_ptr + num_reqs)
    valid = in_range & (t < total)
    # Vectorised binary search for req(t) = #requests whose end <= t (searchsorted right on qsl[1:]);
    # a fixed step count keeps it branch-free and needs only the host-known num_reqs.
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + num_reqs
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(query_start_loc_ptr + mid + 1, mask=active & valid, other=0)
        go_right = end <= t
        lo = tl.where(active & go_right, mid + 1, lo)
        hi = tl.where(active & (~go_right), mid, hi)
    req = tl.where(valid, lo, 0)
    # Padding may carry garbage positions: never load or use them.
    pos = tl.load(positions_ptr + t, mask=valid, other=0).to(tl.int64)
    block_idx = tl.minimum(pos // block_size, max_blocks - 1)
    block = tl.load(block_tables_ptr + req.to(tl.int64) * bt_stride + block_idx, mask=valid, other=0)
    slot = block.to(tl.int64) * block_size + pos % block_size
    tl.store(out_ptr + t, tl.where(valid, slot, -1), mask=in_range)


def compute_slot_mapping(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Slot of token t = block_tables[req(t), pos // block_size] * block_size + pos % block_size; padding gets -1.

    block_tables [R, M] int32, query_start_loc [R + 1] int32, positions [T_pad] int64 -> [T_pad] int64.
    Only shapes are read on the host, so the launch never syncs with the device.
    """
    num_tokens = positions.shape[0]
    num_reqs, max_blocks = block_tables.shape
    out = torch.empty((num_tokens,), dtype=torch.int64, device=positions.device)
    if num_tokens == 0:
        return out
    if num_reqs == 0 or max_blocks == 0:
        return out.fill_(-1)
    assert block_tables.stride(1) == 1 and query_start_loc.is_contiguous() and positions.is_contiguous()
    grid = (triton.cdiv(num_tokens, _BLOCK_T),)
    _slot_mapping_kernel[grid](
        block_tables,
        block_tables.stride(0),
        query_start_loc,
        positions,
        out,
        num_tokens,
        num_reqs,
        max_blocks,
        block_size,
        SEARCH_STEPS=max(1, int(num_reqs).bit_length()),
        BLOCK_T=_BLOCK_T,
    )
    return out
