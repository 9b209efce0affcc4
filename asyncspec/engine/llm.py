"""LLM: the synchronous, offline entry point (`LLM(model, **config).generate(prompts, params)`)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncspec.config import make_config
from asyncspec.engine.llm_engine import LLMEngine, PromptType
from asyncspec.errors import InvalidRequestError
from asyncspec.outputs import RequestOutput
from asyncspec.sampling_params import SamplingParams
from asyncspec.worker.profiler import ProfileSummary


class LLM:
    """Offline batch generation. Keyword arguments are the fields of EngineConfig."""

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.config = make_config(model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._next_id = 0

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in prompt order."""
        prompts = _prompt_batch(prompts)
        params = self._expand(sampling_params, len(prompts), "sampling_params")
        priorities = self._expand(priority, len(prompts), "priority") if priority is not None else [0] * len(prompts)
        # Validate everything first: a bad prompt anywhere leaves the engine untouched.
        requests = []
        for prompt, p, prio in zip(prompts, params, priorities, strict=True):
            requests.append(self.engine.make_request(prompt, p, f"llm-{self._next_id}", prio))
            self._next_id += 1
        order = {r.request_id: i for i, r in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(requests)
        try:
            for request in requests:
                self.engine.add_request(request, stream_deltas=False, enforce_queue_limit=False)
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[order[output.request_id]] = output
        finally:
            unfinished = [r.request_id for r, out in zip(requests, results, strict=True) if out is None]
            if unfinished:
                self.engine.abort_requests(unfinished)
        return results  # type: ignore[return-value]

    @staticmethod
    def _expand(value, n: int, name: str) -> list:
        if value is None:
            return [None] * n  # the engine's defaults (with the model's generation_config.json)
        if isinstance(value, (SamplingParams, int)):
            return [value] * n
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            kind = "a SamplingParams or a list of them" if name == "sampling_params" else "an int or a list of ints"
            raise InvalidRequestError(f"{name} must be {kind}, got {type(value).__name__}")
        value = list(value)
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts")
        return value

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no sampling params (vLLM's name): the model's
        generation_config.json recommendations over SamplingParams' defaults (EngineConfig.generation_config)."""
        return self.engine.default_sampling_params()

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor parallelism) and threads; idempotent. Also
        run on leaving a `with LLM(...) as llm:` block, and at exit for an engine never shut down."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def start_profile(self, trace_dir: str | Path, with_cpu: bool = True) -> None:
        """Starts torch.profiler (CUDA activity, and the host's ops unless with_cpu=False, which
        slows the host far less) in each process that runs the model: this one, or every
        tensor-parallel rank. Raises ProfilerError if it is already running."""
        self.engine.start_profile(trace_dir, with_cpu)

    def stop_profile(self) -> list[ProfileSummary]:
        """Stops it: each process writes a Chrome trace into trace_dir ("engine-*.trace.json" or
        "rank<N>-*.trace.json") and its summary (device busy time, time per kernel) is returned."""
        return self.engine.stop_profile()

    def stats(self) -> dict[str, float]:
        """Counters since start: steps, preemptions, prefix-cache queries and hits, tokens, KV blocks."""
        return self.engine.stats()

    def get_tokenizer(self):
        return self.engine.tokenizer


def _prompt_batch(prompts: Any) -> list[PromptType]:
    """One prompt (a str, a list of token ids, a 1-D tensor or array) or a batch of them (any iterable; a 2-D tensor
    or array) as a list of prompts; anything else is an InvalidRequestError naming what a prompt may be."""
    raw: Any = prompts.tolist() if hasattr(prompts, "tolist") else prompts
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, (bytes, bytearray, Mapping)) or not isinstance(raw, Iterable):
        raise InvalidRequestError(
            f"prompts must be a str, a list of token ids, or a list of those; got {type(raw).__name__}"
        )
    if not isinstance(raw, Sequence):
        raw = list(raw)  # a generator
    if raw and isinstance(raw[0], numbers.Integral) and not isinstance(raw[0], bool):
        return [raw]
    return list(raw)
