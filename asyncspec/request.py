"""Request: the scheduler's record of one generation."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from asyncspec.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """Token ids and progress of one request. The scheduler owns every mutable field."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    """End-of-sequence ids of the model; ignored when sampling_params.ignore_eos."""
    priority: int = 0
    """Lower values are served first under the "priority" policy."""
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache (prefix-cache hits included)."""
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first scheduling (-1: not yet scheduled)."""
    num_output_placeholders: int = 0
    """Tokens the steps in flight will emit if every draft is accepted (the scheduler's optimistic
    view): counted in scheduling, never stored as ids; reconciliation replaces them by real tokens."""
    num_inflight_steps: int = 0
    """Steps in flight that sample tokens for it, each at least one (the pessimistic view beside the
    placeholders' optimistic one: every draft rejected)."""
    spec_accepted: float = 0.0
    """Drafts its verifications accepted, decayed per verification (the speculation policy's own estimate of
    this request's acceptance, `SpeculationPolicy.request_acceptance`)."""
    spec_rejected: float = 0.0
    """Its verifications that rejected a draft, decayed alike."""
    queued_seconds: float | None = None
    """From arrival to first scheduling (set once, at admission)."""
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
