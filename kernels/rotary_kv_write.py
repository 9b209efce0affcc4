"""Reference (pure torch) rotary embedding fused with the paged KV-cache write.

The numbers are exactly those of the model's separate ops (asyncspec/layers/rotary.py and the KV write):
cos/sin gathered from the fp32 caches at the step's positions and cast to the activation dtype, q and k rotated
with Hugging Face's rotate_half operation order, then k_rot and v written to the caches at slot_mapping.
"""

from __future__ import annotations

import torch

from asyncspec.kernels.kv_cache_write import write_kv_cache_ref


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, D // 2] in x.dtype: HF's `x * cos + rotate_half(x) * sin`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    # The op order decides the bf16/fp16 roundings: each product rounded, then their sum rounded.
    return torch.cat((x1 * c + (-x2) * s, x2 * c + x1 * s), dim=-1)


def rotary_kv_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k by RoPE at `positions`, write k_rot and v into the paged caches; returns q_rot.

    q [T, H, D], k/v [T, KVH, D] (one activation dtype; strided views are fine), positions [T] int,
    cos_cache/sin_cache [max_position, D // 2] fp32 (cast to q.dtype after the gather, as the model does),
    k_cache/v_cache [NB, BS, KVH, D], slot_mapping [>= T] flat slots with -1 (any slot < 0) never written.
    q_rot is written into `q_out` when given (it may be q itself: in place), else into a new tensor.
    """
    cos = cos_cache[positions].to(q.dtype)
    sin = sin_cache[positions].to(q.dtype)
    q_rot = rotate_ref(q, cos, sin)
    write_kv_cache_ref(rotate_ref(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return q_rot if q_out is None else q_out.copy_(q_rot)
