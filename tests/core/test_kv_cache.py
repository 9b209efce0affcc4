"""KVCacheManager: exact slot allocation, all-or-nothing failure, prefix cache, LRU eviction."""

from __future__ import annotations

from typing import Any

import pytest

from asyncspec.core.kv_cache import KVCacheManager, PrefixCacheStats, num_blocks_for_bytes
from asyncspec.errors import ConfigError
from asyncspec.request import Request
from asyncspec.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams())


K = 4  # draft tokens: a decode step schedules K + 1 tokens


def snapshot(m: KVCacheManager, request_ids: list[str]) -> tuple:
    pool = m.pool
    return (
        m.num_free_blocks,
        list(pool.free_queue),
        {r: m.get_block_ids(r) for r in request_ids},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached_blocks.items()},
    )


def running(m: KVCacheManager, request_id: str, num_computed: int, tokens: list[int] | None = None) -> Any:
    """A request that has computed `num_computed` tokens and holds exactly the blocks for them."""
    req = make_request(request_id, tokens if tokens is not None else list(range(max(num_computed, 1))))
    assert m.allocate_slots(req, num_computed) is not None
    req.num_computed_tokens = num_computed
    return req


# ---------------------------------------------------------------- allocation arithmetic
@pytest.mark.parametrize(
    "block_size, computed, expected_new",
    [
        (16, 10, 0),  # 10 + 5 = 15: stays inside block 0
        (16, 14, 1),  # 14 + 5 = 19: crosses one boundary
        (4, 4, 2),  # 4 + 5 = 9: positions 4..8 span blocks 1 and 2
        (4, 7, 1),  # 7 + 5 = 12: ends exactly on a boundary
        (1, 3, 5),  # block_size 1: one block per token
        (16, 0, 1),  # nothing held yet
    ],
)
def test_deficit_for_k_plus_one_tokens(block_size: int, computed: int, expected_new: int) -> None:
    m = KVCacheManager(num_blocks=64, block_size=block_size)
    req = running(m, "r", computed)
    held = len(m.get_block_ids("r"))
    assert held == -(-computed // block_size)
    new = m.allocate_slots(req, K + 1)
    assert new is not None and len(new) == expected_new
    table = m.get_block_ids("r")
    assert len(table) == -(-(computed + K + 1) // block_size)
    assert table[held:] == new
    assert m.num_free_blocks == 64 - len(table)


def test_lookahead_slots_are_counted() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    req = running(m, "r", 4)
    new = m.allocate_slots(req, 1, num_lookahead_tokens=K)  # 4 + 1 + 4 = 9 -> 3 blocks
    assert new is not None and len(new) == 2
    assert m.allocate_slots(req, 1, num_lookahead_tokens=K) == []  # already covered


def test_exact_fit_of_the_pool() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("r", list(range(16)))
    assert m.allocate_slots(req, 16) == [0, 1, 2, 3]
    assert m.num_free_blocks == 0 and m.usage == 1.0


def test_insufficient_blocks_returns_none_and_changes_nothing() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = running(m, "a", 8, list(range(8)))
    m.cache_blocks(a, 8)
    b = running(m, "b", 4)
    before = snapshot(m, ["a", "b"])
    assert m.allocate_slots(b, 5, num_lookahead_tokens=4) is None  # 13 tokens: 4 blocks, 3 short
    assert snapshot(m, ["a", "b"]) == before
    assert m.allocate_slots(b, 4) == [3]  # 8 tokens: one more block, the last free one


def test_touched_free_hits_consume_capacity() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = running(m, "a", 8, list(range(8)))
    m.cache_blocks(a, 8)
    m.free(a)  # two cached free blocks + two plain free blocks
    b = make_request("b", list(range(8)) + [9, 9, 9, 9])
    hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 8 and len(hits) == 2
    before = snapshot(m, ["a", "b"])
    # 8 + 4 + 5 = 17 tokens -> 5 blocks: deficit 3 fits the 4 free blocks only if the
    # two hits (themselves free) were not counted. They are, so this must fail.
    assert m.allocate_slots(b, 4, 5, hits, n_hit) is None
    assert snapshot(m, ["a", "b"]) == before
    new = m.allocate_slots(b, 4, 4, hits, n_hit)  # 16 tokens -> 2 new + 2 touched = 4
    assert new is not None and len(new) == 2
    assert m.get_block_ids("b") == hits + new and m.num_free_blocks == 0


def test_negative_counts_are_rejected() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError):
        m.allocate_slots(make_request("r", [1]), -1)


# ---------------------------------------------------------------- prefix cache
def test_only_full_committed_blocks_are_hashed() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    req = running(m, "r", 10, list(range(10)))
    m.cache_blocks(req, 3)  # below the first boundary: nothing
    assert m.block_hashes("r") == [] and not m.pool.cached_blocks
    m.cache_blocks(req, 10)  # 2 full blocks, the partial third is never registered
    table = m.get_block_ids("r")
    assert len(m.pool.cached_blocks) == 2
    assert [m.pool.blocks[i].block_hash is not None for i in table] == [True, True, False]
    req.all_token_ids += [10, 11]
    m.cache_blocks(req, 11)  # still partial
    assert len(m.pool.cached_blocks) == 2
    m.cache_blocks(req, 12)  # incremental: the third block now
    assert len(m.pool.cached_blocks) == 3 and len(m.block_hashes("r")) == 3


def test_placeholder_ids_are_never_hashed() -> None:
    m = KVCacheManager(num_blocks=8, block_size=2)
    req = running(m, "r", 4, [1, 2, 3, -1])
    m.cache_blocks(req, 4)
    assert len(m.pool.cached_blocks) == 1


def test_same_prefix_reuses_blocks_and_divergent_suffix_gets_new_ones() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    prefix = [5, 6, 7, 8, 1, 2, 3, 4]
    a = running(m, "a", 12, prefix + [0, 0, 0, 0])
    m.cache_blocks(a, 12)
    b = make_request("b", prefix + [9, 9, 9, 9, 9])
    hits, n_hit = m.get_computed_blocks(b)
    assert hits == m.get_block_ids("a")[:2] and n_hit == 8
    new = m.allocate_slots(b, b.num_tokens - n_hit, 0, hits, n_hit)
    assert new is not None and len(new) == 2 and not set(new) & set(m.get_block_ids("a"))
    assert [m.pool.blocks[i].ref_cnt for i in hits] == [2, 2]
    m.free(b)
    assert [m.pool.blocks[i].ref_cnt for i in hits] == [1, 1]
    m.free(a)
    assert m.num_free_blocks == 16


def test_whole_prompt_hit_leaves_one_token_to_compute() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = running(m, "a", 8, list(range(8)))
    m.cache_blocks(a, 8)
    same = make_request("same", list(range(8)))
    hits, n_hit = m.get_computed_blocks(same)
    assert n_hit == 4 and hits == m.get_block_ids("a")[:1]  # the last block's hit is dropped
    longer = make_request("longer", list(range(9)))
    hits, n_hit = m.get_computed_blocks(longer)
    assert n_hit == 8 and len(hits) == 2


def test_concurrent_duplicate_keeps_first_mapping() -> None:
    m = KVCacheManager(num_blocks=8, block_size=2)
    a = running(m, "a", 4, [1, 2, 3, 4])
    b = running(m, "b", 4, [1, 2, 3, 4])
    m.cache_blocks(a, 4)
    m.cache_blocks(b, 4)
    assert {h: blk.block_id for h, blk in m.pool.cached_blocks.items()} == dict(
        zip(m.block_hashes("a"), m.get_block_ids("a"), strict=True)
    )
    assert all(m.pool.blocks[i].block_hash is None for i in m.get_block_ids("b"))
    b.all_token_ids += [5, 6]  # b's later blocks chain off the content hash and register
    assert m.allocate_slots(b, 2) is not None
    b.num_computed_tokens = 6
    m.cache_blocks(b, 6)
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7])
    hits, _ = m.get_computed_blocks(c)
    assert hits == m.get_block_ids("a")[:2] + m.get_block_ids("b")[2:3]


