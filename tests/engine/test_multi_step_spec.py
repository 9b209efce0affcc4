"""Multi-step plans in a speculating engine: a plan at k = 0 that proposes nothing (the policy's choice for it
and the next plan) runs several decode steps, the draft model falls behind by them and catches up in its next
pass. With a draft model, a plan at a steady k > 0 (verifying k and proposing k) runs several verification
steps, each one's drafts proposed on the device by the step before. Greedy output equals the engine without
speculation, in both loops; the drafts after a run are exactly those of a draft that caught up at every run;
the debug mode (on in tests) checks the host's reconciled counts against the device's after every plan."""

from __future__ import annotations

import pytest

from asyncspec import SamplingParams
from tests.conftest import load_prompts
from tests.engine.engine_helpers import assert_kv_free
from tests.spec.spec_helpers import METHODS, assert_same_outputs, make_llm, record_plans, script_k

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(block_size=16, max_model_len=192, num_kv_blocks=96, max_num_batched_tokens=128, max_num_seqs=8)
PATTERN = [4, 4, *[0] * 12, 4, 2, *[0] * 5, 1, 4, 0, 0]
"""The policy's k, one per plan: stretches of k = 0 (multi-step runs) between verifying plans."""


def _workload():
    prompts = [p[:60] for p in load_prompts(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40 + 7 * i, ignore_eos=True) for i in range(5)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, stop=["\n"]))  # a stop string may cut a run
    return prompts, params


@pytest.fixture(scope="module")
def reference(one_thread):
    """The engine without speculation's output for `_workload()` (CONFIG), computed once for the tests that share it."""
    return make_llm(**CONFIG).generate(*_workload())


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_multi_step_plans_at_k0_keep_greedy_output(method, async_scheduling, reference):
    prompts, params = _workload()
    ref = reference
    llm = make_llm(method=method, k=4, num_scheduler_steps=4, async_scheduling=async_scheduling, **CONFIG)
    script_k(llm, PATTERN)
    plans = record_plans(llm)
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, f"{method}, multi-step plans at k = 0")
    stats = llm.stats()
    assert any(steps > 1 and k == 0 for k, _, steps in plans), "no plan at k = 0 took several steps"
    # Runs at k > 0 only with the draft model, and only at a steady k.
    steady = 0 if method == "ngram" else 4
    assert all(k == proposed in (0, steady) for k, proposed, steps in plans if steps > 1), plans
    assert stats["num_device_steps"] > stats["num_steps"]
    assert stats.get("spec_steps_with_k_4", 0) > 0 and stats["spec_num_accepted_tokens"] > 0
    assert_kv_free(stats)


def test_draft_catch_up_after_multi_step_runs_is_exact(reference):
    """The draft falls behind by each run's steps and catches up in its next pass, or, when that would pass
    its lag bound, through a run's first step. With the bound at 3 every run catches up first; at 16 the lag
    builds over several runs. Both must give exactly the same drafts (the same accepted counts) and output."""
    prompts, params = _workload()
    ref = reference
    results = {}
    for max_lag in (3, 16):
        llm = make_llm(method="draft_model", k=4, num_scheduler_steps=4, **CONFIG)
        runner = llm.engine.engine_core.runner
        assert runner.spec.proposer.max_lag == 16  # 128 // 8; lowering it keeps the buffers' room
        runner.spec.proposer.max_lag = max_lag
        script_k(llm, PATTERN)
        plans = record_plans(llm)
        catch_ups = []
        catch_up = runner._catch_up_draft
        defer = runner._defer_draft

        def recording_defer(*args, _defer=defer, _catch_ups=catch_ups, _catch_up=catch_up, _runner=runner):
            # Count the catch-ups made for a run (not those of prefill chunks).
            _runner._catch_up_draft = lambda *a: (_catch_ups.append(1), _catch_up(*a))
            try:
                return _defer(*args)
            finally:
                _runner._catch_up_draft = _catch_up

        runner._defer_draft = recording_defer
        got = llm.generate(prompts, params)
        assert_same_outputs(ref, got, f"draft lag bound {max_lag}")
        runs_of_four = sum(steps == 4 for _, _, steps in plans)
        results[max_lag] = (llm.stats(), plans, len(catch_ups), runs_of_four)
    (tight, tight_plans, tight_catch_ups, runs), (loose, loose_plans, loose_catch_ups, _) = results[3], results[16]
    assert tight_plans == loose_plans  # the bound is the worker's: the plans are the same
    assert runs > 5 and tight_catch_ups >= runs  # every run of 4 steps passes a bound of 3
    assert loose_catch_ups < tight_catch_ups
    for key in ("num_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens", "num_generation_tokens"):
        assert tight[key] == loose[key], key
    assert tight["spec_num_accepted_tokens"] > 0
    assert_kv_free(tight)


