"""Greedy verification of a speculative step, shaped so that it can be captured in a CUDA graph.

A step where every request of the batch verifies its drafts greedily (no temperature, penalties,
logprobs or min_tokens anywhere in the batch) needs no sampling metadata: the target's argmax at
each position decides. Everything here reads the step's device buffers (the runner's meta, the
static inputs the forward pass read) and writes its results into device buffers, with shapes fixed
by (batch bucket, query length): no host value, no sync. The runner replays it as the tail of its
verification graphs, or calls it eagerly where no graph serves the step; both give the tokens of the
eager verification path (`SpeculativeDecoder.verify`), whose greedy rows take the rejection kernel over a one-hot
of the same argmax (`greedy_accept_ref` is that rule on the tokens themselves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from asyncspec.layers.attention_metadata import StaticInputs
from asyncspec.layers.sampler import greedy_sample
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

    def __call__(self, hidden: Tensor, static: StaticInputs, num_reqs: int, query_len: int) -> GreedyVerifyResult:
        """hidden: the forward pass's [T, H] over `static` filled for num_reqs requests (padding
        requests have sequence length 0), each with at most query_len tokens, the last
        `planned` of which are its drafts."""
        b, q = num_reqs, query_len
        spec, glue = self.spec, self.spec.glue
        # The hidden row of each request's last known token and of each draft position (padding repeats
        # the last row: its verdict is never read), the drafts of each request's row and how many are valid.
        rows, drafts, num_valid = glue.verify_gather(
            hidden,
            static.query_start_loc,
            static.seq_lens,
            self.meta,
            spec.draft_token_ids,
            spec.num_draft_tokens,
            b,
            q,
        )
        # The target's token at every position decides: no [b * q, V] one-hot for the rejection kernel.
        target_token_ids = greedy_sample(self.compute_logits(rows)).view(b, q)
        # The emitted run goes at positions num_tokens + j (num_tokens = seq_len - planned).
        out, num_accepted, new_num_tokens = glue.greedy_accept_commit(
            target_token_ids, drafts, num_valid, static.seq_lens, self.meta, self.token_ids, self.num_computed, b
        )
        return GreedyVerifyResult(out, num_accepted, num_valid, new_num_tokens)
