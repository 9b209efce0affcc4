"""AsyncEngine: streamed deltas, concurrency, aborts, client disconnects, request errors, shutdown.

No pytest-asyncio: each test runs its own event loop with asyncio.run. One AsyncEngine instance is shared by
the module (its loop task is restarted by each new event loop), and must be whole (no KV used) between tests.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncspec import AsyncEngine, SamplingParams
from asyncspec.config import make_config
from asyncspec.errors import (
    AsyncSpecError,
    EngineDeadError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    QueueFullError,
)
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import (
    assert_ids_in_vocab,
    assert_kv_free,
    bundled_llm,
    wait_kv_free,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
TIMEOUT = 60.0


def _new_engine(async_scheduling: bool, **overrides) -> AsyncEngine:
    return AsyncEngine(make_config(str(TARGET_MODEL), **{**CONFIG, "async_scheduling": async_scheduling, **overrides}))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_scheduling(request):
    """Every test runs against the synchronous loop and the asynchronous (pipelined) one."""
    return request.param


@pytest.fixture(scope="module")
def engine(one_thread, async_scheduling):
    eng = _new_engine(async_scheduling)
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def prompts():
    return [p[:48] for p in load_prompts(8)]


@pytest.fixture(scope="module")
def reference(prompts, one_thread):
    llm = bundled_llm(**CONFIG)
    return llm.generate(prompts, GREEDY)


@pytest.fixture(autouse=True)
def _engine_whole_after(request):
    yield
    if "engine" in request.fixturenames:
        assert_kv_free(request.getfixturevalue("engine").stats())


async def _collect(engine, prompt, params, request_id, log=None):
    deltas = []
    async for delta in engine.generate(prompt, params, request_id=request_id):
        deltas.append(delta)
        if log is not None:
            log.append(request_id)
    return deltas


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def test_deltas_concatenate_to_llm_output_and_interleave(engine, prompts, reference):
    log: list[str] = []

    async def main():
        return await asyncio.gather(*(_collect(engine, p, GREEDY, f"cat-{i}", log) for i, p in enumerate(prompts)))

    results = _run(main())
    for i, (deltas, ref) in enumerate(zip(results, reference, strict=True)):
        assert all(d.request_id == f"cat-{i}" for d in deltas)
        assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
        assert deltas[-1].finish_reason == "length"
        tokens = [t for d in deltas for t in d.token_ids]
        assert_ids_in_vocab(tokens)
        assert tokens == ref.token_ids
        assert "".join(d.text for d in deltas) == ref.text
        assert len(deltas) > 1, "a request of 12 tokens must stream more than one delta"
    # Streams interleave: some request gets a delta after another request's first and before its last.
    first = {r: log.index(r) for r in set(log)}
    last = {r: len(log) - 1 - log[::-1].index(r) for r in set(log)}
    assert any(first[a] < first[b] < last[a] for a in first for b in first if a != b)


def test_sampled_and_seeded_requests_mix(engine, prompts):
    """Seeded sampling is the same alone and amid greedy / unseeded neighbours (through the async path)."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)

    async def alone():
        return await _collect(engine, prompts[0], seeded, "seed-alone")

    async def crowd():
        others = [
            _collect(engine, prompts[1], SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True), "u1"),
            _collect(engine, prompts[2], GREEDY, "g1"),
            _collect(engine, prompts[0], seeded, "seed-crowd"),
            _collect(engine, prompts[3], SamplingParams(temperature=0.7, seed=5, max_tokens=6), "s5"),
        ]
        return await asyncio.gather(*others)

    a = [t for d in _run(alone()) for t in d.token_ids]
    c = [t for d in _run(crowd())[2] for t in d.token_ids]
    assert a == c and len(a) == 10


def test_abort_mid_stream(engine, prompts):
    async def main():
        deltas = []
        async for delta in engine.generate(prompts[0], LONG, request_id="to-abort"):
            deltas.append(delta)
            if len(deltas) == 3:
                await engine.abort("to-abort")
        await wait_kv_free(engine)
        return deltas

    deltas = _run(main())
    assert deltas[-1].finish_reason == "abort"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert len([t for d in deltas for t in d.token_ids]) < 200


