"""Shared checks of the streamed kernels' GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


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


def assert_stage_within_an_ulp(
    got: torch.Tensor, candidates: list[torch.Tensor], stage: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """`got` is `stage` of one of the candidate inputs up to the fp32 sums' order: at most one bf16 ulp apart, and
    in fewer than 2 % of the elements (a skipped rounding would move far more)."""
    best = min((ulps_apart(got, stage(c)) for c in candidates), key=lambda apart: float((apart > 0).float().mean()))
    assert best.max() <= 1.0 and (best > 0).float().mean() < 0.02, (best.max(), (best > 0).float().mean())
