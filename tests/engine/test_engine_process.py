"""EngineProcessClient: the engine in a process of its own behind AsyncEngine's serving interface (CPU, the
bundled model). One client serves the module on one event loop; each test leaves its KV pool free."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncspec import SamplingParams
from asyncspec.config import make_config
from asyncspec.engine.engine_process import EngineProcessClient, EngineProcessStartError
from asyncspec.errors import EngineDeadError, InvalidRequestError, InvalidSamplingParamsError
from tests.conftest import TARGET_MODEL, load_prompts
from tests.engine.engine_helpers import assert_ids_in_vocab, assert_kv_free, bundled_llm, wait_kv_free

CONFIG = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(loop):
    config = make_config(str(TARGET_MODEL), **CONFIG, async_scheduling=True)
    client = loop.run_until_complete(EngineProcessClient.launch(config))
    yield client
    loop.run_until_complete(client.shutdown())


@pytest.fixture(scope="module")
def prompts():
    return [p[:48] for p in load_prompts(6)]


async def _collect(client, prompt, params, **kwargs):
    return [delta async for delta in client.generate(prompt, params, **kwargs)]


def test_concurrent_streams_equal_the_in_process_engine(loop, client, prompts):
    reference = bundled_llm(**CONFIG).generate(prompts, GREEDY)

    async def run():
        return await asyncio.gather(*(_collect(client, p, GREEDY, coalesce=True) for p in prompts))

    streams = loop.run_until_complete(run())
    for deltas, ref in zip(streams, reference, strict=True):
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == ref.token_ids
        # The prompt's ids cross the pipe once; every delta still carries them.
        assert len(deltas) > 1 and all(d.prompt_token_ids == ref.prompt_token_ids for d in deltas)
        assert deltas[-1].num_cached_tokens == ref.num_cached_tokens
        assert deltas[-1].queued_seconds is not None
        assert "".join(d.text for d in deltas) == ref.text
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert all(not d.finished for d in deltas[:-1])
        assert_ids_in_vocab(tokens)
    assert_kv_free(loop.run_until_complete(wait_kv_free(client)))


def test_text_prompt_and_engine_facts(loop, client):
    reference = bundled_llm(**CONFIG).generate(["def add(a, b):"], GREEDY)[0]
    deltas = loop.run_until_complete(_collect(client, "def add(a, b):", GREEDY))
    assert [t for d in deltas for t in d.token_ids] == reference.token_ids
    assert all(d.prompt_token_ids == reference.prompt_token_ids for d in deltas)
    # The same id again: its prompt is sent anew, not taken from the finished request.
    again = loop.run_until_complete(_collect(client, [5, 6, 7], GREEDY, request_id="same"))
    again += loop.run_until_complete(_collect(client, [8, 9], GREEDY, request_id="same"))
    assert [d.prompt_token_ids for d in again if d.finished] == [[5, 6, 7], [8, 9]]
    info = client.engine
    assert info.vocab_size == 8192 and info.max_model_len == 256 and info.config.model == str(TARGET_MODEL)
    assert info.tokenizer.encode("def", add_special_tokens=False).ids  # the tokenizer crossed the pipe


def test_client_leaving_early_aborts_frees_kv_and_the_id_is_reusable(loop, client, prompts):
    before = client.stats()["num_generation_tokens"]

    async def run():
        stream = client.generate(prompts[0], LONG, request_id="leaver")
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()  # the client goes away mid-stream
        assert not client.has_request("leaver")
        # The id is free once the engine has applied the abort; generate() waits for that.
        again = await _collect(client, prompts[1], GREEDY, request_id="leaver")
        assert again[-1].finish_reason == "length"
        return await wait_kv_free(client)

    stats = loop.run_until_complete(run())
    assert_kv_free(stats)
    # The leaver was aborted, not run to its 200 tokens (which would also free its KV and its id).
    assert stats["num_generation_tokens"] - before < LONG.max_tokens + GREEDY.max_tokens


def test_id_reused_right_after_a_client_broke_out_is_free(loop, client, prompts):
    async def break_after_first() -> None:
        async for _ in client.generate(prompts[0], LONG, request_id="broke-out"):
            break  # the generator is left to asyncio's finalizer

    async def run():
        for _ in range(3):
            await break_after_first()
            again = await _collect(client, prompts[1], GREEDY, request_id="broke-out")
            assert again[-1].finish_reason == "length"
        return await wait_kv_free(client)

    assert_kv_free(loop.run_until_complete(run()))


def test_abort_by_id_ends_the_stream_with_abort(loop, client, prompts):
    async def run():
        deltas = []
        async for delta in client.generate(prompts[2], LONG, request_id="to-abort"):
            deltas.append(delta)
            if len(deltas) == 1:
                await client.abort("to-abort")
        await client.abort("never-seen")  # ignored
        return deltas

    deltas = loop.run_until_complete(run())
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert len([t for d in deltas for t in d.token_ids]) < LONG.max_tokens
    assert_kv_free(loop.run_until_complete(wait_kv_free(client)))


def test_bad_requests_get_typed_errors_and_lose_nothing(loop, client, prompts):
    async def run():
        with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
            await _collect(client, prompts[0], SamplingParams(max_tokens=-1))
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await _collect(client, list(range(300)), GREEDY)
        with pytest.raises(InvalidRequestError, match="request_id"):
            await _collect(client, prompts[0], GREEDY, request_id=7)
        with pytest.raises(InvalidRequestError, match="cannot be sent to the engine process"):
            await _collect(client, [1, 2, lambda: 3], GREEDY, request_id="unpicklable")
        assert not client.has_request("unpicklable")  # nothing registered: the id stays free
        long_stream = client.generate(prompts[0], LONG, request_id="busy")
        await long_stream.__anext__()
        with pytest.raises(InvalidRequestError, match="already in use"):
            await _collect(client, prompts[1], GREEDY, request_id="busy")
        await long_stream.aclose()
        return await _collect(client, prompts[3], GREEDY)

    deltas = loop.run_until_complete(run())
    reference = bundled_llm(**CONFIG).generate([prompts[3]], GREEDY)[0]
    assert [t for d in deltas for t in d.token_ids] == reference.token_ids
    assert_kv_free(loop.run_until_complete(wait_kv_free(client)))


def test_step_listeners_and_the_stats_snapshot_follow_the_steps(loop, client, prompts):
    counted: list[int] = []
    client.add_step_listener(counted.append)
    fresh = prompts[4][::-1]  # a prompt no earlier test cached: every token is prefilled
    before = client.stats()
    loop.run_until_complete(_collect(client, fresh, GREEDY))
    after = client.stats()
    generated = after["num_generation_tokens"] - before["num_generation_tokens"]
    prefilled = after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"]
    assert generated == GREEDY.max_tokens and prefilled == len(fresh)
    # Every step's token count reaches the listeners: the prompt's, then one per decode step.
    assert sum(counted) == prefilled + generated - 1
    assert client.stats_snapshot()["num_generation_tokens"] == after["num_generation_tokens"]


def test_a_killed_engine_process_ends_every_stream_and_tells_the_listeners(prompts):
    loop = asyncio.new_event_loop()
    try:
        config = make_config(str(TARGET_MODEL), **CONFIG)
        client = loop.run_until_complete(EngineProcessClient.launch(config))
        assert client.stats_snapshot()["num_kv_blocks"] == CONFIG["num_kv_blocks"]  # known before any step
        deaths: list[EngineDeadError] = []
        client.add_death_listener(deaths.append)

        async def run():
            stream = client.generate(prompts[0], LONG)
            await stream.__anext__()
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await _collect(client, prompts[1], GREEDY)

        loop.run_until_complete(asyncio.wait_for(run(), 60))
        assert len(deaths) == 1 and not client.is_running
        start = time.monotonic()
        assert client.stats()["num_kv_blocks"] == CONFIG["num_kv_blocks"]  # the last snapshot, at once
        assert time.monotonic() - start < 1.0

        async def shut_down_twice():
            await asyncio.gather(client.shutdown(), client.shutdown())  # the second waits for the first

        loop.run_until_complete(shut_down_twice())
        assert client._process.exitcode is not None
    finally:
        loop.close()


def test_an_id_reused_while_the_engine_process_dies_gets_engine_dead_not_a_stream_that_never_ends(prompts):
    """A client retries with the id of a live stream just as the engine process dies: the death is handled inside
    the new call's wait for the old stream's finalizer, and the call must then fail, not register a stream that
    nothing will ever end."""
    loop = asyncio.new_event_loop()
    try:
        dying = loop.run_until_complete(EngineProcessClient.launch(make_config(str(TARGET_MODEL), **CONFIG)))

        async def run() -> None:
            first = dying.generate(prompts[0], LONG, request_id="x")
            await first.__anext__()
            os.kill(dying.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not dying._gone and time.monotonic() < deadline:
                time.sleep(0.01)  # blocks the loop: the reader's exit callback waits for the next await
            assert dying._gone
            dying._reader.join(5)
            second = dying.generate(prompts[0], LONG, request_id="x")
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(10):
                    await second.__anext__()
            await first.aclose()

        loop.run_until_complete(run())
        loop.run_until_complete(dying.shutdown())
    finally:
        loop.close()


def test_an_engine_that_fails_to_load_is_a_start_error_with_its_message(tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(TARGET_MODEL, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    config = make_config(str(broken), **CONFIG)
    start = time.monotonic()
    with pytest.raises(EngineProcessStartError) as caught:
        asyncio.run(EngineProcessClient.launch(config))
    assert str(caught.value) and time.monotonic() - start < 60


def test_the_engine_process_exits_when_its_client_goes_away(prompts):
    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(EngineProcessClient.launch(make_config(str(TARGET_MODEL), **CONFIG)))
        stream = client.generate(prompts[0], LONG)
        loop.run_until_complete(stream.__anext__())
        client._conn.close()  # the server process died: its end of the pipe closes
        client._process.join(30)
        assert client._process.exitcode == 0, "the engine process should shut down cleanly on its own"
        loop.run_until_complete(stream.aclose())
    finally:
        loop.close()


def test_the_engine_process_exits_when_its_server_is_killed_while_the_model_loads(tmp_path):
    """The server is SIGKILLed while the engine process loads (here a load that sleeps, as a slow one on a GPU
    with warm-up): the engine process exits at once instead of finishing the load."""
    script = tmp_path / "server.py"
    script.write_text(
        "import asyncio, multiprocessing, os, signal, sys, threading, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from asyncspec.config import make_config\n"
        "from asyncspec.engine import async_engine\n"
        "from asyncspec.engine.engine_process import EngineProcessClient\n"
        "if __name__ == '__mp_main__':  # the spawned engine process imports this file first\n"
        "    async_engine.AsyncEngine.__init__ = lambda self, *args, **kwargs: time.sleep(600)\n"
        "def die():\n"
        "    time.sleep(2)\n"
        "    print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "if __name__ == '__main__':\n"
        f"    config = make_config({str(TARGET_MODEL)!r}, **{CONFIG!r})\n"
        "    threading.Thread(target=die, daemon=True).start()\n"
        "    asyncio.run(EngineProcessClient.launch(config))\n"
    )
    # Files, not pipes: an engine process that outlives the server would hold a pipe open, and reading it to its
    # end would wait for that process.
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        returncode = subprocess.Popen([sys.executable, str(script)], stdout=stdout, stderr=stderr).wait(timeout=60)
    assert returncode == -signal.SIGKILL, err.read_text()
    pids = [int(pid) for pid in out.read_text().split()]
    assert pids, err.read_text()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), "the engine process outlived its server while loading"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_abort_right_behind_its_add_is_applied_after_it(loop, client):
    """A text prompt is tokenized off the engine's event loop, so its add takes a while; a client that leaves
    at once sends the abort right behind it. The abort waits for the add, so the request never runs on."""
    text = "def parse(line):\n    " * 20

    async def run():
        before = client.stats()["num_generation_tokens"]
        first = asyncio.ensure_future(client.generate(text, LONG, request_id="hasty").__anext__())
        await asyncio.sleep(0)  # the add is sent
        first.cancel()  # the client leaves before any output: the generator's cleanup sends the abort
        with pytest.raises(asyncio.CancelledError):
            await first
        again = await _collect(client, text, GREEDY, request_id="hasty")  # free once the abort is applied
        stats = await wait_kv_free(client)
        return before, again, stats

    before, again, stats = loop.run_until_complete(run())
    assert again[-1].finish_reason == "length"
    assert_kv_free(stats)
    assert stats["num_generation_tokens"] - before < LONG.max_tokens + GREEDY.max_tokens


def test_the_wire_format_carries_every_field_of_a_request_output():
    """A delta crosses the pipe as a tuple: every field round-trips, whatever RequestOutput holds."""
    import dataclasses

    from asyncspec.engine.engine_process import _from_wire, _to_wire
    from asyncspec.outputs import RequestOutput, TokenLogprobs

    values = dict(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        token_ids=[4, 5],
        text="ab",
        finish_reason="stop",
        stop_reason="\n\n",
        logprobs=[TokenLogprobs(token_ids=[4], logprobs=[-0.5], sampled_token_rank=1)],
        num_cached_tokens=16,
        queued_seconds=0.25,
        num_draft_tokens=8,
        num_accepted_tokens=6,
        num_drafts=2,
        error="e",
    )
    assert set(values) == {f.name for f in dataclasses.fields(RequestOutput)}  # a new field must be added here
    output = RequestOutput(**values)
    assert _from_wire("r", [1, 2, 3], _to_wire(output, with_prompt=True)) == output
    assert _to_wire(output, with_prompt=False)[0] is None


def test_a_message_the_engine_process_cannot_apply_stops_it_instead_of_leaving_a_client_waiting():
    """The pipe's messages are applied as plain event-loop callbacks, whose errors asyncio would only log: a
    stats request that fails ends the host (the client then sees the process exit) rather than never answering."""
    from asyncspec.engine.engine_process import _EngineHost

    class BrokenStatsEngine:
        def add_step_listener(self, listener) -> None: ...
        def add_death_listener(self, listener) -> None: ...
        def start(self) -> None: ...
        def stats(self) -> dict:
            raise RuntimeError("broken counters")

    class Pipe:
        def send(self, message) -> None:
            raise AssertionError("nothing is sent for a failed stats request")

    async def run() -> bool:
        host = _EngineHost(BrokenStatsEngine(), Pipe())  # type: ignore[arg-type]
        host._on_message(("stats", 7))
        return host.done.is_set()

    assert asyncio.run(run())


def test_a_program_that_ends_without_shutdown_exits(tmp_path):
    """Regression: Python's exit joined the non-daemon engine process while the client's end of the pipe, which
    the engine process waits on, was still open: the program hung."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import asyncio, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from asyncspec.config import make_config\n"
        "from asyncspec.engine.engine_process import EngineProcessClient\n"
        "if __name__ == '__main__':  # the engine process is spawned: it imports this file\n"
        f"    config = make_config({str(TARGET_MODEL)!r}, **{CONFIG!r})\n"
        "    client = asyncio.run(EngineProcessClient.launch(config))\n"
        "    print(client.pid, flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the engine process is gone too


def test_a_program_that_ends_mid_stream_without_shutdown_exits_quietly(tmp_path):
    """The reader thread outlives the event loop when a program returns while a stream runs: it stops without a
    traceback ("Event loop is closed", "cannot read from the engine process")."""
    script = tmp_path / "leave_busy.py"
    script.write_text(
        "import asyncio, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from asyncspec import SamplingParams\n"
        "from asyncspec.config import make_config\n"
        "from asyncspec.engine.engine_process import EngineProcessClient\n"
        "async def main():\n"
        f"    client = await EngineProcessClient.launch(make_config({str(TARGET_MODEL)!r}, **{CONFIG!r}))\n"
        "    async def long():\n"
        "        async for _ in client.generate([7] * 30, SamplingParams(max_tokens=200, ignore_eos=True)):\n"
        "            pass\n"
        "    asyncio.get_running_loop().create_task(long())\n"
        "    await asyncio.sleep(1.0)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr, done.stderr
