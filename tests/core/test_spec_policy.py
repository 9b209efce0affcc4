"""Adaptive speculation: the policy's choice against a brute-force optimum, its acceptance estimate,
and the engine with k changing from step to step (greedy output must not change)."""

from __future__ import annotations

import itertools
import random

import pytest

from asyncspec import SamplingParams
from asyncspec.core.spec_policy import SpeculationPolicy, speculation_choices
from tests.conftest import load_prompts
from tests.spec.spec_helpers import METHODS, assert_same_outputs, make_llm, script_k


@pytest.mark.parametrize(("max_k", "expected"), [(0, [0]), (1, [0, 1]), (4, [0, 1, 2, 4]), (7, [0, 1, 3, 7])])
def test_choices(max_k, expected):
    assert speculation_choices(max_k) == expected


def test_a_steps_observations_are_decayed_averages_of_its_runs():
    """The scheduler hands the policy a step's runs in one call. The estimates are the exponentially
    decayed sums of every run in order, whatever the steps' sizes: computed here by hand over all runs."""
    rng = random.Random(3)
    policy = SpeculationPolicy(4)
    prior_accepted, prior_rejected = policy._accepted, policy._rejected  # the prior decays like a run
    all_runs: list[tuple[int, int]] = []
    emitted_by_k: dict[int, list[int]] = {1: [], 2: [], 4: []}
    for _ in range(20):
        k = rng.choice([1, 2, 4])
        runs = [(n, rng.randint(0, n)) for n in (rng.randint(0, k) for _ in range(rng.randint(0, 9)))]
        emitted = [accepted + 1 for _, accepted in runs]
        policy.observe_runs(runs)
        policy.observe_emitted_runs(k, emitted)
        all_runs += runs
        emitted_by_k[k] += emitted
        counted = [(n, a) for n, a in all_runs if n > 0]  # a run without drafts says nothing of acceptance
        d = policy.decay
        accepted = prior_accepted * d ** len(counted)
        accepted += sum(a * d ** (len(counted) - 1 - i) for i, (_, a) in enumerate(counted))
        rejected = prior_rejected * d ** len(counted)
        rejected += sum((a < n) * d ** (len(counted) - 1 - i) for i, (n, a) in enumerate(counted))
        assert policy._accepted == pytest.approx(accepted, rel=1e-9, abs=1e-12)
        assert policy._rejected == pytest.approx(rejected, rel=1e-9, abs=1e-12)
        for j, tokens in emitted_by_k.items():
            e = policy.emitted_decay
            total = sum(t * e ** (len(tokens) - 1 - i) for i, t in enumerate(tokens))
            count = sum(e ** (len(tokens) - 1 - i) for i in range(len(tokens)))
            assert policy._emitted.get(j, 0.0) == pytest.approx(total, rel=1e-9, abs=1e-12)
            assert policy._runs.get(j, 0.0) == pytest.approx(count, rel=1e-9, abs=1e-12)


def memory_bound(num_decodes: int, k: int) -> float:
    """A small batch on a big GPU: the step costs the same however wide it is."""
    return 1e-3


def compute_bound(num_decodes: int, k: int) -> float:
    """Past the knee every token costs: 1 ms of weights plus 20 us per token."""
    return 1e-3 + 20e-6 * num_decodes * (k + 1)


def test_without_costs_or_adaptivity_k_is_fixed():
    assert SpeculationPolicy(4).choose(64) == 4
    fixed = SpeculationPolicy(4, adaptive=False, step_cost=compute_bound)
    for _ in range(50):
        fixed.observe_run(4, 0)
    assert fixed.choose(128) == 4


def _feed(policy: SpeculationPolicy, alpha: float, runs: int, k: int = 4, seed: int = 0) -> None:
    """Runs whose drafts are each accepted with probability alpha until the first rejection."""
    rng = random.Random(seed)
    for _ in range(runs):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe_run(k, accepted)
        policy.observe_emitted(k, accepted + 1)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.85])
def test_acceptance_estimate_converges(alpha):
    policy = SpeculationPolicy(4, decay=0.999)
    _feed(policy, alpha, 4000)
    assert abs(policy.acceptance_rate - alpha) < 0.04


def brute_force_best(cost, num_decodes: int, tokens_per_run, host: float, choices: list[int]) -> int:
    def rate(k: int) -> float:
        return num_decodes * tokens_per_run(k) / (cost(num_decodes, k) + host)

    best = max(rate(k) for k in choices)
    return min(k for k in choices if rate(k) >= best / 1.0001)


@pytest.mark.parametrize(
    ("cost", "num_decodes", "alpha"),
    list(itertools.product([memory_bound, compute_bound], [1, 8, 64, 256], [0.05, 0.4, 0.8])),
)
def test_choice_maximises_expected_throughput(cost, num_decodes, alpha):
    policy = SpeculationPolicy(4, step_cost=cost, decay=0.9995)
    _feed(policy, alpha, 6000, seed=num_decodes)
    for k in policy.choices:
        policy.observe_step(num_decodes, k, cost(num_decodes, k) + 5e-4)  # host time 0.5 ms
    chosen = policy.choose(num_decodes)
    # Runs at k = 4 were seen: their mean tokens; k = 1, 2: the geometric model, capped by k = 4's.
    alpha = policy.acceptance_rate
    seen = policy.tokens_per_run(4)
    assert policy.tokens_per_run(2) == pytest.approx(min(1 + alpha + alpha**2, seen))

    def tokens(k):
        return min(sum(alpha**i for i in range(k + 1)), seen) if k < 4 else seen

    assert chosen == brute_force_best(cost, num_decodes, tokens, 5e-4, policy.choices)


