"""Turns EngineCoreOutputs into RequestOutputs: incremental detokenization and stop strings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from asyncspec.core.scheduler_output import EngineCoreOutput
from asyncspec.engine.detokenizer import IncrementalDetokenizer
from asyncspec.outputs import RequestOutput, TokenLogprobs
from asyncspec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class ProcessedOutputs:
    """What one step's output processing produced."""

    outputs: list[RequestOutput] = field(default_factory=list)
    """Outputs to deliver to clients."""
    stopped: list[str] = field(default_factory=list)
    """Requests a stop string ended: the core must free them."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose output processing failed (id -> reason): the core must end them as errors."""
    cut_runs: list[tuple[int, int, int]] = field(default_factory=list)
    """(tokens cut, accepted drafts as counted, accepted drafts kept) for every run of tokens that a
    stop string cut: the core's counters must drop what was never delivered."""


@dataclass
class RequestState:
    """The output side of one request (the scheduler owns the rest)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stream_deltas: bool
    """True: each output carries only what is new; False: one cumulative output at the end."""
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0
    queued_seconds: float | None = None
    num_cached_tokens: int = 0
    """The prompt tokens the prefix cache held, as the core last reported: an abort's final output repeats it."""
    deferred_text: bool = False
    """The output is delivered only at its end (not streamed) and no stop string needs each step's text: a step
    only collects tokens, and the text is made once at the end (a decode of them all gives what one step at a
    time would)."""


class OutputProcessor:
    """Owns every live request's output state."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream_deltas: bool
    ) -> None:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        state = RequestState(request_id, prompt_token_ids, params, stream_deltas, detokenizer)
        state.deferred_text = not stream_deltas and not params.stop
        self.states[request_id] = state

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def remove_request(self, request_id: str) -> None:
        """Forgets a request without an output (its admission to the core failed)."""
        self.states.pop(request_id, None)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """The outputs to deliver, plus the ids the core must still end: those a stop string ended
        and those whose output processing failed (they fail alone)."""
        processed = ProcessedOutputs()
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue
            if state.queued_seconds is None:
                state.queued_seconds = core.queued_seconds
            state.num_cached_tokens = core.num_cached_tokens
            if state.deferred_text and core.finish_reason is None:
                # A step of a whole output with no stop string: nothing to detokenize, cut or deliver yet.
                self._collect(state, core)
                state.num_accepted_tokens += core.num_accepted_tokens
                continue
            try:
                output = self._process_one(state, core, processed)
            except Exception as e:  # a detokenizer failure ends this request, not the engine
                logger.warning("output processing failed for request %s: %r", core.request_id, e)
                error = f"output processing failed: {e!r}"
                if core.finish_reason is None:
                    processed.failed[core.request_id] = error
                output = self._make_error_output(state, error, core.num_cached_tokens)
            if output is not None:
                processed.outputs.append(output)
        return processed

    def _process_one(
        self, state: RequestState, core: EngineCoreOutput, processed: ProcessedOutputs
    ) -> RequestOutput | None:
        if core.finish_reason == "error":
            return self._make_error_output(state, core.error or "the request failed", core.num_cached_tokens)
        finish_reason, stop_reason = core.finish_reason, core.stop_reason
        self._collect(state, core)
        num_accepted = core.num_accepted_tokens
        detok = state.detokenizer
        if detok is not None and not state.deferred_text:
            stop_string = detok.update(_text_token_ids(state, core.new_token_ids, finish_reason))
            if stop_string is not None:
                # Tokens after the one that completed the stop string are never delivered, nor
                # counted as accepted drafts.
                num_cut = len(state.token_ids) - detok.num_output_tokens
                if num_cut > 0:
                    kept = min(num_accepted, max(len(core.new_token_ids) - num_cut, 0))
                    processed.cut_runs.append((num_cut, num_accepted, kept))
                    num_accepted = kept
                del state.token_ids[detok.num_output_tokens :]
                del state.logprobs[detok.num_output_tokens :]
                if finish_reason in (None, "length", "stop"):
                    if finish_reason is None:
                        processed.stopped.append(core.request_id)
                    # Also over a stop token or EOS of the same step (as vLLM): the text and token ids end at
                    # the stop string, and that token, if it came later, was cut.
                    finish_reason, stop_reason = "stop", stop_string
        state.num_accepted_tokens += num_accepted
        return self._make_output(state, finish_reason, stop_reason, core.num_cached_tokens)

    @staticmethod
    def _collect(state: RequestState, core: EngineCoreOutput) -> None:
        """A step's tokens, logprobs and draft counts into the request's state (its accepted drafts are the
        caller's: a stop string may cut some)."""
        state.token_ids.extend(core.new_token_ids)
        if core.new_logprobs:
            state.logprobs.extend(core.new_logprobs)
        if core.num_draft_tokens:
            state.num_draft_tokens += core.num_draft_tokens
            state.num_drafts += core.num_drafts

    def _make_error_output(self, state: RequestState, error: str, num_cached_tokens: int) -> RequestOutput:
        """The final output of a request that failed alone; it carries no new tokens."""
        self.states.pop(state.request_id, None)
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=[] if state.stream_deltas else list(state.token_ids),
            finish_reason="error",
            num_cached_tokens=num_cached_tokens,
            error=error,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request's output stream with finish_reason "abort"."""
        state = self.states.get(request_id)
        if state is None:
            return None
        return self._make_output(state, "abort", None, state.num_cached_tokens)

    def _make_output(
        self, state: RequestState, finish_reason: str | None, stop_reason, num_cached_tokens: int
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        if finished:
            del self.states[state.request_id]
        if not state.stream_deltas and not finished:
            return None
        detok = state.detokenizer
        if detok is not None and finished:
            if state.deferred_text:
                detok.update(_text_token_ids(state, state.token_ids[detok.num_output_tokens :], finish_reason))
            detok.finish()
        if state.stream_deltas:
            token_ids = state.token_ids[state.num_sent_tokens :]
            logprobs = state.logprobs[state.num_sent_logprobs :]
            text = detok.get_text_delta(finished) if detok is not None else ""
        else:
            token_ids, logprobs = list(state.token_ids), list(state.logprobs)
            text = detok.output_text if detok is not None else ""
        state.num_sent_tokens = len(state.token_ids)
        state.num_sent_logprobs = len(state.logprobs)
        if not finished and not token_ids and not text:
            return None
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=token_ids,
            text=text,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs if state.sampling_params.logprobs is not None else None,
            num_cached_tokens=num_cached_tokens,
            queued_seconds=state.queued_seconds,
            num_draft_tokens=state.num_draft_tokens,
            num_accepted_tokens=state.num_accepted_tokens,
            num_drafts=state.num_drafts,
        )


def _text_token_ids(state: RequestState, token_ids: list[int], finish_reason: str | None) -> list[int]:
    """The tokens whose text the output gets: as vLLM, the EOS / stop token that ended the request stays in
    token_ids but its text is left out, unless include_stop_str_in_output."""
    if finish_reason == "stop" and token_ids and not state.sampling_params.include_stop_str_in_output:
        return token_ids[:-1]
    return token_ids
