"""RequestOutput: what clients receive, as streamed deltas or as a final cumulative result."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprobs of one generated token: the sampled token first, then the top-n alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_token_rank: int


@dataclass
class RequestOutput:
    """One request's output. From AsyncEngine.generate: a delta per step; from LLM.generate: the whole."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    """Generated token ids (the new ones, for a delta)."""
    text: str = ""
    """Generated text (the new part, for a delta); never contains a stop string unless asked."""
    finish_reason: str | None = None
    """"stop", "length", "abort" or "error" on the last output; None before."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the request, if one did."""
    logprobs: list[TokenLogprobs] | None = None
    """Per generated token, when SamplingParams.logprobs was set."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    queued_seconds: float | None = None
    """Time from the request's arrival to its first scheduling (its queue time)."""
    num_draft_tokens: int = 0
    """Draft tokens proposed for this request (speculative decoding)."""
    num_accepted_tokens: int = 0
    """Draft tokens the target accepted."""
    num_drafts: int = 0
    """Verification steps that held at least one of this request's drafts (acceptance length:
    1 + num_accepted_tokens / num_drafts)."""
    error: str | None = None
    """Why this request alone failed (finish_reason "error"); AsyncEngine raises RequestFailedError
    with it instead of yielding the output."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
