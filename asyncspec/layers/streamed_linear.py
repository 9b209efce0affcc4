"""The streamed GEMV (kernels/streamed_gemv_gluon.py) for a model's attention output projections and MLP down
projections: when it serves, and setting it up.

A batch-1 decode step's o projection follows the attention, whose few latency-bound programs leave DRAM idle. The
streamed GEMV's loader warp streams the projection's weight into shared memory from the kernel's start, before its
PDL wait, so where a program is resident early the copies overlap the predecessor's tail. For the down projection
the ring is deep instead (about 208 KiB a program): what sets its rate is the bytes each program keeps in flight,
and such a program cannot share an SM with much else, so its early start counts for little. It takes one-row bf16
calls of a bias-free projection on Hopper (`DecodeLinear.streamed_gemv`); every other call keeps its usual kernel.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncspec.errors import ConfigError
from asyncspec.layers.linear import DecodeLinear
from asyncspec.layers.streamed_mlp import unavailable_reason
from asyncspec.layers.streamed_shapes import MIN_STREAMED_TILE_COLUMNS, num_sms, one_tile_per_sm, share_fits_ring

if TYPE_CHECKING:
    from asyncspec.kernels.streamed_gemv import StreamedGemvConfig
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

logger = logging.getLogger(__name__)

STREAMED_O_PROJ_ENV = "ASYNCSPEC_STREAMED_O_PROJ"
"""auto (the default) runs batch-1 decode layers' attention output projection as a streamed Gluon GEMV on Hopper
for only the shapes whose every program's share of the weight fits its ring (`share_fits_ring`: the Llama-1B's
[2048, 2048], one 64 KiB tile a program; not the 8B's [4096, 4096]), so that all of it is in shared memory by the
time the attention ends. 1 takes every shape the kernel can, 0 none. It has no grid barrier: safe under MPS. Only
the target model's one-row calls take it: a speculative verify step has k + 1 rows, and the draft keeps its kernels."""


STREAMED_DOWN_PROJ_ENV = "ASYNCSPEC_STREAMED_DOWN_PROJ"
"""auto (the default) runs batch-1 decode layers' MLP down projection as a streamed Gluon GEMV with a deep ring on
Hopper for only the shapes it was measured faster on: a down projection whose 16-row tiles number between half the
GPU's SMs and all of them, one tile a program, each at least 4,096 columns wide (the Llama-1B's [2048, 8192]; not
the 8B's 4,096 rows, nor the bundled target's [384, 1024]). 1 takes every shape the kernel can, 0 none. As the o
projection's: no grid barrier, the target's one-row calls only. The streamed MLP (ASYNCSPEC_STREAMED_MLP), where
on, runs the whole post-attention half instead; its own `auto` takes the same shapes, so `auto` here then stays off."""
STREAMED_SETTINGS = ("0", "1", "auto")


class StreamedLinearSettingError(ConfigError):
    """ASYNCSPEC_STREAMED_O_PROJ or ASYNCSPEC_STREAMED_DOWN_PROJ holds a value it does not take."""


def _setting(env: str) -> str:
    value = os.environ.get(env, "auto").strip().lower()
    if value not in STREAMED_SETTINGS:
        raise StreamedLinearSettingError(
            f"{env}={value!r}: set it to 0 (off), 1 (on) or auto (the default: on for the shapes it was measured "
            "faster on)"
        )
    return value


def streamed_o_proj_setting() -> str:
    """ASYNCSPEC_STREAMED_O_PROJ read: "auto" (also unset: the shapes of `share_fits_ring`), "1" (every shape it
    takes) or "0" (off); anything else is an error."""
    return _setting(STREAMED_O_PROJ_ENV)


def streamed_down_proj_setting() -> str:
    """ASYNCSPEC_STREAMED_DOWN_PROJ read: "auto" (also unset: the shapes of `one_tile_per_sm`), "1" (every shape
    it takes) or "0" (off); anything else is an error."""
    return _setting(STREAMED_DOWN_PROJ_ENV)


def _projections(model: nn.Module, name: str) -> list[DecodeLinear]:
    found: list[DecodeLinear] = []
    for module in model.modules():
        proj = getattr(module, name, None)
        tp = getattr(module, "tp", None)
        if isinstance(proj, DecodeLinear) and proj.bias is None and not (tp is not None and tp.enabled):
            found.append(proj)
    return found


def o_projections(model: nn.Module) -> list[DecodeLinear]:
    """Every attention block's bias-free output projection in `model` (a module's `o_proj`), where the block is
    not split by tensor parallelism (not measured there)."""
    return _projections(model, "o_proj")


def down_projections(model: nn.Module) -> list[DecodeLinear]:
    """Every MLP's bias-free down projection in `model` (a module's `down_proj`), where the MLP is not split by
    tensor parallelism (not measured there)."""
    return _projections(model, "down_proj")


