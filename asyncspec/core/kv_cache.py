"""KVCacheManager: per-request block tables, exact slot allocation and the prefix cache.

The scheduler asks for slots every step for every running request, so the common decode
call (no new block needed) is a dict lookup and a little arithmetic. Hashing happens once
per full committed block per request, never per step.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from asyncspec.core.block_pool import BlockPool, KVCacheBlock
from asyncspec.errors import ConfigError

# Parent "hash" of a request's first block. Versioned so a format change never matches old hashes.
ROOT_BLOCK_HASH: bytes = hashlib.sha256(b"asyncspec-prefix-cache-v1").digest()


class RequestLike(Protocol):
    """The fields of `asyncspec.request.Request` the manager reads (it never writes them)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last `take_prefix_cache_stats()`."""

    queries: int = 0
    """Tokens looked up (whole request length per lookup)."""
    hits: int = 0
    """Tokens served from the cache."""
    resets: int = 0
    """Successful `reset_prefix_cache()` calls."""


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained, collision-resistant hash of one full block: sha256(parent || int64 tokens)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def num_blocks_for_bytes(kv_cache_bytes: int, bytes_per_block: int) -> int:
    """How many KV blocks fit in `kv_cache_bytes`; ConfigError if not even one."""
    if bytes_per_block <= 0:
        raise ConfigError(f"bytes_per_block must be positive, got {bytes_per_block}")
    num_blocks = kv_cache_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"the KV cache budget of {kv_cache_bytes} bytes holds no block of "
            f"{bytes_per_block} bytes; raise the memory fraction, lower block_size, "
            f"or set num_kv_blocks explicitly"
        )
    return num_blocks


class KVCacheManager:
    """Maps requests to blocks of `block_size` token slots; owns all per-request KV state."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._req_blocks: dict[str, list[int]] = {}
        """request_id -> block table (block ids, in token order)."""
        self._req_hashes: dict[str, list[bytes]] = {}
        """request_id -> chained hashes of its leading full blocks (lookup or commit)."""
        self._req_num_cached: dict[str, int] = {}
        """request_id -> how many leading blocks cache_blocks() has already processed."""
        self._pending_blocks: dict[bytes, str] = {}
        """Hash -> the request computing that full prompt block into a block of its own: looked up at its
        admission, not registered yet (`num_pending_shared_tokens`)."""
        self.prefix_cache_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-free blocks included: they are evictable)."""
        return len(self.pool.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.pool.usage

    @property
    def block_ids_by_request(self) -> Mapping[str, list[int]]:
        """Every request's block table, read-only (the scheduler's hot loop reads a held table's size to skip
        `allocate_slots` when the blocks have room; only this manager writes them)."""
        return self._req_blocks

    @property
    def num_cached_blocks_by_request(self) -> Mapping[str, int]:
        """Per request, its leading blocks `cache_blocks` has processed, read-only (the scheduler's hot loop
        calls `cache_blocks` only once a request's committed tokens fill a block past them)."""
        return self._req_num_cached

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] for an unknown request)."""
        return list(self._req_blocks.get(request_id, ()))

    def block_hashes(self, request_id: str) -> list[bytes]:
        """A copy of the chained hashes computed so far for the request's leading full blocks."""
        return list(self._req_hashes.get(request_id, ()))

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the counters accumulated since the last call and start new ones (for metrics)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: RequestLike) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute.

        Meant for a request that holds no blocks yet (new or preempted), whose
        `all_token_ids` are all committed. Returns (block ids, number of hit tokens).
        """
        if not self.enable_prefix_caching:
            return [], 0
        num_tokens = request.num_tokens
        # At most num_tokens - 1 tokens may hit: the model must run one to produce logits.
        max_blocks = max(num_tokens - 1, 0) // self.block_size
        hashes = self._extend_hashes(request, max_blocks)
        cached = self.pool.cached_blocks
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            hit.append(block.block_id)
        return hit, len(hit) * self.block_size

    def num_pending_shared_tokens(self, request: RequestLike, num_hit_tokens: int) -> int:
        """Tokens right after the request's cached prefix (`num_hit_tokens`, from get_computed_blocks) whose
        blocks other requests are computing now, as part of their own prompts: the request would hit them once
        those are registered, a step or a few later."""
        pending = self._pending_blocks
        if not pending:
            return 0
        request_id = request.request_id
        hashes = self._req_hashes.get(request_id, ())
        end = min(len(hashes), max(request.num_tokens - 1, 0) // self.block_size)
        index = start = num_hit_tokens // self.block_size
        while index < end and pending.get(hashes[index], request_id) != request_id:
            index += 1
        return (index - start) * self.block_size

    def _mark_pending(self, request_id: str, start: int) -> None:
        """The request's looked-up prompt blocks from `start` on (none hit): it computes them now."""
        for block_hash in self._req_hashes.get(request_id, ())[start:]:
            self._pending_blocks.setdefault(block_hash, request_id)

    def _unmark_pending(self, request_id: str, hashes: Sequence[bytes]) -> None:
        pending = self._pending_blocks
        for block_hash in hashes:
            if pending.get(block_hash) == request_id:
                del pending[block_hash]

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counts one admitted lookup (the scheduler calls this once per admission, not per retry)."""
        self.prefix_cache_stats.queries += num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    def cache_blocks(self, request: RequestLike, num_committed_tokens: int) -> None:
        """Register the request's full blocks of committed tokens not yet registered.

        Only `all_token_ids[:num_committed_tokens]` is read, and only whole blocks of it:
        partial blocks and uncommitted (draft / placeholder) tokens never get a hash.
        """
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        block_ids = self._req_blocks.get(request_id)
        if not block_ids:
            return
        num_full = min(num_committed_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(block_ids))
        done = self._req_num_cached.get(request_id, 0)
        if num_full <= done:
            return
        hashes = self._extend_hashes(request, num_full)
        # _extend_hashes stops at a block holding a negative (placeholder) id.
        num_full = min(num_full, len(hashes))
        blocks = self.pool.blocks
        for i in range(done, num_full):
            # A False return (hash already owned by another block) leaves this block
            # unhashed; later blocks still chain off the content hash, so they can register.
            self.pool.cache_block(blocks[block_ids[i]], hashes[i])
        if self._pending_blocks:
            self._unmark_pending(request_id, hashes[done:num_full])
        self._req_num_cached[request_id] = max(done, num_full)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible (True) when no block is held by a request."""
        if not self.pool.reset_prefix_cache():
            return False
        self._req_num_cached.clear()
        self.prefix_cache_stats.resets += 1
        return True

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: list[int] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Reserve slots for `num_new_tokens` (+ lookahead draft slots) after the computed ones.

        Returns the ids of the blocks appended by this call (prefix-hit blocks excluded), or
        None when the pool cannot supply them, in which case nothing at all has changed.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(
                f"negative token count: new={num_new_tokens} lookahead={num_lookahead_tokens} "
                f"new_computed={num_new_computed_tokens}"
            )
        request_id = request.request_id
        block_ids = self._req_blocks.get(request_id)
        num_held = len(block_ids) if block_ids is not None else 0
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        pool = self.pool
        if not new_computed_blocks:
            # Hot path: a decode step; usually the last block still has room.
            deficit = -(-total // self.block_size) - num_held
            if deficit <= 0:
                if block_ids is None:
                    self._req_blocks[request_id] = []
                return []
            if deficit > len(pool.free_queue):
                return None
            new_ids = [b.block_id for b in pool.get_new_blocks(deficit)]
            if block_ids is None:
                self._req_blocks[request_id] = list(new_ids)
                self._mark_pending(request_id, 0)  # a first allocation: its prompt's blocks, computed from now
            else:
                block_ids.extend(new_ids)
            return new_ids
        return self._allocate_with_prefix(request, block_ids, total, new_computed_blocks, num_new_computed_tokens)

    def _allocate_with_prefix(
        self,
        request: RequestLike,
        block_ids: list[int] | None,
        total: int,
        new_computed_blocks: list[int],
        num_new_computed_tokens: int,
    ) -> list[int] | None:
        """allocate_slots for a first schedule with prefix hits (rare path: validates more)."""
        request_id = request.request_id
        pool = self.pool
        if block_ids or request.num_computed_tokens != 0:
            raise ValueError(
                f"request {request_id!r}: prefix-hit blocks are only accepted before the "
                f"request holds any block or computed token"
            )
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"request {request_id!r}: num_new_computed_tokens={num_new_computed_tokens} "
                f"does not match {len(new_computed_blocks)} hit blocks of {self.block_size}"
            )
        hashes = self._req_hashes.get(request_id, ())
        computed: list[KVCacheBlock] = []
        num_touch_free = 0
        for i, block_id in enumerate(new_computed_blocks):
            block = pool.blocks[block_id]
            # A hit evicted since get_computed_blocks() would silently serve foreign K/V.
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise ValueError(
                    f"request {request_id!r}: prefix-hit block {block_id} is stale; call "
                    f"get_computed_blocks() right before allocate_slots()"
                )
            computed.append(block)
            num_touch_free += block.ref_cnt == 0
        deficit = max(-(-total // self.block_size) - len(computed), 0)
        # Touching a free hit block takes it out of the free queue, so it costs capacity too.
        if deficit + num_touch_free > len(pool.free_queue):
            return None
        pool.touch(computed)  # before allocating, so the pops below cannot evict the hits
        new_blocks = pool.get_new_blocks(deficit)
        new_ids = [b.block_id for b in new_blocks]
        self._req_blocks[request_id] = list(new_computed_blocks) + new_ids
        # The hit blocks are registered already; cache_blocks() starts after them.
        self._req_num_cached[request_id] = len(computed)
        self._mark_pending(request_id, len(computed))
        return new_ids

    def free(self, request: RequestLike) -> None:
        """Release the request's blocks and forget its state. Unknown ids are a no-op."""
        self.free_by_id(request.request_id)

    def free_by_id(self, request_id: str) -> None:
        """`free` for callers that only hold the id (aborts)."""
        hashes = self._req_hashes.pop(request_id, None)
        num_cached = self._req_num_cached.pop(request_id, 0)
        if hashes and self._pending_blocks:
            self._unmark_pending(request_id, hashes[num_cached:])
        block_ids = self._req_blocks.pop(request_id, None)
        if block_ids:
            blocks = self.pool.blocks
            # Reverse order: the request's tail blocks are evicted before its shared prefix.
            self.pool.free_blocks([blocks[i] for i in reversed(block_ids)])

    # ------------------------------------------------------------------ internals
    def _extend_hashes(self, request: RequestLike, num_blocks: int) -> list[bytes]:
        """The request's chained hashes for (at least up to) its first `num_blocks` full blocks.

        Stops early at a block containing a negative id: placeholders are never hashed.
        """
        hashes = self._req_hashes.get(request.request_id)
        if hashes is None:
            hashes = self._req_hashes[request.request_id] = []
        bs = self.block_size
        token_ids = request.all_token_ids
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        for i in range(len(hashes), num_blocks):
            block_tokens = token_ids[i * bs : (i + 1) * bs]
            if len(block_tokens) < bs or min(block_tokens) < 0:
                break
            parent = hash_block_tokens(parent, block_tokens)
            hashes.append(parent)
        return hashes
