"""LLMEngine: request validation, tokenization, the engine core and output processing, synchronously."""

from __future__ import annotations

import logging
import numbers
import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from asyncspec.config import EngineConfig
from asyncspec.core.scheduler_output import EngineCoreOutput
from asyncspec.engine.engine_core import EngineCore
from asyncspec.engine.output_processor import OutputProcessor
from asyncspec.errors import InvalidRequestError, InvalidSamplingParamsError, ModelLoadError, QueueFullError
from asyncspec.models.model_config import ModelConfig
from asyncspec.outputs import RequestOutput
from asyncspec.request import Request
from asyncspec.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from asyncspec.worker.profiler import ProfileSummary

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int]


def load_tokenizer(path: str) -> Tokenizer:
    if not os.path.isdir(path):
        raise ModelLoadError(
            f"directory {path!r} does not exist or is not a directory (the model's, where tokenizer= names no other)"
        )
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ModelLoadError(f"no tokenizer.json in {path!r}; pass tokenizer=<dir> or skip_tokenizer_init=True")
    return Tokenizer.from_file(file)


def sampling_defaults(config: EngineConfig, model_config: ModelConfig) -> dict[str, Any]:
    """The SamplingParams fields a request that leaves them unset takes from the model (see
    EngineConfig.generation_config), checked as SamplingParams checks them; logged once, as vLLM does, since
    they change what unset means."""
    if model_config.generation_config_error is not None:
        if config.generation_config == "auto":
            raise ModelLoadError(
                f"{model_config.generation_config_error}; generation_config='none' (--generation-config none) "
                "ignores the file"
            )
        logger.warning("ignoring the model's generation_config.json: %s", model_config.generation_config_error)
    if config.generation_config != "auto" or not model_config.sampling_defaults:
        return {}
    defaults = dict(model_config.sampling_defaults)
    try:
        SamplingParams(**defaults)
    except InvalidSamplingParamsError as e:
        raise ModelLoadError(
            f"the generation_config.json of {config.model!r} recommends a value a request cannot take: {e}; "
            "generation_config='none' (--generation-config none) ignores the file"
        ) from None
    logger.info(
        "sampling defaults from the model's generation_config.json: %s (generation_config='none' ignores them)",
        defaults,
    )
    return defaults


