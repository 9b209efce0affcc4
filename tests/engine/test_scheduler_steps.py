"""The adaptive multi-step tuner (engine/scheduler_steps.py) against a simulated loop: a host whose work per plan
is a + b K and a device whose step takes g, with the asynchronous loop's period, wait and idle derived from them
as the engine measures them."""

from __future__ import annotations

import random

import pytest

from asyncspec.config import AUTO_SCHEDULER_STEPS, EngineConfig
from asyncspec.engine.scheduler_steps import MIN_OBSERVATIONS, SchedulerStepsTuner, initial_scheduler_steps


def _plan(k: int, host_base: float, host_per_step: float, device_step: float, jitter: float = 0.0, rng=None):
    """One steady plan of k steps: (period, wait, device idle) as the engine measures them."""
    host = host_base + host_per_step * k
    if jitter:
        host *= 1.0 + rng.uniform(-jitter, jitter)
    device = device_step * k
    return max(host, device), max(device - host, 0.0), max(host - device, 0.0)


def _run(tuner: SchedulerStepsTuner, plans: int, **plant) -> tuple[list[int], list[float]]:
    """Plans through the tuner; the steps it chose and each plan's device idle fraction."""
    chosen, idle_fractions = [], []
    for _ in range(plans):
        k = tuner.steps
        period, wait, idle = _plan(k, **plant)
        idle_fractions.append(idle / period)
        chosen.append(tuner.observe(k, period, wait, idle))
    return chosen, idle_fractions


def test_a_host_bound_loop_gets_the_fewest_steps_that_keep_the_device_busy():
    """The bundled target at batch 64 (H200, 2026-11-29): 0.75 ms of host work per plan, a 0.40 ms step. One
    step a plan leaves the device idle 47 % of the time; the tuner settles on 3 (2 would leave no margin
    for the host's jitter), and from then on the device does not idle."""
    tuner = SchedulerStepsTuner(max_steps=AUTO_SCHEDULER_STEPS)
    chosen, idle = _run(tuner, 40, host_base=0.70e-3, host_per_step=0.05e-3, device_step=0.40e-3)
    assert chosen[: MIN_OBSERVATIONS - 1] == [1] * (MIN_OBSERVATIONS - 1)  # nothing changes before enough plans
    assert idle[0] > 0.4
    assert chosen[-1] == 3 and chosen[-20:] == [3] * 20
    assert max(idle[-20:]) == 0.0


def test_a_device_bound_loop_keeps_one_step_a_plan():
    """A 1B-class model: the host's 0.3 ms hide behind a 1 ms step."""
    tuner = SchedulerStepsTuner(max_steps=AUTO_SCHEDULER_STEPS)
    chosen, _ = _run(tuner, 50, host_base=0.25e-3, host_per_step=0.05e-3, device_step=1.0e-3)
    assert set(chosen) == {1}


def test_a_device_that_barely_idles_keeps_one_step_a_plan():
    """The bundled target at batch 1: host work about equal to the step, 1.3 % idle (under the 2 % that raises
    K). The device time measured between a step's events includes its waits for kernels the host is still
    enqueueing, so the estimate alone would have asked for 2."""
    tuner = SchedulerStepsTuner(max_steps=AUTO_SCHEDULER_STEPS)
    for _ in range(60):
        assert tuner.observe(1, 0.152e-3, 0.0, 0.002e-3) == 1
    assert tuner.host_seconds / tuner.device_step_seconds * 1.25 > 1  # what the estimate alone says


def test_steps_come_back_down_when_the_host_catches_up():
    tuner = SchedulerStepsTuner(max_steps=AUTO_SCHEDULER_STEPS)
    _run(tuner, 40, host_base=0.70e-3, host_per_step=0.05e-3, device_step=0.40e-3)
    assert tuner.steps == 3
    # Fewer requests: the host's work shrinks more than the step.
    chosen, idle = _run(tuner, 60, host_base=0.10e-3, host_per_step=0.02e-3, device_step=0.30e-3)
    assert chosen[-1] == 1 and chosen[-20:] == [1] * 20
    assert max(idle[-20:]) == 0.0


def test_the_ceiling_holds():
    tuner = SchedulerStepsTuner(max_steps=2)
    chosen, _ = _run(tuner, 40, host_base=2.0e-3, host_per_step=0.0, device_step=0.2e-3)
    assert max(chosen) == 2 and chosen[-1] == 2


