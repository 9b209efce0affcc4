"""One request never ends another's stream, and the AsyncEngine lifecycle has no holes.

Regression tests for defects found by an outside stress test of the public API: values that passed
validation and then killed the engine in the worker's device tables, a failure while admitting one
request, rows with no valid token, streams orphaned by a finished event loop, generate() during
shutdown(), and stop strings without a tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading

import numpy as np
import pytest
import torch

from asyncspec import AsyncEngine, SamplingParams
from asyncspec.config import make_config
from asyncspec.errors import (
    EngineDeadError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    RequestFailedError,
)
from asyncspec.worker.input_batch import InputBatch
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import (
    assert_ids_in_vocab,
    assert_kv_free,
    bundled_llm,
    wait_kv_free,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=48, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
TIMEOUT = 60.0
VOCAB = 8192


def _new_engine(**overrides) -> AsyncEngine:
    return AsyncEngine(make_config(str(TARGET_MODEL), **{**CONFIG, **overrides}))


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def _collect(engine, prompt, params, request_id):
    return [d async for d in engine.generate(prompt, params, request_id=request_id)]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(one_thread, request):
    eng = _new_engine(async_scheduling=request.param)
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def prompts():
    return [p[:40] for p in load_prompts(4)]


@pytest.fixture(scope="module")
def reference(prompts, one_thread):
    return bundled_llm(**CONFIG).generate(prompts, GREEDY)


@pytest.fixture
def poison_admission(monkeypatch):
    """Makes the worker fail to admit requests whose id starts with "poison" (as a value that its
    device tables cannot hold once did), leaving every other request alone."""
    real_add = InputBatch.add_request

    def add_request(self, data, write_device=True):
        if data.request_id.startswith("poison"):
            # Part of the row is written before the failure: the rollback must undo it.
            self.sampling_tensors["top_k"][self._free_rows[-1]] = 123
            raise OverflowError("Overflow when unpacking long long")
        return real_add(self, data, write_device)

    monkeypatch.setattr(InputBatch, "add_request", add_request)


# -- defect 1: a request that passes validation could kill the whole engine ----------------------
@pytest.mark.parametrize(
    "field, value",
    [("top_k", 2**63), ("temperature", 1e39), ("repetition_penalty", 1e39), ("repetition_penalty", 1e-46)],
)
def test_values_beyond_device_tables_are_typed_errors_and_engine_serves_on(engine, prompts, reference, field, value):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    setattr(params, field, value)  # past construction-time validation: the engine checks again

    async def main():
        good = asyncio.create_task(_collect(engine, prompts[0], GREEDY, "good"))
        await asyncio.sleep(0)
        with pytest.raises(InvalidSamplingParamsError, match=field):
            await _collect(engine, prompts[1], params, "bad")
        deltas = await good
        await wait_kv_free(engine)
        return deltas, await _collect(engine, prompts[2], GREEDY, "after")

    deltas, after = _run(main())
    assert _tokens(deltas) == reference[0].token_ids
    assert _tokens(after) == reference[2].token_ids
    with pytest.raises(InvalidSamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_llm_generate_rejects_whole_batch_with_typed_error_before_running(prompts, reference):
    llm = bundled_llm(**CONFIG)
    bad = SamplingParams(temperature=0.0, max_tokens=10)
    bad.top_k = 2**63
    with pytest.raises(InvalidSamplingParamsError, match="top_k"):
        llm.generate(prompts[:2], [GREEDY, bad])
    assert_kv_free(llm.stats())
    assert llm.generate(prompts[:1], GREEDY)[0].token_ids == reference[0].token_ids


@pytest.mark.parametrize(
    ("bad_token", "message"),
    [
        (-1, "prompt token 2 is -1, outside the vocabulary"),
        (8192, "prompt token 2 is 8192, outside"),
        (True, "prompt token 2 is True, not an integer"),
        (3.0, "prompt token 2 is 3.0, not an integer"),
        ("7", "prompt token 2 is '7', not an integer"),
    ],
)
def test_prompt_token_ids_are_checked_one_by_one_in_the_error(prompts, reference, bad_token, message):
    """A prompt of token ids is checked as a whole (types, min and max); a bad one names its first bad entry,
    and the batch it came in runs nothing. Lists, tuples, numpy arrays and tensors of ids are accepted."""
    llm = bundled_llm(**CONFIG)
    bad = [5, 6, bad_token, 7]
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompts[0], bad], GREEDY)
    assert_kv_free(llm.stats())
    as_numpy = np.asarray(prompts[0], dtype=np.int32)
    outs = llm.generate([tuple(prompts[0]), as_numpy, torch.tensor(prompts[0])], GREEDY)
    assert all(o.token_ids == reference[0].token_ids for o in outs)


def test_admission_failure_fails_that_request_alone(engine, prompts, reference, poison_admission):
    async def main():
        tasks = [
            asyncio.create_task(_collect(engine, prompts[0], GREEDY, "ok-0")),
            asyncio.create_task(_collect(engine, prompts[1], GREEDY, "poison-1")),
            asyncio.create_task(_collect(engine, prompts[2], GREEDY, "ok-2")),
        ]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await wait_kv_free(engine)
        return results

    ok0, poisoned, ok2 = _run(main())
    assert isinstance(poisoned, RequestFailedError), poisoned
    assert "poison-1" in str(poisoned) and "could not admit" in str(poisoned)
    assert _tokens(ok0) == reference[0].token_ids
    assert _tokens(ok2) == reference[2].token_ids
    # The engine is alive and the failed id is free again.
    assert _tokens(_run(_collect(engine, prompts[3], GREEDY, "after-poison"))) == reference[3].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_admission_failure_through_llm_generate_keeps_the_batch(prompts, reference, poison_admission, async_scheduling):
    llm = bundled_llm(**CONFIG, async_scheduling=async_scheduling)
    # LLM.generate names its requests llm-<n>; poison the second one via a wrapper of the names.
    llm._next_id = 0
    real_make = llm.engine.make_request

    def make_request(prompt, params, request_id, priority):
        return real_make(prompt, params, "poison-" + request_id if request_id == "llm-1" else request_id, priority)

    llm.engine.make_request = make_request
    outs = llm.generate(prompts[:3], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "could not admit" in outs[1].error
    assert outs[0].token_ids == reference[0].token_ids and outs[2].token_ids == reference[2].token_ids
    assert_kv_free(llm.stats())


# -- defect 2: a row with no valid token used to sample token 0 (EOS) ------------------------------
@pytest.mark.parametrize("neighbour_logprobs", [None, 2], ids=["plain-neighbour", "logprobs-neighbour"])
def test_row_without_valid_token_fails_alone_and_never_emits_token_zero(engine, prompts, reference, neighbour_logprobs):
    """Every token blocked (stop ids = the whole vocabulary, min_tokens not reached): the row has
    no token to sample. The request fails with a typed error; its neighbours are untouched, also one that asks
    for logprobs (whose gather once indexed the blocked row's invalid token and ended the engine)."""
    everything_blocked = SamplingParams(
        temperature=0.8, max_tokens=5, min_tokens=3, stop_token_ids=list(range(VOCAB)), seed=1
    )
    neighbour = dataclasses.replace(GREEDY, logprobs=neighbour_logprobs)

    async def main():
        good = asyncio.create_task(_collect(engine, prompts[0], neighbour, "good"))
        blocked = asyncio.create_task(_collect(engine, prompts[1], everything_blocked, "all-blocked"))
        results = await asyncio.gather(good, blocked, return_exceptions=True)
        await wait_kv_free(engine)
        return results

    good, blocked = _run(main())
    assert isinstance(blocked, RequestFailedError) and "no valid token" in str(blocked)
    assert not isinstance(good, BaseException), good
    assert _tokens(good) == reference[0].token_ids
    if neighbour_logprobs is not None:
        assert all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in good)


