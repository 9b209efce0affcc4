"""Scheduler: token budget, decode-first chunked prefill, prefix hits, preemption, stop checks, aborts."""

from __future__ import annotations

import pytest

from asyncspec.core.scheduler_output import ModelRunnerOutput
from asyncspec.request import RequestStatus

from .scheduler_fakes import FakeRunner, make_request, make_scheduler, run_to_completion, step


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------- budget
def test_budget_and_max_num_seqs_respected_every_step():
    s = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=32)
    runner = FakeRunner(s)
    for i in range(10):
        s.add_request(make_request(f"r{i}", 5 + 9 * i, max_tokens=3 + i))
    steps = 0
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        steps += 1
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens <= 32
        assert len(so.num_scheduled_tokens) <= 4
        assert len(s.running) <= 4
        assert steps < 500
    assert s.kv_cache_manager.num_free_blocks == 256
    assert s.stats.num_finished_requests == 10
    assert s.stats.num_generation_tokens == sum(3 + i for i in range(10))
    assert s.stats.num_prompt_tokens_computed == sum(5 + 9 * i for i in range(10))


def test_empty_schedule():
    s = make_scheduler()
    so = s.schedule()
    assert so.is_empty and so.num_scheduled_tokens == {} and not so.scheduled_new_reqs
    assert s.update_from_output(so, ModelRunnerOutput([], [])) == []


# ---------------------------------------------------------------------------------- chunked prefill
def _start_decoders(s, runner, n: int) -> list[str]:
    ids = [f"d{i}" for i in range(n)]
    for rid in ids:
        s.add_request(make_request(rid, 6, max_tokens=200))
    step(s, runner)  # all prefilled in one step; each sampled its first token
    assert all(s.requests[r].num_output_tokens == 1 for r in ids)
    return ids


@pytest.mark.parametrize("threshold", [0, 8])
def test_decodes_never_starved_by_long_prompt(threshold):
    budget, n_dec, prompt_len = 32, 3, 200
    s = make_scheduler(num_blocks=512, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    runner = FakeRunner(s)
    decoders = _start_decoders(s, runner, n_dec)
    s.add_request(make_request("long", prompt_len, max_tokens=4))
    chunk = budget - n_dec if threshold == 0 else threshold
    done = 0
    while done < prompt_len:
        so, outs = step(s, runner)
        # Every decode gets its one token, and comes before the prefill chunk in batch order.
        assert list(so.num_scheduled_tokens)[:n_dec] == decoders
        assert all(so.num_scheduled_tokens[d] == 1 for d in decoders)
        expected = min(chunk, prompt_len - done)
        assert so.num_scheduled_tokens["long"] == expected
        assert so.total_num_scheduled_tokens <= budget
        done += expected
        sampled = [o for o in outs if o.request_id == "long"]
        assert bool(sampled) == (done == prompt_len)  # only the last chunk samples
    assert s.requests["long"].num_computed_tokens == prompt_len
    assert s.stats.num_prompt_tokens_computed == n_dec * 6 + prompt_len


def test_long_prefill_threshold_caps_a_lone_prompt():
    s = make_scheduler(num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=10)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 35, max_tokens=1))
    sizes = []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        sizes.append(so.num_scheduled_tokens["a"])
    assert sizes == [10, 10, 10, 5]


def test_chunked_prefill_off_prompt_waits_for_budget():
    s = make_scheduler(num_blocks=256, max_num_batched_tokens=32, enable_chunked_prefill=False)
    runner = FakeRunner(s)
    decoders = _start_decoders(s, runner, 3)
    for rid in decoders:
        s.requests[rid].sampling_params.max_tokens = 4
    s.add_request(make_request("big", 30, max_tokens=2))  # 30 > 32 - 3 decodes
    s.add_request(make_request("small", 2, max_tokens=2))  # FCFS: may not jump the queue
    while any(r in s.requests for r in decoders):
        so, _ = step(s, runner)
        assert "big" not in so.num_scheduled_tokens and "small" not in so.num_scheduled_tokens
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens["big"] == 30 and so.num_scheduled_tokens["small"] == 2
    run_to_completion(s, runner)
    assert s.kv_cache_manager.num_free_blocks == 256


