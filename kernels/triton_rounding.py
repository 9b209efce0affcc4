"""Triton helpers shared by the fused kernels: fp32 -> storage dtype with round-to-nearest-even."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """fp32 x rounded to nearest even in DTYPE. bf16 is rounded by hand on the bits: Triton's interpreter
    truncates a plain fp32 -> bf16 cast (a GPU rounds it to nearest even, as this does)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def rounded_fp32(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to DTYPE and widened back, to go on computing in fp32 with the rounded value."""
    return round_to_dtype(x, DTYPE).to(tl.float32)
