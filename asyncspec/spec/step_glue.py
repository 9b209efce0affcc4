"""The greedy speculative step's glue (kernels/spec_glue): the index and bookkeeping work between the verification's
and the draft's kernels, one Triton launch per function where the attention backend is Triton, the torch
references elsewhere. Both write the same values (the references were the code before the kernels existed)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncspec.kernels import spec_glue
from asyncspec.layers.attention import select_backend

FUSED_SPEC_GLUE_ENV = "ASYNCSPEC_FUSED_SPEC_GLUE"
"""Set to 0 to run the torch references on a GPU too (an A/B, or a suspected kernel bug); read at start."""


@dataclass(frozen=True)
class StepGlue:
    """One implementation of each function of kernels/spec_glue (see the references' docstrings)."""

    name: str
    """"triton" or "torch"."""
    verify_gather: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """The hidden rows, drafts and valid draft counts a greedy verification reads."""
    greedy_accept_commit: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """The runs a greedy verification accepts, from the target's tokens, written into the device's state (the
    emitted tokens, the computed counts)."""
    record_drafts: Callable[..., None]
    """A padded batch's drafts, kept per row and placed in the token buffer."""
    draft_step_meta: Callable[..., None]
    """The draft's catch-up meta and block tables after a greedy verification."""
    draft_loop_start: Callable[..., None]
    """The greedy proposal loop's start (newest token's hidden state, position, capacity, pass meta)."""
    draft_pass_inputs: Callable[..., None]
    """One proposal pass's inputs, one token a request."""


REFERENCE_GLUE = StepGlue(
    "torch",
    spec_glue.verify_gather_ref,
    spec_glue.greedy_accept_commit_ref,
    spec_glue.record_drafts_ref,
    spec_glue.draft_step_meta_ref,
    spec_glue.draft_loop_start_ref,
    spec_glue.draft_pass_inputs_ref,
)


def select_step_glue(device: torch.device | str) -> StepGlue:
    """Triton where the attention backend is (CUDA, unless $ASYNCSPEC_ATTENTION_BACKEND says otherwise) and
    $ASYNCSPEC_FUSED_SPEC_GLUE is not 0; the torch references elsewhere."""
    if select_backend(torch.device(device)).name != "triton" or os.environ.get(FUSED_SPEC_GLUE_ENV, "1") == "0":
        return REFERENCE_GLUE
    from asyncspec.kernels import spec_glue_triton as fused  # imported late, as the attention kernels

    return StepGlue(
        "triton",
        fused.verify_gather,
        fused.greedy_accept_commit,
        fused.record_drafts,
        fused.draft_step_meta,
        fused.draft_loop_start,
        fused.draft_pass_inputs,
    )
