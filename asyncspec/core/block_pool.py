"""BlockPool: the physical KV blocks, their free queue (an LRU) and the prefix-cache map.

Pure Python and O(1) per block: the scheduler calls into it for every running
request on every step, so nothing here scans all blocks except the explicit reset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from asyncspec.errors import AsyncSpecError


class NoFreeBlocksError(AsyncSpecError, RuntimeError):
    """More blocks were requested than the pool has free (a caller skipped the capacity check)."""


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical KV block: `block_size` token slots in every layer's cache."""

    block_id: int
    """Index of the block in the paged KV tensors."""
    ref_cnt: int = 0
    """Number of request block tables holding this block."""
    block_hash: bytes | None = None
    """Chained hash of the block's tokens while it is registered in the prefix cache."""


class BlockPool:
    """Owns every block. Free blocks (ref_cnt 0) sit in an LRU queue; the head is evicted first.

    A free block may still carry a hash: its K/V stay valid and a prefix hit can take it
    back ("touch") until an allocation pops it from the head and evicts the hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        # OrderedDict = doubly linked list in C: O(1) popleft, append and remove-from-middle.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        """block_hash -> the one block registered under it (referenced or free)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached or not."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the LRU head, evicting their hashes; each gets ref_cnt 1."""
        free_queue = self.free_queue
        if n > len(free_queue):
            raise NoFreeBlocksError(f"asked for {n} blocks, only {len(free_queue)} free")
        out: list[KVCacheBlock] = []
        for _ in range(n):
            _, block = free_queue.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; free ones leave the queue (no longer evictable)."""
        free_queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                del free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue tail in the given order.

        Callers pass a request's blocks in reverse, so its tail blocks (least likely to be
        shared) are nearer the head and evicted first.
        """
        free_queue = self.free_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than taken"
            if block.ref_cnt == 0:
                free_queue[block.block_id] = block

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register `block` under `block_hash`; False (block left unhashed) if the hash is taken.

        A taken hash means another request computed the same tokens concurrently; the
        existing mapping wins so that no map entry ever changes under a reader.
        """
        if block.block_hash is not None:
            assert block.block_hash == block_hash, "block re-registered under another hash"
            return True
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is referenced, else False (nothing done)."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        if self.cached_blocks.get(block_hash) is block:
            del self.cached_blocks[block_hash]
        block.block_hash = None
