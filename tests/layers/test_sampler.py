"""Sampler: greedy, seeded reproducibility, truncation sets, exact distributions, penalties,
blocked ids and logprobs, each against a direct per-row reference computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncspec.layers.sampler import (
    INVALID_TOKEN_ID,
    Sampler,
    SamplingMetadata,
    apply_penalties,
    make_generator,
    process_logits,
)
from asyncspec.sampling_params import SamplingParams

sampler = Sampler()
# Chi-square critical values at p = 1e-4 by degrees of freedom (standard tables).
CHI2_CRIT_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72}


def meta(params: list[SamplingParams], device: str = "cpu", **kwargs) -> SamplingMetadata:
    gens = kwargs.pop("generators", None)
    if gens is None:
        gens = {i: make_generator(p.seed, device) for i, p in enumerate(params) if p.seed is not None}
    return SamplingMetadata.from_params(params, generators=gens, device=device, **kwargs)


def test_greedy_is_argmax_even_with_truncation_params() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3, seed=i) for i in range(16)]
    md = meta(params)
    assert md.all_greedy and md.top_k is None and md.top_p is None and md.min_p is None
    out = sampler(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.sampled_token_ranks is None


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.9) for i in range(10)]
    md = meta(params)
    assert not md.all_greedy and not md.all_random
    out = sampler(logits, md, torch.Generator().manual_seed(3))
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(-1))


def test_caller_logits_untouched() -> None:
    logits = torch.randn(4, 30)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=5, repetition_penalty=1.3, min_tokens=3)] * 4
    sampler(logits, meta(params, output_token_ids=[[1, 2]] * 4, prompt_token_ids=[[3]] * 4, eos_token_ids=[0]))
    assert torch.equal(logits, before)
    # Non-contiguous input (a transposed view) works the same as its contiguous copy.
    md = meta([SamplingParams(temperature=0.0, min_tokens=1)] * 4, eos_token_ids=[0])
    strided = logits.t().contiguous().t()
    assert torch.equal(sampler(strided, md).sampled_token_ids, sampler(logits, md).sampled_token_ids)


# -- seeded reproducibility --------------------------------------------------------------------
VOCAB, STEPS = 64, 40


def _request_logits(key: int) -> torch.Tensor:
    """The logits a request would see at each step (fixed per request, whatever the batch)."""
    return torch.randn(STEPS, VOCAB, generator=torch.Generator().manual_seed(1000 + key)) * 2


def _run_batch(requests: list[tuple[int, SamplingParams]], default_seed: int) -> list[list[int]]:
    """Runs STEPS steps of a batch; returns each request's tokens. Generators persist per request."""
    gens = {row: make_generator(p.seed, "cpu") for row, (_, p) in enumerate(requests) if p.seed is not None}
    logits = [_request_logits(key) for key, _ in requests]
    default = torch.Generator().manual_seed(default_seed)
    tokens: list[list[int]] = [[] for _ in requests]
    for step in range(STEPS):
        md = SamplingMetadata.from_params(
            [p for _, p in requests],
            generators=gens,
            output_token_ids=tokens,
            prompt_token_ids=[[1, 2, 3]] * len(requests),
        )
        batch_logits = torch.stack([lg[step] for lg in logits])
        out = sampler(batch_logits, md, default).sampled_token_ids.tolist()
        for row, t in enumerate(out):
            tokens[row].append(t)
    return tokens


@pytest.mark.parametrize("extra", [{}, {"top_k": 10, "top_p": 0.9}, {"min_p": 0.05, "frequency_penalty": 0.5}])
def test_seeded_request_independent_of_batch(extra: dict) -> None:
    target = (0, SamplingParams(temperature=0.9, seed=1234, **extra))
    neighbours = [
        (1, SamplingParams(temperature=1.0, seed=99)),
        (2, SamplingParams(temperature=1.2)),
        (3, SamplingParams(temperature=0.0)),
        (4, SamplingParams(temperature=0.7, seed=1234 + 1, top_k=5)),
        (5, SamplingParams(temperature=1.0, presence_penalty=1.0, logprobs=3)),
    ]
    alone = _run_batch([target], default_seed=0)[0]
    first = _run_batch([target] + neighbours, default_seed=1)[0]
    last = _run_batch(neighbours + [target], default_seed=2)[5]
    assert alone == first == last
    assert len(set(alone)) > 5  # really sampling, not stuck on one token
    # A different seed gives a different stream; unseeded rows follow the default generator.
    other = _run_batch([(0, SamplingParams(temperature=0.9, seed=4321, **extra))], default_seed=0)[0]
    assert other != alone


