"""Reference (pure torch) construction of a step's model inputs from per-request counts, on the device."""

from __future__ import annotations

import torch


def prepare_inputs_ref(
    meta: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    token_ids: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    capacity: torch.Tensor | None = None,
    resolve: tuple[int, torch.Tensor] | None = None,
) -> None:
    """Writes the first `num_tokens` inputs and the first `num_reqs` request entries; with `resolve` =
    (n, device_counts), `resolve_computed_ref(meta, n, device_counts)` first.

    meta [>=3, >=num_reqs] int64: row 0 the request's row in `token_ids`, row 1 its computed tokens,
    row 2 its scheduled tokens (0 for a padding request). token_ids [R, L] int64; block_tables
    [>=num_reqs, C] int32 (row i belongs to request i).

    Request i owns tokens [qsl[i], qsl[i + 1]) with qsl the cumulative scheduled counts; its token j
    sits at position num_computed + j, reads token_ids[row, position] and writes its KV at
    block_tables[i, position // block_size] * block_size + position % block_size;
    seq_lens[i] = num_computed + num_scheduled (0 for padding). Tokens past the last request's end
    are padding: slot -1 (never written), position 0, input id 0. With `capacity` (int64, an entry for
    every request with tokens),
    a token at a position >= its request's capacity writes nothing either (slot -1): a block-table
    column past a request's own blocks may name another request's block.
    """
    if resolve is not None:
        resolve_computed_ref(meta, *resolve)
    dev = token_ids.device
    num_sched = meta[2, :num_reqs]
    ends = torch.cumsum(num_sched, 0)
    query_start_loc[0] = 0
    query_start_loc[1 : num_reqs + 1] = ends.to(torch.int32)
    is_real = num_sched > 0
    seq_lens[:num_reqs] = torch.where(is_real, meta[1, :num_reqs] + num_sched, 0).to(torch.int32)
    t = torch.arange(num_tokens, device=dev)
    req = torch.searchsorted(ends, t, right=True)
    valid = req < num_reqs
    req = req.clamp_max(max(num_reqs - 1, 0))
    start = torch.where(req > 0, ends[(req - 1).clamp_min(0)], 0) if num_reqs else t
    pos = torch.where(valid, meta[1, req] + t - start, 0) if num_reqs else torch.zeros_like(t)
    rows = meta[0, req] if num_reqs else torch.zeros_like(t)
    ids = token_ids[rows, pos.clamp_max(token_ids.shape[1] - 1)]
    block_idx = (pos // block_size).clamp_max(block_tables.shape[1] - 1)
    block = block_tables[req, block_idx].to(torch.int64) if num_reqs else torch.zeros_like(t)
    input_ids[:num_tokens] = torch.where(valid, ids, 0)
    positions[:num_tokens] = pos
    if capacity is not None and num_reqs:
        # Padding requests have no tokens: capacity may cover only the real ones.
        valid = valid & (pos < capacity[req.clamp_max(capacity.shape[0] - 1)])
    slot_mapping[:num_tokens] = torch.where(valid, block * block_size + pos % block_size, -1)


def resolve_computed_ref(meta: torch.Tensor, num_reqs: int, device_counts: torch.Tensor) -> None:
    """Takes each request's computed count from the device, where the host's may be ahead of it.

    meta [>=5, >=num_reqs] int64 (rows as in `prepare_inputs_ref`, plus row 4: 1 where the host's count
    in row 1 is authoritative, for a request admitted this step); device_counts [R] int64 per buffer row,
    the rows of requests with tokens distinct. Writes meta[1, i] = the request's computed count (host's if
    flagged, else the device's) and device_counts[row] = that count + its scheduled tokens. A request with
    no scheduled tokens is padding (a graph bucket's tail, whose row may repeat a real one): it is left
    alone, so a graph can resolve its whole bucket.
    """
    if num_reqs == 0:
        return
    scheduled = meta[2, :num_reqs]
    real = (scheduled > 0).nonzero().squeeze(1)
    rows = meta[0, :num_reqs].index_select(0, real)
    host = meta[1, :num_reqs].index_select(0, real)
    computed = torch.where(meta[4, :num_reqs].index_select(0, real) != 0, host, device_counts.index_select(0, rows))
    meta[1, :num_reqs].index_copy_(0, real, computed)
    device_counts.index_copy_(0, rows, computed + scheduled.index_select(0, real))
