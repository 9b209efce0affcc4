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
        first = start // self.block_size
        self._mark(block_table, rows, first, np.where(end > start, (end - 1) // self.block_size + 1, first), False)

    def computed(self, block_table: np.ndarray, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        """The draft caught up on positions [start, end) of each row, every position before `start` holding its
        KV already (a catch-up pass that leaves some lag): the blocks it completed hold the draft's KV throughout."""
        self._mark(block_table, rows, start // self.block_size, end // self.block_size, True)

    def synced(self, block_table: np.ndarray, rows: np.ndarray, num_blocks: np.ndarray) -> None:
        """Each row's draft no longer lags: it holds every position its request computed and fills the rest in
        step with the target (a later skip clears what it misses), so all `num_blocks` blocks of the row hold the
        draft's KV, those given to it while it lagged included."""
        width = int(num_blocks.max(initial=0))
        if width:
            held = np.arange(width) < num_blocks[:, None]
            self.valid[block_table[rows, :width][held]] = True

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
        if span.max() <= 2:  # decode steps: one or two blocks a row, two scatters
            some = span > 0
            self.valid[block_table[rows[some], first[some]]] = value
            two = span == 2
            if two.any():
                self.valid[block_table[rows[two], first[two] + 1]] = value
            return
        for row, a, b in zip(rows.tolist(), first.tolist(), stop.tolist(), strict=True):
            if b > a:
                self.valid[block_table[row, a:b]] = value