def test_unseeded_rows_follow_default_generator() -> None:
    logits = torch.randn(8, 200)
    md = meta([SamplingParams(temperature=1.0)] * 8)
    a = sampler(logits, md, torch.Generator().manual_seed(5)).sampled_token_ids
    b = sampler(logits, md, torch.Generator().manual_seed(5)).sampled_token_ids
    c = sampler(logits, md, torch.Generator().manual_seed(6)).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_seeded_row_needs_generator() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingMetadata.from_params([SamplingParams(seed=3)])


# -- 64-bit seeds (regression: the CPU generator kept only the low 32 bits) -----------------------
SEED_PAIRS = [(1, 2**32 + 1), (0, -(2**63)), (7, 7 + 5 * 2**32), (-1, 2**32 - 1), (2**63 - 1, -1)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("a,b", SEED_PAIRS)
def test_seeds_differing_only_in_high_bits_give_distinct_streams(device: str, a: int, b: int) -> None:
    def stream(seed: int) -> list[float]:
        return torch.rand(8, generator=make_generator(seed, device), device=device).tolist()

    assert stream(a) == stream(a) and stream(b) == stream(b)
    assert stream(a) != stream(b)


def test_seeded_sampling_uses_all_64_bits_through_the_sampler() -> None:
    logits = torch.zeros(1, 1000)  # uniform: the stream is all randomness
    tokens = {}
    for seed in (3, 3 + 2**32, 3 - 2**63):
        gen = make_generator(seed, "cpu")
        md = SamplingMetadata.from_params([SamplingParams(temperature=1.0, seed=seed)], generators={0: gen})
        tokens[seed] = [sampler(logits, md).sampled_token_ids.item() for _ in range(6)]
    assert len({tuple(t) for t in tokens.values()}) == 3, tokens


def test_seeded_cpu_generator_draws_are_uniform() -> None:
    """The installed MT19937 state is a proper one: draws are uniform (chi-square over 10 bins)."""
    draws = torch.rand(20_000, generator=make_generator(2**40 + 17, "cpu"))
    counts = torch.histc(draws, bins=10, min=0.0, max=1.0)
    chi2 = (((counts - 2000.0) ** 2) / 2000.0).sum().item()
    assert chi2 < CHI2_CRIT_1E4[9]


# -- rows with no valid token (regression: NaN rows sampled token 0) ---------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_or_fully_masked_row_yields_invalid_token_not_token_zero(temperature: float) -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 5] = float("inf")  # inf - inf in the softmax
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(4)]
    out = sampler(logits, meta(params), torch.Generator().manual_seed(0)).sampled_token_ids
    assert out[0].item() != INVALID_TOKEN_ID and 0 <= out[0].item() < 50
    if temperature == 0.0:
        assert out[0].item() == logits[0].argmax().item()
        # Greedy over a +inf logit is still well defined: that token.
        assert out[3].item() == 5
        assert out[1:3].tolist() == [INVALID_TOKEN_ID] * 2
    else:
        assert out[1:].tolist() == [INVALID_TOKEN_ID] * 3


def test_tiny_repetition_penalty_cannot_make_a_nan_row() -> None:
    """At the smallest allowed repetition penalty, a seen token's logit stays finite."""
    from asyncspec.sampling_params import MIN_REPETITION_PENALTY

    logits = torch.full((1, 20), 30.0)
    logits[0, 3] = 80.0
    p = SamplingParams(temperature=1.0, repetition_penalty=MIN_REPETITION_PENALTY, seed=0)
    md = meta([p], output_token_ids=[[3]], prompt_token_ids=[[4]])
    out = sampler(logits, md).sampled_token_ids
    assert out.item() == 3  # 80 / 1e-4 dominates; no NaN, no token 0


