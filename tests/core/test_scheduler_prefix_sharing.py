"""Prompts that share a prefix, arriving together (SchedulerConfig.prefix_sharing_wait_tokens): a waiting request
whose next prompt blocks another request is computing waits for them to be registered and hits them, rather than
compute them a second time; it keeps its slot in the batch, the requests behind it are admitted meanwhile into the
slots left, and the tokens are the same."""

from __future__ import annotations

import pytest

from .scheduler_fakes import FakeRunner, make_request, make_scheduler, run_to_completion, step

SHARED = list(range(200, 232))  # 32 tokens: 8 blocks of 4


def _scheduler(wait: int, **cfg):
    return make_scheduler(
        num_blocks=256, block_size=4, max_num_batched_tokens=256, prefix_sharing_wait_tokens=wait, **cfg
    )


def _burst(s, shared: list[int] = SHARED) -> None:
    """a, b and c share `shared` (then differ), d shares nothing; all arrive before the first plan."""
    for i, name in enumerate("abc"):
        s.add_request(make_request(name, shared + [i + 1] * 5, temperature=0.0, max_tokens=6))
    s.add_request(make_request("d", 20, temperature=0.0, max_tokens=6))


def _tokens(outputs, into: dict[str, list[int]]) -> None:
    for output in outputs:
        into.setdefault(output.request_id, []).extend(output.new_token_ids)


def test_a_burst_with_one_prefix_computes_it_once_and_emits_the_same_tokens():
    tokens: dict[int, dict[str, list[int]]] = {}
    computed, cached = {}, {}
    for wait in (0, 16):
        s = _scheduler(wait)
        _burst(s)
        emitted = tokens[wait] = {}
        first, outputs = step(s, runner := FakeRunner(s))
        _tokens(outputs, emitted)
        # b and c wait for a's blocks; d, behind them, does not.
        expected_first = ["a", "b", "c", "d"] if wait == 0 else ["a", "d"]
        assert [r.request_id for r in first.scheduled_new_reqs] == expected_first
        if wait:
            assert [r.request_id for r in s.waiting] == ["b", "c"]
            second, outputs = step(s, runner)
            _tokens(outputs, emitted)
            admitted = {r.request_id: r for r in second.scheduled_new_reqs}
            assert list(admitted) == ["b", "c"]
            # All 32 shared tokens hit: they compute their own 5 tokens only.
            assert all(r.num_computed_tokens == 32 for r in admitted.values())
            assert all(second.num_scheduled_tokens[r] == 5 for r in admitted)
        for request_id, (rest, reason) in run_to_completion(s, runner).items():
            emitted.setdefault(request_id, []).extend(rest)
            assert reason == "length"
        computed[wait] = s.stats.num_prompt_tokens_computed
        cached[wait] = s.stats.num_prompt_tokens_cached
        assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
        assert not s.kv_cache_manager._pending_blocks
    assert tokens[0] == tokens[16] and all(len(t) == 6 for t in tokens[16].values())
    assert cached == {0: 0, 16: 64}
    assert computed[0] - computed[16] == 64
    assert s.stats.num_prefix_sharing_waits == 2


def test_a_shared_run_below_the_threshold_is_computed_again():
    s = _scheduler(16)
    _burst(s, shared=SHARED[:12])  # 3 blocks, 12 tokens < 16
    first, _ = step(s, FakeRunner(s))
    assert [r.request_id for r in first.scheduled_new_reqs] == ["a", "b", "c", "d"]
    assert s.stats.num_prefix_sharing_waits == 0


def test_without_prefix_caching_nothing_waits():
    s = make_scheduler(
        num_blocks=256, max_num_batched_tokens=256, enable_prefix_caching=False, prefix_sharing_wait_tokens=16
    )
    _burst(s)
    first, _ = step(s, FakeRunner(s))
    assert len(first.scheduled_new_reqs) == 4


def test_a_waiting_request_waits_through_plans_made_before_the_owners_step_retires():
    """The asynchronous loop plans step N + 1 before step N's results are reconciled: the blocks step N computes
    are still pending then, so b waits once more, and is admitted with the hit by the plan after."""
    s = _scheduler(16)
    runner = FakeRunner(s, check=False)
    s.add_request(make_request("a", SHARED + [1, 1], temperature=0.0, max_tokens=4))
    s.add_request(make_request("b", SHARED + [2, 2], temperature=0.0, max_tokens=4))
    first = s.schedule()
    assert [r.request_id for r in first.scheduled_new_reqs] == ["a"]
    second = s.schedule()  # step 1 in flight
    assert second.scheduled_new_reqs == []
    s.update_from_output(first, runner.execute(first))
    s.update_from_output(second, runner.execute(second))
    third = s.schedule()
    assert [(r.request_id, r.num_computed_tokens) for r in third.scheduled_new_reqs] == [("b", 32)]


