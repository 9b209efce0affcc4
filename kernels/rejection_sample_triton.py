"""Triton rejection sampler for speculative decoding (contract of `rejection_sample_ref`, bit-identical to it).

One launch, one program per row. Pass 1 finds a, the number of leading accepted drafts: stochastic rows
test all K drafts at once (two scalar loads per draft); greedy rows walk the positions while the draft
equals the argmax, one blocked scan over V per position. Pass 2 scans position a once over V in blocks,
racing both the residual max(p_a - q_a, 0) and p_a against the row's exponentials, and keeps whichever the
row needs (the residual after a rejection, unless it has no mass; p_a otherwise) together with the
validity flags (non-finite values, no positive mass). Argmaxes keep, per lane, the first index holding the
lane's maximum, then take the lowest index among lanes at the global maximum: the first index overall,
as torch.argmax. Nothing is read back on the host, so the launch never syncs with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_V = 2048


@triton.jit
def _argmax_scan(row_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """(first index of the max, any non-finite value) of row_ptr[0:V]; NaNs never win."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK_V], 0, tl.int32)
    bad = tl.full([BLOCK_V], 0, tl.int1)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + offs
        m = v < V
        s = tl.load(row_ptr + v, mask=m, other=float("-inf")).to(tl.float32)
        bad = bad | (m & ((s != s) | (tl.abs(s) == float("inf"))))
        upd = s > best
        best = tl.where(upd, s, best)
        best_idx = tl.where(upd, v, best_idx)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_idx, V), axis=0)
    return idx, tl.max(bad.to(tl.int32), axis=0) != 0


