"""Reference (pure torch) greedy argmax of a batch of logits, computed exactly like the sampler's `greedy_sample`
(asyncspec/layers/sampler.py) always has."""

from __future__ import annotations

import torch


def greedy_argmax_ref(logits: torch.Tensor, invalid_id: int) -> torch.Tensor:
    """[N, V] logits -> [N] int64: the first index of each row's maximum, `invalid_id` for a row holding any NaN
    or whose maximum is -inf (every token masked).

    One max reduction gives both: torch's max propagates NaN, NaN > -inf is false, and among equal maxima it
    returns the first index (+0.0 and -0.0 are equal; +inf is a valid maximum). Any float dtype and any strides;
    an empty last dim raises as torch's max does.
    """
    values, ids = logits.max(dim=-1)
    return torch.where(values > float("-inf"), ids, invalid_id)


def greedy_argmax_into_tokens_ref(
    logits: torch.Tensor,
    invalid_id: int,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
) -> torch.Tensor:
    """greedy_argmax_ref(logits), and each row's token written into token_ids at (rows[i], cols[i]): clamped to 0
    (an invalid id never reaches the buffer as a placeholder), and not at all where cols[i] == 0 (a graph bucket's
    padding request, whose entry keeps the value already there). Returns the argmax, invalid ids included."""
    sampled = greedy_argmax_ref(logits, invalid_id)
    rows, cols = rows.to(torch.int64), cols.to(torch.int64)
    kept = token_ids[rows, cols]
    token_ids[rows, cols] = torch.where(cols > 0, sampled.clamp_min(0), kept)
    return sampled
