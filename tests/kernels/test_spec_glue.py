"""The greedy speculative step's glue: the pass-input reference against the kernels it replaced (prepare_inputs_ref
and copies), and each Triton kernel against its reference (interpreted on the CPU in a child pytest, compiled on
a GPU) over padded batches. See tests/kernels/test_triton_kernels.py for why the interpreted class runs in a
child process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from asyncspec.kernels import spec_glue
from asyncspec.kernels.prepare_inputs import prepare_inputs_ref

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
BLOCK_SIZE = 4
MAX_MODEL_LEN = 60


@dataclass
class Batch:
    """A padded batch as the runner's graphs see it: `num_real` requests, then padding (row 0, no tokens)."""

    meta: torch.Tensor
    """[7, B + 2] int64: rows 0 (token-buffer row), 1 (computed), 2 (scheduled), 5 (planned), 6 (slots)."""
    num_reqs: int
    query_len: int
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    token_ids: torch.Tensor
    block_tables: torch.Tensor
    gen: torch.Generator


def make_batch(num_reqs: int, num_real: int, query_len: int, seed: int, uniform: bool = True) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_rows = num_reqs + 4
    meta = torch.full((7, num_reqs + 2), 77, dtype=torch.int64)  # wider than the batch: stale columns
    meta[:, :num_reqs] = 0
    meta[0, :num_real] = torch.randperm(num_rows, generator=gen)[:num_real]
    meta[0, num_real:num_reqs] = meta[0, 0]
    meta[1, :num_real] = torch.randint(0, 30, (num_real,), generator=gen)
    if uniform:
        meta[2, :num_real] = query_len
    else:
        meta[2, :num_real] = torch.randint(1, query_len + 1, (num_real,), generator=gen)
    meta[5, :num_real] = (torch.rand(num_real, generator=gen) * meta[2, :num_real]).long()  # < scheduled
    meta[6, :num_real] = meta[1, :num_real] + meta[2, :num_real] + torch.randint(-2, 4, (num_real,), generator=gen)
    scheduled = meta[2, :num_reqs]
    seq_lens = torch.where(scheduled > 0, meta[1, :num_reqs] + scheduled, 0).to(torch.int32)
    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(scheduled, 0).to(torch.int32)
    token_ids = torch.randint(0, 500, (num_rows, MAX_MODEL_LEN + query_len + 2), generator=gen)
    cols = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    block_tables = torch.randint(0, 1000, (num_reqs + 2, cols), generator=gen).to(torch.int32)
    return Batch(meta, num_reqs, query_len, seq_lens, query_start_loc, token_ids, block_tables, gen)


def hidden_for(batch: Batch, num_tokens: int, hidden_size: int = 40) -> torch.Tensor:
    return torch.randn((num_tokens, hidden_size), generator=batch.gen)


# (num_reqs, num_real, query_len): a full bucket, a padded one, one request, a padded wide one.
SHAPES = [(4, 4, 5), (8, 3, 5), (1, 1, 3), (16, 13, 2)]


def old_pass_inputs(tokens, pass_index, loop_position, pass_meta, capacity, block_tables, bufs):
    """The proposal pass as the proposer launched it before the fused kernel: prepare_inputs_ref over
    [row, position, live], then the tokens copied over the gathered ids and into the results."""
    b = tokens.shape[0]
    live = pass_meta[2, :b] > 0
    meta = pass_meta.clone()
    position = loop_position[:b] + pass_index
    meta[1, :b] = torch.where(live, position.clamp_max(MAX_MODEL_LEN - 1), 0)
    token_ids = torch.randint(0, 500, (int(meta[0, :b].max()) + 1, MAX_MODEL_LEN))
    prepare_inputs_ref(
        meta,
        b,
        b,
        token_ids,
        block_tables,
        BLOCK_SIZE,
        bufs["input_ids"],
        bufs["positions"],
        bufs["slot_mapping"],
        bufs["qsl"],
        bufs["seq_lens"],
        capacity,
    )
    bufs["input_ids"][:b].copy_(tokens)
    bufs["loop_tokens"][:b, pass_index - 1] = tokens


