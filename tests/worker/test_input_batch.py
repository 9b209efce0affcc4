"""InputBatch: rows, block tables, device sampling parameters and penalty statistics."""

from __future__ import annotations

import torch

from asyncspec.core.scheduler_output import NewRequestData
from asyncspec.sampling_params import SamplingParams
from asyncspec.worker.input_batch import InputBatch

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
