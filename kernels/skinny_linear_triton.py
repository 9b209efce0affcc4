"""Triton decode-shaped linear layer: y = x @ W^T (+ bias) for M <= 32 rows, and up to 1024 in row blocks of 32 (same
contract as `skinny_linear_ref`).

At decode batch sizes the layer is a pure weight stream, so the kernel is built to read W [N, K] once, at the
GPU's read bandwidth. One program owns BLOCK_N output columns for all M rows and walks (its share of) K in
BLOCK_K chunks, loading W rows with unmasked, 16-byte-wide loads: out-of-range rows are clamped to row N - 1
(loaded, never stored) and the K tail is masked only when K % BLOCK_K != 0. Two inner products:

- FMA (M <= 4 in the table; up to 8 rows per program): one fp32 accumulator tile [BLOCK_N, BLOCK_K] per row of
  x, all in the W tile's register layout, summed over K once after the loop; no tensor cores, no shared memory,
  memory parallelism from occupancy and an unrolled loop. It turns ALU-bound above M ~ 4.
- dot: W tile [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M] on the tensor cores (wgmma for BLOCK_N = 64, 128),
  M padded to BLOCK_M >= 16 (the small M sits in the MMA's N slot, a "swap AB" GEMM), W streamed through a
  cp.async shared-memory pipeline of num_stages; fp32 inputs use IEEE fp32 products, not TF32.

When N / BLOCK_N programs leave SMs idle, K is split deterministically: each of SPLIT_K programs of a column
block writes an fp32 partial to a workspace [SPLIT_K, M, N], and the last of them to arrive (a per-device
arrival counter, CUTLASS's serial split-K semaphore) sums the partials in split order, adds the bias and rounds
once; or, where no counter can be used, a second tiny kernel does that sum. No float atomics: results are
bitwise reproducible run to run, whichever program arrives last.

The block shapes come from `choose_config`, a fixed table over (M, N, K) read off sweeps of
benchmarks/skinny_linear.py on an H100: nothing is benchmarked or synchronised at call time, so calls can be
captured in CUDA graphs. Only shapes are read on the host.

Under PDL a program loads its first chunks of W (`preload_chunks`) before it waits for its predecessor: W is
constant through a step, so the programs resident early start the weight stream inside the previous kernel's
time (a norm, attention, the previous projection's tail). Everything a predecessor writes is touched after the
wait. An L2 prefetch of more of W before the wait (up to 32 MiB per launch) was measured slower instead.

`skinny_linear_gated` is the MLP's gate|up projection with the activation in its epilogue: a program's tile
rows pair each gate row with its up row (row 2i of the tile the gate row p, row 2i + 1 the up row I + p), in
the FMA and the tensor-core kernel alike, so the program that stores a column pair holds both sums, rounds each
to the dtype as the plain output would be, and writes silu(gate) * up; gate|up never reaches memory. Only a
split summed by the second kernel runs the plain kernel and then `silu_and_mul` instead: the same numbers.

`skinny_linear_rotary` is the attention's q|k|v projection with RoPE and the KV-cache write in its epilogue: the
lanes pair a head's rows d and d + D / 2 (the rotate-half pair), so the storing program rotates q and k at the
token's position, with `rotary_kv_write`'s roundings, stores q and writes k and v to the token's cache slot. It is
fused in bf16 only: fp32 and fp16 products must not be contracted into FMAs there, which the rotary kernel is
compiled for (enable_fp_fusion=False) and this kernel's loop is not; bf16's rounding by hand on the bits leaves
nothing to contract.

`skinny_linear_add_norm` and `row_scale=` fold a residual add + RMSNorm into the projections around it
(`FoldedNorm` in kernels/skinny_linear.py): a row-parallel projection's epilogue adds the residual, writes the sum
over it, the sum times the norm's weight, and each column block's sum of squares; the next projection (plain,
gated or rotary) sums those partials into each row's rsqrt(mean(h^2) + eps) after its PDL wait and scales its own
sums by it before its epilogue. What an epilogue reads of a predecessor's output (the residual tile, the partials)
is loaded before the K loop; the norm's weight before the PDL wait.

`skinny_linear_silu` is the down projection of the MLP's gate|up tensor. At M = 1 it is this kernel applying
silu(gate) * up while loading x; above, the activation kernel runs first (measured faster). Either way the
activation has exactly the two roundings of `silu_and_mul` (silu in fp32 rounded to the dtype, the product
rounded again). The engine does not use it: alone it measured faster, but inside a graphed decode step (with
PDL) the activation kernel then `skinny_linear` made the Llama-1B / 8B step 7 % / 5 % faster (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import cast

import torch
import triton
import triton.language as tl

from asyncspec.kernels.paged_attention_triton import _patch_interpreter
from asyncspec.kernels.pdl import pdl_launch_options, pdl_mode, pdl_start
from asyncspec.kernels.rotary_kv_write_triton import rotary_kv_write, rotate_halves
from asyncspec.kernels.silu_and_mul_triton import silu_and_mul, silu_mul
from asyncspec.kernels.skinny_linear import FoldedNorm
from asyncspec.kernels.triton_rounding import round_to_dtype, rounded_fp32

if triton.knobs.runtime.interpret:
    _patch_interpreter()  # tensor loop bounds and bf16 tl.dot under TRITON_INTERPRET=1 (idempotent)

MAX_M = 32
"""The rows of a decode-shaped call: the layers' cap by default (`SkinnyLinear.max_rows`), and the tensor-core
kernel's widest row block."""
WIDE_MAX_M = 1024
"""The most rows the kernel takes: past MAX_M the tensor-core kernel tiles the rows in blocks of MAX_M (a grid
dimension, each block reading its W tiles again: from L2 only where W fits, so the layers send wide calls only for
small weights, `layers/linear.py: WIDE_MAX_WEIGHT_BYTES`), so that a verification's k + 1 rows a request keep the
fused epilogues. The layers take up to 256 rows by default (a verification of 32 requests at k = 4 is 160); the rest
is there for ASYNCSPEC_SKINNY_MAX_ROWS, to measure the verification of 128 requests (640 rows at k = 4) and the
draft's catch-up (768): no gain in a closed batch of 128 on an H100 (2026-12-07), so the default stays 256."""
_MAX_FMA_M = 8  # the FMA kernel keeps one accumulator per row of x
# Above M = 1 the fused activation costs more than the activation kernel it saves (an H100 on the Llama down
# projections: the FMA kernel evaluates it once per W row a thread holds, and the tensor-core kernel's x loads
# then miss the shared-memory pipeline).
_MAX_FUSED_SILU_M = 1
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DEFAULT_SMS = 132  # an H100 SXM; used where no CUDA device is asked (the interpreter on CPU)
_REDUCE_BLOCK = 1024
_COUNTER_SLOTS = 1 << 16  # serial split-K arrival counters per device (one per column block of a launch)
PRELOAD_ENV = "ASYNCSPEC_SKINNY_PRELOAD"


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters of one call. block_n, block_k: powers of two (>= 16 each with use_dot); split_k: how many
    programs share one column block's K range (1: no workspace); num_stages: the dot kernel's shared-memory
    pipeline depth (the FMA kernel is not pipelined)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False
    unroll: int = 1  # FMA loop unroll factor
    serial_split: bool = True  # split-K partials summed by the last program (False: by a second kernel)


