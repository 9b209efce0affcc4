"""Greedy argmax (the sampler's `greedy_sample`): the torch reference against the contract written out row by row in
Python, and the Triton kernel against the reference, under TRITON_INTERPRET=1 on the CPU (small shapes, forced
blocks so that a row spans many chunks and the combine many tiles) and compiled on a GPU (real vocabularies in bf16
and fp32, planted ties, no host sync, CUDA-graph capture, one compilation across batch sizes).

Interpretation needs TRITON_INTERPRET=1 set before triton is imported (see tests/kernels/test_triton_kernels.py),
so `TestInterpreted` runs in-process only where that already holds, and otherwise in a child pytest started by
`test_interpreter_suite`.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # a bare GPU box may lack hypothesis; only the fuzz tests need it
    given = None

from asyncspec.kernels.greedy_argmax import greedy_argmax_into_tokens_ref, greedy_argmax_ref
from asyncspec.layers.attention import BACKEND_ENV
from asyncspec.layers.sampler import INVALID_TOKEN_ID, greedy_sample

INF, NAN = math.inf, math.nan
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Exact in every dtype, so bf16 / fp16 rows keep their ties and special values.
SPECIAL = [-INF, INF, NAN, -3.0, -0.0, 0.0, 0.5, 2.0, 7.0]
NUM_CASES = 12
# Chunk boundaries of the blocks the tests use (16, 32, 4096): a maximum planted on both sides of one.
BOUNDARIES = [15, 16, 31, 32, 63, 64, 4095, 4096]


def expected_ids(logits: torch.Tensor, invalid_id: int = INVALID_TOKEN_ID) -> torch.Tensor:
    """The contract, row by row in Python: invalid with a NaN or a maximum of -inf, else the first index of the
    maximum (Python's == makes -0.0 and 0.0 equal, as torch's comparisons do)."""
    ids = []
    for row in logits.float().tolist():
        if any(math.isnan(v) for v in row) or max(row) == -INF:
            ids.append(invalid_id)
        else:
            ids.append(row.index(max(row)))
    return torch.tensor(ids, dtype=torch.int64)


def make_logits(gen: torch.Generator, n: int, v: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """[n, v] logits whose row r is case (r + offset) % NUM_CASES: random, many ties, all -inf, a NaN, +inf twice,
    mostly -inf, signed zeros, the maximum last, NaN with +inf, a constant row, and maxima planted on both sides of
    chunk boundaries (with and without the earlier side)."""
    x = torch.randn(n, v, generator=gen) * 3

    def pos(k: int = 1) -> list[int]:
        return torch.randperm(v, generator=gen)[:k].tolist()

    for r in range(n):
        case = (r + offset) % NUM_CASES
        row = x[r]
        if case == 1:
            row.copy_(torch.randint(-4, 4, (v,), generator=gen).float())
        elif case == 2:
            row.fill_(-INF)
        elif case == 3:
            row[pos()] = NAN
        elif case == 4:
            row[pos(2)] = INF
        elif case == 5:
            row.fill_(-INF)
            row[pos(3)] = torch.tensor([-3.0, 2.0, 2.0])[: min(3, v)]
        elif case == 6:
            row.fill_(-INF)
            p = pos(2)
            row[p[0]] = -0.0
            row[p[-1]] = 0.0
        elif case == 7:
            row[-1] = row.max() + 1
        elif case == 8:
            row[pos(2)] = torch.tensor([NAN, INF])[: min(2, v)]
        elif case == 9:
            row.fill_(0.5)
        elif case in (10, 11):
            top = row.max() + 1
            planted = [b for b in BOUNDARIES if b < v and (case == 10 or b % 2 == 0)]
            row[planted or [v - 1]] = top
    return x.to(dtype)


def test_cases_cover_the_contract() -> None:
    """The generator really makes invalid rows, ties at the maximum and maxima past the first chunk."""
    logits = make_logits(torch.Generator().manual_seed(0), NUM_CASES, 100, torch.float32)
    ids = expected_ids(logits)
    assert [bool(i) for i in ids.eq(INVALID_TOKEN_ID)] == [c in (2, 3, 8) for c in range(NUM_CASES)]
    assert int(ids[10]) == 15 and int(ids[11]) == 16 and int(ids[7]) == 99
    assert int((logits[4] == INF).sum()) == 2 and int((logits[1] == logits[1].max()).sum()) > 1


# ------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,v", [(1, 1), (1, 7), (37, 33), (37, 300), (12, 5000)])
def test_reference_matches_definition(n: int, v: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n * 10000 + v)
    for offset in range(NUM_CASES if n == 1 else 1):
        logits = make_logits(gen, n, v, dtype, offset)
        got = greedy_argmax_ref(logits, INVALID_TOKEN_ID)
        assert got.dtype == torch.int64 and got.shape == (n,)
        assert torch.equal(got, expected_ids(logits)), offset


def test_reference_strided_rows_and_invalid_id() -> None:
    logits = make_logits(torch.Generator().manual_seed(1), 37, 70, torch.bfloat16)
    wide = torch.full((37, 75), NAN, dtype=torch.bfloat16)
    wide[:, :70] = logits
    assert torch.equal(greedy_argmax_ref(wide[:, :70], INVALID_TOKEN_ID), expected_ids(logits))
    column_major = logits.t().contiguous().t()
    assert torch.equal(greedy_argmax_ref(column_major, 12345), expected_ids(logits, 12345))


def test_greedy_sample_is_the_reference_on_cpu(monkeypatch) -> None:
    """On the CPU (no backend override) greedy_sample is the reference, the one max reduction it always was."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    logits = make_logits(torch.Generator().manual_seed(2), 37, 300, torch.float32)
    values, ids = logits.max(dim=-1)
    assert torch.equal(greedy_sample(logits), torch.where(values > -INF, ids, INVALID_TOKEN_ID))
    assert torch.equal(greedy_sample(logits), expected_ids(logits))
    assert torch.equal(greedy_sample(logits[0]), expected_ids(logits[:1])[0])  # 1-D still works