# ---------------------------------------------------------------------------------- prefix cache
@pytest.mark.parametrize("second_len, hit", [(13, 8), (10, 8), (8, 4)])
def test_prefix_cache_hit(second_len, hit):
    s = make_scheduler(num_blocks=64, block_size=4)
    runner = FakeRunner(s)
    shared = list(range(100, 110))  # 10 tokens: 2 full blocks of 4
    s.add_request(make_request("a", shared, max_tokens=8))
    step(s, runner)  # prefill + first token; blocks of committed tokens get cached
    step(s, runner)
    tail = [400 + i for i in range(max(0, second_len - len(shared)))]
    s.add_request(make_request("b", (shared + tail)[:second_len], max_tokens=2))
    so, _ = step(s, runner)
    new = {d.request_id: d for d in so.scheduled_new_reqs}["b"]
    b = s.requests["b"]
    assert new.num_computed_tokens == hit and b.num_cached_tokens == hit
    assert so.num_scheduled_tokens["b"] == second_len - hit >= 1
    assert new.block_ids[: hit // 4] == s.kv_cache_manager.get_block_ids("a")[: hit // 4]
    outs = run_to_completion(s, runner)
    assert len(outs["b"][0]) == 1  # only one more after the first (sampled in the admitting step)
    assert s.kv_cache_manager.num_free_blocks == 64


@pytest.mark.parametrize("stop", [(), ("never-matched",)])
def test_decode_registers_each_full_block_as_it_fills(stop):
    # The decode path calls cache_blocks only once a block filled past those it processed:
    # every full block of committed tokens is still registered on the step that commits it (with stop strings,
    # a run's last token is not yet committed, which a one-token run does not change), and again after a
    # preemption's recompute.
    s = make_scheduler(num_blocks=64, block_size=4)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 6, max_tokens=30, stop=list(stop)))
    kv = s.kv_cache_manager
    preempted = False
    while s.has_unfinished_requests():
        step(s, runner)
        a = s.requests.get("a")
        if a is None:
            break
        if a.output_token_ids:
            committed = a.num_tokens - 1
            assert len(kv.block_hashes("a")) == committed // 4, (a.num_tokens, kv.block_hashes("a"))
        if not preempted and len(a.output_token_ids) == 9:
            s._preempt(a)  # as the scheduler does when memory runs short
            runner.rows.pop("a")  # the worker drops its row (the step's preempted_req_ids)
            preempted = True
    assert preempted and kv.num_free_blocks == 64


@pytest.mark.parametrize("seed", [3, None])
def test_resumed_seeded_stream_recomputes_past_a_hit_of_all_but_its_last_token(seed):
    """A seeded request preempted under speculation recomputes up to one token short of its end, so that its last
    token's decode verifies the drafts the interrupted step would have verified (its draws stay in place). When
    the prefix cache holds every full block before that last token, the hit gives one block back: otherwise the
    recompute would be that token alone, verifying nothing. Other requests keep the whole hit."""
    s = make_scheduler(num_blocks=64, block_size=4, num_speculative_tokens=3, num_lookahead_tokens=3)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 8, max_tokens=12, temperature=0.8, seed=seed))
    step(s, runner)  # the prompt: two full blocks, registered, and the first sampled token
    a = s.requests["a"]
    assert a.num_tokens == 9 and len(a.output_token_ids) == 1
    s._preempt(a)  # as the scheduler does when memory runs short
    runner.rows.pop("a")  # the worker drops its row (the step's preempted_req_ids)
    so, _ = step(s, runner)
    if seed is None:
        assert so.num_scheduled_tokens["a"] == 1  # the hit covers the prompt: its last token alone
    else:
        assert so.num_scheduled_tokens["a"] == 4  # from the hit's end (one block) to one token short
    run_to_completion(s, runner)
    assert s.kv_cache_manager.num_free_blocks == 64