def test_lru_eviction_order() -> None:
    m = KVCacheManager(num_blocks=6, block_size=2)
    a = running(m, "a", 4, [1, 1, 1, 2])  # blocks 0, 1
    b = running(m, "b", 4, [2, 2, 2, 3])  # blocks 2, 3
    m.cache_blocks(a, 4)
    m.cache_blocks(b, 4)
    m.free(a)  # least recently freed: a, and within a its tail block 1 first
    m.free(b)
    assert list(m.pool.free_queue) == [4, 5, 1, 0, 3, 2]
    order = []
    for i in range(6):
        new = m.allocate_slots(make_request(f"x{i}", [7]), 1)
        assert new is not None
        order += new
        # a block is evicted exactly when it is reallocated
        assert len(m.pool.cached_blocks) == 4 - max(0, i - 1)
    assert order == [4, 5, 1, 0, 3, 2]


def test_touched_cached_block_is_not_evictable() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    a = running(m, "a", 4, [1, 2, 3, 4])
    m.cache_blocks(a, 4)
    m.free(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    hits, n_hit = m.get_computed_blocks(b)
    assert m.allocate_slots(b, 1, 0, hits, n_hit) == [2]
    assert m.num_free_blocks == 1
    assert m.allocate_slots(make_request("x", [0]), 1) == [3]
    assert m.allocate_slots(make_request("y", [0]), 1) is None
    assert len(m.pool.cached_blocks) == 2  # the touched hits survived


def test_stale_hits_are_rejected() -> None:
    m = KVCacheManager(num_blocks=2, block_size=2)
    a = running(m, "a", 2, [1, 2])
    m.cache_blocks(a, 2)
    m.free(a)
    b = make_request("b", [1, 2, 3])
    hits, n_hit = m.get_computed_blocks(b)
    m.allocate_slots(make_request("x", [0]), 3)  # evicts the hit
    m.free_by_id("x")
    with pytest.raises(ValueError, match="stale"):
        m.allocate_slots(b, 1, 0, hits, n_hit)


def test_stats_count_queries_and_hits() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    assert m.get_computed_blocks(a) == ([], 0)
    m.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    m.cache_blocks(a, 9)
    assert m.prefix_cache_stats == PrefixCacheStats()  # a lookup alone counts nothing
    b = make_request("b", list(range(10)))
    hits, n_hit = m.get_computed_blocks(b)
    m.record_prefix_cache_query(a.num_tokens, 0)
    m.record_prefix_cache_query(b.num_tokens, n_hit)
    assert m.prefix_cache_stats == PrefixCacheStats(queries=19, hits=8, resets=0)
    taken = m.take_prefix_cache_stats()
    assert taken.hits == 8 and m.prefix_cache_stats == PrefixCacheStats()


def test_free_is_idempotent_and_unknown_ids_are_noops() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = running(m, "a", 5)
    m.free(a)
    m.free(a)
    m.free_by_id("never-seen")
    assert m.num_free_blocks == 4 and m.get_block_ids("a") == []


def test_reset_prefix_cache() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    a = running(m, "a", 4, [1, 2, 3, 4])
    m.cache_blocks(a, 4)
    assert not m.reset_prefix_cache()
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert m.prefix_cache_stats.resets == 1


def test_prefix_caching_off() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = running(m, "a", 4, [1, 2, 3, 4])
    m.cache_blocks(a, 4)
    assert not m.pool.cached_blocks
    assert m.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_num_blocks_for_bytes() -> None:
    assert num_blocks_for_bytes(10 * 1024, 1024) == 10
    assert num_blocks_for_bytes(1024 + 5, 1024) == 1
    with pytest.raises(ConfigError, match="holds no block"):
        num_blocks_for_bytes(1023, 1024)
    with pytest.raises(ConfigError):
        num_blocks_for_bytes(1024, 0)


def test_bad_geometry_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=0, block_size=16)
    with pytest.raises(ConfigError):
        KVCacheManager(num_blocks=4, block_size=0)


