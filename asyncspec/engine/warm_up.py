"""Start-up warm-up: a few dummy requests through the whole engine before the first real one.

Triton compiles a kernel the first time a process launches it with a new variant (its constexpr tile, a
dtype, a model's head count), 0.05-0.7 s each on an H200, or loads it from the disk cache. Graph capture
compiles the decode and verification variants, but the eager paths (prefill chunks of the target and the
draft, a prefill joining running decodes, the sampler with temperature, penalties or logprobs,
verification of a mixed batch, speculation's k = 0 steps, multi-step plans) compiled theirs mid-run: a
steady draft-model window at batch 64 measured 2.68 ms a step against 1.03 ms once warm (docs/benchmarks.md).
The warm-up runs those paths once, in waves, then forgets what they taught the scheduler (statistics, the
speculation policy's estimates) and the timings. The dummy requests' blocks go back to the pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncspec.core.spec_policy import SpeculationPolicy
from asyncspec.request import Request
from asyncspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncspec.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

WARM_UP_REQUEST_PREFIX = "__asyncspec_warm_up__"
"""Request ids of the dummy requests (never reach an output processor or a client)."""

MAX_WARM_UP_STEPS = 2000
"""A guard: the waves take a few dozen steps; more means a request could not be scheduled."""


@dataclass(frozen=True)
class WarmUpStats:
    """What the warm-up ran: reported at start-up."""

    num_requests: int
    num_steps: int
    seconds: float


def _prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    # Spread over the vocabulary, distinct per request (distinct prefix-cache hashes).
    return [(seed * 7919 + j * 104729 + 13) % vocab_size for j in range(length)]


def _waves(core: EngineCore) -> list[list[tuple[int, list[Request]]]]:
    """Each wave: (engine steps to run before adding them, requests). A long prompt (chunked when the
    token budget allows: tall attention tiles, a chunk that samples nothing); short greedy prompts together
    (medium tiles, an all-greedy eager step); then mixed sampling (temperature, top-k/p, penalties, logprobs,
    min_tokens) with a prompt joining the running decodes (short tiles, an eager step of decodes and a
    prefill)."""
    config, vocab = core.config, core.model_config.vocab_size
    max_len, k = core.max_model_len, config.num_speculative_tokens
    new_tokens = 2 * (k + 1) + 2
    room = max_len - new_tokens - k - 2
    if room < 2:
        return []
    long_len = min(config.max_num_batched_tokens + 32, room, 4 * 1024)
    short_len = min(24, room)
    joining_len = min(40, room)
    width = max(1, min(config.max_num_seqs - 1, 8))
    counter = iter(range(10**9))

    def request(length: int, params: SamplingParams) -> Request:
        i = next(counter)
        return Request(f"{WARM_UP_REQUEST_PREFIX}-{i}", _prompt(i, length, vocab), params)

    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    mixed = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=new_tokens, ignore_eos=True),
        greedy,
        SamplingParams(temperature=1.0, presence_penalty=0.5, logprobs=2, max_tokens=new_tokens, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2, max_tokens=new_tokens, ignore_eos=True),
    ]
    return [
        [(0, [request(long_len, greedy)])],
        [(0, [request(short_len, greedy) for _ in range(width)])],
        [
            (0, [request(short_len, mixed[i % len(mixed)]) for i in range(width)]),
            (2, [request(joining_len, greedy)]),
        ],
    ]


def _run_wave(core: EngineCore, wave: list[tuple[int, list[Request]]]) -> int:
    """Adds the wave's requests at their offsets and steps until every one finished; returns the steps."""
    steps = 0
    pending = list(wave)
    while pending or core.has_unfinished_requests():
        while pending and pending[0][0] <= steps:
            for request in pending.pop(0)[1]:
                core.add_request(request)
        if steps >= MAX_WARM_UP_STEPS:
            raise RuntimeError(f"the start-up warm-up did not finish in {MAX_WARM_UP_STEPS} steps")
        core.step()
        steps += 1
    return steps


def warm_up(core: EngineCore) -> WarmUpStats:
    """Runs the waves (with speculation: at the largest k, then again at k = 0, the plain steps of an engine
    that adapts k), then resets what they touched. Call on an idle engine."""
    if core.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine: requests are running")
    start = time.perf_counter()
    num_requests = num_steps = 0
    max_k = core.config.num_speculative_tokens
    # Without adaptive speculation every step verifies max_k: the worker captured no k = 0 graphs, and a
    # k = 0 step would take a path the engine never runs.
    forced_ks = [max_k, 0] if max_k and core.config.adaptive_speculation else [max_k]
    if core.config.max_scheduler_steps > 1:
        # Plans of the most steps wherever they may run (the greedy waves' decodes): the multi-step launch
        # paths. An adaptive engine's tuner would shorten them; reset_after_warm_up makes a fresh one.
        core.scheduler_steps_tuner = None
        core.scheduler.set_steps_per_plan(core.config.max_scheduler_steps)
    for k in forced_ks:
        if max_k:
            # One choice only: the policy picks it at every step (step_cost set, so it decides at all).
            core.scheduler.spec_policy = SpeculationPolicy(max_k, choices=[k], step_cost=lambda n, k: 1.0)
        for wave in _waves(core):
            num_requests += sum(len(requests) for _, requests in wave)
            num_steps += _run_wave(core, wave)
    core.reset_after_warm_up()
    stats = WarmUpStats(num_requests, num_steps, time.perf_counter() - start)
    logger.info(
        "warm-up: %d dummy requests in %d steps, %.2f s (eager kernel variants compiled or loaded)",
        stats.num_requests,
        stats.num_steps,
        stats.seconds,
    )
    return stats
