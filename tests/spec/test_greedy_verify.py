"""GreedyVerification over part of a step's requests: decodes verifying drafts beside a prompt chunk that samples
nothing. Its results must be those of a step made of the decodes alone, and the chunk's prompt tokens must stay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncspec.spec.greedy_verify import GreedyVerification
from asyncspec.spec.step_glue import REFERENCE_GLUE, select_step_glue

VOCAB, HIDDEN, WIDTH = 7, 12, 32


def _decoder(device: str, seed: int) -> tuple[SimpleNamespace, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Drafts per token-buffer row (rows 0-2, then a spare); the lm head maps hidden states to a small vocabulary.
    spec = SimpleNamespace(
        glue=REFERENCE_GLUE if device == "cpu" else select_step_glue(device),
        draft_token_ids=torch.randint(0, VOCAB, (4, 4), generator=gen).to(device),
        num_draft_tokens=torch.tensor([4, 2, 3, 0], device=device),
    )
    return spec, torch.randn(HIDDEN, VOCAB, generator=gen).to(device)


def _verification(spec, head: torch.Tensor, meta: torch.Tensor, token_ids: torch.Tensor, computed: torch.Tensor):
    return GreedyVerification(lambda h: h.float() @ head, meta, token_ids, computed, spec)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sampling_only_equals_a_step_of_the_sampling_requests_alone(seed, device):
    spec, head = _decoder(device, seed)
    gen = torch.Generator().manual_seed(100 + seed)
    # Batch order: a decode (row 2: last known token + 2 drafts), a prompt chunk (row 0: 4 tokens, samples
    # nothing), a decode (row 1: last known token + 1 draft). Computed before the step: 10, 5, 20.
    scheduled, computed_before, rows = [3, 4, 2], [10, 5, 20], [2, 0, 1]
    ends = torch.tensor(scheduled).cumsum(0)
    step = SimpleNamespace(
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32).to(device),
        seq_lens=(torch.tensor(computed_before) + torch.tensor(scheduled)).to(torch.int32).to(device),
    )
    meta = torch.zeros((8, 4), dtype=torch.int64)
    meta[0, :3] = torch.tensor(rows)
    meta[3, :2] = torch.tensor([0, 2])  # the sampling requests' batch indices
    meta[5, :2] = torch.tensor([2, 1])  # their planned drafts
    meta[7, :2] = torch.tensor([2, 1])  # their rows
    meta = meta.to(device)
    hidden = torch.randn(int(ends[-1]), HIDDEN, generator=gen).to(device)
    token_ids = torch.randint(0, VOCAB, (4, WIDTH), generator=gen).to(device)
    num_computed = torch.tensor([9, 22, 13, 0], device=device)  # after the step's advance, by row

    tokens, counts = token_ids.clone(), num_computed.clone()
    got = _verification(spec, head, meta, tokens, counts).sampling_only(hidden, step, 2, 3)  # type: ignore[arg-type]

    # The same two decodes as a step of their own.
    alone = SimpleNamespace(
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([13, 22], dtype=torch.int32, device=device),
    )
    alone_meta = torch.zeros((8, 4), dtype=torch.int64, device=device)
    alone_meta[0, :2] = torch.tensor([2, 1])
    alone_meta[5, :2] = torch.tensor([2, 1])
    alone_hidden = torch.cat([hidden[0:3], hidden[7:9]])
    ref_tokens, ref_counts = token_ids.clone(), num_computed.clone()
    want = _verification(spec, head, alone_meta, ref_tokens, ref_counts)(alone_hidden, alone, 2, 3)  # type: ignore[arg-type]

    for name in ("output_token_ids", "num_accepted", "num_valid_drafts", "new_num_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(counts, ref_counts)
    # The chunk's row keeps its prompt tokens; the decodes' rows got their emitted runs.
    assert torch.equal(tokens[0], token_ids[0])
    for n, (row, base) in enumerate([(2, 11), (1, 21)]):  # base: seq_len - planned drafts
        run = got.output_token_ids[n, : int(got.num_accepted[n]) + 1]
        assert torch.equal(tokens[row, base : base + run.numel()], run)
    assert got.num_valid_drafts.tolist() == [2, 1]
