"""SpeculativeDecoder's parked drafts: a preempted seeded request's drafts, kept and restored into its new row."""

from __future__ import annotations

import torch

from asyncspec.spec.ngram_proposer import NgramProposer
from asyncspec.spec.spec_decoder import SpeculativeDecoder

K, VOCAB = 3, 11


def _decoder() -> SpeculativeDecoder:
    return SpeculativeDecoder(K, NgramProposer(K, 1, 2), max_num_reqs=4, vocab_size=VOCAB, device=torch.device("cpu"))


def _propose_sampled(spec: SpeculativeDecoder, row: int, drafts: list[int], base: int, token_ids: torch.Tensor) -> None:
    """What a sampled draft-model proposal leaves in a row (tokens, count, q, the count they follow)."""
    spec.draft_token_ids[row] = torch.tensor(drafts)
    spec.num_draft_tokens[row] = len(drafts)
    spec.draft_probs = torch.zeros((4, K, VOCAB))
    spec.draft_probs[row] = torch.softmax(torch.arange(K * VOCAB, dtype=torch.float32).view(K, VOCAB) / (row + 1), -1)
    spec.draft_base[row] = base
    token_ids[row, base : base + K] = torch.tensor(drafts)


def test_parked_drafts_come_back_in_the_new_row_after_the_same_tokens():
    spec, token_ids = _decoder(), torch.zeros((4, 16), dtype=torch.int64)
    _propose_sampled(spec, 1, [5, 6, 7], base=9, token_ids=token_ids)
    q = spec.draft_probs[1].clone()
    spec.park_drafts("s", 1)
    _propose_sampled(spec, 1, [1, 1, 1], base=4, token_ids=token_ids)  # the row is reused by another request
    assert spec.has_parked_drafts("s")
    spec.restore_drafts("s", 3, 9, token_ids)
    assert spec.draft_token_ids[3].tolist() == [5, 6, 7] and int(spec.num_draft_tokens[3]) == 3
    assert torch.equal(spec.draft_probs[3], q)
    assert token_ids[3, 9:12].tolist() == [5, 6, 7]  # where the decode after the recompute reads them
    assert spec.draft_token_ids[1].tolist() == [1, 1, 1]  # the other request's row untouched
    assert not spec.has_parked_drafts("s")


def test_parked_drafts_after_other_tokens_count_for_nothing():
    """Drafts proposed after a token count the resumed request does not have (its in-flight step's tokens were
    not kept) are restored with a count of 0: the decode verifies none of them."""
    spec, token_ids = _decoder(), torch.zeros((4, 16), dtype=torch.int64)
    _propose_sampled(spec, 0, [5, 6, 7], base=9, token_ids=token_ids)
    spec.park_drafts("s", 0)
    spec.restore_drafts("s", 2, 8, token_ids)
    assert int(spec.num_draft_tokens[2]) == 0


def test_dropped_parked_drafts_are_gone():
    spec, token_ids = _decoder(), torch.zeros((4, 16), dtype=torch.int64)
    _propose_sampled(spec, 0, [5, 6, 7], base=9, token_ids=token_ids)
    spec.park_drafts("s", 0)
    spec.drop_parked_drafts("s")
    spec.drop_parked_drafts("never-parked")  # finished requests that parked nothing: a no-op
    assert not spec.has_parked_drafts("s") and not spec._parked


def test_restored_drafts_keep_their_base_through_a_second_preemption():
    """Preempted again after the restore but before its decode: the row's base must be the restored drafts' own,
    not the previous occupant's, or the second park records a base no resume matches (0 drafts verified)."""
    spec, token_ids = _decoder(), torch.zeros((4, 16), dtype=torch.int64)
    _propose_sampled(spec, 0, [5, 6, 7], base=9, token_ids=token_ids)
    spec.park_drafts("s", 0)
    _propose_sampled(spec, 2, [1, 1, 1], base=4, token_ids=token_ids)  # row 2's previous occupant
    spec.restore_drafts("s", 2, 9, token_ids)
    assert int(spec.draft_base[2]) == 9
    spec.park_drafts("s", 2)  # preempted again before its decode
    spec.restore_drafts("s", 1, 9, token_ids)
    assert spec.draft_token_ids[1].tolist() == [5, 6, 7] and int(spec.num_draft_tokens[1]) == 3
