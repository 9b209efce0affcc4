"""Token-budget scheduler: running requests first, then prefill chunks; preemption by recompute."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from asyncspec.core.kv_cache import KVCacheManager
from asyncspec.core.request_queue import make_request_queue
from asyncspec.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncspec.core.spec_policy import SpeculationPolicy
from asyncspec.request import Request, RequestStatus
from asyncspec.sampling_params import SamplingParams


@dataclass
class SchedulerConfig:
    """The scheduler's slice of EngineConfig."""

    max_num_seqs: int
    """Most requests in one step."""
    max_num_batched_tokens: int
    """Token budget of one step."""
    max_model_len: int
    """Longest sequence a request may reach."""
    enable_chunked_prefill: bool = True
    """Split prompts that do not fit the remaining budget into chunks."""
    long_prefill_token_threshold: int = 0
    """Largest prefill chunk per request per step; 0 = no limit beyond the budget."""
    enable_prefix_caching: bool = True
    """Look up cached prefix blocks when a request is admitted."""
    prefix_sharing_wait_tokens: int = 0
    """A waiting request whose prompt shares at least this many tokens, past its cached prefix, with prompts
    that running requests are computing waits for their blocks rather than compute the same ones (0: never)."""
    num_lookahead_tokens: int = 0
    """KV slots reserved per decode beyond the scheduled tokens (the drafter's k proposals)."""
    num_speculative_tokens: int = 0
    """Draft tokens verified per decode: a decode is scheduled for 1 + k tokens (0: no speculation)."""
    policy: str = "fcfs"
    """"fcfs" or "priority"."""
    adaptive_speculation: bool = True
    """Choose k per step (SpeculationPolicy); False: always num_speculative_tokens."""
    num_scheduler_steps: int = 1
    """The most greedy decode steps one plan may run back to back when every running request may take them
    (see `_multi_step_count`; `Scheduler.set_steps_per_plan` lowers the cap); 1: one step per plan. With
    speculation: plans at k = 0 that propose nothing, and with multi_step_speculation plans at a steady k."""
    multi_step_speculation: bool = False
    """A plan that verifies k > 0 drafts and proposes k again may run several greedy verification steps back
    to back, each one's drafts proposed by the step before on the device (the worker's draft-model path)."""
    speculate_with_prompts: bool = False
    """With adaptive speculation and measured step costs: the decodes of a plan that computes prompt chunks verify
    the drafts proposed for them, and the plan before it proposes them (False: such plans verify none)."""
    admission_delay_runs: int = 0
    """Under load (at least max_num_seqs // 8 requests running, fewer than that many admissible), how many
    multi-step decode runs in a row may leave the waiting requests waiting, so that they are admitted in waves: a
    plan that admits one computes a prompt chunk and runs a single step. 0 admits as soon as a slot frees."""
    max_draft_lag: int = 0
    """Most decode steps a request's draft model may fall behind (EngineConfig.max_draft_lag; 0: no draft model).
    The worker feeds the draft the first step of a run when the lag would pass it, so a run takes at most
    max_draft_lag + 1 steps."""


@dataclass
class SchedulerStats:
    """Counters since start; read by LLM.stats() and the metrics exporter."""

    num_steps: int = 0
    """Plans reconciled."""
    num_device_steps: int = 0
    """Forward steps those plans ran: a multi-step plan (num_scheduler_steps) counts each of its steps."""
    num_preemptions: int = 0
    num_admission_deferrals: int = 0
    """Multi-step runs planned while requests that could have been admitted waited (admission waves)."""
    num_prefix_sharing_waits: int = 0
    """Plans in which a waiting request waited for the prompt blocks another request was computing (one per
    request and plan; SchedulerConfig.prefix_sharing_wait_tokens)."""
    num_prompt_tokens_computed: int = 0
    """Prompt tokens run through prefill steps, recomputation after a preemption included."""
    num_prompt_tokens: int = 0
    """Prompt tokens of each request that produced its first token, counted once per request and
    prefix-cache hits included (vLLM's prompt_tokens)."""
    num_prompt_tokens_cached: int = 0
    """Of num_prompt_tokens, those the prefix cache held when the request was admitted."""
    num_generation_tokens: int = 0
    num_finished_requests: int = 0
    num_drafts: int = 0
    """Verification steps of a request that had at least one draft token."""
    num_draft_tokens: int = 0
    """Draft tokens proposed and verified (a single step's: those at positions its max_tokens could keep)."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted and kept (none past a stop condition)."""
    accepted_per_position: list[int] = field(default_factory=list)
    """Accepted draft tokens by position in the run (index 0 = first draft)."""
    steps_per_speculative_k: dict[int, int] = field(default_factory=dict)
    """Steps that verified k drafts per decode, by k (adaptive speculation's choices)."""


