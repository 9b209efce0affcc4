"""The KV pool's share of GPU memory (worker/gpu_memory.py): the arithmetic on the CPU, and on a GPU an engine
started beside another process that holds part of the card."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
import torch

from asyncspec.errors import ConfigError
from asyncspec.worker.gpu_memory import GIB, MemorySnapshot, check_free_at_start, kv_cache_budget
from tests.conftest import TARGET_MODEL

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
