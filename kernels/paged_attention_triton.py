"""Triton paged attention over a mixed batch of prefill chunks and decodes (contract of `paged_attention_ref`).

One kernel serves every request shape. Each program owns one KV head and a tile of BLOCK_Q query tokens of
one request; its BLOCK_M = BLOCK_Q * group rows are (query token, query head of the group) pairs, so each K/V
tile is loaded once and serves the whole GQA group. KV is walked in tiles of BLOCK_N keys whose physical
slots come from the block table key by key, so a tile may span paged blocks and any block size works.

The grid is an upper bound computed from shapes only (no host sync): program ids are laid out as
`query_start_loc[b] // BLOCK_Q + b` for request b (vLLM's trick; every request gets enough tiles), and the
ids past the last request zero the padded query rows. Padded rows (t >= query_start_loc[-1]) are therefore
always WRITTEN AS ZEROS, whether or not `out` is passed, matching the reference.

Split-KV ("flash-decoding") path: a decode or speculative-verify batch of few requests has only
(query tiles x KV heads) programs, far fewer than the SMs, and one program walks a whole long context. Then
a third grid axis splits each tile's visible keys into num_splits contiguous ranges (computed in the kernel
from the real seq_len, so the launch still depends on shapes only and stays CUDA-graph capturable); each
split writes its fp32 partial (running max m, sum l, unnormalised acc) to scratch, and a small second kernel
merges the splits by log-sum-exp and writes `out`, zeroing the padded rows. `choose_num_splits` picks the
path from shapes only.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from asyncspec.kernels.pdl import pdl_launch_options, pdl_mode, pdl_start


def _patch_interpreter() -> None:
    """Work around two TRITON_INTERPRET=1 bugs (triton 3.6); compiled kernels are unaffected. Idempotent.

    - Scalars are 1-element arrays converted with `int(array)`, which NumPy >= 2.3 rejects, so a loop
      with tensor bounds (`range(kv_begin, kv_end, ...)`) fails.
    - `tl.dot` multiplies bf16 operands as their raw uint16 bit patterns.
    - `tl.dot` of fp32 operands is an fp32 BLAS matmul, whose rounding depends on a row's place in the tile on
      some OpenBLAS kernels (OPENBLAS_CORETYPE=Haswell on an AMD EPYC): two tiles holding the same row summed it
      differently. The products are summed in fp64 and rounded once, so a row's result is its own.
    """
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_asyncspec_patched", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def as_fp32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data.reshape(h.data.shape), tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = as_fp32(a), as_fp32(b)
        if a.dtype.scalar == tl.float32 and b.dtype.scalar == tl.float32 and d.dtype.scalar == tl.float32:
            product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
            return interpreter.TensorHandle(product + d.data, d.dtype.scalar)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = patched_tensor
    builder.create_dot = patched_dot
    interpreter._asyncspec_patched = True


if triton.knobs.runtime.interpret:
    _patch_interpreter()


# Split-KV heuristic (see `choose_num_splits`).
_MAX_AVG_QUERY = 16  # split only decode / speculative-verify batches; prefill-heavy ones already fill the GPU
_COMBINE_COUNTER_SLOTS = 1 << 14  # (query tile, KV head) pairs: 256 verifications of 5 tokens, 8 KV heads of 4: 4,616
_MAX_SPLITS = 32  # more splits add scratch traffic and combine work for little extra parallelism
_MIN_KEYS_PER_SPLIT = 256  # a split should walk a few BLOCK_N tiles, or launching it costs more than it saves
_WAVES = 2  # aim for ~2 programs per SM so a short program's SM does not idle
_DEFAULT_SMS = 132  # an H100 SXM; used where no CUDA device is asked (the interpreter on CPU)
# From this many requests a short tile walks 128 keys a step (`_tile_sizes`). On an H200, 128 decodes or k = 4
# verifications of the 1B and bundled shapes took 0.83-0.93x the time of 64-key steps at 450-1,000 keys of context
# and 1.00-1.04x at 315; at 64-96 requests 0.99-1.00x at 1,000 and up to 1.08x at 315; at 32 requests 0.88-1.06x
# at 600, and one request 1.18x at 315 (H100). benchmarks/attention_tiles.py, twelfth and thirteenth sessions. With
# contexts spread like real prompts (--spread 0.6), 32 requests took 0.95x / 0.89x at 315 / 1,000 keys, and the 1B's
# 32-stream engine step 0.986x (H100, thirty-sixth session), so the rule starts at 32.
_LONG_KEY_STEP_MIN_REQS = 32
# `early_kv` holds a K/V tile in registers across the PDL wait: about 200 registers a thread in the split pass on
# sm_90 (128 without), so two programs of 4 warps fit an SM. Past that many programs an SM the grid would need a second
# wave that it did not without, so such a call reads everything after the wait.
_EARLY_KV_MAX_PROGRAMS_PER_SM = 2


@triton.jit
def _tile_start(qsl_ptr, b, BLOCK_Q: tl.constexpr, CACHE: tl.constexpr):
    return tl.load(qsl_ptr + b, cache_modifier=CACHE) // BLOCK_Q + b


@triton.jit
def _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr, CACHE: tl.constexpr):
    """The request owning query-tile id `pid`: the largest b in [0, num_reqs] whose first tile id is <= pid.
    b == num_reqs means the padding tail. CACHE: the loads' cache modifier."""
    # `0 * pid` makes both loop-carried tensors even when Triton specialises num_reqs == 1 to a constant.
    lo = 0 * pid
    hi = num_reqs + 0 * pid
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _tile_start(qsl_ptr, mid, BLOCK_Q, CACHE) <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    block_size,
    d,
    d_mask,
    start_n,
    load_begin,
    load_end,
    BLOCK_N: tl.constexpr,
    CACHE: tl.constexpr,
):
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of keys start_n + [0, BLOCK_N), loaded where a key lies in
    [load_begin, load_end) and 0 elsewhere (0 * NaN from unwritten slots would poison a row). CACHE: the loads'
    cache modifier."""
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_in = (k_pos >= load_begin) & (k_pos < load_end)
    # Physical slot of every key: its block from the block table, its offset within the block.
    block = tl.load(bt_row + k_pos // block_size, mask=k_in, other=0, cache_modifier=CACHE).to(tl.int64)
    in_block = k_pos % block_size
    k_ptrs = (
        k_cache_ptr
        + block[None, :] * kc_stride_b
        + in_block[None, :] * kc_stride_s
        + kv_head * kc_stride_h
        + d[:, None]
    )
    v_ptrs = (
        v_cache_ptr
        + block[:, None] * vc_stride_b
        + in_block[:, None] * vc_stride_s
        + kv_head * vc_stride_h
        + d[None, :]
    )
    k = tl.load(k_ptrs, mask=k_in[None, :] & d_mask[:, None], other=0.0, cache_modifier=CACHE)
    v = tl.load(v_ptrs, mask=k_in[:, None] & d_mask[None, :], other=0.0, cache_modifier=CACHE)
    return k, v


@triton.jit
def _softmax_step(
    q, k, v, m_i, l_i, acc, start_n, kv_end, row_ok, q_pos, qk_scale, sliding_window,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N step of the online softmax over the tile's keys (those at or past kv_end masked out)."""
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_ok = k_pos < kv_end
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
    allowed = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if sliding_window > 0:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows with nothing visible yet keep m = -inf; subtract 0 instead so no NaN (-inf - -inf) appears.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_keys(
    q,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    block_size,
    d,
    d_mask,
    row_ok,
    q_pos,
    qk_scale,
    sliding_window,
    kv_begin,
    kv_end,
    k_early,
    v_early,
    early_end,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY_KV: tl.constexpr,
):
    """Online softmax of the query rows over keys [kv_begin, kv_end) (kv_begin a multiple of BLOCK_N).

    EARLY_KV: (k_early, v_early) are the first tile's keys below early_end, loaded before the PDL wait
    (the kernels' EARLY_KV branch); this loads the rest of that tile, the keys a predecessor may have written.

    Returns fp32 (m, l, acc): running max of the log2-scaled scores, sum of exp2(score - m), unnormalised
    output. A row that sees no key keeps m = -inf, l = 0, acc = 0; an empty range returns exactly that."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    loop_begin = kv_begin
    if EARLY_KV:
        if kv_begin < kv_end:
            k_late, v_late = _kv_tile(
                k_cache_ptr, v_cache_ptr, bt_row, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b,
                vc_stride_s, vc_stride_h, block_size, d, d_mask, kv_begin, early_end, kv_end, BLOCK_N, "",
            )  # fmt: skip
            early = kv_begin + tl.arange(0, BLOCK_N) < early_end
            k = tl.where(early[None, :], k_early, k_late)
            v = tl.where(early[:, None], v_early, v_late)
            m_i, l_i, acc = _softmax_step(
                q, k, v, m_i, l_i, acc, kv_begin, kv_end, row_ok, q_pos, qk_scale, sliding_window, BLOCK_N,
                DOT_PRECISION,
            )  # fmt: skip
        loop_begin = kv_begin + BLOCK_N
    for start_n in range(loop_begin, kv_end, BLOCK_N):
        k, v = _kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b,
            vc_stride_s, vc_stride_h, block_size, d, d_mask, start_n, start_n, kv_end, BLOCK_N, "",
        )  # fmt: skip
        m_i, l_i, acc = _softmax_step(
            q, k, v, m_i, l_i, acc, start_n, kv_end, row_ok, q_pos, qk_scale, sliding_window, BLOCK_N,
            DOT_PRECISION,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _visible_keys(context_len, q_tile, q_len, seq_len, sliding_window, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr):
    """[kv_begin, kv_end) holding every key some query of the tile sees; kv_begin is a multiple of BLOCK_N.
    Causal upper bound from the tile's last query, window lower bound from its first."""
    kv_end = tl.minimum(context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len), seq_len)
    kv_begin = 0 * kv_end
    if sliding_window > 0:
        kv_begin = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    return kv_begin, kv_end


