"""The engine's start-up objects frozen out of Python's full garbage collections (EngineConfig.freeze_gc)."""

from __future__ import annotations

import gc
import weakref

import pytest

from asyncspec import SamplingParams
from tests.engine.engine_helpers import bundled_llm


@pytest.fixture(autouse=True)
def nothing_frozen():
    """Each test starts and ends with no frozen object (an engine of another test may have left some)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_up_objects_leave_the_collectors_scans_until_shutdown(one_thread) -> None:
    llm = bundled_llm()
    frozen = gc.get_freeze_count()
    # A full collection now scans only what was made since start-up: a small share of what is alive.
    assert frozen > 10 * len(gc.get_objects()), (frozen, len(gc.get_objects()))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([[1, 2, 3, 4]], params)
    assert len(outputs[0].token_ids) == 4
    llm.shutdown()
    assert gc.get_freeze_count() == 0


def test_freeze_gc_off_leaves_the_collector_alone(one_thread) -> None:
    llm = bundled_llm(freeze_gc=False)
    try:
        assert gc.get_freeze_count() == 0
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0


def _engine_in_a_cycle():
    """An engine that only the collector can free: it holds a reference to itself (as a user's callback can)."""
    llm = bundled_llm()
    llm.self_reference = llm  # type: ignore[attr-defined]
    return llm, weakref.ref(llm.engine.engine_core.runner.model)


def test_a_shut_down_engine_in_a_reference_cycle_is_freed(one_thread) -> None:
    llm, model = _engine_in_a_cycle()
    llm.shutdown()
    del llm
    gc.collect()
    assert model() is None


def test_an_engine_dropped_without_shutdown_is_freed_when_the_next_one_starts(one_thread) -> None:
    llm, model = _engine_in_a_cycle()
    del llm
    gc.collect()
    assert model() is not None  # frozen: the collector does not see the cycle
    successor = bundled_llm()
    try:
        assert model() is None
    finally:
        successor.shutdown()


def test_freeze_gc_must_be_a_bool() -> None:
    from asyncspec import LLM
    from asyncspec.errors import ConfigError
    from tests.conftest import TARGET_MODEL

    with pytest.raises(ConfigError, match="freeze_gc must be True or False"):
        LLM(str(TARGET_MODEL), device="cpu", freeze_gc="false")


class _Node:
    """A weak-referenceable object for a reference cycle."""


def test_release_with_collect_frees_frozen_cycles_at_once_and_only_where_some_were_frozen() -> None:
    from asyncspec.worker.startup_heap import freeze_startup_objects, release_frozen_objects

    node = _Node()
    node.self_reference = node  # type: ignore[attr-defined]
    alive = weakref.ref(node)
    freeze_startup_objects()
    del node
    gc.collect()
    assert alive() is not None  # frozen garbage
    release_frozen_objects(collect=True)
    assert alive() is None and gc.get_freeze_count() == 0
    gc.disable()  # no automatic full pass between the two counts
    try:
        collections = gc.get_stats()[2]["collections"]
        release_frozen_objects(collect=True)  # nothing frozen: no full pass
        assert gc.get_stats()[2]["collections"] == collections
    finally:
        gc.enable()


@pytest.mark.gpu
def test_an_engine_dropped_in_a_cycle_leaves_the_next_one_its_gpu_memory() -> None:
    """On CUDA, an engine dropped without shutdown and held by a reference cycle (frozen garbage) is freed before
    the next engine loads: its weights, KV pool and graphs go, so the process then holds one engine's memory, not
    two. (The next engine's own share would not show it: it sizes its pool from what it allocates itself.)"""
    import torch

    from asyncspec import LLM
    from tests.conftest import TARGET_MODEL

    kwargs = dict(device="cuda", max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.3)
    torch.cuda.empty_cache()
    allocated_before = torch.cuda.memory_allocated()
    first = LLM(str(TARGET_MODEL), **kwargs)
    one_engine = torch.cuda.memory_allocated() - allocated_before
    assert gc.get_freeze_count() > 0 and one_engine > 1 << 30  # its KV pool: 0.3 of the card
    first.self_reference = first  # type: ignore[attr-defined]
    model = weakref.ref(first.engine.engine_core.runner.model)
    del first
    gc.collect()
    assert model() is not None  # frozen: the collector does not see the cycle
    second = LLM(str(TARGET_MODEL), **kwargs)
    try:
        assert model() is None
        assert torch.cuda.memory_allocated() - allocated_before < 1.2 * one_engine
    finally:
        second.shutdown()
    del second
    gc.collect()
    torch.cuda.empty_cache()
    # Both engines gone: what stays is torch's own (cuBLAS workspaces: 64 MiB on an H100, 2026-12-07).
    assert torch.cuda.memory_allocated() - allocated_before < 256 << 20
