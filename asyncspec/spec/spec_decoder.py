"""Speculative decoding beside the model runner: per-row draft buffers, verification of the drafts
by rejection sampling, and proposal of the next drafts.

Drafts never leave the device. The scheduler plans each decode for 1 + k tokens without knowing
how many drafts a request really has (the n-gram proposer may find none): the valid count lives in
`num_draft_tokens` on the device, draft positions past it hold a real padding token, and
verification stops there. Proposing places the drafts in the device token buffer right after each
request's known tokens, where the next step's input gather finds them (verification overwrites
what it keeps; the positions past a request's tokens are never read as known tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from asyncspec.layers.sampler import SamplingMetadata, host_list_to_device
from asyncspec.spec.draft_model_proposer import DraftModelProposer, DraftStep
from asyncspec.spec.ngram_proposer import NgramProposer
from asyncspec.spec.rejection_sampler import RejectionSampler
from asyncspec.spec.step_glue import select_step_glue
from asyncspec.spec.verification import verification_probs


@dataclass
class VerifyInputs:
    """One step's sampling requests, as the runner sees them (host facts plus device tensors)."""

    rows: Tensor
    """[S] int64 device: buffer row of each sampling request."""
    row_ids: list[int]
    """The same rows, on the host."""
    num_draft_positions: Tensor
    """[S] int64 device: draft positions the scheduler planned per request (0 without drafts)."""
    logits: Tensor
    """[S, P, V] target logits at the last token and each draft position (P = max draft positions + 1)."""
    metadata: SamplingMetadata
    """Per-request sampling metadata (penalty tables included)."""
    blocked_token_ids: dict[int, list[int]]
    """Flat row (s * P + j) -> token ids forbidden there (stop ids below min_tokens)."""
    is_greedy: Tensor
    """[S] bool device."""


@dataclass
class ParkedDrafts:
    """A preempted request's drafts, on the device (see SpeculativeDecoder.park_drafts)."""

    token_ids: Tensor
    """[k] int64: the drafts."""
    count: Tensor
    """[] int64: how many are valid."""
    probs: Tensor | None
    """[k, V] float32: the draft's distributions q they were sampled from (None: no sampled proposal yet)."""
    base: Tensor
    """[] int64: the request's token count they follow."""


@dataclass
class VerifyResult:
    """Per sampling request: the emitted run (accepted drafts + one token; -1 after it)."""

    output_token_ids: Tensor
    """[S, P] int64 device."""
    num_accepted: Tensor
    """[S] int64 device."""
    num_valid_drafts: Tensor
    """[S] int64 device: drafts that were really verified."""


