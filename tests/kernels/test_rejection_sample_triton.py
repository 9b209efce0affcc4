"""The Triton rejection sampler against its torch reference: bit-identical outputs on the same random inputs,
under TRITON_INTERPRET=1 on the CPU and compiled on a GPU (with no host-device sync).

Interpretation needs TRITON_INTERPRET=1 set before triton is imported (see tests/kernels/test_triton_kernels.py),
so `TestInterpreted` runs in-process only where that already holds, and otherwise in a child pytest started by
`test_interpreter_suite`. The shared cases and the chi-square machinery live in tests/spec/test_rejection_sampler.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from asyncspec.kernels.rejection_sample import rejection_sample_ref
from tests.spec.test_rejection_sampler import (
    bonus_after_rejection,
    check_equal,
    check_greedy_cases,
    check_invalid_rows,
    check_output_shape,
    check_stochastic_details,
    exponentials,
    lossless_pvalues,
    random_case,
    recover_from_target,
)

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
MIN_INTERPRETED_TESTS = 16


@pytest.fixture(scope="class")
def kernel():
    """rejection_sample_triton, checked to be running in the interpreter (not silently compiled)."""
    from asyncspec.kernels import rejection_sample_triton

    assert isinstance(rejection_sample_triton._rejection_sample_kernel, InterpretedFunction)
    return rejection_sample_triton.rejection_sample_triton


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, MIN_INTERPRETED_TESTS, ("ASYNCSPEC_REJECTION_BACKEND",))


def strided(case: dict) -> dict:
    """The same inputs as non-contiguous views (slices of larger tensors), int32 ids and int32 counts."""
    out = dict(case)
    p = case["target_probs"]
    big = torch.full((p.shape[0], p.shape[1] + 2, p.shape[2] + 3), float("nan"))
    big[:, 1:-1, 2:-1] = p
    out["target_probs"] = big[:, 1:-1, 2:-1]
    e = case["exponential"]
    out["exponential"] = torch.cat([e, e], 1)[:, : e.shape[1]]
    out["draft_token_ids"] = case["draft_token_ids"].to(torch.int32)
    out["num_draft_tokens"] = case["num_draft_tokens"].to(torch.int32)
    if case["draft_probs"] is not None:
        out["draft_probs"] = case["draft_probs"].transpose(0, 1).contiguous().transpose(0, 1)
    return out


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.mark.parametrize("k", [1, 4, 7])
    @pytest.mark.parametrize("vocab", [7, 100, 1000])
    def test_matches_reference(self, kernel, k: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(100 * k + vocab)
        for with_q in (True, False):
            n = int(torch.randint(8, 17, (), generator=gen))
            case = random_case(gen, n, k, vocab, with_q=with_q)
            got = kernel(**case)
            check_equal(got, rejection_sample_ref(**case))
            check_output_shape(*got, case)

    def test_no_drafts_and_empty_batch(self, kernel) -> None:
        gen = torch.Generator().manual_seed(1)
        case = random_case(gen, 6, 0, 11, edge=False)
        check_equal(kernel(**case), rejection_sample_ref(**case))
        case = random_case(gen, 0, 3, 11, edge=False)
        out, a = kernel(**case)
        assert out.shape == (0, 4) and a.shape == (0,)

    def test_strided_inputs(self, kernel) -> None:
        case = random_case(torch.Generator().manual_seed(2), 10, 4, 37)
        check_equal(kernel(**strided(case)), rejection_sample_ref(**case))

    def test_greedy_exact_cases(self, kernel) -> None:
        check_greedy_cases(kernel)

    def test_stochastic_details(self, kernel) -> None:
        check_stochastic_details(kernel)

    def test_invalid_rows(self, kernel) -> None:
        check_invalid_rows(kernel)

    def test_lossless_small(self, kernel) -> None:
        """The chi-square tests through the kernel at a size the interpreter affords; the deliberately
        wrong samplers fail the same tests at that size, so they still have power."""
        n = 500
        p_first, p_joint = lossless_pvalues(kernel, n, seed=7)
        assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)
        assert lossless_pvalues(recover_from_target, n, seed=7)[1] < 1e-6
        assert lossless_pvalues(bonus_after_rejection, n, seed=7)[1] < 1e-6

    def test_sampler_with_triton_backend(self, kernel, monkeypatch) -> None:
        from asyncspec.layers.sampler import make_generator
        from asyncspec.spec.rejection_sampler import BACKEND_ENV, RejectionSampler, draw_rejection_randomness

        monkeypatch.setenv(BACKEND_ENV, "triton")
        sampler = RejectionSampler("cpu")
        case = random_case(torch.Generator().manual_seed(3), 9, 3, 20)
        args = {k: v for k, v in case.items() if k not in ("uniform", "exponential")}
        got = sampler(**args, generators={4: make_generator(1, "cpu")}, default_generator=torch.Generator())
        u, e = draw_rejection_randomness(9, 3, 20, {4: make_generator(1, "cpu")}, torch.Generator(), "cpu")
        check_equal(got, rejection_sample_ref(**args, uniform=u, exponential=e))


# ----------------------------------------------------------------------------------------------- GPU


def _to(case: dict, device: str) -> dict:
    return {k: (v.to(device) if v is not None else None) for k, v in case.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("with_q", [True, False], ids=["draft-probs", "deterministic-draft"])
def test_gpu_matches_reference_without_sync(with_q: bool) -> None:
    from asyncspec.kernels.rejection_sample_triton import rejection_sample_triton
    from asyncspec.spec.rejection_sampler import RejectionSampler

    case = random_case(torch.Generator().manual_seed(64), 64, 8, 32000, with_q=with_q)
    expected = rejection_sample_ref(**case)
    cuda = _to(case, "cuda")
    args = {k: v for k, v in cuda.items() if k not in ("uniform", "exponential")}
    sampler = RejectionSampler("cuda")
    gens = {3: torch.Generator("cuda").manual_seed(3)}
    rejection_sample_triton(**cuda)  # compile outside the check
    sampler(**args, generators=gens, default_generator=None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = rejection_sample_triton(**cuda)
        ref_gpu = rejection_sample_ref(**cuda)
        sampled = sampler(**args, generators=gens, default_generator=None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    check_equal((got[0].cpu(), got[1].cpu()), expected)
    check_equal((ref_gpu[0].cpu(), ref_gpu[1].cpu()), expected)
    check_output_shape(sampled[0].cpu(), sampled[1].cpu(), case)


@pytest.mark.gpu
def test_gpu_lossless() -> None:
    from asyncspec.kernels.rejection_sample_triton import rejection_sample_triton

    def on_gpu(**case):
        out, a = rejection_sample_triton(**_to(case, "cuda"))
        return out.cpu(), a.cpu()

    p_first, p_joint = lossless_pvalues(on_gpu, 40_000, seed=7)
    assert p_first > 1e-3 and p_joint > 1e-3, (p_first, p_joint)


@pytest.mark.gpu
def test_gpu_greedy_and_invalid_rows() -> None:
    from asyncspec.kernels.rejection_sample_triton import rejection_sample_triton

    def on_gpu(**case):
        out, a = rejection_sample_triton(**_to(case, "cuda"))
        return out.cpu(), a.cpu()

    check_greedy_cases(on_gpu)
    check_stochastic_details(on_gpu)
    check_invalid_rows(on_gpu)
    gen = torch.Generator().manual_seed(5)
    for k, vocab in [(1, 7), (4, 100), (7, 1000), (0, 50), (3, 5000)]:
        case = random_case(gen, 16, k, vocab, with_q=vocab % 2 == 0)
        case["exponential"] = exponentials(gen, 16, vocab)
        check_equal(on_gpu(**case), rejection_sample_ref(**case))
