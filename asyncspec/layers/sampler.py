"""Sampler: logits of one row per request -> next token ids (+ logprobs), as vLLM does it.

Order: raw logprobs -> blocked ids -> penalties -> greedy argmax | temperature, min-p, top-k,
top-p, exponential-race sampling (vLLM's order: min-p is one of its argmax-invariant logits processors, applied
before top-k/top-p). Everything is vectorised over rows except the per-row draws
of seeded requests, which use each request's own generator so that a seeded request's tokens
never depend on its batch neighbours or position. Nothing here reads a device tensor back to
the host, so the sampler adds no hidden host-device sync to the hot loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from asyncspec.kernels.greedy_argmax import greedy_argmax_into_tokens_ref, greedy_argmax_ref
from asyncspec.layers.attention import select_backend
from asyncspec.sampling_params import SAMPLING_EPS, SamplingParams

INVALID_TOKEN_ID = -1
"""What the sampler returns for a row with no valid token (NaN logits, or every token masked)."""

_UINT64_MASK = 2**64 - 1
# Layout of torch's CPU generator state (CPUGeneratorImplStateLegacy): the initial seed (u64),
# `left` and `seeded` (i32 each), `next` (u64), then the 624 words of MT19937 (one u64 each).
_MT_STATE_OFFSET, _MT_STATE_WORDS, _CPU_STATE_BYTES = 24, 624, 5056


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, on the device the logits live on.

    Every one of the seed's 64 bits (two's complement for negative seeds) reaches the generator's
    state, so distinct seeds give distinct streams on every device:
    - CUDA's Philox generator takes the 64-bit value as its key directly.
    - The CPU generator is an MT19937 whose `manual_seed` keeps only the low 32 bits (1 and
      2**32 + 1 would collide). Here numpy's SeedSequence hashes the full 64-bit value into the
      624-word MT19937 state, which is installed with `set_state`.
    """
    device = torch.device(device)
    seed64 = seed & _UINT64_MASK
    gen = torch.Generator(device=device)
    gen.manual_seed(seed64)
    if device.type == "cpu":
        gen.set_state(_mt19937_state(gen.get_state(), seed64))
    return gen


def _mt19937_state(state: Tensor, seed64: int) -> Tensor:
    """`state` (of a generator just seeded with seed64) with its MT19937 words replaced by the
    SeedSequence expansion of seed64; checks the layout first rather than corrupt a generator."""
    raw = state.numpy().copy()
    header = np.frombuffer(raw[:_MT_STATE_OFFSET].tobytes(), dtype="<u8")
    words = raw[_MT_STATE_OFFSET : _MT_STATE_OFFSET + 8 * _MT_STATE_WORDS].view("<u8")
    if raw.size != _CPU_STATE_BYTES or header[0] != seed64 or words[0] != seed64 & 0xFFFFFFFF:
        raise RuntimeError(
            "unexpected layout of torch's CPU generator state (torch version change?): "
            "64-bit request seeds cannot be installed"
        )
    key = np.random.MT19937(np.random.SeedSequence(seed64)).state["state"]["key"]
    words[:] = key.astype(np.uint64)
    # left = 1, next = 0: the next draw regenerates the state from these words, as after seeding.
    raw[8:12] = np.array([1], dtype="<i4").view(np.uint8)
    raw[16:24] = np.zeros(8, dtype=np.uint8)
    return torch.from_numpy(raw)


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    # Pinned memory + non_blocking keeps the host->device copy asynchronous on CUDA.
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def check_token_ids(token_ids: Tensor, vocab_size: int, where: str) -> None:
    """Debug mode: raises if a placeholder or an id outside [0, vocab_size) is about to reach `where`
    (synchronizes the device)."""
    if token_ids.numel() and not bool(((token_ids >= 0) & (token_ids < vocab_size)).all()):
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab_size)][:8].tolist()
        raise AssertionError(f"token ids {bad} outside [0, {vocab_size}) reached {where}")


def host_array_to_device(values: np.ndarray, device: torch.device) -> Tensor:
    """A host array as a device tensor, asynchronously (pinned) on CUDA; the array is not kept."""
    return _to_device(torch.from_numpy(np.ascontiguousarray(values)), device)


def host_list_to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """A small list of host integers as a device tensor: pinned and asynchronous on CUDA, so the
    step's host work never waits for the GPU."""
    return _to_device(torch.tensor(values, dtype=dtype), device)


