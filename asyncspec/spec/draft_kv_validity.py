"""Which KV blocks hold the draft model's KV for every position in them.

The draft's KV shares the target's blocks. While speculation is off (k = 0) the draft is left alone and falls
behind (`RowState.draft_lag`), so a block can hold the target's KV without the draft's. The prefix cache only
knows the target: a request that hits such a block must have the draft recompute it, or its drafts would attend
to stale values (lower acceptance, never different output: the target verifies). The worker tells this table
what the draft skipped and what it computed; a hit's leading blocks that hold the draft's KV need no recompute.
Host-side only, and only kept with prefix caching on (without it no block outlives its request's lag).
"""

from __future__ import annotations

import numpy as np


class DraftKVValidity:
    """One flag per KV block: whether the draft's KV is there for every position the block holds."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.valid = np.zeros(num_blocks, dtype=bool)

    def allocated(self, block_ids: list[int], in_sync: bool) -> None:
        """Blocks newly given to a request: the draft fills them in step with the target while it does not lag
        (a later skip clears them); a reused block's old flag means nothing."""
        if block_ids:
            self.valid[block_ids] = in_sync

    def skipped(self, block_table: np.ndarray, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        """The target computed positions [start, end) of each row (its block-table row) without the draft."""
        self._mark(block_table, rows, start // self.block_size, (end - 1) // self.block_size + 1, False)

    def computed(
        self, block_table: np.ndarray, rows: np.ndarray, start: np.ndarray, end: np.ndarray, in_sync: bool
    ) -> None:
        """The draft caught up on positions [start, end) of each row, every position before `start` holding its
        KV already: the blocks it completed hold the draft's KV throughout. `in_sync`: no lag is left, so it
        fills the partly written block in step with the target from now on."""
        bs = self.block_size
        stop = -(-end // bs) if in_sync else end // bs
        self._mark(block_table, rows, start // bs, stop, True)

    def valid_prefix(self, block_ids: list[int], num_tokens: int) -> int:
        """How many of a request's first `num_tokens` positions (whole blocks of a prefix-cache hit) hold the
        draft's KV: up to its first block without it."""
        num_blocks = num_tokens // self.block_size
        flags = self.valid[block_ids[:num_blocks]]
        first_invalid = int(np.argmin(flags)) if not flags.all() else num_blocks
        return min(first_invalid * self.block_size, num_tokens)

    def _mark(self, block_table: np.ndarray, rows: np.ndarray, first: np.ndarray, stop: np.ndarray, value: bool):
        """Sets the flag of block columns [first, stop) of each row."""
        span = stop - first
        if not span.size or span.max() <= 0:
            return
        if span.max() == 1 and span.min() == 1:  # a decode step: one block a row, one scatter
            self.valid[block_table[rows, first]] = value
            return
        for row, a, b in zip(rows.tolist(), first.tolist(), stop.tolist(), strict=True):
            if b > a:
                self.valid[block_table[row, a:b]] = value
