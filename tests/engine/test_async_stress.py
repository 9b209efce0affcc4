"""Randomized stress of AsyncEngine: concurrent streams with random arrivals, aborts, task cancels,
early breaks, id reuse and seeded sampling on a KV pool small enough to force preemption.

Every stream ends exactly once, greedy and seeded outputs equal their alone runs (a prefix of them
when the stream was cut short), the pool is whole afterwards and the engine still serves. See
tests/engine/stress_helpers.py for the scenario; `python benchmarks/async_stress.py --streams 500`
runs a long setting, and the `slow` test below a longer one than CI's.

No pytest-asyncio: run_scenario drives each scenario in its own asyncio.run.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import DRAFT_MODEL
from tests.engine.engine_helpers import assert_kv_free, use_gpu_launch_order
from tests.engine.stress_helpers import References, ScenarioConfig, new_engine, run_scenario

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/engine/conftest.py)


@pytest.fixture(scope="module", params=["sync", "async", "async-gpu-order"])
def engine(one_thread, request):
    """The synchronous loop and the asynchronous one, in the CPU's launch order and in a GPU's (a step's tokens reach
    the worker's row state at collect, after the next launch); references are always synchronous alone runs."""
    eng = new_engine(async_scheduling=request.param != "sync")
    if request.param == "async-gpu-order":
        use_gpu_launch_order(eng)
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def references(one_thread):
    return References()


def _run(engine, references, **kwargs):
    report = run_scenario(engine, references, ScenarioConfig(**kwargs))
    print(report.summary)
    assert not report.failures, f"{len(report.failures)} failure(s), summary {report.summary}:\n{report.failure_text()}"
    assert_kv_free(engine.stats())
    return report


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_streams_end_once_match_alone_and_free_the_pool(engine, references, seed):
    report = _run(engine, references, seed=seed, num_streams=40, timeout=30.0)
    s = report.summary
    # The scenario exercised what it is about (fixed by the seed, so these are deterministic).
    assert s["num_preemptions"] > 0 and s["num_id_reuses"] > 0 and s["num_compared_full"] > 0
    assert s["outcomes"].get("abort", 0) + s["outcomes"].get("cancelled", 0) + s["outcomes"].get("broke", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [10, 11])
def test_random_streams_long(engine, references, seed):
    _run(engine, references, seed=seed, num_streams=400, timeout=300.0)


@pytest.mark.parametrize("seed", [6])  # 6: its seeded streams hit the first-token park of 860f97f
def test_random_streams_with_the_draft_model_in_gpu_launch_order(one_thread, seed):
    """Speculation with the draft model, the asynchronous loop in a GPU's launch order: seeded streams preempted
    around their first token keep their drafts (their references: synchronous alone runs with the same draft)."""
    spec = dict(speculative_method="draft_model", draft_model=str(DRAFT_MODEL), num_speculative_tokens=4)
    engine = new_engine(async_scheduling=True, **spec)
    try:
        use_gpu_launch_order(engine)
        report = _run(engine, References(**spec), seed=seed, num_streams=40, timeout=60.0)
        assert report.summary["num_preemptions"] > 0
    finally:
        asyncio.run(engine.shutdown())
