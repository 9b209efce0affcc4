"""Admission waves under load (SchedulerConfig.admission_delay_runs): while fewer than max_num_seqs / 8 requests could
be admitted (waiting, with a free slot) and at least that many run, waiting requests wait for at most that many
multi-step runs in a row, then are admitted; a wave's worth of them, a light load, single-step plans, or the delay at
0 admit as soon as a slot frees. The tokens are the same."""

from __future__ import annotations

import pytest

from asyncspec.config import EngineConfig
from asyncspec.core.spec_policy import SpeculationPolicy
from asyncspec.errors import ConfigError
from asyncspec.sampling_params import SamplingParams

from .scheduler_fakes import FakeRunner, make_request, make_scheduler, run_to_completion, step

MAX_NUM_SEQS = 16  # a wave: 2 slots


def _scheduler(
    delay: int,
    k: int = 0,
    steps: int = 4,
    chunked: bool = True,
    num_blocks: int = 1024,
    budget: int = 128,
    max_num_seqs: int = MAX_NUM_SEQS,
    **extra: object,
):
    return make_scheduler(
        enable_chunked_prefill=chunked,
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=512,
        num_scheduler_steps=steps,
        admission_delay_runs=delay,
        num_speculative_tokens=k,
        num_lookahead_tokens=k,
        multi_step_speculation=bool(k),
        **extra,
    )


def _load(s, short: tuple[int, ...] = (), ends: dict[int, int] | None = None, waiting: int = 3) -> None:
    """A full batch of greedy requests, those in `short` ending early (after 6 tokens), those in `ends` after the
    tokens it gives, the others after 60 (80 with `ends`), and `waiting` waiting ones."""
    lengths = dict.fromkeys(short, 6) | (ends or {})
    for i in range(MAX_NUM_SEQS):
        s.add_request(make_request(f"r{i}", 4, temperature=0.0, max_tokens=lengths.get(i, 80 if ends else 60)))
    for i in range(waiting):
        s.add_request(make_request(f"w{i}", 4, temperature=0.0, max_tokens=10))


def _plans(s, runner) -> list[dict]:
    """Per plan: its steps, the ids it admitted, and whether it could have admitted (a slot free, a request
    waiting) when it was planned."""
    plans = []
    while s.has_unfinished_requests():
        could_admit = bool(s.waiting) and len(s.running) < MAX_NUM_SEQS
        so, _ = step(s, runner)
        admitted = [r.request_id for r in so.scheduled_new_reqs]
        plans.append({"steps": so.num_steps, "admitted": admitted, "could_admit": could_admit})
        assert len(plans) < 500
    return plans


def _first_slot_free(plans: list[dict]) -> int:
    return next(i for i, p in enumerate(plans) if i > 0 and p["could_admit"])


@pytest.mark.parametrize("k", [0, 2])
def test_one_free_slot_waits_for_at_most_the_delays_runs_then_admits(k):
    s = _scheduler(delay=2, k=k)
    _load(s, short=(0,))
    plans = _plans(s, FakeRunner(s))
    first = _first_slot_free(plans)
    # One slot of 16 free (a wave is 2): two 4-step runs admit nothing, the third plan admits w0 in one step.
    assert [p["steps"] for p in plans[first : first + 3]] == [4, 4, 1]
    assert [p["admitted"] for p in plans[first : first + 3]] == [[], [], ["w0"]]
    assert s.stats.num_admission_deferrals == sum(p["could_admit"] and not p["admitted"] for p in plans) >= 2
    # Never more than 2 runs in a row that could have admitted and did not; each was a multi-step run.
    in_a_row = 0
    for p in plans:
        deferred = p["could_admit"] and not p["admitted"]
        in_a_row = in_a_row + 1 if deferred else 0
        assert in_a_row <= 2
        assert not deferred or p["steps"] > 1
    assert {a for p in plans for a in p["admitted"]} >= {"w0", "w1", "w2"}


def test_without_the_delay_a_free_slot_is_filled_at_once():
    s = _scheduler(delay=0)
    _load(s, short=(0,))
    plans = _plans(s, FakeRunner(s))
    first = _first_slot_free(plans)
    assert plans[first]["admitted"] == ["w0"] and plans[first]["steps"] == 1
    assert all(p["admitted"] for p in plans if p["could_admit"])
    assert s.stats.num_admission_deferrals == 0


def test_a_wave_of_free_slots_is_filled_at_once():
    s = _scheduler(delay=2)
    _load(s, short=(0, 1))  # two slots free together: a wave
    plans = _plans(s, FakeRunner(s))
    first = _first_slot_free(plans)
    assert plans[first]["admitted"] == ["w0", "w1"]


