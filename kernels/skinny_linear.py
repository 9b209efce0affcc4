"""Reference (pure torch) decode-shaped linear layer: y = x @ W^T (+ bias) for a few rows x, as nn.Linear."""

from __future__ import annotations

import torch

from asyncspec.kernels.silu_and_mul import silu_and_mul_ref


def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x.dtype.

    The contract the Triton kernel (`skinny_linear_triton.skinny_linear`) meets: the products are summed in fp32
    (the order of the sum is unspecified), the bias is added in fp32, and the fp32 result is rounded once to
    x.dtype (round to nearest even). x, weight and bias share one dtype (bf16, fp16 or fp32). `out`, if given,
    receives the result (and is returned). fp32 matmuls here must not use TF32: leave
    torch.backends.cuda.matmul.allow_tf32 off (its default) when comparing against this.
    """
    result = x.float() @ weight.float().t()
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


def skinny_linear_error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per-element bound [M, N] (fp32) on |result - skinny_linear_ref(x, weight, bias)| for any fp32 summation
    order: two fp32 sums of the same K (+ 1) terms differ by at most 2 K u S (u = 2^-24, S = sum of |terms|), and
    rounding both to x.dtype adds at most one ulp, eps(dtype) |value|. Deliberately worst-case: callers that want
    to see a single wrong term should also count how many elements differ from the reference."""
    terms = x.float().abs() @ weight.float().abs().t()
    if bias is not None:
        terms = terms + bias.float().abs()
    exact = x.float() @ weight.float().t() + (0.0 if bias is None else bias.float())
    sum_error = 2 * (x.shape[1] + 1) * 2.0**-24 * terms
    tiny = torch.finfo(x.dtype).tiny
    return torch.finfo(x.dtype).eps * (exact.abs() + sum_error) + sum_error + tiny


def skinny_linear_gated_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The MLP's gate|up projection and its activation: silu_and_mul_ref(skinny_linear_ref(x, weight, bias)).

    weight is [2 * I, K] (gate rows then up rows); the projection is rounded to x.dtype once, as the unfused
    layer writes it, before the activation's two roundings. Returns [M, I].
    """
    return silu_and_mul_ref(skinny_linear_ref(x, weight, bias), out=out)
