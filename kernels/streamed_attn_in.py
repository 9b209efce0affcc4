"""Reference (pure torch) and rules of the streamed attention input: one row's residual add, RMSNorm, fused q|k|v
projection, RoPE on q and k and the paged KV-cache write, as `streamed_attn_in_gluon.py` computes them on Hopper in
one kernel whose loader warp streams the q|k|v weight from the kernel's first instruction, before its PDL wait."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.kernels.rotary_kv_write import rotary_kv_write_ref
from asyncspec.kernels.skinny_linear import skinny_linear_ref
from asyncspec.kernels.streamed_gemv import (
    BOX_BYTES,
    MBARRIER_BYTES,
    SHARED_MEMORY_BYTES,
    StreamedKernelError,
    check_stream_config,
)

__all__ = [
    "StreamedAttnInConfig",
    "StreamedAttnInError",
    "qkv_tiles",
    "shape_supported",
    "stages_for",
    "streamed_attn_in_ref",
    "vectors_bytes",
]


class StreamedAttnInError(StreamedKernelError):
    """A streamed attention-input setting or call that cannot run, with what to change."""


@dataclass(frozen=True)
class StreamedAttnInConfig:
    stages: int = 12
    """Ring slots a program streams its q|k|v weight rows through (fewer where the normalised row needs the
    room)."""
    boxes: int = 2
    """Boxes of 16 rows x 256 columns a slot: consecutive column chunks of the same rows."""
    warps: int = 8
    """Consumer warps a program (one loader warp more)."""
    registers: int = 64
    """Registers a thread at launch, so that other kernels' programs can share an SM with one of these."""

    def __post_init__(self) -> None:
        check_stream_config(self.stages, self.boxes, self.warps, self.registers, StreamedAttnInError)


def qkv_tiles(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """16-row tiles of the q|k|v weight: each 8 rows of one head's first half and the same 8 rows of its second
    half, so that a program holds both rotary halves of every output it rotates."""
    return (num_heads + 2 * num_kv_heads) * head_dim // 16


def vectors_bytes(hidden: int) -> int:
    """Shared memory a program holds besides its ring: the normalised row (fp32) and the mbarriers."""
    return hidden * 4 + MBARRIER_BYTES


def stages_for(config: StreamedAttnInConfig, hidden: int) -> int:
    """The config's ring depth, reduced until the ring and the normalised row fit one program's shared memory."""
    return min(config.stages, (SHARED_MEMORY_BYTES - vectors_bytes(hidden)) // (config.boxes * BOX_BYTES))


def shape_supported(
    config: StreamedAttnInConfig, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the kernel takes a layer of this shape: heads of whole 16-row tiles (8 rows a rotary half), whole
    slots along the hidden width, and a ring of at least 2 slots beside the normalised row."""
    return (
        num_heads > 0
        and num_kv_heads > 0
        and head_dim > 0
        and head_dim % 16 == 0
        and hidden >= 256
        and hidden % (256 * config.boxes) == 0
        and stages_for(config, hidden) >= 2
    )


def streamed_attn_in_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot [T, H, D], x + residual) for x, residual [T, hidden] (residual None: the first layer, the sum is x
    itself), qkv_weight [(H + 2 KVH) D, hidden] (q heads, then k heads, then v heads): the engine's chain of
    fused_add_rms_norm, the q|k|v projection and rotary_kv_write, each result rounded to x.dtype as those kernels
    round it. k_rot and v land in k_cache/v_cache [NB, BS, KVH, D] at slot_mapping (slots < 0: nowhere).

    Positions are clamped into the cos/sin caches, as the kernel clamps them: only a padding row's garbage can lie
    beyond them, and the clamp keeps its loads in bounds."""
    normed, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    qkv = skinny_linear_ref(normed, qkv_weight)
    tokens = x.shape[0]
    head_dim = qkv_weight.shape[0] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q_rot = rotary_kv_write_ref(
        q.reshape(tokens, num_heads, head_dim),
        k.reshape(tokens, num_kv_heads, head_dim),
        v.reshape(tokens, num_kv_heads, head_dim),
        positions[:tokens].clamp(0, cos_cache.shape[0] - 1),
        cos_cache,
        sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
    )
    return q_rot, summed
