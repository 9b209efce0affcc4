"""Shared checks of the streamed kernels' GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncspec.kernels.skinny_linear import skinny_linear_error_bound


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last place (bf16), element-wise."""
    ulp = torch.exp2(torch.floor(torch.log2(b.float().abs().clamp_min(2.0**-126))) - 7)
    return (a.float() - b.float()).abs() / ulp


def normed_candidates(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, ulps: int = 2
) -> list[torch.Tensor]:
    """The normalised row as `fused_add_rms_norm_ref` rounds it, with torch's rstd and with rstd moved by up to
    `ulps` fp32 ulps either way. A kernel that adds the squares in another order may land on a neighbour of torch's
    rstd, and that moves the elements near a bf16 rounding boundary by a whole ulp: a stage after the norm is then
    compared with the candidate it matches best, not failed for the sum's order."""
    summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    h = summed.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    candidates = []
    for direction in (float("inf"), float("-inf")):
        r = rstd
        for _ in range(ulps):
            r = torch.nextafter(r, torch.full_like(r, direction))
            candidates.append(weight * (h * r).to(x.dtype))
    return [weight * (h * rstd).to(x.dtype), *candidates]


def gated_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-element bound [M, I] on how far `skinny_linear_gated_ref(x, weight)` may move when the projection's fp32
    sums run in another order: each projection moves by at most `skinny_linear_error_bound` (its rounding
    included), silu's slope lies within [-0.1, 1.1], and two roundings of values that far apart land at most one
    ulp further apart each: silu's and the product's."""
    inter = weight.shape[0] // 2
    bound = skinny_linear_error_bound(x, weight)
    proj = x.float() @ weight.float().t()
    gate, up, gate_bound, up_bound = proj[:, :inter], proj[:, inter:], bound[:, :inter], bound[:, inter:]
    silu_high = F.silu(gate).abs() + 1.1 * gate_bound
    up_high = up.abs() + up_bound
    eps = torch.finfo(x.dtype).eps
    return 1.1 * gate_bound * up_high + silu_high * up_bound + 2 * eps * silu_high * up_high + torch.finfo(x.dtype).tiny


def assert_stage_within_an_ulp(
    got: torch.Tensor,
    candidates: list[torch.Tensor],
    stage: Callable[[torch.Tensor], torch.Tensor],
    order_bound: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """`got` is `stage` of one of the candidate inputs up to the fp32 sums' order: equal to it in all but 2 % of
    the elements (a skipped rounding would move far more), and each element that differs within one bf16 ulp, or
    within `order_bound` of that input: the worst case of another summation order, more than an ulp only where
    the sum cancels to a value much smaller than its terms (on an H100, 2 to 112 ulps in a few elements of 10^4)."""
    scored = [(c, stage(c)) for c in candidates]
    candidate, want = min(scored, key=lambda pair: float((pair[1] != got).float().mean()))
    apart = ulps_apart(got, want)
    beyond = (apart > 1.0) & ((got.float() - want.float()).abs() > order_bound(candidate))
    assert not beyond.any(), (apart[beyond], (got.float() - want.float()).abs()[beyond])
    assert (apart > 0).float().mean() < 0.02, (apart > 0).float().mean()
