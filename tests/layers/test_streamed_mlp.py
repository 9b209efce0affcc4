"""When the streamed MLP serves a decoder layer, how it is set up, and what the layer does with it (no GPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from asyncspec.layers.streamed_mlp import (
    DEFAULT_STREAMED_MLP_FORM,
    STREAMED_MLP_ENV,
    StreamedMLPSettingError,
    make_streamed_mlp,
    served_shapes,
    streamed_mlp_form,
    unavailable_reason,
    use_streamed_mlp,
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
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
            **overrides,
        }
    )


class _Layers(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))


def test_setting_is_auto_unless_set(monkeypatch) -> None:
    monkeypatch.delenv(STREAMED_MLP_ENV, raising=False)
    assert streamed_mlp_form() == "auto"
    monkeypatch.setenv(STREAMED_MLP_ENV, " AUTO ")
    assert streamed_mlp_form() == "auto"
    monkeypatch.setenv(STREAMED_MLP_ENV, "0")
    assert streamed_mlp_form() is None
    monkeypatch.setenv(STREAMED_MLP_ENV, "1")
    assert streamed_mlp_form() == DEFAULT_STREAMED_MLP_FORM
    for form in ("barrier", "split", "split-deep"):
        monkeypatch.setenv(STREAMED_MLP_ENV, form)
        assert streamed_mlp_form() == form
    monkeypatch.setenv(STREAMED_MLP_ENV, "yes")
    with pytest.raises(StreamedMLPSettingError, match="set it to auto .* 0 .* 1 .* barrier .* split .* or split-deep"):
        streamed_mlp_form()


def test_not_on_the_cpu(monkeypatch, caplog) -> None:
    assert "not a CUDA device" in (unavailable_reason(torch.device("cpu")) or "")
    model = _Layers(_config())
    monkeypatch.setenv(STREAMED_MLP_ENV, "0")
    assert make_streamed_mlp(model, torch.device("cpu")) is None
    # auto, the default, asks only where it can serve: a debug line, no warning at every start.
    monkeypatch.delenv(STREAMED_MLP_ENV, raising=False)
    with caplog.at_level(logging.DEBUG, logger="asyncspec.layers.streamed_mlp"):
        assert make_streamed_mlp(model, torch.device("cpu")) is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "=auto but the streamed MLP is off: cpu is not a CUDA device" in caplog.text
    caplog.clear()
    monkeypatch.setenv(STREAMED_MLP_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="asyncspec.layers.streamed_mlp"):
        assert make_streamed_mlp(model, torch.device("cpu")) is None
    assert "streamed MLP is off: cpu is not a CUDA device" in caplog.text


@pytest.mark.parametrize(
    ("hidden", "intermediate", "num_sms", "served"),
    [
        (2048, 8192, 132, True),  # the Llama-1B's: faster on an H100 and an H200
        (4096, 14336, 132, False),  # the 8B's: 256 tiles, slower on an H200
        (512, 1024, 132, False),  # 32 tiles of 1,024 columns
        (2048, 8192, 100, False),  # 128 tiles are more than 100 SMs take one a program
    ],
)
def test_auto_takes_the_deep_split_form_for_the_measured_shapes_only(
    monkeypatch, caplog, hidden: int, intermediate: int, num_sms: int, served: bool
) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels import streamed_mlp_gluon
    from asyncspec.layers import streamed_mlp

    monkeypatch.setattr(streamed_mlp, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    monkeypatch.setattr(streamed_mlp, "num_sms", lambda device: num_sms)
    built: list[tuple] = []
    monkeypatch.setattr(
        streamed_mlp_gluon, "StreamedMLP", lambda device, shapes, config: built.append((shapes, config))
    )
    monkeypatch.delenv(STREAMED_MLP_ENV, raising=False)
    with torch.device("meta"):  # shapes only: no memory for the 8B's weights
        model = _Layers(_config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1))
    with caplog.at_level(logging.DEBUG, logger="asyncspec.layers.streamed_mlp"):
        make_streamed_mlp(model, torch.device("cuda"))
    if served:
        ((shapes, config),) = built
        assert shapes == {(hidden, intermediate)}
        assert (config.grid_barrier, config.co_resident) == (False, False)  # split-deep
    else:
        assert built == []
        assert "do not have between half the GPU's SMs and all of them" in caplog.text
        assert all(r.levelno == logging.DEBUG for r in caplog.records)


@pytest.mark.parametrize(
    ("form", "grid_barrier", "co_resident", "stages"),
    [("1", True, True, 12), ("barrier", True, True, 12), ("split", False, True, 12), ("split-deep", False, False, 16)],
)
def test_each_form_builds_its_config(
    monkeypatch, form: str, grid_barrier: bool, co_resident: bool, stages: int
) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels import streamed_mlp_gluon
    from asyncspec.layers import streamed_mlp

    monkeypatch.setattr(streamed_mlp, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    built: list[tuple] = []
    monkeypatch.setattr(
        streamed_mlp_gluon, "StreamedMLP", lambda device, shapes, config: built.append((shapes, config))
    )
    monkeypatch.setenv(STREAMED_MLP_ENV, form)
    make_streamed_mlp(_Layers(_config()), torch.device("cuda"))
    ((shapes, config),) = built
    assert shapes == {(512, 1024)}
    assert (config.grid_barrier, config.co_resident, config.stages) == (grid_barrier, co_resident, stages)


def test_served_shapes_skip_biased_mlps() -> None:
    assert served_shapes(_Layers(_config())) == {(512, 1024)}
    assert served_shapes(_Layers(_config(mlp_bias=True))) == set()


class _Recording:
    """Stands in for StreamedMLP: serves what `serves` says, returns marked tensors and records its calls."""

    def __init__(self, serves: bool) -> None:
        self.serves = serves
        self.calls: list[tuple] = []

    def applies(self, x, residual, norm_weight, gate_up_weight, down_weight) -> bool:
        return self.serves

    def __call__(self, x, residual, norm_weight, eps, gate_up_weight, down_weight):
        self.calls.append((x.clone(), residual.clone(), eps, gate_up_weight.shape, down_weight.shape))
        return torch.full_like(x, 7.0), torch.full_like(x, -7.0)


class _PassThrough(nn.Module):
    def forward(self, x, rope, kv_cache, attn_metadata):
        return 2 * x


@torch.no_grad()
def test_layer_takes_the_streamed_half_only_where_it_applies() -> None:
    config = _config()
    model = _Layers(config)
    for layer in model.layers:
        layer.self_attn = _PassThrough()
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
    layer = model.layers[0]
    h, residual = torch.randn(1, 512), torch.randn(1, 512)
    want = layer(h, residual, None, None, None)

    declining = _Recording(serves=False)
    assert use_streamed_mlp(model, declining) == 2  # type: ignore[arg-type]
    got = layer(h, residual, None, None, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert declining.calls == []

    serving = _Recording(serves=True)
    use_streamed_mlp(model, serving)  # type: ignore[arg-type]
    out, res = layer(h, residual, None, None, None)
    assert torch.equal(out, torch.full_like(h, 7.0)) and torch.equal(res, torch.full_like(h, -7.0))
    # It is handed the attention's output and the stream after the input norm, as the chain would be.
    x_in, residual_in, eps, gu_shape, down_shape = serving.calls[0]
    _, stream = layer.input_layernorm.forward_residual(h, residual)
    assert torch.equal(residual_in, stream)
    assert torch.equal(x_in, 2 * layer.input_layernorm.forward_residual(h, residual)[0])
    assert eps == config.rms_norm_eps
    assert (tuple(gu_shape), tuple(down_shape)) == ((2048, 512), (512, 1024))

    use_streamed_mlp(model, None)
    got = layer(h, residual, None, None, None)
    assert torch.equal(got[0], want[0])
