"""What crosses from the scheduler to the worker (SchedulerOutput) and back (ModelRunnerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncspec.outputs import TokenLogprobs
from asyncspec.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has no row for: first scheduling, or resumption after preemption."""

    request_id: str
    token_ids: list[int]
    """Every known token: the prompt, then outputs generated before a preemption."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens already in the KV cache (prefix-cache hits) before this step."""


@dataclass
class CachedRequestData:
    """Requests the worker already holds; only what changed since the last step."""

    request_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    """Tokens in the KV cache before this step (the scheduler's view)."""


@dataclass
class SchedulerOutput:
    """One step's plan. The only object the scheduler hands to the worker."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute per request this step, in batch order (dict order)."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    """Requests that ended since the last step; the worker drops their rows."""
    preempted_req_ids: set[str]
    """Requests preempted this step; the worker drops their rows (they come back as new)."""
    num_speculative_tokens: int = 0
    """Drafts per decode verified this step: the k the previous step committed to (and proposed)."""
    num_proposals: int = 0
    """Drafts the worker proposes per sampling request at the end of this step: the next step's k."""
    num_draft_positions: dict[str, int] = field(default_factory=dict)
    """Per decode verifying drafts: the draft positions scheduled after its last token (the worker
    cannot derive them while an earlier step's accepted counts are still on their way)."""
    num_steps: int = 1
    """Greedy decode steps run back to back (EngineConfig.num_scheduler_steps): every request computes its
    num_scheduled_tokens (one, or 1 + k with speculation) in each, from the tokens and drafts the step before
    left on the device, and emits one token a step plus the drafts each step accepts."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Results of one step, one entry per scheduled request in batch order."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Tokens sampled per request; empty for a prefill chunk that did not reach the end."""
    logprobs: list[list[TokenLogprobs] | None] | None = None
    """Per request, per sampled token; None when no request asked for logprobs."""
    num_draft_tokens: list[int] | None = None
    """Per request, the valid draft tokens verified this step (the emitted run is the accepted
    drafts plus one token); None when no request had drafts."""
    step_runs: list[list[tuple[int, int]]] | None = None
    """A plan of several verification steps: per request, per step, (valid drafts verified, tokens emitted: the
    accepted drafts plus one); `sampled_token_ids` holds the runs one after the other and `num_draft_tokens`
    their drafts in all. None for a plan of one step."""
    failed_requests: dict[str, str] = field(default_factory=dict)
    """Requests that failed alone this step (id -> reason): not admitted to the worker, or no
    valid token to sample. The scheduler ends them with finish_reason "error"."""
    device_num_computed_tokens: dict[str, int] | None = None
    """Debug mode only: each request's num_computed_tokens on the device at the end of this step."""


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request, after stop checks (slots: one is made per request per step)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error"; None while the request runs on."""
    stop_reason: int | str | None = None
    error: str | None = None
    """Why the request failed, with finish_reason "error"."""
    num_draft_tokens: int = 0
    """Draft tokens verified for this request this step."""
    num_accepted_tokens: int = 0
    """Of them, accepted and kept."""
    num_drafts: int = 0
    """Verification steps of this request that held at least one draft: several for a multi-step plan's output."""
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    queued_seconds: float | None = None
    """From the request's arrival to its first scheduling."""
