"""The step's computed counts from the device (resolve_computed): the torch reference against a plain
loop, the Triton kernel against the reference (interpreted on the CPU in a child pytest, compiled on
a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from asyncspec.kernels.prepare_inputs import resolve_computed_ref

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
CASES = {"one": 1, "few": 5, "many": 70, "padded_bucket": 16}
NUM_PADDING = {"padded_bucket": 5}
"""Cases whose last requests are a graph bucket's padding: no tokens, row 0, which a real request has too."""


def make_case(num_reqs: int, seed: int, num_padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """meta [6, num_reqs + 2] (stale columns past the batch) over shuffled rows, a third of them
    admitted this step (host count authoritative), and the device's counts per buffer row; the last
    num_padding requests are padding, as the runner writes it (row, counts and flag 0)."""
    gen = torch.Generator().manual_seed(seed)
    meta = torch.randint(0, 500, (6, num_reqs + 2), generator=gen)
    meta[0, :num_reqs] = torch.randperm(num_reqs + 7, generator=gen)[:num_reqs]
    meta[2] = torch.randint(1, 6, (num_reqs + 2,), generator=gen)
    meta[4] = (torch.rand(num_reqs + 2, generator=gen) < 0.33).long()
    if num_padding:
        real = num_reqs - num_padding
        holder = (meta[0, :real] == 0).nonzero().flatten()
        if holder.numel():  # the rows of real requests stay distinct: swap row 0 to the first request
            meta[0, holder[0]] = meta[0, 0]
        meta[0, 0] = 0
        meta[0, real:num_reqs] = meta[1, real:num_reqs] = meta[2, real:num_reqs] = 0
        meta[4, real:num_reqs] = 0
    counts = torch.randint(0, 500, (num_reqs + 7,), generator=gen)
    return meta, counts


def loop_reference(meta: torch.Tensor, num_reqs: int, counts: torch.Tensor):
    meta, counts = meta.clone(), counts.clone()
    for i in range(num_reqs):
        if meta[2, i] == 0:  # padding
            continue
        row = int(meta[0, i])
        computed = int(meta[1, i]) if meta[4, i] else int(counts[row])
        meta[1, i] = computed
        counts[row] = computed + int(meta[2, i])
    return meta, counts


def run(fn, meta: torch.Tensor, num_reqs: int, counts: torch.Tensor, device: str = "cpu"):
    meta, counts = meta.clone().to(device), counts.clone().to(device)
    fn(meta, num_reqs, counts)
    return meta.cpu(), counts.cpu()


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_the_loop(name):
    meta, counts = make_case(CASES[name], 0, NUM_PADDING.get(name, 0))
    got, want = run(resolve_computed_ref, meta, CASES[name], counts), loop_reference(meta, CASES[name], counts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][:, CASES[name] :], meta[:, CASES[name] :])  # columns past the batch untouched
    real = CASES[name] - NUM_PADDING.get(name, 0)
    assert torch.equal(got[0][:, real:], meta[:, real:])  # padding untouched


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, len(CASES))


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 before triton is imported")
class TestInterpreted:
    @pytest.mark.parametrize("name", sorted(CASES))
    def test_triton_matches_reference(self, name):
        from asyncspec.kernels import prepare_inputs_triton

        assert isinstance(prepare_inputs_triton._resolve_computed_kernel, InterpretedFunction)
        meta, counts = make_case(CASES[name], 1, NUM_PADDING.get(name, 0))
        got = run(prepare_inputs_triton.resolve_computed, meta, CASES[name], counts)
        want = run(resolve_computed_ref, meta, CASES[name], counts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_triton_matches_reference(name):
    from asyncspec.kernels import prepare_inputs_triton

    meta, counts = make_case(CASES[name], 2, NUM_PADDING.get(name, 0))
    got = run(prepare_inputs_triton.resolve_computed, meta, CASES[name], counts, "cuda")
    want = run(resolve_computed_ref, meta, CASES[name], counts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