def test_tokens_per_run_are_what_runs_emitted():
    """Half the requests accept every draft, half none: runs at k = 4 emit 3 tokens on average, where
    one pooled acceptance rate (0.8) would predict 3.36."""
    policy = SpeculationPolicy(4, step_cost=memory_bound)
    assert policy.tokens_per_run(4) == pytest.approx(sum(0.6**i for i in range(5)))  # the prior alone
    for _ in range(500):
        policy.observe_run(4, 4)
        policy.observe_emitted(4, 5)
        policy.observe_run(4, 0)
        policy.observe_emitted(4, 1)
    assert policy.acceptance_rate == pytest.approx(0.8, abs=0.01)
    assert policy.tokens_per_run(4) == pytest.approx(3.0, abs=0.02)
    assert policy.tokens_per_run(2) == pytest.approx(1 + 0.8 + 0.64, abs=0.03)  # no runs at 2: the model
    assert policy.tokens_per_run(0) == 1.0


@pytest.mark.parametrize("num_requests", [3, 40])  # the per-request loop and the vectorised pass
def test_a_batch_is_priced_on_its_own_requests_acceptance(num_requests):
    """`batch_tokens` is the mean over the batch of 1 + a + ... + a^k, a each request's own rate shrunk to the
    population's by request_prior verifications' worth: checked against that formula written out."""
    rng = random.Random(num_requests)
    policy = SpeculationPolicy(4)
    _feed(policy, 0.7, 200)
    accepted = [rng.uniform(0, 30) for _ in range(num_requests)]
    rejected = [rng.uniform(0, 10) for _ in range(num_requests)]
    pooled, w = policy.population_rate, policy.request_prior
    batch = policy.batch_tokens(accepted, rejected)
    for k in policy.choices:
        own = [(a + w * pooled) / (a + r + w) for a, r in zip(accepted, rejected, strict=True)]
        assert batch[k] == pytest.approx(sum(sum(x**i for i in range(k + 1)) for x in own) / num_requests)
    # A request never seen is priced at the population's rate.
    assert policy.batch_tokens([0.0], [0.0])[4] == pytest.approx(sum(pooled**i for i in range(5)))
    assert policy.batch_tokens([], []) == {}


def test_a_new_request_is_priced_at_the_population_rate_not_the_last_requests():
    """A closed batch of 128 streams ends with its worst requests: the short-memory pooled rate follows them, but a
    request of the next batch, not yet verified, is priced at the population rate, whose memory is counted in
    steps (a step's runs together), not runs: 128 runs a step would forget the batch within its tail."""
    rng = random.Random(0)
    policy = SpeculationPolicy(4)

    def step(alpha: float, num_requests: int) -> None:
        runs = []
        for _ in range(num_requests):
            accepted = 0
            while accepted < 4 and rng.random() < alpha:
                accepted += 1
            runs.append((4, accepted))
        policy.observe_runs(runs)

    for _ in range(30):
        step(0.9, 128)  # the full batch
    for _ in range(15):
        step(0.3, 16)  # its tail
    assert policy.acceptance_rate < 0.5
    assert policy.population_rate > 0.75
    assert policy.request_acceptance(0.0, 0.0) == pytest.approx(policy.population_rate)


def test_settings_the_policy_cannot_price_are_refused():
    from asyncspec.errors import ConfigError

    with pytest.raises(ConfigError, match="choices"):
        SpeculationPolicy(2, choices=[0, 1, 2, 4])
    with pytest.raises(ConfigError, match="request_prior"):
        SpeculationPolicy(4, request_prior=0.0)
    with pytest.raises(ConfigError, match="population_decay"):
        SpeculationPolicy(4, population_decay=1.5)
    with pytest.raises(ValueError, match="rejected counts"):
        SpeculationPolicy(4).batch_tokens([1.0] * 20, [0.0])


def _feed_requests(policy: SpeculationPolicy, alphas: list[float], steps: int, k: int = 4, seed: int = 0):
    """Steps of a batch at k whose request i accepts each draft with probability alphas[i]: the scheduler's
    bookkeeping (each request's decayed counts, the prediction from them before the step). Returns the counts."""
    rng = random.Random(seed)
    accepted, rejected = [0.0] * len(alphas), [0.0] * len(alphas)
    d = policy.request_decay
    for _ in range(steps):
        runs, emitted, predicted = [], [], []
        for i, alpha in enumerate(alphas):
            predicted.append(policy.batch_tokens([accepted[i]], [rejected[i]])[k])
            n = 0
            while n < k and rng.random() < alpha:
                n += 1
            runs.append((k, n))
            emitted.append(n + 1)
            accepted[i] = d * accepted[i] + n
            rejected[i] = d * rejected[i] + (n < k)
        policy.observe_runs(runs)
        policy.observe_emitted_runs(k, emitted, predicted)
    return accepted, rejected


