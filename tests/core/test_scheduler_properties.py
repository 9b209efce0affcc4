"""Property test: random arrivals / aborts / steps against a small pool keep every scheduler invariant."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncspec.core.scheduler import Scheduler
from asyncspec.request import RequestStatus

from .scheduler_fakes import FakeRunner, make_request, make_scheduler

BASES = [[(b * 37 + i * 11) % 251 for i in range(64)] for b in range(3)]
"""Shared prompt prefixes, so that prefix-cache hits (and hits on evictable blocks) happen."""


@st.composite
def configs(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 48))
    min_blocks = -(-max_model_len // block_size)  # what EngineCore guarantees
    chunked = draw(st.booleans())
    return dict(
        block_size=block_size,
        num_blocks=draw(st.integers(min_blocks, min_blocks + 12)),  # small: preemption is common
        enable_prefix_caching=draw(st.booleans()),
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(1, 6)),
        # Without chunking a prompt must fit one step's budget, as the engine requires.
        max_num_batched_tokens=draw(st.integers(1, 64) if chunked else st.integers(max_model_len, 96)),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 3, 16])),
        num_lookahead_tokens=draw(st.sampled_from([0, 0, 1, 4])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


add_op = st.tuples(
    st.just("add"),
    st.integers(0, 1),  # base prompt
    st.sampled_from([0, 5, 64, 64]),  # shared prefix length
    st.integers(1, 47),  # prompt length
    st.one_of(st.none(), st.integers(1, 24)),  # max_tokens
    st.integers(0, 3),  # priority
)
ops = st.lists(
    st.one_of(
        add_op, add_op, st.tuples(st.just("abort"), st.integers(0, 1000)), st.just(("step",)), st.just(("step",))
    ),
    min_size=4,
    max_size=80,
)


def check_invariants(s: Scheduler, so=None) -> None:
    cfg, kv = s.config, s.kv_cache_manager
    if so is not None:
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= cfg.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
    assert len(s.running) <= cfg.max_num_seqs
    running_ids = [r.request_id for r in s.running]
    waiting_ids = [r.request_id for r in s.waiting]
    assert len(set(running_ids)) == len(running_ids)
    assert set(running_ids).isdisjoint(waiting_ids)
    assert set(running_ids) | set(waiting_ids) == set(s.requests)
    assert len(s.waiting) + len(s.running) == len(s.requests)
    refs: Counter[int] = Counter()
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        blocks = kv.get_block_ids(r.request_id)
        assert len(blocks) * kv.block_size >= r.num_computed_tokens  # enough slots for its K/V
        assert r.num_computed_tokens <= r.num_tokens <= cfg.max_model_len
        refs.update(blocks)
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
    pool = kv.pool
    used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
    assert kv.num_free_blocks + used == kv.num_blocks
    assert {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt} == dict(refs)
    assert all(b.ref_cnt == 0 for b in pool.free_queue.values())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), program=ops)
def test_random_streams_keep_invariants(cfg, program):
    s = make_scheduler(**cfg)
    runner = FakeRunner(s)
    max_len = cfg["max_model_len"]
    expected: dict[str, tuple[int, int]] = {}  # id -> (prompt length, tokens it must produce)
    produced: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    ids: list[str] = []
    all_reqs = []

    def do_step() -> None:
        so = s.schedule()
        check_invariants(s, so)
        for o in s.update_from_output(so, runner.execute(so)):
            produced.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
        check_invariants(s)

    for op in program:
        if op[0] == "add":
            _, base, shared, length, max_tokens, priority = op
            length = min(length, max_len - 1)
            rid = f"r{len(ids)}"
            tail = [300 + len(ids) * 50 + i for i in range(length)]
            prompt = (BASES[base][: min(shared, length)] + tail)[:length]
            all_reqs.append(make_request(rid, prompt, priority=priority, max_tokens=max_tokens))
            s.add_request(all_reqs[-1])
            limit = max_len - length if max_tokens is None else min(max_tokens, max_len - length)
            expected[rid] = (length, limit)
            ids.append(rid)
            check_invariants(s)
        elif op[0] == "abort":
            if ids:
                rid = ids[op[1] % len(ids)]
                was_live = rid in s.requests
                out = s.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                assert len(out) == int(was_live)
                if was_live:
                    reasons[rid] = "abort"
                check_invariants(s)
        else:
            do_step()

    for _ in range(3000):  # drain: every request must finish (no livelock)
        if not s.has_unfinished_requests():
            break
        do_step()
    assert not s.has_unfinished_requests()
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert s.requests == {} and s.running == [] and len(s.waiting) == 0
    assert kv._req_blocks == {} and kv._req_hashes == {}  # no per-request state leaks either
    assert s.stats.num_finished_requests == len(ids)
    event(f"preemptions: {'yes' if s.stats.num_preemptions else 'no'}")
    event(f"prefix hits: {'yes' if any(r.num_cached_tokens > 0 for r in all_reqs) else 'no'}")
    event(f"aborts: {'yes' if 'abort' in reasons.values() else 'no'}")
    for rid, (length, limit) in expected.items():
        tokens = produced.get(rid, [])
        # Deterministic model: preemption / chunking / prefix hits never change the output.
        assert tokens == [runner.token_fn(rid, length + i) for i in range(len(tokens))]
        if reasons[rid] != "abort":
            assert reasons[rid] == "length" and len(tokens) == limit
        else:
            assert len(tokens) <= limit
