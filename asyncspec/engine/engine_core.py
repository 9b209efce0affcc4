"""EngineCore: scheduler + KV cache manager + model runner; one step at a time, or pipelined (async)."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncspec.config import EngineConfig
from asyncspec.core.kv_cache import KVCacheManager
from asyncspec.core.scheduler import Scheduler, SchedulerConfig
from asyncspec.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from asyncspec.core.spec_policy import SpeculationPolicy
from asyncspec.engine.scheduler_steps import SchedulerStepsTuner, initial_scheduler_steps
from asyncspec.engine.step_timing import StartupTimings, StepTimings
from asyncspec.engine.warm_up import WarmUpStats, warm_up
from asyncspec.errors import ConfigError, ProfilerError
from asyncspec.layers.tensor_parallel import TensorParallel, check_divisible
from asyncspec.models.model_config import ModelConfig
from asyncspec.request import Request, RequestStatus
from asyncspec.worker.model_runner import ModelRunner, StepHandle
from asyncspec.worker.profiler import ProfileSummary, StepProfiler
from asyncspec.worker.startup_heap import freeze_startup_objects, release_frozen_objects
from asyncspec.worker.tp_executor import TensorParallelExecutor

DecodeKey = tuple[int, ...]
"""What kind of decode plan a step was (`_decode_key`): steady periods are runs of one kind."""
MAX_INFLIGHT_STEPS = 2
"""The running step and one planned behind it: a deeper pipeline only adds optimistic
over-allocation and later reconciliation (DESIGN.md, "The GPU step")."""


@dataclass
class InflightStep:
    """A launched step whose results are not yet reconciled."""

    scheduler_output: SchedulerOutput
    handle: StepHandle
    schedule_start: float
    launch_start: float
    decode_key: DecodeKey | None = None
    """`_decode_key` of its plan when speculation is configured (the policy's steady-period check reads it)."""


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    # Sliding-window layers mask keys outside the window in attention; their blocks are kept.
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} positions")
    return config.max_model_len


def _make_runner(
    config: EngineConfig, model_config: ModelConfig, max_model_len: int
) -> ModelRunner | TensorParallelExecutor:
    """The model runner in this process, or worker processes for tensor_parallel_size > 1 (or
    worker_process)."""
    size = config.tensor_parallel_size
    if size == 1 and not config.worker_process:
        return ModelRunner(config, model_config, max_model_len)
    mc = model_config
    check_divisible(TensorParallel(0, size), mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size)
    device = config.torch_device
    if device.type == "cuda":
        first, visible = device.index or 0, torch.cuda.device_count()
        if first + size > visible:
            raise ConfigError(
                f"tensor_parallel_size={size} from {device} needs cuda:{first} to cuda:{first + size - 1}, but "
                f"{visible} GPU(s) are visible; lower tensor_parallel_size or set CUDA_VISIBLE_DEVICES"
            )
    return TensorParallelExecutor(config, model_config, max_model_len)


