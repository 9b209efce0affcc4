"""BlockPool: LRU free queue, eviction of cached free blocks, touch, reset."""

from __future__ import annotations

import pytest

from asyncspec.core.block_pool import BlockPool, NoFreeBlocksError


def test_allocation_pops_from_head_in_id_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_over_allocation_raises_typed_error_and_changes_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


def test_freed_blocks_go_to_tail_in_given_order() -> None:
    pool = BlockPool(4, enable_caching=False)
    a = pool.get_new_blocks(2)  # 0, 1
    pool.free_blocks(reversed(a))
    assert list(pool.free_queue) == [2, 3, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 3, 1, 0]


def test_allocating_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b0,) = pool.get_new_blocks(1)
    assert pool.cache_block(b0, b"h0")
    pool.free_blocks([b0])
    assert pool.get_cached_block(b"h0") is b0  # still a hit while free
    pool.get_new_blocks(1)  # block 1: b0 survives
    assert pool.get_cached_block(b"h0") is b0
    (again,) = pool.get_new_blocks(1)
    assert again is b0 and b0.block_hash is None
    assert pool.get_cached_block(b"h0") is None


def test_touch_takes_block_out_of_free_queue() -> None:
    pool = BlockPool(3, enable_caching=True)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, b"h")
    pool.free_blocks([b0])
    pool.touch([b0])
    assert b0.ref_cnt == 1 and 0 not in pool.free_queue
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(1)
    pool.touch([b0])  # a second holder of a referenced block
    assert b0.ref_cnt == 2


def test_duplicate_hash_keeps_existing_mapping() -> None:
    pool = BlockPool(2, enable_caching=True)
    b0, b1 = pool.get_new_blocks(2)
    assert pool.cache_block(b0, b"h")
    assert not pool.cache_block(b1, b"h")
    assert b1.block_hash is None and pool.get_cached_block(b"h") is b0


def test_reset_only_when_nothing_is_referenced() -> None:
    pool = BlockPool(2, enable_caching=True)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_block(b0, b"h")
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is b0
    pool.free_blocks([b0])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"h") is None and b0.block_hash is None


def test_zero_blocks_rejected() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)