def test_the_tail_of_a_batch_is_priced_on_the_requests_left():
    """Half the batch accepts nearly every draft, half few: the pooled history promises about 3.3 tokens a k = 4
    run. The requests that accept most finish first, so the tail is the others: about 1.6 tokens a run, where a
    small batch's k = 4 step costs three times a plain one. Priced on the pooled history the tail keeps k = 4;
    priced on the requests left it takes k = 0, and a batch of the best requests keeps k = 4."""

    def tail_cost(num_decodes: int, k: int) -> float:
        return 0.15e-3 if k == 0 else 0.45e-3

    policy = SpeculationPolicy(4, step_cost=tail_cost, probe_interval=0)
    alphas = [0.97] * 16 + [0.4] * 16
    accepted, rejected = _feed_requests(policy, alphas, 40)
    for k in policy.choices:
        policy.observe_step(8, k, tail_cost(8, k))
    assert policy.tokens_per_run(4) == pytest.approx(3.3, abs=0.25)
    assert policy.choose(8) == 4
    worst = policy.batch_tokens(accepted[16:24], rejected[16:24])
    assert policy.tokens_per_run(4, None, worst) == pytest.approx(1 + 0.4 + 0.16 + 0.064 + 0.0256, abs=0.25)
    assert policy.choose(8, accepted[16:24], rejected[16:24]) == 0
    assert policy.choose(8, accepted[:8], rejected[:8]) == 4


def test_runs_that_the_geometric_model_misjudges_are_calibrated():
    """Every run accepts exactly two of four drafts (not geometric): each request's own rate is 2/3, whose model
    promises 2.6 tokens a run at k = 4; the runs emitted 3. A batch of such requests is priced at what they emit,
    and at k = 2 (never run) at the model, capped by k = 4's."""
    policy = SpeculationPolicy(4, step_cost=memory_bound)
    d = policy.request_decay
    accepted, rejected = [0.0] * 4, [0.0] * 4
    for _ in range(200):
        predicted = [policy.batch_tokens([a], [r])[4] for a, r in zip(accepted, rejected, strict=True)]
        policy.observe_runs([(4, 2)] * 4)
        policy.observe_emitted_runs(4, [3] * 4, predicted)
        accepted = [d * a + 2 for a in accepted]
        rejected = [d * r + 1 for r in rejected]
    batch = policy.batch_tokens(accepted, rejected)
    assert batch[4] == pytest.approx(2.6, abs=0.05)
    assert policy.tokens_per_run(4, None, batch) == pytest.approx(3.0, abs=0.02)
    assert policy.tokens_per_run(2, None, batch) == pytest.approx(batch[2])
    assert policy.tokens_per_run(0, None, batch) == 1.0


def test_a_scaled_run_never_emits_more_than_all_its_drafts_and_one():
    """Runs at k = 1 that each emitted 2 tokens, while their requests' estimates (still near the prior) promised
    1.5: the scaling is 4/3. For a batch of well-accepting requests whose model gives 1.9 at k = 1, that would be
    2.53 tokens from a run that can emit at most 2; the price stops at 2."""
    policy = SpeculationPolicy(4, step_cost=memory_bound)
    for _ in range(50):
        policy.observe_emitted_runs(1, [2], [1.5])
    strong = policy.batch_tokens([90.0], [10.0])
    assert strong[1] * 4 / 3 > 2.0
    assert policy.tokens_per_run(1, None, strong) == 2.0
    weak = policy.batch_tokens([10.0], [90.0])
    assert policy.tokens_per_run(1, None, weak) == pytest.approx(weak[1] * 4 / 3)  # below the cap: scaled


def test_a_smaller_k_is_capped_by_the_larger_ks_batch_scaled_runs():
    """Runs at k = 4 emitted 2 tokens each where the model promised 4 (half its promise: say, drafts that were
    often not found); k = 2 never ran. For a batch of strong requests the model alone would promise about 2.9 at
    k = 2, but k = 4's runs, scaled to this batch, cap it (fewer drafts never emit more than more drafts)."""
    policy = SpeculationPolicy(4, step_cost=memory_bound)
    for _ in range(100):
        policy.observe_emitted_runs(4, [2], [4.0])
    strong = policy.batch_tokens([400.0] * 4, [10.0] * 4)
    scaled_4 = strong[4] * 0.5
    assert policy.tokens_per_run(4, None, strong) == pytest.approx(scaled_4)
    assert strong[2] > scaled_4 > 2.0
    assert policy.tokens_per_run(2, None, strong) == pytest.approx(scaled_4)


