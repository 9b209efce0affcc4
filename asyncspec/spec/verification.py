"""The target's distribution at every draft position, exactly as sampling without speculation sees it.

Position j of a request's verification run comes after its j first drafts: penalties count those
drafts as generated tokens, and `min_tokens` blocks stop tokens by the same count, so an accepted
run is what one-token-per-step decoding would have produced. A greedy row's distribution is the one-hot of
the plain sampler's argmax of its (penalised) logits: the argmax of their softmax could differ where two
logits round to one probability (bf16 ties), and greedy speculation must emit what greedy decoding does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncspec.layers.sampler import (
    SamplingMetadata,
    apply_blocked_tokens,
    apply_penalties,
    greedy_sample,
    output_counts_from_ids,
    process_logits,
    prompt_mask_from_ids,
)
from asyncspec.sampling_params import SAMPLING_EPS


def greedy_target_probs(logits: Tensor) -> Tensor:
    """[N, V] logits -> [N, V] float32: one-hot of `greedy_sample`'s token (the first of equal maxima); a row with
    no valid token (NaN logits, or all -inf) is NaN, which the rejection sampler never accepts or emits."""
    tokens = greedy_sample(logits).unsqueeze(1)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # the one [N, V] it adds
    probs.scatter_(1, tokens.clamp_min(0), 1.0)
    return probs.masked_fill_(tokens < 0, float("nan"))


def _set_greedy_rows(probs: Tensor, logits: Tensor, greedy_rows: Tensor) -> None:
    """Overwrites, in place, the rows of `probs` that `greedy_rows` [N, 1] marks with `greedy_target_probs` of their
    logits, without a mask over the rows on the host (no sync) and without another [N, V] tensor."""
    tokens = greedy_sample(logits).unsqueeze(1)
    at = tokens.clamp_min(0)
    kept = probs.gather(1, at)  # the other rows get their own value back
    probs.masked_fill_(greedy_rows, 0.0)
    probs.scatter_(1, at, torch.where(greedy_rows, torch.ones_like(kept), kept))
    probs.masked_fill_(greedy_rows & (tokens < 0), float("nan"))


def expand_rows(metadata: SamplingMetadata, positions: int) -> SamplingMetadata:
    """The per-request metadata repeated for `positions` consecutive rows per request (no
    penalties or blocked ids: the caller applies those per position)."""

    def rep(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.repeat_interleave(positions, dim=0)

    return SamplingMetadata(
        temperature=rep(metadata.temperature),  # type: ignore[arg-type]  # never None
        top_k=rep(metadata.top_k),
        top_p=rep(metadata.top_p),
        min_p=rep(metadata.min_p),
        generators={},
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        prompt_token_ids=None,
        output_token_ids=[],
        blocked_token_ids={},
        max_num_logprobs=None,
    )


def verification_probs(
    logits: Tensor,
    metadata: SamplingMetadata,
    draft_token_ids: Tensor,
    num_valid_drafts: Tensor,
    blocked_token_ids: dict[int, list[int]],
) -> Tensor:
    """Target probabilities [S, P, V] (float32) at P = K + 1 positions per request.

    logits: [S, P, V] raw target logits; metadata: one row per request (penalty tables included);
    draft_token_ids: [S, K]; num_valid_drafts: [S] (drafts past it never count as context);
    blocked_token_ids: flat row (s * P + j) -> ids forbidden at that position.
    """
    num_rows, num_positions, vocab_size = logits.shape
    flat = torch.empty((num_rows * num_positions, vocab_size), dtype=torch.float32, device=logits.device)
    flat.copy_(logits.reshape(num_rows * num_positions, vocab_size))
    if blocked_token_ids:
        apply_blocked_tokens(flat, blocked_token_ids)
    if metadata.presence_penalty is not None:
        assert metadata.frequency_penalty is not None and metadata.repetition_penalty is not None
        # The engine's metadata holds device tables; metadata built from id lists (SamplingMetadata.from_params) gets
        # the same tables built from them.
        base = metadata.output_token_counts
        if base is None:
            base = output_counts_from_ids(metadata.output_token_ids, vocab_size, logits.device)
        counts = _counts_per_position(base, draft_token_ids, num_valid_drafts, num_positions)
        prompt_mask = metadata.prompt_token_mask
        if prompt_mask is None and metadata.prompt_token_ids is not None:
            prompt_mask = prompt_mask_from_ids(metadata.prompt_token_ids, vocab_size, logits.device)
        if prompt_mask is not None:
            prompt_mask = prompt_mask.repeat_interleave(num_positions, dim=0)
        flat = apply_penalties(
            flat,
            None,
            [],
            metadata.presence_penalty.repeat_interleave(num_positions),
            metadata.frequency_penalty.repeat_interleave(num_positions),
            metadata.repetition_penalty.repeat_interleave(num_positions),
            counts,
            prompt_mask,
        )
    if metadata.all_greedy:
        probs = greedy_target_probs(flat)
    else:
        expanded = expand_rows(metadata, num_positions)
        probs = process_logits(flat, expanded).softmax(dim=-1)
        if not metadata.all_random:
            _set_greedy_rows(probs, flat, (expanded.temperature < SAMPLING_EPS).unsqueeze(1))
    return probs.view(num_rows, num_positions, vocab_size)


def _counts_per_position(base: Tensor, drafts: Tensor, num_valid: Tensor, num_positions: int) -> Tensor:
    """[S * P, V] output-token counts at each position: the request's counts `base` [S, V] plus its earlier drafts."""
    num_rows, vocab_size = base.shape
    increments = torch.zeros((num_rows, num_positions, vocab_size), dtype=torch.float32, device=drafts.device)
    if num_positions > 1:
        k = num_positions - 1
        valid = torch.arange(k, device=drafts.device).unsqueeze(0) < num_valid.unsqueeze(1)
        # Position j + 1 sees draft j as generated (if it is valid).
        increments[:, 1:, :].scatter_(2, drafts[:, :k].unsqueeze(-1), valid.to(torch.float32).unsqueeze(-1))
        increments = increments.cumsum(dim=1)
    return (base.unsqueeze(1) + increments).reshape(num_rows * num_positions, vocab_size)
