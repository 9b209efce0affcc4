"""Reference (pure torch) computation of each token's flat KV-cache slot."""

from __future__ import annotations

import torch


def compute_slot_mapping_ref(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Slot of token t = block_tables[req(t), pos // block_size] * block_size + pos % block_size; padding gets -1.

    block_tables [R, M] int32, query_start_loc [R + 1] int32, positions [T_pad] int64 -> [T_pad] int64.
    Everything stays on the device: no host sync, so the step can be planned ahead.
    """
    num_tokens = positions.shape[0]
    num_reqs, max_blocks = block_tables.shape
    out = torch.full((num_tokens,), -1, dtype=torch.int64, device=positions.device)
    if num_reqs == 0 or num_tokens == 0:
        return out
    qsl = query_start_loc.to(torch.int64)
    t = torch.arange(num_tokens, device=positions.device)
    # Number of requests that end at or before t == index of the request owning t.
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    valid = t < qsl[-1]
    req = torch.where(valid, req, torch.zeros_like(req))
    pos = torch.where(valid, positions.to(torch.int64), torch.zeros_like(t))
    block_idx = pos // block_size
    block = block_tables.to(torch.int64)[req, block_idx.clamp(max=max_blocks - 1)]
    slots = block * block_size + pos % block_size
    return torch.where(valid, slots, out)