def _held_make_request(engine):
    """(tokenizing, release, make_request): a make_request that sets `tokenizing`, then holds the request in the
    tokenizer's executor until `release` is set, so that a test can act while a text prompt is being tokenized."""
    tokenizing, release = threading.Event(), threading.Event()
    make_request = engine.engine.make_request

    def held(*args, **kwargs):
        tokenizing.set()
        release.wait(10)
        return make_request(*args, **kwargs)

    return tokenizing, release, held


def test_an_abort_while_the_text_prompt_is_tokenized_ends_the_stream_with_abort(engine, monkeypatch):
    """A server's drain aborts every stream it has, one whose text prompt is still being tokenized (off the event
    loop) included: the abort is applied once the stream registers, not dropped as an unknown id's (the request
    then ran on until the engine stopped)."""
    tokenizing, release, slow_make_request = _held_make_request(engine)

    monkeypatch.setattr(engine.engine, "make_request", slow_make_request)

    async def main():
        task = asyncio.ensure_future(_collect(engine, "def main():\n    return", LONG, "tokenizing"))
        while not tokenizing.is_set():
            await asyncio.sleep(0.001)
        await engine.abort("tokenizing")
        release.set()
        deltas = await task
        await wait_kv_free(engine)
        return deltas

    deltas = _run(main())
    assert deltas[-1].finish_reason == "abort"
    assert len([t for d in deltas for t in d.token_ids]) < 200
    assert not engine.has_request("tokenizing")


def test_an_abort_of_a_live_id_aborts_that_stream_while_a_duplicate_is_tokenized(engine, prompts, monkeypatch):
    """A stream runs under an id while a second request with that id (a text prompt) is being tokenized: an abort
    ends the live stream, not the second request, which then runs under the freed id."""
    tokenizing, release, slow_make_request = _held_make_request(engine)

    async def main():
        live = engine.generate(prompts[0], LONG, request_id="twice")
        first = [await live.__anext__()]
        monkeypatch.setattr(engine.engine, "make_request", slow_make_request)
        second = asyncio.ensure_future(_collect(engine, "def main():", GREEDY, "twice"))
        while not tokenizing.is_set():
            await asyncio.sleep(0.001)
        await engine.abort("twice")
        first += [delta async for delta in live]
        release.set()
        later = await second
        await wait_kv_free(engine)
        return first, later

    deltas, later = _run(main())
    assert deltas[-1].finish_reason == "abort"
    assert len([t for d in deltas for t in d.token_ids]) < 200
    assert later[-1].finish_reason == "length" and sum(len(d.token_ids) for d in later) == GREEDY.max_tokens


def test_an_aborted_streams_last_output_keeps_its_prefix_cache_hit(engine, prompts):
    """The gRPC usage of an aborted stream takes its last output's cached-token count."""

    async def main():
        async for _ in engine.generate(prompts[1], SamplingParams(max_tokens=2), request_id="warm-prefix"):
            pass
        deltas = []
        async for delta in engine.generate(prompts[1], LONG, request_id="abort-cached"):
            deltas.append(delta)
            if len(deltas) == 3:
                await engine.abort("abort-cached")
        await wait_kv_free(engine)
        return deltas

    deltas = _run(main())
    assert deltas[-1].finish_reason == "abort" and deltas[0].num_cached_tokens > 0
    assert {d.num_cached_tokens for d in deltas} == {deltas[0].num_cached_tokens}


def test_abort_unknown_or_finished_id_is_harmless(engine, prompts, reference):
    async def main():
        await engine.abort("never-existed")
        deltas = await _collect(engine, prompts[0], GREEDY, "done-then-abort")
        await engine.abort("done-then-abort")
        again = await _collect(engine, prompts[0], GREEDY, "done-then-abort")  # the id is free again
        await wait_kv_free(engine)
        return deltas, again

    deltas, again = _run(main())
    assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids
    assert [t for d in again for t in d.token_ids] == reference[0].token_ids


