"""Shared helpers of the engine-level tests (not a test module)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

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
    model = overrides.pop("model", str(TARGET_MODEL))
    kwargs.update(overrides)
    return LLM(model, **kwargs)


def bundled_target_with_generation_config(directory: Path, generation_config: dict) -> str:
    """The bundled target's files linked into `directory`, with `generation_config` as its
    generation_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in TARGET_MODEL.iterdir():
        if file.name != "generation_config.json":
            (directory / file.name).symlink_to(file.resolve())
    (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return str(directory)


def use_gpu_launch_order(llm) -> None:
    """The runner's CUDA ordering on the CPU: a step's finish (its tokens into the worker's row state) runs at
    collect, after the next plan's launch, instead of on the CPU's step thread before it. The asynchronous loop on a
    GPU runs in this order; on the CPU it otherwise never does. `llm`: an LLM or an AsyncEngine (in-process runner)."""
    runner = llm.engine.engine_core.runner
    runner._cpu_stream.shutdown(wait=True)
    runner._cpu_stream = None
    copy_to_host = runner._copy_to_host

    def copy_apart(tensors):  # the CPU has no copy engine: keep a step's copy from the next launch's writes
        flat, event = copy_to_host(tensors)
        return flat.clone(), event

    runner._copy_to_host = copy_apart


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


def abort_r1_while_a_step_is_in_flight(llm, prompts, params, ref, steps_before: int, check_in_flight) -> None:
    """Adds the prompts as r0, r1, r2 ..., runs `steps_before` engine steps, lets `check_in_flight(engine_core)`
    assert what is in flight, aborts r1, and runs the rest: r1 never finishes, r0 and r2 equal `ref`'s tokens,
    and the KV pool is whole again."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(prompt, params, f"r{i}"), stream_deltas=False)
    finished = {}

    def collect(outputs) -> None:
        finished.update({o.request_id: o for o in outputs if o.finished})

    for _ in range(steps_before):
        collect(engine.step())
    check_in_flight(engine.engine_core)
    (aborted,) = engine.abort_requests(["r1"])
    assert aborted.finish_reason == "abort"
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert "r1" not in finished
    assert finished["r0"].token_ids == ref[0].token_ids and finished["r2"].token_ids == ref[2].token_ids
    assert_kv_free(llm.stats())