# -- defect 3: seeds used only their low 32 bits on the CPU ------------------------------------
def test_seeds_differing_in_high_bits_give_distinct_streams_through_the_engine(prompts):
    llm = bundled_llm(**CONFIG)

    def run(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=seed)
        return llm.generate(prompts[:1], params)[0].token_ids

    for a, b in [(1, 2**32 + 1), (0, -(2**63)), (7, 7 + 5 * 2**32)]:
        assert run(a) == run(a)
        assert run(a) != run(b), (a, b)


# -- defect 4: a stream left running when its event loop ends -----------------------------------
def test_stream_left_by_a_finished_event_loop_frees_its_id_and_kv(engine, prompts, reference):
    async def leave_running():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompts[1], LONG, request_id="orphan"):
                started.set()

        asyncio.create_task(consume())  # still streaming when asyncio.run returns
        await started.wait()

    _run(leave_running())
    # The next event loop reuses the id at once: the departed client's request is aborted first.
    deltas = _run(_collect(engine, prompts[0], GREEDY, "orphan"))
    assert _tokens(deltas) == reference[0].token_ids
    _run(wait_kv_free(engine))


def _leave_a_stream_on_a_closed_loop(engine: AsyncEngine, prompt, request_id: str) -> list:
    """A stream left running on an event loop closed with its consumer still pending (no task cancellation, no
    async-generator shutdown); returns the pending tasks, which the caller keeps until it wants them collected."""
    loop = asyncio.new_event_loop()
    keep = []

    async def leave_running():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompt, LONG, request_id=request_id):
                started.set()

        keep.append(asyncio.get_running_loop().create_task(consume()))
        await started.wait()

    loop.run_until_complete(leave_running())
    loop.close()
    return keep


