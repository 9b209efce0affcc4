"""Reference (pure torch) SwiGLU activation, computed exactly like LlamaMLP (asyncspec/models/llama.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2 * I] -> [T, I], in x.dtype as the model does.

    F.silu is evaluated in fp32 and rounded to x.dtype, and the product of the two x.dtype operands is rounded
    again (bf16 / fp16 results differ from an all-fp32 computation by that double rounding). `out`, if given,
    receives the result (and is returned).
    """
    inter = x.shape[-1] // 2
    gate, up = x.split(inter, dim=-1)
    result = F.silu(gate) * up
    return result if out is None else out.copy_(result)
