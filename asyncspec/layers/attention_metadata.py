"""Per-step attention inputs, built by the model runner and read by every attention layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one step's flattened batch of query tokens over the paged KV cache.

    Requests are laid out back to back: request ``b`` owns query tokens
    ``query_start_loc[b]:query_start_loc[b + 1]``. Its queries sit at the last
    positions of its sequence, so query ``i`` of a request with ``q_len`` queries is at
    position ``seq_lens[b] - q_len + i`` and attends causally to keys ``0..that``.
    """

    slot_mapping: torch.Tensor
    """[num_tokens] int64: flat cache slot of each token's K/V; -1 for padding (never written)."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: cumulative query token counts, starting at 0."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: KV length of each request after this step (computed + scheduled)."""
    block_tables: torch.Tensor
    """[num_reqs, max_blocks_per_req] int32: physical block ids; unused entries are 0."""
    max_query_len: int
    """Largest query length in the batch (host-side, for kernel launch sizes)."""
    max_seq_len: int
    """Largest seq_len in the batch (host-side)."""
    block_size: int
    """Tokens per KV block."""

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]