class LLMEngine:
    """Synchronous engine: `add_request` then `step()` until `has_unfinished_requests()` is False."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer_path)
        # Before the model loads (on every rank): a bad recommendation fails in a moment, not after minutes.
        model_config = ModelConfig.from_pretrained(config.model)
        self.sampling_defaults = sampling_defaults(config, model_config)
        self.engine_core = EngineCore(config, model_config)
        self.model_config = self.engine_core.model_config
        self.max_model_len = self.engine_core.max_model_len
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)

    def default_sampling_params(self) -> SamplingParams:
        """The parameters of a request that gives none: the model's generation_config.json recommendations
        (generation_config="auto") over SamplingParams' defaults."""
        return SamplingParams(**self.sampling_defaults)

    def check_health(self) -> None:
        """Raises WorkerDiedError if a tensor-parallel worker process has died."""
        self.engine_core.check_health()

    def shutdown(self) -> None:
        """Stops the worker processes (tensor parallelism) and the CPU stream thread; idempotent."""
        self.engine_core.shutdown()

    def start_profile(self, trace_dir: str | Path, with_cpu: bool = True) -> None:
        self.engine_core.start_profile(trace_dir, with_cpu)

    def stop_profile(self) -> list[ProfileSummary]:
        return self.engine_core.stop_profile()

    # -- validation ------------------------------------------------------------------------
    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validates and tokenizes without touching engine state (so a bad request changes nothing)."""
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate_for_engine(self.config.max_stop_strings, self.vocab_size)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if self.output_processor.has_request(request_id):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use by a running request")
        if isinstance(priority, bool) or not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidRequestError(f"priority must be a 64-bit signed integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            # As vLLM: a priority this engine would ignore is refused rather than silently dropped.
            raise InvalidRequestError(
                f"priority {priority} needs scheduling_policy 'priority' (this engine schedules "
                f"{self.config.scheduling_policy!r})"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer, but this engine was started with skip_tokenizer_init=True: "
                "pass stop_token_ids instead"
            )
        prompt_token_ids = self._tokenize(prompt)
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens, but max_model_len is {self.max_model_len}: "
                "at least one position must be left to generate"
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
        )

    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine was started without a tokenizer: pass token ids")
            try:
                # As Hugging Face and vLLM do: the tokenizer's post-processor adds what the model was trained
                # to see first (Llama's <s> / <|begin_of_text|>); token-id prompts are taken as they are.
                ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
            except TypeError as e:  # the tokenizer refuses what UTF-8 cannot hold (lone surrogates)
                raise InvalidRequestError(f"the prompt is not valid Unicode text: {e}") from None
            if ids and max(ids) >= self.vocab_size:
                # A tokenizer with added tokens past the model's rows (a mismatched --tokenizer, some fine-tunes):
                # such an id must never reach the embedding lookup, which would fail the whole step.
                bad = next(t for t in ids if t >= self.vocab_size)
                raise InvalidRequestError(
                    f"the tokenizer gave token id {bad} ({self.tokenizer.id_to_token(bad)!r}), outside the model's "
                    f"vocabulary [0, {self.vocab_size}): the tokenizer does not match the model"
                )
        elif isinstance(prompt, (bytes, bytearray)):
            # A Sequence of ints too, but never meant as token ids.
            raise InvalidRequestError("a prompt is a str or a list of token ids, got bytes: decode it to str first")
        elif isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
            raw: Any = prompt.tolist() if hasattr(prompt, "tolist") else prompt  # a tensor / array, or a list
            ids = list(raw)
            # The common case in C (a set of types, min and max): a per-token loop costs ~1 us a token.
            if not ids or set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= self.vocab_size:
                ids = self._check_token_ids(ids)
        else:
            raise InvalidRequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def _check_token_ids(self, ids: list[Any]) -> list[int]:
        """The ids as Python ints (NumPy's integers taken); raises for the first entry that is not a token id of
        this vocabulary."""
        checked = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidRequestError(f"prompt token {i} is {t!r}, not an integer token id")
            t = int(t)
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(f"prompt token {i} is {t}, outside the vocabulary [0, {self.vocab_size})")
            checked.append(t)
        return checked

    def _num_queued_beyond_free_slots(self) -> int:
        """Requests that will really wait: those the next step can admit into free running slots (a burst on an
        idle engine arrives before any step) are not queued behind anyone."""
        scheduler = self.engine_core.scheduler
        free_slots = max(self.config.max_num_seqs - len(scheduler.running), 0)
        return max(len(scheduler.waiting) - free_slots, 0)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request, stream_deltas: bool = True, enforce_queue_limit: bool = True) -> None:
        """Queues a validated request. The offline LLM.generate submits its whole batch at once and
        passes enforce_queue_limit=False; online callers get QueueFullError past max_num_waiting."""
        if self.output_processor.has_request(request.request_id):
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use by a running request")
        if enforce_queue_limit and self._num_queued_beyond_free_slots() >= self.config.max_num_waiting:
            raise QueueFullError(
                f"{self.config.max_num_waiting} requests are already waiting (max_num_waiting); retry later"
            )
        self.output_processor.add_request(
            request.request_id, request.prompt_token_ids, request.sampling_params, stream_deltas
        )
        try:
            self.engine_core.add_request(request)
        except BaseException:
            self.output_processor.remove_request(request.request_id)  # all or nothing
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Ends the requests at once, frees their KV blocks, returns their final "abort" outputs."""
        ids = list(request_ids)
        self.engine_core.abort_requests(ids)
        outputs = []
        for request_id in ids:
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self.process(self.engine_core.step())

    def process(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Detokenizes and applies stop strings to a retired step's outputs; ends what they stopped."""
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.stopped:
            self.engine_core.finish_stopped(processed.stopped)
        if processed.failed:
            self.engine_core.fail_requests(processed.failed)
        for num_cut, counted, kept in processed.cut_runs:
            self.engine_core.scheduler.uncount_cut_run(num_cut, counted, kept)
        return processed.outputs

    def stats(self) -> dict[str, float]:
        scheduler = self.engine_core.scheduler
        kv = self.engine_core.kv_cache_manager
        prefix = kv.prefix_cache_stats
        return {
            "num_steps": scheduler.stats.num_steps,
            "num_device_steps": scheduler.stats.num_device_steps,
            "scheduler_steps_per_plan": scheduler.steps_per_plan,
            "num_preemptions": scheduler.stats.num_preemptions,
            "num_admission_deferrals": scheduler.stats.num_admission_deferrals,
            "num_prefix_sharing_waits": scheduler.stats.num_prefix_sharing_waits,
            "num_prompt_tokens_computed": scheduler.stats.num_prompt_tokens_computed,
            "num_prompt_tokens": scheduler.stats.num_prompt_tokens,
            "num_prompt_tokens_cached": scheduler.stats.num_prompt_tokens_cached,
            "num_generation_tokens": scheduler.stats.num_generation_tokens,
            "num_finished_requests": scheduler.stats.num_finished_requests,
            "spec_num_drafts": scheduler.stats.num_drafts,
            "spec_num_draft_tokens": scheduler.stats.num_draft_tokens,
            "spec_num_accepted_tokens": scheduler.stats.num_accepted_tokens,
            "spec_mean_acceptance_length": (
                1.0 + scheduler.stats.num_accepted_tokens / scheduler.stats.num_drafts
                if scheduler.stats.num_drafts
                else 0.0
            ),
            **{f"spec_accepted_at_position_{i}": n for i, n in enumerate(scheduler.stats.accepted_per_position)},
            **{f"spec_steps_with_k_{k}": n for k, n in sorted(scheduler.stats.steps_per_speculative_k.items())},
            "spec_acceptance_rate_estimate": scheduler.spec_policy.acceptance_rate,
            "num_running_requests": len(scheduler.running),
            "num_waiting_requests": len(scheduler.waiting),
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "num_kv_blocks": kv.num_blocks,
            "num_free_kv_blocks": kv.num_free_blocks,
            "kv_cache_usage": kv.usage,
            **self.engine_core.runner.graph_stats(),
            **self.engine_core.step_timings.as_stats(),
            **self.engine_core.startup_timings.as_stats(),
        }