# -- truncation sets against a numpy reference ---------------------------------------------------
def _reference_support(logits: np.ndarray, p: SamplingParams) -> tuple[set[int], bool]:
    """Tokens that may be sampled, computed directly in float64; also whether a top-p boundary
    is so close that float32 rounding could legitimately decide it."""
    x = logits.astype(np.float64) / p.temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones(len(x), dtype=bool)
    if p.min_p > 0.0:  # first, as vLLM: relative to the most likely token of the whole distribution
        probs = np.exp(x - x.max())
        keep[probs / probs.sum() < p.min_p * (probs / probs.sum()).max()] = False
    if p.top_k > 0:
        kept = order[keep[order]]
        keep[kept[p.top_k :]] = False
    near_boundary = False
    if p.top_p < 1.0:
        kept = order[keep[order]]
        probs = np.exp(x[kept] - x[kept].max())
        probs /= probs.sum()
        cum = np.cumsum(probs)
        n = int(np.searchsorted(cum, p.top_p - 1e-12)) + 1  # smallest prefix with mass >= p
        near_boundary = bool(np.any(np.abs(cum - p.top_p) < 1e-5))
        keep[kept[n:]] = False
    return set(np.flatnonzero(keep).tolist()), near_boundary


def test_top_k_top_p_min_p_support_matches_reference() -> None:
    rng = np.random.default_rng(0)
    n, vocab = 200, 40
    params = []
    for _ in range(n):
        params.append(
            SamplingParams(
                temperature=float(rng.choice([0.3, 0.7, 1.0, 2.0])),
                top_k=int(rng.choice([0, 0, 1, 3, 10, 39, 40, 100])),
                top_p=float(rng.choice([1.0, 0.1, 0.5, 0.8, 0.95])),
                min_p=float(rng.choice([0.0, 0.0, 0.01, 0.1, 0.5])),
            )
        )
    logits = torch.from_numpy(rng.normal(size=(n, vocab)) * 3).float()
    processed = process_logits(logits.clone(), meta(params))
    checked = 0
    for i, p in enumerate(params):
        ref, near = _reference_support(logits[i].double().numpy(), p)
        if near:
            continue
        got = set(torch.isfinite(processed[i]).nonzero().flatten().tolist())
        assert got == ref, f"row {i} {p}"
        # Renormalised distribution on the support equals the reference softmax.
        x = logits[i].double().numpy() / p.temperature
        idx = sorted(ref)
        ref_probs = np.exp(x[idx] - x[idx].max())
        ref_probs /= ref_probs.sum()
        got_probs = processed[i].softmax(-1).double().numpy()[idx]
        np.testing.assert_allclose(got_probs, ref_probs, rtol=1e-4, atol=1e-6)
        checked += 1
    assert checked > 0.9 * n


def test_samples_stay_in_support() -> None:
    torch.manual_seed(0)
    vocab = 30
    base = torch.randn(vocab)
    params = [
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=2.0, top_p=0.6),
        SamplingParams(temperature=1.5, min_p=0.2),
    ]
    for p in params:
        support, _ = _reference_support(base.double().numpy(), p)
        md = meta([p] * 5000)
        out = sampler(base.expand(5000, vocab), md, torch.Generator().manual_seed(1)).sampled_token_ids
        assert set(out.tolist()) == support  # every kept token is reachable, nothing else


# -- exact distribution (chi-square) -------------------------------------------------------------
def _target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> np.ndarray:
    x = logits.double().numpy() / temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, top_p)) + 1
    out = np.zeros_like(probs)
    out[order[:n]] = probs[order[:n]]
    return out / out.sum()


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was sampled"
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, "test design: every support cell needs >= 5 expected samples"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize("seeded", [False, True])
def test_distribution_matches_target_chi_square(seeded: bool) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.5, -1.0, -3.0])
    temperature, top_p, n = 0.7, 0.9, 20_000
    probs = _target_probs(logits, temperature, top_p)
    assert 4 <= (probs > 0).sum() < 8  # top-p really truncates here
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i if seeded else None) for i in range(n)]
    md = meta(params)
    out = sampler(logits.expand(n, 8), md, torch.Generator().manual_seed(7)).sampled_token_ids
    counts = np.bincount(out.numpy(), minlength=8)
    stat, dof = _chi_square(counts, probs)
    assert stat < CHI2_CRIT_1E4[dof], (stat, dof, counts, probs)


