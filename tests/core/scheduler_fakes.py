"""A model-free stand-in for the worker, shared by the scheduler tests.

`FakeRunner` mirrors what `ModelRunner` keeps per request (token count, computed count,
block table) purely from the SchedulerOutput diffs, checks that those diffs are coherent
with the scheduler's own state, and "samples" deterministic token ids.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncspec.core.kv_cache import KVCacheManager
from asyncspec.core.scheduler import Scheduler, SchedulerConfig
from asyncspec.core.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from asyncspec.request import Request
from asyncspec.sampling_params import SamplingParams

TokenFn = Callable[[str, int], int]
"""(request_id, position of the token to sample) -> token id."""


def default_token(request_id: str, position: int) -> int:
    return 1000 + (zlib.crc32(request_id.encode()) % 97) * 31 + position  # never an EOS / stop id used in tests


def make_scheduler(num_blocks: int = 64, block_size: int = 4, enable_prefix_caching: bool = True, **cfg) -> Scheduler:
    defaults = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    defaults.update(cfg)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(SchedulerConfig(enable_prefix_caching=enable_prefix_caching, **defaults), kv)


def make_request(
    request_id: str,
    prompt: list[int] | int,
    eos: frozenset[int] = frozenset(),
    priority: int = 0,
    arrival_time: float | None = None,
    **params,
) -> Request:
    if isinstance(prompt, int):
        prompt = [(zlib.crc32(request_id.encode()) + 7 * i) % 500 for i in range(prompt)]
    params.setdefault("max_tokens", 16)
    kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(request_id, list(prompt), SamplingParams(**params), eos, priority, **kwargs)


@dataclass
class _Row:
    num_tokens: int
    num_computed_tokens: int
    block_ids: list[int] = field(default_factory=list)


class FakeRunner:
    def __init__(self, scheduler: Scheduler, token_fn: TokenFn = default_token, check: bool = True) -> None:
        self.scheduler = scheduler
        self.token_fn = token_fn
        self.check = check
        self.rows: dict[str, _Row] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.rows.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.rows.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.request_id not in self.rows, f"{new.request_id} sent as new twice"
            self.rows[new.request_id] = _Row(len(new.token_ids), new.num_computed_tokens, list(new.block_ids))
        cached = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(
            cached.request_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.rows[rid]
            if self.check:
                # Sync mode: the worker's view after the last step is exactly the scheduler's.
                assert computed == row.num_computed_tokens, (rid, computed, row.num_computed_tokens)
            row.block_ids.extend(blocks)
            row.num_computed_tokens = computed
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        kv = self.scheduler.kv_cache_manager
        num_steps = so.num_steps
        for rid in req_ids:
            n = so.num_scheduled_tokens[rid]
            row = self.rows[rid]
            if num_steps > 1:  # a multi-step plan: decodes only, one token a step (1 + k with speculation)
                assert n == 1 + so.num_speculative_tokens and row.num_computed_tokens + 1 >= row.num_tokens, (
                    rid,
                    n,
                    row,
                )
            if self.check and rid in self.scheduler.requests:  # (not aborted since schedule())
                assert n > 0
                # The block table the worker built from diffs is the manager's, and covers the step.
                assert row.block_ids == kv.get_block_ids(rid), rid
                assert len(row.block_ids) * kv.block_size >= row.num_computed_tokens + n * num_steps
                drafts = so.num_draft_positions.get(rid, 0)
                if num_steps == 1 and drafts:
                    # Draft slots follow the last known token: a step that verifies drafts computes up to it.
                    assert row.num_computed_tokens + n - drafts == row.num_tokens, (rid, n, drafts, row)
            out: list[int] = []
            for _ in range(num_steps):
                if row.num_computed_tokens + n >= row.num_tokens:
                    out.append(self.token_fn(rid, row.num_tokens))
                    row.num_tokens += 1
                    # Every draft is rejected: the step computes the last known token only.
                    row.num_computed_tokens = row.num_tokens - 1
                else:
                    row.num_computed_tokens += n
            sampled.append(out)
        k = so.num_speculative_tokens
        if num_steps > 1 and k:
            # A multi-step speculative plan: each step verified k drafts and emitted one token.
            return ModelRunnerOutput(
                req_ids=req_ids,
                sampled_token_ids=sampled,
                num_draft_tokens=[k * num_steps] * len(req_ids),
                step_runs=[[(k, 1)] * num_steps for _ in req_ids],
            )
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def verification_output(
    so: SchedulerOutput, req_ids: list[str], sampled: list[list[int]], runs: list[list[tuple[int, int]]]
) -> ModelRunnerOutput:
    """What a speculating device returns for a plan: per request its sampled tokens and, per step, (drafts
    verified, tokens emitted); a multi-step plan's runs as step_runs, a single step's draft counts alone."""
    if so.num_steps > 1:
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            num_draft_tokens=[sum(v for v, _ in r) for r in runs],
            step_runs=runs,
        )
    drafts = [so.num_draft_positions.get(rid, 0) for rid in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, num_draft_tokens=drafts)


class RunDevice:
    """A model-free device (synchronous order) for speculative plans: in every step of a plan, each decode accepts
    `accepted(request_id, drafts)` of the drafts it verifies, and its tokens are consecutive ids from `first_token`
    plus its token count. `runs` records each request's verification runs as (drafts verified, drafts accepted)."""

    def __init__(self, accepted: Callable[[str, int], int], first_token: int = 0) -> None:
        self.accepted = accepted
        self.first_token = first_token
        self.num_tokens: dict[str, int] = {}
        self.runs: defaultdict[str, list[tuple[int, int]]] = defaultdict(list)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        new = {r.request_id: r for r in so.scheduled_new_reqs}
        req_ids = list(so.num_scheduled_tokens)
        sampled, step_runs = [], []
        for rid in req_ids:
            if rid in new:
                self.num_tokens[rid] = len(new[rid].token_ids)
                steps = [(0, 1)]
            else:
                drafts = so.num_draft_positions.get(rid, 0)
                steps = []
                for _ in range(so.num_steps):
                    kept = min(drafts, self.accepted(rid, drafts))
                    steps.append((drafts, 1 + kept))
                    if drafts:
                        self.runs[rid].append((drafts, kept))
            out: list[int] = []
            for _, length in steps:
                start = self.first_token + self.num_tokens[rid]
                out += range(start, start + length)
                self.num_tokens[rid] += length
            sampled.append(out)
            step_runs.append(steps)
        return verification_output(so, req_ids, sampled, step_runs)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, runner.execute(so))


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, list]:
    """Steps until nothing is left; returns request_id -> [tokens, finish_reason]."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        _, outs = step(scheduler, runner)
        for o in outs:
            entry = results.setdefault(o.request_id, [[], None])
            entry[0].extend(o.new_token_ids)
            entry[1] = o.finish_reason
    raise AssertionError("scheduler did not drain")
