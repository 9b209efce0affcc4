"""The engine in a process of its own, for a server whose per-stream gRPC work must not share an interpreter
lock with the engine's scheduling and output processing.

`EngineProcessClient` has the part of AsyncEngine's interface that a server uses (`generate`, `abort`,
`has_request`, the step and death listeners, `stats`, `stats_snapshot`, `shutdown`, and `engine` for the
tokenizer and the model's facts). The process it starts runs an AsyncEngine on its own event loop, stepping on
that loop's thread; one duplex pipe joins the two:

- to the engine: ("add", request_id, prompt, params, priority), ("abort", request_id), ("stats", token),
  ("shutdown",). They are applied between steps, in order: an add of token ids at once, an add of text in a
  task of its own (tokenizing); an abort whose add is still running waits for it, so an abort never overtakes
  its request's add.
- to the client: ("outputs", [(request_id, RequestOutput | exception), ...], step token counts, stats
  snapshot): everything one engine step delivered, as one message (AsyncEngine.submit hands the outputs to
  a sink, so the engine process runs no coroutine per stream); ("stats", token, stats); ("dead", message).

The engine process ignores SIGINT and SIGTERM (through handlers, which its own workers do not inherit): the
server drains and then sends "shutdown". If the server
goes away the pipe closes and the engine shuts down; if the engine process dies the client ends every stream
with EngineDeadError and calls its death listeners, as an AsyncEngine whose loop failed does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.util
import operator
import os
import pickle
import signal
import threading
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from asyncspec.config import EngineConfig
from asyncspec.engine.async_engine import AsyncEngine, let_finalizers_run, next_output
from asyncspec.engine.llm_engine import PromptType
from asyncspec.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from asyncspec.models.model_config import ModelConfig
from asyncspec.outputs import RequestOutput
from asyncspec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SHUT_DOWN = "the engine was shut down"
_STATS_TIMEOUT_S = 30.0


class EngineProcessStartError(RuntimeError):
    """The engine process failed before it was ready (the message is the engine's error)."""


@dataclass(frozen=True)
class EngineInfo:
    """What a server's non-streaming RPCs read of the engine, sent once by the engine process when it is
    ready (the names of LLMEngine's attributes, so the server reads either alike)."""

    config: EngineConfig
    """The engine's configuration."""
    tokenizer: Any
    """The engine's tokenizer (a `tokenizers.Tokenizer`), or None with skip_tokenizer_init."""
    model_config: ModelConfig
    """The model's facts (vocabulary, special ids)."""
    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    max_model_len: int
    """Longest prompt plus output, in tokens."""
    eos_token_ids: frozenset[int]
    """Ids that end a generation unless ignore_eos."""
    sampling_defaults: dict[str, Any]
    """SamplingParams fields a request that leaves them unset takes from the model's generation_config.json."""


# --------------------------------------------------------------------------------------------- the engine side


def engine_process_main(config: EngineConfig, conn: Connection) -> None:
    """The engine process's entry point (spawned): serves `conn` until "shutdown" or the pipe closes."""
    # Handlers, not SIG_IGN: an ignored signal stays ignored across exec, so the engine's own worker processes
    # (worker_process, tensor parallelism) would inherit it; a handler is reset to the default there.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore_signal)  # the server drains, then says "shutdown"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    loaded = _exit_if_the_server_dies_while_loading()
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(config, conn, loaded))
    else:
        uvloop.run(_serve(config, conn, loaded))


def _exit_if_the_server_dies_while_loading() -> threading.Event:
    """Ends this process if the server's is gone before the engine has loaded (a SIGKILL, an OOM kill): the load
    would otherwise run to its end, minutes on a GPU with warm-up, holding the device's memory a restarted server
    needs. Once `loaded` is set, the pipe's close ends the engine cleanly instead (it stops its own workers)."""
    loaded = threading.Event()
    parent = multiprocessing.parent_process()
    if parent is None:
        return loaded
    sentinel = parent.sentinel

    def watch() -> None:
        wait([sentinel])
        if not loaded.is_set():
            os._exit(1)

    threading.Thread(target=watch, name="asyncspec-server-watch", daemon=True).start()
    return loaded


def _ignore_signal(signum: int, frame: object) -> None:
    logger.info("engine process: signal %d ignored (the server stops the engine)", signum)