def test_seeded_stream_distribution_chi_square() -> None:
    """One seeded request over many steps (its own generator advancing) samples the target."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, -1.5]])
    md = meta([SamplingParams(temperature=1.3, seed=77)])
    steps = 3000
    draws = [sampler(logits, md).sampled_token_ids.item() for _ in range(steps)]
    counts = np.bincount(draws, minlength=6)
    stat, dof = _chi_square(counts, _target_probs(logits[0], 1.3, 1.0))
    assert stat < CHI2_CRIT_1E4[dof]


# -- penalties -------------------------------------------------------------------------------
def test_penalties_match_hand_computation() -> None:
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(3, vocab) * 2
    prompts = [[1, 2, 2, 5], [], [0, 11]]
    outputs = [[2, 3, 3, 3, 7], [4, 4], []]
    pres, freq, rep = [0.5, -1.0, 2.0], [0.25, 0.1, 0.0], [1.5, 1.0, 0.8]
    got = apply_penalties(logits.clone(), prompts, outputs, torch.tensor(pres), torch.tensor(freq), torch.tensor(rep))
    want = logits.clone()
    for r in range(3):
        for t in range(vocab):
            x = float(logits[r, t])
            if t in prompts[r] or t in outputs[r]:
                x = x / rep[r] if x > 0 else x * rep[r]
            count = outputs[r].count(t)
            x -= freq[r] * count + pres[r] * (count > 0)
            want[r, t] = x
    torch.testing.assert_close(got, want)


def test_penalties_change_greedy_choice_and_ignore_placeholders() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    md = meta(params, output_token_ids=[[1, -1]], prompt_token_ids=[[3]])
    assert md.presence_penalty is not None
    assert sampler(logits, md).sampled_token_ids.tolist() == [2]  # 5 - 2 < 4
    md = meta(params, output_token_ids=[[-1, 9]], prompt_token_ids=[[3]])  # -1 / out of range: ignored
    assert sampler(logits, md).sampled_token_ids.tolist() == [1]
    md = meta([SamplingParams(temperature=0.0, repetition_penalty=2.0)], output_token_ids=[[]], prompt_token_ids=[[1]])
    assert sampler(logits, md).sampled_token_ids.tolist() == [2]  # 5 / 2 < 4


def test_no_penalty_fields_when_unused() -> None:
    md = meta([SamplingParams(), SamplingParams(temperature=0.0)])
    assert md.presence_penalty is md.frequency_penalty is md.repetition_penalty is None
    assert md.prompt_token_ids is None and md.max_num_logprobs is None and md.blocked_token_ids == {}


# -- blocked ids (min_tokens) ---------------------------------------------------------------------
def test_blocked_ids_never_sampled_until_min_tokens() -> None:
    vocab, eos, stop_id = 16, 0, 5
    logits = torch.zeros(1000, vocab)
    logits[:, eos] = 10.0
    logits[:, stop_id] = 9.0
    params = [SamplingParams(temperature=t, min_tokens=3, stop_token_ids=[stop_id]) for t in (0.0, 1.0)] * 500
    md = meta(params, output_token_ids=[[7, 7]] * 1000, eos_token_ids=[eos])
    assert md.blocked_token_ids[0] == [eos, stop_id]
    out = sampler(logits, md, torch.Generator().manual_seed(0)).sampled_token_ids
    assert not torch.isin(out, torch.tensor([eos, stop_id])).any()
    md = meta(params, output_token_ids=[[7, 7, 7]] * 1000, eos_token_ids=[eos])
    assert md.blocked_token_ids == {}
    assert (sampler(logits, md).sampled_token_ids[0::2] == eos).all()
    # ignore_eos: EOS is never a stop id, so it is not blocked either; stop ids still are.
    md = meta(
        [SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[stop_id])], eos_token_ids=[eos]
    )
    assert md.blocked_token_ids == {0: [stop_id]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_row_without_valid_token_beside_a_logprobs_row_keeps_the_batch(temperature: float) -> None:
    """Regression: the logprob gather indexed the invalid row's -1 and raised for the whole batch."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1, 7] = float("nan")
    params = [SamplingParams(temperature=temperature, logprobs=2, seed=i) for i in range(3)]
    out = sampler(logits, meta(params), torch.Generator().manual_seed(0))
    assert out.sampled_token_ids[1].item() == INVALID_TOKEN_ID
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_token_ranks is not None
    assert out.logprob_token_ids[1, 0].item() == INVALID_TOKEN_ID
    raw = torch.log_softmax(logits, dim=-1)
    for r in (0, 2):
        token = int(out.sampled_token_ids[r])
        assert 0 <= token < 50
        assert out.logprobs[r, 0].item() == pytest.approx(raw[r, token].item())
        assert out.sampled_token_ranks[r].item() == int((raw[r] > raw[r, token]).sum()) + 1