@triton.jit
def _split_share(kv_begin, kv_end, split, num_splits, BLOCK_N: tl.constexpr):
    """This split's share [split_begin, split_end) of the visible keys, from the real seq_len (the grid only knows
    shapes): whole BLOCK_N tiles, so every share starts aligned; trailing splits of a short context get nothing."""
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), num_splits) * BLOCK_N
    split_begin = kv_begin + split * chunk
    return split_begin, tl.minimum(split_begin + chunk, kv_end)


@triton.jit
def _late_lookup(qsl_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """(req, q_start, q_tile) of query-tile id `pid`, read after the PDL wait (the default path; EARLY_KV's
    `_early_inputs` reads them before it)."""
    req = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q, "")
    q_start = tl.load(qsl_ptr + req)
    q_tile = pid - _tile_start(qsl_ptr, req, BLOCK_Q, "")
    return req, q_start, q_tile


@triton.jit
def _early_inputs(
    qsl_ptr, seq_lens_ptr, block_tables_ptr, pid, num_reqs, bt_stride, sliding_window,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """EARLY_KV's step inputs of query-tile id `pid`, read before the PDL wait: (req, q_start, q_tile, q_len,
    context_len, kv_begin, kv_end, bt_row, live). Every load is in bounds also for the padding tail (req ==
    num_reqs: q_len and seq_len 0); `live` is false there and for a tile without queries. The loads go to L2 (.cg),
    which every grid's completed writes reach, not to an SM's L1."""
    req = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q, ".cg")
    real = req < num_reqs
    q_start = tl.load(qsl_ptr + req, cache_modifier=".cg")
    q_tile = pid - _tile_start(qsl_ptr, req, BLOCK_Q, ".cg")
    q_len = tl.load(qsl_ptr + req + 1, mask=real, other=0, cache_modifier=".cg") - tl.where(real, q_start, 0)
    seq_len = tl.load(seq_lens_ptr + req, mask=real, other=0, cache_modifier=".cg")
    context_len = seq_len - q_len
    kv_begin, kv_end = _visible_keys(context_len, q_tile, q_len, seq_len, sliding_window, BLOCK_Q, BLOCK_N)
    bt_row = block_tables_ptr + req.to(tl.int64) * bt_stride
    live = real & (q_tile * BLOCK_Q < q_len)
    return req, q_start, q_tile, q_len, context_len, kv_begin, kv_end, bt_row, live