@pytest.mark.parametrize("prompt_len", [5, 6, 7, 8])
def test_resumed_seeded_stream_verifies_drafts_only_at_its_last_token(prompt_len):
    """A seeded request's recompute in chunks that ends two tokens short: the chunk that stops one short is that
    one token alone, not a decode. It verifies no drafts, which would sit where its last known token belongs
    (FakeRunner checks where every step's draft slots start)."""
    s = make_scheduler(
        num_blocks=64,
        enable_prefix_caching=False,
        long_prefill_token_threshold=4,
        num_speculative_tokens=2,
        num_lookahead_tokens=2,
    )
    runner = FakeRunner(s)
    s.add_request(make_request("a", prompt_len, max_tokens=12, temperature=0.8, seed=3))
    while len(s.requests["a"].output_token_ids) < 3:
        step(s, runner)
    a = s.requests["a"]
    s._preempt(a)  # as the scheduler does when memory runs short
    runner.rows.pop("a")  # the worker drops its row (the step's preempted_req_ids)
    plans = []
    while a.num_computed_tokens < a.num_tokens - 1:
        so, _ = step(s, runner)
        plans.append((so.num_scheduled_tokens["a"], so.num_draft_positions.get("a", 0)))
    assert all(drafts == 0 for _, drafts in plans), plans
    assert sum(n for n, _ in plans) == a.num_tokens - 1  # it stopped one token short
    so, _ = step(s, runner)
    assert so.num_draft_positions.get("a", 0) == 2  # the decode of its last token verifies the drafts
    run_to_completion(s, runner)
    assert s.kv_cache_manager.num_free_blocks == 64


def test_prefix_caching_off_no_hit():
    s = make_scheduler(num_blocks=64, enable_prefix_caching=False)
    runner = FakeRunner(s)
    s.add_request(make_request("a", list(range(12)), max_tokens=3))
    step(s, runner)
    s.add_request(make_request("b", list(range(12)), max_tokens=3))
    so, _ = step(s, runner)
    assert so.num_scheduled_tokens["b"] == 12 and s.requests["b"].num_cached_tokens == 0


# ---------------------------------------------------------------------------------- preemption
def test_preempts_newest_fcfs_and_resumes_with_generated_tokens():
    # 6 blocks of 4: three 7-token prompts fill the pool; the 9th token of each needs a 3rd block.
    s = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    runner = FakeRunner(s)
    for rid in ("r0", "r1", "r2"):
        s.add_request(make_request(rid, 7, max_tokens=4))
    step(s, runner)  # prefill: 2 blocks each
    s.add_request(make_request("r3", 3, max_tokens=2))
    so, _ = step(s, runner)  # decode at 7 computed -> 8 slots, still 2 blocks; r3 cannot fit
    assert so.preempted_req_ids == set() and "r3" not in so.num_scheduled_tokens
    so, _ = step(s, runner)  # 9 slots: r0 takes r2's blocks
    r2 = s.requests["r2"]
    assert so.preempted_req_ids == {"r2"}
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert not so.scheduled_new_reqs  # nothing admitted in a step that preempted
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_preemptions == 1 and s.stats.num_preemptions == 1
    assert s.kv_cache_manager.get_block_ids("r2") == []
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    generated = list(r2.output_token_ids)
    assert len(generated) == 2
    # Runs on; r2 comes back as a new request carrying prompt + generated tokens.
    resumed = None
    tokens = {}
    while s.has_unfinished_requests():
        so, outs = step(s, runner)
        for d in so.scheduled_new_reqs:
            if d.request_id == "r2":
                resumed = d
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert resumed is not None
    assert resumed.token_ids == r2.prompt_token_ids + generated
    assert resumed.num_prompt_tokens == 7 and resumed.num_computed_tokens == 0
    # Deterministic "model": preemption changed nothing in the output.
    assert generated + tokens["r2"] == [runner.token_fn("r2", 7 + i) for i in range(4)]
    assert s.kv_cache_manager.num_free_blocks == 6
    # The prefill steps ran r2's prompt (and its 2 generated tokens) twice; its prompt counts once.
    assert s.stats.num_prompt_tokens == 3 * 7 + 3
    assert s.stats.num_prompt_tokens_computed >= 3 * 7 + 3 + 7


def test_preempted_request_uses_its_cached_prefix_on_resume():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 15, max_tokens=10))  # 25 tokens: 7 of the 8 blocks
    s.add_request(make_request("b", 15, max_tokens=10))
    preempted_at = None
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        for d in so.scheduled_new_reqs:
            if d.request_id == "b" and preempted_at is not None:
                assert d.num_computed_tokens > 0  # its own committed blocks were still cached
        if so.preempted_req_ids and preempted_at is None:
            preempted_at = so.step_id
            assert so.preempted_req_ids == {"b"}
    assert preempted_at is not None
    assert s.kv_cache_manager.num_free_blocks == 8
    # Its resume hit its own blocks, but the prefix-cache counters count prompts, once each: 30 tokens looked up,
    # none shared.
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (30, 0)


