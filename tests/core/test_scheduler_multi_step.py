"""Multi-step plans (SchedulerConfig.num_scheduler_steps): several greedy decode steps per plan, only while every
running request may take them, never past max_model_len (past a request's max_tokens or EOS, the tokens after its
end are dropped); the same tokens as one step per plan."""

from __future__ import annotations

import pytest

from .scheduler_fakes import FakeRunner, make_request, make_scheduler, run_to_completion, step

EOS = 7


def _greedy(request_id: str, prompt: int, **params):
    return make_request(request_id, prompt, temperature=0.0, **params)


def _plans(s, runner, max_plans: int = 500) -> list[tuple[int, dict[str, int]]]:
    """(num_steps, tokens emitted per request) of every plan until nothing is left."""
    plans = []
    for _ in range(max_plans):
        if not s.has_unfinished_requests():
            return plans
        so, outs = step(s, runner)
        plans.append((so.num_steps, {o.request_id: len(o.new_token_ids) for o in outs}))
    raise AssertionError("did not drain")


def _requests():
    return [
        _greedy("a", 6, max_tokens=13),
        _greedy("b", 9, max_tokens=2),
        _greedy("c", 5, max_tokens=None, eos=frozenset({EOS})),
        _greedy("d", 7, max_tokens=20, stop_token_ids=[EOS], ignore_eos=True),
    ]


def _eos_after(n_by_request: dict[str, int], prompt_len: dict[str, int]):
    """Samples EOS as the n-th output token of the named requests, distinct ids elsewhere."""

    def fn(rid: str, position: int) -> int:
        n = n_by_request.get(rid)
        return EOS if n is not None and position == prompt_len[rid] + n - 1 else 2000 + position

    return fn


@pytest.mark.parametrize("num_steps", [2, 4, 7])
def test_multi_step_plans_emit_the_tokens_of_one_step_plans(num_steps):
    prompt_len = {"a": 6, "b": 9, "c": 5, "d": 7}
    token_fn = _eos_after({"c": 10, "d": 6}, prompt_len)
    results = []
    for steps in (1, num_steps):
        s = make_scheduler(num_blocks=64, block_size=4, max_model_len=64, num_scheduler_steps=steps)
        runner = FakeRunner(s, token_fn)
        for r in _requests():
            s.add_request(r)
        results.append(run_to_completion(s, runner))
        assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    single, multi = results
    assert multi == single
    assert multi["c"] == [[2000 + p for p in range(5, 14)] + [EOS], "stop"]  # EOS cuts the run it lands in
    assert multi["d"][1] == "stop" and len(multi["d"][0]) == 6
    assert len(multi["a"][0]) == 13 and multi["a"][1] == "length"


def test_plans_take_several_steps_only_when_every_request_can_and_never_past_a_limit():
    s = make_scheduler(num_blocks=64, block_size=4, max_model_len=40, num_scheduler_steps=4)
    runner = FakeRunner(s)
    s.add_request(_greedy("a", 6, max_tokens=10))
    s.add_request(_greedy("b", 30, max_tokens=None))  # max_model_len leaves it 10 tokens
    plans = _plans(s, runner)
    # The admission step samples each request's first token; then 4-step plans until a limit is near.
    assert plans[0] == (1, {"a": 1, "b": 1})
    assert [n for n, _ in plans[1:]] == [4, 4, 1]  # 9 tokens left to each after the first: 4 + 4 + 1
    assert plans[1][1] == {"a": 4, "b": 4} and plans[2][1] == {"a": 4, "b": 4}
    assert sum(out.get("a", 0) for _, out in plans) == 10
    assert sum(out.get("b", 0) for _, out in plans) == 10


def test_runs_pass_a_requests_max_tokens_and_drop_the_tokens_after_it():
    """Requests that end at different steps keep the runs at full length until the longest one ends: a request's
    tokens after its max_tokens are dropped, the output is that of one-step plans, every block comes back."""
    limits = {"a": 6, "b": 11, "c": 17}
    results, plans = [], []
    for steps in (1, 4):
        for collect in (run_to_completion, _plans):
            s = make_scheduler(num_blocks=64, block_size=4, max_model_len=64, num_scheduler_steps=steps)
            runner = FakeRunner(s)
            for rid, m in limits.items():
                s.add_request(_greedy(rid, 5, max_tokens=m))
            (results if collect is run_to_completion else plans).append(collect(s, runner))
            assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    assert results[1] == results[0]
    assert {rid: (len(tokens), reason) for rid, (tokens, reason) in results[1].items()} == {
        rid: (m, "length") for rid, m in limits.items()
    }
    multi = plans[1]
    # After the admission plan: 5, 10 and 16 tokens left; four runs of 4 steps, the last ones past a and b's end.
    assert [n for n, _ in multi] == [1, 4, 4, 4, 4]
    assert [out.get("a", 0) for _, out in multi] == [1, 4, 1, 0, 0]
    assert [out.get("b", 0) for _, out in multi] == [1, 4, 4, 2, 0]


