"""The pure-torch kernel references against naive, unpaged computations."""

from __future__ import annotations

import math

import pytest
import torch

from asyncspec.kernels.kv_cache_write import write_kv_cache_ref
from asyncspec.kernels.paged_attention import paged_attention_ref
from asyncspec.kernels.slot_mapping import compute_slot_mapping_ref


def _random_batch(gen: torch.Generator, num_reqs: int, block_size: int, max_seq: int):
    """Ragged seq_lens/q_lens (full prefills, prefix-hit chunks, decodes) and shuffled block tables."""
    seq_lens = torch.randint(1, max_seq + 1, (num_reqs,), generator=gen)
    q_lens = []
    for b, s in enumerate(seq_lens.tolist()):
        kind = b % 3
        q_lens.append(s if kind == 0 else 1 if kind == 1 else int(torch.randint(1, s + 1, (1,), generator=gen)))
    blocks_needed = [(s + block_size - 1) // block_size for s in seq_lens.tolist()]
    max_blocks = max(blocks_needed) + 1
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_needed):
        block_tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return seq_lens.to(torch.int32), q_lens, block_tables, qsl, num_blocks


def test_slot_mapping_matches_python_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    for block_size in (1, 3, 16):
        seq_lens, q_lens, block_tables, qsl, _ = _random_batch(gen, 7, block_size, 40)
        positions = []
        for s, q in zip(seq_lens.tolist(), q_lens, strict=True):
            positions += list(range(s - q, s))
        num_pad = 5
        positions_t = torch.tensor(positions + [123456] * num_pad, dtype=torch.int64)  # garbage in padding
        got = compute_slot_mapping_ref(block_tables, qsl, positions_t, block_size)
        expected = []
        for b in range(len(q_lens)):
            for t in range(int(qsl[b]), int(qsl[b + 1])):
                p = positions[t]
                expected.append(int(block_tables[b, p // block_size]) * block_size + p % block_size)
        expected += [-1] * num_pad
        assert got.dtype == torch.int64
        assert got.tolist() == expected


def test_slot_mapping_empty_requests_and_no_padding() -> None:
    block_tables = torch.tensor([[5, 2], [7, 1], [3, 4]], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 2, 3], dtype=torch.int32)  # request 1 schedules nothing
    positions = torch.tensor([3, 4, 0], dtype=torch.int64)
    got = compute_slot_mapping_ref(block_tables, qsl, positions, 4)
    assert got.tolist() == [5 * 4 + 3, 2 * 4 + 0, 3 * 4 + 0]


def test_kv_write_skips_padding_and_leaves_other_slots_untouched() -> None:
    gen = torch.Generator().manual_seed(1)
    nb, bs, kvh, d = 6, 4, 2, 8
    k_cache = torch.full((nb, bs, kvh, d), float("nan"))
    v_cache = torch.full((nb, bs, kvh, d), float("nan"))
    slots = torch.tensor([5, 17, -1, 0, 23, -1], dtype=torch.int64)
    key = torch.randn(len(slots), kvh, d, generator=gen)
    value = torch.randn(len(slots), kvh, d, generator=gen)
    write_kv_cache_ref(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(nb * bs, kvh, d), v_cache.view(nb * bs, kvh, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(flat_k[s], key[t], rtol=0, atol=0)
            torch.testing.assert_close(flat_v[s], value[t], rtol=0, atol=0)
    untouched = [s for s in range(nb * bs) if s not in slots.tolist()]
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def _naive_attention(q, k, v, scale, sliding_window=None):
    """Dense causal attention of q [Q, H, D] (the last Q positions) over k/v [S, KVH, D], in float64."""
    q_len, h, d = q.shape
    s, kvh = k.shape[0], k.shape[1]
    k = k.double().repeat_interleave(h // kvh, dim=1)
    v = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.ones(q_len, s, dtype=torch.bool).tril(diagonal=s - q_len)
    if sliding_window is not None:
        allowed &= ~torch.ones(q_len, s, dtype=torch.bool).tril(diagonal=s - q_len - sliding_window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_paged_attention_matches_dense(block_size, heads, head_dim, sliding_window) -> None:
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(block_size * 1000 + num_heads * 10 + num_kv_heads + head_dim)
    seq_lens, q_lens, block_tables, qsl, num_blocks = _random_batch(gen, 6, block_size, 37)
    dense_k = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens.tolist()]
    dense_v = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens.tolist()]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, s in enumerate(seq_lens.tolist()):
        pos = torch.arange(s)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        write_kv_cache_ref(dense_k[b], dense_v[b], k_cache, v_cache, slots)
    num_tokens, num_pad = int(qsl[-1]), 3
    query = torch.randn(num_tokens + num_pad, num_heads, head_dim, generator=gen)
    out = torch.full_like(query, float("nan"))
    scale = 1 / math.sqrt(head_dim)
    got = paged_attention_ref(
        query, k_cache, v_cache, qsl, seq_lens, block_tables, scale, out=out, sliding_window=sliding_window
    )
    assert got is out
    for b in range(len(q_lens)):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        expected = _naive_attention(query[rows], dense_k[b], dense_v[b], scale, sliding_window)
        torch.testing.assert_close(got[rows].double(), expected, rtol=1e-5, atol=1e-5)
    assert (got[num_tokens:] == 0).all()


def test_paged_attention_bf16_accumulates_in_fp32() -> None:
    gen = torch.Generator().manual_seed(7)
    block_size, kvh, h, d = 8, 2, 4, 64
    seq_lens, q_lens, block_tables, qsl, num_blocks = _random_batch(gen, 4, block_size, 300)
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).bfloat16()
    query = torch.randn(int(qsl[-1]), h, d, generator=gen).bfloat16()
    got = paged_attention_ref(query, k_cache, v_cache, qsl, seq_lens, block_tables, d**-0.5)
    assert got.dtype == torch.bfloat16
    for b, s in enumerate(seq_lens.tolist()):
        pos = torch.arange(s)
        blocks, offs = block_tables[b, pos // block_size].long(), pos % block_size
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        expected = _naive_attention(query[rows], k_cache[blocks, offs], v_cache[blocks, offs], d**-0.5)
        # Only the final bf16 rounding separates the two.
        torch.testing.assert_close(got[rows].double(), expected, rtol=1e-2, atol=1e-2)