@triton.jit
def _early_kv_tile(
    k_cache_ptr, v_cache_ptr, bt_row, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s,
    vc_stride_h, block_size, d, d_mask, begin, end, context_len, live, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The first tile of keys [begin, end) that lie below the request's context (written by earlier steps), read
    before the PDL wait through L2, and the bound early_end of what it holds (begin where nothing: a dead tile)."""
    early_end = tl.where(live, tl.minimum(context_len, end), begin)
    k, v = _kv_tile(
        k_cache_ptr, v_cache_ptr, bt_row, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b, vc_stride_s,
        vc_stride_h, block_size, d, d_mask, begin, begin, early_end, BLOCK_N, ".cg",
    )  # fmt: skip
    return k, v, early_end


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "bt_stride"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    qsl_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    bt_stride,
    qk_scale,  # softmax scale * log2(e): exp2 is cheaper than exp
    num_reqs,
    num_tokens,
    block_size,
    head_dim,
    sliding_window,  # <= 0: no window
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs: TF32 would cost ~1e-3 relative error
    USE_PDL: tl.constexpr = False,
    EARLY_KV: tl.constexpr = False,
):
    """Single pass: each program walks all visible keys of its (query tile, KV head) and writes `out`.

    EARLY_KV: the step inputs and the first tile's keys below the context are read before the PDL wait
    (`paged_attention(early_kv=True)`)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    if EARLY_KV:
        req, q_start, q_tile, q_len, context_len, kv_begin, kv_end, bt_row, live = _early_inputs(
            qsl_ptr, seq_lens_ptr, block_tables_ptr, pid, num_reqs, bt_stride, sliding_window, BLOCK_Q, BLOCK_N
        )
        k_early, v_early, early_end = _early_kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b,
            vc_stride_s, vc_stride_h, block_size, d, d_mask, kv_begin, kv_end, context_len, live, BLOCK_N,
        )  # fmt: skip
        pdl_start(USE_PDL)
    else:
        pdl_start(USE_PDL)
        req, q_start, q_tile = _late_lookup(qsl_ptr, pid, num_reqs, BLOCK_Q)
        k_early = 0.0
        v_early = 0.0
        early_end = 0

    q_idx = q_tile * BLOCK_Q + rows // GROUP  # query token within the request
    head = kv_head * GROUP + rows % GROUP

    if req == num_reqs:
        # Padding tail: zero rows [num_real, num_tokens) so stale or poisoned values never leak.
        t = q_start + q_idx
        row_ok = (rows < BLOCK_Q * GROUP) & (t < num_tokens)
        o_ptrs = out_ptr + t.to(tl.int64)[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        tl.store(o_ptrs, zeros, mask=row_ok[:, None] & d_mask[None, :])
        return

    if not EARLY_KV:
        q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid over-provisions tiles; this one has no queries
    if not EARLY_KV:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len
        kv_begin, kv_end = _visible_keys(context_len, q_tile, q_len, seq_len, sliding_window, BLOCK_Q, BLOCK_N)
        bt_row = block_tables_ptr + req.to(tl.int64) * bt_stride
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx  # absolute position of each row's query

    t = (q_start + q_idx).to(tl.int64)
    q_ptrs = q_ptr + t[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    m_i, l_i, acc = _attend_keys(
        q,
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head,
        kc_stride_b,
        kc_stride_s,
        kc_stride_h,
        vc_stride_b,
        vc_stride_s,
        vc_stride_h,
        block_size,
        d,
        d_mask,
        row_ok,
        q_pos,
        qk_scale,
        sliding_window,
        kv_begin,
        kv_end,
        k_early,
        v_early,
        early_end,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        DOT_PRECISION,
        EARLY_KV,
    )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_ptrs = out_ptr + t[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "bt_stride", "num_splits"])
def _paged_attention_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    m_part_ptr,  # [T, H, num_splits] fp32
    l_part_ptr,  # [T, H, num_splits] fp32
    acc_part_ptr,  # [T, H, num_splits, head_dim] fp32
    qsl_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,  # [T, H, head_dim]: written here only with FUSED_COMBINE
    counters_ptr,  # int32 [>= tiles * KV heads], zero between launches: only with FUSED_COMBINE
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    kc_stride_b,
    kc_stride_s,
    kc_stride_h,
    vc_stride_b,
    vc_stride_s,
    vc_stride_h,
    bt_stride,
    qk_scale,  # softmax scale * log2(e)
    num_reqs,
    num_heads,
    block_size,
    head_dim,
    sliding_window,  # <= 0: no window
    num_splits,  # a runtime value, not constexpr: one compiled kernel serves every split count
    num_tokens,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    FUSED_COMBINE: tl.constexpr = False,
    EARLY_KV: tl.constexpr = False,
):
    """Split pass: program (query tile, KV head, split) attends to the split-th share of the tile's visible
    keys and writes its partial (m, l, acc) for every real row, even when its share is empty, so that whoever
    combines can read all num_splits partials of every real token without knowing which are empty.

    FUSED_COMBINE: the last of a (tile, KV head)'s programs to arrive merges the partials into `out` itself (a
    serial split, as `skinny_linear`'s split-K), and split 0 of the padding tail's tiles zeroes its rows, so no
    combine kernel runs.

    EARLY_KV: the step inputs and the first tile of this split's keys below the context are read before the PDL
    wait (`paged_attention(early_kv=True)`)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    if EARLY_KV:
        req, q_start, q_tile, q_len, context_len, kv_begin, kv_end, bt_row, live = _early_inputs(
            qsl_ptr, seq_lens_ptr, block_tables_ptr, pid, num_reqs, bt_stride, sliding_window, BLOCK_Q, BLOCK_N
        )
        # `live` also keeps a padding tile's share (whose chunk a window can make negative) from loading anything.
        split_begin, split_end = _split_share(kv_begin, kv_end, split, num_splits, BLOCK_N)
        k_early, v_early, early_end = _early_kv_tile(
            k_cache_ptr, v_cache_ptr, bt_row, kv_head, kc_stride_b, kc_stride_s, kc_stride_h, vc_stride_b,
            vc_stride_s, vc_stride_h, block_size, d, d_mask, split_begin, split_end, context_len, live, BLOCK_N,
        )  # fmt: skip
        pdl_start(USE_PDL)
    else:
        pdl_start(USE_PDL)
        req, q_start, q_tile = _late_lookup(qsl_ptr, pid, num_reqs, BLOCK_Q)
        k_early = 0.0
        v_early = 0.0
        early_end = 0
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    if req == num_reqs:
        if FUSED_COMBINE:
            if split == 0:
                # Padding tail: zeros, as the single pass and the combine kernel write.
                t = q_start + q_idx
                pad_ok = (rows < BLOCK_Q * GROUP) & (t < num_tokens)
                o_ptrs = out_ptr + t.to(tl.int64)[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
                zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty)
                tl.store(o_ptrs, zeros, mask=pad_ok[:, None] & d_mask[None, :])
        return  # otherwise the combine kernel zeroes the padding tail
    if not EARLY_KV:
        q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid over-provisions tiles; this one has no queries

    if not EARLY_KV:
        seq_len = tl.load(seq_lens_ptr + req)
        context_len = seq_len - q_len
        kv_begin, kv_end = _visible_keys(context_len, q_tile, q_len, seq_len, sliding_window, BLOCK_Q, BLOCK_N)
        split_begin, split_end = _split_share(kv_begin, kv_end, split, num_splits, BLOCK_N)
        bt_row = block_tables_ptr + req.to(tl.int64) * bt_stride
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx

    t = (q_start + q_idx).to(tl.int64)
    q_ptrs = q_ptr + t[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    m_i, l_i, acc = _attend_keys(
        q,
        k_cache_ptr,
        v_cache_ptr,
        bt_row,
        kv_head,
        kc_stride_b,
        kc_stride_s,
        kc_stride_h,
        vc_stride_b,
        vc_stride_s,
        vc_stride_h,
        block_size,
        d,
        d_mask,
        row_ok,
        q_pos,
        qk_scale,
        sliding_window,
        split_begin,
        split_end,
        k_early,
        v_early,
        early_end,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        DOT_PRECISION,
        EARLY_KV,
    )

    part = (t * num_heads + head) * num_splits + split  # int64 [BLOCK_M]
    tl.store(m_part_ptr + part, m_i, mask=row_ok)
    tl.store(l_part_ptr + part, l_i, mask=row_ok)
    acc_ptrs = acc_part_ptr + part[:, None] * head_dim + d[None, :]
    tl.store(acc_ptrs, acc, mask=row_ok[:, None] & d_mask[None, :])
    if FUSED_COMBINE:
        # The barrier puts every thread's partial before the single acq_rel increment (release); its acquire side
        # makes the other splits' partials visible to the last program, which reads them through L2 (.cg).
        counter = counters_ptr + pid * tl.num_programs(1) + kv_head
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            _merge_splits(
                out_ptr, m_part_ptr, l_part_ptr, acc_part_ptr, t, head, d, d_mask, row_ok, o_stride_t, o_stride_h,
                num_heads, head_dim, num_splits, BLOCK_M, BLOCK_D,
            )  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def _merge_splits(
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    t,
    head,
    d,
    d_mask,
    row_ok,
    o_stride_t,
    o_stride_h,
    num_heads,
    head_dim,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The rows' log-sum-exp merge of their num_splits partials into `out`, in split order: the combine kernel's
    arithmetic, its sums taken one split at a time."""
    first = (t * num_heads + head) * num_splits  # int64 [BLOCK_M]
    m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        m = tl.load(m_part_ptr + first + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m)
    # Every split empty (m = -inf everywhere): 0 as the max, so no -inf - -inf = NaN appears (output 0).
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_tot = tl.zeros([BLOCK_M], dtype=tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        m = tl.load(m_part_ptr + first + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.math.exp2(m - m_safe)
        l_tot += w * tl.load(l_part_ptr + first + s, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_ptrs = acc_part_ptr + (first + s)[:, None] * head_dim + d[None, :]
        acc = tl.load(acc_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        o += w[:, None] * acc
    o = o / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
    o_ptrs = out_ptr + t[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _combine_splits_kernel(
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    qsl_ptr,
    o_stride_t,
    o_stride_h,
    num_reqs,
    num_heads,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits (every variant compiled at the first split call)
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program (token, query head): log-sum-exp merge of the token's num_splits partials into `out`.
    Tokens of the padding tail (t >= query_start_loc[-1]) are written as zeros."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    o_ptrs = out_ptr + t * o_stride_t + head * o_stride_h + d
    if t >= tl.load(qsl_ptr + num_reqs):
        # Padding tail (the partials of these rows were never written): zeros, as the single pass writes.
        tl.store(o_ptrs, tl.zeros([BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=d_mask)
        return

    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    part = (t * num_heads + head) * num_splits + s
    m = tl.load(m_part_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_part_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(acc_part_ptr + part[:, None] * head_dim + d[None, :], mask=s_ok[:, None] & d_mask[None, :], other=0.0)
    # Rescale every split to the common max. Empty splits have m = -inf: with m_max finite their weight is
    # exp2(-inf) = 0; if every split is empty use 0 as the max so no -inf - -inf = NaN appears (output 0).
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_safe)
    l_tot = tl.sum(w * l_s, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _compile_combine_variants(
    device: torch.device,
    dtype: torch.dtype,
    o_stride_t: int,
    o_stride_h: int,
    num_heads: int,
    head_dim: int,
    block_d: int,
    pdl: int,
) -> None:
    """Compiles (or loads from Triton's disk cache) the combine for every split count a call can take, the first
    time a layer's shapes split: each power of two up to _MAX_SPLITS is its own variant, and an eager step that met
    a new one compiled it mid-run (0.1-0.7 s). Graph capture makes that first call at start-up. Compiling
    launches nothing (`warmup` with dtypes for tensors), so it may happen inside a capture. A single variant
    (a 32-wide pass, or 8 splits at a time in a loop) cost 0.3-1.3 us more per call on an H200."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return
    f32 = torch.float32
    for block_s in (2**i for i in range(1, _MAX_SPLITS.bit_length())):
        _combine_splits_kernel.warmup(
            dtype,
            f32,
            f32,
            f32,
            torch.int32,
            o_stride_t,
            o_stride_h,
            1,
            num_heads,
            head_dim,
            block_s,
            grid=(1, num_heads),
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            USE_PDL=pdl,
            num_warps=4,
            **pdl_launch_options(pdl),
        )


class TileConfig(NamedTuple):
    """A launch's tile shape and schedule."""

    block_m: int
    """Rows of a program's tile: (query token, query head of the GQA group) pairs."""
    block_n: int
    """Keys per step of the KV walk."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipelining depth of the KV walk's loads."""


def _tile_sizes(num_tokens: int, num_reqs: int, group: int, head_dim: int, elem_size: int) -> TileConfig:
    """The tile from shapes only: tall tiles for prefill-heavy batches, short for decodes. A large batch of
    decodes (or verifications) with heads of at most 64 walks 128 keys a step: each program's walk is latency-
    bound, and twice the keys per load halve its steps (`_LONG_KEY_STEP_MIN_REQS`)."""
    avg_q = num_tokens / max(num_reqs, 1)
    rows = 128 if avg_q >= 64 else 64 if avg_q >= 16 else 16
    if elem_size * head_dim >= 512:
        rows = min(rows, 64)  # fp32 x 128 or bf16 x 256: a 128-row tile would not fit shared memory
    rows = max(rows, triton.next_power_of_2(group))
    block_n = 64 if head_dim <= 128 else 32
    if rows == 16 and head_dim <= 64 and num_reqs >= _LONG_KEY_STEP_MIN_REQS:
        block_n = 128
    num_warps = 8 if rows >= 128 else 4
    return TileConfig(rows, block_n, num_warps, 2)


def choose_num_splits(
    num_reqs: int, num_tokens: int, num_kv_heads: int, block_q: int, max_context: int, num_sms: int
) -> int:
    """How many KV splits `paged_attention` uses; 1 is the single-pass kernel. Shapes only (no device data).

    `block_q` is the query tokens per program, `max_context` the largest context a request can have (block
    table width * block size). Split only small-query batches (average query <= 16 tokens) whose
    (query tiles x KV heads) grid would leave SMs idle: enough splits for ~2 programs per SM (two where the
    grid alone is one to two programs per SM), at most _MAX_SPLITS, and no more than
    max_context / _MIN_KEYS_PER_SPLIT so each split has real work.
    """
    if num_reqs <= 0 or num_tokens <= 0 or num_tokens > _MAX_AVG_QUERY * num_reqs:
        return 1
    programs = max(num_reqs, -(-num_tokens // block_q)) * num_kv_heads
    # A grid of one to two waves still gets two splits: 32 decodes of 8 KV heads ran 24 % faster at 1,000 keys of
    # context (4 % slower at 315 on the 1B shape, 5 % faster on the 8B's; benchmarks/attention_splits.py).
    by_waves = _WAVES * num_sms // programs
    splits = min(2 if by_waves == 1 else by_waves, _MAX_SPLITS, max_context // _MIN_KEYS_PER_SPLIT)
    return max(splits, 1)


def make_combine_counters(device: torch.device | str) -> torch.Tensor:
    """Arrival counters for `paged_attention(counters=...)`: one per (query tile, KV head) of a split call, zero
    between calls (the last program to arrive resets its own). The caller owns them, one set per stream, and makes
    them outside a CUDA-graph capture (a capture would record the zeroing)."""
    return torch.zeros(_COMBINE_COUNTER_SLOTS, dtype=torch.int32, device=device)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (host-side, cached: no sync); a fixed H100-like default elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _DEFAULT_SMS


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    counters: torch.Tensor | None = None,
    early_kv: bool = False,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over paged K/V [NB, BS, KVH, D]; returns [T, H, D] in query's dtype.

    Request b's q_len queries sit at the last q_len of its seq_lens[b] positions. Query head h reads
    KV head h // (H // KVH). With `sliding_window` w, a query at position p sees keys in (p - w, p].
    Padded rows (t >= query_start_loc[-1]) are written as zeros. No host sync: only shapes are read.
    `num_splits` forces the number of KV splits (1: single pass); None lets `choose_num_splits` pick.
    `counters` (`make_combine_counters`) lets a split call merge its splits in the split pass itself, the last
    program of each query tile and KV head to finish merging them, instead of in a second kernel; calls sharing
    them must not run concurrently. A call whose grid has more (tile, KV head) pairs than counters takes the
    combine kernel.
    `early_kv` reads the step inputs (query_start_loc, seq_lens, block_tables) and each program's first tile of
    keys below its request's context before the kernel's PDL wait, so that their latency overlaps the previous
    kernel's tail; q and the keys at or past the context, which the kernels before it may be writing, after it.
    The caller guarantees that no kernel launched since its forward pass began writes those inputs nor any key below
    a request's context, and that the pass begins with a launch without PDL (the token embedding's gather): that
    launch completes only after every earlier kernel has, and every later kernel of the pass starts after it, even
    where launches let their successor start before their own wait (`pdl_mode`). What the early reads load was
    written before the pass, so it is complete, and the loads go to L2. The numbers are the same as without it,
    bit for bit.
    A grid of more than `_EARLY_KV_MAX_PROGRAMS_PER_SM` programs an SM ignores it (the registers it holds).
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    for t in (query, out, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dim must be contiguous"
    assert query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_tables.stride(-1) == 1

    block_m, block_n, num_warps, num_stages = _tile_sizes(num_tokens, num_reqs, group, head_dim, query.element_size())
    block_q = block_m // group
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_reqs, num_tokens, num_kv_heads, block_q, max_context, _num_sms(query.device))
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")
    if counters is not None and (counters.dtype != torch.int32 or counters.device != query.device):
        raise ValueError(
            f"counters must be int32 on {query.device} (make_combine_counters), got {counters.dtype} on "
            f"{counters.device}"
        )
    # Upper bound on tiles: request b uses ids [qsl[b] // BQ + b, qsl[b+1] // BQ + b + 1); the rest pad.
    num_tiles = num_tokens // block_q + num_reqs + 1
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_precision = "ieee" if query.dtype == torch.float32 else "tf32"
    qk_scale = scale * math.log2(math.e)
    window = sliding_window if sliding_window is not None else 0

    pdl = pdl_mode(query.device, num_tokens)
    programs = num_tiles * num_kv_heads * num_splits
    early_kv = early_kv and programs <= _EARLY_KV_MAX_PROGRAMS_PER_SM * _num_sms(query.device)
    if num_splits == 1:
        _paged_attention_kernel[(num_tiles, num_kv_heads)](
            query,
            k_cache,
            v_cache,
            out,
            query_start_loc,
            seq_lens,
            block_tables,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            qk_scale,
            num_reqs,
            num_tokens,
            block_size,
            head_dim,
            window,
            GROUP=group,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            DOT_PRECISION=dot_precision,
            USE_PDL=pdl,
            EARLY_KV=early_kv,
            num_warps=num_warps,
            num_stages=num_stages,
            **pdl_launch_options(pdl),
        )
        return out

    # Per-call scratch sized from shapes (a CUDA graph capture gives it a pool address). Only rows of real
    # tokens are written and read; the combine kernel never reads the padding tail's rows.
    dev = query.device
    m_part = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=dev)
    fused = counters is not None and counters.numel() >= num_tiles * num_kv_heads
    _paged_attention_split_kernel[(num_tiles, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        m_part,
        l_part,
        acc_part,
        query_start_loc,
        seq_lens,
        block_tables,
        out,
        counters if fused else m_part,  # never read unless fused
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        qk_scale,
        num_reqs,
        num_heads,
        block_size,
        head_dim,
        window,
        num_splits,
        num_tokens,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision,
        USE_PDL=pdl,
        FUSED_COMBINE=fused,
        EARLY_KV=early_kv,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_options(pdl),
    )
    if fused:
        return out
    _compile_combine_variants(out.device, out.dtype, out.stride(0), out.stride(1), num_heads, head_dim, block_d, pdl)
    _combine_splits_kernel[(num_tokens, num_heads)](
        out,
        m_part,
        l_part,
        acc_part,
        query_start_loc,
        out.stride(0),
        out.stride(1),
        num_reqs,
        num_heads,
        head_dim,
        num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        USE_PDL=pdl,
        num_warps=4,
        **pdl_launch_options(pdl),
    )
    return out


def compile_tile_variants(
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dtype: torch.dtype,
    scale: float,
    sliding_window: int | None = None,
    counters: torch.Tensor | None = None,
    early_kv: bool = False,
) -> int:
    """Runs `paged_attention` once for every tile (`_tile_sizes`) in both passes (single, split) for this head
    layout, on a one-request batch whose keys are block 0 of the cache (only read). Graph capture compiles the
    variants of uniform steps and the warm-up those of small eager ones, but a large eager batch of short queries
    (a prompt's last chunk joining a full batch of decodes) takes the single pass at the short tile, which
    compiled mid-run: 0.5-0.8 s on an H200, once per model. `counters` as the layer's calls pass them (the split
    pass merging its own splits is a variant of its own), and `early_kv` likewise. Returns the number of calls."""
    if k_cache.device.type != "cuda" or triton.knobs.runtime.interpret:
        return 0
    device, block_size = k_cache.device, k_cache.shape[1]
    head_dim, group = k_cache.shape[3], num_heads // k_cache.shape[2]
    elem_size = torch.empty((), dtype=dtype).element_size()
    calls, tiles = 0, set()
    # Average query lengths of the short, medium and tall tiles; the short one also for a large batch.
    for q_len, num_reqs in ((1, 1), (1, _LONG_KEY_STEP_MIN_REQS), (16, 1), (64, 1)):
        tile = _tile_sizes(q_len * num_reqs, num_reqs, group, head_dim, elem_size)
        if tile in tiles:
            continue
        tiles.add(tile)
        query = torch.zeros((q_len * num_reqs, num_heads, head_dim), dtype=dtype, device=device)
        query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=device) * q_len
        seq_lens = torch.full((num_reqs,), q_len, dtype=torch.int32, device=device)
        block_tables = torch.zeros((num_reqs, -(-q_len // block_size)), dtype=torch.int32, device=device)
        for num_splits in (1, 2):
            paged_attention(
                query,
                k_cache,
                v_cache,
                query_start_loc,
                seq_lens,
                block_tables,
                scale,
                None,
                sliding_window,
                num_splits=num_splits,
                counters=counters,
                early_kv=early_kv,
            )
            calls += 1
    return calls
