"""Multi-step plans (num_scheduler_steps > 1) end to end: the engine's tokens, texts and finish reasons equal
one step per plan, in both loops, with arrivals, chunked prefill, prefix caching, stop conditions inside a
run, a request that needs the sampler, preemption and aborts; the debug mode (on in tests) checks the host's
reconciled counts against the device's after every plan."""

from __future__ import annotations

import pytest

from asyncspec import SamplingParams
from asyncspec.engine.scheduler_steps import SchedulerStepsTuner
from asyncspec.errors import ConfigError
from tests.conftest import load_prompts
from tests.engine.engine_helpers import abort_r1_while_a_step_is_in_flight, assert_ids_in_vocab, assert_kv_free
from tests.spec.spec_helpers import make_llm

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(block_size=16, max_model_len=256, max_num_seqs=4, num_kv_blocks=96)


def _run(num_steps, async_scheduling, prompts, params, **overrides):
    llm = make_llm(num_scheduler_steps=num_steps, async_scheduling=async_scheduling, **{**BASE, **overrides})
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert_kv_free(stats)
    for o in outputs:
        assert_ids_in_vocab(o.token_ids)
    return outputs, stats


def _summary(outputs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


def _workload():
    raw = load_prompts(7)
    shared = raw[0][:40]  # shares the first prompt's prefix: a prefix-cache hit once that prompt's blocks fill
    prompts = [raw[0][:60], raw[1][:40], raw[2][:90], raw[3][:30], raw[4][:50], raw[5][:45], shared + raw[6][:12]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),  # ends inside the first run
        SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"], ignore_eos=True),  # a stop string cuts a run
        SamplingParams(temperature=0.0, max_tokens=30),  # EOS possible
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[13, 9]),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3),  # the sampler: one step a plan
        SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True),
    ]
    return prompts, params


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_step_equals_one_step_per_plan(async_scheduling):
    """Seven requests through four slots (arrivals while others decode), prompts chunked at 16 tokens, a
    shared prefix: the same outputs with 4 steps a plan as with 1, in fewer plans."""
    prompts, params = _workload()
    options = dict(long_prefill_token_threshold=16, max_num_batched_tokens=64)
    ref, ref_stats = _run(1, False, prompts, params, **options)
    got, stats = _run(4, async_scheduling, prompts, params, **options)
    assert _summary(got) == _summary(ref)
    assert stats["num_generation_tokens"] == ref_stats["num_generation_tokens"]
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_steps"] < ref_stats["num_steps"], "no plan took several steps"
    assert ref_stats["num_device_steps"] == ref_stats["num_steps"]
    assert stats["num_device_steps"] > stats["num_steps"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_step_under_preemption(async_scheduling):
    prompts = [p[:64] for p in load_prompts(6)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    options = dict(num_kv_blocks=18, max_num_batched_tokens=128)
    ref, _ = _run(1, False, prompts, params, **options)
    got, stats = _run(4, async_scheduling, prompts, params, **options)
    assert stats["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_abort_while_a_multi_step_plan_is_in_flight():
    prompts = [p[:40] for p in load_prompts(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref, _ = _run(1, False, prompts, params)
    llm = make_llm(num_scheduler_steps=4, async_scheduling=True, **BASE)

    def a_multi_step_plan_in_flight(core) -> None:
        assert len(core._inflight) == 1 and core._inflight[0].scheduler_output.num_steps == 4

    abort_r1_while_a_step_is_in_flight(llm, prompts, params, ref, 3, a_multi_step_plan_in_flight)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_scheduler_steps=0), "num_scheduler_steps"),
        (dict(num_scheduler_steps=17), "num_scheduler_steps"),
        (dict(num_scheduler_steps=2.5), "num_scheduler_steps"),
    ],
)
def test_bad_num_scheduler_steps_is_refused(kwargs, field):
    from asyncspec.config import EngineConfig

    with pytest.raises(ConfigError, match=field):
        EngineConfig(device="cpu", **kwargs)


class _ScriptedTuner(SchedulerStepsTuner):
    """Returns scripted step counts; records what the engine measured."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(max_steps=4)
        self.script = iter(script)
        self.calls: list[tuple[int, float, float, float]] = []

    def observe(self, num_steps: int, period: float, wait: float, device_idle: float) -> int:
        self.calls.append((num_steps, period, wait, device_idle))
        self.steps = next(self.script, self.steps)
        return self.steps


def test_the_engine_feeds_steady_decode_plans_to_the_tuner_and_follows_it():
    """The adaptive wiring (on CUDA by default) on the CPU's asynchronous loop, with a tuner whose choices are
    scripted: it sees only steady decode plans with sane measurements, every plan keeps to the cap it set,
    and the tokens are those of one step per plan."""
    prompts = [p[:40] for p in load_prompts(4)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref, _ = _run(1, False, prompts, params)
    llm = make_llm(num_scheduler_steps=4, async_scheduling=True, **BASE)
    core = llm.engine.engine_core
    tuner = _ScriptedTuner([2, 3, 1, 4, 2, 1, 3] * 20)
    core.scheduler_steps_tuner = tuner
    schedule = core.scheduler.schedule
    plans = []

    def recording_schedule():
        cap = core.scheduler.steps_per_plan
        so = schedule()
        plans.append((cap, so.num_steps))
        return so

    core.scheduler.schedule = recording_schedule
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert len(tuner.calls) >= 5, "no steady decode plan reached the tuner"
    for num_steps, period, wait, idle in tuner.calls:
        assert 1 <= num_steps <= 4 and period > 0 and 0 <= wait <= period + 1e-3 and idle >= 0
    assert all(steps <= cap for cap, steps in plans)
    assert {steps for _, steps in plans} >= {1, 2, 3}, plans  # the caps it set were taken
    assert_kv_free(llm.stats())
