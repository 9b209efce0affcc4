"""The streamed MLP (kernels/streamed_mlp_gluon.py) for a model's decoder layers: when it serves, and setting it up.

A decoder layer whose post-attention half it serves has a `streamed_mlp` attribute (None: the chain of kernels);
`use_streamed_mlp` points those at one `StreamedMLP`. It takes one-row bf16 calls on Hopper without tensor
parallelism or MLP biases: the batch-1 decode step.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncspec.errors import ConfigError
from asyncspec.layers.streamed_shapes import MIN_STREAMED_TILE_COLUMNS, num_sms, one_tile_per_sm
from asyncspec.layers.switches import on_off_switch

if TYPE_CHECKING:
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP

logger = logging.getLogger(__name__)

STREAMED_MLP_ENV = "ASYNCSPEC_STREAMED_MLP"
"""How batch-1 decode layers run their post-attention norm and MLP on Hopper: `auto` (the default) as streamed
Gluon kernels in the `split-deep` form for only the shapes measured faster, those whose down projection
`one_tile_per_sm` takes (the Llama-1B's [2048, 8192]: its step ran 1.7-2.0 % faster on an H200 and 0.8 % on an
H100; the 8B's ran 3.2 % slower on an H200, so it keeps the chain), `0` never, `1` always in the `barrier` form, or a
form by name. `barrier` is one kernel whose grid barrier needs one program resident on every SM at once: do not use
it under MPS (an active-thread percentage below 100, or two engines' kernels running side by side on one GPU, could
leave programs waiting for each other for ever). `split` is two kernels without a barrier (gate|up, then the down
projection as a streamed GEMV), which cannot hang; their rings share an SM, so that the second kernel's loader
starts during the first's tail. `split-deep` is those two kernels with a ring of a whole SM's shared memory each
(about 200 KiB in flight a program, where `split` keeps 80-96 KiB); it has no barrier either."""
STREAMED_MLP_NORM_FOLD_ENV = "ASYNCSPEC_STREAMED_MLP_NORM_FOLD"
"""1 folds the next layer's input norm into the streamed MLP's down projection (split forms: the residual add and
h * norm weight in its epilogue, the row's factor in the next q|k|v projection), so that no norm kernel runs between
two batch-1 layers (the default: 0.4 % off the 1B's batch-1 forward on an H100, 2026-12-07); 0 runs the norm
kernel."""
STREAMED_MLP_FORMS = ("barrier", "split", "split-deep")
DEFAULT_STREAMED_MLP_FORM = "barrier"
"""The form `1` selects: the one measured faster in the engine's graphs (2026-12-04)."""
AUTO_STREAMED_MLP_FORM = "split-deep"
"""The form `auto` takes where the shapes qualify: of the three, the only one measured faster on both cards."""


class StreamedMLPSettingError(ConfigError):
    """ASYNCSPEC_STREAMED_MLP holds a value other than 0, 1, auto, barrier, split or split-deep, or
    ASYNCSPEC_STREAMED_MLP_NORM_FOLD one other than 0 or 1."""


def streamed_mlp_norm_fold() -> bool:
    """ASYNCSPEC_STREAMED_MLP_NORM_FOLD read: 1 or unset is on, 0 is off; anything else is an error."""
    return on_off_switch(STREAMED_MLP_NORM_FOLD_ENV, default=True, error=StreamedMLPSettingError)


def streamed_mlp_form() -> str | None:
    """ASYNCSPEC_STREAMED_MLP read: "auto" (also unset), 0 is off (None), 1 the default form, or a form by name;
    anything else is an error."""
    value = os.environ.get(STREAMED_MLP_ENV, "auto").strip().lower()
    if value == "0":
        return None
    if value == "1":
        return DEFAULT_STREAMED_MLP_FORM
    if value != "auto" and value not in STREAMED_MLP_FORMS:
        raise StreamedMLPSettingError(
            f"{STREAMED_MLP_ENV}={value!r}: set it to auto (the default: the split-deep form for the shapes it was "
            f"measured faster on), 0 (off), 1 (on, the {DEFAULT_STREAMED_MLP_FORM} form), barrier (one kernel with a "
            "grid barrier), split (two kernels, no barrier) or split-deep (split with deeper rings)"
        )
    return value


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` (None: it can): it needs CUDA on compute capability 9.x (TMA, warp
    specialisation, register reallocation), Triton's Gluon, and no interpreter."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    import triton

    if triton.knobs.runtime.interpret:
        return "the Triton interpreter is on"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return f"compute capability {major}.{minor}: the kernel is written for 9.x (Hopper)"
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError as exc:
        return f"this Triton has no Gluon ({exc})"
    return None


def served_shapes(model: nn.Module) -> set[tuple[int, int]]:
    """(hidden, intermediate) of every decoder layer with a `streamed_mlp` slot whose MLP the kernel can take:
    no tensor parallelism, no biases."""
    shapes = set()
    for module in model.modules():
        if "streamed_mlp" not in vars(module):
            continue
        mlp = getattr(module, "mlp", None)
        if mlp is None or mlp.tp.enabled or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            continue
        shapes.add((mlp.down_proj.weight.shape[0], mlp.down_proj.weight.shape[1]))
    return shapes


def make_streamed_mlp(model: nn.Module, device: torch.device) -> StreamedMLP | None:
    """The kernel for `model`'s layers on `device` when ASYNCSPEC_STREAMED_MLP asks for it (a form, or auto where
    `one_tile_per_sm` takes every served down projection) and it can serve them; otherwise None (logged when a
    form was asked for by name)."""
    form = streamed_mlp_form()
    if form is None:
        return None
    fold_next_norm = streamed_mlp_norm_fold()
    setting = form
    reason = unavailable_reason(device)
    if form == "auto":
        down_weights = served_shapes(model)  # (hidden, intermediate): the down projection's [N, K]
        if reason is None and not one_tile_per_sm(down_weights, num_sms(device)):
            reason = (
                f"the down projections {sorted(down_weights)} do not have between half the GPU's SMs and all of them "
                f"in 16-row tiles of at least {MIN_STREAMED_TILE_COLUMNS} columns"
            )
        form = AUTO_STREAMED_MLP_FORM
    from asyncspec.kernels.streamed_mlp import StreamedMLPConfig, shape_supported

    if form == "split-deep":
        # 16 is a cap: `stages_for` keeps as many slots as fit beside the vectors (13 for the 1B, 12 for the 8B).
        config = StreamedMLPConfig(stages=16, grid_barrier=False, co_resident=False)
    else:
        config = StreamedMLPConfig(grid_barrier=form == "barrier")
    shapes = {shape for shape in served_shapes(model) if shape_supported(config, *shape)}
    if reason is None and not shapes:
        reason = (
            f"no decoder layer has an MLP shape its {form} form takes (hidden and intermediate multiples of 512, "
            "no TP, rings of 2 slots beside the vectors in shared memory)"
        )
    if reason is not None:
        # auto (the default) asks only where the measured shapes are: elsewhere (another GPU, another model) its
        # absence is no surprise, and not worth a line at every start.
        log = logger.debug if setting == "auto" else logger.warning
        log("%s=%s but the streamed MLP is off: %s", STREAMED_MLP_ENV, setting, reason)
        return None
    from asyncspec.kernels.streamed_mlp_gluon import StreamedMLP

    if fold_next_norm and form == "barrier" and STREAMED_MLP_NORM_FOLD_ENV in os.environ:
        # Only when asked for by name: by default the barrier form simply keeps its norm kernel.
        logger.warning(
            "%s=1 but the streamed MLP's barrier form has its down projection inside its one kernel: the next "
            "layer's norm is not folded (the split and split-deep forms fold it)",
            STREAMED_MLP_NORM_FOLD_ENV,
        )
    logger.info(
        "streamed MLP (%s form, %s=%s) on for batch-1 decode, shapes %s%s",
        form,
        STREAMED_MLP_ENV,
        setting,
        sorted(shapes),
        ", the next norm folded into its down projection" if fold_next_norm and form != "barrier" else "",
    )
    return StreamedMLP(device, shapes, config, fold_next_norm=fold_next_norm)


def use_streamed_mlp(model: nn.Module, streamed: StreamedMLP | None) -> int:
    """Points every decoder layer of `model` with a `streamed_mlp` slot at `streamed`; returns how many."""
    count = 0
    for module in model.modules():
        if "streamed_mlp" in vars(module):
            setattr(module, "streamed_mlp", streamed)  # noqa: B010 - mypy types nn.Module attributes as Tensor | Module
            count += 1
    return count