@triton.jit
def _x_tile(x_ptr, x_rows, offs_k, K, EVEN_K: tl.constexpr, SILU: tl.constexpr):
    """x[rows, offs_k] ([BLOCK_M, 1] row offsets, [1, BLOCK_K] columns) in x's dtype; with SILU, the
    activation silu(gate) * up of gate|up rows (up starts K columns after gate), rounded as silu_and_mul does."""
    ptrs = x_ptr + x_rows + offs_k
    if EVEN_K:
        x = tl.load(ptrs)
        if SILU:
            up = tl.load(ptrs + K)
    else:
        mask = offs_k < K
        x = tl.load(ptrs, mask=mask, other=0.0)
        if SILU:
            up = tl.load(ptrs + K, mask=mask, other=0.0)
    if SILU:
        x = silu_mul(x.to(tl.float32), up.to(tl.float32), x_ptr.dtype.element_ty)
    return x


@triton.jit
def _fma_row(acc, w, x_ptr, row, M, stride_xm, offs_k, K, EVEN_K: tl.constexpr, SILU: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K] += W tile * x row `row` (clamped to M - 1), elementwise in fp32."""
    # x is loaded through a [BLOCK_N, BLOCK_K] pointer tile that is constant along N: it then gets the W tile's
    # register layout (L1 serves the repeats), where a [1, BLOCK_K] load would be converted through shared
    # memory behind a barrier in every iteration.
    x_row = tl.minimum(row, M - 1).to(tl.int64) * stride_xm + tl.zeros_like(acc).to(tl.int64)
    return acc + w * _x_tile(x_ptr, x_row, offs_k, K, EVEN_K, SILU).to(tl.float32)


@triton.jit
def _w_chunk(w_rows, k0, arange_k, K, EVEN_K: tl.constexpr):
    """The W tile of columns k0 + arange_k ([BLOCK_N, BLOCK_K], W's dtype; masked past K unless EVEN_K)."""
    offs_k = (k0 + arange_k)[None, :]
    if EVEN_K:
        return tl.load(w_rows + offs_k)
    return tl.load(w_rows + offs_k, mask=offs_k < K, other=0.0)


@triton.jit
def _dot_chunk(acc, w, x_ptr, x_rows, k0, arange_k, K, EVEN_K: tl.constexpr, SILU: tl.constexpr):
    """The tensor-core kernel's step over one chunk of K: acc [BLOCK_N, BLOCK_M] += the W tile @ x's chunk^T."""
    xt = tl.trans(_x_tile(x_ptr, x_rows, (k0 + arange_k)[None, :], K, EVEN_K, SILU))
    if x_ptr.dtype.element_ty == tl.float32:
        return tl.dot(w, xt, acc, input_precision="ieee")
    return tl.dot(w, xt, acc)


@triton.jit
def _fma_chunk(
    acc0,
    acc1,
    acc2,
    acc3,
    acc4,
    acc5,
    acc6,
    acc7,
    w_tile,
    x_ptr,
    row0,
    M,
    stride_xm,
    k0,
    arange_k,
    K,
    EVEN_K: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The FMA kernel's step over one chunk of K: every row's accumulator += the W tile * that row of x."""
    offs_k = (k0 + arange_k)[None, :]
    w = w_tile.to(tl.float32)
    acc0 = _fma_row(acc0, w, x_ptr, row0 + 0, M, stride_xm, offs_k, K, EVEN_K, SILU)
    if BLOCK_M > 1:
        acc1 = _fma_row(acc1, w, x_ptr, row0 + 1, M, stride_xm, offs_k, K, EVEN_K, SILU)
    if BLOCK_M > 2:
        acc2 = _fma_row(acc2, w, x_ptr, row0 + 2, M, stride_xm, offs_k, K, EVEN_K, SILU)
        acc3 = _fma_row(acc3, w, x_ptr, row0 + 3, M, stride_xm, offs_k, K, EVEN_K, SILU)
    if BLOCK_M > 4:
        acc4 = _fma_row(acc4, w, x_ptr, row0 + 4, M, stride_xm, offs_k, K, EVEN_K, SILU)
        acc5 = _fma_row(acc5, w, x_ptr, row0 + 5, M, stride_xm, offs_k, K, EVEN_K, SILU)
        acc6 = _fma_row(acc6, w, x_ptr, row0 + 6, M, stride_xm, offs_k, K, EVEN_K, SILU)
        acc7 = _fma_row(acc7, w, x_ptr, row0 + 7, M, stride_xm, offs_k, K, EVEN_K, SILU)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _row_sum(acc, rows, i: tl.constexpr, BLOCK_M: tl.constexpr):
    """rows [BLOCK_M, BLOCK_N] with line i set to acc [BLOCK_N, BLOCK_K] summed over K."""
    return tl.where(tl.arange(0, BLOCK_M)[:, None] == i, tl.sum(acc, axis=1)[None, :], rows)


@triton.jit
def _store_rows(acc, bias_ptr, out_ptr, rows_n, offs_m, offs_n, stride_om, mask, HAS_BIAS: tl.constexpr):
    """out[offs_m, offs_n] = acc (+ bias), rounded once to out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    result = round_to_dtype(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], result, mask=mask)


@triton.jit
def _store_gated(
    acc,
    bias_ptr,
    out_ptr,
    rows_n,
    offs_m,
    pid_n,
    N,
    M,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The gated epilogue: acc's lanes hold (gate, up) pairs of columns p = pid_n * BLOCK_N / 2 + i; each is
    rounded to out's dtype as the gate|up output would be, then out[offs_m, p] = silu(gate) * up with the two
    roundings of `silu_and_mul`."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate, up = tl.split(tl.reshape(round_to_dtype(acc, dtype).to(tl.float32), [BLOCK_M, BLOCK_N // 2, 2]))
    result = silu_mul(gate, up, dtype)
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask = (offs_m[:, None] < M) & (cols[None, :] < N // 2)
    tl.store(out_ptr + offs_m[:, None] * stride_om + cols[None, :], result, mask=mask)


@triton.jit
def _store_rotary(
    acc,
    bias_ptr,
    out_ptr,
    rows_n,
    offs_m,
    pid_n,
    N,
    M,
    stride_om,
    rope,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
):
    """The rotary epilogue of a fused q|k|v projection: acc's lanes hold (d, d + HALF) column pairs of one head;
    each is rounded to the dtype as the projection's output would be, then q and k pairs are rotated by RoPE at
    their token's position (every product and sum rounded to the dtype, as `rotary_kv_write` does), q is stored
    to out [M, heads, 2 * HALF] and k, v to the token's cache slot (none for a slot < 0)."""
    (
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        kc_ptr,
        vc_ptr,
        cos_stride,
        sin_stride,
        qo_stride_h,
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
    ) = rope
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    lo, hi = tl.split(tl.reshape(rounded_fp32(acc, dtype), [BLOCK_M, BLOCK_N // 2, 2]))
    pairs = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    pair_ok = pairs < N // 2
    head = pairs // HALF
    d = pairs % HALF
    row_ok = offs_m < M
    # A position past the cache can only be a padding row's garbage: clamped, so that no load strays.
    pos = tl.load(pos_ptr + offs_m, mask=row_ok, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_position - 1)
    cos_ptrs = cos_ptr + pos[:, None] * cos_stride + d[None, :]
    sin_ptrs = sin_ptr + pos[:, None] * sin_stride + d[None, :]
    cos = rounded_fp32(tl.load(cos_ptrs, mask=pair_ok[None, :], other=0.0).to(tl.float32), dtype)
    sin = rounded_fp32(tl.load(sin_ptrs, mask=pair_ok[None, :], other=0.0).to(tl.float32), dtype)
    r_lo, r_hi = rotate_halves(lo, hi, cos, sin, dtype)
    is_q = (head < num_heads) & pair_ok
    is_k = (head >= num_heads) & (head < num_heads + num_kv_heads) & pair_ok
    is_v = (head >= num_heads + num_kv_heads) & pair_ok
    q_ptrs = out_ptr + offs_m[:, None] * stride_om + tl.where(is_q, head, 0)[None, :] * qo_stride_h + d[None, :]
    q_mask = row_ok[:, None] & is_q[None, :]
    tl.store(q_ptrs, r_lo.to(dtype), mask=q_mask)
    tl.store(q_ptrs + HALF, r_hi.to(dtype), mask=q_mask)
    # Padded tokens carry slot -1: masking every access means they are never written.
    slot = tl.load(slot_ptr + offs_m, mask=row_ok, other=-1).to(tl.int64)
    kv_row = row_ok & (slot >= 0)
    safe_slot = tl.maximum(slot, 0)
    blk = (safe_slot // block_size)[:, None]
    off = (safe_slot % block_size)[:, None]
    k_head = tl.where(is_k, head - num_heads, 0)[None, :]
    k_ptrs = kc_ptr + blk * kc_stride_b + off * kc_stride_s + k_head * kc_stride_h + d[None, :]
    k_mask = kv_row[:, None] & is_k[None, :]
    tl.store(k_ptrs, round_to_dtype(r_lo, kc_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_ptrs + HALF, round_to_dtype(r_hi, kc_ptr.dtype.element_ty), mask=k_mask)
    v_head = tl.where(is_v, head - num_heads - num_kv_heads, 0)[None, :]
    v_ptrs = vc_ptr + blk * vc_stride_b + off * vc_stride_s + v_head * vc_stride_h + d[None, :]
    v_mask = kv_row[:, None] & is_v[None, :]
    tl.store(v_ptrs, round_to_dtype(lo, vc_ptr.dtype.element_ty), mask=v_mask)
    tl.store(v_ptrs + HALF, round_to_dtype(hi, vc_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _store_add_norm(
    acc,
    bias_ptr,
    out_ptr,
    rows_n,
    offs_m,
    offs_n,
    pid_n,
    M,
    stride_om,
    mask,
    fold,
    residual,
    norm_w,
    HAS_BIAS: tl.constexpr,
):
    """The residual add and the first half of the RMSNorm after it, in a row-parallel projection's epilogue:
    h = round(round(acc (+ bias)) + residual) is written over the residual, out = round(h * norm weight), and
    the tile's sum of h^2 per row goes to column pid_n of the partials [M, column blocks]. The consumer's
    ROW_SCALE applies the rest of the norm (the row's rsqrt(mean(h^2) + eps)) to its own sums. `residual` (fp32)
    and `norm_w` were loaded before the K loop, so that their latency is not the kernel's tail."""
    res_ptr, sq_ptr, stride_rm = fold[0], fold[2], fold[3]
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    h = rounded_fp32(rounded_fp32(acc, dtype) + residual, dtype)
    tl.store(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], h.to(dtype), mask=mask)
    weighted = round_to_dtype(h * norm_w[None, :], dtype)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], weighted, mask=mask)
    squares = tl.sum(tl.where(mask, h * h, 0.0), axis=1)
    tl.store(sq_ptr + offs_m * tl.num_programs(0) + pid_n, squares, mask=offs_m < M)


@triton.jit
def _row_factors(offs_m, M, fold, SCALE_BLOCKS: tl.constexpr):
    """[BLOCK_M] fp32: each row's RMSNorm factor rsqrt(mean(h^2) + eps), the mean summed from the producer's
    partials [M, blocks]. x was h * norm weight and the norm is linear per row, so the factor scales the sums."""
    sq_ptr, blocks, hidden, eps = fold[4], fold[5], fold[6], fold[7]
    cols = tl.arange(0, SCALE_BLOCKS)
    sq_mask = (offs_m[:, None] < M) & (cols[None, :] < blocks)
    squares = tl.load(sq_ptr + offs_m[:, None] * blocks + cols[None, :], mask=sq_mask, other=0.0)
    return tl.math.rsqrt(tl.sum(squares, axis=1) / hidden + eps)


@triton.jit
def _store(
    acc,
    bias_ptr,
    out_ptr,
    rows_n,
    offs_m,
    offs_n,
    pid_n,
    N,
    M,
    stride_om,
    mask,
    rope,
    fold,
    residual,
    norm_w,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    ADD_NORM: tl.constexpr,
):
    """The kernel's output: the rows as they are, (GATED) their activation, (ROPE_HALF > 0) q rotated and
    k, v rotated and written to the KV cache, or (ADD_NORM) the residual add and the next norm's first half."""
    if ADD_NORM:
        _store_add_norm(
            acc, bias_ptr, out_ptr, rows_n, offs_m, offs_n, pid_n, M, stride_om, mask, fold, residual, norm_w, HAS_BIAS
        )
    elif GATED:
        _store_gated(acc, bias_ptr, out_ptr, rows_n, offs_m, pid_n, N, M, stride_om, HAS_BIAS, BLOCK_M, BLOCK_N)
    elif ROPE_HALF > 0:
        _store_rotary(
            acc, bias_ptr, out_ptr, rows_n, offs_m, pid_n, N, M, stride_om, rope, HAS_BIAS, BLOCK_M, BLOCK_N, ROPE_HALF
        )
    else:
        _store_rows(acc, bias_ptr, out_ptr, rows_n, offs_m, offs_n, stride_om, mask, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])  # one compile serves every M of a BLOCK_M (M = 1 would get its own)
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    rope,
    fold,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    SILU: tl.constexpr,
    UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    GATED: tl.constexpr = False,
    PRELOAD: tl.constexpr = 0,
    ROPE_HALF: tl.constexpr = 0,
    ADD_NORM: tl.constexpr = False,
    ROW_SCALE: tl.constexpr = False,
    SCALE_BLOCKS: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row0 = tl.program_id(2) * BLOCK_M  # row blocks: the FMA kernel past 8 rows, the tensor-core one past 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    # Clamped rows keep every load in bounds without a mask (masks would cost the 16-byte vector loads on the
    # row tail); the duplicates are computed and dropped by the masked store.
    if GATED:
        # Lanes 2i and 2i + 1 compute the gate row p and the up row N / 2 + p of one activation column p, so
        # the epilogue holds both; offs_n stays the lane's index (workspace, masks) over N = 2 * intermediate.
        pair = tl.minimum(offs_n // 2, N // 2 - 1)
        rows_n = pair + (offs_n % 2) * (N // 2)
    elif ROPE_HALF > 0:
        # Lanes 2i and 2i + 1 compute the columns d and d + ROPE_HALF of one head (RoPE's rotate-half pair).
        pair = tl.minimum(offs_n // 2, N // 2 - 1)
        rows_n = (pair // ROPE_HALF) * (2 * ROPE_HALF) + pair % ROPE_HALF + (offs_n % 2) * ROPE_HALF
    else:
        rows_n = tl.minimum(offs_n, N - 1)
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    arange_k = tl.arange(0, BLOCK_K)
    k_begin = pid_k * k_per_split  # k_per_split is a multiple of BLOCK_K: only the last chunk can be partial
    k_end = tl.minimum(k_begin + k_per_split, K)
    # W is constant through a step, so a program may load its first PRELOAD chunks before the predecessor
    # completes: under PDL the programs that are resident early start the weight stream inside the previous
    # kernel's time. Nothing a predecessor writes (x, out, the workspace, the counters) is touched before the
    # wait in pdl_start.
    if PRELOAD > 0:
        w_first = _w_chunk(w_rows, k_begin, arange_k, K, EVEN_K)
    if PRELOAD > 1:
        # Where the program has no second chunk its tile is loaded from the first one's columns (always in
        # bounds) and never used.
        second = k_begin + BLOCK_K
        w_second = _w_chunk(w_rows, tl.where(second < k_end, second, k_begin), arange_k, K, EVEN_K)
    if ADD_NORM:
        norm_w = tl.load(fold[1] + rows_n).to(tl.float32)  # a weight: constant through the step
    else:
        norm_w = tl.zeros([BLOCK_N], dtype=tl.float32)
    pdl_start(USE_PDL)
    # What the epilogue reads of the predecessors' outputs is loaded before the K loop: its latency hides there.
    if ADD_NORM:
        res_tile = fold[0] + offs_m[:, None] * fold[3] + offs_n[None, :]
        res_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        residual = tl.load(res_tile, mask=res_mask, other=0.0).to(tl.float32)
    else:
        residual = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if ROW_SCALE:
        factors = _row_factors(offs_m, M, fold, SCALE_BLOCKS)
    else:
        factors = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_DOT:
        x_rows = tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        loop_begin = k_begin
        if PRELOAD > 0:
            acc = _dot_chunk(acc, w_first, x_ptr, x_rows, k_begin, arange_k, K, EVEN_K, SILU)
            loop_begin = tl.minimum(k_begin + BLOCK_K, k_end)
        for k0 in range(loop_begin, k_end, BLOCK_K):
            acc = _dot_chunk(
                acc, _w_chunk(w_rows, k0, arange_k, K, EVEN_K), x_ptr, x_rows, k0, arange_k, K, EVEN_K, SILU
            )
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        # One [BLOCK_N, BLOCK_K] fp32 accumulator per row of x (BLOCK_M <= 8), all in the W tile's register
        # layout, summed over K once after the loop: a reduction (or a 3-D broadcast) inside the loop changes
        # layout through shared memory behind a barrier every chunk, which stalls the loads.
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc4 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc5 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc6 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc7 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        loop_begin = k_begin
        if PRELOAD > 0:
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_chunk(
                acc0,
                acc1,
                acc2,
                acc3,
                acc4,
                acc5,
                acc6,
                acc7,
                w_first,
                x_ptr,
                row0,
                M,
                stride_xm,
                k_begin,
                arange_k,
                K,
                EVEN_K,
                SILU,
                BLOCK_M,
            )
            loop_begin += BLOCK_K
        if PRELOAD > 1:
            if loop_begin < k_end:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_chunk(
                    acc0,
                    acc1,
                    acc2,
                    acc3,
                    acc4,
                    acc5,
                    acc6,
                    acc7,
                    w_second,
                    x_ptr,
                    row0,
                    M,
                    stride_xm,
                    loop_begin,
                    arange_k,
                    K,
                    EVEN_K,
                    SILU,
                    BLOCK_M,
                )
            loop_begin += BLOCK_K
        # Unrolling lets the next chunk's loads issue before this chunk's FMAs (no shared-memory pipeline here).
        # The unrolled loop's trip count goes wrong for a start past its end, which the preloaded chunks can give.
        loop_begin = tl.minimum(loop_begin, k_end)
        for k0 in tl.range(loop_begin, k_end, BLOCK_K, loop_unroll_factor=UNROLL):
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_chunk(
                acc0,
                acc1,
                acc2,
                acc3,
                acc4,
                acc5,
                acc6,
                acc7,
                _w_chunk(w_rows, k0, arange_k, K, EVEN_K),
                x_ptr,
                row0,
                M,
                stride_xm,
                k0,
                arange_k,
                K,
                EVEN_K,
                SILU,
                BLOCK_M,
            )
        acc = _row_sum(acc0, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), 0, BLOCK_M)
        if BLOCK_M > 1:
            acc = _row_sum(acc1, acc, 1, BLOCK_M)
        if BLOCK_M > 2:
            acc = _row_sum(acc2, acc, 2, BLOCK_M)
            acc = _row_sum(acc3, acc, 3, BLOCK_M)
        if BLOCK_M > 4:
            acc = _row_sum(acc4, acc, 4, BLOCK_M)
            acc = _row_sum(acc5, acc, 5, BLOCK_M)
            acc = _row_sum(acc6, acc, 6, BLOCK_M)
            acc = _row_sum(acc7, acc, 7, BLOCK_M)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT == 0:
        if ROW_SCALE:
            acc = acc * factors[:, None]
        _store(
            acc,
            bias_ptr,
            out_ptr,
            rows_n,
            offs_m,
            offs_n,
            pid_n,
            N,
            M,
            stride_om,
            mask,
            rope,
            fold,
            residual,
            norm_w,
            HAS_BIAS,
            GATED,
            BLOCK_M,
            BLOCK_N,
            ROPE_HALF,
            ADD_NORM,
        )
    else:
        # fp32 partial into the workspace [SPLIT_K, M, N], summed in split order (deterministic) either by
        # _split_reduce_kernel (SPLIT == 1) or here by the last of the column block's programs to arrive
        # (SPLIT == 2), which saves the second launch: CUTLASS's serial split-K semaphore. The barrier puts every
        # thread's partial before the single-thread acq_rel increment (release), whose acquire side makes the
        # other programs' partials visible to the last one; it reads them through L2 (.cg), never a stale L1.
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_tile + pid_k * M * N, acc, mask=mask)
        if SPLIT == 2:
            splits = tl.num_programs(1)
            counter = counter_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
            tl.debug_barrier()
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(0, splits):
                    total += tl.load(ws_tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                if ROW_SCALE:
                    total = total * factors[:, None]
                _store(
                    total,
                    bias_ptr,
                    out_ptr,
                    rows_n,
                    offs_m,
                    offs_n,
                    pid_n,
                    N,
                    M,
                    stride_om,
                    mask,
                    rope,
                    fold,
                    residual,
                    norm_w,
                    HAS_BIAS,
                    GATED,
                    BLOCK_M,
                    BLOCK_N,
                    ROPE_HALF,
                    ADD_NORM,
                )
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(
    ws_ptr,
    bias_ptr,
    out_ptr,
    factor_ptr,
    M,
    N,
    stride_om,
    split_k,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    ROW_SCALE: tl.constexpr = False,
):
    """out[m, n] = round(sum over s in order of ws[s, m, n] (* factor[m]) (+ bias[n])): a fixed order, so
    deterministic."""
    pdl_start(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if ROW_SCALE:
        acc *= tl.load(factor_ptr + m, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, round_to_dtype(acc, out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------- heuristic


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device` (cached: a property query, no sync); a nominal H100 for the CPU."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _split_for(columns: int, k: int, block_k: int, target_programs: int, max_split: int = 16) -> int:
    """The smallest power-of-two split of K that gives `target_programs` programs, keeping >= 2 chunks each."""
    split = 1
    while columns * split < target_programs and split < max_split and k >= 4 * split * block_k:
        split *= 2
    return split


def _dot_split(columns: int, k: int, sms: int) -> int:
    """Split of K for the tensor-core tiles: up to ~2/3 of the SMs busy, but each split keeps >= 512 of K, and
    >= 2048 once there are 48 column blocks (a short split costs more in partials than its extra SMs give)."""
    split = 1
    while columns * split < (2 * sms) // 3 and split < 16:
        per_split = k // (2 * split)
        if per_split < 512 or (columns >= 48 and per_split < 2048):
            break
        split *= 2
    return split


def choose_config(m: int, n: int, k: int, sms: int = _DEFAULT_SMS) -> SkinnyConfig:
    """Launch parameters for x [m, k] @ W[n, k]^T: a fixed rule (no benchmarking at call time), read off sweeps
    of benchmarks/skinny_linear.py on an H100 (bf16) over the Llama-1B / 8B projections and the 8B's TP = 2, 4
    shards, and on an H200 for the one-row tiles and the row-parallel tiles at M = 16, 32. Tensor-core tiles use
    120 KB (64x256, 3 stages), 108 KB (128x128, 3), 80 KB (64x128, 4) and 72 KB (32x256, 3) of shared memory:
    1, 2, 2 and 3 programs per SM."""
    if m <= 2:
        # FMA: BLOCK_M accumulators of BLOCK_N * BLOCK_K / 128 fp32 per thread, 64 registers in all; enough
        # columns to fill the SMs down to N ~ 1000 (below that, K is split).
        block_n, block_k, unroll = (8, 512, 2) if m == 1 else (4, 512, 1)
        if m == 1 and n <= 4096 and k >= 2048 and k % 1024 == 0:
            # Narrower, deeper tiles stream the row-parallel and attention projections faster on an H200
            # (sweep of 2026-11-29: the Llama-8B down projection 35.8 -> 27.9 us, 1B down 12.7 -> 10.6 us,
            # o 4.1 -> 3.6 us); wider layers (gate|up, lm_head, the 8B's qkv) keep 8 x 512.
            block_n, block_k, unroll = 4, 1024, 1
        split = _split_for(triton.cdiv(n, block_n), k, block_k, sms)
        return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=1, unroll=unroll)
    if m <= 4 and n * k <= 9 << 20:
        # Small weights at M = 3, 4: the FMA kernel's many small programs still beat the tensor-core tiles (it
        # turns ALU-bound above M = 4: every W element costs 2 M + 1 instructions).
        block_n, block_k = (4, 512) if n < 16 * sms else (8, 256)
        split = _split_for(triton.cdiv(n, block_n), k, block_k, sms)
        return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=1, unroll=2)
    if n >= 14336 and (m > 8 or n <= 128 * sms):
        block_n, block_k, stages = 128, 128, 3  # one wave of 2-per-SM programs, or M > 8 on wide layers
        if m > 16 and n >= 65536:
            stages = 4  # a vocabulary-wide lm_head at M = 32: the 1B's 138.0 -> 133.6 us on an H200 (2026-12-06)
    elif m > 8 and k >= 2048 and 3 * n // 4 <= k <= 2 * n and (n // 16) % sms >= 0.85 * sms:
        # Row-parallel-like shapes at M = 16, 32 (the 1B and 8B o, the 8B's TP = 2, 4 down). An H100's sweep
        # chose 16 x 256 tiles for them; on an H200 (sweep of 2026-12-03) those ran 2-47 % slower than 32 x 256
        # at M = 32 (the 8B o 18.3 -> 13.0 us) and 3-8 % at M = 16, except the 1B o at M = 16 (6.10 against 6.35).
        block_n, block_k, stages = 32, 256, 3
    elif m > 8 or k <= 1024:
        block_n, block_k, stages = 64, 128, 4
        if m > 16 and k >= 2048 and k < n <= 2 * k and n * k <= 8 << 20:
            # The 1B's q|k|v at M = 32: 48 programs, each latency-bound on its 256 KB of W; a deeper ring took it
            # from 6.97 to 6.41 us on an H200 (2026-12-06) and from 7.49 to 7.08 on an H100 (2026-12-05).
            stages = 6
    else:
        block_n, block_k, stages = 64, 256, 3
    split = _dot_split(triton.cdiv(n, block_n), k, sms)
    return SkinnyConfig(block_n, block_k, split, num_warps=4, num_stages=stages, use_dot=True)


# -------------------------------------------------------------------------------------------------- launch


def preload_chunks() -> int:
    """Chunks of W a program loads before its PDL wait: ASYNCSPEC_SKINNY_PRELOAD (0, 1 or 2; read at each launch),
    by default 2; the tensor-core kernel takes at most 1."""
    raw = os.environ.get(PRELOAD_ENV, "2")
    if raw not in ("0", "1", "2"):
        raise ValueError(f"{PRELOAD_ENV} must be 0, 1 or 2 (chunks of W loaded before the PDL wait), got {raw!r}")
    return int(raw)


def make_split_counters(device: torch.device | str) -> torch.Tensor:
    """Arrival counters for the serial split-K (the last program of a column block sums the partials): zero
    between launches, since that program resets its own. The caller owns them (one set per stream: launches
    sharing a set must not run concurrently) and passes them to every call; without them a split takes a
    second kernel to sum. Create them outside a CUDA-graph capture (a capture would record the zeroing)."""
    return torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)


def skinny_linear_supported(x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False) -> bool:
    """Whether `skinny_linear` (gated: `skinny_linear_silu`, x holding gate|up) takes these operands: 2-D,
    1 <= M <= WIDE_MAX_M rows, K matching (2 * K with gated), dense last dims, one dtype among bf16 / fp16 / fp32,
    on a CUDA device (or the CPU under TRITON_INTERPRET=1). Callers fall back to F.linear otherwise."""
    if x.dim() != 2 or weight.dim() != 2 or x.dtype != weight.dtype or x.dtype not in _DTYPES:
        return False
    if x.device != weight.device or not (x.is_cuda or triton.knobs.runtime.interpret):
        return False
    k = weight.shape[1] * (2 if gated else 1)
    if not (1 <= x.shape[0] <= WIDE_MAX_M) or x.shape[1] != k or weight.shape[0] == 0 or k == 0:
        return False
    return x.stride(-1) == 1 and weight.stride(-1) == 1


@dataclass(frozen=True)
class _RopeOperands:
    """What the rotary epilogue of a q|k|v projection reads and writes besides x and W (see `skinny_linear_rotary`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_out: torch.Tensor

    def kernel_args(self) -> tuple:
        kc, vc = self.k_cache, self.v_cache
        return (
            self.positions,
            self.cos_cache,
            self.sin_cache,
            self.slot_mapping,
            kc,
            vc,
            self.cos_cache.stride(0),
            self.sin_cache.stride(0),
            self.q_out.stride(1),
            kc.stride(0),
            kc.stride(1),
            kc.stride(2),
            vc.stride(0),
            vc.stride(1),
            vc.stride(2),
            self.cos_cache.shape[0],
            kc.shape[1],
            self.num_heads,
            self.num_kv_heads,
        )

    def unfused(self, qkv: torch.Tensor) -> torch.Tensor:
        """The same numbers from the projection's output [M, N]: the separate RoPE + KV-write kernel."""
        t, h, kvh, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        return rotary_kv_write(
            q.view(t, h, d),
            k.view(t, kvh, d),
            v.view(t, kvh, d),
            self.positions,
            self.cos_cache,
            self.sin_cache,
            self.k_cache,
            self.v_cache,
            self.slot_mapping,
            q_out=self.q_out,
        )


@dataclass(frozen=True)
class _AddNormOperands:
    """What the add-norm epilogue of a row-parallel projection reads and writes besides x and W (see
    `skinny_linear_add_norm`): the residual it adds and overwrites, and the next norm's weight."""

    residual: torch.Tensor
    norm_weight: torch.Tensor


def _fold_args(
    x: torch.Tensor, add_norm: _AddNormOperands | None, sum_squares: torch.Tensor | None, row_scale: FoldedNorm | None
) -> tuple:
    """The kernel's `fold` tuple: (residual, norm weight, partials out, residual row stride) for ADD_NORM, then
    (partials in, their blocks, hidden size, eps) for ROW_SCALE; x and ones stand in for what a launch never reads."""
    producer: tuple = (x, x, x, 1)
    if add_norm is not None:
        producer = (add_norm.residual, add_norm.norm_weight, sum_squares, add_norm.residual.stride(0))
    consumer: tuple = (x, 1, 1.0, 1.0)
    if row_scale is not None:
        sq = row_scale.sum_squares
        consumer = (sq, sq.shape[1], float(row_scale.x_weighted.shape[1]), float(row_scale.eps))
    return producer + consumer


def _check_row_scale(x: torch.Tensor, row_scale: FoldedNorm) -> None:
    m = x.shape[0]
    sq = row_scale.sum_squares
    if row_scale.x_weighted is not x and (row_scale.x_weighted.shape != x.shape):
        raise ValueError(
            f"row_scale belongs to an x of shape {tuple(row_scale.x_weighted.shape)}, not {tuple(x.shape)}"
        )
    if sq.dim() != 2 or sq.shape[0] != m or sq.dtype != torch.float32 or not sq.is_contiguous() or sq.shape[1] < 1:
        raise ValueError(
            f"row_scale.sum_squares must be a contiguous [{m}, blocks] float32 tensor, got {tuple(sq.shape)}"
        )
    if sq.device != x.device:
        raise ValueError(f"row_scale.sum_squares is on {sq.device}, x on {x.device}")


def _add_norm_unfused(
    y: torch.Tensor, add_norm: _AddNormOperands, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The add-norm epilogue's numbers from the projection's output y, in torch: (x weighted, sums of squares
    [M, 1]), the residual overwritten with the sum."""
    summed = (y.float() + add_norm.residual.float()).to(y.dtype)
    add_norm.residual.copy_(summed)
    h = summed.float()
    out.copy_((h * add_norm.norm_weight.float()).to(y.dtype))
    return out, h.pow(2).sum(dim=1, keepdim=True)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
    config: SkinnyConfig | None,
    silu: bool,
    counters: torch.Tensor | None,
    gated: bool = False,
    rope: _RopeOperands | None = None,
    add_norm: _AddNormOperands | None = None,
    row_scale: FoldedNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel's output (and with `add_norm` its partial sums of squares [M, column blocks])."""
    if not skinny_linear_supported(x, weight, gated=silu):
        raise ValueError(
            f"skinny_linear does not take x {tuple(x.shape)} {x.dtype} stride {x.stride()} on {x.device} with "
            f"weight {tuple(weight.shape)} {weight.dtype} stride {weight.stride()} (see skinny_linear_supported)"
        )
    m, (n, k) = x.shape[0], weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(f"bias must be a dense [{n}] {x.dtype} tensor, got {tuple(bias.shape)} {bias.dtype}")
    if gated and n % 2:
        raise ValueError(f"a gate|up weight has an even number of rows, got {n}")
    out_n = n // 2 if gated else n
    if rope is not None:
        out = rope.q_out
    elif out is None:
        out = torch.empty((m, out_n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, out_n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{m}, {out_n}] {x.dtype} with a dense last dim, got {tuple(out.shape)}")
    cfg = config or choose_config(m, n, k, num_sms(x.device))
    block_m = (
        min(max(16, triton.next_power_of_2(m)), MAX_M) if cfg.use_dot else min(triton.next_power_of_2(m), _MAX_FMA_M)
    )
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # a requested split larger than K's chunks shrinks
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m))
    if counters is not None and (
        counters.shape != (_COUNTER_SLOTS,) or counters.dtype != torch.int32 or counters.device != x.device
    ):
        raise ValueError("counters must come from make_split_counters on the operands' device")
    if not (split > 1 and cfg.serial_split and grid[0] * grid[2] <= _COUNTER_SLOTS):
        counters = None
    mode = 0 if split == 1 else 2 if counters is not None else 1
    if row_scale is not None:
        _check_row_scale(x, row_scale)
    if add_norm is not None and mode == 1:
        return _add_norm_unfused(_launch(x, weight, bias, None, cfg, silu, counters)[0], add_norm, out)
    if gated and (cfg.block_n % 2 or mode == 1):
        # The epilogue needs (gate, up) column pairs in one tile and the partials summed in-kernel.
        projection = _launch(x, weight, bias, None, cfg, False, counters, row_scale=row_scale)[0]
        return silu_and_mul(projection, out=out), None
    if rope is not None and (cfg.block_n % 2 or mode == 1):
        return rope.unfused(_launch(x, weight, bias, None, cfg, False, counters, row_scale=row_scale)[0]), None
    sum_squares = None
    if add_norm is not None:
        sum_squares = torch.empty((m, grid[0]), dtype=torch.float32, device=x.device)
    ws = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else x  # never read without HAS_BIAS
    # Without the rotary epilogue its operands are never read (ROPE_HALF = 0): x and ones stand in for them.
    rope_args = rope.kernel_args() if rope is not None else (x,) * 6 + (1,) * 13
    pdl = pdl_mode(x.device, m)
    preload = min(preload_chunks(), 1) if cfg.use_dot else preload_chunks()
    _skinny_linear_kernel[grid](
        x,
        weight,
        bias_arg,
        out,
        ws,  # never touched without a split
        counters if counters is not None else ws,  # never touched unless mode 2
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        k_per_split,
        rope_args,
        _fold_args(x, add_norm, sum_squares, row_scale),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_DOT=cfg.use_dot,
        SPLIT=mode,
        HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0,
        SILU=silu,
        UNROLL=cfg.unroll,
        USE_PDL=pdl,
        GATED=gated,
        PRELOAD=preload,
        ROPE_HALF=rope.head_dim // 2 if rope is not None else 0,
        ADD_NORM=add_norm is not None,
        ROW_SCALE=row_scale is not None,
        SCALE_BLOCKS=triton.next_power_of_2(row_scale.sum_squares.shape[1]) if row_scale is not None else 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch_options(pdl),
    )
    if mode == 1:
        # The second kernel scales the sums by the rows' factors, computed here (the fp32 sum of the partials).
        factors = row_scale.row_factors() if row_scale is not None else ws
        _split_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            ws,
            bias_arg,
            out,
            factors,
            m,
            n,
            out.stride(0),
            split,
            HAS_BIAS=bias is not None,
            BLOCK=_REDUCE_BLOCK,
            USE_PDL=pdl,
            ROW_SCALE=row_scale is not None,
            num_warps=4,
            **pdl_launch_options(pdl),
        )
    return out, sum_squares


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    counters: torch.Tensor | None = None,
    row_scale: FoldedNorm | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x.dtype; see `skinny_linear_ref` for the contract
    (with `row_scale`, x is a `FoldedNorm`'s x_weighted and the result that of the norm's output).

    Raises ValueError for operands `skinny_linear_supported` refuses (never computes a wrong result). Rows of
    x, weight and out may be strided. `config` overrides `choose_config` (benchmarks and tests); `counters`
    (`make_split_counters`) lets a split-K launch sum its partials without a second kernel.
    """
    return _launch(x, weight, bias, out, config, silu=False, counters=counters, row_scale=row_scale)[0]


def skinny_linear_add_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    counters: torch.Tensor | None = None,
) -> FoldedNorm:
    """A row-parallel projection (o, down) with the residual add and the first half of the next RMSNorm in its
    epilogue; see `skinny_linear_add_norm_ref`. `residual` [M, N] is overwritten with h = y + residual; the result
    holds h * norm_weight [M, N] (in `out` if given) and h's sums of squares, for the next projection's
    `row_scale=`, which applies the rest of the norm: no norm kernel runs between the two."""
    m, n = x.shape[0], weight.shape[0]
    for name, t, shape in (("residual", residual, (m, n)), ("norm_weight", norm_weight, (n,))):
        if t.shape != shape or t.dtype != x.dtype or t.stride(-1) != 1 or t.device != x.device:
            raise ValueError(
                f"{name} must be a {list(shape)} {x.dtype} tensor on {x.device} with a dense last dim, got "
                f"{tuple(t.shape)} {t.dtype} stride {t.stride()} on {t.device}"
            )
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    # Programs write h over the residual while others still read x, and the weighted sum after h: no sharing.
    storage = residual.untyped_storage().data_ptr()
    if x.untyped_storage().data_ptr() == storage or (out is not None and out.untyped_storage().data_ptr() == storage):
        raise ValueError("residual must not share memory with x or out (it is overwritten with the sum)")
    operands = _AddNormOperands(residual, norm_weight)
    x_weighted, sum_squares = _launch(x, weight, bias, out, config, False, counters, add_norm=operands)
    return FoldedNorm(x_weighted, cast("torch.Tensor", sum_squares), eps)  # _launch gives them with add_norm


def skinny_linear_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    counters: torch.Tensor | None = None,
    row_scale: FoldedNorm | None = None,
) -> torch.Tensor:
    """silu_and_mul(x @ weight^T (+ bias)) -> [M, N / 2] for the MLP's fused gate|up weight [N, K] (gate rows,
    then up rows); see `skinny_linear_gated_ref`. One kernel: each program's tile pairs a gate row with its up
    row and the epilogue applies the activation, so gate|up never reaches memory (a K split without `counters`
    runs the plain kernel and then `silu_and_mul`: the same numbers)."""
    return _launch(x, weight, bias, out, config, False, counters, gated=True, row_scale=row_scale)[0]


def skinny_linear_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    counters: torch.Tensor | None = None,
    row_scale: FoldedNorm | None = None,
) -> torch.Tensor:
    """The attention's fused q|k|v projection, then RoPE and the KV-cache write: returns q rotated [M, H, D] and
    writes k rotated and v to the cache slots of `slot_mapping` (none for a slot < 0), the numbers of
    `skinny_linear` then `rotary_kv_write` bit for bit. weight is [(H + 2 * KVH) * D, K] (q rows, then k, then
    v); positions, cos/sin caches [max_position, D / 2] (fp32), caches [blocks, block_size, KVH, D] and slots
    as `rotary_kv_write` takes them.

    In bf16 it is one kernel: each program's tile pairs the rows d and d + D / 2 of a head, and the epilogue
    rotates and stores them, so the projection's output never reaches memory. Other dtypes, and a K split
    without `counters`, run the two kernels (fp32 and fp16 products must not be contracted, which the rotary
    kernel is compiled for and the projection's loop is not)."""
    if not skinny_linear_supported(x, weight):
        raise ValueError(
            f"skinny_linear does not take x {tuple(x.shape)} {x.dtype} stride {x.stride()} on {x.device} with "
            f"weight {tuple(weight.shape)} {weight.dtype} stride {weight.stride()} (see skinny_linear_supported)"
        )
    m = x.shape[0]
    if num_heads <= 0 or num_kv_heads <= 0 or weight.shape[0] % (num_heads + 2 * num_kv_heads):
        raise ValueError(
            f"a q|k|v weight has (num_heads + 2 * num_kv_heads) * head_dim rows: {weight.shape[0]} rows for "
            f"{num_heads} + 2 * {num_kv_heads} heads"
        )
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    if (
        head_dim % 2
        or cos_cache.shape != sin_cache.shape
        or cos_cache.dim() != 2
        or cos_cache.shape[1] != head_dim // 2
    ):
        raise ValueError(
            f"RoPE needs an even head_dim ({head_dim}) and cos/sin caches [max_position, {head_dim // 2}], got "
            f"{tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}"
        )
    cache_shape = (num_kv_heads, head_dim)
    if k_cache.dim() != 4 or k_cache.shape[2:] != cache_shape or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must be [blocks, block_size, {num_kv_heads}, {head_dim}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if positions.dim() != 1 or slot_mapping.dim() != 1 or positions.shape[0] < m or slot_mapping.shape[0] < m:
        raise ValueError(f"positions and slot_mapping need at least {m} entries (one per row of x)")
    if q_out is None:
        q_out = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    elif q_out.shape != (m, num_heads, head_dim) or q_out.dtype != x.dtype or q_out.stride(-1) != 1:
        raise ValueError(
            f"q_out must be [{m}, {num_heads}, {head_dim}] {x.dtype} with a dense last dim, got "
            f"{tuple(q_out.shape)} {q_out.dtype} stride {q_out.stride()}"
        )
    dense = {
        "cos_cache": cos_cache,
        "sin_cache": sin_cache,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "positions": positions,
        "slot_mapping": slot_mapping,
    }
    for name, t in dense.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a dense last dim, got stride {t.stride()}")
    rope = _RopeOperands(
        num_heads, num_kv_heads, head_dim, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, q_out
    )
    if x.dtype != torch.bfloat16:
        return rope.unfused(_launch(x, weight, bias, None, config, False, counters, row_scale=row_scale)[0])
    return _launch(x, weight, bias, None, config, False, counters, rope=rope, row_scale=row_scale)[0]


def skinny_linear_silu(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    fused: bool | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu_and_mul(x2) @ weight^T (+ bias) for the MLP's gate|up x2 [M, 2 * K] and down_proj weight [N, K];
    see `skinny_linear_silu_ref`. Fused (the activation is applied while loading x, never written to memory)
    where that was measured faster, M <= _MAX_FUSED_SILU_M (fused=None); otherwise the activation kernel
    runs first. Both give bitwise the same result: the same two roundings of the activation."""
    if fused is None:
        fused = x2.shape[0] <= _MAX_FUSED_SILU_M
    if fused:
        return _launch(x2, weight, bias, out, config, silu=True, counters=counters)[0]
    if not skinny_linear_supported(x2, weight, gated=True):
        return _launch(x2, weight, bias, out, config, silu=True, counters=counters)[0]  # raises the ValueError
    return _launch(silu_and_mul(x2), weight, bias, out, config, silu=False, counters=counters)[0]
