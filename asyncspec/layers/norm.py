"""RMSNorm computed in fp32 and cast back, exactly like Hugging Face's LlamaRMSNorm; fused with the
residual add (one Triton kernel on the GPU, the pure-torch reference elsewhere)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from asyncspec.kernels.fused_add_rms_norm import fused_add_rms_norm_ref
from asyncspec.layers.attention import select_backend

FusedAddRMSNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _triton_fused_add_rms_norm(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    from asyncspec.kernels import fused_add_rms_norm_triton  # imported late, as the attention kernels

    return fused_add_rms_norm_triton.fused_add_rms_norm(*args, **kwargs)


def select_fused_add_rms_norm(device: torch.device) -> FusedAddRMSNorm:
    """The Triton kernel where the attention backend is Triton (one switch for the GPU path)."""
    if select_backend(device).name == "triton":
        return _triton_fused_add_rms_norm
    return fused_add_rms_norm_ref


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalised over the last dim."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._fused: FusedAddRMSNorm | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast before the weight multiply, as HF does, so bf16 results match bit for bit.
        return self.weight * h.to(input_dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with residual None, (norm(x), x). The same numbers as
        an add then `forward`, in one kernel on the GPU."""
        if self._fused is None:
            self._fused = select_fused_add_rms_norm(x.device)
        return self._fused(x, residual, self.weight, self.eps)
