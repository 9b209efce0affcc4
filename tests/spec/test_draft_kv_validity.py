"""The draft's KV in prefix-cached blocks: which blocks hold it (DraftKVValidity), and an engine whose draft was
left alone at k = 0 recomputing it for a later request that hits those blocks."""

from __future__ import annotations

import numpy as np
import pytest

from asyncspec import SamplingParams
from asyncspec.spec.draft_kv_validity import DraftKVValidity
from tests.conftest import load_prompts
from tests.engine.engine_helpers import assert_kv_free
from tests.spec.spec_helpers import assert_same_outputs, make_llm, script_k, stats_delta

BS = 4


def _table() -> np.ndarray:
    # Row 0 holds blocks 10..15, row 1 blocks 20..25.
    return np.array([list(range(10, 16)), list(range(20, 26))], dtype=np.int32)


def test_allocated_blocks_follow_the_drafts_sync():
    v = DraftKVValidity(32, BS)
    v.allocated([10, 11], in_sync=True)
    v.allocated([12], in_sync=False)
    assert v.valid[[10, 11, 12]].tolist() == [True, True, False]
    v.valid[20] = True
    v.allocated([20], in_sync=False)  # a reused block's old flag means nothing
    assert not v.valid[20]


def test_skipped_positions_clear_their_blocks():
    v = DraftKVValidity(32, BS)
    v.valid[:] = True
    table = _table()
    # Row 0 skips positions 3..5 (blocks 0 and 1), row 1 skips position 9 (block 2).
    v.skipped(table, np.array([0, 1]), np.array([3, 9]), np.array([6, 10]))
    assert np.flatnonzero(~v.valid).tolist() == [10, 11, 22]
    # One position a row (a decode step): one block each.
    v.valid[:] = True
    v.skipped(table, np.array([0, 1]), np.array([7, 16]), np.array([8, 17]))
    assert np.flatnonzero(~v.valid).tolist() == [11, 24]


def test_skips_of_one_or_two_blocks_a_row_equal_marking_row_by_row():
    """The vectorized path (each row's span at most two blocks) against a per-row reference."""
    rng = np.random.default_rng(0)
    table = rng.permutation(64 * 8).reshape(64, 8).astype(np.int32)
    for _ in range(50):
        rows = rng.choice(64, size=20, replace=False)
        start = rng.integers(0, 20, size=20)
        end = start + rng.integers(0, 6, size=20)
        v = DraftKVValidity(64 * 8, BS)
        v.valid[:] = True
        v.skipped(table, rows, start, end)
        expected = np.ones(64 * 8, dtype=bool)
        for row, a, b in zip(rows, start, end, strict=True):
            if b > a:
                expected[table[row, a // BS : (b - 1) // BS + 1]] = False
        assert (v.valid == expected).all()


def test_computed_positions_mark_the_blocks_they_complete():
    v = DraftKVValidity(32, BS)
    table = _table()
    # Row 0: a pass over positions 2..9 that leaves lag: blocks 0 and 1 complete, block 2 not.
    v.computed(table, np.array([0]), np.array([2]), np.array([10]))
    assert np.flatnonzero(v.valid).tolist() == [10, 11]


def test_a_draft_back_in_sync_holds_all_of_its_rows_blocks():
    """Blocks cleared by skips (or given while the draft lagged) hold the draft's KV once it no longer lags."""
    v = DraftKVValidity(32, BS)
    table = _table()
    v.synced(table, np.array([0, 1]), np.array([3, 1]))
    assert np.flatnonzero(v.valid).tolist() == [10, 11, 12, 20]


def test_valid_prefix_stops_at_the_first_block_without_the_drafts_kv():
    v = DraftKVValidity(32, BS)
    v.valid[[10, 11, 13]] = True
    blocks = list(range(10, 16))
    assert v.valid_prefix(blocks, 16) == 8  # block 12 lacks it
    assert v.valid_prefix(blocks, 8) == 8
    assert v.valid_prefix(blocks, 4) == 4
    assert v.valid_prefix(blocks, 0) == 0
    v.valid[12] = True
    assert v.valid_prefix(blocks, 16) == 16


# max_lag = 128 // 2 = 64: a request's decode steps at k = 0 may all skip the draft.
CONFIG = dict(block_size=16, max_model_len=256, num_kv_blocks=96, max_num_batched_tokens=128, max_num_seqs=2)


def _run(llm, prompt: list[int], params: SamplingParams, pattern: list[int]):
    script_k(llm, pattern)
    before = llm.stats()
    out = llm.generate([prompt], params)
    return out, stats_delta(before, llm.stats())


PATTERNS = {
    "k = 0": [0],
    "k = 4": [4],
    "k = 0 early, then 4": [4, 0, 0, 0, 0, *[4] * 200],
}


@pytest.mark.parametrize("first", list(PATTERNS))
def test_a_prefix_hit_recomputes_the_drafts_kv_only_where_it_is_missing(first):
    """Request A runs with the policy's k following `first`. B's prompt is A's prompt and output (a second turn)
    and runs at k = 4 on the same engine, with prefix caching. After A at k = 0 its decode steps skipped the draft:
    B's hit lands on blocks without the draft's KV from A's first generated token on, which the draft recomputes
    (in passes of its own: the lag bound is lowered to 8 for B). After A at k = 4, or after a few skipped steps
    that the draft caught up on, nothing is recomputed. Either way B's drafts, hence its accepted counts, and its
    output are those of B alone on a fresh engine."""
    prompt = load_prompts(2)[1][:32]  # two blocks; the third, allocated with them, is all decodes
    a_params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    b_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = make_llm(method="draft_model", k=4, **CONFIG)
    runner = llm.engine.engine_core.runner
    assert runner.draft_kv_validity is not None and runner.spec.proposer.max_lag == 64
    (a_out,), _ = _run(llm, prompt, a_params, PATTERNS[first])
    second_turn = prompt + list(a_out.token_ids)
    runner.spec.proposer.max_lag = 8
    admitted_lags = []
    admit = runner._admit_draft_kv
    runner._admit_draft_kv = lambda state: (admit(state), admitted_lags.append(state.draft_lag))
    got, delta = _run(llm, second_turn, b_params, [4])
    alone, alone_delta = _run(make_llm(method="draft_model", k=4, **CONFIG), second_turn, b_params, [4])
    assert got[0].num_cached_tokens == (len(second_turn) - 1) // 16 * 16, "B should hit A's full blocks"
    assert_same_outputs(alone, got, f"B after A at {first}")
    assert delta["spec_num_draft_tokens"] == alone_delta["spec_num_draft_tokens"]
    assert delta["spec_num_accepted_tokens"] == alone_delta["spec_num_accepted_tokens"] > 0
    if first == "k = 0":  # A's prompt blocks (positions below 32) hold the draft's KV; the rest is recomputed
        assert admitted_lags == [got[0].num_cached_tokens - 32] and runner.num_draft_catch_up_passes > 0
    else:
        assert admitted_lags == [0] and runner.num_draft_catch_up_passes == 0
    assert_kv_free(llm.stats())