def test_priority_policy_preempts_lowest_priority_even_if_already_planned():
    s = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False, policy="priority")
    runner = FakeRunner(s)
    # Arrival order p5, p0, p1; p5 is first in `running` but has the lowest priority.
    s.add_request(make_request("p5", 7, priority=5, arrival_time=1.0, max_tokens=8))
    s.add_request(make_request("p0", 7, priority=0, arrival_time=2.0, max_tokens=8))
    s.add_request(make_request("p1", 7, priority=1, arrival_time=3.0, max_tokens=8))
    so, _ = step(s, runner)
    assert list(so.num_scheduled_tokens) == ["p0", "p1", "p5"]  # admitted by priority
    step(s, runner)
    so, _ = step(s, runner)
    assert so.preempted_req_ids == {"p5"}
    assert set(so.num_scheduled_tokens) == {"p0", "p1"}
    assert "p5" not in so.scheduled_cached_reqs.request_ids
    assert so.total_num_scheduled_tokens == 2
    assert s.requests["p5"].status == RequestStatus.PREEMPTED
    run_to_completion(s, runner)
    assert s.kv_cache_manager.num_free_blocks == 6


def _low_planned_before_hi(runner_check: bool = True):
    """3 blocks of 4. `low` (priority 9) is admitted first, so it precedes `hi` in `running`;
    at step 3 `hi` (8 computed) needs a third block after `low` was already visited."""
    s = make_scheduler(num_blocks=3, block_size=4, enable_prefix_caching=False, policy="priority")
    runner = FakeRunner(s, check=runner_check)
    s.add_request(make_request("low", 2, priority=9, arrival_time=0.0, max_tokens=4))
    step(s, runner)
    s.add_request(make_request("hi", 8, priority=0, arrival_time=1.0, max_tokens=4))
    step(s, runner)
    assert [r.request_id for r in s.running] == ["low", "hi"]
    assert s.kv_cache_manager.num_free_blocks == 0
    return s, runner


def test_priority_victim_planned_earlier_in_step_gives_budget_back():
    s, runner = _low_planned_before_hi()
    so, _ = step(s, runner)
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"hi": 1} and so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.request_ids == ["hi"]
    assert len(so.scheduled_cached_reqs.new_block_ids) == len(so.scheduled_cached_reqs.num_computed_tokens) == 1
    low = s.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    outs = run_to_completion(s, runner)
    assert outs["low"][1] == "length" and outs["hi"][1] == "length"
    assert s.kv_cache_manager.num_free_blocks == 3


def test_priority_victim_without_tokens_this_step_no_keyerror():
    """A visited running request with nothing to compute is not in num_scheduled (was a KeyError)."""
    s, _ = _low_planned_before_hi(runner_check=False)
    low = s.requests["low"]
    low.num_computed_tokens = low.num_tokens  # its last step's result not in yet (async scheduling)
    so = s.schedule()
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"hi": 1} and so.total_num_scheduled_tokens == 1


def test_priority_admission_order():
    s = make_scheduler(num_blocks=64, max_num_seqs=1, policy="priority")
    runner = FakeRunner(s)
    for rid, prio, t in (("c", 3, 0.0), ("a", 1, 1.0), ("b", 2, 2.0), ("a2", 1, 3.0)):
        s.add_request(make_request(rid, 4, priority=prio, arrival_time=t, max_tokens=1))
    order = []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        order += [d.request_id for d in so.scheduled_new_reqs]
    assert order == ["a", "a2", "b", "c"]


# ---------------------------------------------------------------------------------- lookahead
def test_lookahead_slots_reserved_for_decodes():
    k, bs = 4, 4
    s = make_scheduler(num_blocks=64, block_size=bs, num_lookahead_tokens=k, max_num_batched_tokens=64)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 6, max_tokens=12))
    s.add_request(make_request("b", 30, max_tokens=2))
    so, _ = step(s, runner)
    # Admission with the whole prompt samples, so the drafter's k slots are reserved too.
    assert len(s.kv_cache_manager.get_block_ids("a")) == cdiv(6 + k, bs)
    while "a" in s.requests:
        a = s.requests["a"]
        computed = a.num_computed_tokens
        so, _ = step(s, runner)
        assert so.num_scheduled_tokens["a"] == 1
        if "a" in s.requests:
            assert len(s.kv_cache_manager.get_block_ids("a")) == cdiv(computed + 1 + k, bs)


