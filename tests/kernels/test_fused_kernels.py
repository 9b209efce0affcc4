"""The fused residual-add + RMSNorm and SwiGLU kernels: the torch references against the model's current code
path (asyncspec/layers/norm.py's RMSNorm, asyncspec/models/llama.py's LlamaMLP) and the plain formulas, and the
Triton kernels against the references, under TRITON_INTERPRET=1 on the CPU and compiled on a GPU.

Interpretation needs TRITON_INTERPRET=1 set before triton is imported (see tests/kernels/test_triton_kernels.py),
so `TestInterpreted` runs in-process only where that already holds, and otherwise in a child pytest started by
`test_interpreter_suite`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.kernels.silu_and_mul import silu_and_mul_ref
from asyncspec.layers.norm import RMSNorm
from asyncspec.models.llama import LlamaMLP

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


def norm_inputs(
    gen: torch.Generator, t: int, h: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual and weight, scaled unlike each other so that a dropped term shows."""
    x = (torch.randn(t, h, generator=gen) * 0.5).to(device=device, dtype=dtype)
    residual = (torch.randn(t, h, generator=gen) * 3.0 + 0.25).to(device=device, dtype=dtype)
    weight = (torch.rand(h, generator=gen) * 1.5 + 0.25).to(device=device, dtype=dtype)
    return x, residual, weight


def model_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The decoder layer's current path: h = residual + x, then RMSNorm(h)."""
    norm = RMSNorm(x.shape[1], EPS).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        h = x if residual is None else residual + x
        return norm(h), h


def model_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """LlamaMLP.forward with identity projections (gate|up an identity matrix, the down projection one that
    copies the activation into the first half of its output: exact in any dtype): exactly its activation."""
    inter = x.shape[1] // 2
    config = SimpleNamespace(hidden_size=2 * inter, intermediate_size=inter, mlp_bias=False)
    mlp = LlamaMLP(config).to(x.dtype)  # type: ignore[arg-type]
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.eye(2 * inter, dtype=x.dtype))
        mlp.down_proj.weight.copy_(torch.eye(2 * inter, inter, dtype=x.dtype))
        return mlp(x)[:, :inter]


# ------------------------------------------------------------------------------------------- references


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_reference_is_the_model_path(dtype: torch.dtype, with_residual: bool) -> None:
    x, residual, weight = norm_inputs(torch.Generator().manual_seed(0), 37, 1000, dtype)
    res = residual if with_residual else None
    out, summed = fused_add_rms_norm_ref(x, res, weight, EPS)
    expected_out, expected_sum = model_norm(x, res, weight)
    assert out.dtype == dtype and summed.dtype == dtype
    assert torch.equal(out, expected_out)
    assert torch.equal(summed, expected_sum)
    if not with_residual:
        assert summed is x  # nothing copied


