"""The step-input kernel: the torch reference against a plain per-token loop, and the Triton kernel
against the reference (interpreted on the CPU in a child pytest, compiled on a GPU). See
tests/kernels/test_triton_kernels.py for why the interpreted class runs in a child process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from asyncspec.kernels.prepare_inputs import prepare_inputs_ref, resolve_computed_ref

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
BLOCK_SIZE = 4


@dataclass
class Case:
    meta: torch.Tensor
    num_reqs: int
    num_tokens: int
    token_ids: torch.Tensor
    block_tables: torch.Tensor
    capacity: torch.Tensor | None = None


def make_case(q_lens: list[int], computed: list[int], num_pad_tokens: int, seed: int = 0) -> Case:
    """Requests with q_lens scheduled tokens (0 = padding request) after `computed` tokens, in
    shuffled token-buffer rows, with distinct block ids; `num_pad_tokens` tail tokens."""
    gen = torch.Generator().manual_seed(seed)
    n = len(q_lens)
    rows = torch.randperm(n + 3, generator=gen)[:n]
    meta = torch.zeros((4, n + 2), dtype=torch.int64)  # wider than the batch: stale columns ignored
    meta[:, n:] = 99
    meta[0, :n], meta[1, :n], meta[2, :n] = rows, torch.tensor(computed), torch.tensor(q_lens)
    width = max(c + q for c, q in zip(computed, q_lens, strict=True)) + 2
    token_ids = torch.randint(0, 1000, (n + 3, width), generator=gen)
    cols = -(-width // BLOCK_SIZE) + 1
    block_tables = torch.randperm(n * cols + 5, generator=gen)[: n * cols].view(n, cols).to(torch.int32)
    return Case(meta, n, sum(q_lens) + num_pad_tokens, token_ids, block_tables)


def loop_reference(case: Case) -> dict[str, list[int]]:
    """The contract, token by token in Python."""
    out: dict[str, list[int]] = {"input_ids": [], "positions": [], "slot_mapping": [], "qsl": [0], "seq_lens": []}
    for i in range(case.num_reqs):
        row, computed, q = (int(case.meta[k, i]) for k in range(3))
        out["qsl"].append(out["qsl"][-1] + q)
        out["seq_lens"].append(computed + q if q else 0)
        for j in range(q):
            pos = computed + j
            out["input_ids"].append(int(case.token_ids[row, pos]))
            out["positions"].append(pos)
            block = int(case.block_tables[i, pos // BLOCK_SIZE])
            fits = case.capacity is None or pos < int(case.capacity[i])
            out["slot_mapping"].append(block * BLOCK_SIZE + pos % BLOCK_SIZE if fits else -1)
    pad = case.num_tokens - len(out["positions"])
    out["input_ids"] += [0] * pad
    out["positions"] += [0] * pad
    out["slot_mapping"] += [-1] * pad
    return out


def run(fn, case: Case, device: str = "cpu") -> dict[str, list[int]]:
    size = case.num_tokens + 5
    bufs = {
        "input_ids": torch.full((size,), -7, dtype=torch.int64, device=device),
        "positions": torch.full((size,), -7, dtype=torch.int64, device=device),
        "slot_mapping": torch.full((size,), -7, dtype=torch.int64, device=device),
        "qsl": torch.full((case.num_reqs + 3,), -7, dtype=torch.int32, device=device),
        "seq_lens": torch.full((case.num_reqs + 2,), -7, dtype=torch.int32, device=device),
    }
    fn(
        case.meta.to(device),
        case.num_reqs,
        case.num_tokens,
        case.token_ids.to(device),
        case.block_tables.to(device),
        BLOCK_SIZE,
        bufs["input_ids"],
        bufs["positions"],
        bufs["slot_mapping"],
        bufs["qsl"],
        bufs["seq_lens"],
        case.capacity.to(device) if case.capacity is not None else None,
    )
    # Nothing past the requested sizes is written.
    for name, limit in (("input_ids", case.num_tokens), ("qsl", case.num_reqs + 1), ("seq_lens", case.num_reqs)):
        assert (bufs[name][limit:] == -7).all(), name
    return {
        "input_ids": bufs["input_ids"][: case.num_tokens].tolist(),
        "positions": bufs["positions"][: case.num_tokens].tolist(),
        "slot_mapping": bufs["slot_mapping"][: case.num_tokens].tolist(),
        "qsl": bufs["qsl"][: case.num_reqs + 1].tolist(),
        "seq_lens": bufs["seq_lens"][: case.num_reqs].tolist(),
    }


def with_capacity(case: Case) -> Case:
    """Each request may write only its first computed + q // 2 positions (the draft's guard)."""
    case.capacity = case.meta[1, : case.num_reqs] + case.meta[2, : case.num_reqs] // 2
    return case


