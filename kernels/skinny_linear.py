"""Reference (pure torch) decode-shaped linear layer: y = x @ W^T (+ bias) for a few rows x, as nn.Linear."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncspec.kernels.silu_and_mul import silu_and_mul_ref


@dataclass(frozen=True)
class FoldedNorm:
    """A residual add + RMSNorm folded into the projections around it: the row-parallel projection before it
    adds the residual and weights the sum (`skinny_linear_add_norm`), and the projection after it scales its own
    sums by each row's RMS factor (`row_scale=`). RMSNorm(h) @ W^T = rsqrt(mean(h^2) + eps) * ((h * w) @ W^T)
    row by row, so no kernel of its own runs between them."""

    x_weighted: torch.Tensor
    """[M, H] h * norm weight, rounded to h's dtype: the next projection's x."""
    sum_squares: torch.Tensor
    """[M, B] fp32 sums of h^2 over B column blocks of h (B = 1: the whole row); a row's mean is their sum / H."""
    eps: float
    """The norm's epsilon."""

    def row_factors(self) -> torch.Tensor:
        """[M] fp32: rsqrt(mean(h^2) + eps), the factor each row's sums are scaled by."""
        hidden = self.x_weighted.shape[1]
        return torch.rsqrt(self.sum_squares.sum(dim=1) / hidden + self.eps)


def skinny_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    row_scale: FoldedNorm | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x.dtype.

    The contract the Triton kernel (`skinny_linear_triton.skinny_linear`) meets: the products are summed in fp32
    (the order of the sum is unspecified), the bias is added in fp32, and the fp32 result is rounded once to
    x.dtype (round to nearest even). x, weight and bias share one dtype (bf16, fp16 or fp32). `out`, if given,
    receives the result (and is returned). fp32 matmuls here must not use TF32: leave
    torch.backends.cuda.matmul.allow_tf32 off (its default) when comparing against this.

    With `row_scale` (x is then its x_weighted) each row's fp32 sum is multiplied by the row's factor before the
    bias: the projection of RMSNorm(h) with the norm folded in (`FoldedNorm`).
    """
    result = x.float() @ weight.float().t()
    if row_scale is not None:
        result = result * row_scale.row_factors()[:, None]
    if bias is not None:
        result = result + bias.float()
    result = result.to(x.dtype)
    return result if out is None else out.copy_(result)


def skinny_linear_silu_ref(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The MLP's down projection of its gate|up tensor: skinny_linear_ref(silu_and_mul_ref(x2), weight, bias).

    x2 is [M, 2 * K] (gate then up); the activation is rounded to x2.dtype exactly as `silu_and_mul_ref` does
    (silu rounded, then the product rounded again) before it enters the fp32 sum.
    """
    return skinny_linear_ref(silu_and_mul_ref(x2), weight, bias, out=out)


def skinny_linear_error_bound(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_scale: FoldedNorm | None = None
) -> torch.Tensor:
    """Per-element bound [M, N] (fp32) on |result - skinny_linear_ref(x, weight, bias)| for any fp32 summation
    order: two fp32 sums of the same K (+ 1) terms differ by at most 2 K u S (u = 2^-24, S = sum of |terms|), and
    rounding both to x.dtype adds at most one ulp, eps(dtype) |value|. Deliberately worst-case: callers that want
    to see a single wrong term should also count how many elements differ from the reference."""
    terms = x.float().abs() @ weight.float().abs().t()
    exact = x.float() @ weight.float().t()
    factor_error: torch.Tensor | float = 0.0
    if row_scale is not None:
        # The factor itself may differ by a few ulp (a GPU's rsqrt, the partials' order): 2^-20 relative.
        factors = row_scale.row_factors()[:, None]
        terms = terms * factors
        exact = exact * factors
        factor_error = exact.abs() * 2.0**-20
    if bias is not None:
        terms = terms + bias.float().abs()
    exact = exact + (0.0 if bias is None else bias.float())
    sum_error = 2 * (x.shape[1] + 1) * 2.0**-24 * terms + factor_error
    tiny = torch.finfo(x.dtype).tiny
    return torch.finfo(x.dtype).eps * (exact.abs() + sum_error) + sum_error + tiny


def skinny_linear_gated_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    row_scale: FoldedNorm | None = None,
) -> torch.Tensor:
    """The MLP's gate|up projection and its activation: silu_and_mul_ref(skinny_linear_ref(x, weight, bias)).

    weight is [2 * I, K] (gate rows then up rows); the projection is rounded to x.dtype once, as the unfused
    layer writes it, before the activation's two roundings. Returns [M, I].
    """
    return silu_and_mul_ref(skinny_linear_ref(x, weight, bias, row_scale=row_scale), out=out)


def skinny_linear_add_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> FoldedNorm:
    """The contract of `skinny_linear_add_norm`: y = skinny_linear_ref(x, weight, bias) rounded to the dtype, h =
    y + residual summed in fp32 and rounded (as `fused_add_rms_norm_ref` adds), written over `residual`;
    x_weighted = h * norm_weight rounded once; sum_squares [M, 1] the fp32 sums of h^2."""
    summed = (skinny_linear_ref(x, weight, bias).float() + residual.float()).to(x.dtype)
    residual.copy_(summed)
    h = summed.float()
    x_weighted = (h * norm_weight.float()).to(x.dtype)
    return FoldedNorm(x_weighted, h.pow(2).sum(dim=1, keepdim=True), eps)
