"""When the streamed MLP serves a decoder layer, how it is set up, and what the layer does with it (no GPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from asyncspec.kernels.skinny_linear import FoldedNorm, skinny_linear_add_norm_ref
from asyncspec.layers.streamed_mlp import (
    DEFAULT_STREAMED_MLP_FORM,
    STREAMED_MLP_ENV,
    STREAMED_MLP_NORM_FOLD_ENV,
    StreamedMLPSettingError,
    make_streamed_mlp,
    served_shapes,
    streamed_mlp_form,
    streamed_mlp_norm_fold,
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
        streamed_mlp_gluon, "StreamedMLP", lambda device, shapes, config, fold_next_norm: built.append((shapes, config))
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
        streamed_mlp_gluon,
        "StreamedMLP",
        lambda device, shapes, config, fold_next_norm: built.append((shapes, config, fold_next_norm)),
    )
    monkeypatch.setenv(STREAMED_MLP_ENV, form)
    monkeypatch.setenv(STREAMED_MLP_NORM_FOLD_ENV, "0")
    make_streamed_mlp(_Layers(_config()), torch.device("cuda"))
    monkeypatch.delenv(STREAMED_MLP_NORM_FOLD_ENV)  # on by default
    make_streamed_mlp(_Layers(_config()), torch.device("cuda"))
    (shapes, config, fold_off), (_, _, fold_on) = built
    assert shapes == {(512, 1024)}
    assert (config.grid_barrier, config.co_resident, config.stages) == (grid_barrier, co_resident, stages)
    assert (fold_off, fold_on) == (False, True)


def test_barrier_form_warns_of_no_fold_only_when_asked(monkeypatch, caplog) -> None:
    """The barrier form has its down projection inside its one kernel, so it cannot fold: with the fold on by
    default it says nothing, and asked for by name (=1) it warns that it does not fold."""
    pytest.importorskip("triton.experimental.gluon")
    from asyncspec.kernels import streamed_mlp_gluon
    from asyncspec.layers import streamed_mlp

    monkeypatch.setattr(streamed_mlp, "unavailable_reason", lambda device: None)  # as on a Hopper GPU
    monkeypatch.setattr(streamed_mlp_gluon, "StreamedMLP", lambda device, shapes, config, fold_next_norm: None)
    monkeypatch.setenv(STREAMED_MLP_ENV, "barrier")
    monkeypatch.delenv(STREAMED_MLP_NORM_FOLD_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="asyncspec"):
        make_streamed_mlp(_Layers(_config()), torch.device("cuda"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    monkeypatch.setenv(STREAMED_MLP_NORM_FOLD_ENV, "1")
    with caplog.at_level(logging.INFO, logger="asyncspec"):
        make_streamed_mlp(_Layers(_config()), torch.device("cuda"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the next layer's norm is not folded" in warnings[0]


def test_norm_fold_setting_is_on_unless_0(monkeypatch) -> None:
    monkeypatch.delenv(STREAMED_MLP_NORM_FOLD_ENV, raising=False)
    assert streamed_mlp_norm_fold() is True
    monkeypatch.setenv(STREAMED_MLP_NORM_FOLD_ENV, "0")
    assert streamed_mlp_norm_fold() is False
    monkeypatch.setenv(STREAMED_MLP_NORM_FOLD_ENV, "1")
    assert streamed_mlp_norm_fold() is True
    monkeypatch.setenv(STREAMED_MLP_NORM_FOLD_ENV, "on")
    with pytest.raises(StreamedMLPSettingError, match="ASYNCSPEC_STREAMED_MLP_NORM_FOLD='on'"):
        streamed_mlp_norm_fold()
    monkeypatch.setenv(STREAMED_MLP_ENV, "1")
    with pytest.raises(StreamedMLPSettingError, match="1 \\(on, the default\\) or 0"):
        make_streamed_mlp(_Layers(_config()), torch.device("cpu"))


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


class _ReferenceStreamed:
    """Stands in for StreamedMLP with its contract in torch: the post-attention add + norm and the MLP, and with
    `fold_next_norm` the next norm folded into the down projection (`skinny_linear_add_norm_ref`)."""

    def __init__(self, fold_next_norm: bool) -> None:
        self.fold_next_norm = fold_next_norm
        self.folded_calls = 0

    def applies(self, x, residual, norm_weight, gate_up_weight, down_weight) -> bool:
        return True

    def __call__(self, x, residual, norm_weight, eps, gate_up_weight, down_weight, next_norm=None):
        h = x + residual
        normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight
        gate, up = torch.nn.functional.linear(normed, gate_up_weight).chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        if next_norm is None:
            return torch.nn.functional.linear(act, down_weight), h
        self.folded_calls += 1
        return skinny_linear_add_norm_ref(
            act, down_weight, None, residual=h, norm_weight=next_norm[0], eps=next_norm[1]
        ), h


class _RotaryAttention(nn.Module):
    """Stands in for the attention block: q|k|v with RoPE in its epilogue (`project_rotated`, which scales by a
    folded norm's factors), attending returns q; the chain's forward doubles x."""

    qk_norm = False

    def __init__(self, scales: bool = True, refuses: bool = False) -> None:
        super().__init__()
        self.scales = scales
        self.refuses = refuses
        self.scaled: list[FoldedNorm] = []

    def fused_rotary(self, rope) -> bool:
        return True

    def scales_folded_norm(self, rope) -> bool:
        return self.scales

    def streamable_input(self, rope) -> bool:
        return False

    def project_rotated(self, x, rope, kv_cache, attn_metadata, row_scale=None):
        if self.refuses:
            return None
        if row_scale is not None:
            self.scaled.append(row_scale)
            x = x * row_scale.row_factors()[:, None]
        return 2 * x

    def attend_rotated(self, q_rot, kv_cache, attn_metadata):
        return q_rot

    def forward(self, x, rope, kv_cache, attn_metadata):
        return 2 * x


_NO_ROPE = object()
"""Stands in for the step's RotaryInputs: the stand-in attention reads none of it."""


def _stand_in_layers(num_layers: int) -> _Layers:
    """Decoder layers with random weights (norm weights near 1) and the stand-in attention."""
    model = _Layers(_config(num_hidden_layers=num_layers))
    for layer in model.layers:
        layer.self_attn = _RotaryAttention()
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.05)
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 512, generator=gen), torch.randn(1, 512, generator=gen)


