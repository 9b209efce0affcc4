"""The streamed GEMV: its configs and shapes, the kernel compiled for sm_90 without a GPU, and (on a Hopper GPU) its
numbers against the engine's skinny-linear reference, eagerly and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from asyncspec.kernels.skinny_linear import skinny_linear_ref
from asyncspec.kernels.streamed_gemv import (
    BOX_BYTES,
    SHARED_MEMORY_BYTES,
    StreamedGemvConfig,
    StreamedGemvError,
    gemv_shape_supported,
    gemv_stages_for,
    gemv_vector_bytes,
    streamed_gemv_ref,
    vector_rows,
)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": 1}, "at least 2"),
        ({"boxes": 3}, "use 1, 2 or 4"),
        ({"warps": 16}, "use 4 or 8"),
        ({"registers": 44}, "multiple of 8"),
        ({"registers": 264}, "from 40 to 256"),
    ],
)
def test_config_rejects_what_cannot_launch(kwargs: dict, message: str) -> None:
    with pytest.raises(StreamedGemvError, match=message):
        StreamedGemvConfig(**kwargs)


def test_ring_and_shapes() -> None:
    config = StreamedGemvConfig(stages=8, boxes=1)
    assert gemv_stages_for(config, 2048) == 8
    # A room too small for the whole ring shrinks it to what fits beside the row.
    room = gemv_vector_bytes(2048) + 3 * BOX_BYTES + 100
    assert gemv_stages_for(config, 2048, room) == 3
    assert gemv_shape_supported(config, 2048, 2048)
    assert not gemv_shape_supported(config, 2048 + 8, 2048)  # not whole 16-row tiles
    assert not gemv_shape_supported(config, 2048, 2048 + 128)  # not whole 256-column boxes
    assert not gemv_shape_supported(StreamedGemvConfig(boxes=2), 2048, 256 * 3)  # not whole 2-box slots
    assert not gemv_shape_supported(config, 2048, 2048, gemv_vector_bytes(2048) + BOX_BYTES)  # a 1-slot ring
    assert not gemv_shape_supported(config, 2048, 256 * 500)  # the row alone overflows shared memory
    assert vector_rows(2048) == 8 and vector_rows(3072) == 4 and vector_rows(2048, 1280) == 1


def test_reference_is_the_skinny_linear_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, generator=gen).to(torch.bfloat16)
    w = (torch.randn(48, 512, generator=gen) * 0.05).to(torch.bfloat16)
    assert torch.equal(streamed_gemv_ref(x, w), skinny_linear_ref(x, w))
    assert streamed_gemv_ref(x, w).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("config", "n", "k", "room"),
    [
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 2048, 2048, SHARED_MEMORY_BYTES),  # Llama-1B o_proj
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 4096, 4096, SHARED_MEMORY_BYTES),  # Llama-8B o_proj
        (StreamedGemvConfig(stages=6, boxes=2, warps=8), 2048, 8192, 119_808),  # the split 1B MLP's down
        (StreamedGemvConfig(stages=16, boxes=2, warps=8), 2048, 8192, SHARED_MEMORY_BYTES),  # 1B down, deep ring
        (StreamedGemvConfig(stages=16, boxes=2, warps=8), 4096, 14336, SHARED_MEMORY_BYTES),  # 8B down, deep ring
        (StreamedGemvConfig(stages=4, boxes=4, warps=8), 3072, 3072, SHARED_MEMORY_BYTES),  # x in blocks of 4 rows
    ],
)
def test_compiles_for_hopper_within_its_room(config: StreamedGemvConfig, n: int, k: int, room: int) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_gemv_gluon import compile_for_hopper

    kernel = compile_for_hopper(config, n, k, room=room)
    assert kernel.metadata.shared <= room
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor.2d" in ptx  # the loader's TMA copies
    assert "griddepcontrol.wait" in ptx
    assert f".maxnreg {config.registers}" in ptx


@pytest.mark.parametrize("pdl", [1, 2])  # WAIT_FIRST, TRIGGER_FIRST
@pytest.mark.parametrize(
    ("config", "n", "k"),
    [
        (StreamedGemvConfig(stages=16, boxes=2, warps=8), 2048, 8192),  # the 1B's down projection, deep ring
        (StreamedGemvConfig(stages=16, boxes=2, warps=8), 4096, 14336),  # the 8B's
        (StreamedGemvConfig(stages=6, boxes=2, warps=8), 2048, 8192),  # the split form's, sharing an SM
    ],
)
def test_add_norm_compiles_for_hopper_and_reads_the_residual_after_the_wait(
    pdl: int, config: StreamedGemvConfig, n: int, k: int
) -> None:
    """The epilogue that folds the next norm: within the ring's room as the plain kernel, nothing stored before the
    PDL wait (the residual is the predecessor's output), and the norm weight (constant) loaded before it, where the
    plain kernel loads nothing."""
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_gemv_gluon import compile_for_hopper

    room = SHARED_MEMORY_BYTES if config.stages == 16 else 119_808
    assert gemv_shape_supported(config, n, k, room)
    plain = compile_for_hopper(config, n, k, room=room, pdl=pdl)
    folded = compile_for_hopper(config, n, k, room=room, pdl=pdl, add_norm=True)
    assert folded.metadata.shared <= room
    plain_ptx, ptx = plain.asm["ptx"], folded.asm["ptx"]
    wait, plain_wait = ptx.index("griddepcontrol.wait"), plain_ptx.index("griddepcontrol.wait")
    assert "st.global" not in ptx[:wait]
    assert ptx[:wait].count("ld.global") > plain_ptx[:plain_wait].count("ld.global")
    assert "ld.global.cg" not in ptx[:wait]  # the residual (and x), read through L2, only after it
    # The residual's stores and the partial sums' store: more stores than the plain kernel's output alone.
    assert ptx[wait:].count("st.global") > plain_ptx[plain_wait:].count("st.global")


def test_compile_rejects_an_unsupported_shape() -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_gemv_gluon import compile_for_hopper

    with pytest.raises(StreamedGemvError, match=r"weight \[2040, 2048\]"):
        compile_for_hopper(StreamedGemvConfig(), 2040, 2048)


def test_runner_refuses_a_cpu_device() -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    with pytest.raises(StreamedGemvError, match="CUDA devices only"):
        StreamedGemv(torch.device("cpu"), StreamedGemvConfig())


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    from asyncspec.kernels.skinny_linear import skinny_linear_error_bound

    want = streamed_gemv_ref(x, w)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert ((out.float() - want.float()).abs() <= skinny_linear_error_bound(x, w)).all()
    # Only the fp32 sums' order differs from the reference: a wrong or missing tile would change most elements.
    assert (out != want).float().mean() < 0.02


def _operands(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize(
    ("config", "n", "k"),
    [
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 2048, 2048),
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 4096, 4096),
        (StreamedGemvConfig(stages=6, boxes=2, warps=8), 2048, 8192),
        (StreamedGemvConfig(stages=16, boxes=2, warps=8), 2048, 8192),  # the down projection's deep ring
        (StreamedGemvConfig(stages=4, boxes=4, warps=8), 3072, 3072),
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 1040, 512),  # programs without a tile
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 4240, 512),  # 2 rounds of tiles and one more
    ],
)
def test_matches_reference_on_hopper(monkeypatch, pdl: str, config: StreamedGemvConfig, n: int, k: int) -> None:
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    monkeypatch.setenv("ASYNCSPEC_PDL", pdl)
    gemv = StreamedGemv(torch.device("cuda"), config)
    for seed in range(2):
        x, w = _operands(n, k, seed)
        assert gemv.applies(x, w)
        _check(gemv(x, w), x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_replays_in_a_cuda_graph() -> None:
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    gemv = StreamedGemv(torch.device("cuda"), StreamedGemvConfig(stages=8, boxes=1, warps=4))
    x, w = _operands(2048, 2048, 0)
    static_x = x.clone()
    gemv(static_x, w)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(static_x, w)
    for seed in range(1, 4):
        x, _ = _operands(2048, 2048, seed)
        static_x.copy_(x)
        graph.replay()
        _check(out, x, w)


def _check_add_norm(folded, residual: torch.Tensor, before: torch.Tensor, x, w, norm_w, eps: float) -> None:
    """`StreamedGemv.add_norm`'s results against `skinny_linear_add_norm_ref` on the same operands."""
    from asyncspec.kernels.skinny_linear import skinny_linear_add_norm_ref, skinny_linear_error_bound

    ref_residual = before.clone()
    want = skinny_linear_add_norm_ref(x, w, None, residual=ref_residual, norm_weight=norm_w, eps=eps)
    n = w.shape[0]
    assert folded.sum_squares.shape == (1, n // 16) and folded.sum_squares.dtype == torch.float32
    assert folded.x_weighted.shape == (1, n) and folded.eps == eps
    # h differs from the reference's where the fp32 sums' order moved the rounded product by a unit: within the
    # product's bound plus one bf16 unit of h, at few elements.
    bound = skinny_linear_error_bound(x, w) + ref_residual.float().abs() * 2**-7
    assert ((residual.float() - ref_residual.float()).abs() <= bound).all()
    assert (residual != ref_residual).float().mean() < 0.02
    weighted_bound = bound * norm_w.float().abs() + want.x_weighted.float().abs() * 2**-7
    assert ((folded.x_weighted.float() - want.x_weighted.float()).abs() <= weighted_bound).all()
    assert (folded.x_weighted != want.x_weighted).float().mean() < 0.02
    # Every tile's partial lands where the factor sums it: a missing one would move the factor by about 1/n_tiles.
    torch.testing.assert_close(folded.row_factors(), want.row_factors(), rtol=1e-3, atol=0.0)
    tiles = residual.float().view(n // 16, 16).pow(2).sum(dim=1)
    torch.testing.assert_close(folded.sum_squares[0], tiles, rtol=1e-4, atol=1e-6)


def _norm_operands(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1000 + seed)
    residual = torch.randn(1, n, generator=gen, device="cuda").to(torch.bfloat16)
    norm_w = (1.0 + 0.1 * torch.randn(n, generator=gen, device="cuda")).to(torch.bfloat16)
    return residual, norm_w


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize(
    ("config", "n", "k"),
    [
        (StreamedGemvConfig(stages=16, boxes=2, warps=8), 2048, 8192),  # the 1B's down projection, deep ring
        (StreamedGemvConfig(stages=16, boxes=2, warps=8), 4096, 14336),  # the 8B's
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 1040, 512),  # programs without a tile
        (StreamedGemvConfig(stages=8, boxes=1, warps=4), 4240, 512),  # 2 rounds of tiles and one more
    ],
)
def test_add_norm_matches_the_reference_on_hopper(
    monkeypatch, pdl: str, config: StreamedGemvConfig, n: int, k: int
) -> None:
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    monkeypatch.setenv("ASYNCSPEC_PDL", pdl)
    gemv = StreamedGemv(torch.device("cuda"), config)
    for seed in range(2):
        x, w = _operands(n, k, seed)
        residual, norm_w = _norm_operands(n, seed)
        before = residual.clone()
        assert gemv.applies(x, w) and gemv.add_norm_applies(w, residual, norm_w)
        folded = gemv.add_norm(x, w, residual=residual, norm_weight=norm_w, eps=1e-5)
        _check_add_norm(folded, residual, before, x, w, norm_w, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_add_norm_replays_in_a_cuda_graph() -> None:
    """Captured, the epilogue reads each replay's residual and writes over it: replays on new inputs give the
    reference's numbers, and nothing of an earlier replay leaks into the partial sums."""
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    gemv = StreamedGemv(torch.device("cuda"), StreamedGemvConfig(stages=16, boxes=2, warps=8))
    x, w = _operands(2048, 8192, 0)
    residual, norm_w = _norm_operands(2048, 0)
    static_x, static_residual = x.clone(), residual.clone()
    gemv.add_norm(static_x, w, residual=static_residual, norm_weight=norm_w, eps=1e-6)  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        folded = gemv.add_norm(static_x, w, residual=static_residual, norm_weight=norm_w, eps=1e-6)
    for seed in range(1, 4):
        x, _ = _operands(2048, 8192, seed)
        residual, _ = _norm_operands(2048, seed)
        static_x.copy_(x)
        static_residual.copy_(residual)
        folded.sum_squares.fill_(float("nan"))
        graph.replay()
        _check_add_norm(folded, static_residual, residual, x, w, norm_w, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_applies_only_to_what_it_serves() -> None:
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    gemv = StreamedGemv(torch.device("cuda"), StreamedGemvConfig())
    x, w = _operands(2048, 2048, 0)
    assert gemv.applies(x, w)
    assert not gemv.applies(torch.cat([x, x]), w)  # two rows
    assert not gemv.applies(x.float(), w)
    assert not gemv.applies(x, w.float())
    assert not gemv.applies(x[:, :1024], w)  # widths differ
    assert not gemv.applies(x.cpu(), w)
    assert not gemv.applies(x, w.t().contiguous().t())  # strided weight
    assert not gemv.applies(x, w[:-8])  # not whole 16-row tiles
