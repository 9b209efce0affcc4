"""Adaptive speculation: how many draft tokens each decode verifies this step.

Verifying k drafts costs a wider forward pass (and the draft model's k passes); it pays when the
expected emitted tokens per step, 1 + a + a^2 + ... + a^k for a per-position acceptance rate a,
grow faster than the step time. At small batch the step is memory-bound and nearly free to widen;
at large batch it becomes compute-bound and wide verification can lose (vLLM measured 1.4-1.8x
slowdowns from fixed k at high load). The policy picks the k in `choices` that maximises tokens
per second for the current batch size, from step costs the worker measured at start-up (GPU time
of the captured graphs), the host time per step measured as the engine runs, and the acceptance
rate observed so far. Without cost measurements (the CPU, enforce_eager) it always takes max k.

A step's host time depends on the k it verifies and on the drafts it proposes for the next step (the
draft model's passes; none at all when the next k is 0 too), so it is kept per (verified, proposed)
pair and a k is charged what a steady run at k costs: (k, k). Estimates only change for the k that
runs, so a k left alone for `probe_interval` steps is chosen `probe_length` times in a row to refresh
them: twice gives one steady (k, k) step in the synchronous loop; the asynchronous loop's period also
holds the retirement of the step before and the launch of the step after, so there a steady sample
needs three (k, k) steps in a row, four choices, and the engine keeps only such samples. So a slow
outlier (a kernel compiled mid-run, a hiccup, a transition between two k) or a stale acceptance rate
can never lock speculation off, or on, for good. Host time is a low quantile of recent steps (hiccups
only ever add time), so outliers do not move it, and samples from before a gap are dropped when a
probe brings a fresh one.

Probes and switches cost more than their steps: at 128 streams a speculating step's host work is several
times a plain one's, a switch from k = 0 makes the draft catch up and breaks multi-step runs, and the
estimates of the k not running go stale as the host's speed drifts. So the policy leaves the k it runs only
for an estimated gain of `switch_margin`, and a probe that finds its k far behind the best (below
`probe_threshold` of its rate) waits the longest interval before the next one.

Tokens per verified run are what runs at that k really emitted, once enough were seen: requests differ
(a repetitive file accepts everything, prose little), and the geometric model of one pooled acceptance
rate overestimates a mixed batch. The batch being planned is not the batch those runs came from, though:
the requests that accept most finish first, so a batch's tail is the requests that accept least, and there
the pooled history promised 3.7 tokens a k = 4 run where the remaining requests gave about 2 (the bundled
pair at 128 streams). So each request keeps its own acceptance estimate (`request_acceptance`, shrunk to
the population's rate while it has few runs), the scheduler hands the planned batch's estimates to `choose`,
and a k's tokens per run are the batch's geometric model (`batch_tokens`) scaled by how far that model
was off for the runs seen at k (what they emitted over what it predicted for them, which also absorbs
proposers that find no draft).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from asyncspec.errors import ConfigError

StepCost = Callable[[int, int], float]
"""step_cost(num_decodes, k) -> seconds of device time of one step verifying k drafts per decode."""


def speculation_choices(max_k: int) -> list[int]:
    """The k values the policy may pick (each needs its own CUDA graphs): 0, 1, k/2 and k."""
    if max_k <= 0:
        return [0]
    return sorted({0, 1, max_k // 2, max_k})


@dataclass
class SpeculationPolicy:
    """Chooses k per step; one per scheduler. `observe_*` feed it what each step showed."""

    max_k: int
    """num_speculative_tokens: the widest verification."""
    adaptive: bool = True
    """False: always max_k."""
    decay: float = 0.98
    """Weight of the past in the running acceptance estimate (per observation)."""
    probe_interval: int = 50
    """A k not chosen for this many steps is chosen twice, to refresh its estimates (0: never probe).
    Each probe that does not make its k the best doubles that k's interval, up to 16 times this."""
    host_window: int = 16
    """Recent steps per (verified, proposed) pair whose host times the low quantile is taken over."""
    probe_length: int = 2
    """Consecutive choices of a probed k: 2 for the synchronous loop, 4 for the asynchronous one."""
    emitted_decay: float = 0.995
    """Weight of the past in the tokens-per-run means (per verified run)."""
    switch_margin: float = 0.1
    """The k running is left only for one whose estimated tokens per second beat its own by this fraction."""
    probe_threshold: float = 0.75
    """A probe that finds its k below this fraction of the best's rate sets that k's interval to the
    longest (16 probe intervals) at once, instead of doubling it."""
    request_prior: float = 16.0
    """Verifications' worth of the population's acceptance rate (`population_rate`) in each request's own
    estimate: a request's first runs say little of it, and the population's rate is the best guess before them.
    At 4, a file whose first lines rejected half the drafts was priced near 0.6 and held k = 1 for most of
    its run at batch 1 (the batch-1 TPOT was 5-7 % slower than pricing on the pooled history on an H200); at
    16 it was not slower."""
    request_decay: float = 0.99
    """Weight of the past in a request's own acceptance counts (per verification). Close to 1: one request's
    estimate sets the choice at batch 1, where k = 2 and k = 4 are near a tie and a noisy estimate flips
    between them (each switch a plan of its own)."""
    population_decay: float = 0.995
    """Weight of the past in the population's acceptance rate, per step (each step's runs summed): a memory of
    some 200 steps whatever the batch, so the end of a closed batch (its worst requests) does not become the
    prior of the next batch's requests. Per run, 128 streams would forget in 8 steps."""
    choices: list[int] = field(default_factory=list)
    """Candidate k values; speculation_choices(max_k) by default."""
    step_cost: StepCost | None = None
    """Device seconds per step, from the worker's start-up measurements; None: always max_k."""
    _accepted: float = 3.0  # a prior of 0.6 acceptance, worth five rejections
    _rejected: float = 2.0
    _population_accepted: float = 3.0  # the same prior, decayed by population_decay
    _population_rejected: float = 2.0
    _num_verified: int = 0  # verifications observed (runs with drafts)
    # Host seconds of recent steps by (k verified, drafts proposed): proposal passes cost host time.
    _host_samples: dict[tuple[int, int], deque[float]] = field(default_factory=dict)
    _probe: int | None = None  # a probed k, chosen again at the next step
    _probe_left: int = 0  # how many more times
    _probed: int | None = None  # the k whose probe just ended: is it the best now?
    _intervals: dict[int, int] = field(default_factory=dict)  # per k, the current probe interval
    _num_observed: int = 0
    _last_observed: dict[tuple[int, int], int] = field(default_factory=dict)
    # Decayed sums of tokens emitted by, and number of, runs that verified exactly k drafts.
    _emitted: dict[int, float] = field(default_factory=dict)
    _runs: dict[int, float] = field(default_factory=dict)
    # Decayed sums of the tokens the model predicted for those runs (from each request's own estimate).
    _predicted: dict[int, float] = field(default_factory=dict)
    _num_choices: int = 0
    _last_chosen: dict[int, int] = field(default_factory=dict)
    _current: int | None = None  # the last k chosen for itself (not as a probe)

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = speculation_choices(self.max_k)
        if any(not 0 <= k <= self.max_k for k in self.choices):
            raise ConfigError(f"speculation choices must be in [0, max_k={self.max_k}], got {self.choices}")
        if self.request_prior <= 0:
            raise ConfigError(f"request_prior must be positive, got {self.request_prior}")
        for name in ("decay", "emitted_decay", "request_decay", "population_decay"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def acceptance_rate(self) -> float:
        """Estimated probability that a draft is accepted given that the ones before it were."""
        return self._accepted / (self._accepted + self._rejected)

    @property
    def population_rate(self) -> float:
        """`acceptance_rate` over a long memory (`population_decay`): the prior of a request not yet verified."""
        return self._population_accepted / (self._population_accepted + self._population_rejected)

    def request_acceptance(self, accepted: float, rejected: float) -> float:
        """One request's acceptance rate from its own (decayed) counts of accepted drafts and of verifications
        that rejected one, shrunk to the population's rate by `request_prior` verifications' worth of it."""
        prior = self.request_prior
        return min((accepted + prior * self.population_rate) / (accepted + rejected + prior), 0.999)

    def batch_tokens(self, accepted: Sequence[float], rejected: Sequence[float]) -> dict[int, float]:
        """Per k of `choices`, the geometric model of a run at k for a batch: the mean over its requests of
        1 + a + ... + a^k, a each request's `request_acceptance` (from its counts, in the same order)."""
        n = len(accepted)
        if len(rejected) != n:
            raise ValueError(f"{n} accepted counts but {len(rejected)} rejected counts")
        if n == 0 or self.max_k == 0:
            return {}
        prior = self.request_prior
        pooled = prior * self.population_rate
        sums = [0.0] * self.max_k  # sums[j]: the batch's sum of a^(j + 1)
        if n <= 16:
            for acc, rej in zip(accepted, rejected, strict=True):
                a = min((acc + pooled) / (acc + rej + prior), 0.999)
                p = 1.0
                for j in range(self.max_k):
                    p *= a
                    sums[j] += p
        else:  # one vectorised pass: this runs once a plan, and a full batch is 100+ requests
            acc_arr = np.asarray(accepted, dtype=np.float64)
            a_arr = np.minimum((acc_arr + pooled) / (acc_arr + np.asarray(rejected, dtype=np.float64) + prior), 0.999)
            p_arr = np.ones_like(a_arr)
            for j in range(self.max_k):
                p_arr *= a_arr
                sums[j] = float(p_arr.sum())
        return {k: 1.0 + sum(sums[:k]) / n for k in self.choices}

    def choose(
        self, num_decodes: int, accepted: Sequence[float] | None = None, rejected: Sequence[float] | None = None
    ) -> int:
        """The k of the next step for `num_decodes` decodes; `accepted` and `rejected` are their requests' own
        acceptance counts (`batch_tokens`), or None to price every k on the pooled history alone."""
        if not self.adaptive or self.step_cost is None or self.max_k == 0 or num_decodes == 0:
            return self.max_k
        self._num_choices += 1
        batch = self.batch_tokens(accepted, rejected) if accepted is not None and rejected is not None else None
        rates = self._rates(num_decodes, self.step_cost, batch)
        k = _fastest(rates)
        current = self._current
        if not self._has_speculated():
            # Nothing seen of any k > 0 yet: the widest first. Its runs show the acceptance at every position (a
            # k = 1 run only at the first) and its host time prices every k > 0. On the prior alone (0.6 a position)
            # a fresh engine at 128 streams took k = 1, then k = 0 on k = 1's host time, for eight plans before a
            # probe found k = 4, about 8 % of the batch (an H200, 2026-12-02).
            k = max(self.choices)
        elif current in rates and rates[k] < rates[current] * (1.0 + self.switch_margin):
            k = current
        self._current = k
        if self._probed is not None:
            # A probe that changed nothing makes the next one of that k rarer (at once the rarest when it
            # found that k far behind); one that did, sooner.
            probed = self._probed
            longest = 16 * self.probe_interval
            grown = min(2 * self._intervals.get(probed, self.probe_interval), longest)
            if rates[probed] < self.probe_threshold * max(rates.values()):
                grown = longest
            self._intervals[probed] = self.probe_interval if k == probed else grown
            self._probed = None
        if self._probe is not None:
            k = self._probe
            self._probe_left -= 1
            if self._probe_left <= 0:
                self._probed, self._probe = k, None
        elif self.probe_interval > 0:
            stale = [j for j in self.choices if self._num_choices - self._last_chosen.get(j, 0) > self._interval(j)]
            if stale:
                k = self._probe = min(stale, key=lambda j: self._last_chosen.get(j, 0))
                self._probe_left = self.probe_length - 1
        self._last_chosen[k] = self._num_choices
        return k

    def _has_speculated(self) -> bool:
        """Whether any step at a k > 0 has been observed: a verification, its emitted runs, or its host time."""
        return bool(self._num_verified or self._runs) or any(j > 0 for j, _ in self._host_samples)

    def _interval(self, k: int) -> int:
        return self._intervals.get(k, self.probe_interval)

    def _best(self, num_decodes: int, step_cost: StepCost) -> int:
        """The k of the highest expected tokens per second under the current estimates."""
        return _fastest(self._rates(num_decodes, step_cost))

    def _rates(self, num_decodes: int, step_cost: StepCost, batch: dict[int, float] | None = None) -> dict[int, float]:
        """Expected tokens per second of each k under the current estimates (for this batch: `batch_tokens`)."""
        alpha = min(self.acceptance_rate, 0.999)
        rates = {}
        for k in self.choices:
            tokens = num_decodes * self.tokens_per_run(k, alpha, batch)
            seconds = step_cost(num_decodes, k) + self.host_seconds(k)
            rates[k] = tokens / max(seconds, 1e-9)
        return rates

    def observe_run(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafts` drafts kept in a row."""
        self.observe_runs([(num_drafts, num_accepted)])

    def observe_runs(self, runs: list[tuple[int, int]]) -> None:
        """`observe_run` for each (num_drafts, num_accepted) of a step, in order (one call per step)."""
        decay, accepted, rejected = self.decay, self._accepted, self._rejected
        long_decay, long_accepted, long_rejected = (
            self.population_decay,
            self._population_accepted,
            self._population_rejected,
        )
        step_accepted = step_rejected = 0.0
        num_verified = 0
        for num_drafts, num_accepted in runs:
            if num_drafts > 0:
                num_verified += 1
                rejection = 1.0 if num_accepted < num_drafts else 0.0
                accepted = decay * accepted + num_accepted
                rejected = decay * rejected + rejection
                step_accepted += num_accepted
                step_rejected += rejection
        self._accepted, self._rejected = accepted, rejected
        if step_accepted or step_rejected:
            self._population_accepted = long_decay * long_accepted + step_accepted
            self._population_rejected = long_decay * long_rejected + step_rejected
        self._num_verified += num_verified

    def observe_emitted_runs(self, k: int, num_tokens: list[int], predicted: list[float] | None = None) -> None:
        """`observe_emitted(k, n)` for each n of a step, in order (one call per step). `predicted`: what the
        geometric model of each run's request promised for it (`expected_tokens`); None: the pooled rate's."""
        if k in self.choices and k > 0 and num_tokens:
            if predicted is None:
                predicted = [expected_tokens(min(self.acceptance_rate, 0.999), k)] * len(num_tokens)
            d = self.emitted_decay
            emitted, runs, model = self._emitted.get(k, 0.0), self._runs.get(k, 0.0), self._predicted.get(k, 0.0)
            for n, m in zip(num_tokens, predicted, strict=True):
                emitted = d * emitted + n
                runs = d * runs + 1.0
                model = d * model + m
            self._emitted[k], self._runs[k], self._predicted[k] = emitted, runs, model

    def observe_emitted(self, k: int, num_tokens: int) -> None:
        """A decode that verified k planned draft positions emitted num_tokens (1 when its proposer
        found no draft: such runs count here, and tell the policy that speculating did not pay)."""
        self.observe_emitted_runs(k, [num_tokens])

    def tokens_per_run(self, k: int, alpha: float | None = None, batch: dict[int, float] | None = None) -> float:
        """Expected tokens a decode emits when verifying k drafts: the mean of recent runs at k once
        there are enough of them, else 1 + a + ... + a^k for the pooled acceptance rate a (at most
        what runs at a larger k emitted). For a `batch` (`batch_tokens`): its model at k, scaled by what
        recent runs at k emitted over what the model predicted for them once there are enough, else its model
        alone (at most what a larger k would emit). Never more than k + 1, what a run that keeps every draft emits."""
        if k == 0:
            return 1.0
        if self._runs.get(k, 0.0) >= 8.0:
            if batch is not None and k in batch and self._predicted.get(k, 0.0) > 0.0:
                # The scaling may overshoot: at batch 1 on an H200, runs of a well-accepting file at k = 1 were
                # priced at 2.08 tokens, above the 2 they can emit.
                return min(batch[k] * self._emitted[k] / self._predicted[k], float(k + 1))
            return self._emitted[k] / self._runs[k]
        if batch is not None and k in batch:
            model = batch[k]
        else:
            model = expected_tokens(min(self.acceptance_rate if alpha is None else alpha, 0.999), k)
        # Fewer drafts never emit more than more drafts did: runs seen at a larger k cap the model.
        seen_above = [self.tokens_per_run(j, alpha, batch) for j in self._runs if j > k and self._runs[j] >= 8.0]
        return min([model, *seen_above])

    def host_seconds(self, k: int) -> float:
        """Host time of a steady step at k (verifying k drafts, proposing k): the low quartile of its
        recent steps once observed. Before that, for k > 0, that of the nearest speculating k observed (below
        it first): a speculating step's host work (proposal, verification, the wider reconciliation) is
        there at every k, and a plain step's says little of it (multi-step plans share theirs): at 128
        requests on an H200 it was 400-650 us at each of k = 1, 2 and 4 against about 0 at k = 0, and a k
        priced at 0 was switched to at once and left again. Else the largest observed at a smaller steady k
        (host work grows with k), else 0.

        k = 0 before its own steady steps: that of the smallest speculating k observed, an upper bound (a plain
        step's host work is part of a speculating one's) until a probe measures it. Priced at 0 instead, an unseen
        k = 0 looked free where the host sets the pace: at batch 1 on an H100 the bundled pair left k = 1 for it
        and kept it for whole generates (9 % slower on the median of nine trials, 16 % in the worst; 2026-12-07)."""
        if (k, k) in self._host_samples:
            return _low_quantile(self._host_samples[k, k])
        steady = {j: _low_quantile(v) for (j, n), v in self._host_samples.items() if j == n}
        if k > 0:
            below = [j for j in steady if 0 < j < k]
            above = [j for j in steady if j > k]
            if below or above:
                return steady[max(below) if below else min(above)]
            return max((t for j, t in steady.items() if j < k), default=0.0)
        speculating = [j for j in steady if j > 0]
        return steady[min(speculating)] if speculating else 0.0

    def observe_step(self, num_decodes: int, k: int, seconds: float, num_proposals: int | None = None) -> None:
        """A decode step's wall time, verifying k drafts and proposing `num_proposals` (default k):
        what it took beyond the device estimate is host time."""
        if self.step_cost is None or num_decodes == 0:
            return
        host = max(seconds - self.step_cost(num_decodes, k), 0.0)
        key = (k, k if num_proposals is None else num_proposals)
        self._num_observed += 1
        samples = self._host_samples.setdefault(key, deque(maxlen=self.host_window))
        # A probe after a long gap: what the old samples said (perhaps while kernels compiled) is stale.
        if self.probe_interval > 0 and self._num_observed - self._last_observed.get(key, 0) > self.probe_interval:
            samples.clear()
        self._last_observed[key] = self._num_observed
        samples.append(host)


def expected_tokens(alpha: float, k: int) -> float:
    """1 + a + ... + a^k: the tokens a run at k emits when each draft is kept with probability a once the ones
    before it were (the last one sampled by the target)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _fastest(rates: dict[int, float]) -> int:
    """The k of the highest rate; near-ties go to the smaller k: the same rate for less work (and less
    over-allocation)."""
    best = max(rates.values())
    return min(k for k, rate in rates.items() if rate >= best / 1.0001)


def _low_quantile(samples: deque[float]) -> float:
    """The first quartile: a typical step, robust to the slow ones (compilation, a GC pause) until
    they are three in four."""
    return sorted(samples)[len(samples) // 4]