def _padded_ids(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[N, L] int64 of the rows' token ids; padding and out-of-range ids map to the spare column V."""
    width = max(1, max((len(r) for r in rows), default=0))
    # numpy row assignment converts Python lists ~4x faster than torch.as_tensor per row.
    ids = np.full((len(rows), width), vocab_size, dtype=np.int64)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = r
    # Placeholders (-1) or garbage ids must never count as a real token.
    ids[(ids < 0) | (ids > vocab_size)] = vocab_size
    return _to_device(torch.from_numpy(ids), device)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs, one row per request that samples this step."""

    temperature: Tensor
    """[N] float32; 0 for greedy rows."""
    top_k: Tensor | None
    """[N] int64, 0 = off; None when no row uses it."""
    top_p: Tensor | None
    """[N] float32, 1 = off; None when no row uses it."""
    min_p: Tensor | None
    """[N] float32, 0 = off; None when no row uses it."""
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator (seeded requests only)."""
    presence_penalty: Tensor | None
    """[N] float32; None when no row uses any penalty (then the other penalty fields are None too)."""
    frequency_penalty: Tensor | None
    """[N] float32."""
    repetition_penalty: Tensor | None
    """[N] float32, 1 = off."""
    prompt_token_ids: list[list[int]] | None
    """Per row, the prompt ids (repetition penalty); None means no prompt tokens are penalised."""
    output_token_ids: Sequence[Sequence[int]]
    """Per row, the tokens generated so far (penalties)."""
    blocked_token_ids: dict[int, list[int]]
    """Row -> token ids forbidden this step (EOS / stop ids while min_tokens is not reached)."""
    max_num_logprobs: int | None
    """Largest `logprobs` among the rows; None when no row asks for logprobs."""
    all_greedy: bool = False
    """Host-side hint: every row is greedy (skips the random path). False = unknown."""
    all_random: bool = False
    """Host-side hint: no row is greedy (skips the argmax). False = unknown."""
    output_token_counts: Tensor | None = None
    """[N, V] float32 occurrences of each token in each row's output, kept on the device by the
    caller; when set, penalties use it (and prompt_token_mask) instead of the id lists."""
    prompt_token_mask: Tensor | None = None
    """[N, V] bool: the token occurs in the row's prompt (with output_token_counts)."""

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: dict[int, torch.Generator] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Iterable[int] = (),
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Builds the metadata of one step. Seeded random rows need their persistent generator
        in `generators` (a fresh one per step would repeat the same draw every step)."""
        device = torch.device(device)
        n = len(params)
        generators = dict(generators or {})
        # No per-row copies: this runs every step and the sampler only reads the lists.
        outputs = list(output_token_ids) if output_token_ids is not None else [[] for _ in params]
        if len(outputs) != n or (prompt_token_ids is not None and len(prompt_token_ids) != n):
            raise ValueError("prompt_token_ids / output_token_ids need one row per SamplingParams")
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy and i not in generators:
                raise ValueError(f"row {i} has seed={p.seed} but no generator; create it once per request")

        def f32(values: list[float]) -> Tensor:
            return _to_device(torch.tensor(values, dtype=torch.float32), device)

        greedy = [p.is_greedy for p in params]
        random_rows = [p for p, g in zip(params, greedy, strict=True) if not g]
        # Truncation parameters only matter for random rows; greedy rows take the argmax, and carry neutral values:
        # speculative verification runs them through the same processing as their random neighbours.
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in random_rows):
            values = [0 if g else max(p.top_k, 0) for p, g in zip(params, greedy, strict=True)]
            top_k = _to_device(torch.tensor(values, dtype=torch.int64), device)
        if any(p.top_p < 1.0 for p in random_rows):
            top_p = f32([1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)])
        if any(p.min_p > 0.0 for p in random_rows):
            min_p = f32([0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)])

        presence = frequency = repetition = None
        prompts = None
        if any(p.uses_penalties for p in params):
            presence = f32([p.presence_penalty for p in params])
            frequency = f32([p.frequency_penalty for p in params])
            repetition = f32([p.repetition_penalty for p in params])
            if prompt_token_ids is not None:
                prompts = [list(x) for x in prompt_token_ids]

        eos = tuple(eos_token_ids)
        blocked: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if len(outputs[i]) < p.min_tokens:
                ids = p.all_stop_token_ids(eos)
                if ids:
                    blocked[i] = sorted(ids)

        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=f32([0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={i: g for i, g in generators.items() if i < n},
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            blocked_token_ids=blocked,
            max_num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=n > 0 and all(greedy),
            all_random=n > 0 and not any(greedy),
        )


@dataclass
class SamplerOutput:
    """What one sampling step produced."""

    sampled_token_ids: Tensor
    """[N] int64."""
    logprob_token_ids: Tensor | None = None
    """[N, 1 + max_num_logprobs] int64: the sampled token first, then the top-n ids."""
    logprobs: Tensor | None = None
    """[N, 1 + max_num_logprobs] float32 logprobs (of the raw logits) matching logprob_token_ids."""
    sampled_token_ranks: Tensor | None = None
    """[N] int64 rank of the sampled token in the raw distribution (1 = most likely)."""


# -- logits transforms (module functions so the rejection sampler can reuse them) ----------
def apply_blocked_tokens(logits: Tensor, blocked: dict[int, list[int]]) -> Tensor:
    """Sets the blocked (row, token) logits to -inf in place; logits must be contiguous [N, V]."""
    vocab_size = logits.shape[-1]
    flat = [r * vocab_size + t for r, ids in blocked.items() for t in ids if 0 <= t < vocab_size]
    if flat:
        # index_fill_ with a Python scalar: `logits[r, c] = x` would copy x to the device and sync.
        index = _to_device(torch.tensor(flat, dtype=torch.int64), logits.device)
        logits.view(-1).index_fill_(0, index, float("-inf"))
    return logits


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: Sequence[Sequence[int]] | None,
    output_token_ids: Sequence[Sequence[int]],
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
    repetition_penalty: Tensor,
    output_token_counts: Tensor | None = None,
    prompt_token_mask: Tensor | None = None,
) -> Tensor:
    """Repetition penalty over prompt + output tokens, then presence / frequency over output.

    Device-resident `output_token_counts` [N, V] / `prompt_token_mask` [N, V], when given, replace
    building them from the id lists (no host work per step)."""
    vocab_size = logits.shape[1]
    if output_token_counts is None:
        counts = output_counts_from_ids(output_token_ids, vocab_size, logits.device)
    else:
        counts = output_token_counts
    in_output = counts > 0
    seen = in_output
    if prompt_token_mask is not None:
        seen = seen | prompt_token_mask
    elif prompt_token_ids is not None:
        seen = seen | prompt_mask_from_ids(prompt_token_ids, vocab_size, logits.device)
    rep = repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency_penalty.unsqueeze(1) * counts
    return logits - presence_penalty.unsqueeze(1) * in_output.to(logits.dtype)


def output_counts_from_ids(output_token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[N, V] float32 counts of each row's output ids (what the device tables hold, built from the lists)."""
    out_ids = _padded_ids(output_token_ids, vocab_size, device)
    counts = torch.zeros(len(output_token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def prompt_mask_from_ids(prompt_token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[N, V] bool: the ids each row's prompt holds."""
    prompt_ids = _padded_ids(prompt_token_ids, vocab_size, device)
    in_prompt = torch.zeros(len(prompt_token_ids), vocab_size + 1, dtype=torch.bool, device=device)
    in_prompt.scatter_(1, prompt_ids, True)
    return in_prompt[:, :vocab_size]


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Masks to -inf all but the top-k tokens, then all but the smallest nucleus of mass >= p.

    One ascending sort serves both; top-p works on the distribution renormalised after top-k.
    Ties at the top-k threshold keep every tied token (as vLLM does).
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k.clamp(max=vocab_size))
        threshold = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total mass stays <= 1 - p; the remainder is the nucleus.
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Masks tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
    """Temperature, min-p, top-k, top-p for random rows (greedy rows are divided by 1 and carry neutral truncation
    values). Min-p before top-k/top-p, as vLLM: its threshold is relative to the most likely token, which
    truncation keeps, but the survivors' renormalised mass that top-p reads is not."""
    temperature = metadata.temperature
    temperature = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    logits = logits / temperature.unsqueeze(1)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)


def random_sample(
    probs: Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None = None,
) -> Tensor:
    """Exponential race: argmax(probs / q), q ~ Exp(1), samples exactly from probs.

    Each seeded row draws one [V] vector from its own generator, so its token depends only on
    its own generator state and its own probabilities.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_(generator=default_generator)
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # Exp(1) may round to 0; 0/0 would be NaN, which argmax would pick.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


def greedy_sample(logits: Tensor) -> Tensor:
    """[N, V] -> [N] int64 argmax (the first index among equal maxima), INVALID_TOKEN_ID for a row
    with a NaN or no score above -inf.

    Where the attention backend is Triton (CUDA, unless $ASYNCSPEC_ATTENTION_BACKEND says otherwise)
    and the kernel takes the logits (2-D float32 / bfloat16 / float16), `greedy_argmax` spreads each
    row over many programs (two launches, or one for V <= 8192); elsewhere `greedy_argmax_ref`, one
    torch max reduction (max propagates NaN, and NaN > -inf is false). Both give the same ids and
    read nothing back to the host, so either can be captured in a CUDA graph."""
    if select_backend(logits.device).name == "triton":
        from asyncspec.kernels import greedy_argmax_triton  # imported late, as the attention kernels

        if greedy_argmax_triton.greedy_argmax_supported(logits):
            return greedy_argmax_triton.greedy_argmax(logits, INVALID_TOKEN_ID)
    return greedy_argmax_ref(logits, INVALID_TOKEN_ID)


def greedy_sample_into_tokens(logits: Tensor, token_ids: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """`greedy_sample`, and each row's token written into the device token buffer token_ids at (rows[i], cols[i])
    as `InputBatch.write_sampled_tokens(rows, cols, sampled, padded=True)` writes it (never below 0; nothing where
    cols[i] == 0, a graph bucket's padding request). With the Triton backend the write happens inside the argmax's
    last launch (`greedy_argmax_into_tokens`), which saves a decode step's six small torch kernels of the write;
    elsewhere the reference. Returns the sampled ids, INVALID_TOKEN_ID included."""
    if select_backend(logits.device).name == "triton":
        from asyncspec.kernels import greedy_argmax_triton

        if greedy_argmax_triton.greedy_argmax_supported(logits):
            return greedy_argmax_triton.greedy_argmax_into_tokens(logits, INVALID_TOKEN_ID, token_ids, rows, cols)
    return greedy_argmax_into_tokens_ref(logits, INVALID_TOKEN_ID, token_ids, rows, cols)


def invalid_rows(scores: Tensor) -> Tensor:
    """[N] bool: rows with no token to sample: a NaN anywhere, or no finite positive score left
    (logits all -inf, or a probability row that is not a distribution)."""
    return torch.isnan(scores).any(dim=-1) | ~(scores.amax(dim=-1) > float("-inf"))


class Sampler(nn.Module):
    """Samples one token per row; see the module docstring for the order of operations.

    A row with no valid token gets INVALID_TOKEN_ID (never a token drawn from NaNs, which would
    be 0 for every such row); the caller fails that request alone.
    """

    def forward(
        self,
        logits: Tensor,
        metadata: SamplingMetadata,
        default_generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        if (
            metadata.all_greedy
            and not metadata.blocked_token_ids
            and metadata.presence_penalty is None
            and metadata.max_num_logprobs is None
        ):
            return SamplerOutput(sampled_token_ids=greedy_sample(logits))
        # Contiguous float32 copy: never modify the caller's tensor; bf16 is too coarse for cumsums.
        logits = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None

        if metadata.blocked_token_ids:
            logits = apply_blocked_tokens(logits, metadata.blocked_token_ids)
        if metadata.presence_penalty is not None:
            assert metadata.frequency_penalty is not None and metadata.repetition_penalty is not None
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalty,
                metadata.frequency_penalty,
                metadata.repetition_penalty,
                metadata.output_token_counts,
                metadata.prompt_token_mask,
            )

        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            assert greedy is not None
            sampled = greedy
            invalid = invalid_rows(logits)
        else:
            probs = process_logits(logits, metadata).softmax(dim=-1)
            sampled = random_sample(probs, metadata.generators, default_generator)
            # A NaN in the raw logits propagates to every probability of its row.
            invalid = invalid_rows(probs)
            if greedy is not None:
                is_greedy = metadata.temperature < SAMPLING_EPS
                sampled = torch.where(is_greedy, greedy, sampled)
                invalid = torch.where(is_greedy, invalid_rows(logits), invalid)
        sampled = sampled.masked_fill(invalid, INVALID_TOKEN_ID)

        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            self._gather_logprobs(out, raw_logprobs, metadata.max_num_logprobs)
        return out

    @staticmethod
    def _gather_logprobs(out: SamplerOutput, raw_logprobs: Tensor, num: int) -> None:
        sampled = out.sampled_token_ids.unsqueeze(1)
        # A row without a valid token holds INVALID_TOKEN_ID; its request fails and its logprobs are dropped, but
        # the gather must stay in range for every row (on a GPU an out-of-range index is a device-side assert).
        sampled_lp = raw_logprobs.gather(1, sampled.clamp_min(0))
        num = min(num, raw_logprobs.shape[-1])
        if num > 0:
            top_lp, top_ids = raw_logprobs.topk(num, dim=-1)
            out.logprob_token_ids = torch.cat([sampled, top_ids], dim=1)
            out.logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            out.logprob_token_ids = sampled
            out.logprobs = sampled_lp
        out.sampled_token_ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