def _make_gemv(
    device: torch.device,
    projections: list[DecodeLinear],
    config: StreamedGemvConfig,
    env: str,
    what: str,
    setting: str = "1",
) -> StreamedGemv | None:
    from asyncspec.kernels.streamed_gemv import gemv_shape_supported

    reason = unavailable_reason(device)
    shapes = {tuple(p.weight.shape) for p in projections}
    if reason is None and not shapes:
        reason = f"no bias-free {what} outside tensor parallelism"
    if reason is None and not any(gemv_shape_supported(config, n, k) for n, k in shapes):
        reason = f"no bias-free {what} has a shape it takes (16-row tiles, 256-column boxes)"
    if reason is not None:
        # auto (the default) asks only where the kernel fits: elsewhere (another GPU, another shape) its absence is
        # no surprise, and not worth a line at every start.
        log = logger.debug if setting == "auto" else logger.warning
        log("%s=%s but the streamed %s is off: %s", env, setting, what, reason)
        return None
    from asyncspec.kernels.streamed_gemv_gluon import StreamedGemv

    logger.info("streamed %s on for batch-1 decode, shapes %s", what, sorted(shapes))
    return StreamedGemv(device, config)


def make_streamed_o_proj(model: nn.Module, device: torch.device) -> StreamedGemv | None:
    """The GEMV for `model`'s o projections on `device` when ASYNCSPEC_STREAMED_O_PROJ asks for it (1, or auto where
    `share_fits_ring` holds) and it can serve them; otherwise None (logged when it was asked for)."""
    setting = streamed_o_proj_setting()
    if setting == "0":
        return None
    from asyncspec.kernels.streamed_gemv import BOX_BYTES, StreamedGemvConfig, gemv_stages_for

    # The o projection is latency-bound (a few µs): a deeper ring measured no faster (docs/benchmarks.md).
    config = StreamedGemvConfig(stages=8, boxes=1, warps=4)
    projections = o_projections(model)
    shapes = {(p.weight.shape[0], p.weight.shape[1]) for p in projections}
    if setting == "auto" and shapes and unavailable_reason(device) is None:
        sms = num_sms(device)
        if not share_fits_ring(shapes, sms, lambda k: gemv_stages_for(config, k) * config.boxes * BOX_BYTES):
            logger.debug(
                "streamed o projection off (auto): shapes %s need more than a program's ring of the %d SMs",
                sorted(shapes),
                sms,
            )
            return None
    return _make_gemv(device, projections, config, STREAMED_O_PROJ_ENV, "o projection", setting)


def make_streamed_down_proj(model: nn.Module, device: torch.device) -> StreamedGemv | None:
    """The GEMV for `model`'s down projections on `device` when ASYNCSPEC_STREAMED_DOWN_PROJ asks for it (1, or auto
    where `one_tile_per_sm` holds and no streamed MLP already serves the layers: set those first) and it can serve
    them; otherwise None (logged when it was asked for)."""
    setting = streamed_down_proj_setting()
    if setting == "0":
        return None
    if setting == "auto" and any(vars(m).get("streamed_mlp") is not None for m in model.modules()):
        logger.debug("streamed down projection off (auto): the streamed MLP runs the layers' one-row MLP calls")
        return None
    projections = down_projections(model)
    shapes = {(p.weight.shape[0], p.weight.shape[1]) for p in projections}
    if setting == "auto" and shapes and unavailable_reason(device) is None:
        sms = num_sms(device)
        if not one_tile_per_sm(shapes, sms):
            logger.debug(
                "streamed down projection off (auto): shapes %s do not have between half the %d SMs and all of them "
                "in 16-row tiles of at least %d columns",
                sorted(shapes),
                sms,
                MIN_STREAMED_TILE_COLUMNS,
            )
            return None
    from asyncspec.kernels.streamed_gemv import StreamedGemvConfig

    # 16 is a cap: `gemv_stages_for` keeps as many 16 KiB slots as fit beside the row (13 for the 1B's 8,192
    # columns, 12 for the 8B's 14,336). Those are the bytes in flight a program needs to read at the card's rate;
    # 8 single-box slots read at 0.80 of it (docs/benchmarks.md, 2026-12-05).
    config = StreamedGemvConfig(stages=16, boxes=2, warps=8)
    return _make_gemv(device, projections, config, STREAMED_DOWN_PROJ_ENV, "down projection", setting)


def _point(projections: list[DecodeLinear], gemv: StreamedGemv | None) -> int:
    for proj in projections:
        proj.streamed_gemv = gemv
    return len(projections)


def use_streamed_o_proj(model: nn.Module, gemv: StreamedGemv | None) -> int:
    """Points every bias-free o projection of `model` at `gemv` (None: their usual kernels); returns how many."""
    return _point(o_projections(model), gemv)


def use_streamed_down_proj(model: nn.Module, gemv: StreamedGemv | None) -> int:
    """Points every bias-free down projection of `model` at `gemv` (None: their usual kernels); returns how
    many."""
    return _point(down_projections(model), gemv)
