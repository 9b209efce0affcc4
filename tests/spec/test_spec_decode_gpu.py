"""Speculative decoding on a GPU (Triton attention and rejection kernels): greedy equality with the
non-speculative engine in fp32, acceptance of the bundled pair, and sane bf16 runs."""

from __future__ import annotations

import pytest

from asyncspec import LLM, SamplingParams
from tests.conftest import TARGET_MODEL, load_prompts

pytestmark = pytest.mark.gpu

CONFIG = dict(device="cuda", max_model_len=640, num_kv_blocks=1024, max_num_batched_tokens=1024)
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return load_prompts(16)


@pytest.fixture(scope="module")
def baseline_fp32(prompts):
    return [o.token_ids for o in LLM(str(TARGET_MODEL), dtype="float32", **CONFIG).generate(prompts, GREEDY)]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculative_equals_plain_fp32(prompts, baseline_fp32, method, k):
    llm = LLM(str(TARGET_MODEL), dtype="float32", speculative_method=method, num_speculative_tokens=k, **CONFIG)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == baseline_fp32
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    print(method, k, "tokens per target step", stats["spec_mean_acceptance_length"])


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculating_beside_prompts_equals_plain_fp32(prompts, baseline_fp32, method):
    """speculate_with_prompts: 16 prompts through 6 rows and 256-token plans, so that decodes verify drafts in plans
    that also compute prompt chunks (mixed graphs, or eager), with the adaptive policy on measured costs."""
    llm = LLM(
        str(TARGET_MODEL),
        dtype="float32",
        speculative_method=method,
        num_speculative_tokens=4,
        speculate_with_prompts=True,
        **dict(CONFIG, max_num_seqs=6, max_num_batched_tokens=256),
    )
    scheduler = llm.engine.engine_core.scheduler
    schedule = scheduler.schedule
    mixed_verifying = []

    def recording():
        so = schedule()
        if so.num_draft_positions and so.total_num_scheduled_tokens > len(so.num_scheduled_tokens) * (
            so.num_speculative_tokens + 1
        ):
            mixed_verifying.append(so.step_id)
        return so

    scheduler.schedule = recording
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == baseline_fp32
    assert mixed_verifying, "no plan verified drafts beside a prompt chunk"
    stats = llm.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_fixed_k_engine_starts_and_equals_plain_fp32(prompts, baseline_fp32, method):
    """adaptive_speculation=False: graphs for k alone, and a warm-up that never plans k = 0 (it used to, and the
    multi-step k = 0 plan found no graph of its shape: the engine failed at start-up)."""
    llm = LLM(
        str(TARGET_MODEL),
        dtype="float32",
        speculative_method=method,
        num_speculative_tokens=2,
        adaptive_speculation=False,
        **CONFIG,
    )
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == baseline_fp32
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert {key for key, n in stats.items() if key.startswith("spec_steps_with_k_") and n} == {"spec_steps_with_k_2"}
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_bf16_speculative_runs_sampled_and_greedy(prompts, method):
    llm = LLM(str(TARGET_MODEL), dtype="bfloat16", speculative_method=method, num_speculative_tokens=4, **CONFIG)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=50, seed=i, max_tokens=48, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 48 and all(0 <= t < 8192 for t in o.token_ids) for o in outs)
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def _syncs_in_steps(llm: LLM, num_steps: int) -> list[int]:
    """Host-device synchronisations torch reports in each of the next engine steps."""
    import warnings

    import torch

    counts = []
    for _ in range(num_steps):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                llm.engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return counts


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculative_step_adds_no_host_sync(prompts, method, monkeypatch):
    """A decode step with speculation synchronises with the device no more often than one without
    (the one copy of the sampled tokens)."""
    monkeypatch.setenv("ASYNCSPEC_DEBUG_INVARIANTS", "0")  # the debug checks read the device
    counts = {}
    for spec in (None, method):
        kwargs = dict(speculative_method=spec, num_speculative_tokens=4) if spec else {}
        llm = LLM(str(TARGET_MODEL), dtype="bfloat16", **kwargs, **CONFIG)
        for i, p in enumerate(prompts[:8]):
            llm.engine.add_request(
                llm.engine.make_request(
                    p, SamplingParams(temperature=0.0 if i % 2 else 0.7, max_tokens=40, seed=i), f"r{i}"
                )
            )
        for _ in range(3):  # prefill, then decodes with drafts
            llm.engine.step()
        counts[spec] = _syncs_in_steps(llm, 4)
    print(counts)
    assert max(counts[method]) <= max(counts[None]), counts


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_bf16_greedy_speculative_matches_plain_up_to_bf16_ties(prompts, method):
    """In bf16, verifying k + 1 positions at once is another reduction shape than decoding one at a
    time, so a near-tie may flip. Every divergence must be such a tie in the plain run's own logits
    (at most one bf16 ulp of logits below 32 apart; three or more tokens can share that ulp, so the
    plain run's top 5 are kept), and most prompts must match exactly."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=5)
    plain = LLM(str(TARGET_MODEL), dtype="bfloat16", **CONFIG).generate(prompts, params)
    spec_llm = LLM(str(TARGET_MODEL), dtype="bfloat16", speculative_method=method, num_speculative_tokens=4, **CONFIG)
    spec = spec_llm.generate(prompts, params)
    exact = 0
    for ours, ref in zip(spec, plain, strict=True):
        i = next((j for j, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=True)) if a != b), None)
        if i is None:
            exact += 1
            continue
        top = dict(zip(ref.logprobs[i].token_ids, ref.logprobs[i].logprobs, strict=True))
        print(f"{method}: divergence at {i}: {ours.token_ids[i]} vs {ref.token_ids[i]}, plain top-5 {top}")
        assert ours.token_ids[i] in top, "the speculative token is not even in the plain run's top 5"
        assert abs(top[ref.token_ids[i]] - top[ours.token_ids[i]]) <= 0.125
    assert exact >= 12, f"only {exact}/16 prompts match exactly"
    assert spec_llm.stats()["spec_num_accepted_tokens"] > 0
