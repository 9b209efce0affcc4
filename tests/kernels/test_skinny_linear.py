"""The decode-shaped linear layer: the torch reference against the plain formula, and the Triton kernel against the
reference, under TRITON_INTERPRET=1 on the CPU (small odd shapes, every code path forced by a config) and compiled
on a GPU (real Llama shapes in bf16, determinism, no host sync, CUDA-graph capture).

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

from asyncspec.kernels.silu_and_mul import silu_and_mul_ref
from asyncspec.kernels.skinny_linear import (
    skinny_linear_error_bound,
    skinny_linear_gated_ref,
    skinny_linear_ref,
    skinny_linear_silu_ref,
)

MAX_MISMATCH = 0.02  # fraction of half-precision outputs that may differ from the reference by a rounding flip


def operands(
    gen: torch.Generator, m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", bias: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [m, k], weight [n, k] (nn.Linear-like scale) and an optional bias, off-centre so a dropped term shows."""
    x = (torch.randn(m, k, generator=gen) + 0.1).to(device=device, dtype=dtype)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5 + 0.01).to(device=device, dtype=dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(device=device, dtype=dtype) if bias else None
    return x, weight, b


def check_result(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within the summation-order bound everywhere, and (in half precision) equal to the reference almost
    everywhere: a single wrong product term would move many outputs across a rounding boundary."""
    expected = skinny_linear_ref(x, weight, bias)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert not got.isnan().any(), "unwritten (NaN-poisoned) outputs"
    err = (got.float() - expected.float()).abs()
    bound = skinny_linear_error_bound(x, weight, bias)
    assert (err <= bound).all(), f"error / bound up to {(err / bound).max().item():.3g}"
    if x.dtype != torch.float32:
        mismatch = (got != expected).float().mean().item()
        assert mismatch <= MAX_MISMATCH, f"{mismatch:.2%} of outputs differ from the reference"
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * x.shape[1] ** 0.5)


def poisoned(m: int, n: int, dtype: torch.dtype, device: str = "cpu", pad: int = 0) -> torch.Tensor:
    """A NaN-filled [m, n] output (rows `pad` elements longer than n): any element not written stays NaN."""
    return torch.full((m, n + pad), float("nan"), dtype=dtype, device=device)[:, :n]


# ------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_fp32_sum_rounded_once(dtype: torch.dtype) -> None:
    x, weight, bias = operands(torch.Generator().manual_seed(0), 7, 90, 300, dtype, bias=True)
    assert bias is not None
    got = skinny_linear_ref(x, weight, bias)
    exact = x.double() @ weight.double().t() + bias.double()
    assert got.dtype == dtype and got.shape == (7, 90)
    assert torch.equal(got, (x.float() @ weight.float().t() + bias.float()).to(dtype))
    assert ((got.double() - exact).abs() <= skinny_linear_error_bound(x, weight, bias).double()).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    out = poisoned(7, 90, dtype)
    assert skinny_linear_ref(x, weight, bias, out=out) is out and torch.equal(out, got)


def test_silu_reference_is_activation_then_linear() -> None:
    gen = torch.Generator().manual_seed(1)
    x2 = (torch.randn(5, 2 * 64, generator=gen) * 3).to(torch.bfloat16)
    weight = (torch.randn(40, 64, generator=gen) * 0.1).to(torch.bfloat16)
    assert torch.equal(skinny_linear_silu_ref(x2, weight), skinny_linear_ref(silu_and_mul_ref(x2), weight))


# -------------------------------------------------------------------------------------------- triton

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from asyncspec.kernels.skinny_linear_triton import (  # noqa: E402  (after the triton import guard)
    MAX_M,
    WIDE_MAX_M,
    SkinnyConfig,
    choose_config,
    skinny_linear,
    skinny_linear_supported,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
MIN_INTERPRETED_TESTS = 50

# Every code path on small shapes: FMA / tensor-core inner product, split-K summed by the last program (serial)
# or by a second kernel, with a ragged last split, K not a multiple of BLOCK_K, N not a multiple of BLOCK_N.
FORCED = [
    SkinnyConfig(block_n=16, block_k=64),
    SkinnyConfig(block_n=8, block_k=32, split_k=3),
    SkinnyConfig(block_n=32, block_k=128, split_k=4, serial_split=False),  # K = 200: 2 chunks, the split shrinks
    SkinnyConfig(block_n=16, block_k=32, use_dot=True),
    SkinnyConfig(block_n=32, block_k=64, split_k=2, use_dot=True),
    SkinnyConfig(block_n=64, block_k=16, split_k=5, use_dot=True, serial_split=False),
]
GATED_CONFIGS = [
    None,
    FORCED[0],
    FORCED[1],
    SkinnyConfig(block_n=4, block_k=32, split_k=2),
    FORCED[2],
    FORCED[3],
    FORCED[4],
]


@pytest.fixture(scope="class")
def kernels() -> SimpleNamespace:
    """The Triton module, checked to be running in the interpreter (not silently compiled)."""
    from asyncspec.kernels import skinny_linear_triton

    assert isinstance(skinny_linear_triton._skinny_linear_kernel, InterpretedFunction)
    assert isinstance(skinny_linear_triton._split_reduce_kernel, InterpretedFunction)
    return SimpleNamespace(
        linear=skinny_linear_triton.skinny_linear,
        silu=skinny_linear_triton.skinny_linear_silu,
        gated=skinny_linear_triton.skinny_linear_gated,
        counters=skinny_linear_triton.make_split_counters,
    )


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, MIN_INTERPRETED_TESTS, ())


def test_cpu_tensors_need_the_interpreter() -> None:
    x, weight, _ = operands(torch.Generator().manual_seed(2), 2, 16, 32, torch.bfloat16)
    assert skinny_linear_supported(x, weight) == INTERPRETING
    if not INTERPRETING:
        with pytest.raises(ValueError, match="skinny_linear_supported"):
            skinny_linear(x, weight)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(2048, 2048), (1536, 4096), (128256, 4096), (4096, 14336), (7, 9), (100, 3000)])
def test_choose_config_is_launchable(m: int, n: int, k: int) -> None:
    """The table gives power-of-two tiles that the kernel can compile (tl.dot needs >= 16 per dim) and, where N
    alone cannot, splits K to put a program on at least three quarters of the multiprocessors."""
    cfg = choose_config(m, n, k, 132)
    for block in (cfg.block_n, cfg.block_k, cfg.num_warps):
        assert block > 0 and block & (block - 1) == 0
    assert cfg.split_k >= 1 and cfg.num_stages >= 1
    if cfg.use_dot:
        assert cfg.block_n >= 16 and cfg.block_k >= 16
    programs = -(-n // cfg.block_n) * cfg.split_k
    if k >= 8192 and n >= 512:
        assert programs >= 3 * 132 // 4, cfg


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize(
        "m,n,k",
        [(1, 5, 7), (3, 70, 130), (8, 33, 300), (17, 48, 96), (32, 20, 64), (80, 48, 96), (160, 20, 64), (300, 20, 64)],
    )
    @pytest.mark.parametrize("with_bias", [False, True])
    def test_matches_reference(self, kernels, m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool) -> None:
        x, weight, bias = operands(torch.Generator().manual_seed(m * 1000 + n + k), m, n, k, dtype, bias=with_bias)
        out = poisoned(m, n, dtype)
        assert kernels.linear(x, weight, bias, out=out) is out
        check_result(out, x, weight, bias)

    @pytest.mark.parametrize("config", FORCED, ids=str)
    @pytest.mark.parametrize("m", [1, 5, 19])
    def test_forced_configs(self, kernels, config: SkinnyConfig, m: int) -> None:
        x, weight, bias = operands(torch.Generator().manual_seed(m), m, 37, 200, torch.bfloat16, bias=True)
        out = poisoned(m, 37, torch.bfloat16)
        kernels.linear(x, weight, bias, out=out, config=config)
        check_result(out, x, weight, bias)
        check_result(kernels.linear(x, weight, config=config), x, weight, None)

    @pytest.mark.parametrize("preload", ["1", "2"])
    @pytest.mark.parametrize(
        "config",
        # K = 200: among them a split of exactly two chunks whose second is partial (block_k 128).
        [*FORCED, SkinnyConfig(block_n=8, block_k=32, split_k=2), SkinnyConfig(block_n=8, block_k=128)],
        ids=str,
    )
    @pytest.mark.parametrize("gated", [False, True])
    def test_preloaded_chunks_change_nothing(self, kernels, monkeypatch, preload, config, gated: bool) -> None:
        # Splits of one chunk and of several, ragged last splits and K tails: the chunks loaded before the PDL
        # wait are each counted once, bit for bit as without them.
        fn = kernels.gated if gated else kernels.linear
        x, weight, bias = operands(torch.Generator().manual_seed(11), 2, 38, 200, torch.bfloat16, bias=True)
        monkeypatch.setenv("ASYNCSPEC_SKINNY_PRELOAD", "0")
        expected = fn(x, weight, bias, config=config, counters=kernels.counters("cpu"))
        monkeypatch.setenv("ASYNCSPEC_SKINNY_PRELOAD", preload)
        got = fn(x, weight, bias, config=config, counters=kernels.counters("cpu"))
        assert torch.equal(got, expected)

    def test_preload_switch_is_validated(self, kernels, monkeypatch) -> None:
        x, weight, _ = operands(torch.Generator().manual_seed(1), 1, 8, 64, torch.bfloat16)
        monkeypatch.setenv("ASYNCSPEC_SKINNY_PRELOAD", "3")
        with pytest.raises(ValueError, match="ASYNCSPEC_SKINNY_PRELOAD must be 0, 1 or 2"):
            kernels.linear(x, weight)

    @pytest.mark.parametrize("config", [None, FORCED[1], FORCED[4]], ids=str)
    def test_fp16_and_fp32_with_bias(self, kernels, config: SkinnyConfig | None) -> None:
        for dtype in (torch.float16, torch.float32):
            x, weight, bias = operands(torch.Generator().manual_seed(3), 6, 50, 160, dtype, bias=True)
            check_result(kernels.linear(x, weight, bias, config=config), x, weight, bias)

    def test_strided_rows(self, kernels) -> None:
        """Rows of x, weight and out with padding after them (views of wider buffers), dense last dims."""
        gen = torch.Generator().manual_seed(4)
        x, weight, bias = operands(gen, 9, 45, 96, torch.bfloat16, bias=True)
        wide_x = torch.full((9, 100), float("nan"), dtype=torch.bfloat16)
        wide_x[:, :96] = x
        wide_w = torch.full((45, 128), float("nan"), dtype=torch.bfloat16)
        wide_w[:, :96] = weight
        for config in (None, FORCED[1], FORCED[4]):
            out = poisoned(9, 45, torch.bfloat16, pad=3)
            kernels.linear(wide_x[:, :96], wide_w[:, :96], bias, out=out, config=config)
            check_result(out, x, weight, bias)

    def test_large_k_tail_and_rows_past_n(self, kernels) -> None:
        """One column block with N far from a multiple of BLOCK_N, and a K with a short last chunk."""
        x, weight, _ = operands(torch.Generator().manual_seed(5), 2, 3, 1000, torch.float32)
        for config in (SkinnyConfig(64, 256), SkinnyConfig(64, 256, split_k=3), SkinnyConfig(64, 128, 2, use_dot=True)):
            check_result(kernels.linear(x, weight, config=config), x, weight, None)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    # The FMA and the tensor-core kernel, whole and split (serial: the epilogue in the last program); a split summed
    # by the second kernel takes the plain kernel then the activation kernel. One row (decode), five (every row
    # branch of the FMA tile: > 1, 2, 4), and 40 for the tensor-core configs (two row blocks).
    @pytest.mark.parametrize(
        ("m", "config"),
        [(m, c) for m in (1, 5) for c in GATED_CONFIGS] + [(40, c) for c in GATED_CONFIGS if c is None or c.use_dot],
        ids=str,
    )
    @pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100) -> inf: fine
    def test_gated_matches_reference(self, kernels, dtype: torch.dtype, config: SkinnyConfig | None, m: int) -> None:
        from asyncspec.kernels import silu_and_mul_triton

        """silu_and_mul of the gate|up projection, bit for bit the reference's roundings: the projection
        rounded once, then the activation's two roundings (intermediate 37: the last column block is ragged)."""
        gen = torch.Generator().manual_seed(10 + m)
        x, weight, bias = operands(gen, m, 2 * 37, 96, dtype, bias=True)
        x[0, :4] = torch.tensor([30.0, -30.0, 0.0, 1e-3], dtype=dtype)  # large gates: silu saturates both ways
        counters = kernels.counters(x.device)
        out = poisoned(m, 37, dtype)
        assert kernels.gated(x, weight, bias, out=out, config=config, counters=counters) is out
        expected = skinny_linear_gated_ref(x, weight, bias)
        # The projection's sum order may differ from the reference's by a rounding: bit for bit, the fused
        # epilogue equals the plain kernel's projection through the activation kernel (the engine's unfused path).
        projection = kernels.linear(x, weight, bias, config=config, counters=counters)
        assert torch.equal(out, silu_and_mul_triton.silu_and_mul(projection))
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(out, kernels.gated(x, weight, bias, config=config, counters=counters))  # deterministic

    def test_gated_refuses_an_odd_weight(self, kernels) -> None:
        x, weight, _ = operands(torch.Generator().manual_seed(11), 1, 7, 32, torch.float32)
        with pytest.raises(ValueError, match="even number of rows"):
            kernels.gated(x, weight)
        with pytest.raises(ValueError, match="out must be"):
            kernels.gated(x, weight[:6], out=torch.empty(1, 6))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("config", [None, FORCED[1], FORCED[3], FORCED[4]], ids=str)
    @pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100) -> inf: fine
    def test_silu_matches_reference(self, kernels, dtype: torch.dtype, config: SkinnyConfig | None) -> None:
        gen = torch.Generator().manual_seed(6)
        x2 = torch.randn(7, 2 * 120, generator=gen) * 3
        x2[0, :6] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 30.0, 100.0])
        x2 = x2.to(dtype)
        weight = (torch.randn(44, 120, generator=gen) * 0.1).to(dtype)
        bias = torch.randn(44, generator=gen).to(dtype)
        out = poisoned(7, 44, dtype)
        assert kernels.silu(x2, weight, bias, out=out, config=config, fused=True) is out
        check_result(out, silu_and_mul_ref(x2), weight, bias)
        assert torch.equal(out, kernels.silu(x2, weight, bias, config=config, fused=True))
        assert torch.equal(out, kernels.silu(x2, weight, bias, config=config, fused=False))  # the same roundings
        check_result(kernels.silu(x2[:1], weight, bias, config=config), silu_and_mul_ref(x2[:1]), weight, bias)

    def test_deterministic(self, kernels) -> None:
        x, weight, bias = operands(torch.Generator().manual_seed(7), 4, 40, 256, torch.bfloat16, bias=True)
        for config in (None, FORCED[1], FORCED[4]):
            first = kernels.linear(x, weight, bias, config=config)
            assert torch.equal(first, kernels.linear(x, weight, bias, config=config))

    def test_serial_split_leaves_counters_zero(self, kernels) -> None:
        """The last program of each column block resets its arrival counter, so the next launch starts at 0;
        the serial and two-kernel splits sum in the same order, so they agree bitwise."""
        from asyncspec.kernels import skinny_linear_triton

        # Three column blocks (the last ragged), ten chunks of K in four splits (the last short), three rows.
        x, weight, bias = operands(torch.Generator().manual_seed(12), 3, 20, 300, torch.bfloat16, bias=True)
        serial = SkinnyConfig(block_n=8, block_k=32, split_k=4)
        counters = skinny_linear_triton.make_split_counters(x.device)
        first = kernels.linear(x, weight, bias, config=serial, counters=counters)
        assert counters.count_nonzero() == 0
        assert torch.equal(first, kernels.linear(x, weight, bias, config=serial, counters=counters))
        with pytest.raises(ValueError, match="counters"):
            kernels.linear(x, weight, bias, config=serial, counters=counters[:8])
        two_kernels = SkinnyConfig(block_n=8, block_k=32, split_k=4, serial_split=False)
        assert torch.equal(first, kernels.linear(x, weight, bias, config=two_kernels))
        check_result(first, x, weight, bias)

    def test_supported_accepts_and_refuses(self, kernels) -> None:
        x, weight, bias = operands(torch.Generator().manual_seed(8), 4, 24, 32, torch.bfloat16)
        assert skinny_linear_supported(x, weight)
        assert skinny_linear_supported(torch.zeros(MAX_M, 32, dtype=torch.bfloat16), weight)
        assert skinny_linear_supported(torch.zeros(WIDE_MAX_M, 32, dtype=torch.bfloat16), weight)
        assert skinny_linear_supported(torch.cat([x, x], 1), weight, gated=True)
        refused: dict[str, tuple] = {
            "no rows": (x[:0], weight),
            "too many rows": (torch.zeros(WIDE_MAX_M + 1, 32, dtype=torch.bfloat16), weight),
            "dtype mismatch": (x.float(), weight),
            "integer dtype": (x.to(torch.int32), weight.to(torch.int32)),
            "float64": (x.double(), weight.double()),
            "K mismatch": (x[:, :16], weight),
            "strided last dim of x": (torch.zeros(4, 64, dtype=torch.bfloat16)[:, ::2], weight),
            "transposed weight": (x, torch.zeros(32, 24, dtype=torch.bfloat16).t()),
            "3-D x": (x[None], weight),
            "1-D x": (x[0], weight),
            "gated width": (x, weight, True),
        }
        for name, (a, w, *gated) in refused.items():
            assert not skinny_linear_supported(a, w, gated=bool(gated)), name
            with pytest.raises(ValueError):
                (kernels.silu if gated else kernels.linear)(a, w)
            if gated:
                with pytest.raises(ValueError):
                    kernels.silu(a, w, fused=False)
        with pytest.raises(ValueError, match="bias"):
            kernels.linear(x, weight, torch.zeros(23, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="bias"):
            kernels.linear(x, weight, torch.zeros(24))
        with pytest.raises(ValueError, match="out"):
            kernels.linear(x, weight, out=torch.empty(4, 25, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="out"):
            kernels.linear(x, weight, out=torch.empty(25, 4, dtype=torch.bfloat16).t())


# ------------------------------------------------------------------------------------------------ gpu

# Llama-8B projections (qkv, o, down, a TP=4 qkv shard), the 1B's qkv and down, an lm_head, and an odd size.
GPU_SHAPES = [
    (6144, 4096),
    (4096, 4096),
    (4096, 14336),
    (1536, 4096),
    (3072, 2048),
    (2048, 8192),
    (128256, 2048),
    (1000, 3000),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_matches_reference(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x_all, weight, _ = operands(gen, MAX_M, n, k, torch.bfloat16, device="cuda")
    for m in (1, 2, 3, 4, 8, 13, 16, 32):
        x = x_all[:m]
        out = poisoned(m, n, torch.bfloat16, device="cuda")
        skinny_linear(x, weight, out=out)
        check_result(out, x, weight, None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 8, 32, 160, 640])
def test_gpu_dtypes_bias_and_configs(dtype: torch.dtype, m: int) -> None:
    x, weight, bias = operands(torch.Generator().manual_seed(m), m, 2000, 1100, dtype, device="cuda", bias=True)
    configs = [
        None,
        SkinnyConfig(16, 256, split_k=4, unroll=2),
        SkinnyConfig(8, 512, split_k=3),
        SkinnyConfig(64, 128, 3, num_stages=3, use_dot=True),
    ]
    for config in configs:
        out = poisoned(m, 2000, dtype, device="cuda", pad=8)
        skinny_linear(x, weight, bias, out=out, config=config)
        check_result(out, x, weight, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 8, 32, 160])
def test_gpu_silu_matches_reference(m: int) -> None:
    from asyncspec.kernels.skinny_linear_triton import skinny_linear_silu

    gen = torch.Generator().manual_seed(m)
    x2 = (torch.randn(m, 2 * 14336, generator=gen) * 3).to("cuda", torch.bfloat16)
    weight = (torch.randn(4096, 14336, generator=gen) * 0.01).to("cuda", torch.bfloat16)
    out = poisoned(m, 4096, torch.bfloat16, device="cuda")
    skinny_linear_silu(x2, weight, out=out, fused=True)
    check_result(out, silu_and_mul_ref(x2), weight, None)
    assert torch.equal(out, skinny_linear_silu(x2, weight, fused=False))


@pytest.mark.gpu
@pytest.mark.parametrize(("inter", "hidden"), [(8192, 2048), (14336, 4096), (7168, 4096)], ids=["1b", "8b", "8b-tp2"])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 32])  # FMA tiles (1, 2) and tensor-core tiles (5, 16, 32)
def test_gpu_gated_equals_the_unfused_path(inter: int, hidden: int, m: int) -> None:
    """The gate|up projection with the activation in its epilogue: bit for bit the plain kernel then the
    activation kernel (the engine's unfused path), in eager mode and replayed from a graph."""
    from asyncspec.kernels import skinny_linear_triton
    from asyncspec.kernels.silu_and_mul_triton import silu_and_mul

    x, weight, _ = operands(torch.Generator().manual_seed(inter + m), m, 2 * inter, hidden, torch.bfloat16, "cuda")
    counters = skinny_linear_triton.make_split_counters(x.device)
    unfused = silu_and_mul(skinny_linear(x, weight, counters=counters))
    out = poisoned(m, inter, torch.bfloat16, device="cuda")
    skinny_linear_triton.skinny_linear_gated(x, weight, out=out, counters=counters)
    assert torch.equal(out, unfused)
    torch.testing.assert_close(
        out.float(), silu_and_mul_ref(skinny_linear_ref(x, weight)).float(), rtol=2e-2, atol=2e-2
    )
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear_triton.skinny_linear_gated(x, weight, out=out, counters=counters)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, unfused) and counters.count_nonzero() == 0


