"""The start-up warm-up (engine/warm_up.py): dummy requests through the whole engine, then nothing of them
left. It runs by itself on CUDA; here it is called on CPU engines, whose outputs, statistics, KV pool and
speculation policy afterwards must be those of an engine that never ran it."""

from __future__ import annotations

import pytest

from asyncspec import SamplingParams
from asyncspec.core.spec_policy import SpeculationPolicy
from asyncspec.engine import warm_up as warm_up_module
from asyncspec.request import Request
from tests.conftest import load_prompts, recorded_spec_plans
from tests.engine.engine_helpers import assert_kv_free
from tests.spec.spec_helpers import make_llm

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=96)


def _llm(method, async_scheduling):
    k = 4 if method == "draft_model" else (3 if method else 0)
    return make_llm(method=method, k=k, async_scheduling=async_scheduling, **BASE)


def _generate(llm):
    prompts = [p[: 20 + 9 * i] for i, p in enumerate(load_prompts(5))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
    ]
    outs = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))])
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("method", [None, "draft_model"])
def test_warm_up_leaves_no_trace(method, async_scheduling, monkeypatch) -> None:
    reference = _generate(_llm(method, async_scheduling))
    llm = _llm(method, async_scheduling)
    core = llm.engine.engine_core
    seen: list[Request] = []
    add = core.add_request

    def recording_add(request: Request) -> None:
        seen.append(request)
        add(request)

    monkeypatch.setattr(core, "add_request", recording_add)
    with recorded_spec_plans(core.scheduler) as plans:
        stats = core.warm_up()
    monkeypatch.undo()
    chosen_k = [proposed for _, proposed in plans]

    # It ran what it says: a chunked long prompt, greedy and sampled requests, and with speculation both the
    # largest k and k = 0.
    assert stats.num_requests == len(seen) > 0 and stats.num_steps > 0
    assert all(r.request_id.startswith(warm_up_module.WARM_UP_REQUEST_PREFIX) and r.is_finished for r in seen)
    assert max(r.num_prompt_tokens for r in seen) > BASE["max_num_batched_tokens"]
    assert any(not r.sampling_params.is_greedy for r in seen)
    assert {r.num_output_tokens for r in seen} == {r.sampling_params.max_tokens for r in seen}
    if method is not None:
        assert {0, 4} <= set(chosen_k)

    after = llm.stats()
    assert_kv_free(after)
    assert after["num_steps"] == after["num_finished_requests"] == after["num_generation_tokens"] == 0
    assert after["prefix_cache_queries"] == 0 and after["spec_num_drafts"] == 0
    assert core.step_timings.as_stats() == type(core.step_timings)().as_stats()
    assert core.num_inflight_steps == 0
    policy = core.scheduler.spec_policy
    assert policy.choices == SpeculationPolicy(policy.max_k).choices and policy.acceptance_rate == 0.6
    assert policy.step_cost is None  # the CPU measures no step costs: always the largest k, as before
    assert _generate(llm) == reference


def test_warm_up_without_adaptive_speculation_verifies_only_the_fixed_k() -> None:
    """A fixed-k engine never plans k = 0 (on CUDA it captures no k = 0 graphs): its warm-up must not either."""
    llm = make_llm(method="draft_model", k=2, adaptive_speculation=False, **BASE)
    core = llm.engine.engine_core
    with recorded_spec_plans(core.scheduler) as planned:
        stats = core.warm_up()
    assert stats.num_steps > 0
    assert {k for k, _ in planned} == {2} and {n for _, n in planned} == {2}
    assert_kv_free(llm.stats())


def test_warm_up_refuses_a_busy_engine() -> None:
    llm = _llm(None, False)
    core = llm.engine.engine_core
    core.add_request(Request("busy", load_prompts(1)[0][:20], SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="idle engine"):
        core.warm_up()
    while core.has_unfinished_requests():
        core.step()
    assert_kv_free(llm.stats())


@pytest.mark.parametrize("max_model_len", [5, 8])
def test_warm_up_fits_a_tiny_max_model_len(max_model_len) -> None:
    """Prompts shrink to what max_model_len leaves after the generated tokens; with no room, no request."""
    llm = make_llm(
        block_size=16, max_model_len=max_model_len, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=8
    )
    stats = llm.engine.engine_core.warm_up()
    assert (stats.num_requests > 0) == (max_model_len == 8)
    assert_kv_free(llm.stats())
    assert llm.stats()["num_steps"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("method", [None, "draft_model"])
def test_after_the_warm_up_no_kernel_compiles_mid_run(monkeypatch, method) -> None:
    """On CUDA the engine warms up by itself; a workload of every eager path (prompts of many lengths, chunked
    and joining running decodes, greedy and sampled requests, penalties and logprobs, adaptive k) then compiles
    no Triton kernel (a steady draft-model window at batch 64 once paid 0.4 s for one compiled mid-run)."""
    import dataclasses
    import random

    triton = pytest.importorskip("triton")
    from asyncspec import LLM
    from tests.conftest import DRAFT_MODEL, TARGET_MODEL

    kwargs = dict(device="cuda", max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=512)
    kwargs["gpu_memory_utilization"] = 0.3
    if method is not None:
        kwargs.update(speculative_method=method, draft_model=str(DRAFT_MODEL), num_speculative_tokens=4)
    llm = LLM(str(TARGET_MODEL), **kwargs)
    stats = llm.stats()
    assert stats["num_steps"] == 0 and stats["num_kv_blocks"] == stats["num_free_kv_blocks"], stats
    assert stats["startup_warm_up_steps"] > 0 and stats["startup_warm_up_seconds"] > 0, stats
    compiled: list[str] = []

    def hook(*args, **kw):
        compiled.append(str(getattr(kw.get("fn"), "name", kw.get("fn"))))
        return False

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    rng = random.Random(3)
    prompts = [p[: rng.choice([3, 9, 17, 40, 70, 130, 300, 700])] for p in load_prompts(48)]
    choices = [
        SamplingParams(temperature=0.0, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=30, frequency_penalty=0.3, logprobs=1, ignore_eos=True),
    ]
    params = [dataclasses.replace(rng.choice(choices), max_tokens=rng.randint(4, 60)) for _ in prompts]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    assert not compiled, f"kernels compiled mid-run after the warm-up: {compiled}"
