"""Triton greedy argmax (same contract as `greedy_argmax_ref`, bit-identical to it): the first index of each row's
maximum, `invalid_id` for a row holding a NaN or whose maximum is -inf.

torch's `max(dim=-1)` reduces a row with one thread block, so a decode batch of a few rows over a 128K vocabulary
keeps a few SMs busy for ~27 us on an H100. Here a row is spread over many programs:

1. `_chunk_max_kernel`, grid (N, cdiv(V, BLOCK)): a program loads BLOCK elements of one row (math in fp32, exact
   for bf16 / fp16), sets its NaNs aside, and writes to the workspace (int32 [N, 2, chunks]: the maxima's fp32
   bits, then the columns) its chunk's maximum and the first column holding it, or -1 in place of that column
   when the chunk holds a NaN (the has-NaN flag).
2. `_combine_kernel`, grid (N,): one program per row reads the row's chunk results in chunk order and keeps a
   later chunk only when its maximum is strictly larger, so the first chunk holding the row's maximum wins and,
   within it, the first column: the first index overall, as torch's max. It writes `invalid_id` when a chunk
   flagged a NaN or the maximum is -inf. +0.0 and -0.0 compare equal, as in torch.

Where a row fits one block (V <= _MAX_ONE_CHUNK) stage 1 writes the result itself and stage 2 is not launched.

Block sizes, reasoned for an H100 (132 SMs, ~3.35 TB/s HBM, ~0.6-0.8 us DRAM latency); to be confirmed by timing:
- BLOCK = 4096 elements with 8 warps: 16 elements per thread, i.e. 4 independent 16-byte loads per thread for
  fp32 (2 for bf16 / fp16) issued back to back, 16 KB in flight per program, then two block reductions (max, then
  first index) whose cost is small next to one DRAM latency. (16-byte loads need 16-byte aligned rows, which
  Triton sees from the pointer and row stride: true of [N, 128256] logits; sm_90 PTX shows 4 ld.global.v4 per
  thread.)
- V = 128256: 32 chunks per row. N = 1 puts the whole row (513 KB fp32) in flight at once over 32 SMs in one wave,
  so stage 1 costs about one memory latency plus the launch; smaller blocks would spread it over more SMs but
  only save each SM's transfer of 16 KB (~0.1 us) while multiplying programs and chunk results. N = 64 gives 2048
  programs, 8 resident per SM (64 warps): far more bytes in flight than the ~2.7 MB HBM needs to run at full
  bandwidth (latency x bandwidth), so the launch is bandwidth-bound (32.8 MB fp32). Larger blocks (16K) would
  leave N = 1 on 8 SMs moving 64 KB each.
- V = 8192 (and any V <= _MAX_ONE_CHUNK): one program per row over BLOCK = next_power_of_2(V) elements (8192 ->
  32 per thread): a small row is latency-bound either way, and a single launch saves the second kernel (its
  launch gap, ~1 us in a CUDA graph without PDL, and its own DRAM round trip) that splitting it would cost.
- Stage 2: one warp per row, reading the chunk results in tiles of up to _MAX_CHUNK_TILE (one tile for any real
  vocabulary).

Two launches rather than "the last-arriving program of a row combines": that needs arrival counters kept at zero
between launches (persistent per-device state, unsafe across concurrent streams) for a gain of one launch gap,
which programmatic dependent launch (kernels/pdl.py) already mostly hides: both kernels wait for their predecessor
first thing, so the combine launches and ramps up while stage 1 drains. No atomics, so results are deterministic.
Only shapes are read on the host (the workspace is a torch.empty), so the launch never syncs with the device and
can be captured in a CUDA graph.

`greedy_argmax_into_tokens` is a decode step's greedy tail in the same launches: the program that writes a row's
result also writes the token into the device token buffer at (batch row, sequence length), where the next step
reads its input id (InputBatch.write_sampled_tokens' contract). In torch that write took six more kernels (a cast
of the lengths, the clamp, a gather, a comparison, a select and the scatter); the row and column are loaded right
after the PDL wait, so their latency hides under the row's reduction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncspec.kernels.paged_attention_triton import _patch_interpreter
from asyncspec.kernels.pdl import pdl_enabled, pdl_launch_options, pdl_start

if triton.knobs.runtime.interpret:
    _patch_interpreter()  # the combine's loop bound is a kernel argument (idempotent)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 4096  # elements of one row per stage-1 program (see the module docstring)
_MAX_ONE_CHUNK = 8192  # rows up to this long take one program each and a single launch
_MIN_BLOCK = 32  # one warp's worth; a forced `block` may go down to 16
_MAX_BLOCK = 16384  # a forced `block` above this would not fit one program's registers
_MAX_CHUNK_TILE = 1024  # chunk results the combine reads per step
_MAX_CHUNKS = 65535  # CUDA's limit on the grid's second dimension
_MAX_VOCAB = 2**30  # columns (and the last block's padding past V) are int32 inside the kernels


@triton.jit
def _token_slot(tokens_ptr, token_stride, rows_ptr, cols_ptr, row, WRITE_TOKENS: tl.constexpr):
    """The token buffer's address for `row`'s sampled token (batch row rows[row], column cols[row]) and whether to
    write it: a column of 0 is a graph bucket's padding request, which leaves the buffer alone."""
    if WRITE_TOKENS:
        col = tl.load(cols_ptr + row).to(tl.int64)
        return tokens_ptr + tl.load(rows_ptr + row).to(tl.int64) * token_stride + col, col > 0
    return tokens_ptr, False