@pytest.mark.gpu
def test_gpu_deterministic() -> None:
    """Bitwise equal results call after call, split-K (small N) included: no float atomics anywhere."""
    for n, k in [(1536, 4096), (1024, 8192), (6144, 4096)]:
        x, weight, _ = operands(torch.Generator().manual_seed(n), MAX_M, n, k, torch.bfloat16, device="cuda")
        for m in (1, 3, 8, 16, 32):
            first = skinny_linear(x[:m], weight)
            for _ in range(3):
                assert torch.equal(first, skinny_linear(x[:m], weight)), (n, k, m)


@pytest.mark.gpu
def test_gpu_no_sync_and_graph_capture() -> None:
    x, weight, _ = operands(torch.Generator().manual_seed(9), 8, 1536, 4096, torch.bfloat16, device="cuda")
    out = torch.empty(8, 1536, dtype=torch.bfloat16, device="cuda")
    skinny_linear(x, weight, out=out)  # compile outside the checks
    expected = out.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        skinny_linear(x, weight, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, weight, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_gpu_serial_split_stress_and_graph() -> None:
    """Many back-to-back serial split-K launches (counters reused each time) in eager mode and in a graph,
    bitwise equal to the two-kernel split (also what a call without counters takes)."""
    from asyncspec.kernels import skinny_linear_triton

    x, weight, bias = operands(torch.Generator().manual_seed(11), 8, 1536, 4096, torch.bfloat16, "cuda", bias=True)
    serial = SkinnyConfig(32, 128, split_k=8, num_stages=4, use_dot=True)
    reference = skinny_linear(x, weight, bias, config=SkinnyConfig(32, 128, 8, 4, 4, True, serial_split=False))
    check_result(reference, x, weight, bias)
    assert torch.equal(skinny_linear(x, weight, bias, config=serial), reference)  # no counters: two kernels
    counters = skinny_linear_triton.make_split_counters(x.device)
    outs = [skinny_linear(x, weight, bias, config=serial, counters=counters) for _ in range(200)]
    assert all(torch.equal(o, reference) for o in outs)
    assert counters.count_nonzero() == 0
    outs = [torch.empty_like(reference) for _ in range(20)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for o in outs:
            skinny_linear(x, weight, bias, out=o, config=serial, counters=counters)
    for _ in range(5):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, reference) for o in outs)


@pytest.mark.gpu
def test_gpu_supported_refuses() -> None:
    x, weight, _ = operands(torch.Generator().manual_seed(10), 4, 64, 128, torch.bfloat16, device="cuda")
    assert skinny_linear_supported(x, weight)
    assert not skinny_linear_supported(torch.zeros(WIDE_MAX_M + 1, 128, device="cuda", dtype=torch.bfloat16), weight)
    assert not skinny_linear_supported(x.half(), weight)
    assert not skinny_linear_supported(x, weight.t().contiguous().t())  # column-major weight
    assert not skinny_linear_supported(x.cpu(), weight)
    with pytest.raises(ValueError):
        skinny_linear(x, weight.t().contiguous().t())
