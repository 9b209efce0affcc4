"""The asynchronous order near max_tokens with speculation: a request that the steps in flight end only if they
accept every draft is planned again (as in vLLM's asynchronous scheduler); one they end for sure is not. If they
do end it, the new plan's results for it are void, and max_tokens stays exact."""

from __future__ import annotations

import pytest

from asyncspec.core.scheduler import Scheduler
from asyncspec.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

from .scheduler_fakes import make_request, make_scheduler, verification_output

K = 4


class AsyncDevice:
    """A model-free device of the asynchronous order: it knows each request's real tokens (not the plan's
    optimistic counts) and, per step, accepts every draft it verifies or rejects every one."""

    def __init__(self, accept: bool) -> None:
        self.accept = accept
        self.num_tokens: dict[str, int] = {}

    @staticmethod
    def token(request_id: str, position: int) -> int:
        return 1000 + 100 * ord(request_id[0]) + position

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.num_tokens.pop(rid, None)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        runs: list[list[tuple[int, int]]] = []
        new = {r.request_id: r for r in so.scheduled_new_reqs}
        for rid in req_ids:
            if rid in new:  # the whole prompt: its first token
                self.num_tokens[rid] = len(new[rid].token_ids)
                steps = [(0, 1)]
            else:
                drafts = so.num_draft_positions.get(rid, 0)
                steps = [(drafts, 1 + drafts if self.accept else 1)] * so.num_steps
            out: list[int] = []
            for _, length in steps:
                for _ in range(length):
                    out.append(self.token(rid, self.num_tokens[rid]))
                    self.num_tokens[rid] += 1
            sampled.append(out)
            runs.append(steps)
        return verification_output(so, req_ids, sampled, runs)


def _scheduler(num_steps: int) -> Scheduler:
    s = make_scheduler(
        num_blocks=128,
        block_size=4,
        max_model_len=128,
        num_scheduler_steps=num_steps,
        num_speculative_tokens=K,
        num_lookahead_tokens=K,
        multi_step_speculation=True,
    )
    s.spec_policy.choose = lambda num_decodes, *counts: K  # type: ignore[method-assign]
    return s


def _surely_ended(request) -> bool:
    return len(request.output_token_ids) + request.num_inflight_steps >= request.sampling_params.max_tokens


@pytest.mark.parametrize("num_steps", [1, 4])
@pytest.mark.parametrize("accept", [False, True])
def test_a_request_is_left_out_only_once_the_steps_in_flight_surely_end_it(accept, num_steps):
    s = _scheduler(num_steps)
    device = AsyncDevice(accept)
    max_tokens = {"a": 23, "b": 9, "c": 14}
    prompts = {"a": 6, "b": 9, "c": 5}
    for rid, n in prompts.items():
        s.add_request(make_request(rid, n, temperature=0.0, max_tokens=max_tokens[rid]))
    requests = dict(s.requests)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    reasons: dict[str, str | None] = {}
    void = 0
    in_flight = s.schedule()
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        nxt = s.schedule()  # planned while `in_flight` runs
        for rid, request in requests.items():
            if not request.is_finished and rid not in nxt.num_scheduled_tokens:
                # Left out only if the plan in flight ends it even when it rejects every draft.
                assert _surely_ended(request), (rid, len(request.output_token_ids), request.num_inflight_steps)
        outs = s.update_from_output(in_flight, device.execute(in_flight))
        done = {o.request_id for o in outs}
        for o in outs:
            if num_steps == 1:  # a step's drafts counted only where its max_tokens could keep them
                room = max_tokens[o.request_id] - len(tokens[o.request_id])
                assert o.num_accepted_tokens <= o.num_draft_tokens <= room
            tokens[o.request_id].extend(o.new_token_ids)
            reasons[o.request_id] = o.finish_reason
        for rid, request in requests.items():
            if not request.is_finished:  # reconciled: what `nxt` counts on, and its steps
                planned = rid in nxt.num_scheduled_tokens
                drafts = nxt.num_draft_positions.get(rid, 0)
                assert request.num_output_placeholders == (nxt.num_steps * (1 + drafts) if planned else 0)
                assert request.num_inflight_steps == (nxt.num_steps if planned else 0)
        # Planned into `nxt` and ended by `in_flight`: its results in `nxt` are void.
        void += sum(1 for rid in nxt.num_scheduled_tokens if rid in done and reasons[rid] is not None)
        in_flight = nxt
    else:
        raise AssertionError("did not drain")
    if in_flight.num_scheduled_tokens:
        assert s.update_from_output(in_flight, device.execute(in_flight)) == []
    for rid, n in prompts.items():
        assert tokens[rid] == [device.token(rid, n + i) for i in range(max_tokens[rid])], rid
        assert reasons[rid] == "length"
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    if accept:
        # The plans in flight ended requests that the next plan had taken on: those results were dropped.
        assert void > 0
