"""Seeded sampling: a request's tokens depend only on its seed, never on batch neighbours, their order, the
token budget (chunking) or preemption. Unseeded sampling is reproducible from the engine seed."""

from __future__ import annotations

import pytest

from asyncspec import SamplingParams
from tests.conftest import load_prompts
from tests.engine.engine_helpers import assert_ids_in_vocab, assert_kv_free, bundled_llm, use_gpu_launch_order

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_TOKENS = 16
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=MAX_TOKENS, ignore_eos=True)
OTHER_SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CONFIG = dict(max_model_len=64, max_num_batched_tokens=256, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def prompts():
    return [p[:40] for p in load_prompts(5)]


@pytest.fixture(scope="module")
def llm(one_thread):
    return bundled_llm(**CONFIG)


@pytest.fixture(scope="module")
def alone(llm, prompts):
    out = llm.generate([prompts[0]], SEEDED)[0]
    assert len(out.token_ids) == MAX_TOKENS
    assert_ids_in_vocab(out.token_ids)
    return out.token_ids


def test_seeded_output_independent_of_neighbours_and_order(llm, prompts, alone):
    batch = [(prompts[0], SEEDED), (prompts[1], GREEDY), (prompts[2], UNSEEDED), (prompts[3], OTHER_SEEDED)]
    forward = llm.generate([p for p, _ in batch], [s for _, s in batch])
    backward = llm.generate([p for p, _ in batch[::-1]], [s for _, s in batch[::-1]])
    assert forward[0].token_ids == alone
    assert backward[-1].token_ids == alone
    assert forward[3].token_ids == backward[0].token_ids, "the other seeded request too"
    assert forward[1].token_ids == backward[2].token_ids, "greedy is deterministic"
    # The same seeded request twice in one batch: each has its own generator.
    twice = llm.generate([prompts[0], prompts[4], prompts[0]], [SEEDED, UNSEEDED, SEEDED])
    assert twice[0].token_ids == alone and twice[2].token_ids == alone
    assert_kv_free(llm.stats())


def test_different_seeds_differ(llm, prompts, alone):
    outs = llm.generate(
        [prompts[0]] * 3,
        [
            SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True)
            for s in (124, 125, 126)
        ],
    )
    assert all(o.token_ids != alone for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_seeded_output_independent_of_token_budget(prompts, alone):
    small = bundled_llm(
        **{**CONFIG, "max_num_batched_tokens": 16, "max_num_seqs": 16}
    )  # 40-token prompts take 3 chunks
    outs = small.generate([prompts[1], prompts[0], prompts[2]], [UNSEEDED, SEEDED, GREEDY])
    assert outs[1].token_ids == alone


def test_seeded_output_survives_preemption(llm, prompts):
    # 12-token prompts: all four are admitted (3 blocks of 4 each), then their growth to 28 tokens
    # (7 blocks each) cannot fit 16 blocks, so running requests are preempted and recomputed.
    short = [p[:12] for p in prompts[:4]]
    params = [GREEDY, UNSEEDED, OTHER_SEEDED, SEEDED]
    ref = llm.generate([short[0], short[2], short[3]], [GREEDY, OTHER_SEEDED, SEEDED])
    tiny = bundled_llm(**{**CONFIG, "num_kv_blocks": 16, "block_size": 4})
    scheduler = tiny.engine.engine_core.scheduler
    preempted: list[tuple[str, int]] = []
    real_preempt = scheduler._preempt

    def record(request):
        preempted.append((request.request_id, request.num_output_tokens))
        real_preempt(request)

    scheduler._preempt = record
    outs = tiny.generate(short, params)
    stats = tiny.stats()
    assert stats["num_preemptions"] > 0
    # The seeded request itself was preempted mid-generation: its generator must resume, not restart.
    assert any(rid == outs[3].request_id and n > 0 for rid, n in preempted), preempted
    assert outs[3].token_ids == ref[2].token_ids
    assert outs[2].token_ids == ref[1].token_ids
    assert outs[0].token_ids == ref[0].token_ids
    assert_kv_free(stats)


def test_unseeded_reproducible_from_engine_seed(prompts, llm):
    batch = prompts[:3]
    a = bundled_llm(**CONFIG, seed=42).generate(batch, UNSEEDED)
    b = bundled_llm(**CONFIG, seed=42).generate(batch, UNSEEDED)
    c = bundled_llm(**CONFIG, seed=43).generate(batch, UNSEEDED)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    for o in a:
        assert_ids_in_vocab(o.token_ids)


def test_seeded_draft_model_stream_survives_preemption_before_its_first_token_is_collected(prompts):
    """A seeded request preempted while the step that samples its first token (and proposes its drafts) is in
    flight: its drafts are parked, and the decode after its recompute verifies them, so its tokens equal those of
    a run without preemption."""
    from tests.conftest import DRAFT_MODEL

    spec = dict(speculative_method="draft_model", draft_model=str(DRAFT_MODEL), num_speculative_tokens=4)
    config = dict(CONFIG, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8, **spec)
    seeded = SamplingParams(temperature=1.5, seed=1, max_tokens=20)
    long_prompt = load_prompts(1)[0][:45]
    results = []
    for async_scheduling, num_kv_blocks in ((False, 64), (True, 6)):
        llm = bundled_llm(**dict(config, async_scheduling=async_scheduling, num_kv_blocks=num_kv_blocks))
        try:
            if async_scheduling:
                use_gpu_launch_order(llm)
            engine = llm.engine
            engine.add_request(
                engine.make_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=60), "A"), False
            )
            out, steps = {}, 0
            while engine.has_unfinished_requests() or steps <= 3:
                if steps == 3:
                    engine.add_request(engine.make_request(prompts[1][:20], seeded, "B"), False)
                out.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
                steps += 1
            results.append((out["B"], llm.stats()["num_preemptions"]))
            assert_kv_free(llm.stats())
        finally:
            llm.shutdown()
    (alone, _), (preempted, num_preemptions) = results
    assert num_preemptions > 0  # the case: the small pool preempts B
    assert preempted == alone
