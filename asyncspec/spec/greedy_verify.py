"""Greedy verification of a speculative step, shaped so that it can be captured in a CUDA graph.

A step where every request of the batch verifies its drafts greedily (no temperature, penalties,
logprobs or min_tokens anywhere in the batch) needs no sampling metadata: the target's argmax at
each position decides. Everything here reads the step's device buffers (the runner's meta, the
static inputs the forward pass read) and writes its results into device buffers, with shapes fixed
by (batch bucket, query length): no host value, no sync. The runner replays it as the tail of its
verification graphs, or calls it eagerly where no graph serves the step (`sampling_only` where prompt
chunks beside the decodes sample nothing); all give the tokens of the
eager verification path (`SpeculativeDecoder.verify`), whose greedy rows take the rejection kernel over a one-hot
of the same argmax (`greedy_accept_ref` is that rule on the tokens themselves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
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
        """The runner's step meta [8, max_reqs]: row 0 each request's token-buffer row; by sampling request, row 3
        its batch index, row 5 its planned draft positions, row 7 its token-buffer row."""
        self.token_ids = token_ids
        self.num_computed = num_computed
        self.spec = spec
        self.num_sampling_only = 0
        """Verifications over part of a step's requests (`sampling_only`; tests and benchmarks read it)."""

    def __call__(self, hidden: Tensor, static: StaticInputs, num_reqs: int, query_len: int) -> GreedyVerifyResult:
        """hidden: the forward pass's [T, H] over `static` filled for num_reqs requests (padding
        requests have sequence length 0), each with at most query_len tokens, the last
        `planned` of which are its drafts."""
        return self._verify(hidden, static.query_start_loc, static.seq_lens, self.meta, num_reqs, query_len)

    def sampling_only(
        self, hidden: Tensor, static: StaticInputs, num_sampling: int, query_len: int
    ) -> GreedyVerifyResult:
        """The same verification where only some requests of the step sample: decodes that verify drafts beside
        prompt chunks that stop short of their prompt's end (whose next token slot holds the prompt's next token,
        which must stay). It runs over the sampling requests alone, in the runner's sampling order: meta row 3
        holds their batch indices, row 7 their token-buffer rows, row 5 their planned drafts. The results are
        per sampling request, as the eager sampler's are."""
        s, meta = num_sampling, self.meta
        self.num_sampling_only += 1
        index = meta[3, :s]
        ends = static.query_start_loc[1:].index_select(0, index)
        query_start_loc = torch.cat([ends.new_zeros(1), ends])  # only the ends are read
        seq_lens = static.seq_lens.index_select(0, index)
        sampling_meta = meta[:6, :s].clone()  # rows 5 (and 3) are in sampling order already
        sampling_meta[0] = meta[7, :s]
        return self._verify(hidden, query_start_loc, seq_lens, sampling_meta, s, query_len)

    def _verify(
        self, hidden: Tensor, query_start_loc: Tensor, seq_lens: Tensor, meta: Tensor, num_reqs: int, query_len: int
    ) -> GreedyVerifyResult:
        b, q = num_reqs, query_len
        spec, glue = self.spec, self.spec.glue
        # The hidden row of each request's last known token and of each draft position (padding repeats
        # the last row: its verdict is never read), the drafts of each request's row and how many are valid.
        rows, drafts, num_valid = glue.verify_gather(
            hidden, query_start_loc, seq_lens, meta, spec.draft_token_ids, spec.num_draft_tokens, b, q
        )
        # The target's token at every position decides: no [b * q, V] one-hot for the rejection kernel.
        target_token_ids = greedy_sample(self.compute_logits(rows)).view(b, q)
        # The emitted run goes at positions num_tokens + j (num_tokens = seq_len - planned).
        out, num_accepted, new_num_tokens = glue.greedy_accept_commit(
            target_token_ids, drafts, num_valid, seq_lens, meta, self.token_ids, self.num_computed, b
        )
        return GreedyVerifyResult(out, num_accepted, num_valid, new_num_tokens)