def _admit(m: KVCacheManager, request: Request) -> int:
    """Looks the request up and allocates its prompt (with its hits), as the scheduler admits it."""
    hits, n_hit = m.get_computed_blocks(request)
    assert m.allocate_slots(request, request.num_tokens - n_hit, 0, hits, n_hit) is not None
    request.num_computed_tokens = n_hit
    return n_hit


def test_prompt_blocks_being_computed_are_pending_until_registered() -> None:
    """A admitted computes its prompt's blocks: B, with the same first 12 tokens, would hit 3 of them once A's step
    registers them; until then they are pending (B waits for them, SchedulerConfig.prefix_sharing_wait_tokens)."""
    m = KVCacheManager(num_blocks=32, block_size=4)
    shared = list(range(100, 112))
    a = make_request("a", shared + [1, 2, 3, 4, 5])
    assert _admit(m, a) == 0
    b = make_request("b", shared + [7, 7])
    hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 0 and m.num_pending_shared_tokens(b, n_hit) == 12
    # Its own pending blocks do not count, nor a prompt that diverges in the first block.
    assert m.num_pending_shared_tokens(a, 0) == 0
    other = make_request("other", [100, 101, 102, 0] + shared[4:])
    m.get_computed_blocks(other)
    assert m.num_pending_shared_tokens(other, 0) == 0
    # Two of A's blocks registered: B hits them and waits for the third only.
    m.cache_blocks(a, 8)
    hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 8 and m.num_pending_shared_tokens(b, n_hit) == 4
    m.cache_blocks(a, a.num_tokens)
    hits, n_hit = m.get_computed_blocks(b)
    assert n_hit == 12 and m.num_pending_shared_tokens(b, n_hit) == 0
    assert not m._pending_blocks


def test_pending_blocks_of_a_freed_request_are_forgotten() -> None:
    """A preempted or aborted request never registers its blocks: nothing may wait for them."""
    m = KVCacheManager(num_blocks=32, block_size=4)
    a = make_request("a", list(range(20)))
    _admit(m, a)
    m.cache_blocks(a, 4)
    b = make_request("b", list(range(20)) + [9])
    _, n_hit = m.get_computed_blocks(b)
    assert (n_hit, m.num_pending_shared_tokens(b, n_hit)) == (4, 12)
    m.free(a)
    assert m.num_pending_shared_tokens(b, n_hit) == 0 and not m._pending_blocks
    # B, admitted now, computes them: they are B's pending blocks.
    assert _admit(m, b) == 4
    c = make_request("c", list(range(20)))
    _, n_hit = m.get_computed_blocks(c)
    assert (n_hit, m.num_pending_shared_tokens(c, n_hit)) == (4, 12)
