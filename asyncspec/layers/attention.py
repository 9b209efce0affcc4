"""Attention front-end: write the step's K/V into the paged cache (alone, or fused with RoPE), then attend."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from asyncspec.errors import ConfigError
from asyncspec.kernels.kv_cache_write import write_kv_cache_ref
from asyncspec.kernels.paged_attention import paged_attention_ref
from asyncspec.kernels.prepare_inputs import prepare_inputs_ref
from asyncspec.kernels.rotary_kv_write import rotary_kv_write_ref
from asyncspec.kernels.slot_mapping import compute_slot_mapping_ref
from asyncspec.layers.attention_metadata import AttentionMetadata
from asyncspec.layers.switches import on_off_switch


@dataclass(frozen=True)
class AttentionBackend:
    """The step's kernels, each with its reference's signature."""

    name: str
    """Human-readable backend name."""
    write_kv: Callable[..., None]
    """write_kv(key, value, k_cache, v_cache, slot_mapping)."""
    attend: Callable[..., torch.Tensor]
    """attend(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out, sliding_window)."""
    slot_mapping: Callable[..., torch.Tensor]
    """slot_mapping(block_tables, query_start_loc, positions, block_size) -> slots, -1 for padding."""
    rotary_kv_write: Callable[..., torch.Tensor]
    """rotary_kv_write(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, *, q_out) -> q_rot:
    RoPE on q and k fused with write_kv."""
    prepare_inputs: Callable[..., None]
    """prepare_inputs(meta, num_reqs, num_tokens, token_ids, block_tables, block_size, input_ids, positions,
    slot_mapping, query_start_loc, seq_lens, capacity=None, resolve=None): a step's model inputs from
    per-request counts; resolve=(n, device_counts) first takes the first n requests' computed counts from the
    device's own (resolve_computed_ref), in the same launch where it can."""


TORCH_REFERENCE = AttentionBackend(
    "torch_reference",
    write_kv_cache_ref,
    paged_attention_ref,
    compute_slot_mapping_ref,
    rotary_kv_write_ref,
    prepare_inputs_ref,
)


# The Triton kernels are imported on first call, not here: importing triton is slow and optional on the CPU,
# and a late module lookup picks up a re-import done under TRITON_INTERPRET=1 (tests do that).
def _triton_write_kv(*args, **kwargs) -> None:
    from asyncspec.kernels import kv_cache_write_triton

    kv_cache_write_triton.write_kv_cache(*args, **kwargs)


def _triton_attend(*args, **kwargs) -> torch.Tensor:
    from asyncspec.kernels import paged_attention_triton

    return paged_attention_triton.paged_attention(*args, **kwargs)


def _triton_slot_mapping(*args, **kwargs) -> torch.Tensor:
    from asyncspec.kernels import slot_mapping_triton

    return slot_mapping_triton.compute_slot_mapping(*args, **kwargs)


def _triton_prepare_inputs(*args, **kwargs) -> None:
    from asyncspec.kernels import prepare_inputs_triton

    prepare_inputs_triton.prepare_inputs(*args, **kwargs)


def _triton_rotary_kv_write(*args, **kwargs) -> torch.Tensor:
    from asyncspec.kernels import rotary_kv_write_triton

    return rotary_kv_write_triton.rotary_kv_write(*args, **kwargs)


TRITON = AttentionBackend(
    "triton",
    _triton_write_kv,
    _triton_attend,
    _triton_slot_mapping,
    _triton_rotary_kv_write,
    _triton_prepare_inputs,
)


class AttentionSettingError(ConfigError):
    """An attention setting (environment variable) that cannot be honoured, with what to change."""


FUSED_COMBINE_ENV = "ASYNCSPEC_ATTN_FUSED_COMBINE"
"""1: a split-KV attention call merges its splits in its split pass (the last program of each query tile and KV
head to finish), with no combine kernel; 0 (the default): the combine kernel merges them."""

EARLY_KV_ENV = "ASYNCSPEC_ATTN_EARLY_KV"
"""1: the Triton attention reads the step inputs and each program's first tile of older keys (below its request's
context) before its PDL wait (`paged_attention(early_kv=True)`); 0 (the default): everything after the wait."""

