"""Per-step attention inputs, built by the model runner and read by every attention layer."""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass
class StaticInputs:
    """Input buffers at fixed addresses: graphs are captured over them, steps write into them."""

    input_ids: torch.Tensor
    """[max_tokens] int64."""
    positions: torch.Tensor
    """[max_tokens] int64."""
    slot_mapping: torch.Tensor
    """[max_tokens] int64; -1 for padding."""
    query_start_loc: torch.Tensor
    """[max_reqs + 1] int32."""
    seq_lens: torch.Tensor
    """[max_reqs] int32."""
    block_tables: torch.Tensor
    """[max_reqs, max_blocks_per_req] int32."""

    @classmethod
    def allocate(cls, max_reqs: int, max_tokens: int, max_blocks_per_req: int, device: torch.device) -> StaticInputs:
        return cls(
            input_ids=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            positions=torch.zeros(max_tokens, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.zeros(max_reqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_reqs, dtype=torch.int32, device=device),
            block_tables=torch.zeros((max_reqs, max_blocks_per_req), dtype=torch.int32, device=device),
        )

    def fill(
        self,
        prepare: Callable[..., None],
        meta: torch.Tensor,
        num_reqs: int,
        num_tokens: int,
        token_ids: torch.Tensor,
        block_size: int,
        capacity: torch.Tensor | None = None,
        resolve: tuple[int, torch.Tensor] | None = None,
    ) -> None:
        """Builds a step's inputs into these buffers with the backend's `prepare_inputs` (one kernel on
        a GPU): `meta` [row, computed, scheduled] per request (padding included), tokens from
        `token_ids`, slots from this object's block tables, `capacity` the optional writable-slot guard,
        `resolve` the optional (requests, device counts) whose computed counts the device's replace first."""
        prepare(
            meta,
            num_reqs,
            num_tokens,
            token_ids,
            self.block_tables,
            block_size,
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.query_start_loc,
            self.seq_lens,
            capacity,
            **({"resolve": resolve} if resolve is not None else {}),
        )

    def metadata(self, num_reqs: int, num_tokens: int, max_query_len: int, block_size: int) -> AttentionMetadata:
        """The first num_reqs requests and num_tokens tokens, with every block-table column."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_tables=self.block_tables[:num_reqs],
            max_query_len=max_query_len,
            max_seq_len=self.block_tables.shape[1] * block_size,
            block_size=block_size,
        )
