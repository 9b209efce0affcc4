"""Shared helpers of the engine-level tests (not a test module)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tests.conftest import TARGET_MODEL

BUNDLED_VOCAB = 8192


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Tiny models on a shared 2-core box: one intra-op thread is ~100x faster than two fighting ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bundled_llm(**overrides):
    from asyncspec import LLM

    kwargs = dict(
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=256,
        num_kv_blocks=64,
        max_num_batched_tokens=256,
    )
    kwargs.update(overrides)
    return LLM(str(TARGET_MODEL), **kwargs)


def assert_kv_free(stats: dict) -> None:
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], f"KV blocks leaked: {stats}"
    assert stats["num_running_requests"] == 0 and stats["num_waiting_requests"] == 0, stats


def assert_ids_in_vocab(token_ids, vocab: int = BUNDLED_VOCAB) -> None:
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
    assert not bad, f"placeholder / out-of-range ids reached the client: {bad}"


async def wait_kv_free(engine, timeout: float = 20.0) -> dict:
    """Polls the engine's stats until every KV block is free (abort/cancel paths are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (
            stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
            and stats["num_running_requests"] == 0
            and stats["num_waiting_requests"] == 0
        ):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not freed within {timeout}s: {stats}")
        await asyncio.sleep(0.01)
