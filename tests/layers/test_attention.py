"""How the attention layers take the split pass that merges its own splits (`ASYNCSPEC_ATTN_FUSED_COMBINE`) and the
early reads (`ASYNCSPEC_ATTN_EARLY_KV`), and what `Attention.attend` hands each backend (no GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncspec.layers.attention import (
    BACKEND_ENV,
    EARLY_KV_ENV,
    FUSED_COMBINE_ENV,
    TORCH_REFERENCE,
    TRITON,
    Attention,
    AttentionSettingError,
    use_early_kv,
    use_fused_combine,
)
from asyncspec.layers.attention_metadata import AttentionMetadata


def _model() -> nn.Module:
    return nn.ModuleList([nn.ModuleDict({"attn": Attention(4, 2, 16, 0.25)}) for _ in range(3)])


def _layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def test_off_by_default(monkeypatch) -> None:
    monkeypatch.delenv(FUSED_COMBINE_ENV, raising=False)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    model = _model()
    assert use_fused_combine(model, torch.device("cpu")) == 0
    assert all(layer.combine_counters is None for layer in _layers(model))


def test_every_layer_shares_one_set_of_zeroed_counters(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv(FUSED_COMBINE_ENV, "1")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    model = _model()
    assert use_fused_combine(model, torch.device("cpu")) == 3
    counters = {id(layer.combine_counters) for layer in _layers(model)}
    first = _layers(model)[0].combine_counters
    assert len(counters) == 1 and first is not None
    assert first.dtype == torch.int32 and not first.any() and first.numel() >= 4096


def test_not_with_the_torch_reference(monkeypatch) -> None:
    monkeypatch.setenv(FUSED_COMBINE_ENV, "1")
    monkeypatch.setenv(BACKEND_ENV, "torch")
    model = _model()
    assert use_fused_combine(model, torch.device("cpu")) == 0
    assert all(layer.combine_counters is None for layer in _layers(model))


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_other_values_are_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv(FUSED_COMBINE_ENV, value)
    model = _model()
    with pytest.raises(AttentionSettingError, match=f"{FUSED_COMBINE_ENV}='{value}': set it to 0"):
        use_fused_combine(model, torch.device("cpu"))
    assert all(layer.combine_counters is None for layer in _layers(model))


def _call(layer: Attention) -> torch.Tensor:
    q = torch.randn(2, 4, 16)
    kv_cache = (torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([3, 12]),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([4, 5], dtype=torch.int32),
        block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=5,
        block_size=8,
    )
    return layer.attend(q, kv_cache, meta)


def _triton_kwargs(monkeypatch) -> list[dict]:
    """Stands in for the Triton kernel; returns the keyword arguments of each call, as they come."""
    pytest.importorskip("triton")
    from asyncspec.kernels import paged_attention_triton

    seen: list[dict] = []

    def spy(*args, **kwargs) -> torch.Tensor:
        seen.append(kwargs)
        return torch.zeros_like(args[0])

    monkeypatch.setattr(paged_attention_triton, "paged_attention", spy)
    return seen


def test_attend_hands_the_counters_to_the_triton_kernel(monkeypatch) -> None:
    seen = _triton_kwargs(monkeypatch)
    layer = Attention(4, 2, 16, 0.25)
    layer.backend = TRITON
    _call(layer)
    layer.combine_counters = torch.zeros(16, dtype=torch.int32)
    _call(layer)
    assert "counters" not in seen[0] and seen[1]["counters"] is layer.combine_counters


def test_the_reference_never_gets_counters() -> None:
    layer = Attention(4, 2, 16, 0.25)
    layer.backend = TORCH_REFERENCE
    plain = _call(layer)
    layer.combine_counters = torch.zeros(16, dtype=torch.int32)  # as if set before the backend was chosen
    assert _call(layer).shape == plain.shape  # paged_attention_ref would refuse a `counters` argument


def test_early_kv_is_off_unless_asked_and_only_for_triton(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.delenv(EARLY_KV_ENV, raising=False)
    model = _model()
    assert use_early_kv(model, torch.device("cpu")) == 0
    assert not any(layer.early_kv for layer in _layers(model))
    monkeypatch.setenv(EARLY_KV_ENV, "1")
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert use_early_kv(model, torch.device("cpu")) == 0
    assert not any(layer.early_kv for layer in _layers(model))
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert use_early_kv(model, torch.device("cpu")) == 3
    assert all(layer.early_kv for layer in _layers(model))


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_early_kv_other_values_are_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv(EARLY_KV_ENV, value)
    model = _model()
    with pytest.raises(AttentionSettingError, match=f"{EARLY_KV_ENV}='{value}': set it to 0"):
        use_early_kv(model, torch.device("cpu"))
    assert not any(layer.early_kv for layer in _layers(model))


def test_attend_asks_the_triton_kernel_for_early_reads_only_when_set(monkeypatch) -> None:
    seen = _triton_kwargs(monkeypatch)
    layer = Attention(4, 2, 16, 0.25)
    layer.backend = TRITON
    _call(layer)
    layer.early_kv = True
    _call(layer)
    assert "early_kv" not in seen[0] and seen[1]["early_kv"] is True
    layer.backend = TORCH_REFERENCE
    assert _call(layer).shape == (2, 4, 16)  # paged_attention_ref would refuse an `early_kv` argument
