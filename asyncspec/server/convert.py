"""Between the gRPC messages (asyncspec.v1) and the engine's types: requests in, deltas out.

Every check that can name a field raises InvalidRequestError / InvalidSamplingParamsError with that
field's API name; the servicer maps them to INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncspec.errors import InvalidRequestError
from asyncspec.outputs import RequestOutput
from asyncspec.sampling_params import SamplingParams
from asyncspec.v1 import asyncspec_pb2 as pb

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_STOPPING_SCALARS = ("max_tokens", "min_tokens", "ignore_eos", "include_stop_str_in_output")
_OUTPUT_SCALARS = ("logprobs", "skip_special_tokens")


@dataclass
class EngineRequest:
    """A GenerateRequest in the engine's terms."""

    request_id: str | None
    prompt: str | list[int]
    params: SamplingParams
    priority: int


def to_engine_request(request: pb.GenerateRequest, defaults: Mapping[str, Any] | None = None) -> EngineRequest:
    """The prompt, SamplingParams (validated: a bad field raises naming it) and priority. `defaults` (the model's
    generation_config.json recommendations, SamplingParams names) fill the fields the request leaves unset."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise InvalidRequestError("prompt: set exactly one of text or token_ids")
    prompt: str | list[int] = request.text if which == "text" else list(request.token_ids.ids)
    kwargs: dict[str, object] = dict(defaults or {})
    for name in _SAMPLING_FIELDS:
        if request.sampling.HasField(name):
            kwargs[name] = getattr(request.sampling, name)
    for name in _STOPPING_SCALARS:
        if request.stopping.HasField(name):
            kwargs[name] = getattr(request.stopping, name)
    # The API's default, as the proto documents it: up to max_model_len (SamplingParams' own default is 16).
    kwargs.setdefault("max_tokens", None)
    if request.stopping.stop:
        kwargs["stop"] = list(request.stopping.stop)
    if request.stopping.stop_token_ids:
        kwargs["stop_token_ids"] = list(request.stopping.stop_token_ids)
    for name in _OUTPUT_SCALARS:
        if request.output.HasField(name):
            kwargs[name] = getattr(request.output, name)
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]  # validated by SamplingParams itself
    return EngineRequest(
        request_id=request.request_id or None,
        prompt=prompt,
        params=params,
        priority=request.priority,
    )


def max_tokens_per_response(max_message_bytes: int, logprobs: int | None) -> int:
    """Most tokens one GenerateResponse may carry under the server's message limit: a bound of a token's bytes
    (its id, its text, its logprobs entries) with room to spare, since a token's text has no fixed length."""
    per_token = 64 + (16 * (logprobs + 1) + 16 if logprobs is not None else 0)
    return max(1, max_message_bytes // (4 * per_token))


def finish_reason_of(output: RequestOutput) -> int:
    """The API's FinishReason of a finished output."""
    reason = output.finish_reason
    if reason == "stop":
        if isinstance(output.stop_reason, str):
            return pb.FINISH_REASON_STOP_STRING
        if isinstance(output.stop_reason, int):
            return pb.FINISH_REASON_STOP_TOKEN
        return pb.FINISH_REASON_EOS
    return {
        "length": pb.FINISH_REASON_LENGTH,
        "abort": pb.FINISH_REASON_ABORTED,
        "error": pb.FINISH_REASON_ERROR,
    }.get(reason or "", pb.FINISH_REASON_UNSPECIFIED)


@dataclass
class UsageCounter:
    """What a stream accumulates for its final Usage."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0

    def add(self, delta: RequestOutput) -> None:
        self.prompt_tokens = len(delta.prompt_token_ids)
        self.completion_tokens += len(delta.token_ids)
        self.cached_tokens = delta.num_cached_tokens
        self.drafted_tokens = delta.num_draft_tokens  # cumulative in every delta
        self.accepted_tokens = delta.num_accepted_tokens
        self.num_drafts = delta.num_drafts

    def add_failure(self, output: RequestOutput) -> None:
        """A failed request's error output: its prompt and cached tokens (it carries no tokens or draft counts,
        which the deltas before it counted)."""
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens

    def to_proto(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=self.accepted_tokens,
            num_drafts=self.num_drafts,
        )


def to_response(delta: RequestOutput, usage: UsageCounter) -> pb.GenerateResponse:
    response = pb.GenerateResponse(request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text)
    if delta.logprobs:
        response.logprobs.extend(
            pb.TokenLogprobs(token_ids=lp.token_ids, logprobs=lp.logprobs, sampled_token_rank=lp.sampled_token_rank)
            for lp in delta.logprobs
        )
    if delta.finished:
        response.finished = True
        response.finish_reason = finish_reason_of(delta)  # type: ignore[assignment]
        if delta.stop_reason is not None:
            response.stop_reason = str(delta.stop_reason)
        if delta.error:
            response.error = delta.error
        response.usage.CopyFrom(usage.to_proto())
    return response
