"""Each request's own acceptance counts for the speculation policy: the scheduler decays them per verification,
hands the planned batch's counts to `choose`, and tells the policy what each emitted run's request was expected
to emit (from its counts before the step)."""

from __future__ import annotations

import pytest

from asyncspec.core.scheduler import Scheduler
from asyncspec.core.spec_policy import expected_tokens

from .scheduler_fakes import RunDevice, make_request, make_scheduler

K = 4
ACCEPTS = {"a": 4, "b": 1, "c": 0}
"""Drafts each request's verifications accept (at most the drafts verified)."""


def scripted_device() -> RunDevice:
    """Verifications that accept ACCEPTS[request] drafts (at most those verified)."""
    device = RunDevice(lambda rid, drafts: ACCEPTS[rid], first_token=7)
    device.runs.update({rid: [] for rid in ACCEPTS})  # every request's record, before its first verification
    return device


def _scheduler(num_steps: int) -> Scheduler:
    return make_scheduler(
        num_blocks=256,
        block_size=4,
        max_model_len=512,
        num_scheduler_steps=num_steps,
        num_speculative_tokens=K,
        num_lookahead_tokens=K,
        multi_step_speculation=True,
    )


def _decayed(runs: list[tuple[int, int]], decay: float) -> tuple[float, float]:
    accepted = rejected = 0.0
    for drafts, kept in runs:
        accepted = decay * accepted + kept
        rejected = decay * rejected + (kept < drafts)
    return accepted, rejected


@pytest.mark.parametrize("num_steps", [1, 4])
def test_each_request_keeps_its_own_decayed_acceptance(num_steps):
    s = _scheduler(num_steps)
    policy = s.spec_policy
    device = scripted_device()
    seen_by_choose: list[dict[str, tuple[float, float]]] = []
    expected_predictions: list[float] = []
    predictions: list[float] = []

    def choose(num_decodes, accepted, rejected):
        assert num_decodes == len(accepted) == len(rejected) == len(s.running)
        seen_by_choose.append({r.request_id: (a, j) for r, a, j in zip(s.running, accepted, rejected, strict=True)})
        return K

    observe = policy.observe_emitted_runs

    def observe_emitted_runs(k, num_tokens, predicted=None):
        assert predicted is not None and len(predicted) == len(num_tokens)
        predictions.extend(predicted)
        observe(k, num_tokens, predicted)

    policy.step_cost = lambda num_decodes, k: 1e-3  # measured costs: the scheduler hands choose the counts
    policy.choose = choose  # type: ignore[method-assign]
    policy.observe_emitted_runs = observe_emitted_runs  # type: ignore[method-assign]
    requests = {rid: make_request(rid, 6, max_tokens=200, temperature=0.0) for rid in ACCEPTS}
    for request in requests.values():
        s.add_request(request)
    for _ in range(12):
        # Before the step: what each verifying request is expected to emit, from the device's record of its runs.
        counts = {rid: _decayed(runs, policy.request_decay) for rid, runs in device.runs.items()}
        num_choices = len(seen_by_choose)
        so = s.schedule()
        for seen in seen_by_choose[num_choices:]:  # the batch planned, with its counts as they were
            assert list(seen) == [r.request_id for r in s.running]
            for rid, pair in seen.items():
                assert pair == pytest.approx(counts[rid])
        for rid in so.num_scheduled_tokens:
            if so.num_draft_positions.get(rid, 0) == K:
                alpha = policy.request_acceptance(*counts[rid])
                expected_predictions += [expected_tokens(alpha, K)] * so.num_steps
        s.update_from_output(so, device.execute(so))
        for request in requests.values():
            assert (request.spec_accepted, request.spec_rejected) == pytest.approx(
                _decayed(device.runs[request.request_id], policy.request_decay)
            )
    assert all(len(device.runs[rid]) >= 8 for rid in ACCEPTS) and len(seen_by_choose) >= 3
    assert sorted(predictions) == pytest.approx(sorted(expected_predictions))
    # The request that accepts every draft is priced above the one that accepts none.
    a, c = requests["a"], requests["c"]
    rate_a = policy.request_acceptance(a.spec_accepted, a.spec_rejected)
    rate_c = policy.request_acceptance(c.spec_accepted, c.spec_rejected)
    assert rate_c < policy.population_rate - 0.2 and rate_a > policy.population_rate + 0.2


@pytest.mark.parametrize("max_tokens", [7, 12, 23])
def test_a_request_that_ends_inside_a_multi_step_plan_pairs_each_counted_run_with_a_prediction(max_tokens):
    """A 4-step plan runs past a request's max_tokens (its tokens after the end are dropped): only the runs of
    steps that began before its end are counted, and each has its prediction. The outputs stay exact."""
    s = _scheduler(4)
    policy = s.spec_policy
    policy.step_cost = lambda num_decodes, k: 1e-3
    policy.choose = lambda num_decodes, *counts: K  # type: ignore[method-assign]
    device = scripted_device()
    pairs: list[tuple[int, int]] = []
    observe = policy.observe_emitted_runs

    def observe_emitted_runs(k, num_tokens, predicted=None):
        pairs.append((len(num_tokens), len(predicted) if predicted is not None else -1))
        observe(k, num_tokens, predicted)

    policy.observe_emitted_runs = observe_emitted_runs  # type: ignore[method-assign]
    requests = {rid: make_request(rid, 6, max_tokens=max_tokens, temperature=0.0) for rid in ACCEPTS}
    for request in requests.values():
        s.add_request(request)
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        s.update_from_output(so, device.execute(so))
    assert not s.has_unfinished_requests()
    assert all(len(r.output_token_ids) == max_tokens for r in requests.values())
    assert pairs and all(n == m for n, m in pairs), pairs
    # Fewer runs counted than the device made: the steps after an end are not counted.
    assert sum(n for n, _ in pairs) < sum(len(runs) for runs in device.runs.values())