def test_client_break_frees_kv(engine, prompts, reference):
    async def main():
        got = 0
        async for delta in engine.generate(prompts[1], LONG, request_id="breaker"):
            got += len(delta.token_ids)
            if got >= 2:
                break
        stats = await wait_kv_free(engine)
        # The engine still serves, and the id can be reused.
        deltas = await _collect(engine, prompts[0], GREEDY, "breaker")
        return stats, deltas

    stats, deltas = _run(main())
    assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids


def test_client_aclose_frees_kv(engine, prompts):
    async def main():
        stream = engine.generate(prompts[1], LONG, request_id="closer")
        await stream.__anext__()
        await stream.aclose()
        return await wait_kv_free(engine)

    _run(main())


def test_cancelled_task_frees_kv(engine, prompts, reference):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(prompts[2], LONG, request_id="cancelled"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_kv_free(engine)
        return await _collect(engine, prompts[0], GREEDY, "after-cancel")

    deltas = _run(main())
    assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids


def test_cancel_before_first_step(engine, prompts):
    """A client that leaves before its request was ever scheduled."""

    async def main():
        task = asyncio.create_task(_collect(engine, prompts[3], LONG, "early-cancel"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_kv_free(engine)

    _run(main())


def test_duplicate_running_request_id_is_refused(engine, prompts, reference):
    async def main():
        first = asyncio.create_task(_collect(engine, prompts[0], GREEDY, "dup"))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError):
            await _collect(engine, prompts[1], GREEDY, "dup")
        return await first

    deltas = _run(main())
    assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(prompt=[]), InvalidRequestError),
        (dict(prompt=[1, 2, 8192]), InvalidRequestError),
        (dict(prompt=[1, -1, 3]), InvalidRequestError),
        (dict(prompt=[5] * 256), InvalidRequestError),  # prompt too long for max_model_len=256
        (dict(prompt=[1, 2.0]), InvalidRequestError),
        (dict(params=SamplingParams(stop_token_ids=[9000])), InvalidSamplingParamsError),
        (dict(params="greedy"), InvalidRequestError),
        (dict(request_id=""), InvalidRequestError),
        (dict(priority="high"), InvalidRequestError),
    ],
)
def test_invalid_request_is_typed_error_and_others_unharmed(engine, prompts, reference, bad, error):
    async def main():
        good = asyncio.create_task(_collect(engine, prompts[0], GREEDY, "good"))
        await asyncio.sleep(0)
        kwargs = dict(prompt=prompts[1], params=GREEDY, request_id="bad", priority=0)
        kwargs.update(bad)
        with pytest.raises(error):
            async for _ in engine.generate(
                kwargs["prompt"], kwargs["params"], request_id=kwargs["request_id"], priority=kwargs["priority"]
            ):
                pass
        return await good

    deltas = _run(main())
    assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids
    assert "".join(d.text for d in deltas) == reference[0].text


def test_invalid_sampling_params_rejected_at_construction():
    for kwargs in (
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(max_tokens=0),
        dict(logprobs=21),
        dict(min_tokens=5, max_tokens=2),
        dict(stop=[""]),
    ):
        with pytest.raises(InvalidSamplingParamsError):
            SamplingParams(**kwargs)
    assert issubclass(InvalidSamplingParamsError, AsyncSpecError)