def test_a_fresh_policy_speculates_at_the_widest_k_first():
    """Before any k > 0 was seen the prior (0.6 a position) prices every k: at 128 decodes on an H200's step costs it
    picks k = 1, whose runs show the first position only. The widest k goes first; once seen, the estimates choose:
    here drafts that are rarely accepted and cost host time, so k = 0."""
    device_us = {0: 307.0, 1: 316.0, 2: 391.0, 4: 552.0}

    def h200_128(num_decodes: int, k: int) -> float:
        return device_us[k] * 1e-6

    policy = SpeculationPolicy(4, step_cost=h200_128, probe_interval=0)
    assert policy._best(128, h200_128) == 1
    assert policy.choose(128) == 4
    assert policy.choose(128) == 4  # nothing observed yet
    _feed(policy, 0.2, 200)
    for _ in range(8):
        policy.observe_step(128, 4, h200_128(128, 4) + 4e-4)
        policy.observe_step(128, 0, h200_128(128, 0), num_proposals=0)
    assert policy.choose(128) == 0


def test_a_fresh_policy_takes_its_widest_choice_until_a_step_at_k_above_0_is_seen():
    """Steps at k = 0 (their host time, their emitted tokens) do not end the widest-first start; the widest is the
    largest of the policy's choices, not max_k."""

    def costly_drafts(num_decodes: int, k: int) -> float:
        return 1e-4 * (1 + k)  # on the prior (0.6 a position) k = 2's 1.96 tokens cost 3x: k = 0 is priced best

    policy = SpeculationPolicy(4, step_cost=costly_drafts, choices=[0, 2], probe_interval=0)
    policy.observe_step(128, 0, 1e-4, num_proposals=0)
    policy.observe_emitted(0, 1)
    assert policy.choose(128) == 2
    policy.observe_step(128, 2, 1e-2)  # a slow step at k = 2: now the estimates choose
    assert policy.choose(128) == 0


def test_runs_without_drafts_turn_speculation_off():
    """An n-gram proposer that finds nothing in random text: no draft is ever verified, so the
    acceptance estimate keeps its prior, but every run at k emitted one token: k = 0 wins."""
    policy = SpeculationPolicy(4, step_cost=compute_bound, probe_interval=0)
    assert policy._best(32, compute_bound) > 0  # the prior: 0.6 acceptance
    for _ in range(50):
        policy.observe_emitted(4, 1)
    assert policy.acceptance_rate == pytest.approx(0.6)
    assert policy.tokens_per_run(4) == pytest.approx(1.0)
    assert policy._best(32, compute_bound) == 0


def test_host_time_is_learned_per_k():
    """Proposal passes cost host time: a k whose steps took longer on the host is charged for it."""
    policy = SpeculationPolicy(4, step_cost=memory_bound)
    _feed(policy, 0.5, 300)
    assert policy.choose(8) == 4  # same device time: the most tokens per step wins
    assert policy.host_seconds(2) == 0.0
    for _ in range(20):
        policy.observe_step(8, 0, 1e-3 + 2e-4)
        policy.observe_step(8, 4, 1e-3 + 4e-3)  # four proposal passes: 4 ms more on the host
    assert policy.host_seconds(4) == pytest.approx(4e-3)
    assert policy.host_seconds(2) == pytest.approx(4e-3)  # unseen: the nearest speculating k seen
    # k=4: 1.94 tokens / 5 ms; k=0: 1 token / 1.2 ms; k=2 (assumed 4 ms host): 1.75 / 5 ms.
    assert policy.choose(8) == 0
    for _ in range(20):
        policy.observe_step(8, 2, 1e-3 + 2e-4)  # its own steps (a probe): 0.2 ms on the host
    assert policy.host_seconds(2) == pytest.approx(2e-4)
    assert policy.host_seconds(1) == pytest.approx(2e-4)  # unseen: the nearest speculating k below it
    # k=2: 1.75 tokens / 1.2 ms, against k=0's 1 / 1.2 ms.
    assert policy.choose(8) == 2


def test_an_unseen_k_is_not_priced_at_a_plain_steps_host_time():
    """A plain step's host time (shared by a multi-step plan: about 0) says nothing of a speculating step's,
    which is there at every k > 0: before its own steps, k = 1 and 2 are priced at what k = 4's cost, so
    the policy does not switch to them on a host time of 0 (at 128 streams on an H200 it switched to k = 2,
    then k = 1, each time for one plan until their own steps showed 650 and 587 us)."""
    policy = SpeculationPolicy(4, step_cost=memory_bound, probe_interval=0)
    _feed(policy, 0.6, 300)
    for _ in range(20):
        policy.observe_step(8, 0, 1e-3, num_proposals=0)  # no host time beyond the device's
        policy.observe_step(8, 4, 1e-3 + 5e-4)
    assert policy.host_seconds(1) == policy.host_seconds(2) == pytest.approx(5e-4)
    assert policy.host_seconds(0) == 0.0
    # At the same host time the most tokens per step win (the same device time at every k): k = 4.
    assert policy.choose(8) == 4


