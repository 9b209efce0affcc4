"""The asynchronous loop (async_scheduling=True) against the synchronous reference loop.

Step N+1 is planned optimistically (every draft of step N accepted) and launched before step N's
results are reconciled; the debug mode (ASYNCSPEC_DEBUG_INVARIANTS, on in every test: see
tests/conftest.py) checks after each step that the host's reconciled computed counts equal the
device's and that no placeholder or out-of-vocabulary id reaches a model input, a request's tokens or
an output. These tests compare outputs token for token (fp32, CPU) and show the overlap is real.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncspec import SamplingParams
from asyncspec.layers.sampler import check_token_ids
from tests.conftest import load_prompts
from tests.engine.engine_helpers import abort_r1_while_a_step_is_in_flight, assert_ids_in_vocab, assert_kv_free
from tests.spec.spec_helpers import make_llm

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = [None, "ngram", "draft_model"]
BASE = dict(block_size=16, max_model_len=256, max_num_seqs=4, adaptive_speculation=False)


def _llm(method, async_scheduling, **overrides):
    k = 4 if method == "draft_model" else (3 if method else 0)
    return make_llm(method=method, k=k, async_scheduling=async_scheduling, **{**BASE, **overrides})


def _prompts() -> list[list[int]]:
    raw = load_prompts(6)
    shared = raw[0][:40]  # the last prompt (admitted once a slot frees) shares the first one's prefix
    return [raw[0][:60], raw[1][:40], raw[2][:70], raw[3][:30], raw[4][:50], raw[5][:45], shared + raw[1][:12]]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),  # ends inside an accepted run
        SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop_token_ids=[13, 9]),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]


def _summary(outputs):
    return [(o.token_ids, o.text, o.finish_reason, _logprob_ids(o)) for o in outputs]


def _logprob_ids(output):
    if output.logprobs is None:
        return None
    return [(lp.token_ids, lp.sampled_token_rank) for lp in output.logprobs]


def _assert_logprobs_close(got, ref):
    """Logprob values agree to float32 rounding: a step's batch (and so its matmul shapes) may
    differ between the loops, which changes the last bits, never the ids or ranks."""
    for g, r in zip(got, ref, strict=True):
        if r.logprobs is not None:
            for a, b in zip(g.logprobs, r.logprobs, strict=True):
                assert a.logprobs == pytest.approx(b.logprobs, rel=1e-4, abs=1e-5)


def _run(method, async_scheduling, prompts, params, **overrides):
    llm = _llm(method, async_scheduling, **overrides)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert_kv_free(stats)
    for o in outputs:
        assert_ids_in_vocab(o.token_ids)
    return outputs, stats, llm


@pytest.mark.parametrize("method", METHODS)
def test_async_equals_sync_on_a_mixed_workload(method):
    """Chunked prefill, prefix caching, penalties, a stop string, min_tokens, logprobs and a
    max_tokens that ends inside an accepted run: the same tokens, text, finish reasons and
    logprobs in both loops."""
    options = dict(num_kv_blocks=96, long_prefill_token_threshold=16, max_num_batched_tokens=64)
    prompts, params = _prompts(), _mixed_params()
    ref, ref_stats, _ = _run(method, False, prompts, params, **options)
    got, stats, _ = _run(method, True, prompts, params, **options)
    assert _summary(got) == _summary(ref)
    _assert_logprobs_close(got, ref)
    assert stats["prefix_cache_hits"] > 0
    if method is not None:
        assert stats["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_async_equals_sync_under_preemption(method):
    prompts = [p[:64] for p in load_prompts(6)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    options = dict(num_kv_blocks=18, max_num_batched_tokens=128)
    ref, ref_stats, _ = _run(method, False, prompts, params, **options)
    got, stats, _ = _run(method, True, prompts, params, **options)
    assert ref_stats["num_preemptions"] > 0 and stats["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_is_the_same_in_both_loops(method):
    prompts = [p[:40] for p in load_prompts(5)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=20) for i in range(5)]
    ref, _, _ = _run(method, False, prompts, params, num_kv_blocks=96)
    got, _, _ = _run(method, True, prompts, params, num_kv_blocks=96)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.parametrize("method", [None, "draft_model"])
def test_step_n_plus_1_is_launched_before_step_n_is_collected(method):
    """The trace of launches and collections: in the asynchronous loop every step but the last has
    its successor launched before its own results are collected; the synchronous loop never does."""
    prompts = [p[:40] for p in load_prompts(4)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for async_scheduling in (False, True):
        _, _, llm = _run(method, async_scheduling, prompts, params, num_kv_blocks=64)
        trace = list(llm.engine.engine_core.step_trace)
        launched = {step: t for event, step, t in trace if event == "launch"}
        collected = {step: t for event, step, t in trace if event == "collect"}
        steps = sorted(collected)
        assert len(steps) >= 12 and steps == sorted(launched)
        overlapped = [launched[n + 1] < collected[n] for n in steps[:-1]]
        assert all(overlapped) if async_scheduling else not any(overlapped)


class ScriptedProposer:
    """Drafts from the known greedy continuation of each request: all right, all wrong (the right
    token + 1), or right with probability 1/2 per position (seeded)."""

    def __init__(self, references: list[list[int]], k: int, pattern: str, vocab: int) -> None:
        self.references = references
        self.k = k
        self.pattern = pattern
        self.vocab = vocab
        self.rng = random.Random(0)

    def propose(self, token_ids, rows, num_tokens, max_num_tokens):
        drafts = torch.zeros((rows.shape[0], self.k), dtype=torch.int64)
        for i, (row, n) in enumerate(zip(rows.tolist(), num_tokens.tolist(), strict=True)):
            known = token_ids[row, :n].tolist()
            # A request may run past its reference (the tokens after its max_tokens, dropped on the host).
            full = next(r for r in self.references if r[: min(n, len(r))] == known[: len(r)])
            for j in range(self.k):
                right = full[n + j] if n + j < len(full) else 0
                wrong = (right + 1) % self.vocab
                keep = self.pattern == "all" or (self.pattern == "random" and self.rng.random() < 0.5)
                drafts[i, j] = right if keep else wrong
        return drafts, torch.full((rows.shape[0],), self.k, dtype=torch.int64)


@pytest.mark.parametrize("pattern", ["all", "none", "random"])
def test_scripted_acceptance_keeps_host_and_device_counts_equal(pattern):
    """Controlled acceptance: the debug mode compares every request's reconciled computed count with
    the device's after every step (it raises on a mismatch), and the output is the greedy one."""
    prompts = [p[:36] for p in load_prompts(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref, _, _ = _run(None, False, prompts, params, num_kv_blocks=64)
    references = [p + o.token_ids for p, o in zip(prompts, ref, strict=True)]
    llm = _llm("ngram", True, num_kv_blocks=64)
    core = llm.engine.engine_core
    assert core.debug_invariants
    spec = core.runner.spec
    spec.proposer = ScriptedProposer(references, spec.k, pattern, core.model_config.vocab_size)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    stats = llm.stats()
    assert_kv_free(stats)
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    assert drafted > 0
    if pattern == "all":
        # every draft kept, except those cut by max_tokens
        assert accepted >= 0.8 * drafted
    elif pattern == "none":
        assert accepted == 0
    else:
        assert 0 < accepted < 0.8 * drafted


def test_debug_mode_catches_a_wrong_reconciliation():
    """The checks can fail: a host count off by one after a step, or a placeholder fed to a model."""
    llm = _llm("ngram", True, num_kv_blocks=64)
    scheduler = llm.engine.engine_core.scheduler
    update = scheduler.update_from_output

    def off_by_one(so, runner_output):
        outputs = update(so, runner_output)
        for request in scheduler.running:
            request.num_computed_tokens += 1
        return outputs

    scheduler.update_from_output = off_by_one
    with pytest.raises(AssertionError, match="computed tokens"):
        llm.generate([load_prompts(1)[0][:30]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with pytest.raises(AssertionError, match="outside"):
        check_token_ids(torch.tensor([5, -1, 7]), 8192, "the target's embedding")


@pytest.mark.parametrize("method", [None, "draft_model"])
def test_abort_while_a_step_is_in_flight(method):
    prompts = [p[:40] for p in load_prompts(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref, _, _ = _run(method, False, prompts, params, num_kv_blocks=64)
    llm = _llm(method, True, num_kv_blocks=64)

    def one_in_flight(core) -> None:
        assert core.num_inflight_steps == 1

    abort_r1_while_a_step_is_in_flight(llm, prompts, params, ref, 4, one_in_flight)


@pytest.fixture(scope="module")
def stress_setup(one_thread):
    prompts = [p[:48] for p in load_prompts(6)]
    llm = _llm("ngram", True, num_kv_blocks=16, max_num_batched_tokens=64)
    reference = _llm("ngram", False, num_kv_blocks=64)  # seeded draws depend on the speculation
    return prompts, llm, reference, {}


def _record_preemptions(llm) -> set[str]:
    """The ids of the requests the scheduler preempts from now on."""
    scheduler = llm.engine.engine_core.scheduler
    pick_victim, preempted = scheduler._pick_victim, set()

    def recording():
        victim = pick_victim()
        preempted.add(victim.request_id)
        return victim

    scheduler._pick_victim = recording
    return preempted


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 5), st.integers(1, 24), st.booleans()),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(False)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(False)),
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_random_arrivals_aborts_and_finishes_leave_the_pool_whole(stress_setup, ops):
    """Random arrivals (greedy or seeded), steps and aborts against the asynchronous loop, on a pool
    small enough to preempt: every request that was not aborted equals its alone run, every aborted
    one ends with "abort", and the pool is whole at the end."""
    prompts, llm, reference, cache = stress_setup
    engine = llm.engine
    live: list[tuple[str, int, SamplingParams]] = []
    aborted: set[str] = set()
    finished = {}
    for n, (op, a, b, seeded) in enumerate(ops):
        if op == "add":
            params = SamplingParams(temperature=0.8 if seeded else 0.0, seed=a, max_tokens=b, ignore_eos=True)
            request_id = f"q{n}"
            engine.add_request(engine.make_request(prompts[a], params, request_id), stream_deltas=False)
            live.append((request_id, a, params))
        elif op == "step":
            for _ in range(a):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        elif live:
            request_id = live[a % len(live)][0]
            if request_id not in finished and request_id not in aborted:
                for output in engine.abort_requests([request_id]):
                    assert output.finish_reason == "abort"
                aborted.add(request_id)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert_kv_free(llm.stats())
    for request_id, a, params in live:
        if request_id in aborted:
            continue
        key = (a, params.max_tokens, params.temperature, params.seed)
        if key not in cache:
            cache[key] = reference.generate([prompts[a]], params)[0].token_ids
        assert finished[request_id].token_ids == cache[key], request_id


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_seeded_stream_survives_preemption_during_a_chunked_recompute(method, async_scheduling):
    """A seeded request preempted over and over in a pool of 16 to 19 blocks, its recompute chunked at 4 tokens:
    it emits the tokens of its run alone. Two ways this went wrong: a chunk ending two tokens short was planned
    as a decode with drafts (the last known token never computed, a draft in its place), and a request preempted
    again during its recompute parked its new row's empty drafts over those parked first."""
    config = dict(
        block_size=4,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        long_prefill_token_threshold=4,
    )
    greedy_long = list(range(300, 340)), SamplingParams(temperature=0.0, max_tokens=20)
    seeded = list(range(500, 510)), SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = make_llm(method=method, k=2, num_kv_blocks=64, **config).generate([seeded[0]], seeded[1])[0].token_ids
    for num_blocks in (16, 17, 18, 19):
        llm = make_llm(method=method, k=2, async_scheduling=async_scheduling, num_kv_blocks=num_blocks, **config)
        preempted = _record_preemptions(llm)
        outputs = llm.generate([greedy_long[0], seeded[0]], [greedy_long[1], seeded[1]])
        assert preempted, f"{num_blocks} blocks were meant to preempt"
        assert outputs[1].token_ids == alone, num_blocks
        assert_kv_free(llm.stats())
        assert not llm.engine.engine_core.runner.spec._parked


@pytest.mark.parametrize(
    "method",
    ["ngram", "draft_model"],
)
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_seeded_stream_survives_preemption_under_speculation(one_thread, method, async_scheduling):
    """A seeded request preempted several times (a pool of 16 blocks shared with four others) emits
    the tokens of its uninterrupted run: its recompute stops one token short, and the decode of that
    token verifies the drafts the interrupted step would have verified (the n-gram proposer drafts them
    again; the draft model's, whose sampling drew from the stream, were parked at preemption)."""
    prompts = [p[:48] for p in load_prompts(3)]
    llm = _llm(method, async_scheduling, num_kv_blocks=16, max_num_batched_tokens=64)
    preempted = _record_preemptions(llm)
    engine = llm.engine
    plan = [(0, 1), (0, 1), (0, 40), (1, 44), (0, 26)]
    for i, (prompt, max_tokens) in enumerate(plan):
        params = SamplingParams(temperature=0.0, seed=prompt, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(engine.make_request(prompts[prompt], params, f"g{i}"), stream_deltas=False)
        if i == 1:
            for _ in range(6):
                engine.step()
    seeded = SamplingParams(temperature=0.8, seed=2, max_tokens=19, ignore_eos=True)
    engine.add_request(engine.make_request(prompts[2], seeded, "s"), stream_deltas=False)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert "s" in preempted, "the small pool was meant to preempt the seeded request"
    alone = _llm(method, False, num_kv_blocks=64).generate([prompts[2]], seeded)[0].token_ids
    assert outputs["s"].token_ids == alone
    assert_kv_free(llm.stats())
    assert not llm.engine.engine_core.runner.spec._parked  # every parked draft was restored or dropped
