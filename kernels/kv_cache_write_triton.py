"""Triton scatter of new keys/values into the paged KV cache (same contract as `write_kv_cache_ref`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncspec.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start


@triton.jit
def _kv_cache_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)
    # One program per token: all its KV heads at once, so the slot is read once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # Padded tokens carry slot -1: masking every access means they are never written.
    mask = (slot >= 0) & (h[:, None] < num_kv_heads) & (d[None, :] < head_dim)
    safe_slot = tl.maximum(slot, 0)
    blk = safe_slot // block_size
    off = safe_slot % block_size
    k = tl.load(key_ptr + t * k_stride_t + h[:, None] * k_stride_h + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * v_stride_t + h[:, None] * v_stride_h + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * kc_stride_b + off * kc_stride_s + h[:, None] * kc_stride_h + d[None, :]
    vc = v_cache_ptr + blk * vc_stride_b + off * vc_stride_s + h[:, None] * vc_stride_h + d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, KVH, D] into caches [NB, BS, KVH, D] at flat slots; slots < 0 are skipped.

    key/value may be strided views (e.g. slices of a fused QKV output) as long as the head dim is contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dim must be contiguous"
    assert slot_mapping.shape[0] >= num_tokens and slot_mapping.is_contiguous()
    pdl = pdl_enabled(key.device)
    _kv_cache_write_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_size,
        num_kv_heads,
        head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        USE_PDL=pdl,
        **pdl_launch_options(pdl),
    )