def test_single_step_plans_gain_nothing_and_admit_at_once():
    s = _scheduler(delay=2, steps=1)
    _load(s, short=(0,))
    plans = _plans(s, FakeRunner(s))
    assert all(p["admitted"] for p in plans if p["could_admit"])


@pytest.mark.parametrize("k", [0, 2])
def test_deferred_admissions_emit_the_same_tokens(k):
    results = []
    for delay in (0, 2):
        s = _scheduler(delay=delay, k=k)
        _load(s, short=(0, 5, 9))
        results.append(run_to_completion(s, FakeRunner(s)))
        assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    assert results[0] == results[1]
    assert len(results[1]) == MAX_NUM_SEQS + 3
    assert all(reason == "length" for _, reason in results[1].values())


def _arrivals_below_capacity(running: int, arriving: int, k: int = 0) -> list[dict]:
    """An engine of 64 slots (a wave: 8) running `running` long greedy requests in 4-step runs, to which `arriving`
    requests come together once the runs have begun (a server below its capacity: its slots never run short).
    Returns the plans from that arrival on (`_plans`)."""
    s = _scheduler(delay=2, k=k, num_blocks=2048, budget=256, max_num_seqs=64)
    for i in range(running):
        s.add_request(make_request(f"r{i}", 4, temperature=0.0, max_tokens=80))
    runner = FakeRunner(s)
    while step(s, runner)[0].num_steps == 1:
        assert s._step_id < 50
    for i in range(arriving):
        s.add_request(make_request(f"w{i}", 4, temperature=0.0, max_tokens=10))
    plans = []
    while s.has_unfinished_requests():
        could_admit = bool(s.waiting)
        so, _ = step(s, runner)
        plans.append({"steps": so.num_steps, "admitted": [r.request_id for r in so.scheduled_new_reqs]})
        plans[-1]["could_admit"] = could_admit
        assert len(plans) < 500
    return plans


@pytest.mark.parametrize("k", [0, 2])
def test_a_lone_arrival_behind_a_loaded_batch_waits_though_slots_are_free(k):
    """16 of 64 slots running (at least a wave) and one request arriving: it waits two 4-step runs, then the third
    plan admits it, although 48 slots are free (32 streams on an engine of 128 freed one slot at a time and never
    deferred, so every admission cut a run to one step)."""
    plans = _arrivals_below_capacity(running=16, arriving=1, k=k)
    assert [p["steps"] for p in plans[:3]] == [4, 4, 1]
    assert [p["admitted"] for p in plans[:3]] == [[], [], ["w0"]]


def test_a_light_load_admits_an_arrival_at_once():
    """Fewer requests running than a wave (7 of 64 slots): the arrival is admitted by the next plan."""
    plans = _arrivals_below_capacity(running=7, arriving=1)
    assert plans[0]["admitted"] == ["w0"] and plans[0]["steps"] == 1


def test_a_wave_of_arrivals_with_slots_free_is_admitted_at_once():
    """A wave's worth of requests (8) arriving behind 16 running: the next plan admits them all."""
    plans = _arrivals_below_capacity(running=16, arriving=8)
    assert plans[0]["admitted"] == [f"w{i}" for i in range(8)]


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_negative_or_non_integer_delay_is_refused(value):
    with pytest.raises(ConfigError, match="admission_delay_runs"):
        EngineConfig(model="m", admission_delay_runs=value)


def _measured_costs(s) -> None:
    """A policy with step costs (as on CUDA) for which k = 2 stays the fastest, whatever it accepts."""
    s.spec_policy = SpeculationPolicy(2, step_cost=lambda num_decodes, k: 1e-4 if k == 2 else 1e-3)


def _admitting_plans(s, runner) -> list:
    plans = []
    while s.has_unfinished_requests():
        so, _ = step(s, runner)
        if so.scheduled_new_reqs and so.scheduled_cached_reqs.request_ids:  # admits beside running decodes
            plans.append(so)
        assert s._step_id < 500
    return plans


@pytest.mark.parametrize("delay", [0, 2])
def test_a_wave_verifies_none_of_the_drafts_held_for_it(delay):
    """With measured step costs, the plan that admits a wave drops the drafts its decodes hold (it is a mixed
    plan, where verification is host work); admitting one request at a time (delay 0) keeps them."""
    s = _scheduler(delay=delay, k=2)
    _measured_costs(s)
    _load(s, short=(0,))
    first, *_ = _admitting_plans(s, FakeRunner(s))
    assert first.num_speculative_tokens == 2
    assert [r.request_id for r in first.scheduled_new_reqs] == ["w0"]
    decodes = first.scheduled_cached_reqs.request_ids
    assert len(decodes) == MAX_NUM_SEQS - 1
    if delay:
        assert first.num_draft_positions == {}
        assert all(first.num_scheduled_tokens[r] == 1 for r in decodes)
    else:
        assert set(first.num_draft_positions) == set(decodes)
        assert all(first.num_scheduled_tokens[r] == 3 for r in decodes)