class EngineCore:
    """Owns the scheduler and the worker; `step()` runs one schedule → execute → update cycle."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.model_config = model_config if model_config is not None else ModelConfig.from_pretrained(config.model)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"with enable_chunked_prefill=False a prompt must fit one step: max_num_batched_tokens="
                f"{config.max_num_batched_tokens} is below max_model_len={self.max_model_len}; raise it, "
                "lower max_model_len or enable chunked prefill"
            )
        if config.freeze_gc:
            # An engine dropped without shutdown but kept by a reference cycle (a user's callback holding it, say)
            # is frozen garbage: on CUDA it is freed before this one loads its weights.
            release_frozen_objects(collect=config.torch_device.type == "cuda")
        start = time.perf_counter()
        self.runner: ModelRunner | TensorParallelExecutor = _make_runner(config, self.model_config, self.max_model_len)
        self.startup_timings = StartupTimings(load_seconds=time.perf_counter() - start)
        """Where construction went (read by stats)."""
        self._profiler: StepProfiler | None = None
        """The running profiler of an in-process runner (the ranks of tensor parallelism hold their own)."""
        self._profiling = False
        try:
            self._init_engine()
        except BaseException:
            self.shutdown()
            raise

    def _init_engine(self) -> None:
        config = self.config
        start = time.perf_counter()
        num_blocks = self.runner.determine_num_kv_blocks()
        blocks_per_max_len = -(-self.max_model_len // config.block_size)
        if num_blocks < blocks_per_max_len:
            knobs = "num_kv_blocks / kv_cache_bytes"
            if config.torch_device.type == "cuda":  # the share of GPU memory sizes the pool only there
                knobs += " / gpu_memory_utilization"
            raise ConfigError(
                f"the KV pool holds {num_blocks} blocks of {config.block_size} tokens, fewer than one request of "
                f"max_model_len={self.max_model_len} needs ({blocks_per_max_len}); raise {knobs} or lower "
                "max_model_len"
            )
        self.runner.initialize_kv_cache(num_blocks)
        self.startup_timings.kv_cache_seconds = time.perf_counter() - start
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                enable_prefix_caching=config.enable_prefix_caching,
                prefix_sharing_wait_tokens=config.prefix_sharing_wait_tokens,
                num_lookahead_tokens=config.num_lookahead_tokens,
                num_speculative_tokens=config.num_lookahead_tokens,
                policy=config.scheduling_policy,
                adaptive_speculation=config.adaptive_speculation,
                num_scheduler_steps=config.max_scheduler_steps,
                admission_delay_runs=config.admission_delay_runs,
                speculate_with_prompts=config.speculate_with_prompts,
                max_draft_lag=config.max_draft_lag,
                multi_step_speculation=config.speculative_method == "draft_model",
            ),
            self.kv_cache_manager,
        )
        self.scheduler.spec_policy = self._new_spec_policy()
        self.step_timings = StepTimings()
        """CPU planning, launch gaps and device idle between steps (read by stats and metrics)."""
        self.async_scheduling = config.use_async_scheduling
        self._inflight: deque[InflightStep] = deque()
        self._last_retired_key: DecodeKey | None = None
        """The last retired step's `_decode_key`."""
        self._last_collected: float | None = None
        self.scheduler_steps_tuner = self._new_scheduler_steps_tuner()
        """Chooses each plan's decode steps (num_scheduler_steps=None on CUDA); None where they are fixed."""
        self._last_retired_decode = False
        self.retired_step_tokens: deque[int] = deque(maxlen=4096)
        """Tokens scheduled in each retired step, until a listener drains them (metrics)."""
        self.step_trace: deque[tuple[str, int, float]] = deque(maxlen=256)
        """The latest launches and collections: (event, step id, time.perf_counter)."""
        self.debug_invariants = _debug_invariants_switch()
        """ASYNCSPEC_DEBUG_INVARIANTS=1: check the placeholder invariant and the host's reconciled
        counts against the device's at every step (tests; synchronizes the device)."""
        self.runner.set_debug_invariants(self.debug_invariants)
        if config.torch_device.type == "cuda":
            stats = self.warm_up()
            self.startup_timings.warm_up_seconds, self.startup_timings.warm_up_steps = stats.seconds, stats.num_steps
        if config.freeze_gc:
            freeze_startup_objects()

    def _new_spec_policy(self) -> SpeculationPolicy:
        policy = SpeculationPolicy(self.config.num_lookahead_tokens, self.config.adaptive_speculation)
        policy.step_cost = self.runner.speculation_step_cost()
        if self.config.use_async_scheduling:
            policy.probe_length = 4  # see spec_policy.py: one steady period per probe
        return policy

    def _new_scheduler_steps_tuner(self) -> SchedulerStepsTuner | None:
        if not self.config.adaptive_scheduler_steps:
            return None
        tuner = SchedulerStepsTuner(self.config.max_scheduler_steps, steps=initial_scheduler_steps(self.config))
        self.scheduler.set_steps_per_plan(tuner.steps)
        return tuner

    def warm_up(self) -> WarmUpStats:
        """Dummy requests through the engine, so that the first real ones compile no kernel (warm_up.py).
        Runs at start-up on CUDA."""
        return warm_up(self)

    def reset_after_warm_up(self) -> None:
        """Forgets the warm-up: scheduler statistics and speculation policy, prefix-cache counters, step
        timings and traces, and the multi-step tuner's measurements."""
        self.scheduler.reset_after_warm_up(self._new_spec_policy())
        self.kv_cache_manager.take_prefix_cache_stats()
        self.step_timings = StepTimings()
        self.retired_step_tokens.clear()
        self.step_trace.clear()
        self._last_retired_key = None
        self._last_collected = None
        self.scheduler_steps_tuner = self._new_scheduler_steps_tuner()
        self._last_retired_decode = False
        self.runner.reset_device_idle()

    def check_health(self) -> None:
        """Raises WorkerDiedError if a tensor-parallel worker process has died."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Stops the worker processes (tensor parallelism) or the CPU stream thread; idempotent. A
        profiler still running in this process is stopped, its trace discarded."""
        if self._profiler is not None and isinstance(self.runner, ModelRunner):
            profiler, self._profiler = self._profiler, None
            self._profiling = False
            with contextlib.suppress(Exception):
                self.runner.call_on_stream(profiler.discard)
        self.runner.close()
        if self.config.freeze_gc:
            release_frozen_objects()

    def start_profile(self, trace_dir: str | Path, with_cpu: bool = True) -> None:
        """Starts torch.profiler in every process that runs the model (this one, or each rank)."""
        if self._profiling:
            raise ProfilerError("the profiler is already running: call stop_profile() first")
        path = Path(trace_dir).resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ProfilerError(f"cannot create the trace directory {path}: {e}") from e
        if isinstance(self.runner, TensorParallelExecutor):
            self.runner.start_profile(str(path), with_cpu)
        else:
            profiler = StepProfiler("engine", self.runner.device)
            # Where the steps run (the CPU stream's thread in the asynchronous loop on the CPU).
            self.runner.call_on_stream(lambda: profiler.start(path, with_cpu))
            self._profiler = profiler
        self._profiling = True

    def stop_profile(self) -> list[ProfileSummary]:
        """Stops the profiler after the device's queued work; one summary per process (rank order)."""
        if not self._profiling:
            raise ProfilerError("the profiler is not running: call start_profile(trace_dir) first")
        self._profiling = False
        if isinstance(self.runner, TensorParallelExecutor):
            return self.runner.stop_profile()
        assert self._profiler is not None
        profiler, self._profiler = self._profiler, None
        return [self.runner.call_on_stream(profiler.stop)]

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def fail_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or steps still in flight (their results are still to be collected)."""
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def step(self) -> list[EngineCoreOutput]:
        """One turn of the loop (see `advance`); returns the outputs of the step it retired."""
        return self.retire_oldest() if self.advance() is not None else []

    def advance(self) -> InflightStep | None:
        """Launches what the loop may launch now and returns the step to retire next (None: none
        yet). Synchronous: plan and launch one step, retire it. Asynchronous: launch the next step
        behind the one in flight, then retire the older one, so that its reconciliation overlaps the
        device's work on the newer one; a step that needs exact host counts (min_tokens) is
        launched only once the step before it was retired."""
        if not self.async_scheduling:
            if not self._inflight:  # one left by an interrupted collect (Ctrl-C) is retired first
                self.launch_next()
            return self._inflight[0] if self._inflight else None
        if self._inflight and self.scheduler.requires_exact_counts():
            return self._inflight[0]
        launched = self.launch_next() if len(self._inflight) < MAX_INFLIGHT_STEPS else None
        if self._inflight and (launched is None or len(self._inflight) == MAX_INFLIGHT_STEPS):
            return self._inflight[0]
        return None

    def launch_next(self) -> InflightStep | None:
        """Plans the next step with the optimistic view (every draft in flight accepted) and queues it
        on the device; None when no request is left to plan."""
        if not self.scheduler.has_unfinished_requests():
            return None
        schedule_start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        launch_start = time.perf_counter()
        handle = self.runner.launch(scheduler_output)
        key = _decode_key(scheduler_output) if self.config.num_speculative_tokens else None
        step = InflightStep(scheduler_output, handle, schedule_start, launch_start, key)
        self._inflight.append(step)
        self.step_trace.append(("launch", scheduler_output.step_id, launch_start))
        return step

    def retire_oldest(self) -> list[EngineCoreOutput]:
        """Collects the oldest step in flight (blocking until its results are on the host) and
        reconciles the scheduler with them."""
        step = self._inflight[0]
        runner_output = self.runner.collect(step.handle)
        # Only now: a collect interrupted while it waits (Ctrl-C) leaves the step to be retired by the next call.
        self._inflight.popleft()
        collected = time.perf_counter()
        self.step_trace.append(("collect", step.scheduler_output.step_id, collected))
        so = step.scheduler_output
        self.retired_step_tokens.append(so.total_num_scheduled_tokens * so.num_steps)
        decode_key = step.decode_key
        if decode_key is not None and self._steady_period(decode_key):
            self._observe_decode_step(so, self._step_seconds(step, collected))
        self._last_retired_key = decode_key
        if self.scheduler_steps_tuner is not None:
            self._tune_scheduler_steps(step, collected)
        plan = self.scheduler.planned_requests(so.step_id) if self.debug_invariants else {}
        outputs = self.scheduler.update_from_output(so, runner_output)
        self.step_timings.record(
            step.schedule_start, step.launch_start, collected, time.perf_counter(), self.runner.last_device_idle_seconds
        )
        self._last_collected = collected
        if not self.has_unfinished_requests():
            self.step_timings.reset_gaps()
            self.runner.reset_device_idle()
            self._last_collected = None
        if self.debug_invariants:
            self.check_reconciled(runner_output, outputs, plan)
        return outputs

    def _tune_scheduler_steps(self, step: InflightStep, collected: float) -> None:
        """Feeds a steady decode plan (it, the plan retired before it and one in flight behind it all pure
        decodes, no admission) to the adaptive multi-step tuner and applies its choice."""
        assert self.scheduler_steps_tuner is not None
        so = step.scheduler_output
        # With speculation, only plans at k = 0 that propose nothing: the plans that may take several steps.
        decode = (
            not so.scheduled_new_reqs
            and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)
            and not so.num_proposals
        )
        steady = decode and self._last_retired_decode and bool(self._inflight) and self._last_collected is not None
        self._last_retired_decode = decode
        idle = self.runner.last_device_idle_seconds
        if not steady or idle is None:
            return
        steps = self.scheduler_steps_tuner.observe(
            so.num_steps, self._step_seconds(step, collected), self.runner.last_wait_seconds, idle
        )
        if steps != self.scheduler.steps_per_plan:
            self.scheduler.set_steps_per_plan(steps)

    def _step_seconds(self, step: InflightStep, collected: float) -> float:
        """A step's cost to the loop: launch to results in the synchronous loop; in the asynchronous
        one, the time between consecutive results (the pipeline's period)."""
        if self.async_scheduling and self._last_collected is not None:
            return collected - max(self._last_collected, step.schedule_start)
        return collected - step.launch_start

    def check_reconciled(
        self, runner_output: ModelRunnerOutput, outputs: list[EngineCoreOutput], plan: dict[str, Request]
    ) -> None:
        """Debug mode (on in tests): after a step's reconciliation, every running request's
        num_computed_tokens, less what the steps still in flight added optimistically, equals the
        device's count at the end of that step; no placeholder is left once nothing is in flight;
        and no id outside the vocabulary is in a request's tokens (which feed the prefix-cache
        hashes and the detokenizer) or in an output (which reaches a client)."""
        vocab = self.model_config.vocab_size
        for output in outputs:
            if any(not 0 <= t < vocab for t in output.new_token_ids):
                raise AssertionError(f"{output.request_id}: output ids {output.new_token_ids} outside [0, {vocab})")
        device = runner_output.device_num_computed_tokens or {}
        for request_id, count in device.items():
            request = plan.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            ahead = sum(
                s.scheduler_output.num_scheduled_tokens[request_id] * s.scheduler_output.num_steps
                for s in self._inflight
                if self.scheduler.planned_requests(s.scheduler_output.step_id).get(request_id) is request
            )
            if request.num_computed_tokens - ahead != count:
                raise AssertionError(
                    f"{request_id}: the host reconciled {request.num_computed_tokens - ahead} computed tokens, "
                    f"the device holds {count}"
                )
            if not self._inflight and (request.num_output_placeholders or request.num_inflight_steps):
                raise AssertionError(f"{request_id}: placeholders or steps in flight left with no step in flight")
            if any(not 0 <= t < vocab for t in request.all_token_ids):
                raise AssertionError(f"{request_id}: token ids outside [0, {vocab}) in the request")

    def _steady_period(self, key: DecodeKey) -> bool:
        next_key = self._inflight[0].decode_key if self._inflight else None
        return steady_period(self.async_scheduling, key, self._last_retired_key, next_key)

    def _observe_decode_step(self, so: SchedulerOutput, seconds: float) -> None:
        """Feeds a pure decode plan's time per step to the speculation policy (its host-time estimate): a
        multi-step plan at k = 0 shares its host work among its steps."""
        k = so.num_speculative_tokens
        self.scheduler.spec_policy.observe_step(
            len(so.num_scheduled_tokens), k, seconds / so.num_steps, so.num_proposals
        )


def steady_period(
    async_scheduling: bool,
    key: DecodeKey,
    previous_key: DecodeKey | None,
    next_key: DecodeKey | None,
) -> bool:
    """Whether a retired decode step's time shows a steady run of its kind (`_decode_key`), given the kinds of
    the step retired before it and of the step in flight after it. Synchronous: the time is the step's own.
    Asynchronous: the period between two results also holds the previous step's retirement and the next
    step's launch, so both must be of the same kind (a probe's transitions would otherwise charge one k for
    another's draft passes)."""
    return not async_scheduling or key == previous_key == next_key


def _decode_key(so: SchedulerOutput) -> DecodeKey | None:
    """(requests, drafts verified, drafts proposed, steps) of a plan that only decodes (every request verifies
    exactly its k drafts, none admitted); None for any other plan."""
    k = so.num_speculative_tokens
    if so.scheduled_new_reqs:
        return None
    if any(n != k + 1 for n in so.num_scheduled_tokens.values()):
        return None
    return (len(so.num_scheduled_tokens), k, so.num_proposals, so.num_steps)


def _debug_invariants_switch() -> bool:
    """ASYNCSPEC_DEBUG_INVARIANTS: 1 (or true, yes, on) checks every step; unset, 0, false, no or off do not. Any
    other value is refused: a typo must not turn on a per-step device synchronization in production."""
    value = os.environ.get("ASYNCSPEC_DEBUG_INVARIANTS", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"ASYNCSPEC_DEBUG_INVARIANTS must be 0 or 1, got {value!r}")
