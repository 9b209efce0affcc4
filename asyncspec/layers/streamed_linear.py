"""The streamed GEMV (kernels/streamed_gemv_gluon.py) for a model's attention output projections: when it serves,
and setting it up.

A batch-1 decode step's o projection follows the attention, whose few latency-bound programs leave DRAM idle. The
streamed GEMV's loader warp streams the projection's weight into shared memory from the kernel's start, before its
PDL wait, so the copies overlap the attention's tail instead of following it. It takes one-row bf16 calls of a
bias-free o projection on Hopper (`DecodeLinear.streamed_gemv`); every other call keeps its usual kernel.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncspec.layers.linear import DecodeLinear
from asyncspec.layers.streamed_mlp import unavailable_reason

if TYPE_CHECKING:
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

logger = logging.getLogger(__name__)

STREAMED_O_PROJ_ENV = "ASYNCSPEC_STREAMED_O_PROJ"
"""Set to 1 to run batch-1 decode layers' attention output projection as a streamed Gluon GEMV on Hopper (off by
default until it is measured faster in the engine: docs/benchmarks.md). It has no grid barrier: safe under MPS. Only
the target model's one-row calls take it: a speculative verify step has k + 1 rows, and the draft keeps its kernels."""


class StreamedLinearSettingError(ValueError):
    """ASYNCSPEC_STREAMED_O_PROJ holds a value other than 0 or 1."""


def streamed_o_proj_requested() -> bool:
    """ASYNCSPEC_STREAMED_O_PROJ read: 0 or unset is off, 1 is on; anything else is an error."""
    value = os.environ.get(STREAMED_O_PROJ_ENV, "0").strip()
    if value not in ("0", "1"):
        raise StreamedLinearSettingError(f"{STREAMED_O_PROJ_ENV}={value!r}: set it to 0 (off, the default) or 1 (on)")
    return value == "1"


def o_projections(model: nn.Module) -> list[DecodeLinear]:
    """Every attention block's bias-free output projection in `model` (a module's `o_proj`), where the block is
    not split by tensor parallelism (not measured there)."""
    found: list[DecodeLinear] = []
    for module in model.modules():
        o_proj = getattr(module, "o_proj", None)
        tp = getattr(module, "tp", None)
        if isinstance(o_proj, DecodeLinear) and o_proj.bias is None and not (tp is not None and tp.enabled):
            found.append(o_proj)
    return found


def make_streamed_o_proj(model: nn.Module, device: torch.device) -> StreamedGemv | None:
    """The GEMV for `model`'s o projections on `device` when ASYNCSPEC_STREAMED_O_PROJ=1 asks for it and it can
    serve them; otherwise None (logged when it was asked for)."""
    if not streamed_o_proj_requested():
        return None
    from asyncspec.kernels.streamed_gemv import StreamedGemvConfig, gemv_shape_supported

    config = StreamedGemvConfig(stages=8, boxes=1, warps=4)
    reason = unavailable_reason(device)
    shapes = {tuple(o.weight.shape) for o in o_projections(model)}
    if reason is None and not any(gemv_shape_supported(config, n, k) for n, k in shapes):
        reason = "no bias-free o projection has a shape it takes (16-row tiles, 256-column boxes)"
    if reason is not None:
        logger.warning("%s=1 but the streamed o projection is off: %s", STREAMED_O_PROJ_ENV, reason)
        return None
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    logger.info("streamed o projection on for batch-1 decode, shapes %s", sorted(shapes))
    return StreamedGemv(device, config)


def use_streamed_o_proj(model: nn.Module, gemv: StreamedGemv | None) -> int:
    """Points every bias-free o projection of `model` at `gemv` (None: their usual kernels); returns how many."""
    projections = o_projections(model)
    for o_proj in projections:
        o_proj.streamed_gemv = gemv
    return len(projections)
