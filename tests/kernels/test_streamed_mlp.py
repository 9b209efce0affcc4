"""The streamed MLP: its reference against the engine's chain of references, its configs and shapes, the kernel
compiled for sm_90 without a GPU, and (on a Hopper GPU) its numbers against the reference."""

from __future__ import annotations

import pytest
import torch

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.kernels.silu_and_mul import silu_and_mul_ref
from asyncspec.kernels.skinny_linear import skinny_linear_ref
from asyncspec.kernels.streamed_mlp import (
    BOX_BYTES,
    SHARED_MEMORY_BYTES,
    StreamedMLPConfig,
    StreamedMLPError,
    shape_supported,
    stages_for,
    streamed_mlp_ref,
)
from tests.kernels.streamed_checks import assert_stage_within_an_ulp, gated_error_bound, normed_candidates


def _layer(hidden: int, inter: int, device: str, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x, residual = rand(1, hidden, scale=1.0), rand(1, hidden, scale=1.0)
    norm_weight = (1.0 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
    gate_up = rand(2 * inter, hidden, scale=hidden**-0.5)
    down = rand(hidden, inter, scale=inter**-0.5)
    return x, residual, norm_weight, gate_up, down


def test_reference_is_the_chain_of_the_engines_references() -> None:
    x, residual, nw, gate_up, down = _layer(64, 96, "cpu")
    out, summed = streamed_mlp_ref(x, residual, nw, 1e-5, gate_up, down)
    normed, want_summed = fused_add_rms_norm_ref(x, residual, nw, 1e-5)
    act = silu_and_mul_ref((normed.float() @ gate_up.float().T).to(torch.bfloat16))
    want = (act.float() @ down.float().T).to(torch.bfloat16)
    assert torch.equal(summed, want_summed)
    assert torch.equal(out, want)
    # Not the unrounded computation: the roundings are the point.
    h = (x.float() + residual.float()).to(torch.bfloat16).float()
    exact_normed = nw.float() * h * torch.rsqrt(h.pow(2).mean() + 1e-5)
    g, u = (exact_normed @ gate_up.float().T).chunk(2, dim=-1)
    exact = torch.nn.functional.silu(g) * u @ down.float().T
    assert not torch.equal(out.float(), exact)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": 1}, "at least 2"),
        ({"boxes": 3}, "use 1, 2 or 4"),
        ({"warps": 2}, "use 4 or 8"),
        ({"registers": 60}, "multiple of 8"),
        ({"registers": 32}, "from 40 to 256"),
        ({"co_resident": False}, "set grid_barrier=False too"),
    ],
)
def test_config_rejects_what_cannot_launch(kwargs: dict, message: str) -> None:
    with pytest.raises(StreamedMLPError, match=message):
        StreamedMLPConfig(**kwargs)


def test_ring_shrinks_to_fit_shared_memory() -> None:
    config = StreamedMLPConfig()
    assert stages_for(config, 2048, 8192) == 12  # Llama-1B: the full ring fits
    eight_b = stages_for(config, 4096, 14336)  # Llama-8B: its vectors take 44 KiB
    assert 2 <= eight_b < 12
    assert shape_supported(config, 4096, 14336)
    assert not shape_supported(config, 2048, 8192 + 256)  # not whole 512-column slots
    assert not shape_supported(StreamedMLPConfig(boxes=1), 256, 120_000)  # the vectors alone overflow


@pytest.mark.parametrize(
    ("config", "hidden", "inter"),
    [
        (StreamedMLPConfig(), 2048, 8192),
        (StreamedMLPConfig(), 4096, 14336),
        (StreamedMLPConfig(stages=16, boxes=1, warps=4), 2048, 8192),
        (StreamedMLPConfig(boxes=4, stages=6), 1024, 4096),
        (StreamedMLPConfig(), 3072, 8192),
        (StreamedMLPConfig(), 512, 1024),
    ],
)
def test_compiles_for_hopper_within_shared_memory(config: StreamedMLPConfig, hidden: int, inter: int) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_mlp_gluon import compile_for_hopper

    kernel = compile_for_hopper(config, hidden, inter)
    assert kernel.metadata.shared <= SHARED_MEMORY_BYTES
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor.2d" in ptx  # the loader's TMA copies
    assert "griddepcontrol.wait" in ptx
    assert f".maxnreg {config.registers}" in ptx


DEEP_SPLIT = StreamedMLPConfig(stages=16, grid_barrier=False, co_resident=False)


