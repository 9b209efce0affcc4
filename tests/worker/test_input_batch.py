"""InputBatch: rows, block tables, device sampling parameters and penalty statistics."""

from __future__ import annotations

import random

import pytest
import torch

from asyncspec.core.scheduler_output import NewRequestData
from asyncspec.sampling_params import SamplingParams
from asyncspec.worker.input_batch import SAMPLING_FEATURES, InputBatch, sampling_features

VOCAB = 32


def _new(request_id: str, tokens: list[int], num_prompt: int, params: SamplingParams) -> NewRequestData:
    return NewRequestData(request_id, tokens, num_prompt, params, block_ids=[3, 1], num_computed_tokens=0)


def test_resumed_penalised_request_gets_its_statistics_rebuilt():
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=4, vocab_size=VOCAB, device=torch.device("cpu"))
    plain = batch.add_request(_new("a", [1, 2, 3], 3, SamplingParams()))
    assert batch.output_token_counts is None  # allocated only once a penalised request arrives
    params = SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5, top_k=5)
    # A request resumed after preemption: prompt [4, 5, 4], outputs so far [7, 7, 9].
    state = batch.add_request(_new("b", [4, 5, 4, 7, 7, 9], 3, params))
    counts, mask = batch.output_token_counts[state.row], batch.prompt_token_mask[state.row]
    assert counts[7] == 2 and counts[9] == 1 and counts.sum() == 3
    assert mask.nonzero().flatten().tolist() == [4, 5]
    assert batch.token_ids[state.row, :6].tolist() == [4, 5, 4, 7, 7, 9]
    assert batch.block_table[state.row, :2].tolist() == [3, 1]
    rows = torch.tensor([state.row, plain.row])
    assert torch.allclose(batch.sampling_tensors["temperature"][rows], torch.tensor([0.7, 1.0]))
    assert batch.sampling_tensors["top_k"][rows].tolist() == [5, 0]

    batch.record_sampled(torch.tensor([state.row, state.row]), torch.tensor([9, 11]))
    assert counts[9] == 2 and counts[11] == 1

    # A new penalised request reusing the row starts from clean statistics.
    batch.remove_request("b")
    again = batch.add_request(_new("c", [6], 1, params))
    assert again.row == state.row
    assert batch.output_token_counts[again.row].sum() == 0
    assert batch.prompt_token_mask[again.row].nonzero().flatten().tolist() == [6]


def test_sampled_tokens_are_counted_only_while_a_penalised_row_is_in_the_batch():
    """Repeated (row, token) pairs add up, a negative id (a rejected draft position) counts nothing; once the
    last penalised request left, later steps leave the table alone, and a penalised request taking a row again
    starts from its own tokens."""
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=4, vocab_size=VOCAB, device=torch.device("cpu"))
    plain = batch.add_request(_new("a", [1, 2, 3], 3, SamplingParams()))
    batch.record_sampled(torch.tensor([plain.row]), torch.tensor([5]))  # no table yet: nothing to count in
    assert batch.output_token_counts is None and not batch.records_sampled
    penalised = batch.add_request(_new("b", [4, 5], 2, SamplingParams(presence_penalty=0.5)))
    assert batch.records_sampled
    rows = torch.tensor([penalised.row, penalised.row, penalised.row, plain.row])
    batch.record_sampled(rows, torch.tensor([7, 7, -1, 9]))
    expected = torch.zeros(4, VOCAB)
    expected[penalised.row, 7] = 2
    expected[plain.row, 9] = 1
    assert torch.equal(batch.output_token_counts, expected)

    batch.remove_request("b")
    assert not batch.records_sampled
    before = batch.output_token_counts.clone()
    batch.record_sampled(torch.tensor([plain.row]), torch.tensor([3]))
    assert torch.equal(batch.output_token_counts, before)

    again = batch.add_request(_new("c", [6, 8, 8], 1, SamplingParams(frequency_penalty=0.5)))
    assert batch.records_sampled
    counts = batch.output_token_counts[again.row]
    assert counts[8] == 2 and counts.sum() == 2


def _recount(batch: InputBatch) -> dict[str, int]:
    counts = dict.fromkeys(SAMPLING_FEATURES, 0)
    for state in batch.rows.values():
        for name in sampling_features(state.sampling_params, state.generator is not None):
            counts[name] += 1
    return counts