def test_norm_reference_fp32_weight_with_half_inputs() -> None:
    """An fp32 weight promotes the output, as RMSNorm's `weight * h.to(input_dtype)` does."""
    x, residual, weight = norm_inputs(torch.Generator().manual_seed(1), 5, 64, torch.bfloat16)
    out, _ = fused_add_rms_norm_ref(x, residual, weight.float(), EPS)
    expected, _ = model_norm(x, residual, weight.float())
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_norm_reference_fp32_is_the_formula() -> None:
    x, residual, weight = norm_inputs(torch.Generator().manual_seed(2), 33, 384, torch.float32)
    out, summed = fused_add_rms_norm_ref(x, residual, weight, EPS)
    s = x + residual
    assert torch.equal(summed, s)
    assert torch.equal(out, weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)))
    rms = torch.sqrt((s.double() ** 2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(out.double(), (s.double() / rms) * weight.double(), atol=1e-5, rtol=1e-5)


def test_norm_reference_writes_out_buffers() -> None:
    x, residual, weight = norm_inputs(torch.Generator().manual_seed(3), 7, 64, torch.bfloat16)
    out, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    got = fused_add_rms_norm_ref(x, residual, weight, EPS, out=out, residual_out=res_out)
    assert got[0] is out and got[1] is res_out
    expected = fused_add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(out, expected[0]) and torch.equal(res_out, expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_reference_is_the_model_path(dtype: torch.dtype) -> None:
    x = (torch.randn(37, 2 * 1000, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    got = silu_and_mul_ref(x)
    assert got.dtype == dtype and got.shape == (37, 1000)
    assert torch.equal(got, model_silu_and_mul(x))
    out = torch.full((37, 1000), float("nan"), dtype=dtype)
    assert silu_and_mul_ref(x, out=out) is out and torch.equal(out, got)


def test_silu_reference_fp32_is_the_formula() -> None:
    x = torch.randn(33, 2 * 384, generator=torch.Generator().manual_seed(5)) * 4
    gate, up = x[:, :384], x[:, 384:]
    got = silu_and_mul_ref(x)
    assert torch.equal(got, F.silu(gate) * up)
    torch.testing.assert_close(got, gate * torch.sigmoid(gate) * up, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got, gate / (1 + torch.exp(-gate)) * up, atol=1e-6, rtol=1e-6)


def test_silu_reference_rounds_twice_in_half_precision() -> None:
    """bf16: silu rounded to bf16, then the product rounded again (not one fp32 computation rounded once)."""
    x = (torch.randn(64, 2 * 512, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16)
    gate, up = x.float().split(512, dim=-1)
    twice = (F.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    assert torch.equal(silu_and_mul_ref(x), twice)


# --------------------------------------------------------------------------------------------- triton

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
MIN_INTERPRETED_TESTS = 60


@pytest.fixture(scope="class")
def kernels() -> SimpleNamespace:
    """The Triton kernels, checked to be running in the interpreter (not silently compiled)."""
    from asyncspec.kernels import fused_add_rms_norm_triton, silu_and_mul_triton

    assert isinstance(fused_add_rms_norm_triton._fused_add_rms_norm_kernel, InterpretedFunction)
    assert isinstance(silu_and_mul_triton._silu_and_mul_kernel, InterpretedFunction)
    return SimpleNamespace(norm=fused_add_rms_norm_triton.fused_add_rms_norm, silu=silu_and_mul_triton.silu_and_mul)


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, MIN_INTERPRETED_TESTS, ())


def check_norm(norm, x, residual, weight, *, strided_out: bool = False) -> None:
    """The kernel into NaN-poisoned buffers (any element it forgets stays NaN and fails) against the reference."""
    expected_out, expected_sum = fused_add_rms_norm_ref(x, residual, weight, EPS)
    width = x.shape[1] + 3 if strided_out else x.shape[1]
    out = torch.full((x.shape[0], width), float("nan"), dtype=expected_out.dtype, device=x.device)[:, : x.shape[1]]
    res_out = torch.full_like(out, float("nan"), dtype=x.dtype) if residual is not None else None
    got_out, got_sum = norm(x, residual, weight, EPS, out=out, residual_out=res_out)
    assert got_out is out and got_out.dtype == expected_out.dtype
    torch.testing.assert_close(got_out, expected_out, **tolerances(x.dtype))
    if residual is None:
        assert got_sum is x
    else:
        assert got_sum is res_out
        assert torch.equal(got_sum, expected_sum)  # one add, rounded once: exact


def check_silu(silu, x) -> None:
    expected = silu_and_mul_ref(x)
    out = torch.full_like(expected, float("nan"))
    assert silu(x, out=out) is out
    torch.testing.assert_close(out, expected, **tolerances(x.dtype))


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("hidden", [64, 384, 1000])
    @pytest.mark.parametrize("num_tokens", [1, 7, 33])
    @pytest.mark.parametrize("with_residual", [True, False])
    def test_norm_matches_reference(self, kernels, num_tokens, hidden, dtype, with_residual) -> None:
        gen = torch.Generator().manual_seed(num_tokens * 10_000 + hidden)
        x, residual, weight = norm_inputs(gen, num_tokens, hidden, dtype)
        check_norm(kernels.norm, x, residual if with_residual else None, weight)

    def test_norm_allocates_outputs(self, kernels) -> None:
        x, residual, weight = norm_inputs(torch.Generator().manual_seed(7), 9, 384, torch.bfloat16)
        expected = fused_add_rms_norm_ref(x, residual, weight, EPS)
        out, summed = kernels.norm(x, residual, weight, EPS)
        torch.testing.assert_close(out, expected[0], atol=1e-2, rtol=1e-2)
        assert torch.equal(summed, expected[1])
        out, summed = kernels.norm(x, None, weight, EPS)
        assert summed is x
        torch.testing.assert_close(out, fused_add_rms_norm_ref(x, None, weight, EPS)[0], atol=1e-2, rtol=1e-2)

    def test_norm_copies_x_into_residual_out(self, kernels) -> None:
        x, _, weight = norm_inputs(torch.Generator().manual_seed(8), 7, 64, torch.float32)
        res_out = torch.full_like(x, float("nan"))
        _, summed = kernels.norm(x, None, weight, EPS, residual_out=res_out)
        assert summed is res_out and torch.equal(res_out, x)

    def test_norm_strided_fp16_and_fp32_weight(self, kernels) -> None:
        gen = torch.Generator().manual_seed(9)
        x, residual, weight = norm_inputs(gen, 33, 1000, torch.float16)
        big = torch.full((33, 1010), float("nan"), dtype=torch.float16)
        big[:, 5:1005] = x
        check_norm(kernels.norm, big[:, 5:1005], residual, weight, strided_out=True)
        check_norm(kernels.norm, x, residual, weight.float())  # fp32 output, as the model's promotion gives

    def test_norm_big_values_and_empty(self, kernels) -> None:
        x, residual, weight = norm_inputs(torch.Generator().manual_seed(10), 7, 384, torch.bfloat16)
        check_norm(kernels.norm, x * 1000, residual * 1000, weight)  # fp32 sum of squares, no overflow
        empty = torch.empty(0, 64, dtype=torch.bfloat16)
        out, summed = kernels.norm(empty, empty, weight[:64], EPS)
        assert out.shape == (0, 64) and summed.shape == (0, 64)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("inter", [64, 384, 1000, 2500])
    @pytest.mark.parametrize("num_tokens", [1, 7, 33])
    def test_silu_matches_reference(self, kernels, num_tokens, inter, dtype) -> None:
        gen = torch.Generator().manual_seed(num_tokens * 10_000 + inter)
        x = (torch.randn(num_tokens, 2 * inter, generator=gen) * 4).to(dtype)
        check_silu(kernels.silu, x)

    @pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100) -> inf: fine
    def test_silu_strided_fp16_extremes_and_empty(self, kernels) -> None:
        x = torch.randn(7, 2 * 384, generator=torch.Generator().manual_seed(11)) * 4
        x[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, -0.0])
        big = torch.full((7, 2 * 384 + 6), float("nan"))
        big[:, 3 : 3 + 2 * 384] = x
        check_silu(kernels.silu, big[:, 3 : 3 + 2 * 384])
        check_silu(kernels.silu, x.to(torch.float16))
        assert kernels.silu(torch.empty(0, 128)).shape == (0, 64)


# ------------------------------------------------------------------------------------------------ gpu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gpu_norm_matches_reference(dtype: torch.dtype, with_residual: bool) -> None:
    from asyncspec.kernels.fused_add_rms_norm_triton import fused_add_rms_norm

    x, residual, weight = norm_inputs(torch.Generator().manual_seed(12), 8192, 4096, dtype, device="cuda")
    check_norm(fused_add_rms_norm, x, residual if with_residual else None, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("inter", [14336, 1000])
def test_gpu_silu_matches_reference(dtype: torch.dtype, inter: int) -> None:
    from asyncspec.kernels.silu_and_mul_triton import silu_and_mul

    x = (torch.randn(8192, 2 * inter, generator=torch.Generator().manual_seed(13)) * 4).to("cuda", dtype)
    check_silu(silu_and_mul, x)


@pytest.mark.gpu
def test_gpu_fused_kernels_do_not_sync() -> None:
    from asyncspec.kernels.fused_add_rms_norm_triton import fused_add_rms_norm
    from asyncspec.kernels.silu_and_mul_triton import silu_and_mul

    x, residual, weight = norm_inputs(torch.Generator().manual_seed(14), 8192, 4096, torch.bfloat16, device="cuda")
    gate_up = torch.randn(8192, 2 * 14336, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        fused_add_rms_norm(x, residual, weight, EPS)
        fused_add_rms_norm(x, None, weight, EPS)
        silu_and_mul(gate_up)

    step()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