@torch.no_grad()
def test_the_next_norm_folds_into_the_streamed_down_projection() -> None:
    """With `fold_next_norm`, a layer given the next layer's norm returns it folded (the residual stream after the
    block, and h * norm weight with its sums of squares); the next layer scales its q|k|v by the factors instead of
    running the norm, and the last layer, given no norm, returns its plain output: the model's numbers are the
    unfolded chain's (fp32 here: to the sums' rounding)."""
    model = _stand_in_layers(3)
    layers = list(model.layers)

    def run(streamed: _ReferenceStreamed) -> tuple[torch.Tensor, torch.Tensor, list]:
        use_streamed_mlp(model, streamed)  # type: ignore[arg-type]
        h, residual = _inputs()
        outputs = []
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            h, residual = layer(h, residual, _NO_ROPE, None, None, next_norm)
            outputs.append(h)
        return h, residual, outputs

    plain_out, plain_residual, plain_outputs = run(_ReferenceStreamed(fold_next_norm=False))
    folding = _ReferenceStreamed(fold_next_norm=True)
    out, residual, outputs = run(folding)
    assert folding.folded_calls == 2
    assert [isinstance(o, FoldedNorm) for o in outputs] == [True, True, False]
    assert not any(isinstance(o, FoldedNorm) for o in plain_outputs)
    # The layers after the first scaled their projection by the fold's factors; the first ran its own norm.
    assert [len(layer.self_attn.scaled) for layer in layers] == [0, 1, 1]
    torch.testing.assert_close(out, plain_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, plain_residual, rtol=1e-5, atol=1e-5)
    # The fold's factor is the next norm's: rsqrt(mean(h^2) + eps) of the residual stream after the block.
    first = outputs[0]
    assert isinstance(first, FoldedNorm)
    norm = layers[1].input_layernorm
    block_out, stream_before = layers[0](*_inputs(), _NO_ROPE, None, None)  # unfolded: the next norm adds them
    stream = block_out + stream_before
    want = torch.rsqrt(stream.pow(2).mean(dim=-1) + norm.eps)
    torch.testing.assert_close(first.row_factors(), want, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("why", ["qk_norm", "no_rotary_kernel", "streamed_attn_in"])
@torch.no_grad()
def test_no_fold_where_the_next_layer_cannot_scale(why: str) -> None:
    """A q/k norm or no rotary epilogue's kernel keeps q|k|v from scaling by the factors, and the streamed attention
    input takes the norm itself: the streamed MLP is not asked to fold."""
    model = _Layers(_config())
    for layer in model.layers:
        layer.self_attn = _RotaryAttention(scales=why != "no_rotary_kernel")
        layer.self_attn.qk_norm = why == "qk_norm"
        if why == "streamed_attn_in":
            layer.streamed_attn_in = object()
    folding = _ReferenceStreamed(fold_next_norm=True)
    use_streamed_mlp(model, folding)  # type: ignore[arg-type]
    h, residual = torch.randn(1, 512), torch.randn(1, 512)
    rope = _NO_ROPE
    out, _ = model.layers[0](h, residual, rope, None, None, model.layers[1].input_layernorm)
    assert not isinstance(out, FoldedNorm) and folding.folded_calls == 0


@torch.no_grad()
def test_a_fold_the_next_projection_refuses_is_unfolded() -> None:
    """Where the next layer's rotary kernel refuses the call after all, the layer unfolds the norm in torch: the
    numbers stay the unfolded chain's."""
    model = _stand_in_layers(2)
    first, second = model.layers
    use_streamed_mlp(model, _ReferenceStreamed(fold_next_norm=False))  # type: ignore[arg-type]
    want = second(*first(*_inputs(), _NO_ROPE, None, None, None), _NO_ROPE, None, None)
    use_streamed_mlp(model, _ReferenceStreamed(fold_next_norm=True))  # type: ignore[arg-type]
    folded = first(*_inputs(), _NO_ROPE, None, None, second.input_layernorm)
    assert isinstance(folded[0], FoldedNorm)
    second.self_attn.refuses = True
    got = second(*folded, _NO_ROPE, None, None)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
