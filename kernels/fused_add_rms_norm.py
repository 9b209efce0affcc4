"""Reference (pure torch) residual add fused with RMSNorm, computed exactly like asyncspec/layers/norm.py."""

from __future__ import annotations

import torch


def fused_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); with residual None the sum is x itself.

    x, residual [T, H] (same dtype: fp32, bf16 or fp16), weight [H]. The sum is taken in fp32 and stored in
    x.dtype; the norm is RMSNorm's: fp32 h * rsqrt(mean(h^2) + eps), cast to x.dtype, then times weight (so the
    output dtype is promote(weight, x), x.dtype when the weight was cast with the model). `out` /
    `residual_out`, if given, receive the results (and are returned); without `residual_out` and with
    residual None, x itself is returned as the sum.
    """
    if residual is None:
        summed = x
    else:
        summed = (x.to(torch.float32) + residual.to(torch.float32)).to(x.dtype)
    h = summed.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * h.to(x.dtype)
    if out is not None:
        normed = out.copy_(normed)
    if residual_out is not None:
        summed = residual_out.copy_(summed)
    return normed, summed