def test_lookahead_only_on_last_prefill_chunk():
    k, bs = 4, 4
    s = make_scheduler(num_blocks=64, block_size=bs, num_lookahead_tokens=k, long_prefill_token_threshold=8)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 20, max_tokens=3))
    sizes = []
    for _ in range(3):
        so, _ = step(s, runner)
        sizes.append(len(s.kv_cache_manager.get_block_ids("a")))
    # chunks 8 (admission, no lookahead), 8 (not last: none), 4 (last: + k)
    assert sizes == [2, 4, cdiv(20 + k, bs)]


def test_lookahead_capped_at_max_model_len_no_self_preemption():
    """A lone request in a pool sized for max_model_len must not preempt itself near the end."""
    bs, max_len = 4, 16
    s = make_scheduler(num_blocks=cdiv(max_len, bs), block_size=bs, num_lookahead_tokens=4, max_model_len=max_len)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 6, max_tokens=None))
    outs = run_to_completion(s, runner)
    assert len(outs["a"][0]) == max_len - 6 and outs["a"][1] == "length"
    assert s.stats.num_preemptions == 0


# ---------------------------------------------------------------------------------- stop checks
def _run_one(s, request, token_fn=None):
    runner = FakeRunner(s) if token_fn is None else FakeRunner(s, token_fn)
    s.add_request(request)
    return run_to_completion(s, runner)[request.request_id]


def test_max_tokens_exact():
    s = make_scheduler()
    tokens, reason = _run_one(s, make_request("a", 5, max_tokens=7))
    assert len(tokens) == 7 and reason == "length"


def test_max_model_len_exact():
    s = make_scheduler(max_model_len=12)
    tokens, reason = _run_one(s, make_request("a", 8, max_tokens=None))
    assert len(tokens) == 4 and reason == "length"


def test_max_model_len_beats_larger_max_tokens():
    s = make_scheduler(max_model_len=12)
    tokens, reason = _run_one(s, make_request("a", 8, max_tokens=100))
    assert len(tokens) == 4 and reason == "length"


EOS = 7


def _eos_at(n: int):
    """Runner that samples EOS as the n-th output token (1-based)."""

    def fn(rid: str, position: int) -> int:
        return EOS if position == fn.prompt_len + n - 1 else 2000 + position

    return fn


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos(ignore_eos):
    s = make_scheduler()
    fn = _eos_at(3)
    fn.prompt_len = 5
    req = make_request("a", 5, eos=frozenset({EOS}), max_tokens=6, ignore_eos=ignore_eos)
    tokens, reason = _run_one(s, req, fn)
    if ignore_eos:
        assert len(tokens) == 6 and tokens[2] == EOS and reason == "length"
    else:
        assert tokens[-1] == EOS and len(tokens) == 3 and reason == "stop"
        assert req.stop_reason is None


def test_stop_token_ids_even_with_ignore_eos():
    s = make_scheduler()
    fn = _eos_at(2)
    fn.prompt_len = 5
    req = make_request("a", 5, max_tokens=6, stop_token_ids=[EOS], ignore_eos=True)
    tokens, reason = _run_one(s, req, fn)
    assert len(tokens) == 2 and reason == "stop" and req.stop_reason == EOS


def test_eos_on_the_last_allowed_token_is_a_stop():
    s = make_scheduler()
    fn = _eos_at(4)
    fn.prompt_len = 5
    req = make_request("a", 5, eos=frozenset({EOS}), max_tokens=4)
    tokens, reason = _run_one(s, req, fn)
    assert len(tokens) == 4 and reason == "stop"


def test_min_tokens_blocks_stop_ids_like_the_sampler():
    # The sampler masks stop ids while fewer than min_tokens tokens exist, so the earliest
    # stop is output token min_tokens + 1. A stop id before that is not a stop.
    s = make_scheduler()
    req = make_request("a", 5, eos=frozenset({EOS}), max_tokens=10, min_tokens=3, stop_token_ids=[8])
    tokens, reason = _run_one(s, req, lambda rid, pos: EOS if pos % 2 else 8)
    # Outputs alternate EOS, 8, EOS, 8 (positions 5..8): the first three are ignored.
    assert tokens == [EOS, 8, EOS, 8] and reason == "stop" and req.stop_reason == 8


