"""When the streamed attention input serves a decoder layer, how it is set up, and what the layer does with it
(no GPU)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from asyncspec.layers.rotary import RotaryInputs
from asyncspec.layers.streamed_attn_in import (
    STREAMED_ATTN_IN_ENV,
    StreamedAttnInSettingError,
    make_streamed_attn_in,
    served_shapes,
    streamed_attn_in_requested,
    use_streamed_attn_in,
)
from asyncspec.models.llama import LlamaDecoderLayer
from asyncspec.models.model_config import ModelConfig


def _config(**overrides) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            **overrides,
        }
    )


def test_setting_is_off_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv(STREAMED_ATTN_IN_ENV, raising=False)
    assert not streamed_attn_in_requested()
    monkeypatch.setenv(STREAMED_ATTN_IN_ENV, "1")
    assert streamed_attn_in_requested()
    monkeypatch.setenv(STREAMED_ATTN_IN_ENV, "true")
    with pytest.raises(StreamedAttnInSettingError, match="set it to 0 .* or 1"):
        streamed_attn_in_requested()


def test_not_on_the_cpu(monkeypatch, caplog) -> None:
    layer = LlamaDecoderLayer(_config(), 0)
    monkeypatch.delenv(STREAMED_ATTN_IN_ENV, raising=False)
    assert make_streamed_attn_in(layer, torch.device("cpu")) is None
    monkeypatch.setenv(STREAMED_ATTN_IN_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="asyncspec.layers.streamed_attn_in"):
        assert make_streamed_attn_in(layer, torch.device("cpu")) is None
    assert "streamed attention input is off: cpu is not a CUDA device" in caplog.text


def test_served_shapes_skip_qk_norm_and_bias() -> None:
    assert served_shapes(LlamaDecoderLayer(_config(), 0)) == {(512, 8, 2, 64)}
    assert served_shapes(LlamaDecoderLayer(_config(attention_bias=True), 0)) == set()
    qwen3 = _config(architectures=["Qwen3ForCausalLM"], head_dim=64)
    assert served_shapes(LlamaDecoderLayer(qwen3, 0)) == set()


class _Recording:
    """Stands in for StreamedAttnIn: serves what `serves` says, returns marked tensors and records its calls."""

    def __init__(self, serves: bool) -> None:
        self.serves = serves
        self.calls: list[tuple] = []

    def applies(self, x, residual, norm_weight, qkv_weight, num_heads, num_kv_heads, *rest) -> bool:
        return self.serves

    def __call__(self, x, residual, norm_weight, eps, qkv_weight, num_heads, num_kv_heads, positions, *rest):
        self.calls.append((x.clone(), None if residual is None else residual.clone(), eps, num_heads, num_kv_heads))
        return torch.full((1, num_heads, 64), 5.0), torch.full_like(x, -5.0)


@torch.no_grad()
def test_layer_takes_the_streamed_input_only_where_it_applies() -> None:
    config = _config()
    layer = LlamaDecoderLayer(config, 0)
    for p in layer.parameters():
        p.normal_(0.0, 0.05)
    attn = layer.self_attn
    attn.forward = lambda x, rope, kv_cache, attn_metadata: 2 * x  # type: ignore[method-assign]
    rotated: list[torch.Tensor] = []

    def attend_rotated(q_rot, kv_cache, attn_metadata):
        rotated.append(q_rot)
        return 3 * q_rot.reshape(1, -1)

    attn.attend_rotated = attend_rotated  # type: ignore[method-assign]
    cache = torch.zeros(4, 16, 64)
    rope = RotaryInputs(torch.zeros(1, dtype=torch.long), cache, cache, None, None)  # the Triton path: cos None
    kv_cache = (torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64))
    metadata = SimpleNamespace(slot_mapping=torch.zeros(1, dtype=torch.long))
    h, residual = torch.randn(1, 512), torch.randn(1, 512)
    want = layer(h, residual, rope, kv_cache, metadata)

    declining = _Recording(serves=False)
    assert use_streamed_attn_in(layer, declining) == 1  # type: ignore[arg-type]
    got = layer(h, residual, rope, kv_cache, metadata)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert declining.calls == [] and rotated == []

    serving = _Recording(serves=True)
    use_streamed_attn_in(layer, serving)  # type: ignore[arg-type]
    out, res = layer(h, residual, rope, kv_cache, metadata)
    ((x_in, residual_in, eps, heads, kv_heads),) = serving.calls
    assert torch.equal(x_in, h) and torch.equal(residual_in, residual)  # the raw stream: it adds and norms itself
    assert (eps, heads, kv_heads) == (config.rms_norm_eps, 8, 2)
    assert torch.equal(rotated[0], torch.full((1, 8, 64), 5.0))
    # The MLP half runs on the attention's output and the stream the kernel returned.
    attn_out, stream = torch.full((1, 512), 15.0), torch.full((1, 512), -5.0)
    want_out, want_res = (
        layer.mlp(layer.post_attention_layernorm.forward_residual(attn_out, stream)[0]),
        attn_out + stream,
    )
    assert torch.allclose(out, want_out) and torch.allclose(res, want_res)

    # Not with cos/sin gathered (the CPU path's rotary): the streamed kernel needs the Triton path's caches.
    eager_rope = RotaryInputs(rope.positions, cache, cache, torch.ones(1, 32), torch.zeros(1, 32))
    layer(h, residual, eager_rope, kv_cache, metadata)
    assert len(serving.calls) == 1


def test_the_engines_ring_fits_beside_the_split_mlps_down_projection() -> None:
    """RING_STAGES is chosen so that a program of the attention input fits an SM beside a program of the kernel
    before it, the split streamed MLP's down projection (Llama-1B shapes, as compiled for sm_90)."""
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels.streamed_attn_in import StreamedAttnInConfig
    from asyncspec.kernels.streamed_attn_in_gluon import compile_for_hopper
    from asyncspec.kernels.streamed_gemv import PROGRAM_RESERVED_BYTES, SM_SHARED_MEMORY_BYTES, StreamedGemvConfig
    from asyncspec.kernels.streamed_gemv_gluon import compile_for_hopper as compile_gemv
    from asyncspec.kernels.streamed_mlp import StreamedMLPConfig, split_down_room, stages_for
    from asyncspec.layers.streamed_attn_in import RING_STAGES

    attn_in = compile_for_hopper(StreamedAttnInConfig(stages=RING_STAGES), 2048, 32, 8, 64)
    mlp = StreamedMLPConfig(grid_barrier=False)
    down_config = StreamedGemvConfig(stages_for(mlp, 2048, 8192), mlp.boxes, mlp.warps, mlp.registers)
    down = compile_gemv(down_config, 2048, 8192, room=split_down_room(mlp, 2048, 8192))
    assert attn_in.metadata.shared + down.metadata.shared + 2 * PROGRAM_RESERVED_BYTES <= SM_SHARED_MEMORY_BYTES