def test_a_wave_keeps_its_drafts_when_speculating_with_prompts():
    """speculate_with_prompts: the plan that admits the wave verifies the drafts its decodes hold, beside the
    prompt chunk, and the tokens stay those of the plain plans."""
    outputs = []
    for with_prompts in (False, True):
        s = _scheduler(delay=2, k=2, speculate_with_prompts=with_prompts)
        _measured_costs(s)
        _load(s, short=(0,))
        first, *_ = _admitting_plans(s, FakeRunner(s))
        decodes = first.scheduled_cached_reqs.request_ids
        assert len(decodes) == MAX_NUM_SEQS - 1
        assert (set(first.num_draft_positions) == set(decodes)) == with_prompts
        s = _scheduler(delay=2, k=2, speculate_with_prompts=with_prompts)
        _measured_costs(s)
        _load(s, short=(0, 5, 9))
        outputs.append(run_to_completion(s, FakeRunner(s)))
    assert outputs[0] == outputs[1]


def test_a_wave_keeps_its_drafts_without_step_costs_or_with_a_seeded_request():
    for seeded in (False, True):
        s = _scheduler(delay=2, k=2)
        if seeded:
            _measured_costs(s)
        _load(s, short=(0,))
        if seeded:
            s.requests["r3"].sampling_params = SamplingParams(temperature=0.8, max_tokens=60, seed=5)
        first, *_ = _admitting_plans(s, FakeRunner(s))
        assert len(first.num_draft_positions) == MAX_NUM_SEQS - 1, seeded


def test_a_greedy_request_with_a_seed_does_not_stop_a_wave():
    """A greedy request's seed draws nothing: the plan defers admissions as without it."""
    plans = []
    for seed in (None, 5):
        s = _scheduler(delay=2, k=2)
        _measured_costs(s)
        _load(s, short=(0,))
        s.requests["r3"].sampling_params = SamplingParams(temperature=0.0, max_tokens=60, seed=seed)
        first, *_ = _admitting_plans(s, FakeRunner(s))
        plans.append(len(first.num_draft_positions))
    assert plans[0] == plans[1] != MAX_NUM_SEQS - 1


def test_dropped_drafts_emit_the_same_tokens():
    results = []
    for delay in (0, 2):
        s = _scheduler(delay=delay, k=2)
        _measured_costs(s)
        _load(s, short=(0, 5, 9))
        results.append(run_to_completion(s, FakeRunner(s)))
    assert results[0] == results[1]


def test_a_wave_whose_prompts_take_several_plans_fills_the_batch_without_deferring():
    """Prompts of 30 tokens fill the batch over several plans (the token budget): when one slot is left, the next
    plan fills it, not deferred although a wave is 2 slots: the admissions under way go on until the batch is full."""
    s = _scheduler(delay=2, chunked=False)
    for i in range(MAX_NUM_SEQS + 2):
        s.add_request(make_request(f"r{i}", 30, temperature=0.0, max_tokens=60))
    runner = FakeRunner(s)
    free_before = []
    while len(s.running) < MAX_NUM_SEQS:
        free_before.append(MAX_NUM_SEQS - len(s.running))
        so, _ = step(s, runner)
        assert so.scheduled_new_reqs, free_before
    assert 1 in free_before


def _deferred_runs(plans: list[dict]) -> int:
    return sum(p["could_admit"] and not p["admitted"] for p in plans)


def test_each_new_free_slot_may_defer_again():
    """Two requests end at different runs: each slot, once free, waits up to two runs (the count starts again)."""
    s = _scheduler(delay=2)
    _load(s, ends={0: 6, 1: 40}, waiting=2)
    plans = _plans(s, FakeRunner(s))
    assert _deferred_runs(plans) >= 4


def test_a_batch_filled_by_an_admission_defers_the_next_free_slot():
    """The wave's plan admits w0 and fills the batch, and r1 ends in that very plan: the slot r1 frees is a new one,
    deferred (the wave that filled the batch is over), not filled at once."""
    s = _scheduler(delay=2)
    _load(s, ends={0: 6, 1: 18}, waiting=2)
    plans = _plans(s, FakeRunner(s))
    at = next(i for i, p in enumerate(plans) if p["admitted"] == ["w0"])
    after = plans[at + 1]
    assert after["could_admit"] and not after["admitted"] and after["steps"] == 4


