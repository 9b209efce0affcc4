"""Triton kernels against their torch references: under TRITON_INTERPRET=1 on the CPU, compiled on a GPU.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function, and triton.language's own helpers
(tl.zeros, tl.maximum, ...) are decorated when triton is first imported. So interpretation works only in a
process whose environment had the variable before triton was imported, and such a process can no longer
run compiled kernels. Hence `TestInterpreted` runs in-process only when that already holds
(`TRITON_INTERPRET=1 pytest ...`); otherwise `test_interpreter_suite` runs it in a child pytest with the
variable set, so it works whatever other test modules imported before and leaves this process (and its
GPU tests) compiled.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # a bare GPU box may lack hypothesis; only one interpreter test needs it
    given = None

from asyncspec.kernels.kv_cache_write import write_kv_cache_ref
from asyncspec.kernels.paged_attention import paged_attention_ref
from asyncspec.kernels.slot_mapping import compute_slot_mapping_ref

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(triton.language.zeros, InterpretedFunction)


@pytest.fixture(scope="class")
def interpreted():
    """The kernel modules, checked to be running in the interpreter (not silently compiled)."""
    from asyncspec.kernels import kv_cache_write_triton, paged_attention_triton, slot_mapping_triton

    for kernel in (
        slot_mapping_triton._slot_mapping_kernel,
        kv_cache_write_triton._kv_cache_write_kernel,
        paged_attention_triton._paged_attention_kernel,
    ):
        assert isinstance(kernel, InterpretedFunction), "kernels are not interpreted"
    return {
        "slot_mapping_triton": slot_mapping_triton,
        "kv_cache_write_triton": kv_cache_write_triton,
        "paged_attention_triton": paged_attention_triton,
    }


@pytest.mark.skipif(INTERPRETING, reason="TestInterpreted runs in this process")
def test_interpreter_suite(interpreted_suites) -> None:
    interpreted_suites.check(__file__, 10, ("ASYNCSPEC_ATTENTION_BACKEND",))


# --------------------------------------------------------------------------------------------- batches


@dataclass
class Batch:
    seq_lens: torch.Tensor  # [R] int32
    q_lens: list[int]
    query_start_loc: torch.Tensor  # [R + 1] int32
    block_tables: torch.Tensor  # [R, M] int32
    positions: torch.Tensor  # [T_pad] int64, garbage in the padding
    num_blocks: int
    num_pad: int

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def make_batch(
    gen: torch.Generator, specs: list[tuple[int, int]], block_size: int, num_pad: int, device: str = "cpu"
) -> Batch:
    """specs: (seq_len, q_len) per request. Block tables are a shuffled pool with spare blocks left over."""
    blocks_needed = [-(-s // block_size) for s, _ in specs]
    num_blocks = sum(blocks_needed) + 5
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(specs), max(blocks_needed) + 2, dtype=torch.int32)
    used, positions = 0, []
    for b, ((s, q), n) in enumerate(zip(specs, blocks_needed, strict=True)):
        block_tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
        positions += list(range(s - q, s))
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in specs]), 0)
    positions_t = torch.tensor(positions + [10**6 + 7] * num_pad, dtype=torch.int64)
    seq_lens = torch.tensor([s for s, _ in specs], dtype=torch.int32)
    return Batch(
        seq_lens.to(device),
        [q for _, q in specs],
        qsl.to(device),
        block_tables.to(device),
        positions_t.to(device),
        num_blocks,
        num_pad,
    )


def fill_cache(
    gen: torch.Generator, batch: Batch, block_size: int, kvh: int, d: int, dtype: torch.dtype, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-poisoned caches with real K/V at every position < seq_len of every request."""
    k_cache = torch.full((batch.num_blocks, block_size, kvh, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, s in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(s, device=device)
        slots = batch.block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(s, kvh, d, generator=gen).to(device)
        v = torch.randn(s, kvh, d, generator=gen).to(device)
        write_kv_cache_ref(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache


def check_attention(
    paged_attention, batch: Batch, k_cache, v_cache, gen, num_heads: int, dtype, window, atol: float
) -> None:
    num_tokens, d = batch.num_tokens, k_cache.shape[3]
    device = k_cache.device
    query = torch.randn(num_tokens + batch.num_pad, num_heads, d, generator=gen).to(device=device, dtype=dtype)
    scale = 1 / math.sqrt(d)
    args = (query, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
    expected = paged_attention_ref(*args, sliding_window=window)
    out = torch.full_like(query, float("nan"))  # any row the kernel forgets stays NaN and fails
    got = paged_attention(*args, out=out, sliding_window=window)
    assert got is out and got.dtype == dtype
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), rtol=atol, atol=atol)
    assert (got[num_tokens:] == 0).all(), "padded rows must be zeroed"
    fresh = paged_attention(*args, sliding_window=window)  # out=None path
    torch.testing.assert_close(fresh.float(), expected.float(), rtol=atol, atol=atol)


# Mixed batches: (seq_len, q_len) = full prefill, prefix-hit chunk, decode of 1, decode of k+1 = 5, idle request.
MIXED = [(70, 70), (45, 13), (33, 1), (9, 5), (20, 0), (1, 1), (29, 5)]
DECODE = [(17, 1), (40, 5), (3, 1), (66, 5)]


# --------------------------------------------------------------------------------------- interpreter


class TestInterpreted:
    # Collected only where triton interprets; elsewhere test_interpreter_suite runs it in a child process.
    __test__ = INTERPRETING

    @pytest.mark.parametrize("block_size", [1, 16, 32])
    def test_slot_mapping(self, interpreted, block_size: int) -> None:
        gen = torch.Generator().manual_seed(block_size)
        batch = make_batch(gen, MIXED, block_size, num_pad=6)
        args = (batch.block_tables, batch.query_start_loc, batch.positions, block_size)
        got = interpreted["slot_mapping_triton"].compute_slot_mapping(*args)
        assert got.dtype == torch.int64
        assert got.tolist() == compute_slot_mapping_ref(*args).tolist()
        assert got[batch.num_tokens :].eq(-1).all()

    def test_slot_mapping_single_request_without_padding(self, interpreted) -> None:
        block_tables = torch.tensor([[5, 2, 9]], dtype=torch.int32)
        qsl = torch.tensor([0, 3], dtype=torch.int32)
        positions = torch.tensor([7, 8, 9], dtype=torch.int64)
        got = interpreted["slot_mapping_triton"].compute_slot_mapping(block_tables, qsl, positions, 4)
        assert got.tolist() == [2 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1]

    @pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
    def test_kv_write_skips_padding(self, interpreted, cache_dtype) -> None:
        gen = torch.Generator().manual_seed(3)
        nb, bs, kvh, d = 6, 4, 3, 64
        k_cache = torch.full((nb, bs, kvh, d), float("nan"), dtype=cache_dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        slots = torch.tensor([5, 17, -1, 0, 23, -1, 11], dtype=torch.int64)
        # Strided views, as sliced from a fused QKV projection.
        # (Same dtype as the cache: the interpreter's fp32 -> bf16 cast does not round like torch's.)
        qkv = torch.randn(len(slots), 3 * kvh, d, generator=gen).to(cache_dtype)
        key, value = qkv[:, kvh : 2 * kvh], qkv[:, 2 * kvh :]
        interpreted["kv_cache_write_triton"].write_kv_cache(key, value, k_cache, v_cache, slots)
        ref_k, ref_v = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
        write_kv_cache_ref(key, value, ref_k, ref_v, slots)
        torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
        untouched = sorted(set(range(nb * bs)) - set(slots.tolist()))
        assert k_cache.view(nb * bs, kvh, d)[untouched].isnan().all()

    @pytest.mark.parametrize(
        "block_size,num_heads,kvh,d,dtype,window,specs",
        [
            (16, 2, 2, 64, torch.float32, None, MIXED),  # GQA 1
            (1, 4, 2, 64, torch.float32, None, MIXED),  # GQA 2, one key per block
            (16, 6, 2, 64, torch.bfloat16, None, MIXED),  # GQA 3, the bundled model's shape
            (32, 4, 1, 128, torch.float32, 7, MIXED),  # GQA 4, sliding window
            (16, 6, 2, 128, torch.float32, None, DECODE),  # decodes of 1 and k+1
            (16, 4, 2, 128, torch.bfloat16, 5, DECODE),
            (16, 2, 1, 64, torch.float32, None, [(150, 150), (80, 66)]),  # tall tiles, several KV tiles
        ],
    )
    def test_paged_attention(self, interpreted, block_size, num_heads, kvh, d, dtype, window, specs) -> None:
        gen = torch.Generator().manual_seed(block_size * 7 + num_heads + d)
        batch = make_batch(gen, specs, block_size, num_pad=3)
        k_cache, v_cache = fill_cache(gen, batch, block_size, kvh, d, dtype)
        atol = 2e-2 if dtype == torch.bfloat16 else 2e-5
        check_attention(
            interpreted["paged_attention_triton"].paged_attention,
            batch,
            k_cache,
            v_cache,
            gen,
            num_heads,
            dtype,
            window,
            atol,
        )

    if given is not None:

        @settings(max_examples=8, deadline=None, derandomize=True)
        @given(
            specs=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 90)), min_size=1, max_size=5).map(
                lambda xs: [(s, min(q, s)) for s, q in xs]
            ),
            block_size=st.sampled_from([1, 16, 32]),
            group=st.sampled_from([1, 2, 3]),
            d=st.sampled_from([32, 64]),
            window=st.sampled_from([None, 1, 9]),
            num_pad=st.integers(0, 3),
        )
        def test_paged_attention_random(self, interpreted, specs, block_size, group, d, window, num_pad) -> None:
            gen = torch.Generator().manual_seed(len(specs) + block_size + group)
            batch = make_batch(gen, specs, block_size, num_pad=num_pad)
            k_cache, v_cache = fill_cache(gen, batch, block_size, 1, d, torch.float32)
            check_attention(
                interpreted["paged_attention_triton"].paged_attention,
                batch,
                k_cache,
                v_cache,
                gen,
                group,
                torch.float32,
                window,
                2e-5,
            )

    def test_backend_pipeline_matches_reference(self, interpreted, monkeypatch) -> None:
        """slot mapping -> KV write -> attention through the Attention layer with the forced Triton backend."""
        from asyncspec.layers.attention import BACKEND_ENV, TORCH_REFERENCE, TRITON, Attention, select_backend
        from asyncspec.layers.attention_metadata import AttentionMetadata

        monkeypatch.setenv(BACKEND_ENV, "triton")
        assert select_backend(torch.device("cpu")) is TRITON
        gen = torch.Generator().manual_seed(11)
        block_size, h, kvh, d = 16, 6, 2, 64
        batch = make_batch(gen, MIXED, block_size, num_pad=4)
        caches = fill_cache(gen, batch, block_size, kvh, d, torch.float32)  # earlier steps' KV, then overwritten
        slots = interpreted["slot_mapping_triton"].compute_slot_mapping(
            batch.block_tables, batch.query_start_loc, batch.positions, block_size
        )
        meta = AttentionMetadata(
            slots,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            max(batch.q_lens),
            int(batch.seq_lens.max()),
            block_size,
        )
        t_pad = batch.num_tokens + batch.num_pad
        q, k, v = (torch.randn(t_pad, n, d, generator=gen) for n in (h, kvh, kvh))
        outs = []
        for backend in (TRITON, TORCH_REFERENCE):
            layer = Attention(h, kvh, d, d**-0.5)
            layer.backend = backend
            kv = (caches[0].clone(), caches[1].clone())
            outs.append((layer(q, k, v, kv, meta), kv))
        (got, (gk, gv)), (exp, (ek, ev)) = outs
        torch.testing.assert_close(gk, ek, rtol=0, atol=0, equal_nan=True)  # padded tokens wrote nothing
        torch.testing.assert_close(gv, ev, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(got, exp, rtol=2e-5, atol=2e-5)


def test_select_backend_defaults(monkeypatch) -> None:
    from asyncspec.layers.attention import BACKEND_ENV, TORCH_REFERENCE, TRITON, select_backend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend(torch.device("cpu")) is TORCH_REFERENCE
    assert select_backend(torch.device("cuda")) is TRITON  # triton is importable here
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend(torch.device("cuda")) is TORCH_REFERENCE
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError):
        select_backend(torch.device("cpu"))


