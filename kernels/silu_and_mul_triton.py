"""Triton SwiGLU activation (same contract as `silu_and_mul_ref`).

A 2-D grid of (row, column block) programs: each reads BLOCK_I gate and up values of one row, evaluates silu in
fp32, rounds it to the input dtype, multiplies in fp32 and rounds again, exactly the two roundings of
`F.silu(gate) * up` (below gate = -88, where exp(-gate) overflows, silu is -0 here and a
subnormal in torch). Only shapes are read on the host, so the launch never syncs with the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncspec.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start
from asyncspec.kernels.triton_rounding import round_to_dtype

_MAX_BLOCK_I = 1024


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from fp32 values of `dtype` numbers: silu rounded to `dtype`, the product rounded again
    (the two roundings of `F.silu(gate) * up`); the one formula of every kernel that applies the activation."""
    act = round_to_dtype(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    return round_to_dtype(act * up, dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, x_stride, out_ptr, out_stride, inter, BLOCK_I: tl.constexpr, USE_PDL: tl.constexpr = False
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < inter
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, silu_mul(gate, up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2 * I] -> [T, I] in x.dtype; see `silu_and_mul_ref`.

    Rows may be strided (the last dim must be dense, else it is copied).
    """
    assert x.dim() == 2 and x.shape[1] % 2 == 0, x.shape
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, inter) and out.stride(-1) == 1 and out.dtype == x.dtype
    if num_rows == 0 or inter == 0:
        return out
    block_i = min(triton.next_power_of_2(inter), _MAX_BLOCK_I)
    num_warps = 4 if block_i >= 512 else 1
    grid = (num_rows, triton.cdiv(inter, block_i))
    pdl = pdl_enabled(x.device)
    _silu_and_mul_kernel[grid](
        x,
        x.stride(0),
        out,
        out.stride(0),
        inter,
        BLOCK_I=block_i,
        USE_PDL=pdl,
        num_warps=num_warps,
        **pdl_launch_options(pdl),
    )
    return out