@pytest.mark.parametrize(("hidden", "inter", "stages"), [(2048, 8192, 13), (4096, 14336, 12), (512, 1024, 13)])
def test_deep_split_rings_take_a_program_s_whole_share(hidden: int, inter: int, stages: int) -> None:
    """split-deep: each kernel's ring as deep as a program's shared memory allows beside its vectors, far deeper
    than the co-resident split's, and both compile within it."""
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_gemv import StreamedGemvConfig
    from asyncspec.kernels.streamed_gemv_gluon import compile_for_hopper as compile_gemv
    from asyncspec.kernels.streamed_mlp import down_stages_for, split_down_room
    from asyncspec.kernels.streamed_mlp_gluon import compile_for_hopper

    assert shape_supported(DEEP_SPLIT, hidden, inter)
    assert stages_for(DEEP_SPLIT, hidden, inter) == stages
    assert down_stages_for(DEEP_SPLIT, hidden, inter) >= stages
    co_resident = StreamedMLPConfig(stages=16, grid_barrier=False)
    assert 2 * stages_for(co_resident, hidden, inter) <= stages + 1
    assert split_down_room(DEEP_SPLIT, hidden, inter) == SHARED_MEMORY_BYTES
    assert stages_for(co_resident, hidden, inter) * 2 * BOX_BYTES <= 96 * 1024  # what split keeps in flight
    gate_up = compile_for_hopper(DEEP_SPLIT, hidden, inter)
    assert gate_up.metadata.shared <= SHARED_MEMORY_BYTES
    down_config = StreamedGemvConfig(down_stages_for(DEEP_SPLIT, hidden, inter), 2, 8, DEEP_SPLIT.registers)
    down = compile_gemv(down_config, hidden, inter, room=SHARED_MEMORY_BYTES)
    assert down.metadata.shared <= SHARED_MEMORY_BYTES


@pytest.mark.parametrize(("hidden", "inter"), [(2048, 8192), (4096, 14336), (3072, 8192), (512, 1024)])
def test_split_kernels_share_an_sm(hidden: int, inter: int) -> None:
    """The split form's down projection streams while the gate|up kernel finishes only if a program of each fits
    one SM's shared memory together."""
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_gemv import PROGRAM_RESERVED_BYTES, SM_SHARED_MEMORY_BYTES, StreamedGemvConfig
    from asyncspec.kernels.streamed_gemv_gluon import compile_for_hopper as compile_gemv
    from asyncspec.kernels.streamed_mlp import down_stages_for, split_down_room
    from asyncspec.kernels.streamed_mlp_gluon import compile_for_hopper

    config = StreamedMLPConfig(grid_barrier=False)
    stages = stages_for(config, hidden, inter)
    assert stages >= 2 and shape_supported(config, hidden, inter)
    gate_up = compile_for_hopper(config, hidden, inter)
    down_config = StreamedGemvConfig(
        down_stages_for(config, hidden, inter), config.boxes, config.warps, config.registers
    )
    down = compile_gemv(down_config, hidden, inter, room=split_down_room(config, hidden, inter))
    assert gate_up.metadata.shared + down.metadata.shared + 2 * PROGRAM_RESERVED_BYTES <= SM_SHARED_MEMORY_BYTES
    # The gate|up kernel alone: no grid barrier (no polling loop on the flags) and no down tiles.
    assert "fence.acq_rel.gpu" not in gate_up.asm["ptx"]
    assert "fence.acq_rel.gpu" in compile_for_hopper(StreamedMLPConfig(), hidden, inter).asm["ptx"]


