"""Rotary position embedding (default, linear and llama3 scaling) with a cos/sin cache indexed by position.

Two ways to apply it, with the same numbers: `apply_rotary` (separate torch ops on cos/sin gathered once per
forward), or, where the attention backend is Triton, one kernel per layer that also writes the KV cache
(asyncspec/kernels/rotary_kv_write_triton.py) reading the fp32 caches at the positions itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncspec.errors import ModelLoadError
from asyncspec.layers.attention import select_backend


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, computed with the same ops as transformers."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope_theta**exponent)
    rope_scaling = rope_scaling or {}
    rope_type = rope_scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_ctx = rope_scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")


@dataclass(frozen=True)
class RotaryInputs:
    """One forward's rotary inputs, shared by all layers."""

    positions: torch.Tensor
    """[T] int64 positions of the step's tokens."""
    cos_cache: torch.Tensor
    """[max_position, head_dim // 2] fp32 (RotaryEmbedding.cos_cache), read by the fused kernel."""
    sin_cache: torch.Tensor
    """[max_position, head_dim // 2] fp32."""
    cos: torch.Tensor | None
    """[T, head_dim // 2] in the activation dtype for `apply_rotary`; None when the layers use the fused kernel."""
    sin: torch.Tensor | None
    """As cos."""


class RotaryEmbedding(nn.Module):
    """Holds cos/sin [max_position, head_dim // 2] in fp32; `forward` gathers them for the step's positions."""

    def __init__(
        self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.reset_non_persistent_buffers(None)

    def reset_non_persistent_buffers(self, device: torch.device | None) -> None:
        """(Re)compute the cache on `device` (None: the default device, meta inside the loader's meta context)."""
        inv_freq = compute_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, device)
        t = torch.arange(self.max_position, device=device, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # one fp32 product per entry, as HF's matmul with K=1
        self.cos_cache = freqs.cos()
        self.sin_cache = freqs.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim // 2] in `dtype` for positions [T]."""
        return self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)

    def step_inputs(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> RotaryInputs:
        """The step's inputs for every layer: cos/sin gathered in `dtype` unless the layers use the fused kernel,
        which gathers (and casts) them itself, saving those launches."""
        cos, sin = (None, None) if fused else self(positions, dtype)
        return RotaryInputs(positions, self.cos_cache, self.sin_cache, cos, sin)


def select_fused_rotary(device: torch.device) -> bool:
    """RoPE fused with the KV write where the attention backend is Triton (one switch for the GPU path)."""
    return select_backend(device).name == "triton"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos/sin [T, D // 2] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    # Same operation order as HF's q * cos + rotate_half(q) * sin so low-precision results agree.
    return torch.cat((x1 * c + (-x2) * s, x2 * c + x1 * s), dim=-1)