async def _serve(config: EngineConfig, conn: Connection, loaded: threading.Event | None = None) -> None:
    try:
        engine = AsyncEngine(config, step_in_loop_thread=True)
    except BaseException as e:  # noqa: BLE001 - reported to the client, which raises it
        with contextlib.suppress(OSError, ValueError):
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    if loaded is not None:
        loaded.set()
    host: _EngineHost | None = None
    try:
        llm = engine.engine
        info = EngineInfo(
            config=config,
            tokenizer=llm.tokenizer,
            model_config=llm.model_config,
            vocab_size=llm.vocab_size,
            max_model_len=llm.max_model_len,
            eos_token_ids=llm.eos_token_ids,
            sampling_defaults=llm.sampling_defaults,
        )
        try:
            conn.send(("ready", info, engine.stats()))
        except (OSError, ValueError):
            return  # the server went away while the model loaded
        host = _EngineHost(engine, conn)
        await host.run()
    finally:
        # Always, so that the engine's own worker processes are told to stop before this process exits.
        if host is None or not host.shut_down:
            await engine.shutdown()


def _picklable(error: BaseException) -> BaseException:
    """`error` if it crosses the pipe, else a RequestFailedError with its text (the client must never fail to
    read a message)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RequestFailedError(f"{type(error).__name__}: {error}")
    return error


# A RequestOutput crosses the pipe as a tuple of its fields (pickling a dataclass costs some 20 times more), and
# its prompt's ids only with the request's first output: the client keeps them for the later ones.
_WIRE_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput) if f.init)[2:]
"""Every field but request_id and prompt_token_ids (the first two), in RequestOutput's own order."""


_wire_fields = operator.attrgetter(*_WIRE_FIELDS)
_FINISH_REASON = 1 + _WIRE_FIELDS.index("finish_reason")
"""Where a wire tuple holds the finish reason (its first item is the prompt or None)."""


def _to_wire(output: RequestOutput, with_prompt: bool) -> tuple:
    return (output.prompt_token_ids if with_prompt else None, *_wire_fields(output))


def _from_wire(request_id: str, prompt_token_ids: list[int], wire: tuple) -> RequestOutput:
    return RequestOutput(request_id, prompt_token_ids, *wire[1:])