CASES = {
    "decode": ([1, 1, 1, 1], [5, 0, 17, 3], 0),
    "verify_padded_bucket": ([5, 5, 5, 0, 0, 0, 0, 0], [9, 30, 2, 0, 0, 0, 0, 0], 25),
    "decode_padded_bucket": ([1, 1, 1, 0, 0, 0, 0, 0], [4, 12, 2, 0, 0, 0, 0, 0], 5),
    "mixed_prefill": ([7, 1, 0, 12, 5], [0, 40, 0, 3, 11], 3),
    "one_long_prefill": ([150], [2], 10),
    "many_requests": ([1 + (i % 3) for i in range(70)], [i % 11 for i in range(70)], 6),
}


@pytest.mark.parametrize("capacity", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_the_loop(name, capacity):
    case = make_case(*CASES[name])
    if capacity:
        case = with_capacity(case)
    assert run(prepare_inputs_ref, case) == loop_reference(case)


def as_runner_pads(case: Case, n: int) -> Case:
    """The padding requests past the first n as the runner writes them: row 0, shared with the first real one."""
    case.meta[0, n : case.num_reqs] = case.meta[0, 0]
    return case


def with_resolve(case: Case, seed: int) -> tuple[Case, torch.Tensor, int]:
    """Adds row 4 (host count authoritative, for about a third of the requests) and the device's counts per
    buffer row, at most 2 behind the plan's (rejected drafts): the runner's call, which resolves the requests
    before the padding ones."""
    gen = torch.Generator().manual_seed(seed)
    n = max((i + 1 for i, q in enumerate(case.meta[2, : case.num_reqs].tolist()) if q), default=0)
    meta = torch.cat([case.meta, torch.zeros((2, case.meta.shape[1]), dtype=torch.int64)])
    meta[4, :n] = (torch.rand(n, generator=gen) < 0.33).long()
    counts = torch.randint(0, 50, (case.token_ids.shape[0],), generator=gen)
    behind = torch.randint(0, 3, (n,), generator=gen)
    counts[meta[0, :n]] = (meta[1, :n] - behind).clamp_min(0)
    case.meta = meta
    return case, counts, n


def run_resolved(fn, case: Case, counts: torch.Tensor, n: int, device: str = "cpu") -> dict[str, list[int]]:
    """`fn` with resolve=(n, counts): its inputs, then the resolved counts in meta and on the device."""
    counts = counts.clone().to(device)
    meta = case.meta.clone().to(device)
    resolved = Case(meta, case.num_reqs, case.num_tokens, case.token_ids, case.block_tables, case.capacity)
    out = run(lambda *args: fn(*args, resolve=(n, counts)), resolved, device)
    return out | {"meta_computed": meta[1].tolist(), "counts": counts.tolist()}


def run_in_two(case: Case, counts: torch.Tensor, n: int) -> dict[str, list[int]]:
    """The references one after the other, as the runner launched them before they were fused."""
    counts, meta = counts.clone(), case.meta.clone()
    resolve_computed_ref(meta, n, counts)
    resolved = Case(meta, case.num_reqs, case.num_tokens, case.token_ids, case.block_tables, case.capacity)
    return run(prepare_inputs_ref, resolved) | {"meta_computed": meta[1].tolist(), "counts": counts.tolist()}


# "one_long_prefill" has 160 tokens: two programs, so the Triton wrapper resolves in a launch of its own.
RESOLVE_CASES = ("decode", "verify_padded_bucket", "mixed_prefill", "many_requests", "one_long_prefill")


@pytest.mark.parametrize("name", RESOLVE_CASES)
def test_reference_resolve_is_resolve_computed_first(name):
    case, counts, n = with_resolve(make_case(*CASES[name]), 0)
    got = run_resolved(prepare_inputs_ref, case, counts, n)
    assert got == run_in_two(case, counts, n)
    assert got["counts"] != counts.tolist()  # it did resolve: the device's counts advanced


@pytest.mark.parametrize("name", ["decode_padded_bucket", "verify_padded_bucket"])
def test_reference_resolving_the_padding_too_changes_nothing(name):
    """A graph resolves its whole bucket: the padding requests (no tokens) must be left alone."""
    case, counts, n = with_resolve(make_case(*CASES[name]), 0)
    assert n < case.num_reqs
    case = as_runner_pads(case, n)
    assert run_resolved(prepare_inputs_ref, case, counts, case.num_reqs) == run_in_two(case, counts, n)


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, 2 * len(CASES) + len(RESOLVE_CASES) + 2)


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 before triton is imported")
class TestInterpreted:
    @pytest.mark.parametrize("capacity", [False, True])
    @pytest.mark.parametrize("name", sorted(CASES))
    def test_triton_matches_reference(self, name, capacity):
        from asyncspec.kernels import prepare_inputs_triton

        assert isinstance(prepare_inputs_triton._prepare_inputs_kernel, InterpretedFunction)
        case = make_case(*CASES[name], seed=1)
        if capacity:
            case = with_capacity(case)
        assert run(prepare_inputs_triton.prepare_inputs, case) == run(prepare_inputs_ref, case)

    @pytest.mark.parametrize("name", RESOLVE_CASES)
    def test_triton_resolving_matches_the_references_in_two(self, name):
        from asyncspec.kernels import prepare_inputs_triton

        case, counts, n = with_resolve(make_case(*CASES[name], seed=3), 3)
        assert run_resolved(prepare_inputs_triton.prepare_inputs, case, counts, n) == run_in_two(case, counts, n)

    @pytest.mark.parametrize("name", ["decode_padded_bucket", "verify_padded_bucket"])
    def test_triton_resolving_the_padding_too_changes_nothing(self, name):
        from asyncspec.kernels import prepare_inputs_triton

        case, counts, n = with_resolve(make_case(*CASES[name], seed=5), 5)
        case = as_runner_pads(case, n)
        got = run_resolved(prepare_inputs_triton.prepare_inputs, case, counts, case.num_reqs)
        assert got == run_in_two(case, counts, n)


@pytest.mark.gpu
@pytest.mark.parametrize("name", RESOLVE_CASES)
def test_compiled_triton_resolving_matches_the_references_in_two(name):
    from asyncspec.kernels import prepare_inputs_triton

    case, counts, n = with_resolve(make_case(*CASES[name], seed=4), 4)
    assert run_resolved(prepare_inputs_triton.prepare_inputs, case, counts, n, "cuda") == run_in_two(case, counts, n)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["decode_padded_bucket", "verify_padded_bucket"])
def test_compiled_triton_resolving_the_padding_too_changes_nothing(name):
    from asyncspec.kernels import prepare_inputs_triton

    case, counts, n = with_resolve(make_case(*CASES[name], seed=6), 6)
    case = as_runner_pads(case, n)
    got = run_resolved(prepare_inputs_triton.prepare_inputs, case, counts, case.num_reqs, "cuda")
    assert got == run_in_two(case, counts, n)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_triton_matches_reference(name, capacity):
    from asyncspec.kernels import prepare_inputs_triton

    case = make_case(*CASES[name], seed=2)
    if capacity:
        case = with_capacity(case)
    assert run(prepare_inputs_triton.prepare_inputs, case, "cuda") == run(prepare_inputs_ref, case)
