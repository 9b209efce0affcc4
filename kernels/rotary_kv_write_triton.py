"""Triton rotary embedding fused with the paged KV-cache write (same contract as `rotary_kv_write_ref`).

One launch replaces the model's separate ops: the per-step cos/sin gather and cast, the slices, products,
negation, sums and concatenations that rotate q and k, and the KV-cache write. The grid is (token, part):
part 0 rotates the token's q heads, part 1 rotates its k heads and writes them with its v heads to the cache
slot (nothing for a slot < 0). Each half of the head dim is a [heads, BLOCK_HALF] tile, so any even head_dim
works (80 = 2 x 40 masked in 64-wide tiles).

The numbers are torch's op by op: cos/sin rounded to the activation dtype, every product and every sum
rounded to it (bf16 by hand, see triton_rounding), so bf16/fp16 results are bit-identical to the reference.
FMA contraction is disabled at compile time (enable_fp_fusion=False): otherwise fp32 products, and fp16 ones
(which LLVM narrows to f16 math and fuses into fma.rn.f16), would reach the sum unrounded, unlike torch's.
Only shapes are read on the host: the launch never syncs with the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncspec.kernels.pdl import pdl_launch_options, pdl_mode, pdl_start
from asyncspec.kernels.triton_rounding import round_to_dtype, rounded_fp32


@triton.jit
def rotate_halves(x1, x2, cos, sin, DTYPE: tl.constexpr):
    """(x1 * cos + (-x2) * sin, x2 * cos + x1 * sin) in DTYPE, each product and each sum rounded to DTYPE (also
    the rotary epilogue of skinny_linear_rotary)."""
    lo = rounded_fp32(rounded_fp32(x1 * cos, DTYPE) + rounded_fp32(-x2 * sin, DTYPE), DTYPE)
    hi = rounded_fp32(rounded_fp32(x2 * cos, DTYPE) + rounded_fp32(x1 * sin, DTYPE), DTYPE)
    return lo, hi


@triton.jit
def _rotary_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    qo_stride_t,
    qo_stride_h,
    cos_stride,
    sin_stride,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    max_position,
    block_size,
    num_heads,
    num_kv_heads,
    half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    # A position past the cache can only be a padding row's garbage: clamped, so that no load strays.
    pos = tl.load(positions_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_position - 1)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half_dim
    cos = rounded_fp32(tl.load(cos_ptr + pos * cos_stride + d, mask=d_mask, other=0.0).to(tl.float32), DTYPE)[None, :]
    sin = rounded_fp32(tl.load(sin_ptr + pos * sin_stride + d, mask=d_mask, other=0.0).to(tl.float32), DTYPE)[None, :]
    # Compiled, both branches are one scf.if: a name bound in both must have one type, hence q_ / kv_ names.
    if tl.program_id(1) == 0:
        q_h = tl.arange(0, BLOCK_H)[:, None]
        q_mask = (q_h < num_heads) & d_mask[None, :]
        # Both halves are loaded before either is stored, so q_out may be q itself (rotation in place).
        q_src = q_ptr + t * q_stride_t + q_h * q_stride_h + d[None, :]
        q1 = tl.load(q_src, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_src + half_dim, mask=q_mask, other=0.0).to(tl.float32)
        q_lo, q_hi = rotate_halves(q1, q2, cos, sin, DTYPE)
        q_dst = q_out_ptr + t * qo_stride_t + q_h * qo_stride_h + d[None, :]
        tl.store(q_dst, q_lo.to(q_out_ptr.dtype.element_ty), mask=q_mask)
        tl.store(q_dst + half_dim, q_hi.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    else:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        kv_h = tl.arange(0, BLOCK_KVH)[:, None]
        # Padded tokens carry slot -1: masking every access means they are never written.
        kv_mask = (slot >= 0) & (kv_h < num_kv_heads) & d_mask[None, :]
        safe_slot = tl.maximum(slot, 0)
        blk = safe_slot // block_size
        off = safe_slot % block_size
        k_src = k_ptr + t * k_stride_t + kv_h * k_stride_h + d[None, :]
        k1 = tl.load(k_src, mask=kv_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + half_dim, mask=kv_mask, other=0.0).to(tl.float32)
        k_lo, k_hi = rotate_halves(k1, k2, cos, sin, DTYPE)
        # The values are exact in DTYPE; one rounding to the cache dtype is torch's `.to(k_cache.dtype)`.
        kc = k_cache_ptr + blk * kc_stride_b + off * kc_stride_s + kv_h * kc_stride_h + d[None, :]
        tl.store(kc, round_to_dtype(k_lo, k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(kc + half_dim, round_to_dtype(k_hi, k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v_src = v_ptr + t * v_stride_t + kv_h * v_stride_h + d[None, :]
        v1 = tl.load(v_src, mask=kv_mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + half_dim, mask=kv_mask, other=0.0).to(tl.float32)
        vc = v_cache_ptr + blk * vc_stride_b + off * vc_stride_s + kv_h * vc_stride_h + d[None, :]
        tl.store(vc, round_to_dtype(v1, v_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(vc + half_dim, round_to_dtype(v2, v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k by RoPE at `positions`, write k_rot and v into the paged caches; returns q_rot.

    Shapes and semantics as `rotary_kv_write_ref`. q/k/v may be strided views (e.g. of a fused QKV output) as
    long as the head dim is dense; nothing is copied. `q_out` may be q itself (rotated in place). Positions
    outside [0, max_position) are clamped (the reference would raise): only padding rows carry them.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0, "RoPE needs an even head dim"
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert cos_cache.shape == sin_cache.shape and cos_cache.shape[1] == head_dim // 2, cos_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape, k_cache.shape
    assert positions.shape[0] >= num_tokens and slot_mapping.shape[0] >= num_tokens
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert q_out.shape == q.shape and q_out.dtype == q.dtype, (q_out.shape, q_out.dtype)
    for t in (q, k, v, q_out, cos_cache, sin_cache, k_cache, v_cache):
        assert t.stride(-1) == 1, "the last dim must be dense"
    assert positions.stride(0) == 1 and slot_mapping.stride(0) == 1
    if num_tokens == 0:
        return q_out
    block_h = triton.next_power_of_2(num_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    # The q part holds 2 x [BLOCK_H, BLOCK_HALF] values: about 16 per thread.
    num_warps = min(max(2 * block_h * block_half // (16 * 32), 1), 8)
    pdl = pdl_mode(q.device, q.shape[0])
    _rotary_kv_write_kernel[(num_tokens, 2)](
        q,
        k,
        v,
        q_out,
        positions,
        cos_cache,
        sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        cos_cache.shape[0],
        k_cache.shape[1],
        num_heads,
        num_kv_heads,
        head_dim // 2,
        BLOCK_H=block_h,
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half,
        USE_PDL=pdl,
        num_warps=num_warps,
        enable_fp_fusion=False,
        **pdl_launch_options(pdl),
    )
    return q_out