def test_plans_follow_the_draft_lag_bound():
    """A draft model whose lag bound is 2 (max_num_batched_tokens // max_num_seqs): runs take at most 3 steps."""
    prompts, params = _workload()
    config = dict(CONFIG, max_num_batched_tokens=16)
    ref = make_llm(**config).generate(prompts, params)
    llm = make_llm(method="draft_model", k=1, num_scheduler_steps=8, **config)
    assert llm.engine.engine_core.runner.spec.proposer.max_lag == 2
    script_k(llm, [0])
    plans = record_plans(llm)
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, "draft lag bound 2")
    assert max(steps for _, _, steps in plans) == 3
    assert_kv_free(llm.stats())


def _speculative_runs(plans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return [p for p in plans if p[2] > 1 and p[0] > 0]


def _steady_workload():
    prompts = [p[:60] for p in load_prompts(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=30 + 9 * i, ignore_eos=i % 2 == 0) for i in range(6)]
    return prompts, params


@pytest.fixture(scope="module")
def steady_references(one_thread):
    """For `_steady_workload()`: the engine without speculation's output, and per k the output and statistics of
    the draft engine at that k in single steps (the synchronous loop), each computed once for both loops' tests."""
    ref = make_llm(**CONFIG).generate(*_steady_workload())
    singles: dict[int, tuple] = {}

    def single_steps(k: int) -> tuple:
        if k not in singles:
            single = make_llm(method="draft_model", k=k, num_scheduler_steps=1, **CONFIG)
            script_k(single, [k])
            singles[k] = (single.generate(*_steady_workload()), single.stats())
        return singles[k]

    return ref, single_steps


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [4, 2])
def test_multi_step_speculative_plans_keep_greedy_output(k, async_scheduling, steady_references):
    """At a steady k every plan that may take several steps does: the output equals the engine without
    speculation's, token for token (EOS may end a request inside a run), the statistics count the drafts of the
    steps before each request's end, and no KV block is left behind."""
    prompts, params = _steady_workload()
    ref, single_steps = steady_references
    single_out, single_stats = single_steps(k)
    llm = make_llm(method="draft_model", k=k, num_scheduler_steps=4, async_scheduling=async_scheduling, **CONFIG)
    script_k(llm, [k])
    plans = record_plans(llm)
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, f"multi-step plans at k = {k}")
    runs = _speculative_runs(plans)
    assert len(runs) > 5 and all(p == (k, k, p[2]) for p in runs), plans
    stats = llm.stats()
    assert stats["num_device_steps"] > stats["num_steps"]
    # The same drafts at the same positions: the steps of the runs accept what single steps accepted, but the
    # single steps verify fewer drafts near max_tokens (a run verifies k to the end).
    accepted, single_accepted = stats["spec_num_accepted_tokens"], single_stats["spec_num_accepted_tokens"]
    assert 0 < single_accepted <= accepted <= single_accepted + len(prompts) * k
    assert single_stats["spec_num_draft_tokens"] <= stats["spec_num_draft_tokens"]
    assert stats["num_generation_tokens"] == sum(len(o.token_ids) for o in got)
    for a, b in zip(got, single_out, strict=True):
        assert a.token_ids == b.token_ids
    # Each output counts the verification steps of its runs, not one per plan: together they are the engine's
    # count, and no request's mean acceptance length passes k + 1.
    assert sum(o.num_drafts for o in got) == stats["spec_num_drafts"]
    assert all(o.num_accepted_tokens <= o.num_drafts * k for o in got)
    assert_kv_free(stats)


def test_multi_step_speculative_plans_under_preemption():
    """A pool too small for every request's runs (the asynchronous loop): a run's plan preempts requests to get
    its slots while the plan before it is in flight, and the output still equals the engine without
    speculation's."""
    prompts = [p[:60] for p in load_prompts(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True) for _ in prompts]
    config = dict(CONFIG, num_kv_blocks=40)
    ref = make_llm(**config).generate(prompts, params)
    llm = make_llm(method="draft_model", k=4, num_scheduler_steps=4, async_scheduling=True, **config)
    script_k(llm, [4])
    scheduler = llm.engine.engine_core.scheduler
    schedule = scheduler.schedule
    plans: list[tuple[int, int, int, int]] = []  # (k, proposals, steps, requests preempted)

    def recording():
        so = schedule()
        plans.append((so.num_speculative_tokens, so.num_proposals, so.num_steps, len(so.preempted_req_ids)))
        return so

    scheduler.schedule = recording
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, "multi-step plans at k = 4 under preemption")
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert _speculative_runs([p[:3] for p in plans])
    # A run's own plan preempted requests for its slots, with the plan before it still in flight.
    assert any(k > 0 and steps > 1 and preempted for k, _, steps, preempted in plans), plans
    assert_kv_free(stats)