@pytest.mark.parametrize(
    "other",
    [
        dict(temperature=0.8),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.0, logprobs=1),
        dict(temperature=0.0, min_tokens=3),
    ],
)
def test_one_step_per_plan_while_a_request_needs_the_sampler(other):
    s = make_scheduler(num_blocks=64, block_size=4, num_scheduler_steps=4)
    runner = FakeRunner(s)
    s.add_request(_greedy("a", 6, max_tokens=30))
    s.add_request(make_request("b", 6, max_tokens=5, **other))
    plans = _plans(s, runner)
    num_b = next(i for i, (_, out) in enumerate(plans) if sum(o.get("b", 0) for _, o in plans[: i + 1]) == 5)
    assert all(n == 1 for n, _ in plans[: num_b + 1]), plans[: num_b + 1]
    assert any(n == 4 for n, _ in plans[num_b + 1 :]), "once b finished, a alone takes several steps a plan"


def test_a_prefill_or_a_request_waiting_for_room_keeps_plans_to_one_step():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, num_scheduler_steps=4)
    runner = FakeRunner(s)
    s.add_request(_greedy("a", 6, max_tokens=30))
    step(s, runner)
    so, _ = step(s, runner)
    assert so.num_steps == 4
    # A long prompt is admitted and chunked: its chunks are not decodes, so plans go back to one step.
    s.add_request(_greedy("b", 20, max_tokens=30))
    so, _ = step(s, runner)
    assert so.num_steps == 1 and "b" in so.num_scheduled_tokens
    while s.requests["b"].num_computed_tokens < 20:
        so, _ = step(s, runner)
        assert so.num_steps == 1
    so, _ = step(s, runner)
    assert so.num_steps == 4
    # The batch is full (max_num_seqs 2): a waiting request could not be admitted anyway.
    s.add_request(_greedy("c", 5, max_tokens=3))
    so, _ = step(s, runner)
    assert so.num_steps == 4 and "c" not in so.num_scheduled_tokens


def test_multi_step_slots_are_reserved_and_reconciled_when_planned_ahead():
    """The asynchronous order: the next plan is made before this one's results are reconciled. Each plan
    reserves slots for all its steps, the optimistic counts include the plan in flight, and once reconciled
    they equal the tokens really emitted; the plan in flight when the request ends is void."""
    bs = 4
    s = make_scheduler(num_blocks=64, block_size=bs, num_scheduler_steps=3)
    runner = FakeRunner(s, check=False)
    request = _greedy("a", 5, max_tokens=14)
    s.add_request(request)
    so = s.schedule()
    s.update_from_output(so, runner.execute(so))  # admission: the first token
    emitted = 1
    in_flight = s.schedule()
    assert in_flight.num_steps == 3
    while s.has_unfinished_requests():
        assert len(s.kv_cache_manager.get_block_ids("a")) * bs >= request.num_computed_tokens
        nxt = s.schedule()  # planned while `in_flight` runs
        planned_ahead = nxt.num_steps if nxt.num_scheduled_tokens else 0
        outs = s.update_from_output(in_flight, runner.execute(in_flight))
        emitted += sum(len(o.new_token_ids) for o in outs)
        if s.has_unfinished_requests():
            # Reconciled: every kept token but the newest is computed, plus the plan still in flight.
            assert request.num_computed_tokens == len(request.all_token_ids) - 1 + planned_ahead
            assert request.num_output_placeholders == planned_ahead
        in_flight = nxt
    assert emitted == 14 and len(request.output_token_ids) == 14
    if in_flight.num_scheduled_tokens:  # planned before the request ended: its results are discarded
        assert s.update_from_output(in_flight, runner.execute(in_flight)) == []
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks


def test_steps_per_plan_caps_the_plans_and_is_checked():
    """The engine's adaptive tuner sets the cap: plans follow it as it changes, tokens are unchanged."""
    results = []
    for steps in (1, 4):
        s = make_scheduler(num_blocks=64, block_size=4, max_model_len=64, num_scheduler_steps=steps)
        runner = FakeRunner(s)
        s.add_request(_greedy("a", 6, max_tokens=30))
        s.add_request(_greedy("b", 5, max_tokens=30))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        if steps == 4:
            plan_steps = []
            for cap in (1, 2, 2, 3, 4, 1, 4):
                s.set_steps_per_plan(cap)
                so, outs = step(s, runner)
                plan_steps.append(so.num_steps)
                for o in outs:
                    tokens[o.request_id] += o.new_token_ids
            assert plan_steps == [1, 2, 2, 3, 4, 1, 4]  # the admission step, then decodes take the whole cap
            for bad in (0, 5, -1):
                with pytest.raises(ValueError, match="steps per plan"):
                    s.set_steps_per_plan(bad)
            assert s.steps_per_plan == 4  # a refused value changes nothing
        for rid, (rest, reason) in run_to_completion(s, runner).items():
            tokens[rid] += rest
            assert reason == "length"
        results.append(tokens)
    assert results[1] == results[0] and len(results[0]["a"]) == 30


def _speculating_scheduler(**cfg):
    """A scheduler of k = 4 with up to 4 steps a plan."""
    return make_scheduler(
        num_blocks=64,
        block_size=4,
        max_model_len=64,
        num_scheduler_steps=4,
        num_speculative_tokens=4,
        num_lookahead_tokens=4,
        **cfg,
    )


@pytest.mark.parametrize("max_draft_lag", [0, 2, 16])
def test_a_speculating_scheduler_runs_several_steps_only_at_k0(max_draft_lag):
    """With speculation a plan takes several steps only when it verifies nothing and the policy chose k = 0 for
    the next plan too (asked once per plan, before the run), at most max_draft_lag + 1 with a draft model."""
    s = _speculating_scheduler(max_draft_lag=max_draft_lag)
    runner = FakeRunner(s)
    asked = []

    def choose(num_decodes: int, *counts: object) -> int:
        asked.append(num_decodes)
        return 0

    s.spec_policy.choose = choose  # type: ignore[method-assign]
    s.add_request(_greedy("a", 6, max_tokens=40))
    s.add_request(_greedy("b", 5, max_tokens=40))
    plans = []
    for _ in range(6):
        so, _ = step(s, runner)
        plans.append((so.num_speculative_tokens, so.num_proposals, so.num_steps))
    cap = 4 if max_draft_lag == 0 else min(4, max_draft_lag + 1)
    # The admission plan verifies the configured k (nothing to verify: a prefill) and proposes the policy's 0.
    assert plans[0] == (4, 0, 1)
    assert plans[1:] == [(0, 0, cap)] * 5
    assert len(asked) == len(plans)  # one choice per plan, not per step


def test_a_plan_before_speculation_resumes_takes_one_step():
    """When the policy turns speculation back on, the plan that proposes the drafts is a single step, and the
    next one verifies them."""
    s = _speculating_scheduler()
    runner = FakeRunner(s)
    script = iter([0, 0, 2, 0])
    s.spec_policy.choose = lambda num_decodes, *counts: next(script)  # type: ignore[method-assign]
    s.add_request(_greedy("a", 6, max_tokens=40))
    plans = []
    for _ in range(3):
        so, _ = step(s, runner)
        plans.append((so.num_speculative_tokens, so.num_proposals, so.num_steps))
    assert plans == [(4, 0, 1), (0, 0, 4), (0, 2, 1)]
    so = s.schedule()
    assert so.num_speculative_tokens == 2 and so.num_scheduled_tokens["a"] == 3  # 1 + its 2 drafts


