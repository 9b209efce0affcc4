"""Linear layers whose decode-sized calls may take the skinny Triton kernel.

A decode step multiplies one row per request (k + 1 with speculation) by every weight matrix: at up to
32 rows purely a read of the weights. There the Triton kernel of `kernels/skinny_linear_triton.py`
measured faster than cuBLAS: alone at one and two rows on every Llama-1B / 8B / tensor-parallel shape
(benchmarks/skinny_linear.py), and inside the graphed decode step (where its launches overlap under
PDL and cuBLAS's do not) at every batch up to 32 (benchmarks/graph_replay.py: the Llama-1B / 8B
steps 4-8 % faster at batches 4, 8 and 32, docs/benchmarks.md).
`DecodeLinear` is an `nn.Linear` (same parameters, same checkpoint names) that sends its calls of
at most `SkinnyLinear.max_rows` rows there once a model is switched over (`use_skinny_linear`);
every other call, and every call before that, is `F.linear`. The model runner captures its graphs
with every size the kernel takes and runs eager steps with calls of at most 2 rows on it (see
`model_runner.EAGER_SKINNY_ROWS`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from asyncspec.errors import ConfigError
from asyncspec.layers.switches import on_off_switch

if TYPE_CHECKING:
    from asyncspec.kernels.skinny_linear import FoldedNorm
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

NORM_FOLD_ENV = "ASYNCSPEC_NORM_FOLD"
"""1 (the default) folds the residual add + RMSNorm inside decoder layers into the projections around it for
graphed decode calls of `NORM_FOLD_MIN_ROWS` rows or more: no norm kernel runs between o and gate|up or between
down and the next q|k|v. 0 keeps the norm kernels (docs/benchmarks.md has the measurements)."""
NORM_FOLD_MIN_ROWS = 4
"""The fewest rows a folded call takes by default: on an H200 at 315 keys the fold made the 1B's 4-row forward
3.9 % faster and its 2-row forward 7.6 % slower (2026-12-06); one row keeps the streamed MLP and attention input."""
NORM_FOLD_MIN_ROWS_ENV = "ASYNCSPEC_NORM_FOLD_MIN_ROWS"
"""Overrides NORM_FOLD_MIN_ROWS (1 to 32), to measure the fold at fewer rows: at one row it also stands in for the
streamed MLP and attention input, whose kernels take the norms themselves."""


DECODE_ROWS = 32
"""The skinny kernel's decode-sized rows (`skinny_linear_triton.MAX_M`): past them its tensor-core tiles run in row
blocks, each reading the weight again."""
WIDE_MAX_WEIGHT_BYTES = 6 << 20
"""Past DECODE_ROWS rows, by default, only weights of at most this many bytes take the kernel: those of the shapes it
was measured faster on there (the bundled pair's, whose largest is the target's 6 MiB LM head: on an H100,
2026-12-07, the draft engine's k = 4 step at 32 streams 8 % faster, the target's 64- and 128-request decode graphs
20-26 %). Its row blocks re-read a weight, from L2 only where it fits beside everything else (an H100 has 50 MB): a
Llama-1B LM head (525 MB) would be read from DRAM five times at 160 rows, where cuBLAS reads it once. A Llama-1B's
q|k|v and o (12 and 8 MiB) made its 64- and 128-request forwards 2 % and 8 % slower there (the same card and day)."""
WIDE_MAX_MIB_ENV = "ASYNCSPEC_SKINNY_WIDE_MAX_MIB"
"""Raises (or lowers) WIDE_MAX_WEIGHT_BYTES, in MiB from 1 to WIDE_MAX_MIB_LIMIT: to measure wider weights."""
WIDE_MAX_MIB_LIMIT = 16
"""The largest wide weight the setting takes, in MiB: beyond it the row blocks' re-reads leave L2."""
SKINNY_MAX_ROWS_ENV = "ASYNCSPEC_SKINNY_MAX_ROWS"
"""The most rows of a graphed call that takes the skinny kernel (32 to the kernel's 1024; DEFAULT_MAX_ROWS unset):
above 32 a speculative step's verification (k + 1 rows a request) and the draft's catch-up keep the kernel and its
fused epilogues (RoPE and the KV write, SiLU, the norm fold) instead of cuBLAS and separate kernels, for weights of at
most WIDE_MAX_WEIGHT_BYTES. 32 keeps every wider call on cuBLAS (the default until 2026-12-07)."""
DEFAULT_MAX_ROWS = 256
"""The layers' default row limit: a k = 4 verification of 32 requests (160 rows) and the bundled target's 128-request
decode graphs, both measured faster with the kernel on an H100 (2026-12-07). Past it (a verification of 128 requests
is 640 rows, the draft's catch-up 768) 1024 gained nothing in a closed batch of 128 (an H100, session 53)."""


class SkinnyMaxRowsSettingError(ConfigError):
    """ASYNCSPEC_SKINNY_MAX_ROWS or ASYNCSPEC_SKINNY_WIDE_MAX_MIB holds a value it does not take."""


