"""Where a PDL launch lets its successor launch (`pdl_mode`, `pdl_start`): trigger-first only for small captured
launches, and the order of the two instructions in the compiled kernels (sm_90, no GPU)."""

from __future__ import annotations

import pytest
import torch

from asyncspec.kernels import pdl
from asyncspec.kernels.pdl import (
    DEFAULT_EARLY_TRIGGER_ROWS,
    EARLY_TRIGGER_ROWS_ENV,
    TRIGGER_FIRST,
    WAIT_FIRST,
    early_trigger_rows,
    pdl_mode,
)

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A device that takes PDL, and a switch for whether the current stream is capturing a graph."""
    capturing = [True]
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.delenv(EARLY_TRIGGER_ROWS_ENV, raising=False)
    monkeypatch.delenv("ASYNCSPEC_ATTN_EARLY_KV", raising=False)
    return capturing


def test_small_captured_launches_trigger_first(hopper: list[bool]) -> None:
    assert early_trigger_rows() == DEFAULT_EARLY_TRIGGER_ROWS == 8
    assert [pdl_mode(CUDA, rows) for rows in (1, 2, 8)] == [TRIGGER_FIRST] * 3
    assert [pdl_mode(CUDA, rows) for rows in (9, 32, 4096)] == [WAIT_FIRST] * 3
    hopper[0] = False  # eager launches never take the other variant: nothing compiles mid-run for them
    assert pdl_mode(CUDA, 1) == WAIT_FIRST


def test_the_row_limit_is_a_setting(hopper: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EARLY_TRIGGER_ROWS_ENV, "32")
    assert pdl_mode(CUDA, 32) == TRIGGER_FIRST and pdl_mode(CUDA, 33) == WAIT_FIRST
    monkeypatch.setenv(EARLY_TRIGGER_ROWS_ENV, "0")
    assert pdl_mode(CUDA, 1) == WAIT_FIRST


def test_early_kv_leaves_the_trigger_alone(hopper: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention's early reads rely on the forward pass's first launch (without PDL), not on the trigger's place
    (tests/models/test_forward_order.py checks that a pass begins with it)."""
    monkeypatch.setenv("ASYNCSPEC_ATTN_EARLY_KV", "1")
    assert pdl_mode(CUDA, 1) == TRIGGER_FIRST and pdl_mode(CUDA, 9) == WAIT_FIRST