class _EngineHost:
    """Applies the client's messages to the AsyncEngine and sends each step's outputs as one message.

    The engine steps on the event loop's own thread (no handoff of the interpreter lock per step), and the
    pipe's reader thread hands each message to the loop as a callback, applied before the next step. An add
    of token ids is admitted right there; a text prompt is tokenized off the loop in a task of its own, and an
    abort of an id whose add is still running waits for that add, so it never overtakes it."""

    def __init__(self, engine: AsyncEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.loop = asyncio.get_running_loop()
        self.outbox: list[tuple[str, tuple | BaseException]] = []
        self.prompt_sent: set[str] = set()
        self.step_tokens: list[int] = []
        self.flush_scheduled = False
        self.adding: dict[str, asyncio.Task[None]] = {}
        self.done = asyncio.Event()
        self.shut_down = False
        engine.add_step_listener(self._on_step)
        engine.add_death_listener(self._on_death)
        engine.start()

    async def run(self) -> None:
        threading.Thread(target=self._read, name="asyncspec-engine-pipe", daemon=True).start()
        await self.done.wait()
        for task in list(self.adding.values()):
            task.cancel()
        self.shut_down = True
        await self.engine.shutdown()
        self._flush()

    def _on_message(self, message: tuple | None) -> None:
        if self.done.is_set():
            return
        try:
            self._apply(message)
        except Exception:  # noqa: BLE001 - a callback's error would only be logged: no client may wait on it
            logger.exception("the engine process could not apply %r; stopping", message[0] if message else None)
            self.done.set()

    def _apply(self, message: tuple | None) -> None:
        if message is None or message[0] == "shutdown":
            self.done.set()
            return
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, params, priority = message
            if not isinstance(prompt, str):
                try:
                    if (
                        self.engine.submit_nowait(prompt, params, request_id, priority, self._sink(request_id))
                        is not None
                    ):
                        return
                except Exception as e:  # a bad request: its stream ends with the typed error
                    self._emit(request_id, e)
                    return
            task = self.loop.create_task(self._add(request_id, prompt, params, priority))
            self.adding[request_id] = task
            task.add_done_callback(functools.partial(self._added, request_id))
        elif kind == "abort":
            adding = self.adding.get(message[1])
            if adding is None:
                self.engine.abort_nowait(message[1])
            else:
                self.loop.create_task(self._abort_after(message[1], adding))
        elif kind == "stats":
            try:
                self.conn.send(("stats", message[1], self.engine.stats()))
            except (OSError, ValueError):
                self.done.set()  # the client is gone

    async def _add(self, request_id: str, prompt: PromptType, params: SamplingParams | None, priority: int) -> None:
        try:
            await self.engine.submit(prompt, params, request_id, priority, self._sink(request_id))
        except Exception as e:  # a bad request: its stream ends with the typed error
            self._emit(request_id, e)

    def _added(self, request_id: str, task: asyncio.Future[None]) -> None:
        if self.adding.get(request_id) is task:
            del self.adding[request_id]

    async def _abort_after(self, request_id: str, adding: asyncio.Task[None]) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(adding)
        await self.engine.abort(request_id)

    def _read(self) -> None:
        """The pipe's reader thread: each message to the event loop, None when the client is gone."""
        while True:
            try:
                message = self.conn.recv()
            except Exception:  # noqa: BLE001 - EOF, a closed pipe or an unreadable message: the client is gone
                message = None
            try:
                self.loop.call_soon_threadsafe(self._on_message, message)
            except RuntimeError:  # the event loop has closed (the engine died meanwhile)
                return
            if message is None or message[0] == "shutdown":
                return

    def _sink(self, request_id: str) -> Callable[[RequestOutput | BaseException], None]:
        return lambda item: self._emit(request_id, item)

    def _emit(self, request_id: str, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.prompt_sent.discard(request_id)
            self.outbox.append((request_id, _picklable(item)))
        else:
            with_prompt = request_id not in self.prompt_sent
            if item.finished:
                self.prompt_sent.discard(request_id)
            elif with_prompt:
                self.prompt_sent.add(request_id)
            self.outbox.append((request_id, _to_wire(item, with_prompt)))
        self._schedule_flush()

    def _on_step(self, num_tokens: int) -> None:
        self.step_tokens.append(num_tokens)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        # Everything delivered before the engine loop next awaits (one step's outputs) goes in one message.
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_scheduled = False
        if not self.outbox and not self.step_tokens:
            return
        outbox, self.outbox = self.outbox, []
        step_tokens, self.step_tokens = self.step_tokens, []
        try:
            self.conn.send(("outputs", outbox, step_tokens, self.engine.stats_snapshot()))
        except (OSError, ValueError):  # the client is gone; the reader thread ends the host
            pass

    def _on_death(self, error: EngineDeadError) -> None:
        self._flush()  # the streams' final EngineDeadErrors
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("dead", str(error)))
        self.done.set()


# --------------------------------------------------------------------------------------------- the client side


class EngineProcessClient:
    """An AsyncEngine in a process of its own, behind AsyncEngine's serving interface. `await launch(config)`
    starts it and returns once the model is loaded; all methods are called on one event loop."""

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        conn: Connection,
        info: EngineInfo,
        stats: dict[str, float],
    ) -> None:
        self.engine = info
        self.config = info.config
        self._process = process
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._prompts: dict[str, list[int]] = {}
        """Each live stream's prompt ids, sent with its first output only."""
        self._departed: dict[str, asyncio.Event] = {}
        self._step_listeners: list[Callable[[int], None]] = []
        self._death_listeners: list[Callable[[EngineDeadError], None]] = []
        self._snapshot: dict[str, float] = stats
        self._stats_replies: dict[int, concurrent.futures.Future[dict[str, float]]] = {}
        self._stats_tokens = itertools.count()
        self._send_lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        self._gone = False  # the reader has stopped: no reply will come
        self._closing = False
        self._shutdown: asyncio.Future[None] | None = None
        self._reader = threading.Thread(target=self._read, name="asyncspec-engine-client", daemon=True)
        self._reader.start()

    @classmethod
    async def launch(cls, config: EngineConfig) -> EngineProcessClient:
        """Spawns the engine process and waits (off the event loop) until its model is loaded. Raises
        EngineProcessStartError with the engine's own message if it fails first."""
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        parent, child = context.Pipe(duplex=True)
        process = context.Process(target=engine_process_main, args=(config, child), name="asyncspec-engine")
        process.start()
        child.close()
        try:
            message = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
        except asyncio.CancelledError:
            # The server is told to stop while the model loads: the engine process ignores SIGTERM (the server
            # drains it), so it is killed; its end of the pipe closing then ends the waiting recv.
            process.kill()
            process.join(5)
            raise
        except (EOFError, OSError):
            process.join(5)
            raise EngineProcessStartError(
                f"the engine process exited before it was ready (exit code {process.exitcode})"
            ) from None
        if message[0] != "ready":
            process.join(5)
            raise EngineProcessStartError(message[1])
        client = cls(process, parent, message[1], message[2])
        # A program that ends without shutdown(): the engine process stops when its pipe closes, but Python's
        # exit joins the (non-daemon) process first, holding the pipe open. This runs before that join.
        multiprocessing.util.Finalize(client, _stop_at_exit, args=(parent,), exitpriority=10)
        return client

    # -- AsyncEngine's serving interface ----------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    def start(self) -> None:
        """The engine runs from launch on; raises EngineDeadError if it has stopped."""
        self._raise_if_dead()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        coalesce: bool = False,
        max_coalesced_tokens: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """As AsyncEngine.generate: RequestOutput deltas, the last one finished; typed errors for a bad
        request; EngineDeadError if the engine stopped."""
        self._raise_if_dead()
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._streams:
            await let_finalizers_run(lambda: request_id in self._streams)
        while request_id in self._departed:  # its previous client just left: free once its abort is applied
            await self._departed[request_id].wait()
            self._raise_if_dead()
        if request_id in self._streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        # The awaits above let the reader's exit callback run: a stream registered after it would never end.
        self._raise_if_dead()
        try:
            add = pickle.dumps(("add", request_id, prompt, sampling_params, priority))
        except Exception as e:  # noqa: BLE001 - whatever cannot be pickled cannot reach the engine
            raise InvalidRequestError(f"the request cannot be sent to the engine process: {e}") from None
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._send_bytes(add)
        try:
            held: RequestOutput | BaseException | None = None
            while True:
                item, held = await next_output(queue, held, coalesce, max_coalesced_tokens)
                yield item
                if item.finished:
                    return
        finally:
            # Still registered only if the client left early: abort it in the engine, and keep the id
            # until the engine's final output for it arrives.
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
                if self._dead is None:
                    self._departed[request_id] = asyncio.Event()
                    self._send(("abort", request_id))

    def has_request(self, request_id: str) -> bool:
        """Whether a live stream has this id."""
        return request_id in self._streams

    async def abort(self, request_id: str) -> None:
        """Ends the request; its stream receives a final output with finish_reason "abort". Unknown or
        finished ids are ignored."""
        if request_id in self._streams and self._dead is None:
            self._send(("abort", request_id))

    def add_step_listener(self, listener: Callable[[int], None]) -> None:
        """Calls `listener(num_tokens)` on the event loop for every step the engine retires."""
        self._step_listeners.append(listener)

    def add_death_listener(self, listener: Callable[[EngineDeadError], None]) -> None:
        """Calls `listener(error)` on the event loop once the engine has failed (every stream has ended)."""
        self._death_listeners.append(listener)

    def stats(self) -> dict[str, float]:
        """The engine's counters now (a round trip to the engine process; blocks until it answers)."""
        if self._dead is not None:
            return dict(self._snapshot)
        token = next(self._stats_tokens)
        reply: concurrent.futures.Future[dict[str, float]] = concurrent.futures.Future()
        self._stats_replies[token] = reply
        if self._gone:  # the reader stopped before this reply was registered: none will come
            reply.cancel()
        self._send(("stats", token))
        try:
            return reply.result(_STATS_TIMEOUT_S)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):  # the engine died or hung
            return dict(self._snapshot)
        finally:
            self._stats_replies.pop(token, None)

    def stats_snapshot(self) -> dict[str, float]:
        """The counters as of the engine's last delivered step (safe from any thread)."""
        return dict(self._snapshot)

    async def shutdown(self) -> None:
        """Stops the engine process; in-flight streams end with EngineDeadError("the engine was shut down")."""
        if self._shutdown is not None:
            await asyncio.shield(self._shutdown)  # a second caller waits for the first
            return
        self._shutdown = self._loop.create_future()
        self._closing = True
        try:
            if self._process.is_alive():  # even if the client has given up on it: let it stop its own workers
                self._send(("shutdown",))
            await self._loop.run_in_executor(None, self._process.join, 60)
            if self._process.is_alive():
                logger.error("the engine process did not stop in 60 s; killing it")
                self._process.kill()
                await self._loop.run_in_executor(None, self._process.join, 10)
            self._end(EngineDeadError(_SHUT_DOWN), notify=False)
            self._conn.close()
        finally:
            self._shutdown.set_result(None)

    # -- the pipe ----------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        self._send_bytes(pickle.dumps(message))

    def _send_bytes(self, data: bytes) -> None:
        try:
            with self._send_lock:  # stats() may be called from another thread (a metrics scrape)
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:  # the engine process is gone; the reader reports it
            logger.debug("could not send to the engine process: %s", e)

    def _read(self) -> None:
        """The reader thread: outputs into the event loop; stats replies answered here (stats() may be
        waiting on the event loop's own thread)."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # closed under the reader (shutdown, the at-exit stop), or a message that cannot be read
                if not self._closing and not self._conn.closed:
                    logger.exception("cannot read from the engine process; treating it as gone")
                break
            if message[0] == "stats":
                reply = self._stats_replies.get(message[1])
                if reply is not None and not reply.done():
                    reply.set_result(message[2])
                continue
            try:
                self._loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:  # the event loop has closed (the program ended without shutdown()): nobody reads
                break
            if message[0] == "dead":
                break
        self._gone = True
        for reply in list(self._stats_replies.values()):
            reply.cancel()
        with contextlib.suppress(RuntimeError):  # the event loop has closed
            self._loop.call_soon_threadsafe(self._on_exit)

    def _dispatch(self, message: tuple) -> None:
        if message[0] == "dead":
            self._end(EngineDeadError(message[1]), notify=True)
            return
        _, outputs, step_tokens, snapshot = message
        self._snapshot = snapshot
        for request_id, wire in outputs:
            item: RequestOutput | BaseException
            if isinstance(wire, BaseException):
                item, done = wire, True
                self._prompts.pop(request_id, None)
            else:
                prompt = wire[0]
                done = wire[_FINISH_REASON] is not None
                if done:
                    prompt = self._prompts.pop(request_id, None) if prompt is None else prompt
                elif prompt is None:
                    prompt = self._prompts.get(request_id)
                else:
                    self._prompts[request_id] = prompt
                item = _from_wire(request_id, prompt if prompt is not None else [], wire)
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(item)
                if done:
                    del self._streams[request_id]
            elif done and request_id in self._departed:
                self._departed.pop(request_id).set()
        for num_tokens in step_tokens:
            for listener in self._step_listeners:
                listener(num_tokens)

    def _on_exit(self) -> None:
        """The pipe closed: expected after a shutdown, a failure otherwise."""
        if self._closing or self._dead is not None:
            return
        self._process.join(0.2)  # its exit code, if it is already gone (the event loop must not wait long)
        self._end(
            EngineDeadError(f"the engine process exited unexpectedly (exit code {self._process.exitcode})"),
            notify=True,
        )

    @property
    def num_unfinished_requests(self) -> int:
        """Requests submitted whose final output has not come yet (a slow reader's backlog not included)."""
        return len(self._streams)

    def declare_dead(self, reason: str) -> None:
        """From outside (the server's stall watchdog): the engine process makes no progress. Every stream ends
        with EngineDeadError(reason) and the death listeners hear of it; shutdown() then stops (or kills) it."""
        self._end(EngineDeadError(reason), notify=True)

    def _end(self, error: EngineDeadError, notify: bool) -> None:
        """Ends every stream with `error`; with `notify`, the engine failed: the death listeners hear of it."""
        first = self._dead is None
        if first:
            self._dead = error
        streams, self._streams = self._streams, {}
        self._prompts.clear()
        for queue in streams.values():
            queue.put_nowait(EngineDeadError(*error.args))
        for event in self._departed.values():
            event.set()
        self._departed.clear()
        if first and notify:
            logger.error("the engine process failed: %s", error)
            for listener in self._death_listeners:
                listener(error)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(*self._dead.args)


def _stop_at_exit(conn: Connection) -> None:
    """Asks the engine process to stop (it then stops its own workers) and closes the pipe; nothing if shutdown()
    already did."""
    if conn.closed:
        return
    try:
        conn.send_bytes(pickle.dumps(("shutdown",)))
    except (OSError, ValueError):
        pass  # already gone
    conn.close()
