"""The streamed attention input: its reference against the engine's chain of references, its configs and shapes, the
kernel compiled for sm_90 without a GPU, and (on a Hopper GPU) its numbers against the reference, stage by stage,
eagerly and in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.kernels.rotary_kv_write import rotary_kv_write_ref, rotate_ref
from asyncspec.kernels.skinny_linear import skinny_linear_error_bound, skinny_linear_ref
from asyncspec.kernels.streamed_attn_in import (
    StreamedAttnInConfig,
    StreamedAttnInError,
    qkv_tiles,
    shape_supported,
    stages_for,
    streamed_attn_in_ref,
)
from asyncspec.kernels.streamed_gemv import SHARED_MEMORY_BYTES
from tests.kernels.streamed_checks import assert_stage_within_an_ulp, normed_candidates

EPS = 1e-5
MAX_POSITION = 4096
NUM_BLOCKS = 8
BLOCK_SIZE = 16

LLAMA_1B = (2048, 32, 8, 64)
LLAMA_8B = (4096, 32, 8, 128)
QWEN3_LIKE = (1024, 16, 8, 128)
SMALL = (512, 8, 2, 64)


@dataclass
class _Layer:
    """One layer's operands for one token."""

    x: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor
    qkv_weight: torch.Tensor
    num_heads: int
    num_kv_heads: int
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor

    def args(self, residual: bool = True, k_cache=None, v_cache=None) -> tuple:
        """The arguments of the reference and the runner (eps after the norm weight)."""
        return (
            self.x,
            self.residual if residual else None,
            self.norm_weight,
            EPS,
            self.qkv_weight,
            self.num_heads,
            self.num_kv_heads,
            self.positions,
            self.cos,
            self.sin,
            self.k_cache if k_cache is None else k_cache,
            self.v_cache if v_cache is None else v_cache,
            self.slots,
        )