@pytest.mark.parametrize("raw", ["-1", "eight", "1.5", ""])
def test_a_bad_row_limit_is_refused(hopper: list[bool], monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """Refused when the graphs are captured; eager launches do not read it."""
    monkeypatch.setenv(EARLY_TRIGGER_ROWS_ENV, raw)
    with pytest.raises(ValueError, match=EARLY_TRIGGER_ROWS_ENV):
        pdl_mode(CUDA, 1)
    hopper[0] = False
    assert pdl_mode(CUDA, 1) == WAIT_FIRST


def test_without_pdl_the_mode_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert pdl_mode(CUDA, 1) == 0
    assert pdl_mode(torch.device("cpu"), 1) == 0


def _order(ptx: str) -> list[str]:
    """The PDL instructions of a kernel's PTX, in program order."""
    marks = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")
    found = sorted((ptx.index(mark), mark.split(".")[1]) for mark in marks if mark in ptx)
    return [name for _, name in found]


@pytest.mark.parametrize(
    ("mode", "order"),
    [(0, []), (WAIT_FIRST, ["wait", "launch_dependents"]), (TRIGGER_FIRST, ["launch_dependents", "wait"])],
)
def test_triton_pdl_start_orders_the_instructions(sm90_compiler, mode: int, order: list[str]) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from asyncspec.kernels.fused_add_rms_norm_triton import _fused_add_rms_norm_kernel as fn

    signature: dict[str, str] = {name: "constexpr" for name in fn.arg_names}
    signature.update(dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"), "*bf16"))
    signature.update(dict.fromkeys(("x_stride", "res_stride", "out_stride", "res_out_stride", "num_rows", "H"), "i32"))
    signature["eps"] = "fp32"
    constexprs = {"HAS_RESIDUAL": True, "STORE_RESIDUAL": True, "BLOCK_T": 1, "BLOCK_H": 2048, "USE_PDL": mode}
    values = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    ptx = triton.compile(ASTSource(fn, signature, values), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert _order(ptx) == order
    if mode == TRIGGER_FIRST:  # the norm's weight is still read before the wait; x and the residual after it
        wait = ptx.index("griddepcontrol.wait")
        assert "ld.global" in ptx[:wait] and "ld.global" in ptx[wait:] and "st.global" not in ptx[:wait]


def test_gluon_pdl_start_orders_the_instructions(sm90_compiler) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_gemv import StreamedGemvConfig
    from asyncspec.kernels.streamed_gemv_gluon import compile_for_hopper

    config = StreamedGemvConfig(stages=8, boxes=1, warps=4)
    assert _order(compile_for_hopper(config, 2048, 2048).asm["ptx"]) == ["wait", "launch_dependents"]
    early = compile_for_hopper(config, 2048, 2048, pdl=TRIGGER_FIRST).asm["ptx"]
    assert _order(early) == ["launch_dependents", "wait"]
    # The loader's TMA copies of W may precede both: they read only the weights.
    assert "cp.async.bulk.tensor.2d" in early


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_a_captured_chain_takes_its_mode_and_matches_eager(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """A norm then two projections sharing one set of serial split-K counters (the second splits K at 8 rows)
    captured in a graph: launches of at most 8 rows trigger first, larger ones wait first, and every replay, on new
    inputs with its intermediates poisoned, gives the eager chain's numbers bit for bit."""
    from asyncspec.kernels import fused_add_rms_norm_triton, skinny_linear_triton

    if not pdl.pdl_enabled(CUDA):
        pytest.skip("needs a GPU that takes PDL (compute capability 9.0+)")
    monkeypatch.delenv(EARLY_TRIGGER_ROWS_ENV, raising=False)
    monkeypatch.delenv("ASYNCSPEC_ATTN_EARLY_KV", raising=False)
    modes: list[int] = []
    for module in (fused_add_rms_norm_triton, skinny_linear_triton):
        real = module.pdl_mode

        def spy(device: torch.device, n: int, real=real) -> int:
            modes.append(real(device, n))
            return modes[-1]

        monkeypatch.setattr(module, "pdl_mode", spy)
    gen = torch.Generator(device="cuda").manual_seed(rows)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    x, residual = randn(rows, 2048), randn(rows, 2048)
    norm_weight = randn(2048).abs() + 0.5
    w1, w2 = randn(3072, 2048) * 0.02, randn(2048, 3072) * 0.02
    counters = skinny_linear_triton.make_split_counters("cuda")

    def chain() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, _ = fused_add_rms_norm_triton.fused_add_rms_norm(x, residual, norm_weight, 1e-5)
        mid = skinny_linear_triton.skinny_linear(h, w1, counters=counters)
        return h, mid, skinny_linear_triton.skinny_linear(mid, w2, counters=counters)

    chain()
    assert modes and set(modes) == {WAIT_FIRST}
    modes.clear()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = chain()
    torch.cuda.current_stream().wait_stream(stream)
    assert set(modes) == {TRIGGER_FIRST if rows <= DEFAULT_EARLY_TRIGGER_ROWS else WAIT_FIRST}
    for _ in range(4):
        x.copy_(randn(rows, 2048))
        residual.copy_(randn(rows, 2048))
        expected = [t.clone() for t in chain()]  # eager, wait-first
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, expected, strict=True):
            assert torch.equal(got, want)
    assert not counters.any()  # every split's last program reset its counter
