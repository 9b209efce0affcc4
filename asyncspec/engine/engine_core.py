"""EngineCore: scheduler + KV cache manager + model runner, one synchronous step at a time."""

from __future__ import annotations

import time
from collections.abc import Iterable

from asyncspec.config import EngineConfig
from asyncspec.core.kv_cache import KVCacheManager
from asyncspec.core.scheduler import Scheduler, SchedulerConfig
from asyncspec.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from asyncspec.engine.step_timing import StepTimings
from asyncspec.errors import ConfigError
from asyncspec.models.model_config import ModelConfig
from asyncspec.request import Request, RequestStatus
from asyncspec.worker.model_runner import ModelRunner


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    # Sliding-window layers mask keys outside the window in attention; their blocks are kept.
    limit = model_config.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} positions")
    return config.max_model_len


class EngineCore:
    """Owns the scheduler and the worker; `step()` runs one schedule → execute → update cycle."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"with enable_chunked_prefill=False a prompt must fit one step: max_num_batched_tokens="
                f"{config.max_num_batched_tokens} is below max_model_len={self.max_model_len}; raise it, "
                "lower max_model_len or enable chunked prefill"
            )
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        num_blocks = self.runner.determine_num_kv_blocks()
        blocks_per_max_len = -(-self.max_model_len // config.block_size)
        if num_blocks < blocks_per_max_len:
            raise ConfigError(
                f"the KV pool holds {num_blocks} blocks of {config.block_size} tokens, fewer than one request of "
                f"max_model_len={self.max_model_len} needs ({blocks_per_max_len}); raise num_kv_blocks / "
                "kv_cache_bytes / gpu_memory_utilization or lower max_model_len"
            )
        self.runner.initialize_kv_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                enable_prefix_caching=config.enable_prefix_caching,
                num_lookahead_tokens=config.num_lookahead_tokens,
                num_speculative_tokens=config.num_lookahead_tokens,
                policy=config.scheduling_policy,
                adaptive_speculation=config.adaptive_speculation,
            ),
            self.kv_cache_manager,
        )
        self.scheduler.spec_policy.step_cost = self.runner.speculation_step_cost()
        self.step_timings = StepTimings()
        """CPU planning, launch gaps and device idle between steps (read by stats and metrics)."""

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def fail_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        schedule_start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        start = time.perf_counter()
        runner_output = self.runner.execute_model(scheduler_output)
        execute_end = time.perf_counter()
        if scheduler_output.num_speculative_tokens or self.config.num_speculative_tokens:
            self._observe_decode_step(scheduler_output, execute_end - start)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        idle = self.runner.last_device_idle_seconds if self.runner.device.type == "cuda" else None
        self.step_timings.record(schedule_start, start, execute_end, time.perf_counter(), idle)
        if not self.scheduler.has_unfinished_requests():
            self.step_timings.reset_gaps()
            self.runner.reset_device_idle()
        return outputs

    def _observe_decode_step(self, so: SchedulerOutput, seconds: float) -> None:
        """Feeds a pure decode step's time to the speculation policy (its host-time estimate)."""
        k = so.num_speculative_tokens
        if so.scheduled_new_reqs or any(n != k + 1 for n in so.num_scheduled_tokens.values()):
            return
        self.scheduler.spec_policy.observe_step(len(so.num_scheduled_tokens), k, seconds, so.num_proposals)
