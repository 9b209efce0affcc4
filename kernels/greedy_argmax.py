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