def test_steady_speculation_runs_several_verification_steps():
    """With multi_step_speculation a plan at a steady k (it verifies k, the next verifies k) takes several steps:
    every request is scheduled 1 + k tokens a step, with slots for every step and the last one's k proposals;
    runs may pass max_tokens, never max_model_len; a request with a stop string, or one about to sample its first
    token, keeps plans to one step. The tokens equal those of one step a plan (the fake worker rejects every
    draft), and the blocks all come back."""
    prompt_len = {"a": 6, "b": 9, "c": 5, "d": 7}
    token_fn = _eos_after({"c": 10}, prompt_len)
    results, all_plans = [], []
    for multi in (False, True):
        s = _speculating_scheduler(multi_step_speculation=multi)
        s.spec_policy.choose = lambda num_decodes, *counts: 4  # type: ignore[method-assign]
        runner = FakeRunner(s, token_fn)
        for r in (
            _greedy("a", 6, max_tokens=13),
            _greedy("b", 9, max_tokens=30),
            _greedy("c", 5, max_tokens=None, eos=frozenset({EOS})),
            _greedy("d", 7, max_tokens=None),  # up to max_model_len (64)
        ):
            s.add_request(r)
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str | None] = {}
        plans = []
        kv = s.kv_cache_manager
        while s.has_unfinished_requests():
            so = s.schedule()
            plans.append((so.num_speculative_tokens, so.num_proposals, so.num_steps))
            if so.num_steps > 1:
                assert so.num_speculative_tokens == so.num_proposals == 4
                for rid, n in so.num_scheduled_tokens.items():
                    assert n == 5 and so.num_draft_positions[rid] == 4
                    request = s.requests[rid]
                    # Slots for every step's 1 + k tokens and the last step's k proposals, below max_model_len.
                    held = len(kv.get_block_ids(rid)) * kv.block_size
                    start = request.num_computed_tokens - 5 * so.num_steps
                    assert held >= start + 5 * so.num_steps + 4 and start + 5 * so.num_steps + 4 <= 64
            for o in s.update_from_output(so, runner.execute(so)):
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                reasons[o.request_id] = o.finish_reason
        assert kv.num_free_blocks == kv.num_blocks
        results.append((tokens, reasons))
        all_plans.append(plans)
    assert results[1] == results[0]
    single, multi = all_plans
    assert all(steps == 1 for _, _, steps in single)
    assert sum(steps > 1 for _, _, steps in multi) >= 3, multi
    assert len(multi) < len(single)
    assert len(results[1][0]["d"]) == 64 - 7  # to max_model_len, the last plans one step each
    assert len(results[1][0]["a"]) == 13 and results[1][1]["c"] == "stop"


def test_steady_speculation_keeps_one_step_for_a_stop_string():
    s = _speculating_scheduler(multi_step_speculation=True)
    s.spec_policy.choose = lambda num_decodes, *counts: 4  # type: ignore[method-assign]
    runner = FakeRunner(s)
    s.add_request(_greedy("a", 6, max_tokens=30))
    s.add_request(_greedy("b", 5, max_tokens=30, stop=["x"]))
    steps = []
    for _ in range(8):
        so, _ = step(s, runner)
        steps.append(so.num_steps)
    assert steps == [1] * 8


def test_a_request_waiting_for_memory_keeps_speculation_on():
    """With measured costs a plan proposes no drafts while admissions are pending (the next plan computes prompt
    chunks), but a request that waits for KV memory is no admission: the plans that admit nothing go on
    speculating."""
    s = make_scheduler(
        num_blocks=40,
        block_size=4,
        max_model_len=256,
        num_scheduler_steps=4,
        num_speculative_tokens=4,
        num_lookahead_tokens=4,
        max_num_batched_tokens=80,
        max_num_seqs=16,
        multi_step_speculation=True,
    )
    s.spec_policy.step_cost = lambda num_decodes, k: 1e-3
    s.spec_policy.choose = lambda num_decodes, *counts: 4  # type: ignore[method-assign]
    runner = FakeRunner(s)
    for i in range(4):
        s.add_request(_greedy(f"r{i}", 20, max_tokens=40))
    blocked = []  # drafts proposed by each plan that left every waiting request waiting (no memory for them)
    for j in range(40):
        if j == 3:
            s.add_request(_greedy("w", 60, max_tokens=40))  # no room for it until a request ends
        waiting_before = len(s.waiting)
        so = s.schedule()
        if waiting_before and not so.scheduled_new_reqs and len(s.waiting) >= waiting_before:
            blocked.append(so.num_proposals)
        s.update_from_output(so, runner.execute(so))
        if not s.has_unfinished_requests():
            break
    assert len(blocked) > 10, blocked
    assert blocked.count(4) >= 0.9 * len(blocked), blocked
