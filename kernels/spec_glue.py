"""Reference (pure torch) glue of a greedy speculative step: the index and bookkeeping work between the
verification's and the draft's big kernels. Eager torch spends one launch per op here (about 60 tiny kernels in a
k = 4 step, as many as the two models' layers); `spec_glue_triton` does each function in one launch.

Every function reads only device tensors and host-known sizes: no sync, so each can sit inside a CUDA graph.
Conventions shared by the callers (the runner's step meta, the speculative decoder's per-row buffers):
- `meta` rows: 0 the request's row in the token buffer, 1 its computed tokens before the step, 2 its scheduled
  tokens (0 for a padding request of a graph bucket), 5 its planned draft positions, 6 its writable KV slots.
- Padding requests come after the real ones and carry row 0 (shared with a real request): they never write
  another request's state.
"""

from __future__ import annotations

import torch
from torch import Tensor


def verify_gather_ref(
    hidden: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    meta: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
    num_reqs: int,
    query_len: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The inputs of a greedy verification over a padded batch of `num_reqs` requests of at most `query_len`
    tokens (the forward pass's `hidden` [T, H] over inputs with `query_start_loc` and `seq_lens`; the last
    meta[5] tokens of each are drafts).

    Returns (rows [num_reqs * query_len, H]: the hidden state of each request's last known token and of each
    of its draft positions, position j past the planned ones repeating the last; drafts [num_reqs, query_len - 1]:
    the drafts kept for its token-buffer row; num_valid [num_reqs]: the drafts really verified, at most the
    planned ones). A padding request reads the row before it (its verdict is never read)."""
    b, q = num_reqs, query_len
    real = seq_lens[:b] > 0
    planned = torch.where(real, meta[5, :b], 0)
    j = torch.arange(q, dtype=torch.int64, device=hidden.device)
    last_known = query_start_loc[1 : b + 1].to(torch.int64) - 1 - planned
    index = (last_known.unsqueeze(1) + torch.minimum(j, planned.unsqueeze(1))).clamp_min(0)
    rows = meta[0, :b]
    drafts = draft_token_ids.index_select(0, rows)[:, : q - 1]
    num_valid = torch.minimum(num_draft_tokens.index_select(0, rows), planned)
    return hidden.index_select(0, index.view(-1)), drafts, num_valid


def verify_commit_ref(
    output_token_ids: Tensor,
    num_accepted: Tensor,
    seq_lens: Tensor,
    meta: Tensor,
    token_ids: Tensor,
    num_computed: Tensor,
    num_reqs: int,
) -> Tensor:
    """A greedy verification's effects on the device's state: each real request's emitted run
    (`output_token_ids` [num_reqs, q]: accepted drafts, the target's token, then -1) goes into its token-buffer
    row at positions num_tokens + j (num_tokens = seq_len - planned), and its computed count loses the rejected
    positions (num_accepted - planned). Returns new_num_tokens [num_reqs]: num_tokens + num_accepted + 1."""
    b, q = num_reqs, output_token_ids.shape[1]
    real = seq_lens[:b] > 0
    planned = torch.where(real, meta[5, :b], 0)
    rows = meta[0, :b]
    j = torch.arange(q, dtype=torch.int64, device=output_token_ids.device)
    base = seq_lens[:b].to(torch.int64) - planned
    # Padding requests (row 0) write row 0's column 0 back to itself: a real request writes columns >= 1.
    cols = torch.where(real.unsqueeze(1), base.unsqueeze(1) + j, 0)
    grid = rows.unsqueeze(1).expand_as(cols)
    keep = (output_token_ids >= 0) & real.unsqueeze(1)
    token_ids[grid, cols] = torch.where(keep, output_token_ids, token_ids[grid, cols])
    num_computed.index_add_(0, rows, torch.where(real, num_accepted[:b] - planned, 0))
    return base + num_accepted[:b] + 1


def greedy_accept_ref(target_token_ids: Tensor, drafts: Tensor, num_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance from the target's own tokens: `target_token_ids` [B, q] is `greedy_sample` at each request's
    last known token and each draft position (-1 where a row had no valid token), `drafts` [B, >= q - 1] the drafts
    and `num_valid` [B] how many of them count. Draft j is accepted while j < num_valid and it equals the target's
    token there (a -1 matches nothing); the emitted run is the target's tokens up to and including the first position
    not accepted (where accepted, they equal the drafts), then -1. The same as `rejection_sample_ref`'s greedy rows
    over `greedy_target_probs` of the same logits, without the [B * q, V] one-hot. Returns (output_token_ids [B, q],
    num_accepted [B])."""
    b, q = target_token_ids.shape
    k = q - 1
    j = torch.arange(k, dtype=torch.int64, device=target_token_ids.device)
    target = target_token_ids.to(torch.int64)
    accept = (j < num_valid[:b].unsqueeze(1)) & (drafts[:b, :k] == target[:, :k]) & (target[:, :k] >= 0)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    emitted = torch.arange(q, dtype=torch.int64, device=target.device).unsqueeze(0) <= num_accepted.unsqueeze(1)
    return torch.where(emitted, target, -1), num_accepted


def greedy_accept_commit_ref(
    target_token_ids: Tensor,
    drafts: Tensor,
    num_valid: Tensor,
    seq_lens: Tensor,
    meta: Tensor,
    token_ids: Tensor,
    num_computed: Tensor,
    num_reqs: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`greedy_accept_ref`, then `verify_commit_ref` of its runs: (output_token_ids, num_accepted,
    new_num_tokens)."""
    out, num_accepted = greedy_accept_ref(target_token_ids, drafts, num_valid)
    new_num_tokens = verify_commit_ref(out, num_accepted, seq_lens, meta, token_ids, num_computed, num_reqs)
    return out, num_accepted, new_num_tokens


def record_drafts_ref(
    drafts: Tensor,
    meta: Tensor,
    num_tokens: Tensor,
    token_ids: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
) -> None:
    """The drafts [B, n] of a padded batch: each real request's go into its row of `draft_token_ids` (with
    num_draft_tokens = n) and into its token-buffer row at positions num_tokens + j. Padding requests write
    only into the spare last row of `draft_token_ids` / `num_draft_tokens` (its content is unspecified)."""
    b, n = drafts.shape
    rows = meta[0, :b]
    real = meta[2, :b] > 0
    spare = draft_token_ids.shape[0] - 1
    kept_rows = torch.where(real, rows, spare)
    draft_token_ids[:, :n].index_copy_(0, kept_rows, drafts)
    num_draft_tokens.index_fill_(0, kept_rows, n)
    j = torch.arange(n, dtype=torch.int64, device=drafts.device)
    cols = torch.where(real.unsqueeze(1), num_tokens[:b].unsqueeze(1) + j, 0)
    grid = rows.unsqueeze(1).expand_as(cols)
    token_ids[grid, cols] = torch.where(real.unsqueeze(1), drafts, token_ids[grid, cols])


def draft_step_meta_ref(
    step_meta: Tensor, block_tables: Tensor, draft_meta: Tensor, draft_block_tables: Tensor, num_reqs: int
) -> None:
    """The draft's catch-up meta after a greedy verification, from the target's step meta: rows 0 (row),
    1 (computed), 2 (scheduled + 1 for a real request: it also feeds its newest token; 0 for padding) and 3
    (writable slots, meta[6]); and the batch's block-table rows copied into the draft's inputs."""
    b = num_reqs
    scheduled = step_meta[2, :b]
    draft_meta[0, :b] = step_meta[0, :b]
    draft_meta[1, :b] = step_meta[1, :b]
    draft_meta[2, :b] = torch.where(scheduled > 0, scheduled + 1, 0)
    draft_meta[3, :b] = step_meta[6, :b]
    draft_block_tables[:b].copy_(block_tables[:b])


def draft_loop_start_ref(
    step_meta: Tensor,
    num_accepted: Tensor,
    hidden: Tensor,
    max_model_len: int,
    loop_hidden: Tensor,
    loop_position: Tensor,
    loop_capacity: Tensor,
    pass_meta: Tensor,
    num_reqs: int,
) -> None:
    """The greedy proposal loop's start after the draft's catch-up (`hidden` [T, H] over the catch-up layout of
    `draft_step_meta_ref`: each real request's scheduled tokens plus its newest): the hidden state of each
    request's newest token (after its committed tokens and its accepted drafts) into `loop_hidden`, that
    token's position into `loop_position`, its writable slots (below max_model_len - 1) into `loop_capacity`,
    and the passes' meta: row 0 the request's row, row 2 one token for a real request, none for padding."""
    b = num_reqs
    scheduled = step_meta[2, :b]
    real = scheduled > 0
    planned = torch.where(real, step_meta[5, :b], 0)
    lengths = torch.where(real, scheduled + 1, 0)
    committed = scheduled - planned
    accepted = num_accepted[:b]
    starts = torch.cumsum(lengths, dim=0) - lengths
    last_index = (starts + committed + accepted).clamp(0, hidden.shape[0] - 1)
    torch.index_select(hidden, 0, last_index, out=loop_hidden[:b])
    loop_position[:b] = step_meta[1, :b] + committed + accepted
    loop_capacity[:b] = step_meta[6, :b].clamp_max(max_model_len - 1)
    pass_meta[0, :b] = step_meta[0, :b]
    pass_meta[2, :b] = real.to(torch.int64)


def draft_pass_inputs_ref(
    tokens: Tensor,
    pass_index: int,
    loop_position: Tensor,
    pass_meta: Tensor,
    capacity: Tensor,
    block_tables: Tensor,
    block_size: int,
    max_model_len: int,
    input_ids: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    loop_tokens: Tensor,
) -> None:
    """Pass `pass_index` (>= 1) of the greedy proposal loop over B = len(tokens) requests, one token each: the
    inputs `prepare_inputs_ref` builds for meta [row, position, live] (live = pass_meta[2] > 0, the live requests
    first) with each request's token replaced by `tokens` (the previous pass's proposals), which also go into
    column pass_index - 1 of `loop_tokens`.

    Request i (token i) sits at position loop_position[i] + pass_index, capped at max_model_len - 1, and writes
    its KV at its block table's slot for it when that position is below capacity[i] (else slot -1). Padding
    requests have position 0, slot -1 and sequence length 0."""
    b = tokens.shape[0]
    live = pass_meta[2, :b] > 0
    pos = torch.where(live, (loop_position[:b] + pass_index).clamp_max(max_model_len - 1), 0)
    query_start_loc[:1].zero_()  # no host scalar: the reference may run inside a CUDA graph capture
    query_start_loc[1 : b + 1] = torch.cumsum(live.to(torch.int64), 0).to(torch.int32)
    seq_lens[:b] = torch.where(live, pos + 1, 0).to(torch.int32)
    block_idx = (pos // block_size).clamp_max(block_tables.shape[1] - 1)
    block = block_tables[:b].gather(1, block_idx.unsqueeze(1)).squeeze(1).to(torch.int64)
    input_ids[:b] = tokens
    positions[:b] = pos
    slot_mapping[:b] = torch.where(live & (pos < capacity[:b]), block * block_size + pos % block_size, -1)
    loop_tokens[:b, pass_index - 1] = tokens
