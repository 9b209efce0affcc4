"""Greedy verification of a speculative step, shaped so that it can be captured in a CUDA graph.

A step where every request of the batch verifies its drafts greedily (no temperature, penalties,
logprobs or min_tokens anywhere in the batch) needs no sampling metadata: the target's argmax at
each position decides. Everything here reads the step's device buffers (the runner's meta, the
static inputs the forward pass read) and writes its results into device buffers, with shapes fixed
by (batch bucket, query length): no host value, no sync. The runner replays it as the tail of its
verification graphs, or calls it eagerly where no graph serves the step; both give the tokens of the
eager verification path (`SpeculativeDecoder.verify`), whose greedy rows take the same argmax of the
same probabilities in the same rejection kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncspec.layers.attention_metadata import StaticInputs
from asyncspec.spec.spec_decoder import SpeculativeDecoder


@dataclass
class GreedyVerifyResult:
    """Per request of the padded batch (rows past the real requests are padding: never read)."""

    output_token_ids: Tensor
    """[B, q] int64: accepted drafts, then the target's token, then -1."""
    num_accepted: Tensor
    """[B] int64."""
    num_valid_drafts: Tensor
    """[B] int64: drafts that were really verified."""
    new_num_tokens: Tensor
    """[B] int64: each request's known tokens after the step."""


class GreedyVerification:
    """The target's argmax at every draft position, the accepted runs, and their effects on the
    device's state: the emitted tokens go into the token buffer, and the rejected positions leave
    the device's computed counts. It holds what it needs, not the runner (the graphs that keep it
    must not keep the runner alive)."""

    def __init__(
        self,
        compute_logits: Callable[[Tensor], Tensor],
        meta: Tensor,
        token_ids: Tensor,
        num_computed: Tensor,
        spec: SpeculativeDecoder,
    ) -> None:
        self.compute_logits = compute_logits
        self.meta = meta
        """The runner's step meta [6, max_reqs]: row 0 batch rows, row 5 planned draft positions."""
        self.token_ids = token_ids
        self.num_computed = num_computed
        self.spec = spec
        self._positions = torch.arange(spec.k + 1, dtype=torch.int64, device=meta.device)
        max_reqs = meta.shape[1]
        self._is_greedy = torch.ones(max_reqs, dtype=torch.bool, device=meta.device)

    def __call__(self, hidden: Tensor, static: StaticInputs, num_reqs: int, query_len: int) -> GreedyVerifyResult:
        """hidden: the forward pass's [T, H] over `static` filled for num_reqs requests (padding
        requests have sequence length 0), each with at most query_len tokens, the last
        `planned` of which are its drafts."""
        b, q, k = num_reqs, query_len, query_len - 1
        real = static.seq_lens[:b] > 0
        planned = torch.where(real, self.meta[5, :b], 0)
        j = self._positions[:q]
        # Hidden row of each request's last known token and of each draft position; padding repeats
        # the last row (its verdict is never read).
        last_known = static.query_start_loc[1 : b + 1].to(torch.int64) - 1 - planned
        index = (last_known.unsqueeze(1) + torch.minimum(j, planned.unsqueeze(1))).clamp_min(0)
        logits = self.compute_logits(hidden.index_select(0, index.view(-1)))
        probs = logits.softmax(dim=-1).view(b, q, -1)
        rows = self.meta[0, :b]
        drafts = self.spec.draft_token_ids.index_select(0, rows)[:, :k]
        num_valid = torch.minimum(self.spec.num_draft_tokens.index_select(0, rows), planned)
        # Greedy rows read neither the uniforms nor the exponentials: left unfilled.
        uniform = torch.empty((b, k), dtype=torch.float32, device=probs.device)
        exponential = torch.empty((b, probs.shape[-1]), dtype=torch.float32, device=probs.device)
        out, num_accepted = self.spec.rejection_sampler.kernel(
            probs, drafts, None, num_valid, self._is_greedy[:b], uniform, exponential
        )
        # The emitted run goes at positions num_tokens + j (num_tokens = seq_len - planned). Padding
        # requests (row 0) write row 0's column 0 back to itself: a real request writes columns >= 1,
        # so no element is written twice with different values.
        base = static.seq_lens[:b].to(torch.int64) - planned
        cols = torch.where(real.unsqueeze(1), base.unsqueeze(1) + j, 0)
        grid = rows.unsqueeze(1).expand_as(cols)
        keep = (out >= 0) & real.unsqueeze(1)
        self.token_ids[grid, cols] = torch.where(keep, out, self.token_ids[grid, cols])
        self.num_computed.index_add_(0, rows, torch.where(real, num_accepted - planned, 0))
        return GreedyVerifyResult(out, num_accepted, num_valid, base + num_accepted + 1)
