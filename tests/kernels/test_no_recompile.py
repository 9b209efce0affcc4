"""Kernels compile once per shape class, not once per batch: a new batch size, token count, block
table width or buffer offset mid-run must not stop the engine for a compilation (hundreds of ms).
Counted with Triton's post-compile hook on the GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.kernels.test_prepare_inputs import make_case  # noqa: E402


@pytest.fixture
def compiled() -> Iterator[list[str]]:
    names: list[str] = []

    def hook(*args, **kwargs):
        names.append(str(getattr(kwargs.get("fn"), "name", kwargs.get("fn"))))
        return False

    knobs = triton.knobs.runtime
    previous = knobs.jit_post_compile_hook
    knobs.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.jit_post_compile_hook = previous


@pytest.mark.gpu
def test_prepare_inputs_compiles_once_per_block_class(compiled):
    from asyncspec.kernels.prepare_inputs_triton import prepare_inputs

    def run(num_reqs: int, offset: int, with_capacity: bool, seed: int) -> None:
        case = make_case([1 + (i % 3) for i in range(num_reqs)], [5 * i for i in range(num_reqs)], 3, seed)
        # meta and capacity as views into one packed buffer at any offset, as the engine passes them
        packed = torch.zeros(offset + case.meta.numel() + num_reqs, dtype=torch.int64, device="cuda")
        meta = packed[offset : offset + case.meta.numel()].view(case.meta.shape)
        meta.copy_(case.meta)
        capacity = packed[offset + case.meta.numel() :] if with_capacity else None
        if capacity is not None:
            capacity.fill_(1 << 20)
        n = case.num_tokens
        ints = [torch.empty(n, dtype=torch.int64, device="cuda") for _ in range(3)]
        qsl = torch.empty(num_reqs + 1, dtype=torch.int32, device="cuda")
        seq_lens = torch.empty(num_reqs, dtype=torch.int32, device="cuda")
        prepare_inputs(
            meta, num_reqs, n, case.token_ids.cuda(), case.block_tables.cuda(), 4, *ints, qsl, seq_lens, capacity
        )

    run(20, 0, False, 0)
    run(20, 0, True, 0)
    warm = len(compiled)
    for seed, num_reqs in enumerate(range(17, 33)):  # one BLOCK_R class (32)
        run(num_reqs, seed % 5, seed % 2 == 0, seed)
    torch.cuda.synchronize()
    assert compiled[warm:] == [], compiled[warm:]


@pytest.mark.gpu
def test_norm_and_attention_compile_once_across_batch_sizes(compiled):
    from asyncspec.kernels.fused_add_rms_norm_triton import fused_add_rms_norm
    from asyncspec.kernels.paged_attention_triton import _LONG_KEY_STEP_MIN_REQS, paged_attention

    hidden, heads, kv_heads, head_dim, block_size = 256, 4, 2, 64, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    k_cache = torch.randn(256, block_size, kv_heads, head_dim, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn_like(k_cache)

    def step(num_reqs: int, num_splits: int) -> None:
        x = torch.randn(num_reqs, hidden, generator=gen, device="cuda").bfloat16()
        fused_add_rms_norm(x, x.clone(), weight, 1e-6)
        width = 3 + num_reqs % 4  # the block-table width changes with the longest request
        tables = torch.randint(0, 256, (num_reqs, width), generator=gen, device="cuda", dtype=torch.int32)
        seq_lens = torch.randint(1, width * block_size, (num_reqs,), generator=gen, device="cuda", dtype=torch.int32)
        qsl = torch.arange(num_reqs + 1, device="cuda", dtype=torch.int32)
        query = torch.randn(num_reqs, heads, head_dim, generator=gen, device="cuda").bfloat16()
        paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, 0.125, num_splits=num_splits)

    for tile_reqs in (5, _LONG_KEY_STEP_MIN_REQS):  # both short tiles: 64 keys a step, and 128 for large batches
        step(tile_reqs, 1)
        step(tile_reqs, 4)
    warm = len(compiled)
    for num_reqs in range(1, _LONG_KEY_STEP_MIN_REQS + 8):
        step(num_reqs, 1)
        step(num_reqs, 2 + num_reqs % 31)  # every split count 2..32: the first split call compiled each BLOCK_S
    torch.cuda.synchronize()
    assert compiled[warm:] == [], compiled[warm:]


def _attention_batches(heads: int, kv_heads: int, precompile: bool, compiled: list[str]) -> list[str]:
    """What compiles in a series of eager attention batches after the start-up variants (or without them)."""
    from asyncspec.kernels.paged_attention_triton import compile_tile_variants, paged_attention

    head_dim, block_size, num_blocks = 64, 16, 512
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, device="cuda").bfloat16()
    v_cache = torch.randn_like(k_cache)
    if precompile:
        assert compile_tile_variants(heads, k_cache, v_cache, torch.bfloat16, 0.125) == 8
        torch.cuda.synchronize()
    warm = len(compiled)

    def batch(query_lens: list[int], context: int) -> None:
        n = len(query_lens)
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([context + q for q in query_lens], dtype=torch.int32, device="cuda")
        width = -(-(context + max(query_lens)) // block_size)
        tables = torch.randint(0, num_blocks, (n, width), generator=gen, device="cuda", dtype=torch.int32)
        query = torch.randn(sum(query_lens), heads, head_dim, generator=gen, device="cuda").bfloat16()
        paged_attention(query, k_cache, v_cache, qsl, seq_lens, tables, 0.125)

    batch([1], 40)  # a decode
    batch([5] * 8, 300)  # a small verification batch: split
    batch([5] * 127 + [302], 300)  # 127 verifications joined by a prompt's last chunk: single pass, short tile
    batch([1] * 128 + [40], 1000)
    batch([20] * 16, 64)  # medium tile
    batch([300, 200], 0)  # tall tiles (prefill)
    batch([512] * 8, 0)
    torch.cuda.synchronize()
    return compiled[warm:]


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "kv_heads"), [(10, 2), (28, 4)])
def test_start_up_attention_variants_cover_every_eager_batch(compiled, heads, kv_heads, tmp_path, monkeypatch):
    """After `compile_tile_variants`, no batch compiles the attention kernel again: short, medium and tall tiles,
    single pass or split, small batches and a full batch of decodes joined by a prompt's last chunk (the variant
    that compiled mid-run on an H200, 0.5-0.8 s). Head groups (5, 7) no other test uses and an empty disk cache,
    so that every variant really compiles in this test."""
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    assert _attention_batches(heads, kv_heads, True, compiled) == []


@pytest.mark.gpu
def test_without_start_up_variants_eager_batches_compile(compiled, tmp_path, monkeypatch):
    """The control: the same batches without `compile_tile_variants` compile the single pass's three tiles as they
    meet them (a group of 9 no other test uses; 3 on an H200)."""
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    assert _attention_batches(18, 2, False, compiled).count("_paged_attention_kernel") >= 3


@pytest.mark.gpu
def test_greedy_argmax_compiles_once_across_batch_sizes(compiled):
    """Only shapes that do not change with the batch (V, the row stride) reach its kernels as arguments."""
    from asyncspec.kernels.greedy_argmax_triton import greedy_argmax

    for v in (128256, 8192):
        logits = torch.randn(64, v, device="cuda")
        greedy_argmax(logits[:1], -1)
        warm = len(compiled)
        for n in (2, 3, 5, 8, 13, 17, 32, 33, 64):
            greedy_argmax(logits[:n], -1)
        torch.cuda.synchronize()
        assert compiled[warm:] == [], (v, compiled[warm:])