def _dropping_plans(s, runner) -> list:
    """Runs to the end; returns the plans that dropped the drafts their decodes held (the scheduler's decision,
    recorded as it plans), each checked to verify no draft."""
    decide = s._admits_wave
    decisions: list[bool] = []

    def recording(defers_admission: bool) -> bool:
        decisions.append(decide(defers_admission))
        return decisions[-1]

    s._admits_wave = recording
    dropped = []
    while s.has_unfinished_requests():
        decisions.clear()
        so, _ = step(s, runner)
        decodes = so.scheduled_cached_reqs.request_ids
        if so.num_steps == 1 and so.num_speculative_tokens and decodes and any(decisions):
            assert so.num_draft_positions == {} and so.scheduled_new_reqs
            dropped.append(so)
        assert s._step_id < 500
    return dropped


def _stop_string_batch(s, waiting: int, prompt: int = 4, max_tokens: int = 30) -> None:
    """A full batch that one request's stop string holds to one step a plan (k > 0), two requests ending early."""
    for i in range(MAX_NUM_SEQS):
        stop = ["never-sampled"] if i == 2 else None
        s.add_request(make_request(f"r{i}", 4, temperature=0.0, max_tokens=6 if i < 2 else max_tokens, stop=stop))
    for i in range(waiting):
        s.add_request(make_request(f"w{i}", prompt, temperature=0.0, max_tokens=10))


@pytest.mark.parametrize(
    ("case", "drops"),
    [("wave", True), ("nothing waiting", False), ("one step a plan", False), ("small batch", False)],
)
def test_which_admitting_plans_drop_their_drafts(case, drops):
    """A wave's worth of free slots (2 of 16) with requests waiting: its plan drops the drafts. Kept: with nothing
    to admit, with the engine's steps a plan at one (the device sets the pace), and in a batch of 8 (no waves)."""
    s = _scheduler(delay=2, k=2)
    if case == "small batch":
        s.config.max_num_seqs = 8
    if case == "one step a plan":
        s.set_steps_per_plan(1)
    _measured_costs(s)
    _stop_string_batch(s, waiting=0 if case == "nothing waiting" else 3)
    zero_k = []
    plan = s.schedule

    def planning():
        so = plan()
        zero_k.append(so.num_speculative_tokens == 0)
        return so

    s.schedule = planning
    dropped = _dropping_plans(s, FakeRunner(s))
    assert bool(dropped) == drops
    # A plan that dropped its drafts counts as a step that verified none.
    assert s.stats.steps_per_speculative_k.get(0, 0) == sum(zero_k) + len(dropped)


def test_no_drafts_are_dropped_for_a_wave_the_kv_pool_cannot_hold():
    """The first waiting prompt's chunk needs more blocks than the pool has free: the plans keep their drafts (with
    a large pool the same load drops them)."""
    for num_blocks, drops in ((1024, True), (100, False)):
        s = _scheduler(delay=2, k=2, num_blocks=num_blocks, budget=160)
        _measured_costs(s)
        _stop_string_batch(s, waiting=2, prompt=200, max_tokens=12)
        assert bool(_dropping_plans(s, FakeRunner(s))) == drops, num_blocks


def test_a_deferral_that_falls_back_to_one_step_chooses_the_next_k_after_its_admissions():
    """A slot frees and the policy, seeing 15 decodes, picks k = 0 where the plan before verified 2: the plan cannot
    run several steps, so it admits after all. It admits a seeded sampling request, whose draws must not depend on
    the policy: the next plan verifies the full k (the k chosen before the admission, for 15 greedy decodes, is 0)."""
    s = _scheduler(delay=2, k=2)
    s.spec_policy = SpeculationPolicy(
        2, step_cost=lambda num_decodes, k: (1e-4 if k == 2 else 1e-3) if num_decodes >= MAX_NUM_SEQS else k * 1e-3
    )
    _load(s, short=(0,), waiting=0)
    s.add_request(make_request("w0", 4, temperature=1.0, seed=11, max_tokens=10))
    runner = FakeRunner(s)
    while all(r.request_id != "w0" for r in s.running):
        admitting = step(s, runner)[0]
        assert s._step_id < 200
    assert [r.request_id for r in admitting.scheduled_new_reqs] == ["w0"] and admitting.num_steps == 1
    assert admitting.num_speculative_tokens == 2
    assert admitting.num_proposals == 2
    following, _ = step(s, runner)
    assert following.num_speculative_tokens == 2


