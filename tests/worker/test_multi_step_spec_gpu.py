"""Multi-step plans at k = 0 in a speculating engine on the GPU: the decode graph's head and tail replayed back
to back while the draft model falls behind, its catch-up (in its next pass, or through a run's first step at the
lag bound) and the verification after it, with joins, finishes and preemption."""

from __future__ import annotations

import pytest

from asyncspec import LLM
from tests.conftest import TARGET_MODEL
from tests.spec.spec_helpers import assert_same_outputs, record_plans, script_k, spec_kwargs
from tests.worker.test_cuda_graphs import GPU_CONFIG, _params, _prompts, step_without_host_sync

PATTERN = [4, 4, *[0] * 9, 2, 4, *[0] * 4, 1]
"""The policy's k per plan: runs of k = 0 between verifying plans."""


def _llm(method: str | None, dtype: str, **overrides) -> LLM:
    return LLM(
        str(TARGET_MODEL), dtype=dtype, **{**GPU_CONFIG, **overrides}, **(spec_kwargs(method, 4) if method else {})
    )


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_multi_step_plans_at_k0_equal_the_plain_engine_on_gpu(method, async_scheduling):
    """fp32 greedy with CUDA graphs: the speculating engine's output, with runs of four steps at k = 0 and the
    draft's lag bound at 3 (every run's first step catches the draft up), equals the engine without
    speculation."""
    ref = _llm(None, "float32", num_scheduler_steps=1).generate(_prompts(), _params())
    llm = _llm(method, "float32", num_scheduler_steps=4, async_scheduling=async_scheduling)
    runner = llm.engine.engine_core.runner
    if method == "draft_model":
        runner.spec.proposer.max_lag = 3
    script_k(llm, PATTERN)
    plans = record_plans(llm)
    assert_same_outputs(ref, llm.generate(_prompts(), _params()), f"{method}, multi-step plans at k = 0")
    stats = llm.stats()
    assert sum(steps > 1 for _, _, steps in plans) > 5, plans
    assert stats["num_preemptions"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["cuda_graph_decode_tail_replays"] > 10 and stats["cuda_graph_verify_tail_replays"] > 5, stats
    assert stats["spec_num_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_multi_step_plans_at_k0_make_no_host_sync(async_scheduling, monkeypatch):
    """bf16 draft model, runs of four steps at k = 0 with catch-ups at the lag bound, under
    set_sync_debug_mode("error")."""
    monkeypatch.setenv("ASYNCSPEC_DEBUG_INVARIANTS", "0")  # the debug checks read the device
    llm = _llm("draft_model", "bfloat16", num_scheduler_steps=4, async_scheduling=async_scheduling)
    llm.engine.engine_core.runner.spec.proposer.max_lag = 3
    script_k(llm, PATTERN)
    plans = record_plans(llm)
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(_prompts(), _params(), strict=True)):
        engine.add_request(engine.make_request(prompt, params, f"r{i}"), stream_deltas=False)
    step_without_host_sync(engine)
    assert sum(steps > 1 for _, _, steps in plans) > 5, plans
    assert llm.stats()["num_free_kv_blocks"] == llm.stats()["num_kv_blocks"]


def _speculative_runs(plans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    return [p for p in plans if p[2] > 1 and p[0] > 0]


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_multi_step_speculative_plans_equal_the_plain_engine_on_gpu(async_scheduling):
    """fp32 greedy with CUDA graphs, the draft model at a steady k = 4 and at k changing between plans: runs of
    verification steps (head, forward and verification tail, the draft's step graph, back to back) give the
    output of the engine without speculation, through joins, finishes and preemption."""
    ref = _llm(None, "float32", num_scheduler_steps=1).generate(_prompts(), _params())
    for pattern in ([4], [4, 4, 4, 2, 2, 2, 0, 4, 4]):
        llm = _llm("draft_model", "float32", num_scheduler_steps=4, async_scheduling=async_scheduling)
        script_k(llm, pattern)
        plans = record_plans(llm)
        got = llm.generate(_prompts(), _params())
        assert_same_outputs(ref, got, f"multi-step plans at k = {pattern}")
        stats = llm.stats()
        assert len(_speculative_runs(plans)) > 3, plans
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        assert stats["cuda_graph_verify_tail_replays"] > 10 and stats["cuda_graph_draft_step_replays"] > 10, stats
        assert stats["spec_num_accepted_tokens"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_multi_step_speculative_plans_make_no_host_sync(async_scheduling, monkeypatch):
    """bf16 draft model at a steady k = 4, runs of four verification steps, under set_sync_debug_mode("error")."""
    monkeypatch.setenv("ASYNCSPEC_DEBUG_INVARIANTS", "0")  # the debug checks read the device
    llm = _llm("draft_model", "bfloat16", num_scheduler_steps=4, async_scheduling=async_scheduling)
    script_k(llm, [4])
    plans = record_plans(llm)
    engine = llm.engine
    for i, (prompt, params) in enumerate(zip(_prompts(), _params(), strict=True)):
        engine.add_request(engine.make_request(prompt, params, f"r{i}"), stream_deltas=False)
    step_without_host_sync(engine)
    assert len(_speculative_runs(plans)) > 3, plans
    assert llm.stats()["num_free_kv_blocks"] == llm.stats()["num_kv_blocks"]