# -- logprobs ------------------------------------------------------------------------------
def test_logprobs_from_raw_logits() -> None:
    torch.manual_seed(3)
    vocab = 50
    logits = torch.randn(6, vocab) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.5, logprobs=0, top_k=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, logprobs=2, presence_penalty=2.0, min_tokens=2),
        SamplingParams(temperature=1.0, logprobs=1, seed=4),
        SamplingParams(temperature=0.0, logprobs=3, frequency_penalty=-2.0),
    ]
    md = meta(params, output_token_ids=[[1, 2]] * 6, prompt_token_ids=[[3, 4]] * 6, eos_token_ids=[0])
    assert md.max_num_logprobs == 5
    out = sampler(logits, md, torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == out.logprobs.shape == (6, 6)
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top_lp, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_lp)
    for r in range(6):
        rank = int((raw[r] > raw[r, sampled[r]]).sum()) + 1
        assert out.sampled_token_ranks[r].item() == rank
        sorted_ids = raw[r].argsort(descending=True).tolist()
        assert sorted_ids.index(int(sampled[r])) + 1 == rank


def test_logprobs_zero_gives_only_sampled_token() -> None:
    logits = torch.randn(3, 10)
    out = sampler(logits, meta([SamplingParams(temperature=0.0, logprobs=0)] * 3))
    assert out.logprobs.shape == (3, 1)
    assert torch.equal(out.sampled_token_ranks, torch.ones(3, dtype=torch.int64))
    small = sampler(torch.randn(2, 4), meta([SamplingParams(logprobs=20)] * 2))
    assert small.logprobs.shape == (2, 5)  # capped at the vocabulary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_and_no_sync() -> None:
    dev = "cuda"
    logits = torch.randn(8, 1000, device=dev, dtype=torch.bfloat16)
    params = (
        [
            SamplingParams(
                temperature=0.8,
                seed=11,
                top_p=0.9,
                top_k=50,
                min_p=0.01,
                logprobs=2,
                repetition_penalty=1.2,
                min_tokens=2,
            )
        ]
        + [SamplingParams(temperature=t) for t in (0.0, 1.0) * 3]
        + [SamplingParams()]
    )
    md_a = meta(params, device=dev, output_token_ids=[[1]] * 8, prompt_token_ids=[[2]] * 8, eos_token_ids=[0])
    md_b = meta(params[:1], device=dev, output_token_ids=[[1]], prompt_token_ids=[[2]], eos_token_ids=[0])
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = sampler(logits, md_a, torch.Generator(device=dev).manual_seed(0))
        b = sampler(logits[:1], md_b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert a.sampled_token_ids[0].item() == b.sampled_token_ids[0].item()
    assert a.sampled_token_ids[1].item() == logits[1].float().argmax().item()
    assert math.isfinite(a.logprobs.float().sum().item())