def skinny_max_rows() -> int:
    """ASYNCSPEC_SKINNY_MAX_ROWS read (unset: DEFAULT_MAX_ROWS); anything but 32 to the kernel's 1024 is an error."""
    from asyncspec.kernels.skinny_linear_triton import MAX_M, WIDE_MAX_M

    value = os.environ.get(SKINNY_MAX_ROWS_ENV, str(DEFAULT_MAX_ROWS)).strip()
    if not (value.isascii() and value.isdigit()) or not MAX_M <= int(value) <= WIDE_MAX_M:
        raise SkinnyMaxRowsSettingError(
            f"{SKINNY_MAX_ROWS_ENV}={value!r}: set it to a row count from {MAX_M} to {WIDE_MAX_M} "
            f"(unset: {DEFAULT_MAX_ROWS})"
        )
    return int(value)


def wide_max_weight_bytes() -> int:
    """ASYNCSPEC_SKINNY_WIDE_MAX_MIB read, in bytes (unset: WIDE_MAX_WEIGHT_BYTES); anything but 1 to 16 MiB is an
    error."""
    value = os.environ.get(WIDE_MAX_MIB_ENV)
    if value is None:
        return WIDE_MAX_WEIGHT_BYTES
    value = value.strip()
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= WIDE_MAX_MIB_LIMIT:
        raise SkinnyMaxRowsSettingError(
            f"{WIDE_MAX_MIB_ENV}={value!r}: set it to a weight size in MiB from 1 to {WIDE_MAX_MIB_LIMIT} "
            f"(unset: {WIDE_MAX_WEIGHT_BYTES >> 20})"
        )
    return int(value) << 20


class NormFoldSettingError(ConfigError):
    """ASYNCSPEC_NORM_FOLD or ASYNCSPEC_NORM_FOLD_MIN_ROWS holds a value it does not take."""


def norm_fold_requested() -> bool:
    """ASYNCSPEC_NORM_FOLD read: 1 or unset is on, 0 is off; anything else is an error."""
    return on_off_switch(NORM_FOLD_ENV, default=True, error=NormFoldSettingError)


def norm_fold_min_rows() -> int:
    """ASYNCSPEC_NORM_FOLD_MIN_ROWS read (unset: NORM_FOLD_MIN_ROWS); anything but 1 to 32 is an error."""
    value = os.environ.get(NORM_FOLD_MIN_ROWS_ENV, str(NORM_FOLD_MIN_ROWS)).strip()
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 32:
        raise NormFoldSettingError(f"{NORM_FOLD_MIN_ROWS_ENV}={value!r}: set it to a row count from 1 to 32")
    return int(value)