def test_an_unseen_k_0_is_not_priced_as_free_on_the_host():
    """Before its own steady steps, k = 0 is charged the host time of the smallest speculating k seen, not 0.
    At batch 1 the host sets the pace: the bundled pair on an H100 (2026-12-07) switched from k = 1 to an unseen
    k = 0, device-priced below a speculating step and free on the host, and kept it for a whole generate. Here
    k = 1's runs emit 1.8 tokens in 0.15 ms of device and 0.15 ms of host time; k = 0 costs 0.12 ms of device."""

    def batch_1(num_decodes: int, k: int) -> float:
        return 1.2e-4 if k == 0 else 1.5e-4

    policy = SpeculationPolicy(4, step_cost=batch_1, choices=[0, 1], probe_interval=0)
    for step in range(20):
        policy.observe_emitted(1, 1 if step % 5 == 0 else 2)
        policy.observe_step(1, 1, 1.5e-4 + 1.5e-4)
    assert policy.tokens_per_run(1) == pytest.approx(1.8, abs=0.01)
    assert policy.host_seconds(0) == pytest.approx(1.5e-4)
    assert policy.choose(1) == 1  # 1.8 tokens / 0.3 ms against 1 / 0.27 ms (priced free on the host: 1 / 0.12 ms)
    # Its own steady steps price it: a plain step of 0.02 ms on the host makes it the fastest.
    for _ in range(4):
        policy.observe_step(1, 0, 1.2e-4 + 0.2e-4, num_proposals=0)
    assert policy.host_seconds(0) == pytest.approx(0.2e-4)
    assert policy.choose(1) == 0  # 1 / 0.14 ms against 1.8 / 0.3 ms


def test_speculation_backs_off_under_load_and_returns():
    policy = SpeculationPolicy(4, step_cost=compute_bound)
    _feed(policy, 0.6, 300)
    assert policy.choose(1) == 4  # nearly free to verify at batch 1
    assert policy.choose(256) == 0  # 5x the tokens for 2.3 expected: not worth it
    _feed(policy, 0.95, 400, seed=1)  # the drafts became very good
    rates = policy._rates(256, compute_bound)
    assert 1.0 < rates[2] / rates[0] < 1.0 + policy.switch_margin
    assert policy.choose(256) == 0  # a gain within the switch margin: not worth a switch
    rates = policy._rates(96, compute_bound)
    assert max(rates.values()) > (1.0 + policy.switch_margin) * rates[0]
    assert policy.choose(96) > 0


def test_the_running_k_is_left_only_for_a_clear_gain():
    """Estimates are noisy and a switch costs more than its steps: the k running stays until another beats
    it by switch_margin; a fresh policy takes the best at once."""
    policy = SpeculationPolicy(4, step_cost=memory_bound, choices=[0, 4], probe_interval=0)
    for _ in range(20):
        policy.observe_emitted(4, 2)  # runs at k = 4 emit 2 tokens
        policy.observe_step(8, 0, 1e-3)  # no host time at k = 0
    # k = 4: 2 tokens in 1 ms + host; k = 0: 1 token in 1 ms. Fresh: the best (1.08x); k = 0 1.02x better:
    # stays; 1.15x: switches.
    for host, expected in ((0.85e-3, 4), (1.05e-3, 4), (1.3e-3, 0)):
        policy._host_samples.pop((4, 4), None)
        policy.observe_step(8, 4, 1e-3 + host)
        assert policy.choose(8) == expected
    for host, expected in ((0.85e-3, 0), (0.75e-3, 4)):  # 1.08x: stays at 0; 1.14x: switches
        policy._host_samples.pop((4, 4), None)
        policy.observe_step(8, 4, 1e-3 + host)
        assert policy.choose(8) == expected


def test_one_slow_step_does_not_move_the_host_estimate():
    policy = SpeculationPolicy(4, step_cost=memory_bound)
    for seconds in (0.5, 1.2e-3, 1.3e-3):  # a step that compiled a kernel, then two ordinary ones
        policy.observe_step(8, 4, seconds)
    assert policy.host_seconds(4) == pytest.approx(2e-4)  # a typical step, not the slow one


def test_a_stale_estimate_is_probed_and_speculation_comes_back():
    """A k whose last steps looked slow is tried again (twice in a row: one steady step) after
    probe_interval steps: when it is fast now, the policy returns to it."""
    policy = SpeculationPolicy(4, step_cost=memory_bound, probe_interval=20)
    _feed(policy, 0.9, 300)
    for _ in range(3):  # k = 4 looked terrible (say: kernels compiling during its first steps)
        policy.observe_step(1, 4, 0.2)
    policy.observe_step(1, 0, 1.1e-3)
    chosen = [policy.choose(1)]
    for _ in range(120):
        chosen.append(policy.choose(1))
        # The step that verified chosen[-2] drafts proposed chosen[-1]; every k is fast now.
        policy.observe_step(1, chosen[-2], 1.3e-3 if chosen[-2] else 1.1e-3, chosen[-1])
    first_probe = chosen.index(4)
    assert 0 < first_probe <= 20 + 2 * len(policy.choices)
    after = chosen[first_probe:]
    assert after.count(4) > 0.6 * len(after)  # the probe replaced the slow samples: k = 4 wins again
    for j in policy.choices:  # every k is tried within the interval (later probes back off)
        idx = [i for i, k in enumerate(chosen) if k == j]
        assert idx and idx[0] <= 20 + 2 * len(policy.choices)
    probes = [k for k, nxt in zip(chosen, chosen[1:], strict=False) if k != 4 and k == nxt]
    assert set(probes) == {0, 1, 2}  # each probe is two steps in a row


