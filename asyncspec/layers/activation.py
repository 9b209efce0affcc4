"""SiLU-and-multiply of the SwiGLU MLP: one Triton kernel on the GPU, the pure-torch reference elsewhere."""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncspec.kernels.silu_and_mul import silu_and_mul_ref
from asyncspec.layers.attention import select_backend


def _triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from asyncspec.kernels import silu_and_mul_triton  # imported late, as the attention kernels

    return silu_and_mul_triton.silu_and_mul(x)


def select_silu_and_mul(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """[T, 2I] -> silu(x[:, :I]) * x[:, I:]; the Triton kernel where the attention backend is Triton."""
    if select_backend(device).name == "triton":
        return _triton_silu_and_mul
    return silu_and_mul_ref