def test_compile_rejects_an_unsupported_shape() -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_mlp_gluon import compile_for_hopper

    with pytest.raises(StreamedMLPError, match="hidden=2048, intermediate=8000"):
        compile_for_hopper(StreamedMLPConfig(), 2048, 8000)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize(
    ("config", "hidden", "inter"),
    [
        (StreamedMLPConfig(), 2048, 8192),
        (StreamedMLPConfig(), 4096, 14336),
        (StreamedMLPConfig(), 3072, 8192),  # vectors in blocks of 4 rows: warps share rows
        (StreamedMLPConfig(), 512, 1024),  # programs without a gate|up or a down tile
        (StreamedMLPConfig(stages=16, boxes=1, warps=4), 2048, 8192),
        (StreamedMLPConfig(stages=6, boxes=4), 2048, 8192),
        (StreamedMLPConfig(grid_barrier=False), 2048, 8192),
        (StreamedMLPConfig(grid_barrier=False), 4096, 14336),
        (StreamedMLPConfig(grid_barrier=False), 3072, 8192),
        (StreamedMLPConfig(grid_barrier=False), 512, 1024),
        (DEEP_SPLIT, 2048, 8192),
        (DEEP_SPLIT, 4096, 14336),
        (DEEP_SPLIT, 512, 1024),
    ],
)
def test_matches_reference_on_hopper(monkeypatch, pdl: str, config: StreamedMLPConfig, hidden: int, inter: int):
    from asyncspec.kernels.skinny_linear import skinny_linear_error_bound, skinny_linear_gated_ref
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP

    monkeypatch.setenv("ASYNCSPEC_PDL", pdl)
    device = torch.device("cuda")
    streamed = StreamedMLP(device, {(hidden, inter)}, config)
    for seed in range(3):  # the barrier's flags carry over between launches
        x, residual, nw, gate_up, down = _layer(hidden, inter, "cuda", seed=seed)
        assert streamed.applies(x, residual, nw, gate_up, down)
        out, summed = streamed(x, residual, nw, 1e-5, gate_up, down)
        normed, want_summed = fused_add_rms_norm_ref(x, residual, nw, 1e-5)
        assert torch.equal(summed, want_summed)
        # Each stage against the reference of that stage on the kernel's own input to it: the activations from the
        # reference's normalised row, the output from the kernel's own activations. Only the fp32 sums' order
        # differs, so a bf16 result is rarely off, by one ulp (more only where a sum cancels); a skipped rounding
        # would show at once.
        act = streamed._act[:inter].view(1, inter)
        candidates = normed_candidates(x, residual, nw, 1e-5)
        assert torch.equal(candidates[0], normed)
        assert_stage_within_an_ulp(
            act,
            candidates,
            lambda n, w=gate_up: skinny_linear_gated_ref(n, w),
            lambda n, w=gate_up: gated_error_bound(n, w),
        )
        want_out = skinny_linear_ref(act, down)
        bound = skinny_linear_error_bound(act, down)
        assert ((out.float() - want_out.float()).abs() <= bound).all()
        assert (out != want_out).float().mean() < 0.02
        err = (out.float() - streamed_mlp_ref(x, residual, nw, 1e-5, gate_up, down)[0].float()).norm()
        assert err / out.float().norm() < 0.01
    # Three launches moved every program's barrier flag on by three; the split form has no barrier.
    assert set(streamed._flags.tolist()) == {3 if config.grid_barrier else 0}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_replays_in_a_cuda_graph() -> None:
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP

    streamed = StreamedMLP(torch.device("cuda"), {(2048, 8192)}, StreamedMLPConfig())
    x, residual, nw, gate_up, down = _layer(2048, 8192, "cuda")
    static_x, static_res = x.clone(), residual.clone()
    streamed(static_x, static_res, nw, 1e-5, gate_up, down)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, summed = streamed(static_x, static_res, nw, 1e-5, gate_up, down)
    for seed in range(1, 4):
        x, residual, *_ = _layer(2048, 8192, "cuda", seed=seed)
        static_x.copy_(x)
        static_res.copy_(residual)
        graph.replay()
        want_out, want_summed = streamed_mlp_ref(x, residual, nw, 1e-5, gate_up, down)
        assert torch.equal(summed, want_summed)
        assert (out.float() - want_out.float()).norm() / want_out.float().norm() < 0.01
    assert set(streamed._flags.tolist()) == {4}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_applies_only_to_what_it_serves() -> None:
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP

    streamed = StreamedMLP(torch.device("cuda"), {(2048, 8192)}, StreamedMLPConfig())
    x, residual, nw, gate_up, down = _layer(2048, 8192, "cuda")
    assert streamed.applies(x, residual, nw, gate_up, down)
    assert not streamed.applies(torch.cat([x, x]), torch.cat([residual, residual]), nw, gate_up, down)  # two rows
    assert not streamed.applies(x.float(), residual, nw, gate_up, down)
    assert not streamed.applies(x, residual.float(), nw, gate_up, down)
    assert not streamed.applies(x, residual, nw, gate_up[:-16], down)  # another shape
    assert not streamed.applies(x.cpu(), residual, nw, gate_up, down)
    assert not streamed.applies(x, residual, nw, gate_up.t().contiguous().t(), down)  # strided weight
    assert not streamed.applies(x, residual, nw[:-1], gate_up, down)


def test_runner_refuses_what_it_cannot_serve() -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP

    with pytest.raises(StreamedMLPError, match="hidden=2048, intermediate=8000"):
        StreamedMLP(torch.device("cpu"), {(2048, 8000)}, StreamedMLPConfig())
    with pytest.raises(StreamedMLPError, match="CUDA devices only"):
        StreamedMLP(torch.device("cpu"), {(2048, 8192)}, StreamedMLPConfig())