async def _burst(engine, prompts, n: int) -> list:
    """n greedy requests submitted at once to an idle engine; each one's deltas or its exception. Shuts it down."""
    tasks = [asyncio.create_task(_collect(engine, prompts[i % 2], GREEDY, f"burst{i}")) for i in range(n)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await wait_kv_free(engine)
    await engine.shutdown()
    return results


def test_queue_full_is_typed_and_nothing_lost(prompts, reference, async_scheduling):
    engine = _new_engine(async_scheduling, max_num_waiting=1, max_num_seqs=1)
    results = _run(_burst(engine, prompts, 4))
    served = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert served, "at least one request is served"
    assert all(isinstance(e, QueueFullError) for e in refused), refused
    for i, r in enumerate(results):
        if not isinstance(r, BaseException):
            assert [t for d in r for t in d.token_ids] == reference[i % 2].token_ids


def test_a_burst_on_an_idle_engine_is_refused_only_past_the_free_slots_and_the_queue(prompts, async_scheduling):
    """max_num_waiting bounds the requests that really wait: a burst's first max_num_seqs go straight into the
    free running slots at the next step, so they do not count against it."""
    engine = _new_engine(async_scheduling, max_num_waiting=2, max_num_seqs=3)
    results = _run(_burst(engine, prompts, 7))
    assert [isinstance(r, QueueFullError) for r in results] == [False] * 5 + [True] * 2, results


def test_shutdown_ends_in_flight_streams(prompts, async_scheduling):
    """After shutdown no stream hangs: in-flight ones end (abort or a typed error), new ones are refused."""
    engine = _new_engine(async_scheduling)

    async def main():
        seen = asyncio.Event()
        outcome = {}

        async def consume():
            deltas = []
            try:
                async for d in engine.generate(prompts[0], LONG, request_id="inflight"):
                    deltas.append(d)
                    seen.set()
            except AsyncSpecError as e:
                outcome["error"] = e
            outcome["deltas"] = deltas

        task = asyncio.create_task(consume())
        await seen.wait()
        await engine.shutdown()
        await asyncio.wait_for(task, 10.0)
        with pytest.raises(AsyncSpecError):
            async for _ in engine.generate(prompts[1], GREEDY, request_id="late"):
                pass
        return outcome

    outcome = _run(main())
    assert "error" in outcome or outcome["deltas"][-1].finish_reason == "abort"
    assert_kv_free(engine.stats())


def test_engine_failure_ends_every_stream(prompts, async_scheduling):
    engine = _new_engine(async_scheduling)
    calls = {"n": 0}
    # The synchronous loop's step() is one retirement; the asynchronous loop's step() retires through it.
    name = "retire_oldest" if async_scheduling else "step"
    real_step = getattr(engine.engine.engine_core, name)

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected worker failure")
        return real_step()

    setattr(engine.engine.engine_core, name, failing_step)

    async def main():
        tasks = [asyncio.create_task(_collect(engine, p, LONG, f"f{i}")) for i, p in enumerate(prompts[:3])]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate(prompts[0], GREEDY, request_id="after-death"):
                pass
        await engine.shutdown()
        return results

    results = _run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results


def test_streamed_logprobs_and_stop_string_match_llm(engine, prompts, reference):
    """Deltas carry one logprobs entry per token; with include_stop_str_in_output the streamed text
    ends with the stop string, exactly as LLM.generate returns it."""
    text = reference[2].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, stop=[stop], include_stop_str_in_output=True
    )
    expected = bundled_llm(**CONFIG).generate([prompts[2]], params)[0]

    deltas = _run(_collect(engine, prompts[2], params, "lp"))
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas if d.logprobs is not None)
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text and expected.text.endswith(stop)
    streamed_lp = [lp for d in deltas for lp in (d.logprobs or [])]
    assert [lp.token_ids for lp in streamed_lp] == [lp.token_ids for lp in expected.logprobs]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop


def test_engine_serves_across_event_loops(engine, prompts, reference):
    """An AsyncEngine outlives one asyncio.run: a later event loop drives it again (regression: its
    wake-up Event stayed bound to the first loop and the engine died)."""
    for i in range(2):
        deltas = _run(_collect(engine, prompts[0], GREEDY, f"loop-{i}"))
        assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids


def test_id_reused_right_after_client_left_is_never_silently_aborted(engine, prompts, reference):
    async def main():
        stream = engine.generate(prompts[1], LONG, request_id="reuse")
        await stream.__anext__()
        await stream.aclose()  # its abort is pending, not applied yet
        try:
            deltas = await _collect(engine, prompts[0], GREEDY, "reuse")
        except InvalidRequestError:
            deltas = None  # "already in use" until the abort is applied: typed, acceptable
        await wait_kv_free(engine)
        return deltas

    deltas = _run(main())
    if deltas is not None:
        assert deltas[-1].finish_reason == "length"
        assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids


async def _break_after_first(engine, prompt, request_id) -> None:
    """A client that breaks out of its `async for` and returns, leaving the generator to asyncio's finalizer."""
    async for _ in engine.generate(prompt, LONG, request_id=request_id):
        break


def test_id_reused_right_after_a_client_broke_out_is_free(engine, prompts, reference):
    """generate() promises that the id of a client that just left is free once its abort is applied: also when
    the client broke out of `async for` without closing the generator (the common way to stop reading)."""

    async def main():
        outputs = []
        for _ in range(3):
            await _break_after_first(engine, prompts[1], "broke-out")
            outputs.append(await _collect(engine, prompts[0], GREEDY, "broke-out"))
        await wait_kv_free(engine)
        return outputs

    for deltas in _run(main()):
        assert deltas[-1].finish_reason == "length"
        assert [t for d in deltas for t in d.token_ids] == reference[0].token_ids


def test_pipelined_loop_lets_other_tasks_run_every_step(prompts, monkeypatch):
    """When each step's results are ready by the time the loop looks (a device ahead of the host),
    the asynchronous loop must still yield every turn: a ticker task keeps running while a stream
    is generated."""
    engine = _new_engine(True)
    runner = engine.engine.engine_core.runner
    launch = runner.launch

    def launch_and_finish(so):
        # A handle whose results are already on the host, as a CUDA step's are when the device is
        # ahead: nothing in the turn has to wait for it.
        from asyncspec.worker.model_runner import StepHandle

        handle = launch(so)
        return StepHandle(output=handle.future.result()) if handle.future is not None else handle

    monkeypatch.setattr(runner, "launch", launch_and_finish)

    async def main():
        ticks = 0
        done = False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        deltas = await _collect(engine, prompts[0], LONG, "ticks")
        done = True
        await task
        await engine.shutdown()
        return ticks, deltas

    ticks, deltas = _run(main())
    assert sum(len(d.token_ids) for d in deltas) == LONG.max_tokens
    assert ticks >= LONG.max_tokens // 2, ticks


def test_coalesced_stream_merges_piled_up_deltas(engine, prompts, reference):
    """A consumer that sleeps between deltas receives fewer, merged ones: the same tokens, text and
    logprobs in order, the finish information on the last."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    async def main():
        plain = [d async for d in engine.generate(prompts[0], params, request_id="plain")]
        merged = []
        async for d in engine.generate(prompts[0], params, request_id="merged", coalesce=True):
            merged.append(d)
            # A consumer that falls behind: it reads on only once the engine has queued the request's last
            # delta (a fixed pause merged nothing on a loaded 2-core CI host, whose steps outlasted it).
            for _ in range(1000):
                if not engine.has_request("merged"):
                    break
                await asyncio.sleep(0.01)
        return plain, merged

    plain, merged = _run(main())
    assert len(plain) > 2
    assert len(merged) <= 2  # the first delta, then everything that piled up behind it as one
    for field in ("token_ids", "logprobs"):
        assert [x for d in merged for x in getattr(d, field)] == [x for d in plain for x in getattr(d, field)]
    assert "".join(d.text for d in merged) == "".join(d.text for d in plain)
    assert merged[-1].finish_reason == plain[-1].finish_reason == "length"


def test_coalescing_stops_before_max_coalesced_tokens(engine, prompts, reference):
    """With a cap, the deltas that piled up arrive merged up to it: the same tokens in order, no merged
    delta past the cap, and the finish on the last."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)

    async def main():
        plain = [d async for d in engine.generate(prompts[0], params, request_id="plain")]
        capped = []
        stream = engine.generate(prompts[0], params, request_id="capped", coalesce=True, max_coalesced_tokens=5)
        async for d in stream:
            capped.append(d)
            for _ in range(1000):  # fall behind until the request's last delta is queued
                if not engine.has_request("capped"):
                    break
                await asyncio.sleep(0.01)
        return plain, capped

    plain, capped = _run(main())
    assert all(len(d.token_ids) <= 5 for d in capped)
    assert len(capped) >= 12 // 5 + 1 and max(len(d.token_ids) for d in capped) > max(len(d.token_ids) for d in plain)
    for field in ("token_ids", "logprobs"):
        assert [x for d in capped for x in getattr(d, field)] == [x for d in plain for x in getattr(d, field)]
    assert "".join(d.text for d in capped) == "".join(d.text for d in plain)
    assert capped[-1].finish_reason == "length" and not any(d.finished for d in capped[:-1])