def test_a_jittery_host_near_the_boundary_does_not_flip_between_lengths():
    """Host work within +-15 % of 1.5 device steps: the tuner only raises (to 2, or to 3 once a jittery run
    pushes the estimate over the margin), never flips back, and the device stays busy."""
    rng = random.Random(7)
    tuner = SchedulerStepsTuner(max_steps=AUTO_SCHEDULER_STEPS)
    chosen, idle = _run(tuner, 240, host_base=0.60e-3, host_per_step=0.0, device_step=0.40e-3, jitter=0.15, rng=rng)
    assert all(b >= a for a, b in zip(chosen, chosen[1:], strict=False)), chosen
    assert chosen[-1] in (2, 3) and sum(1 for a, b in zip(chosen, chosen[1:], strict=False) if a != b) <= 2
    assert sum(idle[-200:]) / 200 < 0.03


def test_unusable_observations_change_nothing():
    tuner = SchedulerStepsTuner(max_steps=4)
    for _ in range(10):
        assert tuner.observe(1, 0.0, 0.0, 0.0) == 1  # no period (first plan after a pause)
        assert tuner.observe(0, 1e-3, 0.0, 0.0) == 1
        assert tuner.observe(1, 1e-3, 0.0, 1e-3) == 1  # all idle: no device time to divide by
    assert tuner.num_observations == 0


@pytest.mark.parametrize(
    "kwargs, adaptive, ceiling",
    [
        (dict(device="cuda"), True, AUTO_SCHEDULER_STEPS),  # the CUDA default: asynchronous, no speculation
        (dict(device="cuda", async_scheduling=False), False, 1),  # the reference loop plans every step
        # Speculation too: its plans at k = 0 may take several steps.
        (dict(device="cuda", speculative_method="ngram", num_speculative_tokens=3), True, AUTO_SCHEDULER_STEPS),
        (dict(device="cuda", speculative_method="ngram", num_speculative_tokens=3, num_scheduler_steps=3), False, 3),
        (dict(device="cuda", num_scheduler_steps=2), False, 2),  # a fixed count
        (dict(device="cuda", num_scheduler_steps=1), False, 1),
        (dict(device="cpu"), False, 1),
        (dict(device="cpu", async_scheduling=True), False, 1),  # no device events to measure the bubble by
    ],
)
def test_config_resolves_automatic_scheduler_steps(kwargs, adaptive, ceiling):
    config = EngineConfig(**kwargs)
    assert config.num_scheduler_steps == kwargs.get("num_scheduler_steps")
    assert config.adaptive_scheduler_steps is adaptive
    assert config.max_scheduler_steps == ceiling


@pytest.mark.parametrize(
    "kwargs, initial",
    [
        (dict(device="cuda"), 1),  # no speculation: raised once the device is seen idling
        # k = 0 plans are measured at several steps from the first, so k = 0 is priced per step as it runs.
        (dict(device="cuda", speculative_method="ngram", num_speculative_tokens=3), AUTO_SCHEDULER_STEPS),
        (dict(device="cuda", speculative_method="ngram", num_speculative_tokens=3, num_scheduler_steps=3), 3),
        (dict(device="cpu", speculative_method="ngram", num_speculative_tokens=3), 1),
    ],
)
def test_speculating_engines_start_at_the_ceiling(kwargs, initial):
    assert initial_scheduler_steps(EngineConfig(**kwargs)) == initial


def test_a_device_bound_loop_started_at_the_ceiling_comes_down():
    """A speculating engine's k = 0 plans start at the ceiling: where the device is the slower side (host work
    0.2 ms a plan, a 0.6 ms step), the tuner lowers the count to 1 once it has measured that, and keeps it."""
    tuner = SchedulerStepsTuner(max_steps=AUTO_SCHEDULER_STEPS, steps=AUTO_SCHEDULER_STEPS)
    chosen, _ = _run(tuner, 60, host_base=0.2e-3, host_per_step=0.0, device_step=0.6e-3)
    assert chosen[: MIN_OBSERVATIONS - 1] == [AUTO_SCHEDULER_STEPS] * (MIN_OBSERVATIONS - 1)
    assert chosen[-50:] == [1] * 50, chosen
    # A host-bound one (1.2 ms a plan, a 0.3 ms step) keeps the ceiling: the device needs every step of it.
    tuner = SchedulerStepsTuner(max_steps=AUTO_SCHEDULER_STEPS, steps=AUTO_SCHEDULER_STEPS)
    chosen, idle = _run(tuner, 60, host_base=1.2e-3, host_per_step=0.0, device_step=0.3e-3)
    assert chosen == [AUTO_SCHEDULER_STEPS] * 60
