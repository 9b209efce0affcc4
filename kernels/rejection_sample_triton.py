"""Triton rejection sampler for speculative decoding (contract of `rejection_sample_ref`, bit-identical to it).

One launch, one program per row, which branches on the row's kind:
- A greedy row scans positions 0..c together in [positions, vocab] tiles, keeping each position's argmax
  (and whether it holds a non-finite value or any positive mass); a is the first position whose draft is
  not that argmax, and the token at a is its argmax. Positions past c are never read.
- A stochastic row first tests all K drafts at once (two scalar loads per draft: u_j * q_j(x_j) < p_j(x_j)),
  then scans position a once over V in blocks, racing both the residual max(p_a - q_a, 0) and p_a against
  the row's exponentials, and keeps the residual's winner after a rejection (unless the residual has no
  mass) and p_a's otherwise, with the validity flags (non-finite values, no positive mass).
Argmaxes keep, per lane, the first index holding the lane's maximum, then take the lowest index among the
lanes at the global maximum: the first index overall, as torch.argmax. Inputs must be float32 / int64 / bool
as documented (other dtypes and non-contiguous inputs are copied first). Nothing is read back on the host,
so the launch never syncs with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_V = 2048
_GREEDY_TILE = 4096  # elements of the [positions, vocab] tile a greedy row scans per step


@triton.jit
def _greedy_row(p_row, x_row, c, K: tl.constexpr, V: tl.constexpr, BLOCK_K1: tl.constexpr, BLOCK_VG: tl.constexpr):
    """(a, argmax(p_a), p_a invalid) of a greedy row: positions 0..c scanned together, [BLOCK_K1, BLOCK_VG]
    tiles (more loads in flight than a position-by-position walk; positions past c are never read)."""
    j = tl.arange(0, BLOCK_K1)
    jj = j[:, None]
    need = jj <= c  # a <= c, so later positions are never needed
    offs = tl.arange(0, BLOCK_VG)[None, :]
    best = tl.full([BLOCK_K1, BLOCK_VG], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK_K1, BLOCK_VG], 0, tl.int32)
    bad = tl.full([BLOCK_K1, BLOCK_VG], 0, tl.int1)
    positive = tl.full([BLOCK_K1, BLOCK_VG], 0, tl.int1)
    for v0 in tl.range(0, V, BLOCK_VG, num_stages=3):  # loads pipelined 3 deep: the scan is latency-bound
        v = v0 + offs
        m = need & (v < V)
        s = tl.load(p_row + jj * V + v, mask=m, other=float("-inf")).to(tl.float32)
        bad = bad | (m & ((s != s) | (tl.abs(s) == float("inf"))))
        positive = positive | (m & (s > 0))
        upd = s > best  # NaNs never win; they are flagged in `bad`
        best = tl.where(upd, s, best)
        best_idx = tl.where(upd, v, best_idx)
    top = tl.max(best, axis=1)
    argmax = tl.min(tl.where(best == top[:, None], best_idx, V), axis=1)
    nonfinite = tl.max(bad.to(tl.int32), axis=1) != 0
    invalid = nonfinite | (tl.max(positive.to(tl.int32), axis=1) == 0)
    x = tl.load(x_row + j, mask=j < c, other=-1)
    match = (j < c) & (x == argmax) & (~nonfinite)
    a = tl.min(tl.where(match, BLOCK_K1, j), axis=0)  # first mismatch, <= c
    token = tl.sum(tl.where(j == a, argmax, 0), axis=0)
    invalid_a = tl.sum(tl.where(j == a, invalid.to(tl.int32), 0), axis=0) != 0
    return a.to(tl.int32), token.to(tl.int64), invalid_a


@triton.jit
def _stochastic_row(
    p_row,
    x_row,
    q_row,
    u_row,
    e_row,
    c,
    K: tl.constexpr,
    V: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """(a, token at a, invalid) of a stochastic row."""
    # Pass 1: accept draft j iff u_j * q_j(x_j) < p_j(x_j), all K at once; a = the first rejection.
    jk = tl.arange(0, BLOCK_K)
    x = tl.load(x_row + jk, mask=jk < K, other=-1).to(tl.int64)
    in_range = (x >= 0) & (x < V)
    xs = tl.where(in_range, x, 0)
    live = (jk < c) & in_range
    px = tl.load(p_row + jk * V + xs, mask=live, other=0.0).to(tl.float32)
    if HAS_Q:
        qx = tl.load(q_row + jk * V + xs, mask=live, other=0.0).to(tl.float32)
    else:
        qx = tl.full([BLOCK_K], 1.0, tl.float32)  # deterministic proposer: q_j is one-hot at x_j
    u = tl.load(u_row + jk, mask=live, other=1.0).to(tl.float32)
    accept = live & (u * qx < px)
    a = tl.min(tl.where(accept, BLOCK_K, jk), axis=0).to(tl.int32)  # <= c: position c is never accepted

    # Pass 2: race the residual max(p_a - q_a, 0) and p_a against the exponentials in one scan.
    rejected = a < c
    pa_row = p_row + a * V
    qa_row = q_row + a * V
    x_a = tl.load(x_row + a, mask=rejected, other=-1)
    offs = tl.arange(0, BLOCK_V)
    best_r = tl.full([BLOCK_V], float("-inf"), tl.float32)
    idx_r = tl.full([BLOCK_V], 0, tl.int32)
    best_t = tl.full([BLOCK_V], float("-inf"), tl.float32)
    idx_t = tl.full([BLOCK_V], 0, tl.int32)
    bad = tl.full([BLOCK_V], 0, tl.int1)
    positive = tl.full([BLOCK_V], 0, tl.int1)
    has_residual = tl.full([BLOCK_V], 0, tl.int1)
    for v0 in tl.range(0, V, BLOCK_V, num_stages=3):
        v = v0 + offs
        m = v < V
        pv = tl.load(pa_row + v, mask=m, other=0.0).to(tl.float32)
        if HAS_Q:
            qv = tl.load(qa_row + v, mask=m & rejected, other=0.0).to(tl.float32)
        else:
            qv = tl.where((v == x_a) & rejected, 1.0, 0.0)
        ev = tl.load(e_row + v, mask=m, other=1.0).to(tl.float32)
        p_bad = (pv != pv) | (tl.abs(pv) == float("inf"))
        q_bad = (qv != qv) | (tl.abs(qv) == float("inf"))
        bad = bad | (m & (p_bad | (rejected & q_bad)))
        positive = positive | (m & (pv > 0))
        diff = pv - qv
        has_residual = has_residual | (m & (diff > 0))
        score_r = tl.where(m, tl.where(diff > 0, diff, 0.0) / ev, float("-inf"))
        score_t = tl.where(m, pv / ev, float("-inf"))
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
    return a, token, invalid


@triton.jit
def _rejection_sample_kernel(
    p_ptr,  # [N, K+1, V] contiguous
    x_ptr,  # [N, K] int64 contiguous
    q_ptr,  # [N, K, V] contiguous (unused unless HAS_Q)
    c_ptr,  # [N] int64
    g_ptr,  # [N] uint8 (bool)
    u_ptr,  # [N, K] contiguous
    e_ptr,  # [N, V] contiguous
    out_ptr,  # [N, K+1] int64
    acc_ptr,  # [N] int64
    K: tl.constexpr,
    V: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_VG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.load(c_ptr + row)
    c = tl.minimum(tl.maximum(c, 0), K).to(tl.int32)
    p_row = p_ptr + row * ((K + 1) * V)
    x_row = x_ptr + row * K
    if tl.load(g_ptr + row) != 0:
        a, token, invalid = _greedy_row(p_row, x_row, c, K, V, BLOCK_K1, BLOCK_VG)
    else:
        a, token, invalid = _stochastic_row(
            p_row, x_row, q_ptr + row * (K * V), u_ptr + row * K, e_ptr + row * V, c, K, V, HAS_Q, BLOCK_K, BLOCK_V
        )
    token = tl.where(invalid, -1, token)
    # Accepted drafts, the token at a, then -1.
    jo = tl.arange(0, BLOCK_K1)
    drafts = tl.load(x_row + jo, mask=jo < a, other=-1).to(tl.int64)
    out = tl.where(jo < a, drafts, tl.where(jo == a, token, -1))
    tl.store(out_ptr + row * (K + 1) + jo, out, mask=jo < K + 1)
    tl.store(acc_ptr + row, a.to(tl.int64))


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
    -> (output_token_ids [N, K+1] i64, num_accepted [N] i64). One kernel launch (plus copies of inputs
    that are not contiguous or have other dtypes); only shapes are read on the host."""
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    out = torch.empty((n, k1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((n,), dtype=torch.int64, device=device)
    if n == 0:
        return out, num_accepted
    p = target_probs.contiguous()
    greedy = is_greedy.to(torch.bool).contiguous().view(torch.uint8)
    counts = num_draft_tokens.to(torch.int64).contiguous()
    if k > 0:
        x = draft_token_ids.to(torch.int64).contiguous()
        u = uniform.contiguous()
    else:  # empty [N, 0] tensors: hand the kernel real pointers it never reads
        x, u = counts, p
    has_q = draft_probs is not None and k > 0
    q = draft_probs.contiguous() if has_q and draft_probs is not None else p
    block_k1 = triton.next_power_of_2(k1)
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    _rejection_sample_kernel[(n,)](
        p,
        x,
        q,
        counts,
        greedy,
        u,
        exponential.contiguous(),
        out,
        num_accepted,
        K=k,
        V=vocab,
        HAS_Q=has_q,
        BLOCK_K=triton.next_power_of_2(max(k, 1)),
        BLOCK_K1=block_k1,
        BLOCK_V=block_v,
        BLOCK_VG=max(16, min(_GREEDY_TILE // block_k1, triton.next_power_of_2(vocab))),
        num_warps=8 if block_v >= 1024 else 4,
    )
    return out, num_accepted
