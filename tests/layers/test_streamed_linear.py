"""When the streamed GEMV serves an attention's o projection or an MLP's down projection, how it is set up, and what
`DecodeLinear` does with it (no GPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from asyncspec.layers.linear import DecodeLinear
from asyncspec.layers.streamed_linear import (
    STREAMED_DOWN_PROJ_ENV,
    STREAMED_O_PROJ_ENV,
    StreamedLinearSettingError,
    down_projections,
    make_streamed_down_proj,
    make_streamed_o_proj,
    o_projections,
    streamed_down_proj_setting,
    streamed_o_proj_setting,
    use_streamed_down_proj,
    use_streamed_o_proj,
)
from asyncspec.models.llama import LlamaAttention, LlamaMLP
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


class _Attentions(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaAttention(config, i) for i in range(config.num_hidden_layers))


class _MLPs(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaMLP(config) for _ in range(config.num_hidden_layers))


def test_o_projection_setting(monkeypatch) -> None:
    monkeypatch.delenv(STREAMED_O_PROJ_ENV, raising=False)
    assert streamed_o_proj_setting() == "auto"
    for value, want in (("1", "1"), (" Auto", "auto"), ("0", "0")):
        monkeypatch.setenv(STREAMED_O_PROJ_ENV, value)
        assert streamed_o_proj_setting() == want
    monkeypatch.setenv(STREAMED_O_PROJ_ENV, "on")
    with pytest.raises(StreamedLinearSettingError, match=f"{STREAMED_O_PROJ_ENV}='on': .*0 .*1 .*auto"):
        streamed_o_proj_setting()


def test_down_projection_setting(monkeypatch) -> None:
    monkeypatch.delenv(STREAMED_DOWN_PROJ_ENV, raising=False)
    assert streamed_down_proj_setting() == "auto"
    for value, want in (("1", "1"), (" AUTO ", "auto"), ("0", "0")):
        monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, value)
        assert streamed_down_proj_setting() == want
    monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, "yes")
    with pytest.raises(StreamedLinearSettingError, match=f"{STREAMED_DOWN_PROJ_ENV}='yes': .*0 .*1 .*auto"):
        streamed_down_proj_setting()


def test_not_on_the_cpu(monkeypatch, caplog) -> None:
    model = _Attentions(_config())
    for unset in ("auto", "0"):
        monkeypatch.setenv(STREAMED_O_PROJ_ENV, unset)
        with caplog.at_level(logging.WARNING, logger="asyncspec.layers.streamed_linear"):
            assert make_streamed_o_proj(model, torch.device("cpu")) is None
    assert caplog.text == ""  # auto does not warn where the kernel cannot run
    monkeypatch.setenv(STREAMED_O_PROJ_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="asyncspec.layers.streamed_linear"):
        assert make_streamed_o_proj(model, torch.device("cpu")) is None
    assert "streamed o projection is off: cpu is not a CUDA device" in caplog.text


@pytest.mark.parametrize(("sms", "setting", "served"), [(8, "auto", True), (4, "auto", False), (4, "1", True)])
def test_auto_takes_an_o_projection_whose_share_fits_the_ring(
    monkeypatch, sms: int, setting: str, served: bool
) -> None:
    """o_proj [512, 512]: 32 sixteen-row tiles of 16 KiB. Over 8 SMs a program's 4 tiles fill the 64 KiB ring
    exactly, so auto takes it; over 4 SMs its 8 tiles (128 KiB) do not fit, so auto leaves it and 1 still takes it."""
    from asyncspec.layers import streamed_linear

    made: list[tuple[set, str]] = []

    def record(device, projections, config, env, what, setting="1"):
        made.append(({tuple(p.weight.shape) for p in projections}, setting))
        return "gemv"

    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    monkeypatch.setattr(streamed_linear, "num_sms", lambda device: sms)
    monkeypatch.setattr(streamed_linear, "_make_gemv", record)
    monkeypatch.setenv(STREAMED_O_PROJ_ENV, setting)
    got = make_streamed_o_proj(_Attentions(_config()), torch.device("cuda"))
    assert (got == "gemv") == served
    assert made == ([({(512, 512)}, setting)] if served else [])


def test_finds_the_bias_free_o_projections_only() -> None:
    model = _Attentions(_config())
    assert [o is layer.o_proj for o, layer in zip(o_projections(model), model.layers, strict=True)] == [True, True]
    assert o_projections(_Attentions(_config(attention_bias=True))) == []  # Llama: o_proj takes the bias too


class _Recording:
    """Stands in for StreamedGemv: serves what `serves` says, returns a marked tensor and records its calls."""

    def __init__(self, serves: bool) -> None:
        self.serves = serves
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.serves

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.clone(), weight))
        return torch.full((x.shape[0], weight.shape[0]), 7.0)


@torch.no_grad()
def test_decode_linear_takes_the_gemv_only_where_it_applies() -> None:
    layer = DecodeLinear(512, 256, bias=False)
    layer.weight.normal_(0.0, 0.05)
    x = torch.randn(1, 512)
    want = layer(x)

    declining = _Recording(serves=False)
    layer.streamed_gemv = declining  # type: ignore[assignment]
    assert torch.equal(layer(x), want) and declining.calls == []

    serving = _Recording(serves=True)
    layer.streamed_gemv = serving  # type: ignore[assignment]
    assert torch.equal(layer(x), torch.full((1, 256), 7.0))
    ((x_in, weight_in),) = serving.calls
    assert torch.equal(x_in, x) and weight_in is layer.weight

    biased = DecodeLinear(512, 256, bias=True)
    biased.streamed_gemv = serving  # type: ignore[assignment]
    assert torch.equal(biased(x), torch.nn.functional.linear(x, biased.weight, biased.bias))  # never for a bias
    assert len(serving.calls) == 1


def test_use_points_every_o_projection_and_back() -> None:
    model = _Attentions(_config())
    stand_in = _Recording(serves=True)
    assert use_streamed_o_proj(model, stand_in) == 2  # type: ignore[arg-type]
    assert all(layer.o_proj.streamed_gemv is stand_in for layer in model.layers)
    assert all(layer.qkv_proj.streamed_gemv is None for layer in model.layers)
    use_streamed_o_proj(model, None)
    assert all(layer.o_proj.streamed_gemv is None for layer in model.layers)


def test_off_where_no_o_projection_has_a_shape_it_takes(monkeypatch, caplog) -> None:
    from asyncspec.layers import streamed_linear

    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    monkeypatch.setenv(STREAMED_O_PROJ_ENV, "1")
    model = _Attentions(_config(num_attention_heads=4, head_dim=32))  # o_proj [512, 128]: no 256-column box
    with caplog.at_level(logging.WARNING, logger="asyncspec.layers.streamed_linear"):
        assert make_streamed_o_proj(model, torch.device("cuda")) is None
    assert "no bias-free o projection has a shape it takes" in caplog.text


def test_skips_tensor_parallel_attention() -> None:
    model = _Attentions(_config())
    for layer in model.layers:
        layer.tp = type("SplitTP", (), {"enabled": True})()
    assert o_projections(model) == []


def test_finds_the_bias_free_down_projections_only() -> None:
    model = _MLPs(_config())
    assert [d is layer.down_proj for d, layer in zip(down_projections(model), model.layers, strict=True)] == [
        True,
        True,
    ]
    assert down_projections(_MLPs(_config(mlp_bias=True))) == []
    for layer in model.layers:
        layer.tp = type("SplitTP", (), {"enabled": True})()
    assert down_projections(model) == []


def test_down_projection_gemv_is_set_apart_from_the_o_projection(monkeypatch, caplog) -> None:
    model = _MLPs(_config())
    stand_in = _Recording(serves=True)
    assert use_streamed_down_proj(model, stand_in) == 2  # type: ignore[arg-type]
    assert all(layer.down_proj.streamed_gemv is stand_in for layer in model.layers)
    assert all(layer.gate_up_proj.streamed_gemv is None for layer in model.layers)
    assert use_streamed_o_proj(model, None) == 0  # an MLP has no o projection
    use_streamed_down_proj(model, None)
    assert all(layer.down_proj.streamed_gemv is None for layer in model.layers)

    monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="asyncspec.layers.streamed_linear"):
        assert make_streamed_down_proj(model, torch.device("cpu")) is None
    assert f"{STREAMED_DOWN_PROJ_ENV}=1 but the streamed down projection is off: cpu is not a CUDA device" in (
        caplog.text
    )
    caplog.clear()
    # auto, the default, asks only where it can serve: a debug line, no warning nor a line at every start.
    monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, "auto")
    with caplog.at_level(logging.DEBUG, logger="asyncspec.layers.streamed_linear"):
        assert make_streamed_down_proj(model, torch.device("cpu")) is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "auto but the streamed down projection is off: cpu is not a CUDA device" in caplog.text


def test_down_projection_off_where_no_shape_fits(monkeypatch, caplog) -> None:
    from asyncspec.layers import streamed_linear

    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, "1")
    model = _MLPs(_config(intermediate_size=768))  # down [512, 768]: not whole 2-box slots
    with caplog.at_level(logging.WARNING, logger="asyncspec.layers.streamed_linear"):
        assert make_streamed_down_proj(model, torch.device("cuda")) is None
    assert "no bias-free down projection has a shape it takes" in caplog.text


@pytest.mark.parametrize("num_sms", [16, 65])
def test_auto_keeps_shapes_off_the_card_s_measure(monkeypatch, caplog, num_sms: int) -> None:
    """auto, also when unset: 32 tiles are more than 16 SMs can take one a program, and fewer than half of 65."""
    from asyncspec.layers import streamed_linear

    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    properties = type("Properties", (), {"multi_processor_count": num_sms})()
    monkeypatch.setattr(streamed_linear.torch.cuda, "get_device_properties", lambda device: properties)
    model = _MLPs(_config())  # down [512, 1024]: 32 tiles
    for unset in (True, False):
        if unset:
            monkeypatch.delenv(STREAMED_DOWN_PROJ_ENV, raising=False)
        else:
            monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, "auto")
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="asyncspec.layers.streamed_linear"):
            assert make_streamed_down_proj(model, torch.device("cuda")) is None
        assert (
            f"off (auto): shapes [(512, 1024)] do not have between half the {num_sms} SMs and all of them"
            in caplog.text
        )
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # the default: no line at every start


def test_tensor_parallel_mlps_are_named_as_such(monkeypatch, caplog) -> None:
    from asyncspec.layers import streamed_linear

    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    model = _MLPs(_config())
    for layer in model.layers:
        layer.tp = type("SplitTP", (), {"enabled": True})()
    for setting in ("1", "auto"):
        monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, setting)
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="asyncspec.layers.streamed_linear"):
            assert make_streamed_down_proj(model, torch.device("cuda")) is None
        assert "no bias-free down projection outside tensor parallelism" in caplog.text


def test_auto_leaves_the_down_projection_to_a_streamed_mlp(monkeypatch, caplog) -> None:
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels import streamed_gemv_gluon
    from asyncspec.layers import streamed_linear

    monkeypatch.setattr(streamed_linear, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    monkeypatch.setattr(streamed_linear, "num_sms", lambda device: 132)
    monkeypatch.setattr(streamed_gemv_gluon, "StreamedGemv", lambda device, config: config)
    with torch.device("meta"):  # shapes only
        model = _MLPs(_config(hidden_size=2048, intermediate_size=8192))  # the Llama-1B's down projection
    monkeypatch.delenv(STREAMED_DOWN_PROJ_ENV, raising=False)
    assert make_streamed_down_proj(model, torch.device("cuda")) is not None
    model.layers[1].streamed_mlp = object()  # what use_streamed_mlp sets where the streamed MLP serves
    with caplog.at_level(logging.DEBUG, logger="asyncspec.layers.streamed_linear"):
        assert make_streamed_down_proj(model, torch.device("cuda")) is None
    assert "off (auto): the streamed MLP runs the layers' one-row MLP calls" in caplog.text
    monkeypatch.setenv(STREAMED_DOWN_PROJ_ENV, "1")  # asked by name: built for the one-row calls the MLP declines
    assert make_streamed_down_proj(model, torch.device("cuda")) is not None
