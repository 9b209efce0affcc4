"""Reference (pure torch) rejection sampler for speculative decoding: lossless verification of K drafts.

Row n, with c = num_draft_tokens[n] (clamped to [0, K]) valid drafts x_j = draft_token_ids[n, j]:

- Greedy rows accept draft j < c while x_j == argmax(p_j) (first index among ties) and p_j holds no
  non-finite value; the token at the stopping position a is argmax(p_a).
- Stochastic rows accept draft j < c while uniform[n, j] * q_j(x_j) < p_j(x_j), i.e. with probability
  min(1, p_j(x_j) / q_j(x_j)). A draft the drafter gave q_j(x_j) == 0 is therefore accepted iff
  p_j(x_j) > 0 (min(1, p/0) = 1, and a token the target cannot produce is never accepted). On the first
  rejection (a < c) the token at a is drawn from the residual max(p_a - q_a, 0); when the residual has no
  positive entry (p_a == q_a up to rounding) it is drawn from p_a. When every valid draft was accepted
  (a == c, c == 0 included) the bonus token at a is drawn from p_a = target_probs[n, c].
- `draft_probs is None` means a deterministic proposer (n-gram, or all rows greedy): q_j is the one-hot
  distribution of x_j, so acceptance happens with probability p_j(x_j) and the residual is p_a with x_a
  removed. That is the lossless rule for a proposer that always proposes x_j.
- A draft id outside [0, V) is never accepted (never emitted).
- "Drawn from dist" is the exponential race argmax(dist / exponential[n]) over the unnormalised dist
  (normalising does not change the argmax, and skipping it keeps the reference and the Triton kernel
  bit-identical). Ties go to the lowest index, as torch.argmax does.
- The token at a is INVALID (-1) when p_a holds a NaN or infinity (or q_a does and a was a rejection), or
  when p_a has no positive entry: the caller fails that request; no token is ever drawn from NaNs.

Output: tokens [N, K + 1] int64 = accepted drafts at 0..a-1, the recovered/bonus token at a, -1 after;
num_accepted [N] int64 = a. Everything stays on the device (no host sync, no branch on tensor values).
"""

from __future__ import annotations

import torch
from torch import Tensor

INVALID = -1


def _argmax_first(scores: Tensor) -> Tensor:
    """argmax over the last dim, ties to the lowest index; NaNs never win (callers flag them separately)."""
    scores = scores.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    return scores.argmax(dim=-1)


def rejection_sample_ref(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None,
    num_draft_tokens: Tensor,
    is_greedy: Tensor,
    uniform: Tensor,
    exponential: Tensor,
) -> tuple[Tensor, Tensor]:
    """target_probs [N, K+1, V] f32, draft_token_ids [N, K] i64, draft_probs [N, K, V] f32 | None,
    num_draft_tokens [N] i64, is_greedy [N] bool, uniform [N, K] f32, exponential [N, V] f32 (> 0)
    -> (output_token_ids [N, K+1] i64, num_accepted [N] i64). See the module docstring."""
    n, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    p = target_probs.float()
    rows = torch.arange(n, device=device)
    c = num_draft_tokens.to(torch.int64).clamp(0, k)
    greedy = is_greedy.to(torch.bool)

    # ---- pass 1: number of leading accepted drafts a
    if k > 0:
        x = draft_token_ids.to(torch.int64)
        in_range = (x >= 0) & (x < vocab)
        xs = torch.where(in_range, x, torch.zeros_like(x))
        valid = (torch.arange(k, device=device) < c.unsqueeze(1)) & in_range
        p_x = p[:, :k].gather(2, xs.unsqueeze(2)).squeeze(2)
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[:, :k].float().gather(2, xs.unsqueeze(2))
        stochastic_accept = uniform.float() * q_x.reshape(p_x.shape) < p_x
        p_draft = p[:, :k]
        greedy_accept = (x == _argmax_first(p_draft)) & torch.isfinite(p_draft).all(dim=-1)
        accept = valid & torch.where(greedy.unsqueeze(1), greedy_accept, stochastic_accept)
        a = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        x = torch.zeros(n, 0, dtype=torch.int64, device=device)
        a = torch.zeros(n, dtype=torch.int64, device=device)

    # ---- pass 2: the token at position a
    p_a = p[rows, a]
    rejected = (a < c) & ~greedy
    if k > 0:
        at = a.clamp(max=k - 1)
        if draft_probs is None:
            x_a = x[rows, at]
            q_a = (torch.arange(vocab, device=device) == x_a.unsqueeze(1)).float()
        else:
            q_a = draft_probs[rows, at].float()
        q_a = torch.where(rejected.unsqueeze(1), q_a, torch.zeros_like(q_a))
    else:
        q_a = torch.zeros_like(p_a)
    diff = p_a - q_a
    residual = torch.where(diff > 0, diff, torch.zeros_like(diff))
    has_residual = (diff > 0).any(dim=-1)
    e = exponential.float()
    residual_token = _argmax_first(residual / e)
    target_token = _argmax_first(torch.where(greedy.unsqueeze(1), p_a, p_a / e))
    token = torch.where(rejected & has_residual, residual_token, target_token)
    bad = ~torch.isfinite(p_a).all(dim=-1) | ~(p_a.amax(dim=-1) > 0)
    bad |= rejected & ~torch.isfinite(q_a).all(dim=-1)
    token = token.masked_fill(bad, INVALID)

    # ---- output: accepted drafts, then the token at a, then -1
    pos = torch.arange(k1, device=device).unsqueeze(0)
    drafts = torch.cat([x, torch.full((n, 1), INVALID, dtype=torch.int64, device=device)], dim=1)
    out = torch.where(pos < a.unsqueeze(1), drafts, torch.full_like(drafts, INVALID))
    out = torch.where(pos == a.unsqueeze(1), token.unsqueeze(1), out)
    return out, a
