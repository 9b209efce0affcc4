"""The KV pool's share of GPU memory (worker/gpu_memory.py): the arithmetic on the CPU, and on a GPU an engine
started beside another process that holds part of the card, or after another engine of the same process."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from asyncspec.errors import ConfigError
from asyncspec.worker import gpu_memory
from asyncspec.worker.gpu_memory import GIB, MemorySnapshot, check_free_at_start, kv_cache_budget
from tests.conftest import TARGET_MODEL
from tests.hf_tiny_models import save_tiny_family_model

TOTAL = 80 * GIB


def snapshot(free: float, reserved: float = 0.0, allocated: float = 0.0) -> MemorySnapshot:
    return MemorySnapshot(
        total=TOTAL, free=int(free * GIB), torch_reserved=int(reserved * GIB), torch_allocated=int(allocated * GIB)
    )


def test_another_process_s_memory_is_not_counted_against_the_share() -> None:
    # Another engine holds 32 GiB (and this context 0.5): a share of 0.4 (32 GiB) still fits in the 47.5 free.
    start = snapshot(free=47.5)
    check_free_at_start(start, 0.4)
    # This engine then takes 2 GiB of weights and activations at its peak and 0.25 GiB outside torch (NCCL).
    now = snapshot(free=47.5 - 3 - 0.25, reserved=3, allocated=2)
    budget = kv_cache_budget(start, now, 0.4, peak_torch=2 * GIB, reserved_after=GIB // 4)
    assert budget == int(0.4 * TOTAL) - 2 * GIB - GIB // 4 - GIB // 4


def test_tensors_live_at_the_start_are_not_counted_either() -> None:
    # A first engine in the same process holds 30 GiB of tensors; the second's peak includes them.
    start = snapshot(free=49, reserved=31, allocated=30)
    check_free_at_start(start, 0.4)  # 49 free + 1 cached and unused
    now = snapshot(free=49 - 2, reserved=33, allocated=32)
    assert kv_cache_budget(start, now, 0.4, peak_torch=32 * GIB, reserved_after=0) == int(0.4 * TOTAL) - 2 * GIB


def test_a_share_larger_than_the_free_memory_fails_with_the_numbers() -> None:
    with pytest.raises(ConfigError) as err:
        check_free_at_start(snapshot(free=20), 0.4)
    message = str(err.value)
    assert "gpu_memory_utilization=0.4" in message and "32.00 GiB" in message and "20.00 GiB are free" in message


def test_the_start_snapshot_follows_the_release_of_garbage_and_cached_memory(monkeypatch) -> None:
    """A dropped engine's KV pool, still cached by this process's allocator (or alive in a reference cycle), goes
    back before the snapshot is read, so that the new engine's weights are not carved out of it."""
    events: list[str] = []
    monkeypatch.setattr(gpu_memory.gc, "collect", lambda: events.append("collect"))
    monkeypatch.setattr(gpu_memory.torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    taken = snapshot(free=79)

    def take(device: torch.device) -> MemorySnapshot:
        events.append("take")
        return taken

    monkeypatch.setattr(MemorySnapshot, "take", staticmethod(take))
    assert gpu_memory.snapshot_at_start(torch.device("cuda", 0)) is taken
    assert events == ["collect", "empty_cache", "take"]


def test_nothing_left_is_a_negative_budget() -> None:
    start = snapshot(free=79)
    now = snapshot(free=60, reserved=19, allocated=19)
    assert kv_cache_budget(start, now, 0.2, peak_torch=19 * GIB, reserved_after=0) < 0


_HOLDER = """
import sys, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(int(total * float(sys.argv[1])), dtype=torch.uint8, device="cuda")
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def other_process_holding():
    procs = []

    def hold(fraction: float) -> None:
        gc.collect()  # an engine of an earlier test may still be cached by this process's allocator
        torch.cuda.empty_cache()
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(fraction)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "the holder could not allocate"

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.gpu
def test_two_engines_share_one_gpu(other_process_holding) -> None:
    from asyncspec import LLM, SamplingParams

    other_process_holding(0.45)
    with LLM(str(TARGET_MODEL), gpu_memory_utilization=0.4, max_num_seqs=4) as llm:
        stats = llm.stats()
        kv_bytes = stats["num_kv_blocks"] * llm.engine.engine_core.runner.bytes_per_block
        free, total = torch.cuda.mem_get_info()
        # The pool takes most of the share (the bundled model is small), and the card is not overcommitted.
        assert 0.3 * total < kv_bytes < 0.4 * total and free > 0.1 * total
        out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0.0, max_tokens=8))
        assert len(out[0].token_ids) == 8


@pytest.mark.gpu
def test_an_engine_whose_share_is_not_free_fails_at_once(other_process_holding) -> None:
    from asyncspec import LLM

    other_process_holding(0.7)
    with pytest.raises(ConfigError, match="are free"):
        LLM(str(TARGET_MODEL), gpu_memory_utilization=0.4, max_num_seqs=4)


@pytest.mark.gpu
def test_an_engine_started_after_a_dropped_one_gets_the_same_share(tmp_path) -> None:
    """Two engines one after the other in one process, each at the default gpu_memory_utilization, the first dropped
    without a context manager or a garbage collection. The first one's pool stayed cached as four segments of about
    18 GiB (two layers, K and V); the second one's weights were carved out of one, which then could not be released,
    and its own pool's last tensor ran out of memory (H100, 2026-12-06)."""
    from asyncspec import LLM, SamplingParams

    paths = []
    for heads in (8, 36):  # the second model's weights are larger than the first's
        path = tmp_path / f"heads{heads}"
        save_tiny_family_model(
            "llama",
            path,
            torch.bfloat16,
            hidden_size=heads * 64,
            intermediate_size=1024,
            num_attention_heads=heads,
            head_dim=64,
        )
        paths.append(path)
    first = LLM(str(paths[0]), device="cuda", skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=64)
    first_blocks = first.stats()["num_kv_blocks"]
    del first
    second = LLM(str(paths[1]), device="cuda", skip_tokenizer_init=True, max_model_len=256, max_num_batched_tokens=64)
    # The same share less the second model's few extra megabytes of weights and activations.
    assert second.stats()["num_kv_blocks"] > 0.99 * first_blocks
    out = second.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