def _rope_caches(head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(MAX_POSITION, device=device, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def _layer(shape: tuple[int, int, int, int], device: str, seed: int = 0, position: int = 1234, slot: int = 37):
    hidden, num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size, scale):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(torch.bfloat16)

    rows = (num_heads + 2 * num_kv_heads) * head_dim
    cos, sin = _rope_caches(head_dim, device)
    # Caches full of values, so that a write where none belongs shows.
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    return _Layer(
        x=rand(1, hidden, scale=1.0),
        residual=rand(1, hidden, scale=1.0),
        norm_weight=(1.0 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(torch.bfloat16),
        qkv_weight=rand(rows, hidden, scale=hidden**-0.5),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        positions=torch.tensor([position], dtype=torch.int64, device=device),
        cos=cos,
        sin=sin,
        k_cache=rand(*cache_shape, scale=1.0),
        v_cache=rand(*cache_shape, scale=1.0),
        slots=torch.tensor([slot], dtype=torch.int64, device=device),
    )


@pytest.mark.parametrize("residual", [True, False])
def test_reference_is_the_chain_of_the_engines_references(residual: bool) -> None:
    layer = _layer(SMALL, "cpu")
    hidden, nh, kvh, hd = SMALL
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    q_rot, summed = streamed_attn_in_ref(*layer.args(residual))
    normed, want_summed = fused_add_rms_norm_ref(layer.x, layer.residual if residual else None, layer.norm_weight, EPS)
    assert torch.equal(summed, want_summed)
    if not residual:
        assert summed is layer.x  # the first layer's new residual is its input
    qkv = (normed.float() @ layer.qkv_weight.float().T).to(torch.bfloat16).view(1, nh + 2 * kvh, hd)
    cos = layer.cos[layer.positions].to(torch.bfloat16)
    sin = layer.sin[layer.positions].to(torch.bfloat16)
    assert torch.equal(q_rot, rotate_ref(qkv[:, :nh], cos, sin))
    k_want, v_want = k_cache.view(-1, kvh, hd).clone(), v_cache.view(-1, kvh, hd).clone()
    k_want[layer.slots[0]] = rotate_ref(qkv[:, nh : nh + kvh], cos, sin)[0]
    v_want[layer.slots[0]] = qkv[0, nh + kvh :]
    assert torch.equal(layer.k_cache.view(-1, kvh, hd), k_want)
    assert torch.equal(layer.v_cache.view(-1, kvh, hd), v_want)
    # Not the unrounded computation: the roundings are the point.
    h = want_summed.float()
    exact_normed = layer.norm_weight.float() * h * torch.rsqrt(h.pow(2).mean() + EPS)
    exact = (exact_normed @ layer.qkv_weight.float().T).view(1, nh + 2 * kvh, hd)
    c, s = layer.cos[layer.positions][:, None], layer.sin[layer.positions][:, None]
    x1, x2 = exact[:, :nh, : hd // 2], exact[:, :nh, hd // 2 :]
    exact_q = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert not torch.equal(q_rot.float(), exact_q)
    assert (q_rot.float() - exact_q).norm() / exact_q.norm() < 0.02


def test_reference_clamps_the_position_and_skips_a_negative_slot() -> None:
    layer = _layer(SMALL, "cpu", position=MAX_POSITION + 100, slot=-1)
    k_cache, v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    q_rot, _ = streamed_attn_in_ref(*layer.args())
    assert torch.equal(layer.k_cache, k_cache) and torch.equal(layer.v_cache, v_cache)
    last = _layer(SMALL, "cpu", position=MAX_POSITION - 1)
    assert torch.equal(q_rot, streamed_attn_in_ref(*last.args())[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stages": 1}, "at least 2"),
        ({"boxes": 3}, "use 1, 2 or 4"),
        ({"warps": 2}, "use 4 or 8"),
        ({"registers": 60}, "multiple of 8"),
        ({"registers": 32}, "from 40 to 256"),
    ],
)
def test_config_rejects_what_cannot_launch(kwargs: dict, message: str) -> None:
    with pytest.raises(StreamedAttnInError, match=message):
        StreamedAttnInConfig(**kwargs)


def test_ring_and_shapes() -> None:
    config = StreamedAttnInConfig()
    assert stages_for(config, 2048) == 12  # the whole ring fits beside an 8 KiB row
    assert stages_for(StreamedAttnInConfig(stages=16), 4096) == 13  # 16 KiB slots beside a 16 KiB row
    assert qkv_tiles(32, 8, 64) == 192 and qkv_tiles(32, 8, 128) == 384
    for shape in (LLAMA_1B, LLAMA_8B, QWEN3_LIKE, SMALL):
        assert shape_supported(config, *shape)
    assert not shape_supported(config, 2048, 32, 8, 72)  # a rotary half of 36 rows: not whole 8-row halves
    assert not shape_supported(config, 2048 + 256, 32, 8, 64)  # not whole 512-column slots
    assert shape_supported(StreamedAttnInConfig(boxes=1), 2048 + 256, 32, 8, 64)
    assert not shape_supported(config, 2048, 0, 8, 64)
    assert not shape_supported(StreamedAttnInConfig(boxes=1), 256 * 224, 32, 8, 64)  # the row alone overflows


@pytest.mark.parametrize(
    ("config", "shape", "residual"),
    [
        (StreamedAttnInConfig(), LLAMA_1B, True),
        (StreamedAttnInConfig(), LLAMA_8B, True),
        (StreamedAttnInConfig(), QWEN3_LIKE, True),
        (StreamedAttnInConfig(), SMALL, True),
        (StreamedAttnInConfig(), LLAMA_1B, False),
        (StreamedAttnInConfig(stages=8, boxes=1, warps=4), LLAMA_1B, True),
        (StreamedAttnInConfig(stages=4, boxes=4), LLAMA_8B, True),
        (StreamedAttnInConfig(stages=6), LLAMA_1B, True),  # the engine's config (layers/streamed_attn_in.py)
        (StreamedAttnInConfig(stages=6), LLAMA_8B, False),
    ],
)
def test_compiles_for_hopper_within_shared_memory(
    config: StreamedAttnInConfig, shape: tuple[int, int, int, int], residual: bool
) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_attn_in_gluon import compile_for_hopper

    kernel = compile_for_hopper(config, *shape, residual=residual)
    assert kernel.metadata.shared <= SHARED_MEMORY_BYTES
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor.2d" in ptx  # the loader's TMA copies
    assert "griddepcontrol.wait" in ptx
    assert f".maxnreg {config.registers}" in ptx


def test_compile_rejects_an_unsupported_shape() -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_attn_in_gluon import compile_for_hopper

    with pytest.raises(StreamedAttnInError, match="head_dim=72: not a shape"):
        compile_for_hopper(StreamedAttnInConfig(), 2048, 32, 8, 72)
    with pytest.raises(StreamedAttnInError, match="hidden=2304"):
        compile_for_hopper(StreamedAttnInConfig(), 2304, 32, 8, 64)


def test_runner_refuses_what_it_cannot_serve() -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    with pytest.raises(StreamedAttnInError, match="head_dim=72"):
        StreamedAttnIn(torch.device("cpu"), {(2048, 32, 8, 72)}, StreamedAttnInConfig())
    with pytest.raises(StreamedAttnInError, match="CUDA devices only"):
        StreamedAttnIn(torch.device("cpu"), {LLAMA_1B}, StreamedAttnInConfig())


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _kernel_projection(streamed, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The kernel's own q|k|v projection [1, rows] in bf16, read back from its scratch: tile t holds 8 rows of a
    head's first half, then the same 8 rows of its second half."""
    _, nh, kvh, hd = shape
    heads = nh + 2 * kvh
    tiles = streamed._qkv[: heads * hd].view(heads, hd // 16, 2, 8)
    return tiles.transpose(1, 2).reshape(1, heads * hd).to(torch.bfloat16)


def _check(streamed, layer: _Layer, shape: tuple[int, int, int, int], residual: bool) -> None:
    """Each stage against the reference of that stage on the kernel's own input to it: the projection from the
    reference's normalised row (only the fp32 sums' order differs, so rarely an ulp, more only where a sum
    cancels), the rotation and the cache writes from the kernel's own projection (bit-exact); and the whole
    against the reference."""
    _, nh, kvh, hd = shape
    k_before, v_before = layer.k_cache.clone(), layer.v_cache.clone()
    args = layer.args(residual)
    assert streamed.applies(*args[:3], *args[4:])
    q_rot, summed = streamed(*args)
    torch.cuda.synchronize()
    normed, want_summed = fused_add_rms_norm_ref(layer.x, layer.residual if residual else None, layer.norm_weight, EPS)
    assert torch.equal(summed, want_summed)
    qkv = _kernel_projection(streamed, shape)
    candidates = normed_candidates(layer.x, layer.residual if residual else None, layer.norm_weight, EPS)
    assert torch.equal(candidates[0], normed)
    assert_stage_within_an_ulp(
        qkv,
        candidates,
        lambda n: skinny_linear_ref(n, layer.qkv_weight),
        lambda n: skinny_linear_error_bound(n, layer.qkv_weight),
    )
    k_want, v_want = k_before.clone(), v_before.clone()
    q, k, v = qkv.split([nh * hd, kvh * hd, kvh * hd], dim=-1)
    pos = layer.positions.clamp(0, MAX_POSITION - 1)
    want_q = rotary_kv_write_ref(
        q.view(1, nh, hd),
        k.view(1, kvh, hd),
        v.view(1, kvh, hd),
        pos,
        layer.cos,
        layer.sin,
        k_want,
        v_want,
        layer.slots,
    )
    assert q_rot.shape == (1, nh, hd) and q_rot.dtype == torch.bfloat16
    assert torch.equal(q_rot, want_q)
    assert torch.equal(layer.k_cache, k_want) and torch.equal(layer.v_cache, v_want)
    ref_k, ref_v = k_before.clone(), v_before.clone()
    ref_q, _ = streamed_attn_in_ref(*layer.args(residual, ref_k, ref_v))
    assert (q_rot.float() - ref_q.float()).norm() / ref_q.float().norm() < 0.01
    assert (layer.k_cache.float() - ref_k.float()).norm() / ref_k.float().norm() < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize(
    ("config", "shape"),
    [
        (StreamedAttnInConfig(), LLAMA_1B),
        (StreamedAttnInConfig(), LLAMA_8B),
        (StreamedAttnInConfig(), QWEN3_LIKE),
        (StreamedAttnInConfig(), SMALL),  # programs without a tile
        (StreamedAttnInConfig(stages=8, boxes=1, warps=4), LLAMA_1B),
        (StreamedAttnInConfig(stages=4, boxes=4), LLAMA_8B),
    ],
)
def test_matches_reference_on_hopper(
    monkeypatch, pdl: str, residual: bool, config: StreamedAttnInConfig, shape: tuple[int, int, int, int]
) -> None:
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    monkeypatch.setenv("ASYNCSPEC_PDL", pdl)
    streamed = StreamedAttnIn(torch.device("cuda"), {shape}, config)
    for seed, (position, slot) in enumerate([(1234, 37), (0, 0), (MAX_POSITION - 1, NUM_BLOCKS * BLOCK_SIZE - 1)]):
        _check(streamed, _layer(shape, "cuda", seed, position, slot), shape, residual)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_padding_slot_writes_nothing_and_positions_clamp(monkeypatch, pdl: str) -> None:
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    monkeypatch.setenv("ASYNCSPEC_PDL", pdl)
    streamed = StreamedAttnIn(torch.device("cuda"), {LLAMA_1B}, StreamedAttnInConfig())
    layer = _layer(LLAMA_1B, "cuda", slot=-1)
    k_before, v_before = layer.k_cache.clone(), layer.v_cache.clone()
    _check(streamed, layer, LLAMA_1B, True)
    assert torch.equal(layer.k_cache, k_before) and torch.equal(layer.v_cache, v_before)
    # A position past the cos/sin caches (or before them) is clamped into them.
    for position in (MAX_POSITION + 1000, -5):
        _check(streamed, _layer(LLAMA_1B, "cuda", position=position), LLAMA_1B, True)
    beyond = _layer(LLAMA_1B, "cuda", position=MAX_POSITION + 1000)
    last = _layer(LLAMA_1B, "cuda", position=MAX_POSITION - 1)
    assert torch.equal(streamed(*beyond.args())[0], streamed(*last.args())[0])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_strided_caches() -> None:
    """Caches that are views of a wider tensor (their strides are the kernel's arguments)."""
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    streamed = StreamedAttnIn(torch.device("cuda"), {SMALL}, StreamedAttnInConfig())
    layer = _layer(SMALL, "cuda")
    _, _, kvh, hd = SMALL
    both = torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, kvh, hd, device="cuda").to(torch.bfloat16)
    layer.k_cache, layer.v_cache = both[:, :, 0], both[:, :, 1]
    _check(streamed, layer, SMALL, True)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_replays_in_a_cuda_graph() -> None:
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    streamed = StreamedAttnIn(torch.device("cuda"), {LLAMA_1B}, StreamedAttnInConfig())
    static = _layer(LLAMA_1B, "cuda")  # same weights and caches (seed 0); its row, position and slot get replaced
    streamed(*static.args())  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_rot, summed = streamed(*static.args())
    for seed, (position, slot) in enumerate([(5, 3), (MAX_POSITION + 7, 100), (2000, -1)], start=1):
        fresh = _layer(LLAMA_1B, "cuda", seed, position, slot)
        for name in ("x", "residual", "positions", "slots"):
            getattr(static, name).copy_(getattr(fresh, name))
        want_k, want_v = static.k_cache.clone(), static.v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        want_q, want_summed = streamed_attn_in_ref(*static.args(True, want_k, want_v))
        assert torch.equal(summed, want_summed)
        assert (q_rot.float() - want_q.float()).norm() / want_q.float().norm() < 0.01
        assert (static.k_cache.float() - want_k.float()).norm() / want_k.float().norm() < 0.01
        assert (static.v_cache.float() - want_v.float()).norm() / want_v.float().norm() < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")
def test_applies_only_to_what_it_serves() -> None:
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    streamed = StreamedAttnIn(torch.device("cuda"), {LLAMA_1B}, StreamedAttnInConfig())
    layer = _layer(LLAMA_1B, "cuda")
    args = list(layer.args())
    del args[3]  # applies takes no eps

    def with_(index: int, value) -> list:
        return args[:index] + [value] + args[index + 1 :]

    assert streamed.applies(*args)
    assert streamed.applies(*with_(1, None))  # the first layer
    assert not streamed.applies(*with_(0, torch.cat([layer.x, layer.x])))  # two rows
    assert not streamed.applies(*with_(0, layer.x.float()))
    assert not streamed.applies(*with_(0, layer.x.cpu()))
    assert not streamed.applies(*with_(1, layer.residual.float()))
    assert not streamed.applies(*with_(2, layer.norm_weight[:-1]))
    assert not streamed.applies(*with_(3, layer.qkv_weight[:-16]))  # another shape
    assert not streamed.applies(*with_(3, layer.qkv_weight.t().contiguous().t()))  # strided weight
    assert not streamed.applies(*with_(4, 16))  # heads that do not divide the weight's rows into this shape
    assert not streamed.applies(*with_(6, layer.positions.float()))
    assert not streamed.applies(*with_(7, layer.cos.to(torch.bfloat16)))
    assert not streamed.applies(*with_(8, layer.sin[:, :-1]))
    assert not streamed.applies(*with_(9, layer.k_cache.float()))
    strided = layer.k_cache.transpose(2, 3).contiguous().transpose(2, 3)
    assert not streamed.applies(*with_(9, strided))  # last dimension strided
    assert not streamed.applies(*with_(10, layer.v_cache[:, :, :1]))
    assert not streamed.applies(*with_(11, layer.slots.view(1, 1)))
