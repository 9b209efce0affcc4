"""The streamed kernels' stage check on the CPU: it accepts another fp32 summation order, cancelling sums
included, and rejects a skipped rounding or a wrong element."""

from __future__ import annotations

import pytest
import torch

from asyncspec.kernels.silu_and_mul import silu_and_mul_ref
from asyncspec.kernels.skinny_linear import skinny_linear_error_bound, skinny_linear_gated_ref, skinny_linear_ref
from tests.kernels.streamed_checks import (
    assert_stage_within_an_ulp,
    gated_error_bound,
    normed_candidates,
    ulps_apart,
)

EPS = 1e-5
K = 2048
N = 512
CANCELLING_ROWS = 8


def _reordered(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T summed as a kernel might: fp32 partial sums of 256-wide chunks, added last chunk first."""
    partials = [x[:, c : c + 256].float() @ weight[:, c : c + 256].float().t() for c in range(0, K, 256)]
    total = torch.zeros_like(partials[0])
    for part in reversed(partials):
        total = total + part
    return total.to(x.dtype)


def _inputs(seed: int, cancelling: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    norm_weight = (1 + 0.1 * torch.randn(K, generator=gen)).to(torch.bfloat16)
    weight = (torch.randn(N, K, generator=gen) / K**0.5).to(torch.bfloat16)
    candidates = normed_candidates(x, residual, norm_weight, EPS)
    if cancelling:
        # A few rows nearly orthogonal to the normalised row: their sums cancel to values far below their terms.
        n = candidates[0].float()
        w = weight.float()[:CANCELLING_ROWS]
        w = w - (w @ n.t()) / (n @ n.t()) * n
        weight[:CANCELLING_ROWS] = w.to(torch.bfloat16)
    return x, residual, norm_weight, weight, candidates


@pytest.mark.parametrize("cancelling", [False, True])
def test_another_summation_order_passes(cancelling: bool) -> None:
    _, _, _, weight, candidates = _inputs(0, cancelling)
    got = _reordered(candidates[0], weight)
    assert_stage_within_an_ulp(
        got, candidates, lambda n: skinny_linear_ref(n, weight), lambda n: skinny_linear_error_bound(n, weight)
    )


@pytest.mark.parametrize("cancelling", [False, True])
def test_another_summation_order_passes_gated(cancelling: bool) -> None:
    _, _, _, weight, candidates = _inputs(3, cancelling)
    got = silu_and_mul_ref(_reordered(candidates[0], weight))
    assert_stage_within_an_ulp(
        got, candidates, lambda n: skinny_linear_gated_ref(n, weight), lambda n: gated_error_bound(n, weight)
    )


def test_a_cancelling_sum_may_move_several_ulps() -> None:
    """What the GPU showed (2 to 112 ulps in a few elements): the element whose sum cancels most, moved by half
    of what another order may move it, passes; the same move in an element that does not cancel fails."""
    _, _, _, weight, candidates = _inputs(1, cancelling=True)
    exact = candidates[0].float() @ weight.float().t()
    bound = skinny_linear_error_bound(candidates[0], weight)
    want = skinny_linear_ref(candidates[0], weight)
    cancels = int((bound / exact.abs()).argmax())
    got = want.clone()
    got[0, cancels] = (exact[0, cancels] + 0.5 * bound[0, cancels]).to(torch.bfloat16)
    assert ulps_apart(got, want)[0, cancels] > 1.0
    check = (lambda n: skinny_linear_ref(n, weight), lambda n: skinny_linear_error_bound(n, weight))
    assert_stage_within_an_ulp(got, candidates, *check)
    plain = int((bound / exact.abs()).argmin())
    got = want.clone()
    got[0, plain] = (exact[0, plain] * 1.1).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_stage_within_an_ulp(got, candidates, *check)


def test_a_neighbouring_rstd_passes() -> None:
    _, _, _, weight, candidates = _inputs(4, cancelling=False)
    got = skinny_linear_ref(candidates[2], weight)  # rstd two fp32 ulps up
    assert_stage_within_an_ulp(
        got, candidates, lambda n: skinny_linear_ref(n, weight), lambda n: skinny_linear_error_bound(n, weight)
    )


def test_a_skipped_rounding_fails() -> None:
    x, residual, norm_weight, weight, candidates = _inputs(5, cancelling=False)
    h = (x.float() + residual.float()).to(torch.bfloat16).float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    unrounded = (norm_weight.float() * h * rstd).to(torch.bfloat16)  # h * rstd never rounded to bf16
    got = skinny_linear_ref(unrounded, weight)
    with pytest.raises(AssertionError):
        assert_stage_within_an_ulp(
            got, candidates, lambda n: skinny_linear_ref(n, weight), lambda n: skinny_linear_error_bound(n, weight)
        )


def test_one_wrong_element_fails() -> None:
    _, _, _, weight, candidates = _inputs(6, cancelling=False)
    got = skinny_linear_ref(candidates[0], weight)
    got[0, int(got.abs().argmax())] *= -1  # a tile's sign or row mixed up
    with pytest.raises(AssertionError):
        assert_stage_within_an_ulp(
            got, candidates, lambda n: skinny_linear_ref(n, weight), lambda n: skinny_linear_error_bound(n, weight)
        )