def test_finished_ids_in_next_output_and_blocks_freed():
    s = make_scheduler(num_blocks=32)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 5, max_tokens=2))
    s.add_request(make_request("b", 5, max_tokens=4))
    step(s, runner)
    so, outs = step(s, runner)
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "length", "b": None}
    assert "a" not in so.finished_req_ids
    assert "a" not in s.requests and s.kv_cache_manager.get_block_ids("a") == []
    so, _ = step(s, runner)
    assert so.finished_req_ids == {"a"} and "a" not in so.num_scheduled_tokens
    so, _ = step(s, runner)
    assert so.finished_req_ids == set()
    so, _ = step(s, runner)
    assert so.finished_req_ids == {"b"} and so.is_empty
    assert s.kv_cache_manager.num_free_blocks == 32


def test_results_of_request_aborted_between_schedule_and_update_are_discarded():
    s = make_scheduler(num_blocks=32)
    runner = FakeRunner(s)
    s.add_request(make_request("a", 5, max_tokens=8))
    s.add_request(make_request("b", 5, max_tokens=8))
    step(s, runner)
    a = s.requests["a"]
    so = s.schedule()
    finished = s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert finished == [a] and a.finish_reason == "abort"
    n_out = a.num_output_tokens
    outs = s.update_from_output(so, runner.execute(so))
    assert [o.request_id for o in outs] == ["b"]
    assert a.num_output_tokens == n_out
    assert s.kv_cache_manager.get_block_ids("a") == []
    assert s.schedule().finished_req_ids == {"a"}


# ---------------------------------------------------------------------------------- aborts
def test_abort_waiting_and_running_frees_everything():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    runner = FakeRunner(s)
    s.add_request(make_request("run", 10, max_tokens=50))
    s.add_request(make_request("chunk", 30, max_tokens=50))  # partially prefilled: running
    s.add_request(make_request("wait", 30, max_tokens=50))  # cannot fit yet: waiting
    step(s, runner)
    step(s, runner)
    assert {r.request_id for r in s.running} == {"run", "chunk"}
    assert [r.request_id for r in s.waiting] == ["wait"]
    assert s.kv_cache_manager.num_free_blocks < 16
    finished = s.finish_requests(["wait", "chunk", "run", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["wait", "chunk", "run"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in finished)
    assert s.kv_cache_manager.num_free_blocks == 16
    assert not s.has_unfinished_requests() and s.requests == {}
    assert s.finish_requests(["run"], RequestStatus.FINISHED_ABORTED) == []  # idempotent
    so = s.schedule()
    assert so.finished_req_ids == {"wait", "chunk", "run"} and so.is_empty
    assert s.stats.num_finished_requests == 3


def test_abort_preempted_request():
    s = make_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    runner = FakeRunner(s)
    for rid in ("r0", "r1", "r2"):
        s.add_request(make_request(rid, 7, max_tokens=6))
    for _ in range(3):
        so, _ = step(s, runner)
    assert s.requests["r2"].status == RequestStatus.PREEMPTED
    s.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 0
    run_to_completion(s, runner)
    assert s.kv_cache_manager.num_free_blocks == 6


def test_a_failure_reported_for_an_old_request_never_ends_a_newer_one_with_its_id():
    """Asynchronous loop: r1 fails in step N, is aborted and resubmitted under the same id, and
    the new r1 is planned into step N+1 before step N is reconciled. Step N's failure report names
    the old r1 only: the new one runs on."""
    from asyncspec.core.scheduler_output import ModelRunnerOutput
    from asyncspec.request import RequestStatus
    from tests.core.scheduler_fakes import make_request, make_scheduler

    scheduler = make_scheduler()
    old = make_request("r1", 8)
    scheduler.add_request(old)
    step_n = scheduler.schedule()
    scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    new = make_request("r1", 8)
    scheduler.add_request(new)
    step_n1 = scheduler.schedule()
    assert "r1" in step_n1.num_scheduled_tokens
    failed = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed_requests={"r1": "no valid token"})
    outputs = scheduler.update_from_output(step_n, failed)
    assert outputs == [] and new.status == RequestStatus.RUNNING and scheduler.requests["r1"] is new


def test_min_tokens_requests_are_forgotten_when_they_finish():
    from asyncspec.request import RequestStatus
    from tests.core.scheduler_fakes import make_request, make_scheduler

    scheduler = make_scheduler()
    request = make_request("m", 8, min_tokens=4)
    scheduler.add_request(request)
    scheduler.schedule()
    assert scheduler.requires_exact_counts()
    scheduler.finish_requests(["m"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler._below_min_tokens and not scheduler.requires_exact_counts()
