"""Turns EngineCoreOutputs into RequestOutputs: incremental detokenization and stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenizers import Tokenizer

from asyncspec.core.scheduler_output import EngineCoreOutput, TokenLogprobs
from asyncspec.engine.detokenizer import IncrementalDetokenizer
from asyncspec.outputs import RequestOutput
from asyncspec.sampling_params import SamplingParams


@dataclass
class RequestState:
    """The output side of one request (the scheduler owns the rest)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stream_deltas: bool
    """True: each output carries only what is new; False: one cumulative output at the end."""
    detokenizer: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0


class OutputProcessor:
    """Owns every live request's output state."""

    def __init__(self, tokenizer: Optional[Tokenizer]) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream_deltas: bool
    ) -> None:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        self.states[request_id] = RequestState(request_id, prompt_token_ids, params, stream_deltas, detokenizer)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.states

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver and the ids that a stop string ended (to free in the core)."""
        results: list[RequestOutput] = []
        stopped_by_string: list[str] = []
        for core in core_outputs:
            state = self.states.get(core.request_id)
            if state is None:
                continue
            finish_reason, stop_reason = core.finish_reason, core.stop_reason
            state.token_ids.extend(core.new_token_ids)
            if core.new_logprobs:
                state.logprobs.extend(core.new_logprobs)
            detok = state.detokenizer
            if detok is not None:
                text_token_ids = core.new_token_ids
                if finish_reason == "stop" and text_token_ids and not state.sampling_params.include_stop_str_in_output:
                    # As vLLM: the EOS / stop token that ended the request stays in token_ids but its
                    # text is left out, unless include_stop_str_in_output.
                    text_token_ids = text_token_ids[:-1]
                stop_string = detok.update(text_token_ids)
                if stop_string is not None:
                    # Tokens after the one that completed the stop string are never delivered.
                    del state.token_ids[detok.num_output_tokens :]
                    del state.logprobs[detok.num_output_tokens :]
                    if finish_reason is None or finish_reason == "length":
                        if finish_reason is None:
                            stopped_by_string.append(core.request_id)
                        finish_reason, stop_reason = "stop", stop_string
            output = self._make_output(state, finish_reason, stop_reason, core.num_cached_tokens)
            if output is not None:
                results.append(output)
        return results, stopped_by_string

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Ends a request's output stream with finish_reason "abort"."""
        state = self.states.get(request_id)
        if state is None:
            return None
        return self._make_output(state, "abort", None, 0)

    def _make_output(
        self, state: RequestState, finish_reason: Optional[str], stop_reason, num_cached_tokens: int
    ) -> Optional[RequestOutput]:
        finished = finish_reason is not None
        if finished:
            del self.states[state.request_id]
        if not state.stream_deltas and not finished:
            return None
        detok = state.detokenizer
        if detok is not None and finished:
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
        )
