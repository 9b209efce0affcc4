"""The target's distribution at draft positions: greedy rows take exactly the plain sampler's argmax."""

from __future__ import annotations

import pytest
import torch

from asyncspec.kernels.rejection_sample import rejection_sample_ref
from asyncspec.layers.sampler import Sampler, SamplingMetadata, greedy_sample
from asyncspec.sampling_params import SamplingParams
from asyncspec.spec.verification import greedy_target_probs, verification_probs

VOCAB = 8


def _verify(logits: torch.Tensor, params: list[SamplingParams], drafts: list[list[int]]) -> torch.Tensor:
    """Tokens emitted by verifying `drafts` ([S, K]) against logits [S, K + 1, V] (greedy rows only read)."""
    metadata = SamplingMetadata.from_params(params, eos_token_ids=[], device=torch.device("cpu"))
    draft_ids = torch.tensor(drafts)
    num_valid = torch.full((len(params),), draft_ids.shape[1])
    probs = verification_probs(logits, metadata, draft_ids, num_valid, {})
    is_greedy = torch.tensor([p.is_greedy for p in params])
    n, k = draft_ids.shape
    out, _ = rejection_sample_ref(probs, draft_ids, None, num_valid, is_greedy, torch.rand(n, k), torch.ones(n, VOCAB))
    return out


def _plain_greedy(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    metadata = SamplingMetadata.from_params(params, eos_token_ids=[], device=torch.device("cpu"))
    return Sampler()(logits, metadata).sampled_token_ids


def test_a_greedy_row_ignores_its_own_top_p_beside_a_random_row_that_uses_top_p() -> None:
    """Two exactly tied top logits: the plain sampler takes the first; a top-p left on the greedy row would keep
    only one of them (the sort's last) and verification would emit the other."""
    greedy = SamplingParams(temperature=0.0, top_p=0.3, top_k=1, min_p=0.5)
    random = SamplingParams(temperature=1.0, top_p=0.5)
    row = torch.tensor([5.0, 5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0])
    logits = torch.stack([row, torch.zeros(VOCAB)]).unsqueeze(1).repeat(1, 2, 1)  # [2, K + 1 = 2, V]
    plain = _plain_greedy(logits[:, 0], [greedy, random])[0].item()
    assert plain == 0
    out = _verify(logits, [greedy, random], [[plain], [3]])
    assert out[0].tolist() == [plain, plain]  # the draft accepted, then the bonus token: the same argmax


def test_greedy_verification_takes_the_argmax_of_the_logits_not_of_rounded_probabilities() -> None:
    """Two logits one float32 ulp apart give the same softmax probability: the larger one still wins."""
    row = torch.full((VOCAB,), -30.0)
    row[0] = 0.1
    row[1] = torch.nextafter(row[0], torch.tensor(1.0))
    assert row.softmax(-1)[0] == row.softmax(-1)[1]  # the case: tied probabilities
    logits = row.view(1, 1, VOCAB).repeat(1, 2, 1)
    params = [SamplingParams(temperature=0.0)]
    assert _plain_greedy(logits[:, 0], params).item() == 1
    assert _verify(logits, params, [[0]])[0].tolist() == [1, -1]  # draft 0 rejected; the argmax emitted
    assert _verify(logits, params, [[1]])[0].tolist() == [1, 1]


def test_greedy_target_probs_is_the_one_hot_of_greedy_sample() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB).to(torch.bfloat16)
    logits[1, 3] = logits[1, 5] = logits[1].max() + 1  # a tie: the first index
    logits[2] = float("nan")
    logits[3] = float("-inf")
    probs = greedy_target_probs(logits)
    tokens = greedy_sample(logits)
    assert tokens[1] == 3 and tokens[2] == tokens[3] == -1
    for i, token in enumerate(tokens.tolist()):
        if token < 0:
            assert probs[i].isnan().all()
        else:
            assert probs[i].tolist() == [float(j == token) for j in range(VOCAB)]


def test_penalties_from_id_lists_apply_at_every_position() -> None:
    """Metadata built from id lists (no device tables): position j penalises the prompt, the outputs and the j drafts
    before it, as the plain sampler does after those tokens."""
    torch.manual_seed(1)
    params = [SamplingParams(temperature=0.0, repetition_penalty=5.0, frequency_penalty=0.7, presence_penalty=0.4)]
    prompt, output, drafts = [[1, 2]], [[3, 3]], [[4, 5]]
    logits = torch.randn(1, 3, VOCAB) + 4.0  # positive: the repetition penalty divides
    for seen in (1, 2, 3, 4, 5):
        logits[0, :, seen] += 2.0  # the penalised tokens would win without their penalties
    metadata = SamplingMetadata.from_params(params, prompt_token_ids=prompt, output_token_ids=output)
    probs = verification_probs(logits, metadata, torch.tensor(drafts), torch.tensor([2]), {})
    for j in range(3):
        plain = SamplingMetadata.from_params(
            params, prompt_token_ids=prompt, output_token_ids=[output[0] + drafts[0][:j]]
        )
        expected = Sampler()(logits[:, j], plain).sampled_token_ids.item()
        assert probs[0, j].argmax().item() == expected and probs[0, j, expected] == 1.0, j


def test_a_mixed_batch_gets_one_hot_greedy_rows_and_untouched_random_rows() -> None:
    torch.manual_seed(2)
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 0.0, 1.3, 0.0)]
    logits = torch.randn(5, 3, VOCAB)
    logits[4, 1] = float("nan")  # a greedy row with no valid token at one position
    metadata = SamplingMetadata.from_params(params)
    probs = verification_probs(logits, metadata, torch.zeros(5, 2, dtype=torch.int64), torch.zeros(5), {})
    for s, p in enumerate(params):
        for j in range(3):
            if p.is_greedy:
                expected = greedy_target_probs(logits[s, j : j + 1])[0]
            else:
                expected = (logits[s, j] / p.temperature).softmax(-1)
            torch.testing.assert_close(probs[s, j], expected, equal_nan=True)


def test_greedy_rows_of_the_metadata_carry_neutral_truncation_values() -> None:
    greedy = SamplingParams(temperature=0.0, top_k=2, top_p=0.1, min_p=0.9)
    random = SamplingParams(temperature=0.5, top_k=2, top_p=0.1, min_p=0.9)
    metadata = SamplingMetadata.from_params([greedy, random])
    assert metadata.top_k.tolist() == [0, 2]
    assert metadata.top_p.tolist() == [1.0, pytest.approx(0.1)]
    assert metadata.min_p.tolist() == [0.0, pytest.approx(0.9)]
