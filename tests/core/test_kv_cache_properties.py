"""Property tests: random request streams keep the block pool consistent and leak-free.

A shadow model records which token every slot holds, so prefix hits are also checked
for content: a hit block must hold exactly the request's tokens.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncspec.core.kv_cache import KVCacheManager
from asyncspec.request import Request
from asyncspec.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams())


ALPHABET = st.integers(0, 1)  # two symbols: prefixes collide often


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.reqs: dict[str, Any] = {}
        self.running: set[str] = set()
        self.content: dict[int, dict[int, int]] = {}
        """block id -> {offset: token} written by the last computation (shadow KV)."""
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)

    # ------------------------------------------------------------ helpers
    def _snapshot(self) -> tuple:
        pool = self.m.pool
        return (
            list(pool.free_queue),
            {r: self.m.get_block_ids(r) for r in self.reqs},
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {h: b.block_id for h, b in pool.cached_blocks.items()},
        )

    def _compute(self, req: Any, n: int) -> None:
        """Run `n` tokens: write their shadow K/V, then sample so one token stays uncomputed."""
        bs = self.m.block_size
        table = self.m.get_block_ids(req.request_id)
        start = req.num_computed_tokens
        while req.num_tokens < start + n + 1:
            req.all_token_ids.append(req.num_tokens % 2)
        for pos in range(start, start + n):
            self.content.setdefault(table[pos // bs], {})[pos % bs] = req.all_token_ids[pos]
        req.num_computed_tokens = start + n

    def _check_allocation(self, req: Any, before: tuple, total: int, result: Any, extra_free: int) -> None:
        bs = self.m.block_size
        held = len(before[1][req.request_id])
        if result is None:
            assert self._snapshot() == before  # all-or-nothing
            assert -(-total // bs) - held + extra_free > len(before[0])
        else:
            table = self.m.get_block_ids(req.request_id)
            assert len(table) == max(-(-total // bs), held)  # never short, never more than needed
            assert table[len(table) - len(result) :] == result

    # ------------------------------------------------------------ rules
    @rule(prompt=st.lists(ALPHABET, min_size=1, max_size=20), lookahead=st.integers(0, 4))
    def add_request(self, prompt: list[int], lookahead: int) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = make_request(rid, prompt)
        self._schedule_waiting(rid, lookahead)

    @precondition(lambda self: len(self.reqs) > len(self.running))
    @rule(data=st.data(), lookahead=st.integers(0, 4))
    def schedule_waiting(self, data: st.DataObject, lookahead: int) -> None:
        rid = data.draw(st.sampled_from(sorted(set(self.reqs) - self.running)))
        self._schedule_waiting(rid, lookahead)

    def _schedule_waiting(self, rid: str, lookahead: int) -> None:
        req = self.reqs[rid]
        bs = self.m.block_size
        hits, n_hit = self.m.get_computed_blocks(req)
        assert n_hit == len(hits) * bs and n_hit <= req.num_tokens - 1
        for i, block_id in enumerate(hits):  # content check: the hit holds these tokens
            expect = {o: t for o, t in enumerate(req.all_token_ids[i * bs : (i + 1) * bs])}
            assert self.content.get(block_id) == expect
        n_new = req.num_tokens - n_hit
        before = self._snapshot()
        extra = sum(self.m.pool.blocks[b].ref_cnt == 0 for b in hits)
        result = self.m.allocate_slots(req, n_new, lookahead, hits, n_hit)
        self._check_allocation(req, before, n_hit + n_new + lookahead, result, extra)
        if result is not None:
            assert self.m.get_block_ids(rid)[: len(hits)] == hits
            req.num_computed_tokens = n_hit
            self._compute(req, n_new)
            self.running.add(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.integers(0, 6), lookahead=st.integers(0, 4))
    def decode(self, data: st.DataObject, n: int, lookahead: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.reqs[rid]
        before = self._snapshot()
        total = req.num_computed_tokens + n + lookahead
        result = self.m.allocate_slots(req, n, lookahead)
        self._check_allocation(req, before, total, result, 0)
        if result is not None:
            self._compute(req, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.reqs[rid]
        self.m.cache_blocks(req, data.draw(st.integers(0, req.num_computed_tokens)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), finish=st.booleans())
    def free(self, data: st.DataObject, finish: bool) -> None:
        """Finish (forget the request) or preempt (back to waiting, recomputed later)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.m.free(self.reqs[rid])
        self.running.discard(rid)
        if finish:
            del self.reqs[rid]
        else:
            self.reqs[rid].num_computed_tokens = 0

    @rule()
    def free_unknown(self) -> None:
        self.m.free_by_id("nobody")

    # ------------------------------------------------------------ invariants
    @invariant()
    def pool_is_consistent(self) -> None:
        m = self.m
        pool = m.pool
        holders: dict[int, int] = {}
        for rid in self.reqs:
            table = m.get_block_ids(rid)
            assert len(table) == len(set(table)), "block twice in one table"
            if rid not in self.running:
                assert table == []
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
            assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
            if block.block_hash is not None:
                assert pool.cached_blocks[block.block_hash] is block
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        assert m.num_free_blocks + len(holders) == m.num_blocks
        assert 0.0 <= m.usage <= 1.0

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for req in self.reqs.values():
            self.m.free(req)
        assert self.m.num_free_blocks == self.m.num_blocks, "KV blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.m.pool.blocks)


KVCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