if given is not None:

    @st.composite
    def few_valued_logits(draw, max_rows: int = 6, max_vocab: int = 80) -> torch.Tensor:
        """Rows drawn from a few of SPECIAL's values each: ties, NaN / +-inf rows, signed zeros."""
        n, v = draw(st.integers(1, max_rows)), draw(st.integers(1, max_vocab))
        rows = []
        for _ in range(n):
            palette = sorted(draw(st.sets(st.integers(0, len(SPECIAL) - 1), min_size=1, max_size=4)))
            rows.append([SPECIAL[i] for i in draw(st.lists(st.sampled_from(palette), min_size=v, max_size=v))])
        return torch.tensor(rows).to(draw(st.sampled_from(DTYPES)))

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(logits=few_valued_logits())
    def test_reference_fuzz(logits: torch.Tensor) -> None:
        assert torch.equal(greedy_argmax_ref(logits, INVALID_TOKEN_ID), expected_ids(logits))


def token_write_case(
    gen: torch.Generator, n: int, v: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, token buffer, rows, cols) of a padded decode batch: distinct rows in a shuffled order, the last two
    requests a bucket's padding (row 0, column 0), row 3's logits holding a NaN (an invalid id, written as 0); the
    buffer filled with POISON so that every write shows."""
    logits = make_logits(gen, n, v, dtype).to(device)
    logits[min(3, n - 1), v // 2] = NAN
    tokens = torch.full((n + 3, 64), POISON, dtype=torch.int64, device=device)
    rows = torch.randperm(n + 3, generator=gen)[:n].to(device)
    cols = torch.randint(1, 64, (n,), generator=gen, dtype=torch.int32).to(device)
    if n > 2:
        rows[-2:], cols[-2:] = 0, 0
    return logits, tokens, rows, cols


def test_token_write_reference_is_write_sampled_tokens() -> None:
    """The reference writes what greedy sampling then `InputBatch.write_sampled_tokens(padded=True)` wrote."""
    logits, tokens, rows, cols = token_write_case(torch.Generator().manual_seed(20), 9, 300, torch.bfloat16)
    expected_tokens = tokens.clone()
    sampled = greedy_argmax_ref(logits, INVALID_TOKEN_ID)
    values = torch.where(cols > 0, sampled.clamp_min(0), expected_tokens[rows, cols.long()])
    expected_tokens[rows, cols.long()] = values
    got = greedy_argmax_into_tokens_ref(logits, INVALID_TOKEN_ID, tokens, rows, cols)
    assert torch.equal(got, sampled) and torch.equal(tokens, expected_tokens)
    assert sampled[3] == INVALID_TOKEN_ID and tokens[rows[3], cols[3]] == 0
    assert tokens[0, 0] == POISON  # the padding requests wrote nothing


# -------------------------------------------------------------------------------------------- triton

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from asyncspec.kernels import greedy_argmax_triton  # noqa: E402  (after the triton import guard)
from asyncspec.kernels.greedy_argmax_triton import (  # noqa: E402
    choose_block,
    greedy_argmax,
    greedy_argmax_into_tokens,
    greedy_argmax_supported,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)
MIN_INTERPRETED_TESTS = 30
POISON = 777  # an output row the kernel did not write keeps it


@pytest.fixture(scope="class")
def kernel():
    """greedy_argmax, checked to be running in the interpreter (not silently compiled)."""
    assert isinstance(greedy_argmax_triton._chunk_max_kernel, InterpretedFunction)
    assert isinstance(greedy_argmax_triton._combine_kernel, InterpretedFunction)
    return greedy_argmax


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, MIN_INTERPRETED_TESTS, (BACKEND_ENV,))


def test_cpu_tensors_need_the_interpreter() -> None:
    logits = torch.zeros(2, 10)
    assert greedy_argmax_supported(logits) == INTERPRETING
    if not INTERPRETING:
        with pytest.raises(ValueError, match="CUDA"):
            greedy_argmax(logits, INVALID_TOKEN_ID)


def test_choose_block() -> None:
    """A whole row per program up to 8192 columns (one launch), 4096-column chunks above."""
    assert [choose_block(v) for v in (1, 7, 100, 5000, 8192)] == [32, 32, 128, 8192, 8192]
    assert choose_block(8193) == choose_block(128256) == 4096
    assert triton.cdiv(128256, choose_block(128256)) == 32


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize(
        "n,v,block",
        [
            (1, 1, None),
            (1, 300, 32),  # every case alone in a row of 10 chunks (the last ragged)
            (37, 7, None),  # V < BLOCK: one program per row, one launch
            (37, 130, 32),  # 5 chunks, the last of 2 columns
            (5, 8192, None),  # the largest one-chunk row
            (3, 8193, None),  # chunks of 4096, 4096 and 1 column
        ],
    )
    def test_matches_reference(self, kernel, n: int, v: int, block: int | None, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(n * 10000 + v)
        for offset in range(NUM_CASES if n == 1 else 1):
            logits = make_logits(gen, n, v, dtype, offset)
            out = torch.full((n,), POISON, dtype=torch.int64)
            assert kernel(logits, INVALID_TOKEN_ID, out=out, block=block) is out
            assert torch.equal(out, greedy_argmax_ref(logits, INVALID_TOKEN_ID)), offset

    def test_strided_rows_and_out(self, kernel) -> None:
        """Rows padded with NaN (a read past V would make them invalid), a strided out, a column-major input."""
        logits = make_logits(torch.Generator().manual_seed(3), NUM_CASES, 100, torch.bfloat16)
        expected = greedy_argmax_ref(logits, INVALID_TOKEN_ID)
        wide = torch.full((NUM_CASES, 107), NAN, dtype=torch.bfloat16)
        wide[:, :100] = logits
        for block in (None, 16, 32):
            buffer = torch.full((2 * NUM_CASES,), POISON, dtype=torch.int64)
            kernel(wide[:, :100], INVALID_TOKEN_ID, out=buffer[::2], block=block)
            assert torch.equal(buffer[::2], expected) and (buffer[1::2] == POISON).all()
            assert torch.equal(kernel(logits.t().contiguous().t(), INVALID_TOKEN_ID, block=block), expected)
        one_row = wide[5:6, :100]
        assert torch.equal(kernel(one_row, INVALID_TOKEN_ID, block=16), expected[5:6])

    def test_combine_walks_many_tiles(self, kernel, monkeypatch) -> None:
        """19 chunks read 4 at a time (a ragged last tile): equal maxima in a later tile never win."""
        monkeypatch.setattr(greedy_argmax_triton, "_MAX_CHUNK_TILE", 4)
        gen = torch.Generator().manual_seed(4)
        logits = make_logits(gen, NUM_CASES, 300, torch.float32)
        logits[0, [20, 100, 290]] = 50.0  # chunks 1, 6 and 18: tiles 0, 1 and 4
        logits[1, [100, 290]] = 50.0  # tiles 1 and 4
        logits[2, [65, 79]] = 50.0  # one chunk
        logits[3, 299] = NAN  # the last column of the ragged last tile
        expected = greedy_argmax_ref(logits, INVALID_TOKEN_ID)
        assert expected[:4].tolist() == [20, 100, 65, INVALID_TOKEN_ID]
        assert torch.equal(kernel(logits, INVALID_TOKEN_ID, block=16), expected)

    def test_invalid_id_and_empty_batch(self, kernel) -> None:
        logits = make_logits(torch.Generator().manual_seed(5), NUM_CASES, 50, torch.float16)
        for invalid_id, block in [(0, None), (50, 16), (2**40, None), (-(2**40), 16)]:
            assert torch.equal(kernel(logits, invalid_id, block=block), greedy_argmax_ref(logits, invalid_id))
        out = torch.empty(0, dtype=torch.int64)
        assert kernel(torch.zeros(0, 50), INVALID_TOKEN_ID, out=out) is out

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("n,v,block", [(1, 100, None), (7, 300, None), (7, 300, 32), (5, 8193, None)])
    def test_into_tokens_matches_reference(self, kernel, n: int, v: int, block: int | None, dtype) -> None:
        """The argmax and the token write in the argmax's launches (one chunk, or the combine), int32 and int64
        columns: bit for bit the reference's result and buffer."""
        for cols_dtype in (torch.int32, torch.int64):
            logits, tokens, rows, cols = token_write_case(torch.Generator().manual_seed(n + v), n, v, dtype)
            cols = cols.to(cols_dtype)
            expected_tokens = tokens.clone()
            expected = greedy_argmax_into_tokens_ref(logits, INVALID_TOKEN_ID, expected_tokens, rows, cols)
            out = torch.full((n,), POISON, dtype=torch.int64)
            got = greedy_argmax_into_tokens(logits, INVALID_TOKEN_ID, tokens, rows, cols, out=out, block=block)
            assert got is out and torch.equal(out, expected) and torch.equal(tokens, expected_tokens)
            assert (tokens != POISON).sum() == (cols > 0).sum()  # one write per real request, none for padding

    def test_into_tokens_rejects_with_value_error(self, kernel) -> None:
        logits, tokens, rows, cols = token_write_case(torch.Generator().manual_seed(21), 4, 50, torch.float32)
        before = tokens.clone()
        bad = [
            ("token_ids must be an int64", (tokens.int(), rows, cols)),
            ("token_ids must be an int64", (tokens.t(), rows, cols)),
            ("rows must be an int32 or int64 \\[4\\]", (tokens, rows[:3], cols)),
            ("cols must be an int32 or int64", (tokens, rows, cols.float())),
        ]
        for match, args in bad:
            with pytest.raises(ValueError, match=match):
                greedy_argmax_into_tokens(logits, INVALID_TOKEN_ID, *args)
        assert torch.equal(tokens, before)  # a refused call writes nothing

    def test_rejects_with_value_error(self, kernel) -> None:
        x = torch.zeros(3, 40)
        refused = [
            ("2-D", x[0]),
            ("2-D", x[None]),
            ("float32, bfloat16 or float16", x.double()),
            ("float32, bfloat16 or float16", x.to(torch.int32)),
            ("empty vocabulary", x[:, :0]),
        ]
        for match, logits in refused:
            assert not greedy_argmax_supported(logits)
            with pytest.raises(ValueError, match=match):
                kernel(logits, INVALID_TOKEN_ID)
        for out in (torch.empty(4, dtype=torch.int64), torch.empty(3, dtype=torch.int32)):
            with pytest.raises(ValueError, match="out must be"):
                kernel(x, INVALID_TOKEN_ID, out=out)
        for block in (3, 8, 1 << 15):
            with pytest.raises(ValueError, match="block"):
                kernel(x, INVALID_TOKEN_ID, block=block)

    def test_greedy_sample_takes_the_kernel_with_the_triton_backend(self, kernel, monkeypatch) -> None:
        calls = []
        monkeypatch.setattr(greedy_argmax_triton, "greedy_argmax", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
        logits = make_logits(torch.Generator().manual_seed(6), 13, 300, torch.bfloat16)
        expected = greedy_argmax_ref(logits, INVALID_TOKEN_ID)
        monkeypatch.setenv(BACKEND_ENV, "triton")
        assert torch.equal(greedy_sample(logits), expected) and len(calls) == 1
        # Inputs the kernel does not take keep the reference: 1-D, float64.
        assert torch.equal(greedy_sample(logits[3]), expected[3])
        assert torch.equal(greedy_sample(logits.double()), expected) and len(calls) == 1
        monkeypatch.setenv(BACKEND_ENV, "torch")
        assert torch.equal(greedy_sample(logits), expected) and len(calls) == 1

    if given is not None:

        @settings(max_examples=40, deadline=None, derandomize=True)
        @given(logits=few_valued_logits(), block=st.sampled_from([None, 16, 32]))
        def test_fuzz(self, kernel, logits: torch.Tensor, block: int | None) -> None:
            assert torch.equal(kernel(logits, INVALID_TOKEN_ID, block=block), expected_ids(logits))


# ------------------------------------------------------------------------------------------------ gpu

GPU_SHAPES = [(1, 128256), (64, 128256), (4, 8192), (7, 151936), (3, 32000)]


def planted_ties(gen: torch.Generator, n: int, v: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows (bf16 rounding makes natural ties too) with the maximum planted 2-4 times per row, in one chunk
    or across chunks, plus the special rows of `make_logits` at the end."""
    x = torch.randn(n, v, generator=gen) * 4
    for r in range(n):
        planted = torch.randint(0, v, (int(torch.randint(2, 5, (), generator=gen)),), generator=gen)
        if r % 3 == 0:  # same 4096-column chunk
            planted = planted % 64 + (int(planted[0]) // 4096) * 4096
        x[r, planted.clamp(max=v - 1)] = 20.0
    x = x.to(dtype)
    special = min(n, NUM_CASES) // 2
    if special:
        x[-special:] = make_logits(gen, special, v, dtype, offset=2)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v", GPU_SHAPES)
def test_gpu_matches_reference(n: int, v: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n + v)
    for logits in (
        (torch.randn(n, v, generator=gen) * 3).to(dtype),
        planted_ties(gen, n, v, dtype),
        make_logits(gen, n, v, dtype, offset=n),
    ):
        expected = greedy_argmax_ref(logits, INVALID_TOKEN_ID)  # torch's CPU max
        logits = logits.cuda()
        assert torch.equal(greedy_argmax_ref(logits, INVALID_TOKEN_ID).cpu(), expected)  # torch's CUDA max
        out = torch.full((n,), POISON, dtype=torch.int64, device="cuda")
        assert greedy_argmax(logits, INVALID_TOKEN_ID, out=out) is out
        assert torch.equal(out.cpu(), expected)
        for block in (1024, 8192):
            assert torch.equal(greedy_argmax(logits, INVALID_TOKEN_ID, block=block).cpu(), expected)


@pytest.mark.gpu
def test_gpu_fp16_strided_and_deterministic() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = planted_ties(gen, 16, 128256, torch.float16)
    expected = greedy_argmax_ref(logits, INVALID_TOKEN_ID)
    wide = torch.full((16, 128256 + 64), NAN, dtype=torch.float16, device="cuda")
    wide[:, :128256] = logits.cuda()
    view = wide[:, :128256]
    first = greedy_argmax(view, INVALID_TOKEN_ID)
    assert torch.equal(first.cpu(), expected)
    for _ in range(20):
        assert torch.equal(greedy_argmax(view, INVALID_TOKEN_ID), first)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_gpu_no_sync_and_graph_capture(pdl: str, monkeypatch) -> None:
    """No host sync; captured once in a CUDA graph (workspace included), replays on new logits written into the
    static input give the new argmaxes, through greedy_argmax and through greedy_sample; with and without
    programmatic dependent launch between the two stages."""
    from asyncspec.kernels.pdl import PDL_ENV

    monkeypatch.setenv(PDL_ENV, pdl)
    gen = torch.Generator().manual_seed(8)
    for n, v in [(8, 128256), (4, 8192)]:
        static = torch.empty(n, v, device="cuda")
        out = torch.empty(n, dtype=torch.int64, device="cuda")
        static.copy_(planted_ties(gen, n, v, torch.float32))
        greedy_argmax(static, INVALID_TOKEN_ID, out=out)  # compile outside the checks
        greedy_sample(static)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            greedy_argmax(static, INVALID_TOKEN_ID, out=out)
            greedy_sample(static)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            greedy_argmax(static, INVALID_TOKEN_ID, out=out)
            sampled = greedy_sample(static)
        for round_ in range(4):
            fresh = planted_ties(gen, n, v, torch.float32) if round_ % 2 else make_logits(gen, n, v, torch.float32, 3)
            static.copy_(fresh)
            out.fill_(POISON)
            graph.replay()
            torch.cuda.synchronize()
            expected = greedy_argmax_ref(fresh, INVALID_TOKEN_ID)
            assert torch.equal(out.cpu(), expected) and torch.equal(sampled.cpu(), expected), (n, v, round_)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [8192, 128256])
def test_gpu_into_tokens_in_a_graph(v: int) -> None:
    """The decode tail's argmax with its token write, compiled (one launch at 8192 columns, two at 128256): equal to
    the reference eagerly and replayed from a CUDA graph on new logits and columns, with no host sync."""
    from asyncspec.layers.sampler import greedy_sample_into_tokens

    gen = torch.Generator().manual_seed(v)
    logits, tokens, rows, cols = token_write_case(gen, 12, v, torch.bfloat16, "cuda")
    start = tokens.clone()
    expected_tokens = tokens.clone()
    expected = greedy_argmax_into_tokens_ref(logits, INVALID_TOKEN_ID, expected_tokens, rows, cols)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = greedy_sample_into_tokens(logits, tokens, rows, cols)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, expected) and torch.equal(tokens, expected_tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sampled = greedy_sample_into_tokens(logits, tokens, rows, cols)
    for _ in range(3):
        fresh, _, _, fresh_cols = token_write_case(gen, 12, v, torch.bfloat16, "cuda")
        logits.copy_(fresh)
        cols.copy_(fresh_cols)
        tokens.copy_(start)
        expected_tokens = start.clone()
        expected = greedy_argmax_into_tokens_ref(fresh, INVALID_TOKEN_ID, expected_tokens, rows, cols)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(sampled, expected) and torch.equal(tokens, expected_tokens)


@pytest.mark.gpu
def test_gpu_greedy_sample_takes_the_kernel(monkeypatch) -> None:
    calls = []
    kernel = greedy_argmax_triton.greedy_argmax
    monkeypatch.setattr(greedy_argmax_triton, "greedy_argmax", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    logits = planted_ties(torch.Generator().manual_seed(9), 5, 128256, torch.bfloat16)
    expected = greedy_argmax_ref(logits, INVALID_TOKEN_ID)
    assert torch.equal(greedy_sample(logits.cuda()).cpu(), expected) and len(calls) == 1
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert torch.equal(greedy_sample(logits.cuda()).cpu(), expected) and len(calls) == 1
