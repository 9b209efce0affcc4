"""Which all-reduce ASYNCSPEC_TP_ALL_REDUCE picks (the paths themselves need GPUs:
tests/worker/test_symm_all_reduce_gpu.py, tests/kernels/test_push_all_reduce.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncspec.worker import symm_all_reduce
from asyncspec.worker.symm_all_reduce import DEFAULT_MODE, MODE_ENV, all_reduce_mode, make_small_all_reduce


@pytest.mark.parametrize("mode", ["nccl", "symm_mem", "push"])
def test_a_known_mode_is_taken(mode, monkeypatch) -> None:
    monkeypatch.setenv(MODE_ENV, mode)
    assert all_reduce_mode() == mode


def test_unset_gives_the_default(monkeypatch) -> None:
    monkeypatch.delenv(MODE_ENV, raising=False)
    assert all_reduce_mode() == DEFAULT_MODE


def test_a_misspelt_mode_warns_and_gives_the_default(monkeypatch, caplog) -> None:
    monkeypatch.setenv(MODE_ENV, "pusj")
    with caplog.at_level(logging.WARNING, logger=symm_all_reduce.__name__):
        assert all_reduce_mode() == DEFAULT_MODE
    assert "pusj" in caplog.text and "push" in caplog.text


@pytest.mark.parametrize("mode", ["symm_mem", "push"])
def test_the_cpu_always_takes_the_group_backend(mode, monkeypatch) -> None:
    """No collective is issued (there is no group here): the CPU path returns before any."""
    monkeypatch.setenv(MODE_ENV, mode)
    assert make_small_all_reduce(None, torch.device("cpu"), torch.float32) is None  # type: ignore[arg-type]