def test_host_time_is_charged_to_the_steady_pair():
    """A step's host time depends on what it proposes too: the k = 0 step that proposes 4 drafts for
    the next step pays for them, and must not make a steady run at k = 0 look expensive."""
    policy = SpeculationPolicy(4, step_cost=memory_bound, choices=[0, 4])
    _feed(policy, 0.5, 300)
    for _ in range(5):
        policy.observe_step(8, 0, 1e-3 + 6e-3, num_proposals=4)  # a transition step: four draft passes
        policy.observe_step(8, 4, 1e-3 + 4e-3)
    # No steady k = 0 step seen yet: the speculating steps' host time, not the transition's.
    assert policy.host_seconds(0) == pytest.approx(4e-3)
    policy.observe_step(8, 0, 1e-3 + 1e-4, num_proposals=0)
    assert policy.host_seconds(0) == pytest.approx(1e-4)
    assert policy.host_seconds(4) == pytest.approx(4e-3)
    assert policy._best(8, memory_bound) == 0  # 1 token / 1.1 ms beats 1.94 / 5 ms


def _probe_starts(chosen: list[int], k: int) -> list[int]:
    return [i for i, j in enumerate(chosen) if j == k and (i == 0 or chosen[i - 1] != k)]


def test_probes_that_change_nothing_back_off():
    """Drafts that are never accepted: k = 0 stays best, and a probe of k = 1, 2, 4 that finds its k far
    behind makes that k wait the longest interval (16x) at once, so the probes' cost fades."""
    policy = SpeculationPolicy(4, step_cost=compute_bound, probe_interval=10)
    for _ in range(300):
        policy.observe_run(4, 0)
    chosen = [policy.choose(32) for _ in range(2000)]
    for k in (1, 2, 4):
        rates = policy._rates(32, compute_bound)
        assert rates[k] < policy.probe_threshold * rates[0]
        starts = _probe_starts(chosen, k)
        assert starts[0] <= 10 + 2 * len(policy.choices)  # the first probe at the base interval
        assert len(starts) >= 5 and all(b - a > 160 for a, b in itertools.pairwise(starts))
    probes_late = sum(k != 0 for k in chosen[-500:])
    assert probes_late <= 3 * 2 * (500 // 160 + 1)  # at most one probe per k per 160 steps late on


def test_a_probe_close_to_the_best_doubles_its_interval():
    """A probed k within probe_threshold of the best is probed again sooner: its interval doubles."""
    policy = SpeculationPolicy(4, step_cost=memory_bound, choices=[0, 4], probe_interval=10)
    for _ in range(20):
        policy.observe_emitted(4, 2)
        policy.observe_step(8, 0, 1e-3)
        policy.observe_step(8, 4, 1e-3 + 1.35e-3)  # k = 4: 2 tokens in 2.35 ms, 0.85 of k = 0's rate
    policy._current = 0
    chosen = [policy.choose(8) for _ in range(400)]
    rates = policy._rates(8, memory_bound)
    assert policy.probe_threshold < rates[4] / rates[0] < 1.0
    gaps = [b - a for a, b in itertools.pairwise(_probe_starts(chosen, 4))]
    assert gaps[:4] == [20 + 2, 40 + 2, 80 + 2, 160 + 2]  # the doubled interval and the probe's two choices


def test_probing_off_keeps_the_best():
    policy = SpeculationPolicy(4, step_cost=compute_bound, probe_interval=0)
    _feed(policy, 0.6, 300)
    assert {policy.choose(256) for _ in range(200)} == {0}


# --------------------------------------------------------------------------------------- engine, CPU

CONFIG = dict(block_size=16, max_model_len=192, num_kv_blocks=96, max_num_batched_tokens=128, max_num_seqs=8)


@pytest.mark.parametrize("method", METHODS)
def test_k_changing_every_step_keeps_greedy_output(method):
    """A cost model that makes the policy pick a different k each step (0 included): greedy output
    equals the non-speculative engine's, and every choice was really used."""
    prompts = [p[:60] for p in load_prompts(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 5 * i, ignore_eos=True) for i in range(6)]
    ref = make_llm(**CONFIG).generate(prompts, params)
    llm = make_llm(method=method, k=4, **CONFIG)
    policy = llm.engine.engine_core.scheduler.spec_policy
    schedule = itertools.cycle([4, 0, 2, 1, 4, 4, 0])
    state = {"k": 4}

    def cost(num_decodes: int, k: int) -> float:
        # Called once per choice per step: reshuffle when the policy asks about k = 0 (its first).
        if k == 0:
            state["k"] = next(schedule)
        return 1.0 if k != state["k"] else 1e-6

    policy.step_cost = cost
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, f"{method} with k changing per step")
    stats = llm.stats()
    for k in (0, 1, 2, 4):
        assert stats.get(f"spec_steps_with_k_{k}", 0) > 0, stats
    assert stats["spec_num_accepted_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("method", METHODS)
def test_seeded_streams_do_not_depend_on_the_adaptive_choice(method):
    """A seeded request's tokens depend on how much randomness each step draws, hence on k: while a
    seeded sampling request runs, every step verifies the full k, so its tokens equal a fixed-k run's
    whatever the policy would have chosen (the batch size and measured times steer it)."""
    prompts = [p[:60] for p in load_prompts(4)]
    params = [
        SamplingParams(temperature=0.9, top_k=40, seed=11 + i, max_tokens=8, ignore_eos=True) for i in range(2)
    ] + [SamplingParams(temperature=0.0, max_tokens=60 + 10 * i, ignore_eos=True) for i in range(2)]
    fixed = make_llm(method=method, k=4, adaptive_speculation=False, **CONFIG).generate(prompts, params)
    llm = make_llm(method=method, k=4, **CONFIG)
    policy = llm.engine.engine_core.scheduler.spec_policy
    policy.step_cost = lambda num_decodes, k: 1.0 if k else 1e-6  # the policy would always take k = 0
    got = llm.generate(prompts, params)
    assert_same_outputs(fixed, got, f"{method}, seeded with an adaptive policy")
    stats = llm.stats()
    # Once the seeded requests are done, the greedy ones run on at the policy's k = 0.
    assert stats.get("spec_steps_with_k_0", 0) > 0 and stats.get("spec_steps_with_k_4", 0) > 0, stats


@pytest.mark.parametrize("method", METHODS)
def test_seeded_request_admitted_late_keeps_the_full_k(method):
    """A seeded request that waits for a seat arrives while the policy runs at k = 0: the step that
    admits it already proposes the full k for it, so its tokens still equal a fixed-k run's."""
    prompts = [p[:40] for p in load_prompts(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 50, 50, 50)]
    params.append(SamplingParams(temperature=0.9, seed=11, max_tokens=16, ignore_eos=True))  # waits for a seat
    config = dict(CONFIG, max_num_seqs=4)
    fixed = make_llm(method=method, k=4, adaptive_speculation=False, **config).generate(prompts, params)
    llm = make_llm(method=method, k=4, **config)
    llm.engine.engine_core.scheduler.spec_policy.step_cost = lambda num_decodes, k: 1.0 if k else 1e-6
    got = llm.generate(prompts, params)
    assert_same_outputs(fixed, got, f"{method}, a seeded request admitted while k = 0")
    assert llm.stats().get("spec_steps_with_k_0", 0) > 0


@pytest.mark.parametrize("method", METHODS)
def test_each_step_verifies_what_the_previous_one_proposed(method):
    """k alternating between 0 and 4: the steps at 4 verify real drafts (the step before proposed 4),
    and accepted drafts show up in the counters."""
    prompts = [p[:60] for p in load_prompts(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = make_llm(**CONFIG).generate(prompts, params)
    llm = make_llm(method=method, k=4, **CONFIG)
    flip = itertools.cycle([0, 4])
    state = {"k": 4}

    def cost(num_decodes: int, k: int) -> float:
        if k == 0:
            state["k"] = next(flip)
        return 1.0 if k != state["k"] else 1e-6

    llm.engine.engine_core.scheduler.spec_policy.step_cost = cost
    runner = llm.engine.engine_core.runner
    plain_steps = []
    samples_plainly = runner._samples_plainly
    runner._samples_plainly = lambda drafts: plain_steps.append(samples_plainly(drafts)) or plain_steps[-1]
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, f"{method}, k alternating 0 / 4")
    assert sum(plain_steps) > 3, "the k = 0 steps should sample plainly"
    stats = llm.stats()
    assert stats.get("spec_steps_with_k_4", 0) > 3
    # Every step at k = 4 verifies the 4 drafts the step before proposed (n-gram may find fewer).
    assert stats["spec_num_draft_tokens"] >= (2 if method == "ngram" else 4) * stats["spec_steps_with_k_4"]


@pytest.mark.parametrize("method", METHODS)
def test_steps_that_verify_no_draft_sample_plainly(method):
    """A step whose sampling requests verify no draft (prompts completing, whatever the planned k) takes the
    plain sampling path, not verification; steps with drafts are verified; output stays the plain engine's."""
    prompts = [p[: 40 + 9 * i] for i, p in enumerate(load_prompts(6))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = make_llm(**CONFIG).generate(prompts, params)
    llm = make_llm(method=method, k=4, adaptive_speculation=False, **dict(CONFIG, max_num_seqs=3))
    runner = llm.engine.engine_core.runner
    decisions: list[tuple[bool, bool]] = []  # (any draft verified, sampled plainly)
    samples_plainly = runner._samples_plainly

    def record(drafts: list[int]) -> bool:
        decisions.append((any(drafts), samples_plainly(drafts)))
        return decisions[-1][1]

    runner._samples_plainly = record
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, f"{method}, k = 4 fixed")
    assert (False, True) in decisions, "a step completing prompts only should sample plainly"
    assert (True, False) in decisions, "steps with drafts should verify them"
    assert all(plain != verified for verified, plain in decisions), decisions


@pytest.mark.parametrize(("num_scheduler_steps", "with_prompts"), [(1, False), (4, False), (1, True), (4, True)])
@pytest.mark.parametrize("method", METHODS)
def test_no_drafts_for_plans_that_compute_prompts(method, num_scheduler_steps, with_prompts):
    """With measured costs, a plan that leaves a prompt unfinished, or requests waiting with room in the batch,
    proposes no drafts: the next plan computes prompt chunks and verifies nothing. Once prompts are done the
    policy's k (scripted: 4) comes back; output stays the plain engine's. With speculate_with_prompts every plan
    proposes the policy's k, those before prompt chunks too, and the decodes beside the chunks verify them."""
    prompts = [p[: 40 + 9 * i] for i, p in enumerate(load_prompts(6))]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    config = dict(CONFIG, max_num_batched_tokens=48, max_num_seqs=4)
    ref = make_llm(**config).generate(prompts, params)
    llm = make_llm(
        method=method, k=4, num_scheduler_steps=num_scheduler_steps, speculate_with_prompts=with_prompts, **config
    )
    script_k(llm, [4])
    scheduler = llm.engine.engine_core.scheduler
    schedule = scheduler.schedule
    plans: list[tuple[bool, int]] = []  # (prompts pending after the plan, drafts it proposes)
    mixed_verifying = []  # plans computing prompt chunks whose decodes verify drafts

    def recording():
        so = schedule()
        mid_prompt = any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
        room = bool(scheduler.waiting) and len(scheduler.running) < scheduler.config.max_num_seqs
        plans.append((mid_prompt or room, so.num_proposals))
        decodes = so.num_speculative_tokens + 1
        if so.num_draft_positions and any(n > decodes for n in so.num_scheduled_tokens.values()):
            mixed_verifying.append(so.step_id)
        return so

    scheduler.schedule = recording
    got = llm.generate(prompts, params)
    assert_same_outputs(ref, got, f"{method}, with_prompts={with_prompts}")
    assert sum(pending for pending, _ in plans) >= 4, plans
    assert any(proposed == 4 for pending, proposed in plans if not pending), plans
    if with_prompts:
        assert all(proposed == 4 for pending, proposed in plans if pending), plans
        # Without the setting only a plan admitting into a slot freed since the plan before verifies beside a prompt
        # (1-2 here); with it, those after each plan that left prompts pending too (10-11).
        assert len(mixed_verifying) >= sum(pending for pending, _ in plans) // 2, (mixed_verifying, plans)
        # Some of them beside a chunk that stops short of its prompt: verified greedily, over the decodes alone.
        assert llm.engine.engine_core.runner._greedy_verification.num_sampling_only > 0
    else:
        assert all(proposed == 0 for pending, proposed in plans if pending), plans


def _recording(decide, decisions: list[bool]):
    def wrapper(*args):
        decisions.append(decide(*args))
        return decisions[-1]

    return wrapper


def test_draft_skipped_at_k0_catches_up_to_the_same_drafts():
    """Decode steps at k = 0 that propose nothing leave the draft model alone; its next pass catches
    up on the skipped tokens (at most max_lag of them). The drafts must be exactly those of a draft
    that followed every step: the same accepted counts and steps, and greedy output unchanged."""
    prompts = [p[:60] for p in load_prompts(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=50 + 7 * i, ignore_eos=True) for i in range(5)]
    pattern = [4, 4, *[0] * 24, 4, 2, *[0] * 5, 1, 4]  # 24 zeros: longer than max_lag (128 // 8 = 16)
    ref = make_llm(**CONFIG).generate(prompts, params)
    runs = {}
    for lazy in (True, False):
        llm = make_llm(method="draft_model", k=4, **CONFIG)
        script_k(llm, pattern)
        runner = llm.engine.engine_core.runner
        decisions: list[bool] = []
        runner._skips_draft = _recording(runner._skips_draft, decisions) if lazy else (lambda *a: False)
        got = llm.generate(prompts, params)
        assert_same_outputs(ref, got, f"lazy draft catch-up = {lazy}")
        runs[lazy] = (llm.stats(), decisions, runner.spec.proposer.max_lag)
    (lazy_stats, decisions, max_lag), (eager_stats, _, _) = runs[True], runs[False]
    assert sum(decisions) > 20, "k = 0 decode steps should skip the draft"
    assert max_lag == 16
    # 24 zeros in a row: the lag bound forces a catch-up inside the stretch.
    longest = max(len(run) for run in "".join("s" if d else "." for d in decisions).split("."))
    assert longest <= max_lag
    for key in ("num_steps", "spec_num_draft_tokens", "spec_num_accepted_tokens", "num_generation_tokens"):
        assert lazy_stats[key] == eager_stats[key], key
    assert lazy_stats["num_free_kv_blocks"] == lazy_stats["num_kv_blocks"]


def test_a_probe_is_probe_length_choices_in_a_row():
    """The asynchronous loop's probes are four choices long (one steady period in the middle)."""
    policy = SpeculationPolicy(4, step_cost=compute_bound, probe_interval=10, probe_length=4)
    for _ in range(300):
        policy.observe_run(4, 0)  # nothing accepted: k = 0 is best, the others are only probed
    chosen = [policy.choose(32) for _ in range(400)]
    runs = [len(list(group)) for k, group in itertools.groupby(chosen) if k != 0]
    assert runs and all(length == 4 for length in runs)