@dataclass(frozen=True)
class SkinnyLinear:
    """The decode-shaped kernel as a model's linear layers use it."""

    max_rows: int
    """Calls with at most this many rows take the kernel (where it measured faster than cuBLAS)."""
    counters: torch.Tensor
    """Split-K arrival counters shared by the model's layers (they run one after another on one stream)."""
    kernel: Callable[..., torch.Tensor]
    """skinny_linear(x, weight, bias, counters=...)."""
    supported: Callable[[torch.Tensor, torch.Tensor], bool]
    """Whether the kernel takes these operands (else F.linear)."""
    gated_kernel: Callable[..., torch.Tensor] | None = None
    """skinny_linear_gated(x, weight, bias, counters=...): the MLP's gate|up projection with the activation
    in its epilogue, [M, I] out (None: the projection, then the activation kernel)."""
    rotary_kernel: Callable[..., torch.Tensor] | None = None
    """skinny_linear_rotary(x, weight, bias, counters=..., num_heads=..., ...): the attention's q|k|v projection
    with RoPE and the KV-cache write in its epilogue, q rotated [M, H, D] out (None: the projection, then the
    rotary kernel)."""
    add_norm_kernel: Callable[..., FoldedNorm] | None = None
    """skinny_linear_add_norm(x, weight, bias, residual=..., norm_weight=..., eps=..., counters=...): a row-parallel
    projection with the residual add and the next norm's weighting in its epilogue, for the next projection's
    `row_scale=` (None: no fold; see NORM_FOLD_ENV)."""
    fold_min_rows: int = NORM_FOLD_MIN_ROWS
    """The fewest rows a folded call takes (NORM_FOLD_MIN_ROWS_ENV)."""
    wide_max_weight_bytes: int = WIDE_MAX_WEIGHT_BYTES
    """Past DECODE_ROWS rows, the largest weight (bytes) that takes the kernel (WIDE_MAX_MIB_ENV)."""

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a call on x takes the kernel: 2-D, at most max_rows rows, operands it supports, and a weight
        its row blocks may re-read (`weight_fits`)."""
        if x.dim() != 2 or x.shape[0] > self.max_rows or not self.weight_fits(x.shape[0], weight):
            return False
        return self.supported(x, weight)

    def weight_fits(self, rows: int, weight: torch.Tensor) -> bool:
        """Up to DECODE_ROWS rows any weight; past them one of at most `wide_max_weight_bytes`."""
        return rows <= DECODE_ROWS or weight.numel() * weight.element_size() <= self.wide_max_weight_bytes

    def folds(self, x: torch.Tensor) -> bool:
        """Whether a decoder layer's call on x folds its norms into the projections: the fold is on and x is a
        bf16 call of fold_min_rows to max_rows rows."""
        return (
            self.add_norm_kernel is not None
            and self.rotary_kernel is not None
            and self.gated_kernel is not None
            and x.dtype == torch.bfloat16
            and self.fold_min_rows <= x.shape[0] <= self.max_rows
        )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, skinny: SkinnyLinear | None
) -> torch.Tensor:
    """x @ weight^T (+ bias): the skinny kernel for a decode-sized x it takes, else F.linear."""
    if skinny is not None and skinny.takes(x, weight):
        return skinny.kernel(x, weight, bias, counters=skinny.counters)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    skinny: SkinnyLinear | None,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """silu_and_mul(x @ weight^T (+ bias)) for the MLP's fused gate|up weight: one kernel for a decode-sized x
    the gated kernel takes (gate|up never written), else `linear` then the activation. The same numbers either
    way where the kernel serves both (the epilogue rounds the projection as the kernel's output would be)."""
    if skinny is not None and skinny.gated_kernel is not None and skinny.takes(x, weight):
        return skinny.gated_kernel(x, weight, bias, counters=skinny.counters)
    return silu_and_mul(linear(x, weight, bias, skinny))


ROTARY_IN_LINEAR_ENV = "ASYNCSPEC_ROTARY_IN_LINEAR"
"""Set to 0 to run the q|k|v projection and the RoPE + KV-write kernel separately (an A/B switch, read when the
kernel is set up)."""


def linear_rotary_kv_write(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    skinny: SkinnyLinear | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    row_scale: FoldedNorm | None = None,
) -> torch.Tensor | None:
    """q rotated [T, H, D] from one kernel that also rotates k and writes k and v to the cache, for a bf16
    decode-sized x the kernel takes; None where it does not serve (the caller projects, then runs the rotary
    kernel: bit for bit the same numbers, which the fused kernel keeps only in bf16). With `row_scale`, x is that
    `FoldedNorm`'s x_weighted and the projection that of the folded norm's output."""
    if skinny is None or skinny.rotary_kernel is None or x.dtype != torch.bfloat16 or not skinny.takes(x, weight):
        return None
    k_cache, v_cache = kv_cache
    return skinny.rotary_kernel(
        x,
        weight,
        bias,
        counters=skinny.counters,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        positions=positions,
        cos_cache=cos_cache,
        sin_cache=sin_cache,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
        row_scale=row_scale,
    )


class DecodeLinear(nn.Linear):
    """`nn.Linear` whose decode-sized calls take the skinny kernel once `skinny_linear` is set, and whose one-row
    calls take the streamed GEMV once `streamed_gemv` is set (layers/streamed_linear.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.skinny_linear: SkinnyLinear | None = None
        self.streamed_gemv: StreamedGemv | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemv = self.streamed_gemv
        if gemv is not None and self.bias is None and gemv.applies(x, self.weight):
            return gemv(x, self.weight)
        return linear(x, self.weight, self.bias, self.skinny_linear)


def make_skinny_linear(device: torch.device, max_rows: int | None = None) -> SkinnyLinear:
    """The Triton kernel on `device` (CUDA) for calls of at most `max_rows` rows (None: `skinny_max_rows()`, 256
    unless ASYNCSPEC_SKINNY_MAX_ROWS says otherwise; past 32 rows only for weights of `wide_max_weight_bytes()`)."""
    from asyncspec.kernels.skinny_linear_triton import (
        make_split_counters,
        skinny_linear,
        skinny_linear_add_norm,
        skinny_linear_gated,
        skinny_linear_rotary,
        skinny_linear_supported,
    )

    return SkinnyLinear(
        skinny_max_rows() if max_rows is None else max_rows,
        make_split_counters(device),
        skinny_linear,
        skinny_linear_supported,
        skinny_linear_gated,
        None if os.environ.get(ROTARY_IN_LINEAR_ENV, "1") == "0" else skinny_linear_rotary,
        skinny_linear_add_norm if norm_fold_requested() else None,
        norm_fold_min_rows(),
        wide_max_weight_bytes(),
    )


def use_skinny_linear(model: nn.Module, skinny: SkinnyLinear | None) -> int:
    """Points every module of `model` that has a `skinny_linear` attribute (the `DecodeLinear`
    layers, and a causal LM for its logits) at `skinny` (None: back to F.linear everywhere).
    Returns how many modules it set."""
    count = 0
    for module in model.modules():
        if "skinny_linear" in vars(module):
            setattr(module, "skinny_linear", skinny)  # noqa: B010 - mypy types nn.Module attributes as Tensor | Module
            count += 1
    return count