def test_feature_counts_follow_admissions_removals_and_failures():
    """The batch-wide feature counts a decode step trusts instead of scanning equal a recount after
    every admission, finish, preemption (seeded generators parked and resumed) and failed admission."""
    rng = random.Random(0)
    batch = InputBatch(max_num_reqs=6, max_model_len=64, block_size=4, vocab_size=VOCAB, device=torch.device("cpu"))
    choices = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=3),
        SamplingParams(temperature=0.8, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2, min_tokens=4),
        SamplingParams(temperature=1.0, presence_penalty=0.5),
    ]
    live: list[str] = []
    for step in range(300):
        if live and (len(live) == 6 or rng.random() < 0.45):
            victim = live.pop(rng.randrange(len(live)))
            batch.remove_request(victim, preempted=rng.random() < 0.5)
        else:
            request_id = f"r{rng.randrange(12)}"
            if request_id in live:
                continue
            params = rng.choice(choices)
            if rng.random() < 0.1:
                bad = _new(request_id, [1, 2, 3], 3, params)
                bad.block_ids = list(range(20))  # more blocks than a row of the table holds
                with pytest.raises(ValueError):
                    batch.add_request(bad)
                assert request_id not in batch.rows
                assert batch.feature_counts == _recount(batch)
                continue
            batch.add_request(_new(request_id, [1, 2, 3], 3, params))
            live.append(request_id)
        assert batch.feature_counts == _recount(batch), f"step {step}"
    assert all(v >= 0 for v in batch.feature_counts.values())


def test_rows_admitted_together_are_written_at_once_and_a_failed_one_leaves_nothing():
    """Admissions with write_device=False reach the device at write_admitted, each row with its own tokens and
    sampling values, exactly as one-by-one admissions write them; a request whose value its table cannot hold
    fails alone, before anything of it is queued."""
    cpu = torch.device("cpu")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.3, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2),
    ]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    one_by_one = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4, vocab_size=VOCAB, device=cpu)
    together = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4, vocab_size=VOCAB, device=cpu)
    together.token_ids.fill_(-3)  # stale values a row must overwrite
    for t in together.sampling_tensors.values():
        t.fill_(-3)
    for i, (p, tokens) in enumerate(zip(params, prompts, strict=True)):
        one_by_one.add_request(_new(f"r{i}", tokens, len(tokens), p))
        together.add_request(_new(f"r{i}", tokens, len(tokens), p), write_device=False)
        if i == 1:
            bad = SamplingParams(temperature=0.5)
            bad.top_k = 2**63  # past validation: the device table cannot hold it
            with pytest.raises(OverflowError):
                together.add_request(_new("bad", [7, 7], 2, bad), write_device=False)
            assert "bad" not in together.rows
    assert (together.token_ids == -3).all()  # nothing written yet
    together.write_admitted()
    rows = torch.tensor([together.rows[f"r{i}"].row for i in range(3)])
    assert rows.tolist() == [one_by_one.rows[f"r{i}"].row for i in range(3)]
    for i, tokens in enumerate(prompts):
        assert together.token_ids[rows[i], : len(tokens)].tolist() == tokens
        assert (together.token_ids[rows[i], len(tokens) :] == -3).all()  # the rest of the row untouched
    for name, table in together.sampling_tensors.items():
        assert torch.equal(table[rows], one_by_one.sampling_tensors[name][rows]), name
    assert together.sampling_tensors["top_k"][rows].tolist() == [0, 5, 0]
    together.write_admitted()  # nothing pending: a no-op
    assert (together.token_ids[3] == -3).all()


def test_a_greedy_row_carries_neutral_truncation_values_and_no_generator():
    """Verification processes greedy rows beside random ones: a greedy row's own top-k/top-p/min-p must not apply
    (its token is the argmax), and its seed draws nothing, so it makes no seeded stream."""
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4, vocab_size=VOCAB, device=torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.4, seed=7)
    random_ = SamplingParams(temperature=0.9, top_k=3, top_p=0.2, min_p=0.4, seed=7)
    states = [batch.add_request(_new(f"r{i}", [1, 2], 2, p)) for i, p in enumerate([greedy, random_])]
    values = {name: table[[s.row for s in states]].tolist() for name, table in batch.sampling_tensors.items()}
    assert values["temperature"][0] == 0.0 and values["temperature"][1] == pytest.approx(0.9)
    assert [values["top_k"][0], values["top_p"][0], values["min_p"][0]] == [0, 1.0, 0.0]
    assert [values["top_k"][1], values["top_p"][1], values["min_p"][1]] == pytest.approx([3, 0.2, 0.4])
    assert states[0].generator is None and states[1].generator is not None
    assert batch.feature_counts["seeded"] == 1