class Scheduler:
    """Owns every Request's scheduling state and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.spec_policy = SpeculationPolicy(config.num_speculative_tokens, config.adaptive_speculation)
        self._planned_k = config.num_speculative_tokens  # drafts the previous step proposed per request
        self.steps_per_plan = config.num_scheduler_steps
        """The most decode steps the next plans may run (`set_steps_per_plan`; at most the config's)."""
        self._finished_since_last_step: set[str] = set()
        self._step_id = 0
        self._admission_deferrals = 0
        """Multi-step runs planned in a row that left admissible requests waiting (`_defers_admission`)."""
        self._admitted_last_plan = False
        """Whether the last plan admitted requests, or set some aside for a shared prefix, and left some waiting with
        slots free (its token budget ran out): a wave of admissions under way goes on until the batch is full. A
        request set aside for its prefix is the tail of a wave: deferred again, it waited two runs more."""
        self._memory_short = False
        """Whether the last plan preempted a request or could not admit one for KV memory."""
        self._below_min_tokens: set[Request] = set()
        self._plans: dict[int, dict[str, Request]] = {}
        """Per step not yet reconciled, the Request objects it planned: a request id may be reused
        by a new request while an older step with the old one is still in flight."""

    # -- request lifecycle ---------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.sampling_params.min_tokens:
            self._below_min_tokens.add(request)

    def requires_exact_counts(self) -> bool:
        """Whether the next step must be planned on reconciled counts (the asynchronous loop then
        retires the step in flight first): a running request still below its min_tokens has its stop
        ids masked by its exact output count, which only reconciliation knows."""
        if not self._below_min_tokens:
            return False
        for request in list(self._below_min_tokens):
            if request.is_finished or len(request.output_token_ids) >= request.sampling_params.min_tokens:
                self._below_min_tokens.discard(request)
        return any(r.status == RequestStatus.RUNNING for r in self._below_min_tokens)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests (abort, stop string) and frees their blocks at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        self._below_min_tokens.discard(request)
        self._finished_since_last_step.add(request.request_id)
        del self.requests[request.request_id]
        self.stats.num_finished_requests += 1

    def reset_after_warm_up(self, spec_policy: SpeculationPolicy) -> None:
        """Forgets what the start-up warm-up's dummy requests taught: the statistics, and the speculation
        policy (replaced by a fresh one). Only on an idle scheduler."""
        if self.requests or self._plans:
            raise RuntimeError("reset_after_warm_up needs an idle scheduler: requests or steps are in flight")
        self.stats = SchedulerStats()
        self.spec_policy = spec_policy
        self._planned_k = self.config.num_speculative_tokens

    def set_steps_per_plan(self, num_steps: int) -> None:
        """Caps the decode steps of the next plans (the engine's adaptive multi-step: as many as the host's
        work per plan needs to stay ahead of the device), within 1..SchedulerConfig.num_scheduler_steps."""
        if not 1 <= num_steps <= self.config.num_scheduler_steps:
            raise ValueError(f"steps per plan must be in [1, {self.config.num_scheduler_steps}], got {num_steps}")
        self.steps_per_plan = num_steps

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    # -- scheduling ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        token_budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted_ids: set[str] = set()

        # 1. Running requests: decodes (1 + k tokens) and unfinished prefill chunks.
        # Hot loop (every running request, every step): locals and inlined arithmetic only.
        running = self.running
        allocate_slots = kv.allocate_slots
        block_tables = kv.block_ids_by_request
        block_size = kv.block_size
        threshold = cfg.long_prefill_token_threshold
        lookahead_k = cfg.num_lookahead_tokens
        # This step verifies what the previous step proposed: the k it committed to.
        spec_k = self._planned_k if cfg.num_speculative_tokens else 0
        max_model_len = cfg.max_model_len
        cached_ids = cached.request_ids
        cached_blocks = cached.new_block_ids
        cached_computed = cached.num_computed_tokens
        draft_positions: dict[str, int] = {}
        # Decode steps this plan runs back to back: each request computes one token per step, so it needs
        # slots for num_steps tokens and emits num_steps tokens (optimistic view below).
        # Not while a request waits that could be admitted now (it would wait for the whole run), unless
        # admissions are deferred under load (`_defers_admission`). With
        # speculation, only when this plan verifies nothing and the next one verifies nothing either (the
        # policy's choice before the run: a run admits no request, so the batch it saw is the run's).
        num_steps = 1
        next_k: int | None = None
        chosen_k: int | None = None  # the policy's choice when it was made before the admissions (next_k: final)
        prompts_pending = False  # a prompt (or a recompute) this plan leaves unfinished
        defers_admission = False
        if self.steps_per_plan > 1 and (spec_k == 0 or cfg.multi_step_speculation):
            defers_admission = self._defers_admission()
            if not self.waiting or len(running) >= cfg.max_num_seqs or defers_admission:
                # Every request a decode and no admission possible: no prompt chunk in this plan or the next, so
                # the policy may choose the next k now (its only choice for this plan).
                # Deferred admissions, too: the run admits none (a plan whose requests cannot run several
                # steps gains nothing from deferring, and admits).
                count = self._multi_step_count(spec_k)
                if count > 1:
                    if cfg.num_speculative_tokens:
                        next_k = self._plan_next_k()
                    if (next_k or 0) == spec_k:  # a steady k: this plan verifies it and proposes it again
                        num_steps = count
                    elif defers_admission:
                        # One step after all, so it admits: the choice holds, but its rules apply once the
                        # admissions are known (a seeded request admitted here must get the full k).
                        chosen_k, next_k = next_k, None
                defers_admission = defers_admission and num_steps > 1
        drops_drafts = bool(spec_k) and num_steps == 1 and bool(running) and self._admits_wave(defers_admission)
        if num_steps > 1:
            # Each step computes 1 + k tokens a request; the last one's k proposals need slots too.
            lookahead_k = (num_steps - 1) * (spec_k + 1) + spec_k
        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + placeholders
            # The steps in flight, if every draft is accepted, may end it: past max_model_len a step has no place
            # to go, so plan it once that is known; past max_tokens only if they end it for sure (_ended_in_flight).
            if placeholders and (
                num_tokens >= max_model_len
                or (
                    (max_tokens := request.sampling_params.max_tokens) is not None
                    and len(request.output_token_ids) + placeholders >= max_tokens
                    and self._ended_in_flight(request)
                )
            ):
                index += 1
                continue
            num_new = num_tokens - computed
            num_drafts = 0
            # A recompute's chunk: even at one token it is not the decode of the last token, which verifies drafts.
            recomputes = num_new > 1
            if recomputes and placeholders == 0 and self._resumes_seeded_stream(request):
                num_new -= 1
            # Chunk any multi-token catch-up: a prompt, or a preempted request's recompute.
            if threshold > 0 and num_new > 1:
                num_new = min(num_new, threshold)
            elif num_new == 1 and not recomputes and spec_k and (placeholders or request.output_token_ids):
                # A decode after a sampling step: the worker holds up to k drafts to verify. A run's steps verify
                # k whatever max_tokens keeps (its tokens past it are dropped, as at k = 0).
                if num_steps > 1:
                    num_drafts = spec_k
                elif drops_drafts:
                    num_drafts = 0
                else:
                    num_drafts = self._num_drafts_for(request, computed, spec_k, max_model_len)
                if num_drafts < spec_k and placeholders and _is_seeded_stream(request.sampling_params):
                    # Near its end the drafts a request verifies depend on what the step in flight
                    # accepts; a seeded stream's draws depend on them: plan it once that is known.
                    index += 1
                    continue
                num_new += num_drafts
            if num_new > token_budget:
                if num_drafts and num_new <= cfg.max_num_batched_tokens and self._draws_follow_drafts(request):
                    # The budget left depends on the neighbours planned before it: a seeded stream waits for a
                    # step with room for all its drafts rather than verify fewer (which moves its draws).
                    index += 1
                    continue
                num_drafts = max(0, num_drafts - (num_new - token_budget))
                num_new = token_budget
            if num_new <= 0:
                index += 1
                continue
            end = computed + num_new
            if end < num_tokens:
                prompts_pending = True
            # Draft slots as _lookahead_for (inlined: hot loop).
            if end < num_tokens or not lookahead_k:
                lookahead = 0
            else:
                lookahead = lookahead_k if end + lookahead_k <= max_model_len else max(0, max_model_len - end)
            held = block_tables.get(request.request_id)
            if held is not None and end + lookahead <= len(held) * block_size:
                new_block_ids: list[int] | None = []  # allocate_slots' answer when the held blocks have room
            else:
                new_block_ids = allocate_slots(request, num_new, lookahead)
            while new_block_ids is None:
                victim = self._pick_victim()
                victim_index = running.index(victim)
                if victim_index < index:
                    # Already visited this step: hand its budget back (if it got any) before
                    # preempting it. A visited request with nothing to compute was never planned.
                    victim_tokens = num_scheduled.pop(victim.request_id, None)
                    if victim_tokens is not None:
                        token_budget += victim_tokens
                        self._unschedule_cached(cached, victim.request_id)
                        draft_positions.pop(victim.request_id, None)
                    index -= 1
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
                new_block_ids = allocate_slots(request, num_new, lookahead)
            if new_block_ids is None:
                continue  # `request` itself was preempted; self.running shrank under `index`
            request_id = request.request_id
            num_scheduled[request_id] = num_new
            cached_ids.append(request_id)
            cached_blocks.append(new_block_ids)
            cached_computed.append(computed)
            # Optimistic view: the scheduled tokens count as computed from now on, and a step that
            # reaches the last token emits every draft plus one token (a victim preempted later in
            # this step is reset by _preempt; reconciliation corrects both).
            request.num_computed_tokens = computed + num_new * num_steps
            if computed + num_new >= num_tokens:
                request.num_output_placeholders = placeholders + num_steps * (1 + num_drafts)
                request.num_inflight_steps += num_steps
                if num_drafts:
                    draft_positions[request_id] = num_drafts
            token_budget -= num_new
            index += 1

        # 2. Waiting requests, unless memory was short this step.
        memory_short = bool(preempted_ids)
        sharing_waits: list[Request] = []
        if defers_admission:
            self._admission_deferrals += 1
            self.stats.num_admission_deferrals += 1
        elif not preempted_ids:
            self._admission_deferrals = 0
            try:
                # A request set aside for a shared prefix keeps its slot in the batch: given to the requests behind
                # it, a full batch left it waiting for one of them to finish (a whole generation, not a plan or two).
                while self.waiting and token_budget > 0 and len(self.running) + len(sharing_waits) < cfg.max_num_seqs:
                    request = self.waiting.peek()
                    if request.num_computed_tokens == 0 and cfg.enable_prefix_caching:
                        computed_blocks, num_hit = kv.get_computed_blocks(request)
                        if num_hit and request.num_tokens - num_hit < 2 and self._resumes_seeded_stream(request):
                            # Its recompute must stop one token short (_resumes_seeded_stream): a hit that leaves it
                            # only its last token would skip the drafts the interrupted step verified there.
                            computed_blocks, num_hit = computed_blocks[:-1], num_hit - kv.block_size
                        wait_tokens = cfg.prefix_sharing_wait_tokens
                        if wait_tokens and kv.num_pending_shared_tokens(request, num_hit) >= wait_tokens:
                            # Another request is computing this prompt's next blocks (admitted in this plan, or
                            # in one whose step has not retired): they are registered, and hit, a plan or a few later.
                            # At most the batch's free slots are set aside: a burst of thousands with one prompt
                            # leaves the rest unexamined.
                            sharing_waits.append(self.waiting.pop())
                            self.stats.num_prefix_sharing_waits += 1
                            continue
                    else:
                        computed_blocks, num_hit = [], 0
                    num_new = request.num_tokens - request.num_computed_tokens - num_hit
                    if num_new > 1 and self._resumes_seeded_stream(request):
                        num_new -= 1
                    if cfg.long_prefill_token_threshold > 0:
                        num_new = min(num_new, cfg.long_prefill_token_threshold)
                    if num_new > token_budget:
                        if not cfg.enable_chunked_prefill:
                            break
                        num_new = token_budget
                    # A chunk that completes the prompt samples, and then the drafter writes k slots ahead.
                    end = request.num_computed_tokens + num_hit + num_new
                    lookahead = self._lookahead_for(
                        end, request.num_tokens, cfg.num_lookahead_tokens, cfg.max_model_len
                    )
                    new_block_ids = kv.allocate_slots(
                        request,
                        num_new,
                        lookahead,
                        new_computed_blocks=computed_blocks,
                        num_new_computed_tokens=num_hit,
                    )
                    if new_block_ids is None:
                        memory_short = True
                        break
                    self.waiting.pop()
                    if request.num_computed_tokens == 0 and cfg.enable_prefix_caching and request.num_cached_tokens < 0:
                        # The first admission only: a preempted request finding its own blocks again, generated
                        # tokens included, is no prompt lookup (and would inflate the hit rate under KV pressure).
                        kv.record_prefix_cache_query(request.num_tokens, num_hit)
                    request.num_computed_tokens += num_hit
                    if request.num_cached_tokens < 0:
                        request.num_cached_tokens = num_hit
                        request.queued_seconds = time.monotonic() - request.arrival_time
                    request.status = RequestStatus.RUNNING
                    self.running.append(request)
                    num_scheduled[request.request_id] = num_new
                    new_reqs.append(
                        NewRequestData(
                            request_id=request.request_id,
                            token_ids=list(request.all_token_ids),
                            num_prompt_tokens=request.num_prompt_tokens,
                            sampling_params=request.sampling_params,
                            block_ids=kv.get_block_ids(request.request_id),
                            num_computed_tokens=request.num_computed_tokens,
                        )
                    )
                    request.num_computed_tokens += num_new  # optimistic, as above
                    if request.num_computed_tokens >= request.num_tokens:
                        request.num_output_placeholders = 1
                        request.num_inflight_steps = 1
                    else:
                        prompts_pending = True
                    token_budget -= num_new
            finally:
                self.waiting.put_back(sharing_waits)  # their places, ahead of those never looked at

        self._admitted_last_plan = (
            bool(new_reqs or sharing_waits) and bool(self.waiting) and len(self.running) < cfg.max_num_seqs
        )
        self._memory_short = memory_short
        self._step_id += 1
        output = SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - token_budget,
            finished_req_ids=self._finished_since_last_step,
            preempted_req_ids=preempted_ids,
            num_speculative_tokens=spec_k,
            num_proposals=self._next_proposals(
                next_k, prompts_pending or (not memory_short and self._admissions_pending()), chosen_k
            ),
            num_draft_positions=draft_positions,
            num_steps=num_steps,
        )
        requests = self.requests
        self._plans[self._step_id] = {rid: requests[rid] for rid in num_scheduled}
        if cfg.num_speculative_tokens:
            counts = self.stats.steps_per_speculative_k
            verified_k = 0 if drops_drafts else spec_k
            counts[verified_k] = counts.get(verified_k, 0) + 1
        self._finished_since_last_step = set()
        return output

    def _next_proposals(self, next_k: int | None, prompts_pending: bool = False, chosen_k: int | None = None) -> int:
        """The drafts the worker proposes after this plan (the next plan's k): the choice already made when the
        plan could take several steps (no admission possible), else the policy's now that the admissions are
        known; 0 when the next plan computes prompt chunks (`_plan_next_k`)."""
        if not self.config.num_speculative_tokens:
            return 0
        return self._plan_next_k(prompts_pending, chosen_k) if next_k is None else next_k

    def _defers_admission(self) -> bool:
        """Whether this plan leaves the waiting requests waiting and runs several decode steps instead (if it can):
        fewer requests could be admitted (waiting, with a free slot) than a wave (an eighth of max_num_seqs), at
        least a wave is running, fewer than `admission_delay_runs` runs in a row have deferred, the last plan
        admitted none (a wave under way, whose prompts took several plans, goes on until the batch is full) and was
        not short of KV memory (a deferred run reserves its steps' slots ahead, which with requests preempted and
        slots free preempted more: 53 preemptions against 43 admitting at once, in a test's tight pool). A plan
        that admits runs one step, for every request; where the host's work per plan sets the pace (the reason
        plans take several steps), a request that ends every few steps (as requests that speculate do, their
        lengths spread) would otherwise cut every run to one step. Holding the admissions for a run or two admits
        them together: each waits at most that many runs.

        The free slots alone do not say whether a wave is coming: 32 streams held full on an engine of 128 slots
        (a server below its capacity) free one slot at a time and never run short of slots. There the bundled
        pair's draft engine admitted nearly every request alone, in a one-step plan of 2.6 ms against 1.9 ms for a
        4-step run (32 prompt plans a trial, against 20 on an engine of 32 slots, where waves applied; 0.91 of the
        plain engine's throughput against 0.97-1.01; an H100, 2026-12-07). Below a wave running (a light load)
        nothing waits."""
        cfg = self.config
        if not cfg.admission_delay_runs or not self.waiting or self._admitted_last_plan or self._memory_short:
            return False
        wave = cfg.max_num_seqs // 8
        return (
            0 < self._num_admissible() < wave <= len(self.running)
            and self._admission_deferrals < cfg.admission_delay_runs
        )

    def _num_admissible(self) -> int:
        """Waiting requests the batch has slots for."""
        return min(len(self.waiting), self.config.max_num_seqs - len(self.running))

    def _admits_wave(self, defers_admission: bool) -> bool:
        """Whether this plan admits a wave (`_defers_admission`: a wave's worth of admissible requests, or requests
        that waited through deferred runs) while its decodes hold drafts that the run before it proposed: they then
        verify none. The plan computes prompt chunks, so it replays a mixed graph, where verifying and the draft's
        catch-up after it are eager host work: about 5.5 ms a plan against 2.6 ms without drafts at 128 streams
        on an H200, several times the cost of the few tokens a request then gains, which the next run's steps
        make up. Only with measured step costs (the policy's: with none, as on the CPU, k never changes), without
        `speculate_with_prompts`, and with no seeded request running (a seeded stream's draws must not depend on
        when admissions come)."""
        cfg = self.config
        if defers_admission or not cfg.admission_delay_runs or self.steps_per_plan <= 1 or not self.waiting:
            return False
        wave = cfg.max_num_seqs // 8
        admissible = self._num_admissible()
        if wave < 2 or admissible <= 0 or (admissible < wave and not self._admission_deferrals):
            return False
        if not cfg.adaptive_speculation or self.spec_policy.step_cost is None or cfg.speculate_with_prompts:
            return False
        # A wave that may not get its KV blocks would drop the drafts for nothing: not after a plan short of
        # memory, nor while the pool cannot hold the first waiting request's next chunk (and the running
        # requests' slots for this step).
        if self._memory_short:
            return False
        kv = self.kv_cache_manager
        head = self.waiting.peek()
        chunk = min(head.num_tokens - head.num_computed_tokens, cfg.max_num_batched_tokens)
        if kv.num_free_blocks * kv.block_size < chunk + len(self.running) * (1 + self._planned_k):
            return False
        return not any(_is_seeded_stream(r.sampling_params) for r in self.running)

    def _admissions_pending(self) -> bool:
        """Requests wait that the next plan may admit: the batch has room (the caller rules out a wait for KV
        memory, which would otherwise keep speculation off for as long as the pool is full)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def _multi_step_count(self, k: int = 0) -> int:
        """How many decode steps the next plan may run back to back (1: just one). Every running request must
        be a decode (one token to compute, its last) whose sampling a greedy decode step does whole: greedy,
        no penalties, logprobs or min_tokens (the worker samples these steps inside the decode graph, with
        no host work between them). No step may pass max_model_len: a request's slots end there. A run may
        pass a request's max_tokens, as it may pass an EOS it samples: the tokens after its end are dropped
        when the run is reconciled. So requests that finish at different steps keep the runs long (a run
        cut to the nearest end would leave one step a plan for the whole tail of a batch), and only a run
        longer than every request's remaining tokens is cut. At k = 0 with a draft model, at most
        max_draft_lag + 1 steps (its lag bound). A request that the steps in flight already end is not planned:
        it sets no bound. One they end only if they accept every draft is planned (`_ended_in_flight`), with the
        tokens they leave it if they reject every draft.

        At k > 0 (multi_step_speculation) every step verifies k drafts a request, also past its max_tokens (where
        a single step verifies fewer, `_num_drafts_for`): each planned request needs room for every step's 1 + k
        tokens and the last step's k proposals before max_model_len, and no stop string."""
        max_model_len = self.config.max_model_len
        num_steps = self.steps_per_plan
        if self.config.max_draft_lag and not k:
            num_steps = min(num_steps, self.config.max_draft_lag + 1)
        most_left = 0
        for request in self.running:
            params = request.sampling_params
            if not params.multi_step_decodable:
                return 1
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + placeholders
            max_tokens = params.max_tokens
            left = max_model_len - num_tokens
            if max_tokens is not None:
                left = min(left, max_tokens - len(request.output_token_ids) - placeholders)
            if placeholders and left <= 0:
                if num_tokens >= max_model_len or self._ended_in_flight(request):
                    continue  # ended by the steps in flight (Scheduler.schedule skips it)
                # Planned although the steps in flight may end it: at most a token a step of them.
                left = (max_tokens or 0) - len(request.output_token_ids) - request.num_inflight_steps
            if num_tokens - request.num_computed_tokens != 1:
                return 1
            if k:
                if params.stop:
                    return 1  # a stop string cuts one step's run (the output processor uncounts its drafts)
                if not placeholders and not request.output_token_ids:
                    return 1  # its prompt's last token: it samples its first token, with no drafts to verify
                # Steps that fit: n (1 + k) tokens and k proposal slots after them, below max_model_len.
                room = (max_model_len - num_tokens - k - 1) // (k + 1)
            else:
                room = max_model_len - num_tokens
            if room < num_steps:
                num_steps = room
                if num_steps <= 1:
                    return 1
            most_left = max(most_left, left)
        return max(1, min(num_steps, most_left))

    def _draws_follow_drafts(self, request: Request) -> bool:
        """A seeded sampling request: where its draws fall depends on how many drafts each step verifies."""
        return _is_seeded_stream(request.sampling_params)

    def _resumes_seeded_stream(self, request: Request) -> bool:
        """A seeded sampling request recomputing its tokens under speculation (it was preempted): its
        recompute stops one token short, so that the decode of its last token verifies the drafts
        the interrupted step would have verified (the worker proposes them at the recompute's end).
        Its draws then go to the same positions as in an uninterrupted run."""
        if not self.config.num_speculative_tokens or not request.output_token_ids:
            return False
        return _is_seeded_stream(request.sampling_params)

    def _plan_next_k(self, prompts_pending: bool = False, chosen_k: int | None = None) -> int:
        """Commits to the k of the next step, once this step's admissions are known: the worker
        proposes that many drafts now, and the next step verifies exactly them. The policy's k,
        except the full k while a seeded sampling request runs: how much randomness a seeded stream
        draws depends on k, and its tokens must depend neither on its neighbours (the batch size
        steers the policy) nor on timing (the policy measures it). With adaptive speculation and
        measured costs (as the policy: on the CPU it keeps max k), 0 when the next plan computes
        prompt chunks (`prompts_pending`: a prompt left unfinished, or admissions waiting): such a
        plan runs eagerly or from a mixed graph, where verification is host work that the policy's
        measurements of decode steps do not see, and the prompts keep the GPU busy anyway
        (`speculate_with_prompts` lifts this rule: the policy's k for the running batch). `chosen_k`: the
        policy's choice for this plan, made already (the policy is asked once a plan: it counts its choices)."""
        cfg = self.config
        max_k = cfg.num_speculative_tokens
        measured = cfg.adaptive_speculation and self.spec_policy.step_cost is not None
        if prompts_pending and measured and not cfg.speculate_with_prompts:
            k = 0
        elif chosen_k is not None:
            k = chosen_k
        else:
            running, policy = self.running, self.spec_policy
            if policy.adaptive and policy.step_cost is not None:  # else it keeps max k, whatever the counts
                k = policy.choose(len(running), [r.spec_accepted for r in running], [r.spec_rejected for r in running])
            else:
                k = policy.choose(len(running))
        if k < max_k and any(_is_seeded_stream(r.sampling_params) for r in self.running):
            k = max_k
        self._planned_k = k
        return k

    @staticmethod
    def _num_drafts_for(request: Request, computed: int, k: int, max_model_len: int) -> int:
        """Draft positions to verify: k, but none whose token could not be kept (past max_model_len, or past
        max_tokens even if the steps in flight reject every draft). With d drafts the run's last token lands at
        position computed + d + 1, which must stay below max_model_len. A seeded stream counts the steps in
        flight as if they accept every draft: its drafts near its end must be those of its exact count (the
        caller plans it once that is known, when they could differ)."""
        num_drafts = min(k, max_model_len - computed - 2)
        params = request.sampling_params
        max_tokens = params.max_tokens
        if max_tokens is not None:
            in_flight = request.num_output_placeholders if _is_seeded_stream(params) else request.num_inflight_steps
            num_drafts = min(num_drafts, max_tokens - len(request.output_token_ids) - in_flight - 1)
        return max(num_drafts, 0)

    def _ended_in_flight(self, request: Request) -> bool:
        """For a request that the steps in flight end at its max_tokens if they accept every draft: whether the
        plan leaves it out. It does if they end it even when they reject every draft (a token a step), or if it
        is a seeded stream (`_num_drafts_for`). Otherwise it is planned, as in vLLM's asynchronous scheduler: if
        the steps in flight do end it, its results in the new step are void (as after an EOS); if they do not,
        it does not sit out a plan while the device runs the others (the tail of a speculating batch)."""
        params = request.sampling_params
        if _is_seeded_stream(params) or params.max_tokens is None:
            return True
        return len(request.output_token_ids) + request.num_inflight_steps >= params.max_tokens

    @staticmethod
    def _lookahead_for(end: int, num_tokens: int, k: int, max_model_len: int) -> int:
        # Draft slots only for a request that samples this step (decode or last prefill chunk:
        # `end` reaches its last known token), and never past max_model_len: no token there can
        # be kept, and reserving slots there could make a request that fits the pool on its own
        # preempt itself over and over near the end.
        if end < num_tokens:
            return 0
        return k if end + k <= max_model_len else max(0, max_model_len - end)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a step in flight for it is void (update_from_output)
        request.num_inflight_steps = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(request)

    @staticmethod
    def _unschedule_cached(cached: CachedRequestData, request_id: str) -> None:
        i = cached.request_ids.index(request_id)
        del cached.request_ids[i], cached.new_block_ids[i], cached.num_computed_tokens[i]

    # -- results -----------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, applies token-level stop conditions, frees finished requests."""
        stats = self.stats
        stats.num_steps += 1
        stats.num_device_steps += scheduler_output.num_steps
        outputs: list[EngineCoreOutput] = []
        plan = self._plans.pop(scheduler_output.step_id, {})
        if runner_output.failed_requests:
            # Only the requests this step planned: an id may belong to a newer request by now.
            failed = {
                rid: reason
                for rid, reason in runner_output.failed_requests.items()
                if plan.get(rid) is not None and plan.get(rid) is self.requests.get(rid)
            }
            outputs.extend(self._fail_requests(failed))
        logprobs = runner_output.logprobs
        num_drafts = runner_output.num_draft_tokens
        step_runs = runner_output.step_runs
        num_scheduled_map = scheduler_output.num_scheduled_tokens
        kv = self.kv_cache_manager
        cache_blocks = kv.cache_blocks if kv.enable_prefix_caching else None
        num_cached_blocks = kv.num_cached_blocks_by_request
        block_size = kv.block_size
        max_model_len = self.config.max_model_len
        running_status = RequestStatus.RUNNING
        finished_status = RequestStatus.FINISHED_STOPPED  # this and above: finished (RequestStatus.is_finished)
        num_prompt_computed = 0
        num_generated = 0
        spec_k = scheduler_output.num_speculative_tokens
        num_steps = scheduler_output.num_steps
        cached = scheduler_output.scheduled_cached_reqs
        # Where each request's step began (the plan's view: exact for prefill chunks, which have no
        # draft in flight before them).
        starts = dict(zip(cached.request_ids, cached.num_computed_tokens, strict=True))
        for new_req in scheduler_output.scheduled_new_reqs:
            starts[new_req.request_id] = new_req.num_computed_tokens
        draft_positions = scheduler_output.num_draft_positions
        # Tokens emitted by each decode that verified the step's k, and per request with drafts (drafts counted, kept
        # in its output, verified, accepted by verification): the statistics and the policy take them once per step.
        emitted: list[int] = []
        draft_runs: list[tuple[int, int, int, int]] = []
        # What each emitted run's request was expected to emit (its own acceptance before this step), and how
        # its counts decay: `SpeculationPolicy.request_acceptance`, inlined (every decode, every step).
        policy = self.spec_policy
        prior = policy.request_prior
        pooled_prior = prior * policy.population_rate
        request_decay = policy.request_decay
        spec_k1 = scheduler_output.num_speculative_tokens + 1
        predicted: list[float] = []
        for i, (request_id, sampled) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        ):
            request = plan.get(request_id)
            if request is None or request.status >= finished_status:
                continue  # finished after this step was planned: its results are void
            # Preempted after this step was planned (asynchronous loop): its tokens are real (a
            # seeded stream already drew them) and are kept; it recomputes them when it resumes.
            preempted = request.status != running_status
            num_sched = num_scheduled_map[request_id]
            start = starts[request_id]
            num_prompt = len(request.prompt_token_ids)
            if start < num_prompt:
                num_prompt_computed += min(num_sched, num_prompt - start)
            if not sampled:
                # A prefill chunk that did not reach the end of the prompt: all of it is committed.
                if (
                    cache_blocks is not None
                    and not preempted
                    and (start + num_sched) // block_size > start // block_size
                ):
                    cache_blocks(request, start + num_sched)
                continue
            num_drafts_planned = draft_positions.get(request_id, 0) if draft_positions else 0
            num_sampled = len(sampled)
            # Reconcile the optimistic view, once: the draft positions this step rejected are not
            # computed (a later step already planned keeps its own optimistic share). A run cut by a
            # stop ends the request, so its cut tail needs no correction.
            if not preempted:  # preemption reset both counts
                planned = num_steps * (1 + num_drafts_planned)  # tokens the plan counted on
                request.num_output_placeholders -= planned
                request.num_inflight_steps -= num_steps
                if planned != num_sampled:
                    request.num_computed_tokens -= planned - num_sampled
            params = request.sampling_params
            output_ids = request.output_token_ids
            all_ids = request.all_token_ids
            max_tokens = params.max_tokens
            status: RequestStatus | None = None
            num_new = 0
            if not output_ids:  # its first token: the prompt is counted once, whatever came before
                stats.num_prompt_tokens += num_prompt
                stats.num_prompt_tokens_cached += max(request.num_cached_tokens, 0)
            if (
                num_sampled > 1
                and (max_tokens is None or len(output_ids) + num_sampled < max_tokens)
                and len(all_ids) + num_sampled < max_model_len
                and request.eos_token_ids.isdisjoint(sampled)
                and (not params.stop_token_ids or not any(t in params.stop_token_ids for t in sampled))
            ):
                # A run that no limit and no stop id can end (most verification runs): taken whole.
                output_ids.extend(sampled)
                all_ids.extend(sampled)
                num_new = num_sampled
            else:
                for token_id in sampled:
                    output_ids.append(token_id)
                    all_ids.append(token_id)
                    num_new += 1
                    # Cheap pre-check; _check_stop decides (and records stop_reason).
                    if (
                        (max_tokens is not None and len(output_ids) >= max_tokens)
                        or len(all_ids) >= max_model_len
                        or token_id in request.eos_token_ids
                        or token_id in params.stop_token_ids
                    ) and (status := self._check_stop(request, token_id)) is not None:
                        break
            num_generated += num_new
            # A multi-step plan's runs of this request: those of the steps that began before its end.
            runs_begun = step_runs[i][: _steps_begun(step_runs[i], num_new)] if step_runs is not None else ()
            if spec_k and start >= num_prompt and num_sched == spec_k + 1:
                spec_accepted = request.spec_accepted
                alpha = (spec_accepted + pooled_prior) / (spec_accepted + request.spec_rejected + prior)
                if alpha > 0.999:
                    alpha = 0.999
                expected = (1.0 - alpha**spec_k1) / (1.0 - alpha)  # `expected_tokens`, inlined
                if step_runs is None:
                    emitted.append(num_sampled)
                    predicted.append(expected)
                else:
                    emitted.extend(length for _, length in runs_begun)
                    predicted.extend([expected] * len(runs_begun))
            # Every kept token but the newest has its KV in the cache. Only verified tokens reach
            # the prefix cache, and with stop strings only those that precede this step's run: the
            # output processor may still cut the run at a stop string (the next step registers the
            # run, if the request goes on).
            committed = len(all_ids) - 1
            cacheable = committed - num_new + 1 if params.stop else committed
            if (
                cache_blocks is not None
                and not preempted
                and cacheable // block_size > num_cached_blocks.get(request_id, 0)
            ):
                cache_blocks(request, cacheable)  # only once a block filled past those it processed
            output = EngineCoreOutput(
                request_id,
                sampled if num_new == num_sampled else sampled[:num_new],  # the runner's list, made for this step
                num_cached_tokens=max(request.num_cached_tokens, 0),
                queued_seconds=request.queued_seconds,
            )
            if num_drafts is not None:
                num_accepted = 0
                if step_runs is not None:
                    # Several steps' runs: each one's drafts among the kept tokens, the steps after a stop none.
                    left, n_drafts = num_new, 0
                    # Positions max_tokens lets each run keep, as a single step counts them (the steps after the
                    # request's end verify drafts that can never be delivered).
                    room = None if max_tokens is None else max_tokens - len(output_ids) + num_new
                    spec_accepted, spec_rejected = request.spec_accepted, request.spec_rejected
                    for valid, length in runs_begun:
                        kept = min(left, length - 1)
                        left = max(left - length, 0)
                        num_accepted += kept
                        counted = valid if room is None else min(valid, max(room, 0))
                        if room is not None:
                            room -= length
                        n_drafts += counted
                        if valid:
                            output.num_drafts += 1 if counted else 0
                            draft_runs.append((counted, kept, valid, length - 1))
                            spec_accepted = request_decay * spec_accepted + length - 1
                            spec_rejected = request_decay * spec_rejected + (length - 1 < valid)
                    request.spec_accepted, request.spec_rejected = spec_accepted, spec_rejected
                elif verified := num_drafts[i]:
                    num_accepted = min(num_new, num_sampled - 1)  # drafts among the kept tokens
                    # Counted: the drafts at positions max_tokens could keep (the asynchronous loop plans them
                    # for the count that rejects every draft in flight: more than the exact count keeps).
                    n_drafts = verified if max_tokens is None else min(verified, max_tokens - len(output_ids) + num_new)
                    output.num_drafts = 1 if n_drafts else 0
                    draft_runs.append((n_drafts, num_accepted, verified, num_sampled - 1))
                    request.spec_accepted = request_decay * request.spec_accepted + num_sampled - 1
                    request.spec_rejected = request_decay * request.spec_rejected + (num_sampled - 1 < verified)
                else:
                    n_drafts = 0
                output.num_draft_tokens = n_drafts
                output.num_accepted_tokens = num_accepted
            if logprobs is not None and (token_logprobs := logprobs[i]):
                output.new_logprobs = token_logprobs[:num_new]
            if status is not None:
                if preempted:
                    self.waiting.remove(request)
                else:
                    self.running.remove(request)
                self._free(request, status)
                output.finish_reason = request.finish_reason
                output.stop_reason = request.stop_reason
            outputs.append(output)
        stats.num_prompt_tokens_computed += num_prompt_computed
        stats.num_generation_tokens += num_generated
        if emitted:
            policy.observe_emitted_runs(spec_k, emitted, predicted)
        if draft_runs:
            self._count_drafts(draft_runs)
            policy.observe_runs([(verified, accepted) for _, _, verified, accepted in draft_runs])
        return outputs

    def planned_requests(self, step_id: int) -> dict[str, Request]:
        """The Request objects a step not yet reconciled planned (by id)."""
        return self._plans.get(step_id, {})

    def _count_drafts(self, runs: list[tuple[int, int, int, int]]) -> None:
        """Counts a step's verifications: per request (drafts counted, drafts kept, _, _)."""
        stats = self.stats
        stats.num_drafts += sum(1 for num_drafts, _, _, _ in runs if num_drafts)  # those with drafts to count
        kept_counts: dict[int, int] = {}
        most = 0
        for num_drafts, num_kept, _, _ in runs:
            stats.num_draft_tokens += num_drafts
            stats.num_accepted_tokens += num_kept
            kept_counts[num_kept] = kept_counts.get(num_kept, 0) + 1
            most = max(most, num_drafts)
        per_position = stats.accepted_per_position
        if len(per_position) < most:
            per_position.extend([0] * (most - len(per_position)))
        for num_kept, count in kept_counts.items():
            for position in range(num_kept):
                per_position[position] += count

    def uncount_cut_run(self, num_cut: int, counted: int, kept: int) -> None:
        """Takes back the tail of one run of tokens that a stop string cut (found by the output
        processor after this step was counted): `num_cut` generated tokens, and the accepted drafts
        at positions kept..counted-1, were never delivered."""
        stats = self.stats
        stats.num_generation_tokens -= num_cut
        stats.num_accepted_tokens -= counted - kept
        for position in range(kept, counted):
            stats.accepted_per_position[position] -= 1

    def _fail_requests(self, reasons: dict[str, str]) -> list[EngineCoreOutput]:
        """Ends requests that failed alone (finish_reason "error"), freeing their blocks."""
        failed = self.finish_requests(reasons, RequestStatus.FINISHED_ERROR)
        return [
            EngineCoreOutput(
                request_id=r.request_id,
                new_token_ids=[],
                finish_reason=r.finish_reason,
                error=reasons[r.request_id],
                num_cached_tokens=max(r.num_cached_tokens, 0),
            )
            for r in failed
        ]

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        # Like the sampler's mask: stop ids are blocked while fewer than min_tokens tokens
        # precede the one being checked (so the earliest stop is token min_tokens + 1).
        if num_output > params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _steps_begun(runs: list[tuple[int, int]], num_kept: int) -> int:
    """Of a multi-step plan's runs (valid drafts, tokens emitted), how many began before the request's end: the
    steps after the one that emitted its last kept token verified drafts for nothing."""
    emitted = 0
    for j, (_, length) in enumerate(runs):
        if emitted >= num_kept:
            return j
        emitted += length
    return len(runs)


def _is_seeded_stream(params: SamplingParams) -> bool:
    """A seeded sampling request: its tokens depend on where its generator's draws fall. A greedy request's seed
    draws nothing, so it constrains no plan."""
    return params.seed is not None and not params.is_greedy
