"""Rejection sampler front-end: draws the step's randomness, then verifies the drafts in one kernel.

The kernel (Triton on CUDA, the pure-torch reference elsewhere; `asyncspec.kernels.rejection_sample`
documents the exact contract) accepts draft j with probability min(1, p_j(x_j) / q_j(x_j)), draws the
token after the first rejection from max(p - q, 0) and the bonus token from p only when every draft was
accepted, so the emitted tokens are distributed exactly as the target's samples. Greedy rows accept
while the draft equals the target's argmax. Nothing here reads a device tensor on the host.

Randomness: each row gets K uniforms (acceptance) and V exponentials (the one exponential race at the
stopping position). A seeded request draws exactly that amount from its own generator every step,
whatever happens in the batch, so its tokens never depend on its neighbours; the other rows draw from
the default generator in one batched call.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from asyncspec.errors import ConfigError
from asyncspec.kernels.rejection_sample import rejection_sample_ref

RejectionKernel = Callable[..., tuple[Tensor, Tensor]]

BACKEND_ENV = "ASYNCSPEC_REJECTION_BACKEND"
"""Environment override: "torch" or "triton" (e.g. triton on the CPU under TRITON_INTERPRET=1)."""


def _triton_rejection_sample(*args, **kwargs) -> tuple[Tensor, Tensor]:
    # Imported on first call: importing triton is slow and optional on the CPU, and a late lookup picks
    # up a re-import done under TRITON_INTERPRET=1 (tests do that).
    from asyncspec.kernels import rejection_sample_triton

    return rejection_sample_triton.rejection_sample_triton(*args, **kwargs)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_rejection_kernel(device: torch.device | str) -> RejectionKernel:
    """Triton on CUDA when triton imports, else the torch reference; $ASYNCSPEC_REJECTION_BACKEND overrides."""
    choice = os.environ.get(BACKEND_ENV, "").strip().lower()
    if choice == "torch":
        return rejection_sample_ref
    if choice == "triton":
        return _triton_rejection_sample
    if choice:
        raise ConfigError(f"{BACKEND_ENV} must be 'torch' or 'triton', got {choice!r}")
    if torch.device(device).type == "cuda" and _triton_available():
        return _triton_rejection_sample
    return rejection_sample_ref


def draw_rejection_randomness(
    num_rows: int,
    num_spec: int,
    vocab_size: int,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
    device: torch.device | str,
    *,
    max_num_spec: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(uniform [N, K] in [0, 1), exponential [N, V] ~ Exp(1) clamped to >= float32 tiny), float32.

    Row r in `generators` draws its K uniforms, then its V exponentials, from its own generator (always
    that amount); the other rows draw from `default_generator` (None: torch's default) in one batched
    call per tensor. Rows of `generators` outside [0, num_rows) are ignored.

    max_num_spec: when the step's K varies with the batch (K = the widest row's drafts), pass the
    configured number of speculative tokens: seeded rows then always draw max_num_spec uniforms (the
    first K are used), so their streams stay independent of the neighbours' draft counts."""
    uniform = torch.empty((num_rows, num_spec), dtype=torch.float32, device=device)
    exponential = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=device)
    seeded = {r: g for r, g in generators.items() if 0 <= r < num_rows}
    if len(seeded) < num_rows:
        uniform.uniform_(generator=default_generator)
        exponential.exponential_(generator=default_generator)
    num_seeded_uniforms = num_spec if max_num_spec is None else max_num_spec
    if num_seeded_uniforms < num_spec:
        raise ValueError(f"max_num_spec={max_num_spec} is smaller than this step's {num_spec} draft positions")
    for row, gen in seeded.items():
        if num_seeded_uniforms == num_spec:
            uniform[row].uniform_(generator=gen)
        else:
            draws = torch.empty(num_seeded_uniforms, dtype=torch.float32, device=device).uniform_(generator=gen)
            uniform[row].copy_(draws[:num_spec])
        exponential[row].exponential_(generator=gen)
    # Exp(1) may round to 0; p / 0 would be inf (or NaN for p == 0) and win the race.
    exponential.clamp_min_(torch.finfo(torch.float32).tiny)
    return uniform, exponential


class RejectionSampler:
    """Verifies K draft tokens per row against the target; see the module docstring.

    Returns (output_token_ids [N, K+1] int64, num_accepted [N] int64): the accepted drafts, then one
    recovered or bonus token at position num_accepted, then -1. A row whose distribution at that
    position is not a distribution (NaN, inf, no positive mass) gets -1 there too: fail that request.
    """

    def __init__(self, device: torch.device | str, num_speculative_tokens: int | None = None) -> None:
        self.device = torch.device(device)
        self.kernel: RejectionKernel = select_rejection_kernel(self.device)
        self.num_speculative_tokens = num_speculative_tokens
        """The configured k, when a step's K may be smaller (see draw_rejection_randomness's max_num_spec)."""

    def __call__(
        self,
        target_probs: Tensor,
        draft_token_ids: Tensor,
        draft_probs: Tensor | None,
        num_draft_tokens: Tensor,
        is_greedy: Tensor,
        generators: dict[int, torch.Generator],
        default_generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor]:
        """target_probs [N, K+1, V] float32 (processed: penalties, temperature, top-k/p, min-p,
        softmax), draft_token_ids [N, K] int64 (padding past num_draft_tokens ignored), draft_probs
        [N, K, V] float32 or None (a deterministic proposer: q is one-hot at the draft),
        num_draft_tokens [N] int64 in [0, K], is_greedy [N] bool."""
        num_rows, k1, vocab_size = target_probs.shape
        uniform, exponential = draw_rejection_randomness(
            num_rows,
            k1 - 1,
            vocab_size,
            generators,
            default_generator,
            target_probs.device,
            max_num_spec=self.num_speculative_tokens,
        )
        return self.kernel(
            target_probs, draft_token_ids, draft_probs, num_draft_tokens, is_greedy, uniform, exponential
        )
