"""Triton residual add fused with RMSNorm (same contract as `fused_add_rms_norm_ref`).

One program normalises BLOCK_T rows held whole in a [BLOCK_T, BLOCK_H] tile (BLOCK_H = H rounded up to a
power of two; several rows per program when H is small): it reads x (and residual) once, writes the sum and the
normalised rows, all fp32 math with RMSNorm's casts (sum stored in x.dtype, normalised h cast to x.dtype before
the weight multiply). Only shapes are read on the host, so the launch never syncs with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncspec.kernels.pdl import pdl_launch_options, pdl_mode, pdl_start
from asyncspec.kernels.triton_rounding import round_to_dtype

_MAX_BLOCK_H = 65536  # rows are held whole in registers
_TILE = 4096  # elements per program when several rows share one


@triton.jit(do_not_specialize=["num_rows"])
def _fused_add_rms_norm_kernel(
    x_ptr,
    x_stride,
    res_ptr,
    res_stride,
    w_ptr,
    out_ptr,
    out_stride,
    res_out_ptr,
    res_out_stride,
    num_rows,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    STORE_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    cols = tl.arange(0, BLOCK_H)
    # The weight is constant through a step: under PDL its (usually cold) load overlaps the predecessor's tail
    # instead of following the reduction. x and the residual are read after the wait.
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < H)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        x = round_to_dtype(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
    if STORE_RESIDUAL:
        tl.store(res_out_ptr + rows[:, None] * res_out_stride + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)
    mean_sq = tl.sum(h * h, axis=1) / H
    h = h * tl.math.rsqrt(mean_sq + eps)[:, None]
    y = round_to_dtype(h, x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_stride + cols[None, :], round_to_dtype(y, out_ptr.dtype.element_ty), mask=mask
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual); with residual None the sum is x itself.

    x, residual [T, H] (same dtype: fp32, bf16 or fp16), weight [H]; see `fused_add_rms_norm_ref`. Rows may be
    strided (the last dim must be dense, else it is copied). With residual None and no `residual_out`, x itself
    is returned as the sum and nothing is copied.
    """
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    num_rows, hidden = x.shape
    x = _rows(x)
    weight = weight.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    assert out.shape == x.shape and out.stride(-1) == 1
    has_residual = residual is not None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        residual = _rows(residual)
        if residual_out is None:
            residual_out = torch.empty_like(x)
    store_residual = residual_out is not None
    if residual_out is not None:
        assert residual_out.shape == x.shape and residual_out.stride(-1) == 1 and residual_out.dtype == x.dtype
    summed = residual_out if residual_out is not None else x
    if num_rows == 0 or hidden == 0:
        return out, summed
    block_h = triton.next_power_of_2(hidden)
    assert block_h <= _MAX_BLOCK_H, f"hidden size {hidden} too large for a one-tile row"
    block_t = max(1, min(16, _TILE // block_h))
    num_warps = min(max(block_t * block_h // 512, 1), 16)
    grid = (triton.cdiv(num_rows, block_t),)
    res_arg = residual if residual is not None else x
    res_out_arg = residual_out if residual_out is not None else out
    pdl = pdl_mode(x.device, num_rows)
    _fused_add_rms_norm_kernel[grid](
        x,
        x.stride(0),
        res_arg,
        res_arg.stride(0),
        weight,
        out,
        out.stride(0),
        res_out_arg,
        res_out_arg.stride(0),
        num_rows,
        hidden,
        eps,
        HAS_RESIDUAL=has_residual,
        STORE_RESIDUAL=store_residual,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        USE_PDL=pdl,
        num_warps=num_warps,
        **pdl_launch_options(pdl),
    )
    return out, summed