class SpeculativeDecoder:
    """Owns the draft state of every row; the runner calls it at three points of a step."""

    def __init__(
        self,
        num_speculative_tokens: int,
        proposer: NgramProposer | DraftModelProposer,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.k = num_speculative_tokens
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.device = device
        self.max_num_reqs = max_num_reqs
        # One spare row past the last: a graphed step's padding requests write their drafts there.
        self.draft_token_ids = torch.zeros((max_num_reqs + 1, self.k), dtype=torch.int64, device=device)
        self.num_draft_tokens = torch.zeros(max_num_reqs + 1, dtype=torch.int64, device=device)
        # The draft model's sampling distributions q, per row and draft position: allocated with
        # the first sampled (non-greedy) proposal.
        self.draft_probs: Tensor | None = None
        # Per row, the token count its sampled drafts follow (set with sampled proposals): a preempted
        # seeded request's drafts are parked, and restored only where they still follow its tokens.
        self.draft_base = torch.zeros(max_num_reqs + 1, dtype=torch.int64, device=device)
        self._parked: dict[str, ParkedDrafts] = {}
        # Seeded rows draw randomness for k positions whatever the step's widest row: their
        # streams must not depend on their neighbours.
        self.rejection_sampler = RejectionSampler(device, num_speculative_tokens=num_speculative_tokens)
        self._slots = torch.arange(max(num_speculative_tokens, 1), dtype=torch.int64, device=device)
        self.glue = select_step_glue(device)
        """The greedy step's glue ops (one Triton launch each on a GPU): the runner's verification and draft use it."""

    @property
    def uses_draft_model(self) -> bool:
        return isinstance(self.proposer, DraftModelProposer)

    def compile_kernel_variants(self, ks: Sequence[int]) -> int:
        """Runs the stochastic verification's rejection kernel once for each k of `ks` (with and without the draft's
        q), on one dummy row, so that no sampled step compiles a variant mid-run. The warm-up verifies only the
        largest k, and an adaptive engine's k = 1 or 2 with a sampling request compiled two variants mid-run (an
        H200, 2026-12-02). Call outside graph capture. Returns the number of launches."""
        kernel, device, vocab = self.rejection_sampler.kernel, self.device, self.vocab_size
        calls = 0
        for k in ks:
            if k <= 0:
                continue
            probs = torch.full((1, k + 1, vocab), 1.0 / vocab, dtype=torch.float32, device=device)
            drafts = torch.zeros((1, k), dtype=torch.int64, device=device)
            counts = torch.full((1,), k, dtype=torch.int64, device=device)
            is_greedy = torch.zeros(1, dtype=torch.bool, device=device)
            uniform = torch.rand((1, k), dtype=torch.float32, device=device)
            exponential = torch.ones((1, vocab), dtype=torch.float32, device=device)
            for q in (None, probs[:, :k].contiguous()) if self.uses_draft_model else (None,):
                kernel(probs, drafts, q, counts, is_greedy, uniform, exponential)
                calls += 1
        return calls

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes the proposer keeps per token (the draft model's own cache), beside the target's."""
        return self.proposer.kv_bytes_per_token if isinstance(self.proposer, DraftModelProposer) else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.initialize_kv_cache(num_blocks)

    # -- 1. new rows have no drafts ---------------------------------------------------------
    def reset_rows(self, rows: Sequence[int]) -> None:
        if rows:
            self.num_draft_tokens.index_fill_(0, host_list_to_device(rows, self.device), 0)

    def clear_drafts(self, rows: Tensor) -> None:
        """The rows (device) have no drafts for their next step (it verifies nothing)."""
        self.num_draft_tokens.index_fill_(0, rows, 0)

    # -- 2. a preempted seeded request keeps its drafts ------------------------------------------
    def park_drafts(self, request_id: str, row: int) -> None:
        """Keeps a row's sampled drafts for its request, preempted now (device copies, ordered after the step
        in flight that may still be proposing them). Its seeded stream has drawn their randomness already:
        when it resumes, `restore_drafts` gives the decode after its recompute the drafts the interrupted step
        would have verified, so that its stream is the same as an uninterrupted run's. Preempted again before they
        were restored (during its recompute, whose row proposed nothing), it keeps the drafts parked first."""
        if request_id in self._parked:
            return
        probs = self.draft_probs[row].clone() if self.draft_probs is not None else None
        self._parked[request_id] = ParkedDrafts(
            self.draft_token_ids[row].clone(), self.num_draft_tokens[row].clone(), probs, self.draft_base[row].clone()
        )

    def has_parked_drafts(self, request_id: str) -> bool:
        return request_id in self._parked

    def drop_parked_drafts(self, request_id: str) -> None:
        """Forgets a request's parked drafts (it finished or was aborted while preempted)."""
        self._parked.pop(request_id, None)

    def restore_drafts(self, request_id: str, row: int, num_tokens: int, token_ids: Tensor) -> None:
        """Puts a resumed request's parked drafts in its new row and after its `num_tokens` known tokens in the
        token buffer. They count only if they were proposed after exactly those tokens (checked on the device:
        otherwise the row has no drafts)."""
        parked = self._parked.pop(request_id)
        self.draft_token_ids[row].copy_(parked.token_ids)
        count = torch.where(parked.base == num_tokens, parked.count, 0)
        self.num_draft_tokens[row].copy_(count)
        # The row's base is its previous occupant's: a preemption before this request's decode would park that.
        self.draft_base[row].copy_(parked.base)
        if parked.probs is not None and self.draft_probs is not None:
            self.draft_probs[row].copy_(parked.probs)
        token_ids[row, num_tokens : num_tokens + self.k] = parked.token_ids

    # -- 3. verification ----------------------------------------------------------------------
    def verify(
        self,
        inputs: VerifyInputs,
        generators: dict[int, torch.Generator],
        default_generator: torch.Generator | None,
    ) -> VerifyResult:
        num_rows, num_positions, _ = inputs.logits.shape
        k = num_positions - 1
        planned = inputs.num_draft_positions
        drafts = self.draft_token_ids.index_select(0, inputs.rows)[:, :k]
        num_valid = torch.minimum(self.num_draft_tokens.index_select(0, inputs.rows), planned)
        probs = verification_probs(inputs.logits, inputs.metadata, drafts, num_valid, inputs.blocked_token_ids)
        # None means q is one-hot at the draft: the n-gram proposer's drafts are deterministic (and
        # greedy rows never read q).
        draft_probs = None
        if self.draft_probs is not None and not inputs.metadata.all_greedy and k > 0:
            draft_probs = self.draft_probs.index_select(0, inputs.rows)[:, :k]
        out, num_accepted = self.rejection_sampler(
            probs, drafts, draft_probs, num_valid, inputs.is_greedy, generators, default_generator
        )
        return VerifyResult(out, num_accepted, num_valid)

    # -- 4. the next drafts -------------------------------------------------------------------
    def propose(
        self,
        token_ids: Tensor,
        rows: Tensor,
        num_tokens: Tensor,
        max_num_tokens: int,
        draft_step: DraftStep | None,
        num_proposals: int | None = None,
    ) -> None:
        """Proposes up to `num_proposals` drafts (default k) for the sampling rows (`rows`, with
        verified tokens [0, num_tokens)). The draft model needs the whole step (`draft_step`) to keep
        its KV in lockstep, sampling or not."""
        n = self.k if num_proposals is None else min(num_proposals, self.k)
        if isinstance(self.proposer, DraftModelProposer):
            assert draft_step is not None
            drafts, q = self.proposer.propose(draft_step)
            if rows.shape[0] == 0:
                return
            n = drafts.shape[1]
            if q is not None:
                if self.draft_probs is None:
                    shape = (self.max_num_reqs, self.k, q.shape[-1])
                    self.draft_probs = torch.zeros(shape, dtype=torch.float32, device=self.device)
                self.draft_probs[:, :n].index_copy_(0, rows, q)
                self.draft_base.index_copy_(0, rows, num_tokens)
            if n > 0:
                self.draft_token_ids[:, :n].index_copy_(0, rows, drafts)
                self._place_drafts(token_ids, rows, num_tokens, drafts)
            self.num_draft_tokens.index_fill_(0, rows, n)
            return
        if rows.shape[0] == 0:
            return
        if n == 0:  # the next step verifies nothing: no lookup to run
            self.num_draft_tokens.index_fill_(0, rows, 0)
            return
        drafts, counts = self.proposer.propose(token_ids, rows, num_tokens, max_num_tokens)
        if n < self.k:
            counts = counts.clamp_max(n)
        self.draft_token_ids.index_copy_(0, rows, drafts)
        self.num_draft_tokens.index_copy_(0, rows, counts)
        self._place_drafts(token_ids, rows, num_tokens, drafts)

    def record_greedy_drafts(self, token_ids: Tensor, meta: Tensor, num_tokens: Tensor, drafts: Tensor) -> None:
        """The drafts [B, n] of a graphed step's padded batch (the step meta's row 0 holds each request's row,
        row 2 its scheduled tokens, 0 for padding): kept per row and placed in the token buffer at positions
        num_tokens + j, as `propose` does. Shapes are fixed by the batch bucket; padding writes at most into
        the spare row (`glue.record_drafts`)."""
        self.glue.record_drafts(drafts, meta, num_tokens, token_ids, self.draft_token_ids, self.num_draft_tokens)

    def _place_drafts(self, token_ids: Tensor, rows: Tensor, num_tokens: Tensor, drafts: Tensor) -> None:
        """Writes the drafts [S, n] at positions num_tokens + j of each row of the token buffer (its
        spare columns hold them at max_model_len). Invalid drafts (past num_draft_tokens) are real
        padding ids: the next step feeds them to the target but never accepts them."""
        cols = num_tokens.unsqueeze(1) + self._slots[: drafts.shape[1]]
        token_ids[rows.unsqueeze(1).expand_as(cols), cols] = drafts
