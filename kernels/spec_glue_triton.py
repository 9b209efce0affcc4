"""Triton glue of a greedy speculative step: each function of `spec_glue` (same arguments, same writes) in one
launch, where eager torch launches 5 to 15 tiny kernels. A program per request (and per hidden row where rows
are gathered): batches are at most a few hundred requests, so a request's scalars are plain loads, and the only
batch-wide quantity, an exclusive sum over the batch, is one register reduction per program.

Sizes that change per step are not specialized on (a kernel variant per batch would compile mid-run); every
kernel waits for its predecessor first (programmatic dependent launch, kernels/pdl.py) and reads no host value,
so each launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from asyncspec.kernels.paged_attention_triton import _patch_interpreter
from asyncspec.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start

if triton.knobs.runtime.interpret:
    _patch_interpreter()  # loop bounds here are kernel arguments (idempotent)

_BLOCK_H = 512  # hidden elements per copy iteration


def _pdl(t: Tensor) -> dict[str, bool]:
    return pdl_launch_options(pdl_enabled(t.device))


@triton.jit(do_not_specialize=["hidden_stride", "H", "meta_stride", "src_stride", "k"])
def _verify_gather_kernel(
    hidden_ptr,
    hidden_stride,
    out_ptr,
    H,
    qsl_ptr,
    seq_lens_ptr,
    meta_ptr,
    meta_stride,
    src_drafts_ptr,
    src_stride,
    num_draft_ptr,
    drafts_ptr,
    num_valid_ptr,
    k,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    i = tl.program_id(0)
    j = tl.program_id(1)
    q = tl.num_programs(1)
    real = tl.load(seq_lens_ptr + i) > 0
    planned = tl.where(real, tl.load(meta_ptr + 5 * meta_stride + i), 0)
    last_known = tl.load(qsl_ptr + i + 1).to(tl.int64) - 1 - planned
    index = tl.maximum(last_known + tl.minimum(j, planned), 0)
    h = tl.arange(0, BLOCK_H)
    src = hidden_ptr + index * hidden_stride
    dst = out_ptr + (i * q + j).to(tl.int64) * H
    for start in range(0, H, BLOCK_H):
        mask = start + h < H
        tl.store(dst + start + h, tl.load(src + start + h, mask=mask), mask=mask)
    if j == 0:
        row = tl.load(meta_ptr + i)
        c = tl.arange(0, BLOCK_K)
        drafts = tl.load(src_drafts_ptr + row * src_stride + c, mask=c < k, other=0)
        tl.store(drafts_ptr + i * k + c, drafts, mask=c < k)
        tl.store(num_valid_ptr + i, tl.minimum(tl.load(num_draft_ptr + row), planned))


def verify_gather(
    hidden: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    meta: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
    num_reqs: int,
    query_len: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """See `verify_gather_ref`."""
    b, q, k = num_reqs, query_len, query_len - 1
    assert hidden.stride(1) == 1 and meta.stride(1) == 1 and draft_token_ids.stride(1) == 1
    assert meta.dtype == draft_token_ids.dtype == num_draft_tokens.dtype == torch.int64
    hidden_size = hidden.shape[1]
    rows = torch.empty((b * q, hidden_size), dtype=hidden.dtype, device=hidden.device)
    drafts = torch.empty((b, k), dtype=torch.int64, device=hidden.device)
    num_valid = torch.empty(b, dtype=torch.int64, device=hidden.device)
    if b == 0:
        return rows, drafts, num_valid
    _verify_gather_kernel[(b, q)](
        hidden,
        hidden.stride(0),
        rows,
        hidden_size,
        query_start_loc,
        seq_lens,
        meta,
        meta.stride(0),
        draft_token_ids,
        draft_token_ids.stride(0),
        num_draft_tokens,
        drafts,
        num_valid,
        k,
        BLOCK_H=min(_BLOCK_H, triton.next_power_of_2(hidden_size)),
        BLOCK_K=triton.next_power_of_2(max(k, 1)),
        USE_PDL=pdl_enabled(hidden.device),
        **_pdl(hidden),
    )
    return rows, drafts, num_valid


@triton.jit(do_not_specialize=["q", "drafts_stride", "meta_stride", "token_stride"])
def _greedy_accept_commit_kernel(
    target_ptr,
    q,
    drafts_ptr,
    drafts_stride,
    num_valid_ptr,
    out_ptr,
    accepted_ptr,
    seq_lens_ptr,
    meta_ptr,
    meta_stride,
    token_ids_ptr,
    token_stride,
    num_computed_ptr,
    new_num_tokens_ptr,
    BLOCK_Q: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    i = tl.program_id(0)
    c = tl.arange(0, BLOCK_Q)
    target = tl.load(target_ptr + i * q + c, mask=c < q, other=-1).to(tl.int64)
    is_draft = c < q - 1
    draft = tl.load(drafts_ptr + i * drafts_stride + c, mask=is_draft, other=-1)
    num_valid = tl.load(num_valid_ptr + i)
    accept = is_draft & (c < num_valid) & (draft == target) & (target >= 0)
    # The first position not accepted; position q - 1 never is, so it is at most q - 1.
    accepted = tl.min(tl.where(accept, BLOCK_Q, c), axis=0).to(tl.int64)
    out = tl.where(c <= accepted, target, -1)
    tl.store(out_ptr + i * q + c, out, mask=c < q)
    tl.store(accepted_ptr + i, accepted)
    # The run's effects, as `verify_commit_ref` writes them.
    seq_len = tl.load(seq_lens_ptr + i).to(tl.int64)
    real = seq_len > 0
    planned = tl.where(real, tl.load(meta_ptr + 5 * meta_stride + i), 0)
    row = tl.load(meta_ptr + i)
    base = seq_len - planned
    tl.store(token_ids_ptr + row * token_stride + base + c, out, mask=(c < q) & (out >= 0) & real)
    if real:
        # A real request's row is its own: no other program of the batch touches it.
        counter = num_computed_ptr + row
        tl.store(counter, tl.load(counter) + accepted - planned)
    tl.store(new_num_tokens_ptr + i, base + accepted + 1)


def greedy_accept_commit(
    target_token_ids: Tensor,
    drafts: Tensor,
    num_valid: Tensor,
    seq_lens: Tensor,
    meta: Tensor,
    token_ids: Tensor,
    num_computed: Tensor,
    num_reqs: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """See `greedy_accept_commit_ref`: the acceptance and the commit in one launch, where the eager greedy path takes
    a one-hot of the argmax, the rejection kernel and the commit (seven launches after the argmax)."""
    b, q = target_token_ids.shape
    assert b == num_reqs and target_token_ids.is_contiguous() and drafts.stride(1) == 1
    assert drafts.shape[0] >= b and drafts.shape[1] >= q - 1 and num_valid.shape[0] >= b and seq_lens.shape[0] >= b
    assert meta.shape[0] >= 6 and meta.shape[1] >= b
    assert meta.stride(1) == 1 and token_ids.stride(1) == 1
    assert drafts.dtype == num_valid.dtype == meta.dtype == token_ids.dtype == torch.int64
    device = target_token_ids.device
    out = torch.empty((b, q), dtype=torch.int64, device=device)
    num_accepted = torch.empty(b, dtype=torch.int64, device=device)
    new_num_tokens = torch.empty(b, dtype=torch.int64, device=device)
    if b == 0:
        return out, num_accepted, new_num_tokens
    _greedy_accept_commit_kernel[(b,)](
        target_token_ids,
        q,
        drafts,
        drafts.stride(0),
        num_valid,
        out,
        num_accepted,
        seq_lens,
        meta,
        meta.stride(0),
        token_ids,
        token_ids.stride(0),
        num_computed,
        new_num_tokens,
        BLOCK_Q=triton.next_power_of_2(q),
        USE_PDL=pdl_enabled(device),
        **_pdl(token_ids),
    )
    return out, num_accepted, new_num_tokens


@triton.jit(do_not_specialize=["n", "drafts_stride", "meta_stride", "token_stride", "dst_stride"])
def _record_drafts_kernel(
    drafts_ptr,
    drafts_stride,
    n,
    meta_ptr,
    meta_stride,
    num_tokens_ptr,
    token_ids_ptr,
    token_stride,
    dst_ptr,
    dst_stride,
    num_draft_ptr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    i = tl.program_id(0)
    if tl.load(meta_ptr + 2 * meta_stride + i) > 0:
        row = tl.load(meta_ptr + i)
        c = tl.arange(0, BLOCK_N)
        ok = c < n
        drafts = tl.load(drafts_ptr + i * drafts_stride + c, mask=ok, other=0)
        tl.store(dst_ptr + row * dst_stride + c, drafts, mask=ok)
        tl.store(num_draft_ptr + row, n.to(tl.int64))
        tl.store(token_ids_ptr + row * token_stride + tl.load(num_tokens_ptr + i) + c, drafts, mask=ok)


def record_drafts(
    drafts: Tensor,
    meta: Tensor,
    num_tokens: Tensor,
    token_ids: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
) -> None:
    """See `record_drafts_ref` (padding requests write nothing here)."""
    b, n = drafts.shape
    if b == 0 or n == 0:
        return
    assert drafts.stride(1) == 1 and meta.stride(1) == 1 and token_ids.stride(1) == 1
    assert draft_token_ids.stride(1) == 1 and num_tokens.is_contiguous()
    _record_drafts_kernel[(b,)](
        drafts,
        drafts.stride(0),
        n,
        meta,
        meta.stride(0),
        num_tokens,
        token_ids,
        token_ids.stride(0),
        draft_token_ids,
        draft_token_ids.stride(0),
        num_draft_tokens,
        BLOCK_N=triton.next_power_of_2(n),
        USE_PDL=pdl_enabled(token_ids.device),
        **_pdl(token_ids),
    )


@triton.jit(do_not_specialize=["meta_stride", "bt_stride", "bt_cols", "out_meta_stride", "out_bt_stride"])
def _draft_step_meta_kernel(
    meta_ptr,
    meta_stride,
    bt_ptr,
    bt_stride,
    bt_cols,
    out_meta_ptr,
    out_meta_stride,
    out_bt_ptr,
    out_bt_stride,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    i = tl.program_id(0)
    scheduled = tl.load(meta_ptr + 2 * meta_stride + i)
    tl.store(out_meta_ptr + i, tl.load(meta_ptr + i))
    tl.store(out_meta_ptr + out_meta_stride + i, tl.load(meta_ptr + meta_stride + i))
    tl.store(out_meta_ptr + 2 * out_meta_stride + i, tl.where(scheduled > 0, scheduled + 1, 0))
    tl.store(out_meta_ptr + 3 * out_meta_stride + i, tl.load(meta_ptr + 6 * meta_stride + i))
    c = tl.arange(0, BLOCK_C)
    for start in range(0, bt_cols, BLOCK_C):
        mask = start + c < bt_cols
        entries = tl.load(bt_ptr + i * bt_stride + start + c, mask=mask)
        tl.store(out_bt_ptr + i * out_bt_stride + start + c, entries, mask=mask)


def draft_step_meta(
    step_meta: Tensor, block_tables: Tensor, draft_meta: Tensor, draft_block_tables: Tensor, num_reqs: int
) -> None:
    """See `draft_step_meta_ref`."""
    if num_reqs == 0:
        return
    assert step_meta.stride(1) == 1 and draft_meta.stride(1) == 1
    assert block_tables.stride(1) == 1 and draft_block_tables.stride(1) == 1
    assert block_tables.shape[1] == draft_block_tables.shape[1] and block_tables.dtype == draft_block_tables.dtype
    cols = block_tables.shape[1]
    _draft_step_meta_kernel[(num_reqs,)](
        step_meta,
        step_meta.stride(0),
        block_tables,
        block_tables.stride(0),
        cols,
        draft_meta,
        draft_meta.stride(0),
        draft_block_tables,
        draft_block_tables.stride(0),
        BLOCK_C=min(1024, triton.next_power_of_2(max(cols, 1))),
        USE_PDL=pdl_enabled(step_meta.device),
        **_pdl(step_meta),
    )


@triton.jit(
    do_not_specialize=["meta_stride", "num_reqs", "hidden_stride", "num_tokens", "H", "max_model_len", "pass_stride"]
)
def _draft_loop_start_kernel(
    meta_ptr,
    meta_stride,
    num_reqs,
    accepted_ptr,
    hidden_ptr,
    hidden_stride,
    num_tokens,
    H,
    max_model_len,
    loop_hidden_ptr,
    loop_position_ptr,
    loop_capacity_ptr,
    pass_meta_ptr,
    pass_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    i = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    scheduled_r = tl.load(meta_ptr + 2 * meta_stride + r, mask=r < num_reqs, other=0)
    start = tl.sum(tl.where((r < i) & (scheduled_r > 0), scheduled_r + 1, 0), axis=0)
    scheduled = tl.load(meta_ptr + 2 * meta_stride + i)
    real = scheduled > 0
    planned = tl.where(real, tl.load(meta_ptr + 5 * meta_stride + i), 0)
    committed = scheduled - planned
    accepted = tl.load(accepted_ptr + i)
    last_index = tl.minimum(tl.maximum(start + committed + accepted, 0), num_tokens - 1)
    h = tl.arange(0, BLOCK_H)
    for offset in range(0, H, BLOCK_H):
        mask = offset + h < H
        values = tl.load(hidden_ptr + last_index * hidden_stride + offset + h, mask=mask)
        tl.store(loop_hidden_ptr + i * H + offset + h, values, mask=mask)
    tl.store(loop_position_ptr + i, tl.load(meta_ptr + meta_stride + i) + committed + accepted)
    tl.store(loop_capacity_ptr + i, tl.minimum(tl.load(meta_ptr + 6 * meta_stride + i), max_model_len - 1))
    tl.store(pass_meta_ptr + i, tl.load(meta_ptr + i))
    tl.store(pass_meta_ptr + 2 * pass_stride + i, real.to(tl.int64))


def draft_loop_start(
    step_meta: Tensor,
    num_accepted: Tensor,
    hidden: Tensor,
    max_model_len: int,
    loop_hidden: Tensor,
    loop_position: Tensor,
    loop_capacity: Tensor,
    pass_meta: Tensor,
    num_reqs: int,
) -> None:
    """See `draft_loop_start_ref`."""
    if num_reqs == 0:
        return
    assert step_meta.stride(1) == 1 and pass_meta.stride(1) == 1 and hidden.stride(1) == 1
    assert loop_hidden.is_contiguous() and loop_hidden.shape[1] == hidden.shape[1]
    hidden_size = hidden.shape[1]
    _draft_loop_start_kernel[(num_reqs,)](
        step_meta,
        step_meta.stride(0),
        num_reqs,
        num_accepted,
        hidden,
        hidden.stride(0),
        hidden.shape[0],
        hidden_size,
        max_model_len,
        loop_hidden,
        loop_position,
        loop_capacity,
        pass_meta,
        pass_meta.stride(0),
        BLOCK_R=max(16, triton.next_power_of_2(num_reqs)),
        BLOCK_H=min(_BLOCK_H, triton.next_power_of_2(hidden_size)),
        USE_PDL=pdl_enabled(hidden.device),
        **_pdl(hidden),
    )


@triton.jit(
    do_not_specialize=["num_reqs", "pass_index", "pass_stride", "bt_stride", "bt_cols", "max_model_len", "loop_stride"]
)
def _draft_pass_inputs_kernel(
    tokens_ptr,
    num_reqs,
    pass_index,
    loop_position_ptr,
    pass_meta_ptr,
    pass_stride,
    capacity_ptr,
    bt_ptr,
    bt_stride,
    bt_cols,
    block_size,
    max_model_len,
    input_ids_ptr,
    positions_ptr,
    slot_mapping_ptr,
    qsl_ptr,
    seq_lens_ptr,
    loop_tokens_ptr,
    loop_stride,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    r = tl.arange(0, BLOCK_R)
    ok = r < num_reqs
    live = tl.load(pass_meta_ptr + 2 * pass_stride + r, mask=ok, other=0) > 0
    position = tl.load(loop_position_ptr + r, mask=ok, other=0) + pass_index
    pos = tl.where(live, tl.minimum(position, max_model_len - 1), 0)
    block_idx = tl.minimum(pos // block_size, bt_cols - 1)
    block = tl.load(bt_ptr + r.to(tl.int64) * bt_stride + block_idx, mask=ok, other=0).to(tl.int64)
    capacity = tl.load(capacity_ptr + r, mask=ok & live, other=0)
    writes = live & (pos < capacity)
    tokens = tl.load(tokens_ptr + r, mask=ok, other=0)
    tl.store(input_ids_ptr + r, tokens, mask=ok)
    tl.store(positions_ptr + r, pos, mask=ok)
    tl.store(slot_mapping_ptr + r, tl.where(writes, block * block_size + pos % block_size, -1), mask=ok)
    tl.store(qsl_ptr + r + 1, tl.cumsum(live.to(tl.int32), axis=0), mask=ok)
    tl.store(qsl_ptr + r, tl.zeros_like(r), mask=r == 0)
    tl.store(seq_lens_ptr + r, tl.where(live, pos + 1, 0).to(tl.int32), mask=ok)
    tl.store(loop_tokens_ptr + r * loop_stride + pass_index - 1, tokens, mask=ok)


def draft_pass_inputs(
    tokens: Tensor,
    pass_index: int,
    loop_position: Tensor,
    pass_meta: Tensor,
    capacity: Tensor,
    block_tables: Tensor,
    block_size: int,
    max_model_len: int,
    input_ids: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    loop_tokens: Tensor,
) -> None:
    """See `draft_pass_inputs_ref`: one program over the batch."""
    num_reqs = tokens.shape[0]
    if num_reqs == 0:
        return
    assert pass_index >= 1 and tokens.is_contiguous() and pass_meta.stride(1) == 1 and block_tables.stride(1) == 1
    assert tokens.dtype == loop_position.dtype == pass_meta.dtype == capacity.dtype == torch.int64
    _draft_pass_inputs_kernel[(1,)](
        tokens,
        num_reqs,
        pass_index,
        loop_position,
        pass_meta,
        pass_meta.stride(0),
        capacity,
        block_tables,
        block_tables.stride(0),
        block_tables.shape[1],
        block_size,
        max_model_len,
        input_ids,
        positions,
        slot_mapping,
        query_start_loc,
        seq_lens,
        loop_tokens,
        loop_tokens.stride(0),
        BLOCK_R=max(16, triton.next_power_of_2(num_reqs)),
        USE_PDL=pdl_enabled(tokens.device),
        **_pdl(tokens),
    )
