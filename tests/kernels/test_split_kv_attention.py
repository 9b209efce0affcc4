"""Split-KV ("flash-decoding") path of the Triton paged attention against `paged_attention_ref`.

Same layout as test_triton_kernels.py (whose docstring explains why): `TestInterpreted` runs under
TRITON_INTERPRET=1, in a child pytest unless this process already interprets; the `gpu` tests run compiled
on CUDA. `choose_num_splits` is a pure function of shapes and is tested directly in this process.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping

import pytest
import torch

from asyncspec.kernels.paged_attention import paged_attention_ref

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from asyncspec.kernels.paged_attention_triton import _find_request, choose_num_splits  # noqa: E402
from asyncspec.kernels.pdl import pdl_start  # noqa: E402
from tests.kernels.test_triton_kernels import Batch, fill_cache, make_batch  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)

# Decodes (q = 1) with short and long contexts mixed: one key, less than a BLOCK_N tile, several tiles.
DECODE = [(1, 1), (17, 1), (300, 1), (1000, 1)]
# Speculative verification: k + 1 = 5 query tokens per request.
VERIFY = [(5, 5), (40, 5), (300, 5), (700, 5)]
# Prefill chunks after a context (first query tile straddling it), beside decodes and a whole prompt.
MIXED = [(300, 40), (1000, 1), (64, 64), (130, 3), (20, 20)]
# Zero-length requests (as the CUDA-graph runner pads with) interleaved with real ones.
WITH_IDLE = [(20, 0), (300, 1), (0, 0), (150, 5), (7, 0), (64, 1)]


@pytest.fixture(scope="class")
def attention() -> Callable[..., torch.Tensor]:
    """`paged_attention`, checked to be running in the interpreter (not silently compiled)."""
    from asyncspec.kernels import paged_attention_triton as mod

    for kernel in (mod._paged_attention_kernel, mod._paged_attention_split_kernel, mod._combine_splits_kernel):
        assert isinstance(kernel, InterpretedFunction), "kernels are not interpreted"
    return mod.paged_attention


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, 53)


def check_split(
    paged_attention: Callable[..., torch.Tensor],
    batch: Batch,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gen: torch.Generator,
    num_heads: int,
    window: int | None,
    num_splits: int | None,
    atol: float,
    check_fresh_out: bool = False,
) -> None:
    """Kernel vs reference with `out` pre-filled with NaN: every real row close, every padded row exactly 0.
    `check_fresh_out` also runs with out=None (a fresh, NaN-poisoned buffer under `nan_scratch`)."""
    num_tokens, d, dtype = batch.num_tokens, k_cache.shape[3], k_cache.dtype
    query = torch.randn(num_tokens + batch.num_pad, num_heads, d, generator=gen).to(k_cache.device, dtype)
    args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 1 / math.sqrt(d))
    expected = paged_attention_ref(*args, sliding_window=window)
    out = torch.full_like(query, float("nan"))  # any row the kernels forget stays NaN and fails
    got = paged_attention(*args, out=out, sliding_window=window, num_splits=num_splits)
    assert got is out and got.dtype == dtype
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), rtol=atol, atol=atol)
    assert (got[num_tokens:] == 0).all(), "padded rows must be zeroed"
    if check_fresh_out:
        fresh = paged_attention(*args, sliding_window=window, num_splits=num_splits)
        assert torch.equal(fresh, got)


def _atol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 2e-5


class _Launches:
    """Stands in for a kernel: counts its launches, and refuses them unless `allow`."""

    def __init__(self, kernel, allow: bool) -> None:
        self.kernel, self.allow, self.count = kernel, allow, 0

    def __getitem__(self, grid):
        assert self.allow, "the combine kernel was launched"
        self.count += 1
        return self.kernel[grid]


# ------------------------------------------------------------------------------------ the heuristic


def test_choose_num_splits_small_decode_batch_splits() -> None:
    # Batch 1, 8 KV heads: 8 programs on 132 SMs; a 4096-key capacity allows 16 splits of >= 256 keys.
    assert choose_num_splits(1, 1, 8, 16, 4096, 132) == 16
    assert choose_num_splits(4, 20, 8, 2, 8192, 132) > 1  # speculative verify, q = 5, GQA 8
    assert choose_num_splits(1, 1, 1, 16, 1 << 20, 132) == 32  # capped


def test_choose_num_splits_two_for_a_grid_of_one_to_two_waves() -> None:
    # 32 decodes x 8 KV heads = 256 programs on 132 SMs: measured 24 % faster with two splits at long contexts.
    assert choose_num_splits(32, 32, 8, 4, 2048, 132) == 2
    assert choose_num_splits(16, 16, 8, 4, 2048, 132) == 2  # 128 programs: two by the wave count already
    assert choose_num_splits(40, 40, 8, 4, 2048, 132) == 1  # past two waves
    assert choose_num_splits(32, 32, 8, 4, 256, 132) == 1  # context capacity too short to split


def test_choose_num_splits_keeps_single_pass() -> None:
    assert choose_num_splits(256, 256, 8, 16, 8192, 132) == 1  # the grid already fills the SMs
    assert choose_num_splits(1, 1, 8, 16, 256, 132) == 1  # context capacity too short to split
    assert choose_num_splits(2, 2 * 17, 8, 16, 8192, 132) == 1  # prefill-heavy: average query > 16
    assert choose_num_splits(0, 4, 8, 16, 8192, 132) == 1  # padding only
    assert choose_num_splits(4, 0, 8, 16, 8192, 132) == 1


def test_large_decode_batches_take_long_key_steps() -> None:
    """From 32 requests a short tile (decodes, verifications) of heads at most 64 wide walks 128 keys a step;
    fewer requests, wider heads and taller tiles keep 64."""
    from asyncspec.kernels.paged_attention_triton import _tile_sizes

    assert _tile_sizes(64, 64, 3, 64, 2) == (16, 128, 4, 2)
    assert _tile_sizes(128 * 5, 128, 4, 64, 2).block_n == 128  # k = 4 verifications
    assert _tile_sizes(32, 32, 4, 64, 2).block_n == 128  # from 32 requests (the 1B's 32-stream decodes)
    assert _tile_sizes(31, 31, 3, 64, 2).block_n == 64
    assert _tile_sizes(64, 64, 4, 128, 2).block_n == 64
    assert _tile_sizes(64 * 20, 64, 4, 64, 2) == (64, 64, 4, 2)  # medium tile
    assert _tile_sizes(64, 64, 32, 64, 4).block_m == 32  # a group of 32 rows: not the short tile


@pytest.mark.parametrize("num_splits", [0, 33])
def test_forced_num_splits_outside_the_combines_range_is_refused(num_splits: int) -> None:
    from asyncspec.kernels.paged_attention_triton import paged_attention

    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, DECODE, 16, num_pad=0)
    k_cache, v_cache = fill_cache(gen, batch, 16, 1, 64, torch.float32)
    query = torch.randn(batch.num_tokens, 4, 64, generator=gen)
    args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125)
    with pytest.raises(ValueError, match=r"num_splits must be in \[1, 32\]"):
        paged_attention(*args, num_splits=num_splits)


def test_choose_num_splits_scales_with_sms_and_grid() -> None:
    counts = [choose_num_splits(r, r, 8, 16, 1 << 16, 132) for r in (1, 2, 4, 8, 16, 32, 64)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1] == 1
    assert choose_num_splits(4, 4, 8, 16, 1 << 16, 264) >= choose_num_splits(4, 4, 8, 16, 1 << 16, 132)


# --------------------------------------------------------------------------------------- interpreter


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.fixture(autouse=True)
    def nan_scratch(self, monkeypatch) -> None:
        """Fresh float buffers (the split scratch, `out` when not passed) start as NaN, not the allocator's
        usual zeros, so a partial the split kernel forgets to write, or a row nobody writes, fails."""
        empty, empty_like = torch.empty, torch.empty_like

        def poison(t: torch.Tensor) -> torch.Tensor:
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
        monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))

    @pytest.mark.parametrize("num_splits", [1, 2, 7, 11, 16, 32])
    def test_decode_forced_splits(self, attention, num_splits: int) -> None:
        gen = torch.Generator().manual_seed(num_splits)
        batch = make_batch(gen, DECODE, 16, num_pad=3)
        k_cache, v_cache = fill_cache(gen, batch, 16, 1, 64, torch.float32)
        check_split(attention, batch, k_cache, v_cache, gen, 4, None, num_splits, 2e-5)

    @pytest.mark.parametrize(
        "specs,block_size,heads,d,dtype,num_splits",
        [
            (DECODE, 16, (8, 1), 80, torch.bfloat16, 7),  # GQA 8, head_dim not a power of two
            (DECODE, 32, (2, 2), 96, torch.float32, 3),  # GQA 1
            (VERIFY, 16, (4, 1), 64, torch.float32, 5),  # GQA 4: tiles of 4 queries, 2 tiles per request
            (VERIFY, 1, (8, 1), 64, torch.bfloat16, 9),  # GQA 8: tiles of 2 queries, one key per block
            (VERIFY, 16, (2, 2), 128, torch.float32, 2),
        ],
    )
    def test_shapes(self, attention, specs, block_size, heads, d, dtype, num_splits) -> None:
        gen = torch.Generator().manual_seed(block_size + d + num_splits)
        batch = make_batch(gen, specs, block_size, num_pad=2)
        k_cache, v_cache = fill_cache(gen, batch, block_size, heads[1], d, dtype)
        check_split(attention, batch, k_cache, v_cache, gen, heads[0], None, num_splits, _atol(dtype))

    @pytest.mark.parametrize("window,specs", [(1, VERIFY), (33, DECODE), (200, VERIFY), (5000, DECODE)])
    def test_sliding_window(self, attention, window: int, specs) -> None:
        # Splits cover only the window's keys; with window 1 most splits of a tile are empty.
        gen = torch.Generator().manual_seed(window)
        batch = make_batch(gen, specs, 16, num_pad=1)
        k_cache, v_cache = fill_cache(gen, batch, 16, 1, 64, torch.float32)
        check_split(attention, batch, k_cache, v_cache, gen, 4, window, 6, 2e-5)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_zero_length_requests_and_padding_tail(self, attention, dtype) -> None:
        gen = torch.Generator().manual_seed(5)
        batch = make_batch(gen, WITH_IDLE, 16, num_pad=7)
        k_cache, v_cache = fill_cache(gen, batch, 16, 2, 64, dtype)
        fresh = dtype == torch.float32
        check_split(attention, batch, k_cache, v_cache, gen, 4, None, 4, _atol(dtype), check_fresh_out=fresh)

    def test_only_padding(self, attention) -> None:
        """A graph-padded batch of idle requests: every row is padding and comes out zero."""
        gen = torch.Generator().manual_seed(6)
        batch = make_batch(gen, [(9, 0), (0, 0), (40, 0)], 16, num_pad=5)
        k_cache, v_cache = fill_cache(gen, batch, 16, 1, 64, torch.float32)
        check_split(attention, batch, k_cache, v_cache, gen, 2, None, 8, 2e-5, check_fresh_out=True)

    def test_nan_poisoned_cache(self, attention) -> None:
        """Unwritten slots (block tails, spare blocks, block-table padding) are NaN; none may leak.
        seq_lens one past / one short of BLOCK_N and block boundaries put masked keys in every split."""
        gen = torch.Generator().manual_seed(7)
        batch = make_batch(gen, [(63, 1), (65, 1), (129, 5), (31, 1)], 32, num_pad=2)
        k_cache, v_cache = fill_cache(gen, batch, 32, 2, 64, torch.float32)
        written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
        for b, s in enumerate(batch.seq_lens.tolist()):
            pos = torch.arange(s)
            written[batch.block_tables[b, pos // 32].long(), pos % 32] = True
        assert k_cache[~written].isnan().all() and (~written).sum() > 0
        check_split(attention, batch, k_cache, v_cache, gen, 2, None, 3, 2e-5)

    @pytest.mark.parametrize(
        "specs,heads,d,dtype,num_splits,window,num_pad",
        [
            (DECODE, (4, 1), 64, torch.float32, 2, None, 3),
            (DECODE, (8, 1), 80, torch.bfloat16, 32, None, 2),  # most splits of a tile empty
            (VERIFY, (4, 1), 64, torch.float32, 5, 200, 2),  # two query tiles a request, a window
            (WITH_IDLE, (4, 2), 64, torch.float32, 4, None, 7),  # idle requests, a long padding tail
            ([(9, 0), (0, 0), (40, 0)], (2, 1), 64, torch.float32, 8, None, 5),  # padding only
        ],
    )
    def test_fused_combine(self, attention, monkeypatch, specs, heads, d, dtype, num_splits, window, num_pad) -> None:
        """Splits merged in the split pass by the last program of each tile and KV head: every real row matches
        the reference and every padded row is zero, no combine kernel launches, and every counter is back at
        zero for the next call (a second call gives the same result)."""
        from asyncspec.kernels import paged_attention_triton as mod

        gen = torch.Generator().manual_seed(num_splits + num_pad)
        batch = make_batch(gen, specs, 16, num_pad=num_pad)
        k_cache, v_cache = fill_cache(gen, batch, 16, heads[1], d, dtype)
        counters = mod.make_combine_counters("cpu")
        monkeypatch.setattr(mod, "_combine_splits_kernel", _Launches(mod._combine_splits_kernel, allow=False))
        fused = functools.partial(attention, counters=counters)
        check_split(fused, batch, k_cache, v_cache, gen, heads[0], window, num_splits, _atol(dtype), True)
        assert not counters.any()

    def test_too_few_counters_take_the_combine_kernel(self, attention, monkeypatch) -> None:
        from asyncspec.kernels import paged_attention_triton as mod

        gen = torch.Generator().manual_seed(9)
        batch = make_batch(gen, DECODE, 16, num_pad=2)
        k_cache, v_cache = fill_cache(gen, batch, 16, 2, 64, torch.float32)
        combine = _Launches(mod._combine_splits_kernel, allow=True)
        monkeypatch.setattr(mod, "_combine_splits_kernel", combine)
        counters = torch.zeros(3, dtype=torch.int32)  # fewer than (tiles x KV heads)
        check_split(functools.partial(attention, counters=counters), batch, k_cache, v_cache, gen, 4, None, 3, 2e-5)
        assert combine.count == 1 and not counters.any()

    @pytest.mark.parametrize("num_splits", [1, 2])
    def test_counters_of_another_dtype_are_refused(self, attention, num_splits: int) -> None:
        gen = torch.Generator().manual_seed(10)
        batch = make_batch(gen, DECODE, 16, num_pad=0)
        k_cache, v_cache = fill_cache(gen, batch, 16, 1, 64, torch.float32)
        query = torch.randn(batch.num_tokens, 4, 64, generator=gen)
        args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125)
        with pytest.raises(ValueError, match="counters must be int32"):
            attention(*args, num_splits=num_splits, counters=torch.zeros(64, dtype=torch.int64))

    def test_automatic_choice_splits(self, attention, monkeypatch) -> None:
        """With num_splits=None the heuristic picks > 1 split for a small decode batch, the result matches,
        and the choice depends on shapes only: other seq_lens / query_start_loc contents, same shapes, same
        choice (what a CUDA-graph replay relies on)."""
        from asyncspec.kernels import paged_attention_triton as mod

        chosen: list[int] = []

        def spy(*args: int) -> int:
            chosen.append(choose_num_splits(*args))
            return chosen[-1]

        monkeypatch.setattr(mod, "choose_num_splits", spy)
        gen = torch.Generator().manual_seed(8)
        for specs in ([(1000, 1), (300, 1)], [(2, 1), (700, 1)], [(513, 0), (40, 2)]):
            # Pad the block tables to a common width, as a graph runner's static buffers are.
            batch = make_batch(gen, specs, 16, num_pad=1)
            width = 70
            batch.block_tables = torch.nn.functional.pad(batch.block_tables, (0, width - batch.block_tables.shape[1]))
            k_cache, v_cache = fill_cache(gen, batch, 16, 2, 64, torch.float32)
            check_split(attention, batch, k_cache, v_cache, gen, 4, None, None, 2e-5)
        assert len(set(chosen)) == 1 and chosen[0] > 1, chosen
        # A prefill-heavy batch keeps the single pass.
        batch = make_batch(gen, [(90, 90)], 16, num_pad=0)
        k_cache, v_cache = fill_cache(gen, batch, 16, 1, 64, torch.float32)
        check_split(attention, batch, k_cache, v_cache, gen, 2, None, None, 2e-5)
        assert chosen[-1] == 1

    @pytest.mark.parametrize(
        "specs,heads,d,dtype,num_splits,window",
        [
            (DECODE, (4, 1), 64, torch.float32, 1, None),
            (DECODE, (8, 1), 80, torch.bfloat16, 7, None),
            (VERIFY, (4, 1), 64, torch.float32, 2, 200),  # two query tiles a request, a window
            (MIXED, (4, 2), 64, torch.float32, 1, None),  # prefill chunks whose first tile straddles the context
            (MIXED, (2, 2), 64, torch.bfloat16, 3, 40),  # a window past the context for the chunk's later tiles
            (WITH_IDLE, (4, 2), 64, torch.float32, 4, None),
            ([(9, 0), (0, 0), (40, 0)], (2, 1), 64, torch.float32, 8, None),  # padding only
        ],
    )
    def test_early_kv_matches_the_default_bit_for_bit(
        self, attention, monkeypatch, specs, heads, d, dtype, num_splits, window
    ) -> None:
        """early_kv loads the first tile in two parts (below the context before the PDL wait, the rest after): the
        same numbers as the default, bit for bit, and the reference's."""
        gen = torch.Generator().manual_seed(num_splits * 3 + d)
        batch = make_batch(gen, specs, 16, num_pad=3)
        k_cache, v_cache = fill_cache(gen, batch, 16, heads[1], d, dtype)
        query = torch.randn(batch.num_tokens + 3, heads[0], d, generator=gen).to(dtype)
        args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, d**-0.5)
        shipped = attention(*args, sliding_window=window, num_splits=num_splits)
        assert torch.equal(attention(*args, sliding_window=window, num_splits=num_splits, early_kv=True), shipped)
        early = functools.partial(attention, early_kv=True)
        check_split(early, batch, k_cache, v_cache, gen, heads[0], window, num_splits, _atol(dtype))

    @pytest.mark.parametrize("num_splits", [1, 6])
    def test_early_kv_only_for_grids_of_at_most_two_programs_an_sm(self, attention, monkeypatch, num_splits) -> None:
        """The early tile's registers let two programs share an SM: a larger grid keeps the default kernel."""
        from asyncspec.kernels import paged_attention_triton as mod

        gen = torch.Generator().manual_seed(40 + num_splits)
        batch = make_batch(gen, DECODE, 16, num_pad=1)
        k_cache, v_cache = fill_cache(gen, batch, 16, 2, 64, torch.float32)
        query = torch.randn(batch.num_tokens + 1, 4, 64, generator=gen)
        args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125)
        taken: list[tuple[int, bool]] = []
        for name in ("_paged_attention_kernel", "_paged_attention_split_kernel"):
            kernel = getattr(mod, name)

            class Spy:
                def __getitem__(self, grid, kernel=kernel):
                    launcher = kernel[grid]

                    def launch(*a, **k):
                        taken.append((math.prod(grid), k["EARLY_KV"]))
                        return launcher(*a, **k)

                    return launch

            monkeypatch.setattr(mod, name, Spy())
        attention(*args, num_splits=num_splits)
        programs = taken[-1][0]
        for sms, early in ((-(-programs // 2), True), (-(-programs // 2) - 1, False)):
            monkeypatch.setattr(mod, "_num_sms", lambda device, sms=sms: sms)
            got = attention(*args, num_splits=num_splits, early_kv=True)
            assert taken[-1] == (programs, early)
            torch.testing.assert_close(got, paged_attention_ref(*args), rtol=2e-5, atol=2e-5)

    @pytest.mark.parametrize(
        "specs,num_splits", [(DECODE, 1), (DECODE, 5), (VERIFY, 3), (MIXED, 1), (MIXED, 2), (WITH_IDLE, 4)]
    )
    def test_early_kv_reads_the_step_s_new_keys_only_after_the_wait(
        self, attention, monkeypatch, specs, num_splits: int
    ) -> None:
        """What a predecessor writes this step, q and the new tokens' K/V (positions >= seq_len - q_len), is NaN
        until each program's PDL wait and real from then on: the interpreter runs the programs one after another,
        each first poisons them (when it looks up its request) and its `pdl_start` publishes them. A program that
        read one before its wait would carry the NaN into its output. No program may store to `out` before its wait,
        and every program waits (the padding tail's and the empty tiles' too)."""
        from asyncspec.kernels import paged_attention_triton as mod

        gen = torch.Generator().manual_seed(20 + num_splits)
        batch = make_batch(gen, specs, 16, num_pad=2)
        k_cache, v_cache = fill_cache(gen, batch, 16, 2, 64, torch.float32)
        query = torch.randn(batch.num_tokens + 2, 4, 64, generator=gen)
        args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125)
        expected = paged_attention_ref(*args)
        new_slots = []
        for b, (s, q) in enumerate(zip(batch.seq_lens.tolist(), batch.q_lens, strict=True)):
            pos = torch.arange(s - q, s)
            new_slots.append(batch.block_tables[b, pos // 16].long() * 16 + pos % 16)
        slots = torch.cat(new_slots)
        assert slots.numel() > 0
        k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
        written = (k_flat[slots].clone(), v_flat[slots].clone(), query.clone())
        out = torch.full_like(query, 1234.5)
        find_request = mod._find_request
        events: list[str] = []
        out_at_lookup: list[torch.Tensor] = []

        def poisoning_find_request(*lookup_args):
            events.append("find")
            out_at_lookup.append(out.clone())
            k_flat[slots] = float("nan")
            v_flat[slots] = float("nan")
            query.fill_(float("nan"))
            return find_request(*lookup_args)

        def publishing_pdl_start(use_pdl) -> None:
            if events and events[-1] == "find":  # an attention program (the combine kernel looks nothing up)
                assert torch.equal(out, out_at_lookup[-1]), "a store before the PDL wait"
            events.append("wait")
            k_flat[slots], v_flat[slots] = written[0], written[1]
            query.copy_(written[2])

        monkeypatch.setattr(mod, "_find_request", poisoning_find_request)
        monkeypatch.setattr(mod, "pdl_start", publishing_pdl_start)
        got = attention(*args, out=out, num_splits=num_splits, early_kv=True)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
        assert (got[batch.num_tokens :] == 0).all()
        # Every attention program looked its request up, then waited; the combine kernel's waits come last.
        attention_events = events[: len(events) - events[::-1].index("find") + 1]
        assert attention_events == ["find", "wait"] * events.count("find"), "a program returned without its wait"

    # BLOCK_Q 1 and 4 (decodes of GQA 16 and 4), idle requests among them as graph padding adds.
    @pytest.mark.parametrize("num_reqs", [1, 5, 127, 128, 300])
    @pytest.mark.parametrize("block_q", [1, 4])
    def test_find_request_returns_the_tile_s_owner(self, num_reqs: int, block_q: int) -> None:
        gen = torch.Generator().manual_seed(num_reqs + block_q)
        q_lens = torch.randint(0, 9, (num_reqs,), generator=gen)
        q_lens[torch.randperm(num_reqs, generator=gen)[: num_reqs // 3]] = 0
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(q_lens, 0)
        num_tiles = int(qsl[-1]) // block_q + num_reqs + 1  # paged_attention's grid
        found = torch.full((num_tiles,), -1, dtype=torch.int32)
        _lookup[(num_tiles,)](qsl, found, num_reqs, BLOCK_Q=block_q)
        # The largest b whose first tile id is <= pid.
        first = qsl.long() // block_q + torch.arange(num_reqs + 1)
        expected = (first[None, :] <= torch.arange(num_tiles)[:, None]).sum(1) - 1
        assert torch.equal(found.long(), expected)


@triton.jit
def _lookup(qsl_ptr, found_ptr, num_reqs, BLOCK_Q: tl.constexpr):
    """found[pid] = `_find_request`'s request of query-tile id pid."""
    pid = tl.program_id(0)
    tl.store(found_ptr + pid, _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q, ""))


# ------------------------------------------------------------------------------------- sm_90 compile


def _compile_for_h100(fn, dtype: str, ints_equal_one: tuple[str, ...], constexprs: Mapping[str, object]):
    """Compile `fn` for sm_90 on this host (no GPU needed): type errors between branches, returns inside
    ifs and the like only show when compiled. `ints_equal_one` are int arguments Triton specialises to the
    constant 1 at launch (num_reqs == 1 for a single request, sliding_window == 1, ...)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in constexprs or name in ints_equal_one:
            signature[name] = "constexpr"
        elif name.endswith("_part_ptr"):
            signature[name] = "*fp32"
        elif name in ("qsl_ptr", "seq_lens_ptr", "block_tables_ptr", "counters_ptr"):
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    values = {**constexprs, **dict.fromkeys(ints_equal_one, 1)}
    source = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(n),): v for n, v in values.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})


@pytest.mark.skipif(INTERPRETING, reason="compiles the kernels: needs triton not in interpreter mode")
@pytest.mark.parametrize("dtype,ints_equal_one", [("bf16", ()), ("fp32", ("num_reqs", "sliding_window", "num_heads"))])
def test_kernels_compile_for_sm90(dtype: str, ints_equal_one: tuple[str, ...], sm90_compiler) -> None:
    from asyncspec.kernels import paged_attention_triton as mod

    precision = "ieee" if dtype == "fp32" else "tf32"
    tiles = {"GROUP": 8, "BLOCK_Q": 2, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": 128, "DOT_PRECISION": precision}
    tiles["EARLY_KV"] = False  # a constexpr: left out of `tiles`, it would compile as a runtime int
    for fn in (mod._paged_attention_kernel, mod._paged_attention_split_kernel):
        ones = tuple(n for n in ints_equal_one if n in fn.arg_names)
        assert "ld.global" in _compile_for_h100(fn, dtype, ones, tiles).asm["ptx"]
    # The keys below the context read before the PDL wait (which an unset USE_PDL leaves out here).
    for fn in (mod._paged_attention_kernel, mod._paged_attention_split_kernel):
        ones = tuple(n for n in ints_equal_one if n in fn.arg_names)
        early = _compile_for_h100(fn, dtype, ones, {**tiles, "EARLY_KV": True, "USE_PDL": True}).asm["ptx"]
        wait = early.index("griddepcontrol.wait")
        # A K/V tile's loads before the wait, not only the handful of step inputs (scalar loads here: the compile
        # has no divisibility hints); q and the tile's newest keys after it.
        assert early[:wait].count("ld.global") >= 64 and "ld.global" in early[wait:]
        assert "st.global" not in early[:wait] and "atom" not in early[:wait], "a store before the PDL wait"
    # The split pass that merges its own splits: an acq_rel arrival, then the merge's L2 reads.
    ones = tuple(n for n in ints_equal_one if n in mod._paged_attention_split_kernel.arg_names)
    fused = _compile_for_h100(mod._paged_attention_split_kernel, dtype, ones, {**tiles, "FUSED_COMBINE": True})
    assert "atom.global.gpu.acq_rel.add" in fused.asm["ptx"] and "ld.global.cg" in fused.asm["ptx"]
    combine = {"BLOCK_S": 16, "BLOCK_D": 128}
    ones = tuple(n for n in ints_equal_one if n in mod._combine_splits_kernel.arg_names)
    assert "ex2.approx" in _compile_for_h100(mod._combine_splits_kernel, dtype, ones, combine).asm["ptx"]


# ----------------------------------------------------------------------------------------------- GPU


def _gpu_batch(gen: torch.Generator, num_reqs: int, q_len: int, max_seq: int, num_pad: int) -> Batch:
    """Decode / verify batch of real sizes with one idle request, as graph padding adds."""
    specs = [(int(torch.randint(q_len, max_seq + 1, (1,), generator=gen)), q_len) for _ in range(num_reqs)]
    specs[0] = (max_seq, q_len)  # always one full-length context
    specs.append((37, 0))
    return make_batch(gen, specs, 16, num_pad=num_pad, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4, 32])
@pytest.mark.parametrize(
    "num_reqs,q_len,heads,d,dtype,window",
    [
        (1, 1, (32, 8), 128, torch.bfloat16, None),
        (4, 5, (32, 8), 128, torch.bfloat16, None),
        (3, 1, (6, 2), 64, torch.bfloat16, 1000),
        (2, 5, (8, 8), 80, torch.float32, None),
        (5, 1, (12, 4), 96, torch.bfloat16, None),
        # From 32 requests a short tile walks 128 keys a step (heads of at most 64): decodes and verifications, at
        # the boundary (32, the 1B's heads), inside the range the engine's 32- to 63-request buckets take, and past it.
        (32, 1, (32, 8), 64, torch.bfloat16, None),
        (47, 5, (6, 2), 64, torch.bfloat16, 1000),
        (70, 1, (6, 2), 64, torch.bfloat16, None),
        (66, 5, (32, 8), 64, torch.bfloat16, 300),
        (64, 3, (8, 8), 32, torch.float32, None),
    ],
)
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_split_matches_reference(monkeypatch, num_reqs, q_len, heads, d, dtype, window, num_splits, fused) -> None:
    """fused: the splits merged in the split pass (`counters`), its programs racing for the last arrival; the
    combine kernel may not launch."""
    from asyncspec.kernels import paged_attention_triton as mod
    from asyncspec.kernels.paged_attention_triton import make_combine_counters, paged_attention

    if fused:
        monkeypatch.setattr(mod, "_combine_splits_kernel", _Launches(mod._combine_splits_kernel, allow=False))
    gen = torch.Generator().manual_seed(num_reqs * 10 + q_len)
    batch = _gpu_batch(gen, num_reqs, q_len, 6000, num_pad=5)
    k_cache, v_cache = fill_cache(gen, batch, 16, heads[1], d, dtype, device="cuda")
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    counters = make_combine_counters("cuda") if fused else None
    attend = functools.partial(paged_attention, counters=counters)
    check_split(attend, batch, k_cache, v_cache, gen, heads[0], window, num_splits, atol)
    if counters is not None:
        assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_split_cuda_graph_replay(monkeypatch, fused: bool) -> None:
    """Capture the auto-split launch once, replay it with other seq_lens, query_start_loc (including an idle
    request and a different padding tail) and queries: every replay must match the reference (fused: the
    splits merged in the split pass, no combine kernel, its counters back at zero after every replay)."""
    from asyncspec.kernels import paged_attention_triton as mod

    counters = mod.make_combine_counters("cuda") if fused else None
    if fused:
        monkeypatch.setattr(mod, "_combine_splits_kernel", _Launches(mod._combine_splits_kernel, allow=False))

    gen = torch.Generator().manual_seed(3)
    h, kvh, d, bs, width, num_reqs, t_pad = 32, 8, 128, 16, 512, 4, 24
    block_q = mod._tile_sizes(t_pad, num_reqs, h // kvh, d, 2)[0] // (h // kvh)
    num_sms = mod._num_sms(torch.device("cuda"))
    assert mod.choose_num_splits(num_reqs, t_pad, kvh, block_q, width * bs, num_sms) > 1, "must take the split path"
    num_blocks = num_reqs * width
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to("cuda", torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, generator=gen).view(num_reqs, width).to("cuda", torch.int32)
    query = torch.zeros(t_pad, h, d, device="cuda", dtype=torch.bfloat16)
    qsl = torch.zeros(num_reqs + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.ones(num_reqs, device="cuda", dtype=torch.int32)
    out = torch.zeros_like(query)
    args = (query, k_cache, v_cache, qsl, seq_lens, block_tables, d**-0.5)

    def load(q_lens: list[int], lens: list[int]) -> None:
        qsl[1:].copy_(torch.tensor(q_lens).cumsum(0))
        seq_lens.copy_(torch.tensor(lens))
        query.copy_(torch.randn(t_pad, h, d, generator=gen))
        out.fill_(float("nan"))

    load([5, 5, 5, 5], [8000, 6, 300, 5])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mod.paged_attention(*args, out=out, counters=counters)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod.paged_attention(*args, out=out, counters=counters)
    for q_lens, lens in (
        ([5, 5, 5, 5], [8000, 6, 300, 5]),
        ([1, 0, 5, 1], [1, 40, 8191, 2]),
        ([5, 5, 0, 0], [9, 4000, 3, 1]),
    ):
        load(q_lens, lens)
        graph.replay()
        torch.cuda.synchronize()
        expected = paged_attention_ref(*args)
        num_real = sum(q_lens)
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
        assert (out[num_real:] == 0).all()
        assert counters is None or not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 5])
def test_gpu_fused_combine_under_load(monkeypatch, q_len: int) -> None:
    """The last-arrival merge under contention: 32 splits of many tiles, 24 launches back to back in one graph
    sharing one set of counters (with PDL where the GPU has it, each launch may start before the previous one
    ends), replayed 4 times. The merge sums in split order whatever order the programs arrive in, so every
    launch's output must equal the first eager one bit for bit; it must match the reference; the counters must
    end at zero."""
    from asyncspec.kernels import paged_attention_triton as mod

    monkeypatch.setattr(mod, "_combine_splits_kernel", _Launches(mod._combine_splits_kernel, allow=False))
    gen = torch.Generator().manual_seed(11 + q_len)
    batch = _gpu_batch(gen, 12, q_len, 8000, num_pad=3)
    k_cache, v_cache = fill_cache(gen, batch, 16, 8, 128, torch.bfloat16, device="cuda")
    query = torch.randn(batch.num_tokens + 3, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 128**-0.5)
    counters = mod.make_combine_counters("cuda")
    first = mod.paged_attention(*args, num_splits=32, counters=counters)
    torch.cuda.synchronize()
    torch.testing.assert_close(first.float(), paged_attention_ref(*args).float(), rtol=2e-2, atol=2e-2)
    outs = [torch.full_like(query, float("nan")) for _ in range(24)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for out in outs:
            mod.paged_attention(*args, out=out, num_splits=32, counters=counters)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(4):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, first) for out in outs)
        assert not counters.any()


@pytest.mark.gpu
def test_gpu_split_does_not_sync() -> None:
    from asyncspec.kernels.paged_attention_triton import paged_attention

    gen = torch.Generator().manual_seed(4)
    batch = _gpu_batch(gen, 2, 5, 4000, num_pad=3)
    k_cache, v_cache = fill_cache(gen, batch, 16, 8, 128, torch.bfloat16, device="cuda")
    q = torch.randn(batch.num_tokens + 3, 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.1)
    paged_attention(*args, num_splits=None)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_attention(*args, num_splits=None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@triton.jit
def _late_kv_write_kernel(k_src_ptr, v_src_ptr, k_flat_ptr, v_flat_ptr, slots_ptr, row, spin, BLOCK: tl.constexpr):
    """A predecessor that lets its successor launch at once (PDL), spins for a while, then writes its keys' K/V:
    whatever the successor read before its own wait is the NaN these slots held."""
    pdl_start(True)
    i = tl.program_id(0)
    x = i.to(tl.float32)
    for _ in range(spin):
        x = x * 0.999 + 1.0
    slot = tl.load(slots_ptr + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < row
    k = tl.load(k_src_ptr + i * row + offs, mask=ok)
    v = tl.load(v_src_ptr + i * row + offs, mask=ok)
    keep = (x * 0.0).to(k.dtype)  # the spin stays in the program (x is finite)
    tl.store(k_flat_ptr + slot * row + offs, k + keep, mask=ok)
    tl.store(v_flat_ptr + slot * row + offs, v + keep, mask=ok)


@triton.jit
def _read_before_wait_kernel(k_flat_ptr, slot_ptr, seen_ptr, USE_PDL: tl.constexpr):
    """The control: reads one new key's first element before its PDL wait, as a wrong early path would."""
    early = tl.load(k_flat_ptr + tl.load(slot_ptr).to(tl.int64) * 512, cache_modifier=".cg")
    pdl_start(USE_PDL)
    tl.store(seen_ptr, early.to(tl.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [4, 1])
@pytest.mark.parametrize("q_len", [1, 5])
def test_gpu_early_kv_waits_for_the_predecessor_s_keys(monkeypatch, num_splits, q_len: int) -> None:
    """early_kv under PDL: the step's new keys are written by a predecessor that spins first, while
    the attention's programs already run their part before the wait. The output must match the reference (no NaN
    read early) and equal the default path's bit for bit."""
    from asyncspec.kernels import paged_attention_triton as mod
    from asyncspec.kernels.pdl import pdl_enabled

    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("needs PDL (compute capability 9.0+, ASYNCSPEC_PDL not 0)")
    gen = torch.Generator().manual_seed(30 + q_len)
    batch = _gpu_batch(gen, 2, q_len, 3000, num_pad=2)  # a grid small enough to take the early reads
    k_cache, v_cache = fill_cache(gen, batch, 16, 8, 64, torch.bfloat16, device="cuda")
    query = torch.randn(batch.num_tokens + 2, 32, 64, generator=gen).to("cuda", torch.bfloat16)
    args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 64**-0.5)
    slots = []
    for b, (s, q) in enumerate(zip(batch.seq_lens.tolist(), batch.q_lens, strict=True)):
        pos = torch.arange(s - q, s, device="cuda")
        slots.append(batch.block_tables[b, pos // 16].long() * 16 + pos % 16)
    slot_ids = torch.cat(slots)
    k_flat, v_flat = k_cache.view(-1, 8 * 64), v_cache.view(-1, 8 * 64)
    k_new, v_new = k_flat[slot_ids].clone(), v_flat[slot_ids].clone()
    shipped = mod.paged_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(shipped.float(), paged_attention_ref(*args).float(), rtol=2e-2, atol=2e-2)
    name = "_paged_attention_kernel" if num_splits == 1 else "_paged_attention_split_kernel"
    kernel = getattr(mod, name)
    early_launches: list[bool] = []

    class Spy:
        def __getitem__(self, grid):
            launcher = kernel[grid]

            def launch(*a, **k):
                early_launches.append(k["EARLY_KV"])
                return launcher(*a, **k)

            return launch

    monkeypatch.setattr(mod, name, Spy())
    mod.paged_attention(*args, num_splits=num_splits, early_kv=True)  # compiled before the races
    torch.cuda.synchronize()
    assert early_launches == [True], "the grid is too large for the early reads: the test would race nothing"
    for _ in range(3):
        k_flat[slot_ids] = float("nan")
        v_flat[slot_ids] = float("nan")
        out = torch.full_like(query, float("nan"))
        _late_kv_write_kernel[(slot_ids.numel(),)](
            k_new, v_new, k_flat, v_flat, slot_ids, 8 * 64, 200_000, BLOCK=512, launch_pdl=True
        )
        mod.paged_attention(*args, out=out, num_splits=num_splits, early_kv=True)
        torch.cuda.synchronize()
        assert not out[: batch.num_tokens].isnan().any(), "a key of this step was read before the wait"
        assert torch.equal(out, shipped)
    # The race is real: a successor that reads a new key before its wait sees the NaN the predecessor overwrites.
    # The control is compiled first: a launch that compiles would let the spin finish before it (an H100 showed it).
    seen = torch.zeros(1, device="cuda")
    _read_before_wait_kernel[(1,)](k_flat, slot_ids, seen, USE_PDL=True, launch_pdl=True)
    torch.cuda.synchronize()
    k_flat[slot_ids] = float("nan")
    _late_kv_write_kernel[(slot_ids.numel(),)](
        k_new, v_new, k_flat, v_flat, slot_ids, 8 * 64, 200_000, BLOCK=512, launch_pdl=True
    )
    _read_before_wait_kernel[(1,)](k_flat, slot_ids, seen, USE_PDL=True, launch_pdl=True)
    torch.cuda.synchronize()
    assert seen.isnan().all(), "the control read the key after its write: the test raced nothing"


def _captured(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`fn` captured into a CUDA graph, after one throwaway capture that compiles and loads its kernels' variants."""
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    return graph


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [4, 1])
def test_gpu_early_kv_under_trigger_first_reads_older_keys_after_a_launch_without_pdl(num_splits) -> None:
    """early_kv in a captured chain whose launches trigger first (kernels/pdl.py): a kernel writes older keys (below
    the context) late, and a launch without PDL (as a forward pass's embedding gather) stands between it and the
    attention, so the early reads must see them. The control, the same graph without that launch, shows the race is
    real: the early reads then see the NaN the writer overwrites."""
    from asyncspec.kernels import paged_attention_triton as mod
    from asyncspec.kernels.pdl import TRIGGER_FIRST, pdl_enabled, pdl_mode

    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("needs PDL (compute capability 9.0+, ASYNCSPEC_PDL not 0)")
    gen = torch.Generator().manual_seed(40 + num_splits)
    batch = _gpu_batch(gen, 2, 1, 3000, num_pad=2)
    k_cache, v_cache = fill_cache(gen, batch, 16, 8, 64, torch.bfloat16, device="cuda")
    query = torch.randn(batch.num_tokens + 2, 32, 64, generator=gen).to("cuda", torch.bfloat16)
    args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 64**-0.5)
    # Each request's first 16 keys: older keys, in the first tile of split 0 (the one the early reads load).
    slot_ids = torch.cat([batch.block_tables[b, 0].long() * 16 + torch.arange(16, device="cuda") for b in range(2)])
    k_flat, v_flat = k_cache.view(-1, 8 * 64), v_cache.view(-1, 8 * 64)
    k_old, v_old = k_flat[slot_ids].clone(), v_flat[slot_ids].clone()
    shipped = mod.paged_attention(*args, num_splits=num_splits)
    out = torch.empty_like(query)
    marker = torch.zeros(1, device="cuda")

    def chain(barrier: bool) -> None:
        _late_kv_write_kernel[(slot_ids.numel(),)](
            k_old, v_old, k_flat, v_flat, slot_ids, 8 * 64, 200_000, BLOCK=512, launch_pdl=True
        )
        if barrier:
            marker.add_(1)  # a torch kernel: no PDL
        assert pdl_mode(query.device, query.shape[0]) == TRIGGER_FIRST
        mod.paged_attention(*args, out=out, num_splits=num_splits, early_kv=True)

    for barrier, expect_race in ((True, False), (False, True)):
        graph = _captured(functools.partial(chain, barrier))
        raced = False
        for _ in range(3):
            k_flat[slot_ids] = float("nan")
            v_flat[slot_ids] = float("nan")
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            raced |= bool(out[: batch.num_tokens].isnan().any())
            if not expect_race:
                assert not raced, "an older key was read before its write"
                assert torch.equal(out, shipped)
        if expect_race:
            assert raced, "without the launch between them the early reads never saw the NaN: the test raced nothing"
