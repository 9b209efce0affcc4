"""The streamed attention input (kernels/streamed_attn_in_gluon.py) for a model's decoder layers: when it serves,
and setting it up.

A decoder layer whose attention input it serves has a `streamed_attn_in` attribute (None: the input norm, then the
q|k|v projection with RoPE and the KV write in its epilogue). It takes one-row bf16 calls on Hopper of attention
blocks without q/k norm, q|k|v bias or tensor parallelism: the batch-1 decode step of Llama and Mistral.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncspec.errors import ConfigError
from asyncspec.layers.streamed_mlp import unavailable_reason
from asyncspec.layers.switches import on_off_switch

if TYPE_CHECKING:
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

logger = logging.getLogger(__name__)

STREAMED_ATTN_IN_ENV = "ASYNCSPEC_STREAMED_ATTN_IN"
"""Set to 1 to run batch-1 decode layers' input norm, q|k|v projection, RoPE and KV write as one streamed Gluon
kernel on Hopper (off by default until it is verified and measured on a GPU in the engine: docs/benchmarks.md). It
has no grid barrier: safe under MPS."""
RING_STAGES = 6
"""Slots of 2 boxes in its ring: 96 KiB, a Llama-1B program's whole share of the q|k|v weight, small enough that a
program fits an SM beside one of the kernel before it (the split streamed MLP's down projection holds 112 KiB) and
can start streaming while that one finishes. Not yet tuned on a GPU."""


class StreamedAttnInSettingError(ConfigError):
    """ASYNCSPEC_STREAMED_ATTN_IN holds a value other than 0 or 1."""


def streamed_attn_in_requested() -> bool:
    """ASYNCSPEC_STREAMED_ATTN_IN read: 0 or unset is off, 1 is on; anything else is an error."""
    return on_off_switch(STREAMED_ATTN_IN_ENV, default=False, error=StreamedAttnInSettingError)


def served_shapes(model: nn.Module) -> set[tuple[int, int, int, int]]:
    """(hidden, heads, KV heads, head_dim) of every decoder layer with a `streamed_attn_in` slot whose attention
    input the kernel can take: no q/k norm, no q|k|v bias, no tensor parallelism."""
    shapes = set()
    for module in model.modules():
        if "streamed_attn_in" not in vars(module):
            continue
        attn = getattr(module, "self_attn", None)
        if attn is None or attn.qk_norm or attn.qkv_proj.bias is not None or attn.tp.enabled:
            continue
        hidden = attn.qkv_proj.weight.shape[1]
        shapes.add((hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim))
    return shapes


def make_streamed_attn_in(model: nn.Module, device: torch.device) -> StreamedAttnIn | None:
    """The kernel for `model`'s layers on `device` when ASYNCSPEC_STREAMED_ATTN_IN=1 asks for it and it can serve
    them; otherwise None (logged when it was asked for)."""
    if not streamed_attn_in_requested():
        return None
    from asyncspec.kernels.streamed_attn_in import StreamedAttnInConfig, shape_supported

    config = StreamedAttnInConfig(stages=RING_STAGES)
    reason = unavailable_reason(device)
    shapes = {shape for shape in served_shapes(model) if shape_supported(config, *shape)}
    if reason is None and not shapes:
        reason = "no decoder layer has an attention input it takes (no q/k norm, bias or TP; head_dim % 16 == 0)"
    if reason is not None:
        logger.warning("%s=1 but the streamed attention input is off: %s", STREAMED_ATTN_IN_ENV, reason)
        return None
    from asyncspec.kernels.streamed_attn_in_gluon import StreamedAttnIn

    logger.info("streamed attention input on for batch-1 decode, shapes %s", sorted(shapes))
    return StreamedAttnIn(device, shapes, config)


def use_streamed_attn_in(model: nn.Module, streamed: StreamedAttnIn | None) -> int:
    """Points every decoder layer of `model` with a `streamed_attn_in` slot at `streamed`; returns how many."""
    count = 0
    for module in model.modules():
        if "streamed_attn_in" in vars(module):
            setattr(module, "streamed_attn_in", streamed)  # noqa: B010 - mypy types nn.Module attributes as Tensor | Module
            count += 1
    return count
