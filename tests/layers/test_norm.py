"""RMSNorm's residual path under tensor parallelism: its input is a rank's partial sum, reduced by the
group's fused all-reduce + add + norm where that takes the call, else by all_reduce and then the norm.
A fake group of two ranks whose peer's part is known stands in for the collectives."""

from __future__ import annotations

import torch

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.layers.norm import RMSNorm
from asyncspec.layers.tensor_parallel import TensorParallel

HIDDEN = 64


def _norm() -> RMSNorm:
    norm = RMSNorm(HIDDEN, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, HIDDEN))
    return norm


def test_the_fused_op_takes_the_call_when_it_can() -> None:
    peer = torch.randn(3, HIDDEN)
    calls = []

    def fused(x, residual, weight, eps):
        calls.append(x.shape)
        return fused_add_rms_norm_ref(x + peer, residual, weight, eps)

    tp = TensorParallel(0, 2, small_all_reduce=lambda x: None, small_all_reduce_add_rms_norm=fused)
    x, residual = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    norm = _norm()
    got = norm.forward_residual(x, residual, tp)
    expected = norm.forward_residual(x + peer, residual)
    assert calls == [(3, HIDDEN)]
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_without_the_fused_op_it_all_reduces_then_normalises() -> None:
    peer = torch.randn(2, HIDDEN)
    reduced = []

    def small(x):
        reduced.append(x.shape)
        return x + peer

    norm = _norm()
    x, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    # A fused op that declines the call (a message too large, say), and no fused op at all.
    for fused in (lambda *args: None, None):
        reduced.clear()
        tp = TensorParallel(0, 2, small_all_reduce=small, small_all_reduce_add_rms_norm=fused)
        got = norm.forward_residual(x, residual, tp)
        expected = norm.forward_residual(x + peer, residual)
        assert reduced == [(2, HIDDEN)]
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # No residual (never the case after a projection, but defined): reduced, then normalised.
    reduced.clear()
    got = norm.forward_residual(x, None, TensorParallel(0, 2, small_all_reduce=small))
    assert reduced == [(2, HIDDEN)] and torch.equal(got[1], x + peer)


def test_one_rank_reduces_nothing() -> None:
    def fail(*args):
        raise AssertionError("a group of one has no collective")

    norm = _norm()
    x, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    tp = TensorParallel(0, 1, small_all_reduce=fail, small_all_reduce_add_rms_norm=fail)
    got = norm.forward_residual(x, residual, tp)
    expected = norm.forward_residual(x, residual)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