BACKEND_ENV = "ASYNCSPEC_ATTENTION_BACKEND"
"""Environment override: "torch" or "triton" (e.g. triton on the CPU under TRITON_INTERPRET=1)."""


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device: torch.device) -> AttentionBackend:
    """Triton for CUDA devices when triton imports, else the torch reference; $ASYNCSPEC_ATTENTION_BACKEND overrides."""
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice == "torch":
        return TORCH_REFERENCE
    if choice == "triton":
        return TRITON
    if choice:
        raise ConfigError(f"{BACKEND_ENV} must be 'torch' or 'triton', got {choice!r}")
    if torch.device(device).type == "cuda" and _triton_available():
        return TRITON
    return TORCH_REFERENCE


def allocate_paged_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


class Attention(nn.Module):
    """Paged multi-head attention with GQA over one layer's (k_cache, v_cache)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend: AttentionBackend | None = None
        self.combine_counters: torch.Tensor | None = None
        """The Triton kernel's arrival counters (`use_fused_combine`): a split call then merges its splits in its
        split pass. None: the combine kernel merges them."""
        self.early_kv = False
        """Whether the Triton kernel reads its inputs and older keys before its PDL wait (`use_early_kv`)."""

    def compile_kernel_variants(self, kv_cache: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> int:
        """Compiles (or loads from Triton's disk cache) every tile variant of the attention kernel for this layer's
        heads at start-up (`compile_tile_variants`); nothing with the torch reference. Returns the calls made."""
        if self._backend(kv_cache[0].device).name != "triton":
            return 0
        from asyncspec.kernels import paged_attention_triton

        k_cache, v_cache = kv_cache
        return paged_attention_triton.compile_tile_variants(
            self.num_heads,
            k_cache,
            v_cache,
            dtype,
            self.scale,
            self.sliding_window,
            self.combine_counters,
            early_kv=self.early_kv,
        )

    def _backend(self, device: torch.device) -> AttentionBackend:
        if self.backend is None:
            self.backend = select_backend(device)
        return self.backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        k_cache, v_cache = kv_cache
        self._backend(q.device).write_kv(k, v, k_cache, v_cache, attn_metadata.slot_mapping)
        return self.attend(q, kv_cache, attn_metadata)

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """`forward` on q/k not yet rotated: RoPE at positions [T] from the fp32 cos/sin caches
        [max_position, D // 2] and the K/V write in one kernel (q is rotated in place), then attention."""
        k_cache, v_cache = kv_cache
        backend = self._backend(q.device)
        q = backend.rotary_kv_write(
            q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, attn_metadata.slot_mapping, q_out=q
        )
        return self.attend(q, kv_cache, attn_metadata)

    def attend(
        self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of q [T, H, D] over the cache, which already holds this step's K/V -> [T, H, D]."""
        k_cache, v_cache = kv_cache
        backend = self._backend(q.device)
        # Only the Triton kernel takes counters and early reads; the reference keeps its own signature.
        extra: dict[str, object] = {}
        if backend is TRITON:
            if self.combine_counters is not None:
                extra["counters"] = self.combine_counters
            if self.early_kv:
                extra["early_kv"] = True
        return backend.attend(
            q,
            k_cache,
            v_cache,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_tables,
            self.scale,
            None,
            self.sliding_window,
            **extra,
        )


def use_fused_combine(model: nn.Module, device: torch.device) -> int:
    """Where ASYNCSPEC_ATTN_FUSED_COMBINE=1 and the Triton kernel serves `device`, gives every `Attention` of
    `model` one set of arrival counters, so that its split calls merge their splits in the split pass; the layers
    run one after another on one stream, so they share it. Returns how many layers took them (0 when off)."""
    if not on_off_switch(FUSED_COMBINE_ENV, default=False, error=AttentionSettingError):
        return 0
    if select_backend(device) is not TRITON:
        return 0
    from asyncspec.kernels.paged_attention_triton import make_combine_counters

    counters = make_combine_counters(device)
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for layer in layers:
        layer.combine_counters = counters
    return len(layers)


def use_early_kv(model: nn.Module, device: torch.device) -> int:
    """Where ASYNCSPEC_ATTN_EARLY_KV=1 and the Triton kernel serves `device`, has every `Attention` of `model` read
    its step inputs and older keys before its PDL wait. Returns how many layers took it (0 when off)."""
    if not on_off_switch(EARLY_KV_ENV, default=False, error=AttentionSettingError):
        return 0
    if select_backend(device) is not TRITON:
        return 0
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    for layer in layers:
        layer.early_kv = True
    return len(layers)