def test_stream_of_a_loop_closed_without_cleanup_is_aborted_when_engine_is_next_driven(
    engine, prompts, reference, caplog
):
    """The loop is closed with the consumer still pending (no task cancellation, no async-generator
    shutdown): nothing ever runs the stream's cleanup. A later loop, using another id, frees it."""
    keep = _leave_a_stream_on_a_closed_loop(engine, prompts[2], "abandoned")
    deltas = _run(_collect(engine, prompts[0], GREEDY, "next-client"))
    assert _tokens(deltas) == reference[0].token_ids
    _run(wait_kv_free(engine))
    # Collecting the dead loop's pending tasks (the consumer and the engine's old loop task) closes
    # their coroutines: that is no engine failure.
    with caplog.at_level(logging.ERROR, logger="asyncspec"):
        keep.clear()
        gc.collect()
    assert not [r for r in caplog.records if r.name.startswith("asyncspec")], caplog.records
    assert _tokens(_run(_collect(engine, prompts[0], GREEDY, "abandoned"))) == reference[0].token_ids


# -- defect 5: generate() during shutdown() ---------------------------------------------------
def test_generate_during_shutdown_is_refused_cleanly(prompts, caplog):
    engine = _new_engine()

    async def main():
        seen = asyncio.Event()
        outcome: dict = {}

        async def consume():
            try:
                async for _ in engine.generate(prompts[0], LONG, request_id="inflight"):
                    seen.set()
            except EngineDeadError as e:
                outcome["inflight"] = e

        task = asyncio.create_task(consume())
        await seen.wait()
        stopping = asyncio.create_task(engine.shutdown())
        await asyncio.sleep(0)  # shutdown has begun and waits for the step in flight
        assert not stopping.done()
        with pytest.raises(EngineDeadError, match="the engine was shut down") as late:
            await _collect(engine, prompts[1], GREEDY, "late")
        outcome["late"] = late.value
        await stopping
        await task
        with pytest.raises(EngineDeadError, match="the engine was shut down"):
            await _collect(engine, prompts[1], GREEDY, "after")
        return outcome

    with caplog.at_level(logging.ERROR, logger="asyncspec"):
        outcome = _run(main())
    assert str(outcome["inflight"]) == "the engine was shut down"
    assert not [r for r in caplog.records if r.name.startswith("asyncspec")], caplog.records
    assert_kv_free(engine.stats())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_shutdown_while_a_text_prompt_is_tokenized_ends_its_stream(prompts, async_scheduling):
    """Regression: the request registered after shutdown() had finished, restarted the engine loop and its
    stream never got an output or an error."""
    engine = _new_engine(async_scheduling=async_scheduling)
    make_request = engine.engine.make_request
    tokenizing, release = threading.Event(), threading.Event()

    def slow_make_request(*args, **kwargs):
        tokenizing.set()
        release.wait(TIMEOUT)
        return make_request(*args, **kwargs)

    engine.engine.make_request = slow_make_request  # type: ignore[method-assign]

    async def main():
        client = asyncio.create_task(_collect(engine, "def main():\n", GREEDY, "tokenizing"))
        await asyncio.get_running_loop().run_in_executor(None, tokenizing.wait, TIMEOUT)
        await engine.shutdown()
        release.set()
        with pytest.raises(EngineDeadError, match="the engine was shut down"):
            await asyncio.wait_for(client, 10)
        assert engine._loop_task is None or engine._loop_task.done()

    _run(main())


def test_shutdown_after_the_driving_loop_was_closed_stops_the_engine(prompts):
    """The loop that drove the engine closed with a stream still pending: shutdown() from another loop ends the
    engine and its threads, and fails no more on the dead loop's task."""
    before = set(threading.enumerate())
    engine = _new_engine(async_scheduling=True)
    keep = _leave_a_stream_on_a_closed_loop(engine, prompts[2], "abandoned")
    assert set(threading.enumerate()) - before  # the engine's worker threads
    _run(engine.shutdown())
    left = {t.name for t in set(threading.enumerate()) - before if t.is_alive()}
    assert not left, left
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        _run(_collect(engine, prompts[0], GREEDY, "after"))
    keep.clear()


def test_prompt_that_is_not_unicode_text_is_a_typed_error(engine, prompts, reference):
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        _run(_collect(engine, "def f():\ud800\n", GREEDY, "surrogate"))
    assert _tokens(_run(_collect(engine, prompts[0], GREEDY, "after-surrogate"))) == reference[0].token_ids


# -- defect 6: stop strings without a tokenizer -------------------------------------------------
def test_stop_strings_without_tokenizer_are_refused(prompts):
    engine = _new_engine(skip_tokenizer_init=True)

    async def main():
        with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
            await _collect(engine, prompts[0], SamplingParams(stop=["\n"], max_tokens=4), "s")
        # Stop token ids still work, and the engine serves on.
        deltas = await _collect(engine, prompts[0], GREEDY, "ok")
        await engine.shutdown()
        return deltas

    deltas = _run(main())
    assert len(_tokens(deltas)) == 10 and all(d.text == "" for d in deltas)
    assert_ids_in_vocab(_tokens(deltas))
    llm = bundled_llm(**CONFIG, skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        llm.generate(prompts[:1], SamplingParams(stop="x"))