def pass_case(num_reqs: int, num_live: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 500, (num_reqs,), generator=gen)
    loop_position = torch.randint(0, MAX_MODEL_LEN + 3, (num_reqs + 2,), generator=gen)  # some past the cap
    pass_meta = torch.zeros((3, num_reqs + 2), dtype=torch.int64)
    pass_meta[0, :num_reqs] = torch.randint(0, 8, (num_reqs,), generator=gen)
    pass_meta[2, :num_live] = 1
    capacity = (loop_position + torch.randint(-1, 7, (num_reqs + 2,), generator=gen)).clamp_max(MAX_MODEL_LEN - 1)
    block_tables = torch.randint(0, 1000, (num_reqs + 2, -(-MAX_MODEL_LEN // BLOCK_SIZE)), generator=gen)
    return tokens, loop_position, pass_meta, capacity, block_tables.to(torch.int32)


def pass_buffers(num_reqs: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    size = num_reqs + 3
    return {
        "input_ids": torch.full((size,), -7, dtype=torch.int64, device=device),
        "positions": torch.full((size,), -7, dtype=torch.int64, device=device),
        "slot_mapping": torch.full((size,), -7, dtype=torch.int64, device=device),
        "qsl": torch.full((size,), -7, dtype=torch.int32, device=device),
        "seq_lens": torch.full((size,), -7, dtype=torch.int32, device=device),
        "loop_tokens": torch.full((size, 4), -7, dtype=torch.int64, device=device),
    }


def run_pass(fn, case, pass_index: int, device: str = "cpu") -> dict[str, list]:
    tokens, loop_position, pass_meta, capacity, block_tables = (t.to(device) for t in case)
    bufs = pass_buffers(tokens.shape[0], device)
    fn(
        tokens,
        pass_index,
        loop_position,
        pass_meta,
        capacity,
        block_tables,
        BLOCK_SIZE,
        MAX_MODEL_LEN,
        bufs["input_ids"],
        bufs["positions"],
        bufs["slot_mapping"],
        bufs["qsl"],
        bufs["seq_lens"],
        bufs["loop_tokens"],
    )
    return {name: t.tolist() for name, t in bufs.items()}


PASS_CASES = [(4, 4), (8, 5), (1, 1), (16, 0), (32, 31)]


@pytest.mark.parametrize("pass_index", [1, 3])
@pytest.mark.parametrize("num_reqs,num_live", PASS_CASES)
def test_pass_inputs_reference_equals_the_kernels_it_replaced(num_reqs, num_live, pass_index):
    case = pass_case(num_reqs, num_live, seed=num_reqs + pass_index)
    tokens, loop_position, pass_meta, capacity, block_tables = case
    old = pass_buffers(num_reqs)
    old_pass_inputs(tokens, pass_index, loop_position, pass_meta, capacity, block_tables, old)
    new = run_pass(spec_glue.draft_pass_inputs_ref, case, pass_index)
    assert new == {name: t.tolist() for name, t in old.items()}
    # It did exercise both guards: the position cap and the capacity.
    if num_live > 4:
        slots = new["slot_mapping"][:num_live]
        assert -1 in slots and any(s >= 0 for s in slots)


def test_verify_reference_writes_the_emitted_runs():
    """The commit's effects, request by request in Python: the run at num_tokens + j, computed counts."""
    batch = make_batch(8, 5, 5, seed=3)
    b, q = batch.num_reqs, batch.query_len
    out, accepted = emitted_runs(batch)
    token_ids, counts = batch.token_ids.clone(), torch.arange(batch.token_ids.shape[0]) * 10
    new_counts = counts.clone()
    new = spec_glue.verify_commit_ref(out, accepted, batch.seq_lens, batch.meta, token_ids, new_counts, b)
    expected = batch.token_ids.clone()
    for i in range(5):
        row, planned = int(batch.meta[0, i]), int(batch.meta[5, i])
        base = int(batch.seq_lens[i]) - planned
        for j in range(q):
            if out[i, j] >= 0:
                expected[row, base + j] = out[i, j]
        counts[row] += int(accepted[i]) - planned
        assert int(new[i]) == base + int(accepted[i]) + 1
    assert torch.equal(token_ids, expected)
    assert torch.equal(new_counts, counts)


def verdicts(batch: Batch, vocab: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy verification's inputs over `batch`: the target's tokens [B, q] from a small vocabulary (so that drafts
    often match) with some -1 (rows without a valid token), drafts [B, q - 1] half copied from them, a few -1 or
    past the vocabulary, and the valid counts (at most the planned positions)."""
    b, q = batch.num_reqs, batch.query_len
    target = torch.randint(0, vocab, (b, q), generator=batch.gen)
    target[torch.rand((b, q), generator=batch.gen) < 0.1] = -1
    drafts = torch.randint(0, vocab, (b, q - 1), generator=batch.gen)
    copied = torch.rand((b, q - 1), generator=batch.gen) < 0.6
    drafts = torch.where(copied, target[:, : q - 1], drafts)
    odd = torch.rand((b, q - 1), generator=batch.gen)
    drafts[odd < 0.05] = -1  # never accepted, even where the target's token is -1
    drafts[(odd >= 0.05) & (odd < 0.1)] = vocab + 3
    num_valid = (torch.rand(b, generator=batch.gen) * (batch.meta[5, :b] + 1)).long()
    return target, drafts, num_valid


def test_greedy_accept_equals_the_rejection_sampler_over_the_one_hot():
    """The greedy verification's rule on the target's tokens gives the runs the rejection kernel gives over
    `greedy_target_probs` of the same logits (the path it replaced): NaN rows and all -inf rows included."""
    from asyncspec.kernels.rejection_sample import rejection_sample_ref
    from asyncspec.layers.sampler import greedy_sample
    from asyncspec.spec.verification import greedy_target_probs

    vocab = 7
    accepted_any = invalid_any = False
    for seed in range(20):
        batch = make_batch(8, 6, 5, seed=seed)
        b, q = batch.num_reqs, batch.query_len
        _, drafts, num_valid = verdicts(batch, vocab)
        logits = torch.randn((b * q, vocab), generator=batch.gen)
        # Drafts often the argmax: each row's logits peak at its request's draft there, or elsewhere.
        peaks = torch.cat([drafts, drafts[:, :1]], dim=1).reshape(-1).clamp(0, vocab - 1)
        logits[torch.arange(b * q), peaks] += 3 * (torch.rand(b * q, generator=batch.gen) < 0.7)
        logits[torch.rand(b * q, generator=batch.gen) < 0.08] = float("nan")
        logits[torch.rand(b * q, generator=batch.gen) < 0.05] = float("-inf")
        probs = greedy_target_probs(logits).view(b, q, vocab)
        want = rejection_sample_ref(
            probs,
            drafts,
            None,
            num_valid,
            torch.ones(b, dtype=torch.bool),
            torch.rand((b, q - 1), generator=batch.gen),
            torch.ones((b, vocab)),
        )
        got = spec_glue.greedy_accept_ref(greedy_sample(logits).view(b, q), drafts, num_valid)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        accepted_any |= bool((got[1] > 0).any())
        invalid_any |= bool((got[0] == -1).any() & (got[0][torch.arange(b), got[1]] == -1).any())
    assert accepted_any and invalid_any  # drafts were accepted, and some run ends at a row without a token


def test_greedy_accept_reference_request_by_request():
    batch = make_batch(8, 8, 5, seed=11)
    target, drafts, num_valid = verdicts(batch)
    out, accepted = spec_glue.greedy_accept_ref(target, drafts, num_valid)
    for i in range(batch.num_reqs):
        a = 0
        while a < int(num_valid[i]) and int(drafts[i, a]) == int(target[i, a]) >= 0:
            a += 1
        assert int(accepted[i]) == a
        assert out[i].tolist() == target[i, : a + 1].tolist() + [-1] * (batch.query_len - a - 1)
    assert 0 < int(accepted.sum()) < int(num_valid.sum())  # both verdicts occur


def emitted_runs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: accepted drafts (at most the planned ones), the target's token, then -1."""
    b, q = batch.num_reqs, batch.query_len
    accepted = (torch.rand(b, generator=batch.gen) * (batch.meta[5, :b] + 1)).long()
    out = torch.randint(0, 500, (b, q), generator=batch.gen)
    out[torch.arange(q).unsqueeze(0) > accepted.unsqueeze(1)] = -1
    return out, accepted


def on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def check_verify_gather(fused, shape, device: str) -> None:
    batch = make_batch(*shape, seed=1)
    b, q = batch.num_reqs, batch.query_len
    hidden = hidden_for(batch, b * q + 3)
    draft_token_ids = torch.randint(0, 500, (b + 5, 6), generator=batch.gen)
    num_draft = torch.randint(0, 6, (b + 5,), generator=batch.gen)
    tensors = (hidden, batch.query_start_loc, batch.seq_lens, batch.meta, draft_token_ids, num_draft)
    got = fused.verify_gather(*on(device, *tensors), b, q)
    for got_one, want in zip(got, spec_glue.verify_gather_ref(*tensors, b, q), strict=True):
        assert torch.equal(got_one.cpu(), want)


def check_greedy_accept_commit(fused, shape, device: str) -> None:
    batch = make_batch(*shape, seed=2)
    target, drafts, num_valid = verdicts(batch)
    # The drafts as verify_gather leaves them: a view of a wider buffer (its stride is not q - 1).
    wide = torch.full((batch.num_reqs, batch.query_len + 2), -5, dtype=torch.int64)
    wide[:, : batch.query_len - 1] = drafts
    results = []
    for fn, dev in ((fused.greedy_accept_commit, device), (spec_glue.greedy_accept_commit_ref, "cpu")):
        token_ids, counts = on(dev, batch.token_ids.clone(), torch.arange(batch.token_ids.shape[0]) * 10)
        (drafts_view,) = on(dev, wide)
        got = fn(
            *on(dev, target),
            drafts_view[:, : batch.query_len - 1],
            *on(dev, num_valid, batch.seq_lens, batch.meta),
            token_ids,
            counts,
            batch.num_reqs,
        )
        results.append([t.cpu() for t in (*got, token_ids, counts)])
    for got_one, want in zip(*results, strict=True):
        assert torch.equal(got_one, want)
    assert not torch.equal(results[0][3], batch.token_ids)  # runs were written


def check_record_drafts(fused, shape, device: str) -> None:
    batch = make_batch(*shape, seed=4)
    b, n = batch.num_reqs, batch.query_len - 1
    drafts = torch.randint(0, 500, (b, n), generator=batch.gen)
    num_tokens = torch.randint(1, MAX_MODEL_LEN, (b,), generator=batch.gen)
    results = []
    for fn, dev in ((fused.record_drafts, device), (spec_glue.record_drafts_ref, "cpu")):
        rows = batch.token_ids.shape[0] + 1
        token_ids, draft_token_ids, num_draft = on(
            dev,
            batch.token_ids.clone(),
            torch.full((rows, 6), -3, dtype=torch.int64),
            torch.full((rows,), -3, dtype=torch.int64),
        )
        fn(*on(dev, drafts, batch.meta, num_tokens), token_ids, draft_token_ids, num_draft)
        # The spare last row is unspecified.
        results.append([t.cpu() for t in (token_ids, draft_token_ids[:-1], num_draft[:-1])])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def check_draft_step_meta(fused, shape, device: str) -> None:
    batch = make_batch(*shape, seed=5, uniform=False)
    results = []
    for fn, dev in ((fused.draft_step_meta, device), (spec_glue.draft_step_meta_ref, "cpu")):
        draft_meta, draft_tables = on(
            dev,
            torch.full((4, batch.num_reqs + 3), -3, dtype=torch.int64),
            torch.full((batch.num_reqs + 3, batch.block_tables.shape[1]), -3, dtype=torch.int32),
        )
        fn(*on(dev, batch.meta, batch.block_tables), draft_meta, draft_tables, batch.num_reqs)
        results.append([draft_meta.cpu(), draft_tables.cpu()])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def check_draft_loop_start(fused, shape, device: str) -> None:
    batch = make_batch(*shape, seed=6, uniform=False)
    b = batch.num_reqs
    hidden = hidden_for(batch, b * (batch.query_len + 1))
    accepted = (torch.rand(b, generator=batch.gen) * (batch.meta[5, :b] + 1)).long()
    results = []
    for fn, dev in ((fused.draft_loop_start, device), (spec_glue.draft_loop_start_ref, "cpu")):
        bufs = on(
            dev,
            torch.full((b + 2, hidden.shape[1]), -3.0),
            torch.full((b + 2,), -3, dtype=torch.int64),
            torch.full((b + 2,), -3, dtype=torch.int64),
            torch.full((3, b + 2), -3, dtype=torch.int64),
        )
        meta, accepted_dev, hidden_dev = on(dev, batch.meta, accepted, hidden)
        fn(meta, accepted_dev, hidden_dev, MAX_MODEL_LEN, *bufs, b)
        results.append([t.cpu() for t in bufs])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def check_draft_pass_inputs(fused, num_reqs: int, num_live: int, pass_index: int, device: str) -> None:
    case = pass_case(num_reqs, num_live, seed=num_reqs * pass_index)
    got = run_pass(fused.draft_pass_inputs, case, pass_index, device)
    assert got == run_pass(spec_glue.draft_pass_inputs_ref, case, pass_index)


CHECKS = [
    check_verify_gather,
    check_greedy_accept_commit,
    check_record_drafts,
    check_draft_step_meta,
    check_draft_loop_start,
]


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, len(CHECKS) * len(SHAPES) + 2 * len(PASS_CASES) + 1)


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 before triton is imported")
class TestInterpreted:
    @pytest.fixture(autouse=True)
    def _interpreted(self):
        from asyncspec.kernels import spec_glue_triton

        assert isinstance(spec_glue_triton._verify_gather_kernel, InterpretedFunction)
        self.fused = spec_glue_triton

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_kernel_matches_reference(self, check, shape):
        check(self.fused, shape, "cpu")

    @pytest.mark.parametrize("pass_index", [1, 3])
    @pytest.mark.parametrize("num_reqs,num_live", PASS_CASES)
    def test_draft_pass_inputs(self, num_reqs, num_live, pass_index):
        check_draft_pass_inputs(self.fused, num_reqs, num_live, pass_index, "cpu")

    def test_greedy_accept_commit_without_drafts(self):
        check_greedy_accept_commit(self.fused, (4, 3, 1), "cpu")  # q = 1: the target's token alone


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_compiled_kernel_matches_reference(check, shape):
    from asyncspec.kernels import spec_glue_triton

    check(spec_glue_triton, shape, "cuda")


@pytest.mark.gpu
def test_compiled_greedy_accept_commit_without_drafts():
    from asyncspec.kernels import spec_glue_triton

    check_greedy_accept_commit(spec_glue_triton, (4, 3, 1), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("pass_index", [1, 3])
@pytest.mark.parametrize("num_reqs,num_live", PASS_CASES)
def test_compiled_draft_pass_inputs(num_reqs, num_live, pass_index):
    from asyncspec.kernels import spec_glue_triton

    check_draft_pass_inputs(spec_glue_triton, num_reqs, num_live, pass_index, "cuda")
