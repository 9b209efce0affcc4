"""Prometheus metrics: vLLM's series under the `asyncspec:` prefix, plus this engine's step timing.

Engine-wide values (running and waiting requests, KV usage, token, preemption and spec-decode counts,
step timing) are read from `AsyncEngine.stats()` at scrape time, so they are exact and never counted
twice; per-request latencies (TTFT, inter-token latency, end-to-end) are observed by the servicer as
its streams progress. Each server owns its registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "asyncspec:"
# Inter-token latency from 0.1 ms: a graphed batch-1 step of the bundled target takes about 0.2 ms on a GPU, and a
# multi-step plan's delta spreads its gap over its tokens. The upper ends follow vLLM's (overload shows, not a cap).
ITL_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")
REFUSAL_REASONS = ("queue_full", "invalid_request", "unavailable")
"""Why a Generate call was refused before it ran: RESOURCE_EXHAUSTED, INVALID_ARGUMENT, UNAVAILABLE."""

# (metric name without prefix, help, engine stats key); counters get `_total` from prometheus_client.
_GAUGES = (
    ("num_requests_running", "Requests running on the engine.", "num_running_requests"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting_requests"),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
    ("startup_load_seconds", "Start-up: loading the model runner (config, weights).", "startup_load_seconds"),
    (
        "startup_kv_cache_seconds",
        "Start-up: memory profiling, the KV pool and CUDA-graph capture.",
        "startup_kv_cache_seconds",
    ),
    ("startup_warm_up_seconds", "Start-up: the warm-up's dummy requests (CUDA).", "startup_warm_up_seconds"),
    (
        "scheduler_steps_per_plan",
        "Most decode steps the next plans may run (adaptive with num_scheduler_steps unset on CUDA).",
        "scheduler_steps_per_plan",
    ),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("num_preemptions", "Requests preempted (their KV freed, recomputed later).", "num_preemptions"),
    (
        "num_admission_deferrals",
        "Multi-step runs planned while admissible requests waited, so they are admitted in waves.",
        "num_admission_deferrals",
    ),
    (
        "num_prefix_sharing_waits",
        "Plans in which a waiting request waited for prompt blocks another request was computing (then hit).",
        "num_prefix_sharing_waits",
    ),
    (
        "prompt_tokens",
        "Prompt tokens of the requests that started generating: once per request, prefix-cache hits included.",
        "num_prompt_tokens",
    ),
    (
        "prompt_tokens_computed",
        "Prompt tokens run through prefill steps, recomputation after a preemption included.",
        "num_prompt_tokens_computed",
    ),
    ("generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("spec_decode_num_drafts", "Verification steps of a request with at least one draft.", "spec_num_drafts"),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"),
    ("num_steps", "Engine steps run.", "num_steps"),
    (
        "num_device_steps",
        "Forward steps the engine steps ran: a multi-step plan (num_scheduler_steps) counts each of its steps.",
        "num_device_steps",
    ),
    ("step_duration_seconds", "Wall time of engine steps, launch to results.", "step_execute_seconds_total"),
    ("step_scheduling_seconds", "CPU time planning engine steps.", "step_scheduling_seconds_total"),
    ("step_update_seconds", "CPU time reconciling engine steps' results.", "step_update_seconds_total"),
    ("gpu_idle_seconds", "Device idle time between consecutive steps (the bubble).", "device_idle_seconds_total"),
)


class EngineCollector(Collector):
    """Reads the engine's counters at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc, key in _GAUGES:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0.0)))
        for name, doc, key in _COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0.0)))
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the run (0 = first draft).",
            labels=["position"],
        )
        for key, value in stats.items():
            if key.startswith("spec_accepted_at_position_"):
                per_position.add_metric([key.rsplit("_", 1)[1]], float(value))
        yield per_position
        by_source = CounterMetricFamily(
            PREFIX + "prompt_tokens_by_source",
            "prompt_tokens split by where their KV came from: computed, or the prefix cache.",
            labels=["source"],
        )
        prompt, cached = stats.get("num_prompt_tokens", 0.0), stats.get("num_prompt_tokens_cached", 0.0)
        by_source.add_metric(["local_compute"], float(prompt - cached))
        by_source.add_metric(["local_cache_hit"], float(cached))
        yield by_source


class ServerMetrics:
    """The server's registry: the engine's counters and the per-request latencies."""

    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats))
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)  # every series exists from the start
        self.request_refused = Counter(
            PREFIX + "request_refused",
            "Generate calls refused before they ran (not in request_success): load shed, bad input, loading or "
            "draining.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REFUSAL_REASONS:
            self.request_refused.labels(reason)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from the request's arrival to its first token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive tokens of a request (a delta of n tokens counts n gaps).",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from the request's arrival to its last token.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time from a request's arrival to its first scheduling.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total",
            "Tokens computed per engine step.",
            buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
            registry=self.registry,
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Tokens generated per finished request.",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000),
            registry=self.registry,
        )


class RequestTimer:
    """One stream's latencies, fed to the histograms as its deltas arrive."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None
        self.num_tokens = 0
        self.finished = False
        """Whether on_finish ran: a stream counts once, whichever way it ends."""

    def on_delta(self, now: float, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        if self.last is None:
            self.metrics.time_to_first_token.observe(now - self.arrival)
            gaps = num_tokens - 1
            gap = 0.0
        else:
            gaps = num_tokens
            gap = (now - self.last) / num_tokens
        for _ in range(gaps):
            self.metrics.inter_token_latency.observe(gap)
        self.last = now
        self.num_tokens += num_tokens

    def on_finish(self, now: float, finish_reason: str, queued_seconds: float | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.metrics.request_success.labels(finish_reason).inc()
        if queued_seconds is not None:
            self.metrics.request_queue_time.observe(queued_seconds)
        self.metrics.e2e_request_latency.observe(now - self.arrival)
        self.metrics.request_generation_tokens.observe(self.num_tokens)