def test_a_long_prompt_in_chunks_is_waited_for_chunk_by_chunk():
    """a's 64-token prompt takes four chunks of 16: b hits what each chunk registered and waits while what is
    left to share is 16 tokens or more; it computes the last shared block's tokens itself."""
    shared = list(range(300, 364))
    s = _scheduler(16, long_prefill_token_threshold=16)
    s.add_request(make_request("a", shared + [1], temperature=0.0, max_tokens=4))
    s.add_request(make_request("b", shared + [2], temperature=0.0, max_tokens=4))
    runner = FakeRunner(s)
    plans = []
    while not s.requests["b"].num_computed_tokens:
        so, _ = step(s, runner)
        plans.append(so)
        assert len(plans) < 10
    (admitted,) = plans[-1].scheduled_new_reqs
    assert admitted.request_id == "b" and admitted.num_computed_tokens >= 64 - 16
    assert len(plans) >= 3
    assert s.stats.num_prompt_tokens_cached >= 48


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_that_wait_keep_their_places(policy):
    """b waits for a's blocks and keeps its slot: e, behind it, takes the last free one, and f waits. The next plan
    admits b with the hit; f, then g (arrived later), follow as slots free up."""
    s = _scheduler(16, policy=policy, max_num_seqs=3)
    s.add_request(make_request("a", SHARED + [1], temperature=0.0, max_tokens=30, arrival_time=1.0))
    s.add_request(make_request("b", SHARED + [2], temperature=0.0, max_tokens=30, arrival_time=2.0))
    s.add_request(make_request("e", 8, temperature=0.0, max_tokens=3, arrival_time=3.0))
    s.add_request(make_request("f", 8, temperature=0.0, max_tokens=30, arrival_time=4.0))
    runner = FakeRunner(s)
    first, _ = step(s, runner)
    assert [r.request_id for r in first.scheduled_new_reqs] == ["a", "e"]
    s.add_request(make_request("g", 8, temperature=0.0, max_tokens=30, arrival_time=5.0))
    assert [r.request_id for r in s.waiting] == ["b", "f", "g"]
    second, _ = step(s, runner)
    assert [(r.request_id, r.num_computed_tokens) for r in second.scheduled_new_reqs] == [("b", 32)]
    while "e" in s.requests:
        so, _ = step(s, runner)
        assert not so.scheduled_new_reqs
    so, _ = step(s, runner)
    assert [r.request_id for r in so.scheduled_new_reqs] == ["f"]
    assert [r.request_id for r in s.waiting] == ["g"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_waiting_for_a_prefix_is_not_left_behind_by_a_full_batch(policy):
    """The batch holds two. w waits for a's blocks; x, behind it (and of lower priority), must not take the slot
    w is waiting to fill, or w would wait for a or x to finish (100 steps) instead of a plan or two."""
    s = _scheduler(16, policy=policy, max_num_seqs=2)
    s.add_request(make_request("a", SHARED + [1], temperature=0.0, max_tokens=100))
    s.add_request(make_request("w", SHARED + [2], temperature=0.0, max_tokens=3))
    s.add_request(make_request("x", 8, temperature=0.0, max_tokens=100, priority=1))
    runner = FakeRunner(s)
    first_token: dict[str, int] = {}
    for i in range(1, 200):
        so, outputs = step(s, runner)
        for output in outputs:
            if output.new_token_ids:
                first_token.setdefault(output.request_id, i)
        if "w" in first_token:
            break
    assert first_token["w"] <= 3, first_token
    assert "x" not in first_token  # admitted after w finishes, not before w's first token
    assert s.stats.num_prefix_sharing_waits >= 1


def test_a_plan_examines_at_most_a_batch_of_waiting_requests_sharing_a_prefix():
    """Two hundred requests with one prompt arrive together: the plan admits the first, sets aside as many as the
    batch has free slots (15 of max_num_seqs 16) to wait for its blocks and looks no further; the next plan admits
    those 15 with the hit."""
    s = _scheduler(16)
    for i in range(200):
        s.add_request(make_request(f"r{i}", SHARED + [i % 50 + 1], temperature=0.0, max_tokens=2))
    runner = FakeRunner(s)
    first, _ = step(s, runner)
    assert [r.request_id for r in first.scheduled_new_reqs] == ["r0"]
    assert s.stats.num_prefix_sharing_waits == 15
    assert [r.request_id for r in s.waiting][:3] == ["r1", "r2", "r3"]
    second, _ = step(s, runner)
    assert [(r.request_id, r.num_computed_tokens) for r in second.scheduled_new_reqs] == [
        (f"r{i}", 32) for i in range(1, 16)
    ]


def test_priority_ties_keep_their_order_through_sharing_waits():
    """Equal priorities and arrival times: the queue's order of arrival breaks the tie, also for requests set aside
    and put back plan after plan."""
    s = _scheduler(16, policy="priority", max_num_seqs=4)
    s.add_request(make_request("a", SHARED + [1], temperature=0.0, max_tokens=40, arrival_time=1.0))
    for name in "bcd":
        s.add_request(make_request(name, SHARED + [2], temperature=0.0, max_tokens=40, arrival_time=2.0))
    s.add_request(make_request("e", 8, temperature=0.0, max_tokens=40, arrival_time=2.0))
    runner = FakeRunner(s)
    orders = []
    for _ in range(4):
        step(s, runner)
        orders.append([r.request_id for r in s.waiting])
    assert orders[0] == ["b", "c", "d", "e"]  # the three set aside hold the batch's free slots: e waits behind them
    assert orders[1:] == [["e"]] * 3  # b, c and d admitted in their order; e waits for a slot


def test_requests_set_aside_are_back_in_the_queue_if_planning_fails(monkeypatch):
    s = _scheduler(16)
    _burst(s)
    allocate = s.kv_cache_manager.allocate_slots

    def failing(request, *args, **kw):
        if request.request_id == "d":
            raise RuntimeError("allocation failed")
        return allocate(request, *args, **kw)

    monkeypatch.setattr(s.kv_cache_manager, "allocate_slots", failing)
    with pytest.raises(RuntimeError):
        s.schedule()
    assert [r.request_id for r in s.waiting] == ["b", "c", "d"]