def test_waiting_to_reuse_an_id_wakes_when_its_request_ends_on_its_own(async_scheduling):
    """A cancelled stream's request finished in the step that was running when its abort was
    queued: the abort is moot, and a generate() waiting to reuse the id must wake, not hang."""
    from asyncspec.outputs import RequestOutput

    engine = _new_engine(async_scheduling)

    async def main():
        # The events only, no loop task: nothing else may apply the abort meanwhile.
        engine._wakeup, engine._aborts_applied = asyncio.Event(), asyncio.Event()
        engine._pending_aborts.append("x")
        waiter = asyncio.create_task(engine._wait_for_abort("x"))
        await asyncio.sleep(0.01)
        engine._deliver(RequestOutput(request_id="x", prompt_token_ids=[1], finish_reason="length"))
        await asyncio.wait_for(waiter, 5.0)
        await engine.shutdown()

    _run(main())


def test_next_step_runs_while_the_previous_outputs_are_delivered(async_scheduling) -> None:
    """The worker thread does not wait for the deliveries: when a step's outputs are put on their
    streams, the next step has already been handed to the worker thread (128 streams' deliveries are
    a fraction of a millisecond of the event loop's time). Each stream still receives its deltas in
    order and complete."""
    import threading

    eng = _new_engine(async_scheduling)
    lock = threading.Lock()
    started = 0
    produced_by: dict[int, int] = {}  # id(output) -> the step call that returned it
    step = eng.engine.step

    def counting_step():
        nonlocal started
        with lock:
            started += 1
            k = started
        outputs = step()
        for out in outputs:
            produced_by[id(out)] = k
        return outputs

    eng.engine.step = counting_step  # type: ignore[method-assign]
    submitted = 0  # steps handed to the worker thread (they run in this order)
    submit = eng._executor.submit

    def counting_submit(fn, *args, **kwargs):
        nonlocal submitted
        submitted += 1
        return submit(fn, *args, **kwargs)

    eng._executor.submit = counting_submit  # type: ignore[method-assign]
    at_delivery: list[tuple[int, int]] = []  # (the step that produced it, steps handed over when delivered)
    deliver = eng._deliver

    def recording_deliver(output):
        if id(output) in produced_by:
            at_delivery.append((produced_by[id(output)], submitted))
        deliver(output)

    eng._deliver = recording_deliver  # type: ignore[method-assign]

    async def consume(prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in eng.generate(prompt, GREEDY):
            tokens.extend(out.token_ids)
        return tokens

    prompts = [p[:40] for p in load_prompts(3)]

    async def main() -> list[list[int]]:
        results = await asyncio.gather(*(consume(p) for p in prompts))
        await eng.shutdown()
        return results

    results = asyncio.run(main())
    assert results == [list(r.token_ids) for r in bundled_llm().generate(prompts, GREEDY)]
    last = max(k for k, _ in at_delivery)
    behind = [(k, s) for k, s in at_delivery if k < last]
    assert len(behind) > 10
    assert all(s > k for k, s in behind), [(k, s) for k, s in behind if s <= k][:5]