# ----------------------------------------------------------------------------------------------- GPU


def _gpu_specs(gen: torch.Generator, num_reqs: int = 64, max_seq: int = 2048) -> list[tuple[int, int]]:
    """Real-size mixed batch: a few prefill chunks (with prefix hits) among decodes of 1 and k+1 tokens."""
    specs = []
    for b in range(num_reqs):
        s = int(torch.randint(1, max_seq + 1, (1,), generator=gen))
        if b % 16 == 0:
            q = min(s, 512)  # prefill chunk, a prefix hit whenever s > 512
        elif b % 2:
            q = min(s, 5)
        else:
            q = 1
        specs.append((s, q))
    return specs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,heads,d,window",
    [
        (torch.bfloat16, (32, 8), 128, None),
        (torch.bfloat16, (6, 2), 64, None),
        (torch.bfloat16, (32, 8), 128, 256),
        (torch.float32, (8, 8), 64, None),
    ],
)
def test_gpu_attention_matches_reference(dtype, heads, d, window) -> None:
    from asyncspec.kernels.paged_attention_triton import paged_attention

    gen = torch.Generator().manual_seed(0)
    batch = make_batch(gen, _gpu_specs(gen), 16, num_pad=7, device="cuda")
    k_cache, v_cache = fill_cache(gen, batch, 16, heads[1], d, dtype, device="cuda")
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    check_attention(paged_attention, batch, k_cache, v_cache, gen, heads[0], dtype, window, atol)