def test_a_deferral_that_falls_back_asks_the_policy_once():
    """The policy counts its choices (and runs its probes by them): the fallback's plan asks it once, then applies
    the rules that depend on the admissions to that choice."""
    s = _scheduler(delay=2, k=2)
    s.spec_policy = SpeculationPolicy(
        2, step_cost=lambda num_decodes, k: (1e-4 if k == 2 else 1e-3) if num_decodes >= MAX_NUM_SEQS else k * 1e-3
    )
    _load(s, short=(0,), waiting=1)
    runner = FakeRunner(s)
    choose = s.spec_policy.choose
    choices_per_plan = []

    def counting(*args, **kw):
        choices_per_plan[-1] += 1
        return choose(*args, **kw)

    s.spec_policy.choose = counting
    while s.has_unfinished_requests():
        choices_per_plan.append(0)
        step(s, runner)
        assert s._step_id < 300
    assert max(choices_per_plan) == 1


def test_a_request_set_aside_for_a_shared_prefix_after_its_deferred_runs_is_not_deferred_again():
    """Asynchronous loop, 16 of 64 slots running: a and b (one 32-token prefix) arrive together and wait two runs;
    the plan admits a and sets b aside for a's blocks, and the plan after (a's step in flight) sets it aside again.
    Once a's blocks are registered b is admitted, not held for two more runs."""
    shared = list(range(200, 232))
    s = _scheduler(delay=2, num_blocks=2048, budget=256, max_num_seqs=64, prefix_sharing_wait_tokens=16)
    for i in range(16):
        s.add_request(make_request(f"r{i}", 4, temperature=0.0, max_tokens=200))
    runner = FakeRunner(s, check=False)
    in_flight = s.schedule()
    while in_flight.num_steps == 1:
        nxt = s.schedule()
        s.update_from_output(in_flight, runner.execute(in_flight))
        in_flight = nxt
        assert s._step_id < 50
    s.add_request(make_request("a", shared + [1], temperature=0.0, max_tokens=50))
    s.add_request(make_request("b", shared + [2], temperature=0.0, max_tokens=50))
    deferred_while_b_waits = 0
    while not s.requests["b"].num_computed_tokens:
        nxt = s.schedule()
        deferred_while_b_waits += nxt.num_steps > 1 and not nxt.scheduled_new_reqs
        s.update_from_output(in_flight, runner.execute(in_flight))
        in_flight = nxt
        assert s._step_id < 100
    assert deferred_while_b_waits <= 2


def test_an_arrival_behind_exactly_a_wave_running_waits():
    """8 of 64 running (exactly a wave): a lone arrival is deferred as behind 16."""
    plans = _arrivals_below_capacity(running=8, arriving=1)
    assert [p["steps"] for p in plans[:3]] == [4, 4, 1]
    assert [p["admitted"] for p in plans[:3]] == [[], [], ["w0"]]


def test_a_lone_arrival_at_a_light_load_keeps_the_drafts():
    """7 of 64 running at k = 2 with measured step costs: the arrival is admitted at once, and the plan that admits it
    verifies the drafts its decodes hold (no wave, nothing deferred: there is nothing to drop them for)."""
    s = _scheduler(delay=2, k=2, num_blocks=2048, budget=256, max_num_seqs=64)
    _measured_costs(s)
    for i in range(7):
        s.add_request(make_request(f"r{i}", 4, temperature=0.0, max_tokens=80))
    runner = FakeRunner(s)
    while step(s, runner)[0].num_steps == 1:
        assert s._step_id < 50
    s.add_request(make_request("w0", 4, temperature=0.0, max_tokens=10))
    so, _ = step(s, runner)
    assert [r.request_id for r in so.scheduled_new_reqs] == ["w0"]
    assert so.num_speculative_tokens == 2
    assert len(so.num_draft_positions) == 7


def test_deferring_while_kv_memory_is_short_preempts_no_more():
    """20 of 64 slots, a KV pool that preempts, k = 2: deferring admissions while preempted requests wait (slots
    free) must not preempt more than admitting at once (each multi-step run reserves its drafts' slots)."""
    preemptions = {}
    for delay in (0, 2):
        s = _scheduler(delay=delay, k=2, num_blocks=120, budget=256, max_num_seqs=64)
        for i in range(20):
            s.add_request(make_request(f"r{i}", 8, temperature=0.0, max_tokens=40 + 7 * i))
        runner = FakeRunner(s)
        preemptions[delay] = 0
        while s.has_unfinished_requests():
            so, _ = step(s, runner)
            preemptions[delay] += len(so.preempted_req_ids)
            assert s._step_id < 2000
    assert preemptions[2] <= preemptions[0], preemptions