@triton.jit
def _rejection_sample_kernel(
    p_ptr,  # [N, K+1, V]
    sp_n,
    sp_k,
    x_ptr,  # [N, K] int64
    sx_n,
    q_ptr,  # [N, K, V] (unused unless HAS_Q)
    sq_n,
    sq_k,
    c_ptr,  # [N] int64
    g_ptr,  # [N] uint8 (bool)
    u_ptr,  # [N, K]
    su_n,
    e_ptr,  # [N, V]
    se_n,
    out_ptr,  # [N, K+1] int64
    so_n,
    acc_ptr,  # [N] int64
    K: tl.constexpr,
    V: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.load(c_ptr + row)
    c = tl.minimum(tl.maximum(c, 0), K).to(tl.int32)
    greedy = tl.load(g_ptr + row) != 0
    p_row = p_ptr + row * sp_n
    x_row = x_ptr + row * sx_n
    q_row = q_ptr + row * sq_n

    # ---- pass 1a (stochastic rows): accept draft j iff u_j * q_j(x_j) < p_j(x_j); a = first rejection
    jk = tl.arange(0, BLOCK_K)
    x = tl.load(x_row + jk, mask=jk < K, other=-1).to(tl.int64)
    in_range = (x >= 0) & (x < V)
    xs = tl.where(in_range, x, 0)
    live = (jk < c) & in_range & (~greedy)
    px = tl.load(p_row + jk * sp_k + xs, mask=live, other=0.0).to(tl.float32)
    if HAS_Q:
        qx = tl.load(q_row + jk * sq_k + xs, mask=live, other=0.0).to(tl.float32)
    else:
        qx = tl.full([BLOCK_K], 1.0, tl.float32)  # deterministic proposer: q_j is one-hot at x_j
    u = tl.load(u_ptr + row * su_n + jk, mask=live, other=1.0).to(tl.float32)
    accept = live & (u * qx < px)
    a_stochastic = tl.min(tl.where(accept, BLOCK_K, jk), axis=0)  # <= c: position c is never accepted

    # ---- pass 1b (greedy rows): accept while the draft is the (finite) argmax
    a_greedy = c * 0
    going = greedy & (c > 0)
    while going:
        idx, nonfinite = _argmax_scan(p_row + a_greedy.to(tl.int64) * sp_k, V, BLOCK_V)
        draft = tl.load(x_row + a_greedy)
        match = (draft == idx) & (~nonfinite)
        a_greedy = a_greedy + match.to(tl.int32)
        going = match & (a_greedy < c)
    a = tl.where(greedy, a_greedy, a_stochastic).to(tl.int32)

    # ---- pass 2: race the residual and p_a at position a (exponential race; plain argmax for greedy rows)
    rejected = (a < c) & (~greedy)
    pa_row = p_row + a.to(tl.int64) * sp_k
    qa_row = q_row + a.to(tl.int64) * sq_k
    x_a = tl.load(x_row + a, mask=rejected, other=-1)
    e_row = e_ptr + row * se_n
    offs = tl.arange(0, BLOCK_V)
    best_r = tl.full([BLOCK_V], float("-inf"), tl.float32)
    idx_r = tl.full([BLOCK_V], 0, tl.int32)
    best_t = tl.full([BLOCK_V], float("-inf"), tl.float32)
    idx_t = tl.full([BLOCK_V], 0, tl.int32)
    bad = tl.full([BLOCK_V], 0, tl.int1)
    positive = tl.full([BLOCK_V], 0, tl.int1)
    has_residual = tl.full([BLOCK_V], 0, tl.int1)
    for v0 in range(0, V, BLOCK_V):
        v = v0 + offs
        m = v < V
        pv = tl.load(pa_row + v, mask=m, other=0.0).to(tl.float32)
        if HAS_Q:
            qv = tl.load(qa_row + v, mask=m & rejected, other=0.0).to(tl.float32)
        else:
            qv = tl.where((v == x_a) & rejected, 1.0, 0.0)
        ev = tl.load(e_row + v, mask=m & (~greedy), other=1.0).to(tl.float32)
        p_bad = (pv != pv) | (tl.abs(pv) == float("inf"))
        q_bad = (qv != qv) | (tl.abs(qv) == float("inf"))
        bad = bad | (m & (p_bad | (rejected & q_bad)))
        positive = positive | (m & (pv > 0))
        diff = pv - qv
        has_residual = has_residual | (m & (diff > 0))
        residual = tl.where(diff > 0, diff, 0.0)
        score_r = tl.where(m, residual / ev, float("-inf"))
        score_t = tl.where(m, tl.where(greedy, pv, pv / ev), float("-inf"))
        upd_r = score_r > best_r
        best_r = tl.where(upd_r, score_r, best_r)
        idx_r = tl.where(upd_r, v, idx_r)
        upd_t = score_t > best_t
        best_t = tl.where(upd_t, score_t, best_t)
        idx_t = tl.where(upd_t, v, idx_t)
    top_r = tl.max(best_r, axis=0)
    token_r = tl.min(tl.where(best_r == top_r, idx_r, V), axis=0)
    top_t = tl.max(best_t, axis=0)
    token_t = tl.min(tl.where(best_t == top_t, idx_t, V), axis=0)
    use_residual = rejected & (tl.max(has_residual.to(tl.int32), axis=0) != 0)
    token = tl.where(use_residual, token_r, token_t).to(tl.int64)
    invalid = (tl.max(bad.to(tl.int32), axis=0) != 0) | (tl.max(positive.to(tl.int32), axis=0) == 0)
    token = tl.where(invalid, -1, token)

    # ---- output: accepted drafts, the token at a, then -1
    jo = tl.arange(0, BLOCK_K1)
    drafts = tl.load(x_row + jo, mask=jo < a, other=-1).to(tl.int64)
    out = tl.where(jo < a, drafts, tl.where(jo == a, token, -1))
    tl.store(out_ptr + row * so_n + jo, out, mask=jo < K + 1)
    tl.store(acc_ptr + row, a.to(tl.int64))


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rejection_sample_triton(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft_tokens: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform: torch.Tensor,
    exponential: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [N, K+1, V] f32, draft_token_ids [N, K] i64, draft_probs [N, K, V] f32 | None,
    num_draft_tokens [N] i64, is_greedy [N] bool, uniform [N, K] f32, exponential [N, V] f32 (> 0)
    -> (output_token_ids [N, K+1] i64, num_accepted [N] i64). One kernel launch; only shapes are read."""
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    out = torch.empty((n, k1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((n,), dtype=torch.int64, device=device)
    if n == 0:
        return out, num_accepted
    p = _unit_stride(target_probs)
    e = _unit_stride(exponential)
    greedy = is_greedy.to(torch.bool).contiguous().view(torch.uint8)
    counts = num_draft_tokens.to(torch.int64).contiguous()
    if k > 0:
        x = _unit_stride(draft_token_ids.to(torch.int64))
        u = _unit_stride(uniform)
    else:  # empty [N, 0] tensors: hand the kernel a real pointer it never reads
        x, u = counts.view(n, 1), p[:, 0]
    q = p if draft_probs is None or k == 0 else _unit_stride(draft_probs)
    has_q = draft_probs is not None and k > 0
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    _rejection_sample_kernel[(n,)](
        p,
        p.stride(0),
        p.stride(1),
        x,
        x.stride(0),
        q,
        q.stride(0) if has_q else 0,
        q.stride(1) if has_q else 0,
        counts,
        greedy,
        u,
        u.stride(0),
        e,
        e.stride(0),
        out,
        out.stride(0),
        num_accepted,
        K=k,
        V=vocab,
        HAS_Q=has_q,
        BLOCK_K=triton.next_power_of_2(max(k, 1)),
        BLOCK_K1=triton.next_power_of_2(k1),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 1024 else 4,
    )
    return out, num_accepted
