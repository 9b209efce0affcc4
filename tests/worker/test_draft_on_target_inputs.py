"""The draft model's catch-up over a plan that proposes nothing (prompt chunks, with measured costs) runs on the
target's step inputs instead of building its own (ModelRunner._draft_on_target_inputs). Its KV must be exactly what
its own pass would have written: the drafts after the prompts (so the accepted counts) are the same with the switch
off, and greedy output equals the engine without speculation, in both loops."""

from __future__ import annotations

import pytest

from asyncspec import SamplingParams
from asyncspec.worker.model_runner import DRAFT_ON_TARGET_INPUTS_ENV
from tests.conftest import load_prompts
from tests.engine.engine_helpers import assert_kv_free, one_thread  # noqa: F401 (a fixture)
from tests.spec.spec_helpers import assert_same_outputs, make_llm, record_plans, script_k

pytestmark = pytest.mark.usefixtures("one_thread")

# Prompts of 70-150 tokens over 48-token plans and 3 rows: chunked prompts, and admissions waiting for a row.
CONFIG = dict(block_size=16, max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=48, max_num_seqs=3)


def _workload():
    prompts = [p[: 70 + 16 * i] for i, p in enumerate(load_prompts(6))]
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 5 * i, ignore_eos=True) for i in range(6)]
    return prompts, params


def _run(async_scheduling: bool):
    prompts, params = _workload()
    llm = make_llm(method="draft_model", k=4, async_scheduling=async_scheduling, **CONFIG)
    # Measured costs (scripted: always k = 4 for decodes) turn on the rule that plans of prompt chunks propose nothing.
    script_k(llm, [4])
    plans = record_plans(llm)
    outputs = llm.generate(prompts, params)
    return outputs, llm.stats(), plans, llm.engine.engine_core.runner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_catch_up_on_target_inputs_is_exact(monkeypatch, async_scheduling):
    prompts, params = _workload()
    ref = make_llm(**CONFIG).generate(prompts, params)
    got_on, on, plans_on, runner_on = _run(async_scheduling)
    monkeypatch.setenv(DRAFT_ON_TARGET_INPUTS_ENV, "0")
    got_off, off, plans_off, runner_off = _run(async_scheduling)
    assert_same_outputs(ref, got_on, "draft on the target's inputs")
    assert_same_outputs(ref, got_off, "draft on its own inputs")
    assert plans_on == plans_off
    for key in ("num_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens", "num_generation_tokens"):
        assert on[key] == off[key], key
    # The bundled draft agrees with its target most of the time: a draft KV left empty over the prompts would not.
    assert on["spec_num_accepted_tokens"] > 0.6 * on["spec_num_draft_tokens"], on
    assert runner_off.num_draft_on_target_steps == 0
    # Plans that propose nothing: prompt chunks (the draft runs on the target's inputs), and decodes at k = 0 (the
    # draft skips them and falls behind; the next plan that has such a request catches it up on its own inputs).
    no_proposals = sum(1 for _, proposed, _ in plans_on if proposed == 0)
    assert runner_on.num_draft_on_target_steps == on["draft_on_target_inputs_steps"] >= 4
    assert runner_on.num_draft_on_target_steps <= no_proposals
    assert_kv_free(on)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_draft_on_target_mixed_graphs_on_gpu(monkeypatch, async_scheduling):
    """fp32 with CUDA graphs: the draft's twin of each mixed graph of the target replays its catch-up over prompt
    chunks. Greedy output equals the engine without speculation; the acceptance stays that of the draft on its
    own inputs (a padded graph may round differently, so within a few drafts, not exactly)."""
    config = dict(CONFIG, device="cuda", num_kv_blocks=None, gpu_memory_utilization=0.3)
    prompts, params = _workload()
    ref = make_llm(**config).generate(prompts, params)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(DRAFT_ON_TARGET_INPUTS_ENV, switch)
        llm = make_llm(method="draft_model", k=4, async_scheduling=async_scheduling, **config)
        script_k(llm, [4])
        got = llm.generate(prompts, params)
        assert_same_outputs(ref, got, f"draft on the target's inputs: {switch}")
        results[switch] = (llm.stats(), llm.engine.engine_core.runner)
    (on, runner), (off, _) = results["1"], results["0"]
    assert runner.draft_on_target_graphs is not None and runner.draft_on_target_graphs.num_mixed_replays >= 4, on
    assert on["draft_on_target_inputs_steps"] == runner.draft_on_target_graphs.num_mixed_replays
    assert off["draft_on_target_inputs_steps"] == 0
    rate_on = on["spec_num_accepted_tokens"] / on["spec_num_draft_tokens"]
    rate_off = off["spec_num_accepted_tokens"] / off["spec_num_draft_tokens"]
    assert rate_on > 0.6 and abs(rate_on - rate_off) < 0.03, (rate_on, rate_off)
    assert_kv_free(on)