@triton.jit
def _store_result(out_ptr, out_stride, row, value, slot, write, WRITE_TOKENS: tl.constexpr):
    """out[row] = value; with WRITE_TOKENS the token too, never a placeholder (an invalid id is written as 0: its
    request fails, and a step already planned behind this one feeds the value to the model)."""
    tl.store(out_ptr + row * out_stride, value)
    if WRITE_TOKENS:
        tl.store(slot, tl.maximum(value, 0), mask=write)


@triton.jit
def _chunk_max_kernel(
    x_ptr,
    row_stride,
    V,
    ws_ptr,
    num_chunks,
    out_ptr,
    out_stride,
    invalid_id,
    tokens_ptr,
    token_stride,
    rows_ptr,
    cols_ptr,
    BLOCK: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    WRITE_TOKENS: tl.constexpr = False,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    if ONE_CHUNK:
        slot, write = _token_slot(tokens_ptr, token_stride, rows_ptr, cols_ptr, row, WRITE_TOKENS)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * row_stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    nan = x != x
    x = tl.where(nan, float("-inf"), x)
    best = tl.max(x, axis=0)
    # The first column holding the maximum (the chunk has a column < V, and the masked ones come after it),
    # -1 when the chunk holds a NaN.
    first = tl.min(tl.where(nan, -1, tl.where(x == best, cols, V)), axis=0)
    if ONE_CHUNK:
        valid = (best > float("-inf")) & (first >= 0)
        value = tl.where(valid, first.to(tl.int64), invalid_id)
        _store_result(out_ptr, out_stride, row, value, slot, write, WRITE_TOKENS)
    else:
        slot = ws_ptr + row * (2 * num_chunks) + chunk
        tl.store(slot, best.to(tl.int32, bitcast=True))
        tl.store(slot + num_chunks, first)


@triton.jit
def _combine_kernel(
    ws_ptr,
    num_chunks,
    out_ptr,
    out_stride,
    invalid_id,
    tokens_ptr,
    token_stride,
    rows_ptr,
    cols_ptr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    WRITE_TOKENS: tl.constexpr = False,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    slot, write = _token_slot(tokens_ptr, token_stride, rows_ptr, cols_ptr, row, WRITE_TOKENS)
    values_ptr = ws_ptr + row * (2 * num_chunks)
    firsts_ptr = values_ptr + num_chunks
    offs = tl.arange(0, BLOCK_C)
    best = tl.full([], float("-inf"), tl.float32)
    best_col = tl.full([], 0, tl.int32)
    lowest = tl.full([], 0, tl.int32)  # < 0 once a chunk flagged a NaN
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + offs
        m = c < num_chunks
        value = tl.load(values_ptr + c, mask=m, other=0).to(tl.float32, bitcast=True)
        value = tl.where(m, value, float("-inf"))
        first = tl.load(firsts_ptr + c, mask=m, other=2147483647)
        tile_best = tl.max(value, axis=0)
        # Columns grow with the chunk, so the smallest column at the maximum is the first chunk's.
        tile_col = tl.min(tl.where(value == tile_best, first, 2147483647), axis=0)
        later_wins = tile_best > best  # equal maxima keep the earlier tile
        best = tl.where(later_wins, tile_best, best)
        best_col = tl.where(later_wins, tile_col, best_col)
        lowest = tl.minimum(lowest, tl.min(first, axis=0))
    valid = (best > float("-inf")) & (lowest >= 0)
    _store_result(
        out_ptr, out_stride, row, tl.where(valid, best_col.to(tl.int64), invalid_id), slot, write, WRITE_TOKENS
    )


def _unsupported(logits: torch.Tensor) -> str | None:
    """Why `greedy_argmax` cannot take these logits, or None."""
    if logits.dim() != 2:
        return f"logits must be 2-D [num_rows, vocab], got shape {tuple(logits.shape)} (reshape to [-1, vocab])"
    if logits.dtype not in _DTYPES:
        return f"logits dtype {logits.dtype} is not supported: pass float32, bfloat16 or float16"
    if logits.shape[1] == 0:
        return "logits have an empty vocabulary (last dim 0): there is no token to pick"
    if logits.shape[1] > _MAX_VOCAB:
        return f"vocabulary of {logits.shape[1]} exceeds {_MAX_VOCAB} columns"
    if not (logits.is_cuda or triton.knobs.runtime.interpret):
        return f"logits on {logits.device}: the Triton kernel needs a CUDA tensor (or TRITON_INTERPRET=1)"
    return None


def greedy_argmax_supported(logits: torch.Tensor) -> bool:
    """Whether `greedy_argmax` takes these logits: 2-D with a non-empty last dim, float32 / bfloat16 / float16, on a
    CUDA device (or the CPU under TRITON_INTERPRET=1). Callers fall back to `greedy_argmax_ref` otherwise."""
    return _unsupported(logits) is None


def choose_block(vocab: int) -> int:
    """Stage-1 block for a vocabulary: the whole row (a power of two) up to _MAX_ONE_CHUNK, else _BLOCK."""
    if vocab <= _MAX_ONE_CHUNK:
        return max(_MIN_BLOCK, triton.next_power_of_2(vocab))
    return _BLOCK


def greedy_argmax(
    logits: torch.Tensor, invalid_id: int, *, out: torch.Tensor | None = None, block: int | None = None
) -> torch.Tensor:
    """[N, V] logits -> [N] int64: the first index of each row's maximum, `invalid_id` for a row holding a NaN or
    whose maximum is -inf; see `greedy_argmax_ref`.

    Rows may be strided (a last dim that is not dense is copied first). `out`, if given, receives the result (an
    int64 [N] tensor on the logits' device) and is returned. `block` (a power of two) overrides `choose_block`
    (tests and benchmarks). Raises ValueError for inputs it does not take (see `greedy_argmax_supported`).
    """
    return _greedy_argmax(logits, invalid_id, out, block, None)


def greedy_argmax_into_tokens(
    logits: torch.Tensor,
    invalid_id: int,
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """`greedy_argmax`, and each row's token written into token_ids [R, L] at (rows[i], cols[i]) in the same
    launches, as `greedy_argmax_into_tokens_ref` says: never below 0 (an invalid id writes 0), and nothing where
    cols[i] == 0 (a graph bucket's padding request). rows and cols are [N] integer tensors on the device (cols may be
    int32: the sequence lengths as the attention reads them); every written (row, col) must lie inside token_ids,
    which the caller guarantees (a sequence length is always below max_model_len)."""
    if token_ids.dim() != 2 or token_ids.dtype != torch.int64 or token_ids.stride(1) != 1:
        raise ValueError(
            f"token_ids must be an int64 [rows, len] tensor with dense rows, got {token_ids.dtype} "
            f"{tuple(token_ids.shape)}"
        )
    n = logits.shape[0] if logits.dim() == 2 else -1
    for name, t in (("rows", rows), ("cols", cols)):
        if t.shape != (n,) or t.dtype not in (torch.int32, torch.int64) or t.device != token_ids.device:
            raise ValueError(
                f"{name} must be an int32 or int64 [{n}] tensor on {token_ids.device}, got {t.dtype} "
                f"{tuple(t.shape)} on {t.device}"
            )
    return _greedy_argmax(logits, invalid_id, out, block, (token_ids, rows, cols))


def _greedy_argmax(
    logits: torch.Tensor,
    invalid_id: int,
    out: torch.Tensor | None,
    block: int | None,
    tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    reason = _unsupported(logits)
    if reason is not None:
        raise ValueError(f"greedy_argmax: {reason}; greedy_argmax_ref takes any float logits")
    num_rows, vocab = logits.shape
    if out is None:
        out = torch.empty((num_rows,), dtype=torch.int64, device=logits.device)
    elif out.shape != (num_rows,) or out.dtype != torch.int64 or out.device != logits.device:
        raise ValueError(
            f"out must be an int64 [{num_rows}] tensor on {logits.device}, got {out.dtype} {tuple(out.shape)} "
            f"on {out.device}"
        )
    if block is None:
        block = choose_block(vocab)
    elif not (16 <= block <= _MAX_BLOCK and block & (block - 1) == 0):
        raise ValueError(f"block must be a power of two in [16, {_MAX_BLOCK}], got {block}")
    num_chunks = triton.cdiv(vocab, block)
    if num_chunks > _MAX_CHUNKS:
        raise ValueError(
            f"vocabulary {vocab} needs {num_chunks} blocks of {block} (> {_MAX_CHUNKS}): pass a larger block"
        )
    if num_rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    one_chunk = num_chunks == 1
    ws = out if one_chunk else torch.empty((num_rows, 2, num_chunks), dtype=torch.int32, device=logits.device)
    pdl = pdl_enabled(logits.device)
    # Never read without WRITE_TOKENS: any tensors stand in for the token buffer's arguments.
    token_ids, rows, cols = tokens if tokens is not None else (out, out, out)
    token_args = (token_ids, token_ids.stride(0) if tokens is not None else 0, rows, cols)
    _chunk_max_kernel[(num_rows, num_chunks)](
        logits,
        logits.stride(0),
        vocab,
        ws,
        num_chunks,
        out,
        out.stride(0),
        invalid_id,
        *token_args,
        BLOCK=block,
        ONE_CHUNK=one_chunk,
        USE_PDL=pdl,
        WRITE_TOKENS=tokens is not None and one_chunk,
        num_warps=max(1, min(8, block // 512)),
        **pdl_launch_options(pdl),
    )
    if not one_chunk:
        block_c = min(triton.next_power_of_2(num_chunks), _MAX_CHUNK_TILE)  # >= 2 chunks here
        _combine_kernel[(num_rows,)](
            ws,
            num_chunks,
            out,
            out.stride(0),
            invalid_id,
            *token_args,
            BLOCK_C=block_c,
            USE_PDL=pdl,
            WRITE_TOKENS=tokens is not None,
            num_warps=1,
            **pdl_launch_options(pdl),
        )
    return out
