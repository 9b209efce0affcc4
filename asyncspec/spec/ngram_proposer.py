"""N-gram (prompt lookup) proposer, vectorised on the device over the worker's persistent token buffer.

For each request with T known tokens it finds the longest n in [prompt_lookup_min, prompt_lookup_max] such
that the last n tokens also occur strictly earlier (as tokens[s:s+n] with s + n <= T - 1), takes the most
recent such occurrence and proposes the tokens that follow it, tokens[s+n : min(s+n+k, T)].

Algorithm (no host loop over requests, no host-device sync, so it fits the async loop and CUDA graphs): index
every candidate occurrence by its end position e = s + n - 1. With P = prompt_lookup_max, the match length at
e is the number of trailing agreements of tokens[e-P+1 .. e] with tokens[T-P .. T-1], capped at e + 1 (the
window may not start before 0). One unfold of the left-padded buffer gives all the [N, M, P] comparisons at
once (M = max_num_tokens); a max-reduction of the last disagreeing index turns them into the match length l(e)
(an occurrence of every n <= l(e) ends at e). Only e <= T - 2 counts, which also keeps every compared position
below T, so stale data beyond T never matches. Then n* = max_e l(e) is the longest n that occurs (a request
matches iff n* >= prompt_lookup_min), and the largest e with l(e) = n* is its most recent occurrence (one
max-reduction finds both); the drafts are tokens[e+1 : e+1+k], masked to positions < T. Memory O(N * M * P)
bytes of bool/int8 plus O(N * M) int64; time O(N * M * P) elementwise work in a fixed handful of kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncspec.errors import ConfigError


class NgramProposer:
    """Proposes up to `num_speculative_tokens` draft tokens per request by prompt lookup."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ConfigError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ConfigError(
                f"prompt_lookup_max ({prompt_lookup_max}) must be >= prompt_lookup_min ({prompt_lookup_min})"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(
        self,
        token_ids: Tensor,
        rows: Tensor,
        num_tokens: Tensor,
        max_num_tokens: int,
    ) -> tuple[Tensor, Tensor]:
        """Draft tokens for the requests in `rows`.

        token_ids: [R, L] int64 device buffer; row r holds its request's known tokens at [0, num_tokens).
        rows: [N] int64 buffer row of each request. num_tokens: [N] int64 tokens known per request (>= 1).
        max_num_tokens: host-known upper bound of num_tokens.
        Returns draft_token_ids [N, k] int64 and num_draft_tokens [N] int64 in [0, k]. Entries at
        j >= num_draft_tokens hold the request's last token tokens[T-1] (a valid id for the embedding).
        """
        k, p = self.k, self.max_n
        device = token_ids.device
        m = max(1, min(max_num_tokens, token_ids.shape[1]))
        tok = token_ids[:, :m].index_select(0, rows)  # [N, M]
        t = num_tokens.long()[:, None]  # [N, 1]
        last = tok.gather(1, (t - 1).clamp(0, m - 1))  # [N, 1]
        if m < 2:  # host-known: no request has two tokens, so none can match
            return last.expand(-1, k).contiguous(), torch.zeros_like(t[:, 0])

        # windows[:, e, i] = tokens[e - (p - 1) + i]; the left padding lies before position 0.
        windows = F.pad(tok, (p - 1, 0)).unfold(1, p, 1)  # [N, M, P] view
        suffix_idx = (t - p + torch.arange(p, device=device)).clamp(0, m - 1)  # [N, P]
        suffix = tok.gather(1, suffix_idx)  # tokens[T-P .. T-1] (clamped where T < P: capped below)
        # Trailing agreements = P - 1 - (index of the last disagreement, -1 if none). A max-reduction over the
        # window dim, not a cumprod: scans over a short innermost dim are ~20x slower on CUDA.
        offset = torch.arange(p, device=device, dtype=torch.int8 if p <= 127 else torch.int32)
        last_miss = torch.where(windows == suffix[:, None, :], -1, offset).amax(-1)  # [N, M]
        pos = torch.arange(m, device=device)  # end position e
        match_len = (p - 1) - last_miss.long()
        match_len = torch.minimum(match_len, pos + 1)
        match_len = torch.where(pos <= t - 2, match_len, 0)

        # n* = max_e l(e); no e has l(e) > n*, so the most recent e with l(e) >= n* is the largest e with
        # l(e) == n*: both come out of one max-reduction over the key l(e) * M + e.
        best = (match_len * m + pos).amax(-1, keepdim=True)  # [N, 1]
        longest, end = best // m, best % m
        matched = longest >= self.min_n

        draft_pos = end + 1 + torch.arange(k, device=device)  # [N, k]
        valid = matched & (draft_pos < t)
        drafts = tok.gather(1, draft_pos.clamp(0, m - 1))
        draft_token_ids = torch.where(valid, drafts, last)
        return draft_token_ids, valid.sum(-1)