@pytest.mark.gpu
def test_gpu_slot_mapping_and_kv_write_match_reference() -> None:
    from asyncspec.kernels.kv_cache_write_triton import write_kv_cache
    from asyncspec.kernels.slot_mapping_triton import compute_slot_mapping

    gen = torch.Generator().manual_seed(1)
    batch = make_batch(gen, _gpu_specs(gen), 16, num_pad=9, device="cuda")
    args = (batch.block_tables, batch.query_start_loc, batch.positions, 16)
    slots = compute_slot_mapping(*args)
    assert torch.equal(slots, compute_slot_mapping_ref(*args))
    t_pad = batch.positions.shape[0]
    key = torch.randn(t_pad, 8, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    caches = [
        torch.full((batch.num_blocks, 16, 8, 128), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(4)
    ]
    write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))


@pytest.mark.gpu
def test_gpu_kernels_do_not_sync() -> None:
    from asyncspec.kernels.kv_cache_write_triton import write_kv_cache
    from asyncspec.kernels.paged_attention_triton import paged_attention
    from asyncspec.kernels.slot_mapping_triton import compute_slot_mapping

    gen = torch.Generator().manual_seed(2)
    batch = make_batch(gen, _gpu_specs(gen, 16, 512), 16, num_pad=3, device="cuda")
    k_cache, v_cache = fill_cache(gen, batch, 16, 2, 64, torch.bfloat16, device="cuda")
    t_pad = batch.positions.shape[0]
    q = torch.randn(t_pad, 6, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(t_pad, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def step() -> torch.Tensor:
        slots = compute_slot_mapping(batch.block_tables, batch.query_start_loc, batch.positions, 16)
        write_kv_cache(k, v, k_cache, v_cache, slots)
        return paged_attention(
            q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.125, sliding_window=None
        )

    step()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
