"""AsyncEngine: the asyncio API. One loop task drives the engine: it applies arrivals and aborts between
steps and hands each step to a worker thread, so the event loop keeps accepting and streaming while
the model computes. With async_scheduling the worker's step is the pipelined one (step N+1 launched
before step N's results are awaited), and the worker thread is the one that waits for the device."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from asyncspec.config import EngineConfig
from asyncspec.engine.llm_engine import LLMEngine, PromptType
from asyncspec.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from asyncspec.outputs import RequestOutput
from asyncspec.request import Request
from asyncspec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SHUT_DOWN = "the engine was shut down"


OutputSink = Callable[[RequestOutput | BaseException], None]
"""Receives one request's outputs in order, on the engine's event loop: RequestOutput deltas (the last one
finished) or the exception that ended the request."""


@dataclass(eq=False)
class _Stream:
    """One client's stream: where its outputs go, and the event loop its consumer runs on."""

    put: OutputSink
    loop: asyncio.AbstractEventLoop


_FINALIZER_TURNS = 4
"""Event-loop turns asyncio takes to close an abandoned async generator: its finalizer hook schedules a task
(call_soon_threadsafe) that runs aclose(), whose `finally` then runs."""


async def let_finalizers_run(still_taken: Callable[[], bool]) -> None:
    """A client that broke out of `async for` without closing its generator leaves it to asyncio's finalizer, which
    aborts its request a few loop turns later: those turns pass before the id counts as taken."""
    for _ in range(_FINALIZER_TURNS):
        if not still_taken():
            return
        await asyncio.sleep(0)


def merge_deltas(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one: tokens, text and logprobs concatenated, the
    cumulative counters and the finish information from the later one."""
    logprobs = None
    if first.logprobs is not None or second.logprobs is not None:
        logprobs = [*(first.logprobs or []), *(second.logprobs or [])]
    return dataclasses.replace(
        second,
        token_ids=[*first.token_ids, *second.token_ids],
        text=first.text + second.text,
        logprobs=logprobs,
        queued_seconds=first.queued_seconds if first.queued_seconds is not None else second.queued_seconds,
    )


def coalesce_waiting(
    item: RequestOutput, queue: asyncio.Queue[RequestOutput | BaseException], max_tokens: int | None = None
) -> tuple[RequestOutput, RequestOutput | BaseException | None]:
    """`item` merged with the deltas already waiting behind it in `queue` (a consumer that fell behind then sends
    one message); stops at a finished delta, before passing `max_tokens` tokens (a delta that would is returned,
    to come next), or at an exception, which is returned to be raised next."""
    while not item.finished and not queue.empty():
        following = queue.get_nowait()
        if isinstance(following, BaseException):
            return item, following
        if max_tokens is not None and len(item.token_ids) + len(following.token_ids) > max_tokens:
            return item, following
        item = merge_deltas(item, following)
    return item, None


async def next_output(
    queue: asyncio.Queue[RequestOutput | BaseException],
    held: RequestOutput | BaseException | None,
    coalesce: bool,
    max_coalesced_tokens: int | None = None,
) -> tuple[RequestOutput, RequestOutput | BaseException | None]:
    """A stream's next output from its queue (`held`, an output or error that a coalesced delta came before,
    first): raises the exception that ended the request; with `coalesce`, the deltas waiting behind it merged in,
    up to `max_coalesced_tokens` tokens. Returns the output and what to hold for the next call."""
    item = held if held is not None else await queue.get()
    if isinstance(item, BaseException):
        raise item
    return coalesce_waiting(item, queue, max_coalesced_tokens) if coalesce else (item, None)


_IDLE_HEALTH_CHECK_S = 1.0
"""How often an idle loop checks that the engine's worker processes are alive."""


class AsyncEngine:
    """`async for delta in engine.generate(prompt, params, request_id=...)`; `await engine.abort(id)`.

    One event loop drives the engine at a time; a later event loop (a second `asyncio.run`) may take
    over, and then the streams whose loop has stopped count as departed clients: their requests
    are aborted and their ids freed.
    """

    def __init__(self, config: EngineConfig, step_in_loop_thread: bool = False) -> None:
        self.config = config
        self._step_in_loop_thread = step_in_loop_thread
        """Run each step on the event loop's own thread instead of a worker thread: for a host whose event
        loop serves no latency-sensitive streams (the engine process), which then spends no interpreter-lock
        handoffs between the two threads on every step."""
        self.engine = LLMEngine(config)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncspec-worker")
        self._streams: dict[str, _Stream] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        # Named requests whose text prompt is being tokenized (not yet registered): True once aborted meanwhile.
        self._admitting: dict[str, bool] = {}
        self._wakeup: asyncio.Event | None = None
        self._aborts_applied: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._inflight_step: concurrent.futures.Future[list[RequestOutput]] | None = None
        self._step_listeners: list[Callable[[int], None]] = []
        self._death_listeners: list[Callable[[EngineDeadError], None]] = []
        self._stats_snapshot: dict[str, float] | None = None

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        coalesce: bool = False,
        max_coalesced_tokens: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams RequestOutput deltas; the last one has finish_reason set. Raises a typed error
        for a bad request, RequestFailedError if this request alone failed, EngineDeadError if the
        engine stopped. An id whose previous client just left is free once that request's abort is
        applied, which this call waits for. With `coalesce`, deltas that piled up while the consumer
        was busy arrive merged into one (a server then sends one message instead of several), of at most
        `max_coalesced_tokens` tokens where given (a message-size limit)."""
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        request_id, stream = await self._admit(prompt, sampling_params, request_id, priority, queue.put_nowait)
        try:
            held: RequestOutput | BaseException | None = None
            while True:
                item, held = await next_output(queue, held, coalesce, max_coalesced_tokens)
                yield item
                if item.finished:
                    return
        finally:
            # Still registered (and so possibly live in the engine) only if the client went away
            # early (cancelled, broke out, closed the iterator): free its KV at once. The identity
            # check leaves alone a newer stream that reuses the id after this one ended.
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                self._pending_aborts.append(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    async def submit(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        sink: OutputSink,
    ) -> str:
        """Admits a request whose outputs go to `sink` (called on this event loop) instead of a generator:
        a host that forwards them elsewhere (the engine process) spends no coroutine per stream. Raises
        the same typed errors as `generate` for a bad request; returns the request id. `abort` ends it
        early (the sink then receives the final "abort" output)."""
        request_id, _ = await self._admit(prompt, sampling_params, request_id, priority, sink)
        return request_id

    def submit_nowait(
        self,
        prompt: list[int],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        sink: OutputSink,
    ) -> str | None:
        """`submit` without awaiting, for a prompt of token ids: None (nothing done) when the request must go
        through `submit` instead, because its id waits for an abort to be applied. Raises the same errors."""
        self._raise_if_dead()
        if isinstance(request_id, str) and request_id in self._pending_aborts:
            return None
        request = self.engine.make_request(prompt, sampling_params, request_id, priority)
        return self._register(request, sink)[0]

    async def _admit(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        priority: int,
        put: OutputSink,
    ) -> tuple[str, _Stream]:
        """Validates the request and registers its stream; the loop adds it to the engine before its next step."""
        self._raise_if_dead()
        self._ensure_loop()
        if isinstance(request_id, str) and request_id in self._streams:
            await let_finalizers_run(lambda: request_id in self._streams)
        if isinstance(request_id, str) and request_id in self._pending_aborts:
            await self._wait_for_abort(request_id)
        if isinstance(prompt, str):
            # Tokenizing a long text takes a while: not on the event loop, whose streams would stall. An abort of
            # the id meanwhile (a server's drain) is kept for the registration, not dropped as an unknown id's.
            owner = request_id if isinstance(request_id, str) and request_id not in self._admitting else None
            if owner is not None:
                self._admitting[owner] = False
            try:
                request = await asyncio.get_running_loop().run_in_executor(
                    None, self.engine.make_request, prompt, sampling_params, request_id, priority
                )
                aborted = owner is not None and self._admitting[owner]
            finally:
                if owner is not None:
                    del self._admitting[owner]
        else:
            request, aborted = self.engine.make_request(prompt, sampling_params, request_id, priority), False
        registered = self._register(request, put)
        if aborted:
            self.abort_nowait(request.request_id)
        return registered

    def _register(self, request: Request, put: OutputSink) -> tuple[str, _Stream]:
        # Again: the engine may have died or shut down while a text prompt was being tokenized.
        self._raise_if_dead()
        if request.request_id in self._streams or request.request_id in self._pending_aborts:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use")
        stream = _Stream(put, asyncio.get_running_loop())
        self._streams[request.request_id] = stream
        self._pending_adds.append(request)
        self._ensure_loop()
        return request.request_id, stream

    def add_death_listener(self, listener: Callable[[EngineDeadError], None]) -> None:
        """Calls `listener(error)` on the event loop once the engine has failed (every stream has
        then ended with the error); a server exits on it."""
        self._death_listeners.append(listener)

    def add_step_listener(self, listener: Callable[[int], None]) -> None:
        """Calls `listener(num_tokens)` on the event loop for every step the engine retires (metrics)."""
        self._step_listeners.append(listener)

    def _notify_step_listeners(self) -> None:
        retired = self.engine.engine_core.retired_step_tokens
        while retired:
            num_tokens = retired.popleft()
            for listener in self._step_listeners:
                listener(num_tokens)

    def has_request(self, request_id: str) -> bool:
        """Whether a live stream has this id."""
        return request_id in self._streams

    async def abort(self, request_id: str) -> None:
        """Ends the request; its stream receives a final output with finish_reason "abort".
        Unknown or already finished ids are ignored (an abort must never hit a later request
        that reuses the id)."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """`abort`, callable from a plain callback on the event loop."""
        if request_id not in self._streams and request_id in self._admitting:
            # A live stream of the id is the one aborted (a second one being admitted is refused as a duplicate).
            self._admitting[request_id] = True  # applied once its text is tokenized and the stream registered
            return
        if request_id not in self._streams or self._dead is not None:
            return
        self._pending_aborts.append(request_id)
        self._ensure_loop()

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            # A fresh instance per caller: one exception object raised in many tasks would
            # accumulate their tracebacks.
            raise EngineDeadError(*self._dead.args)

    async def _wait_for_abort(self, request_id: str) -> None:
        while request_id in self._pending_aborts:
            self._raise_if_dead()
            assert self._aborts_applied is not None  # set by _ensure_loop
            self._aborts_applied.clear()
            await self._aborts_applied.wait()
        self._raise_if_dead()

    def start(self) -> None:
        """Starts the engine loop on the running event loop now rather than at the first request, so
        that a worker process dying before any request is noticed (a server calls this when ready)."""
        self._raise_if_dead()
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        """Starts the loop task on the running event loop unless it already runs there (never for an engine
        that has failed or shut down: no stream could be served)."""
        if self._dead is not None:
            return
        loop = asyncio.get_running_loop()
        if self._loop_task is None or self._loop_task.done() or self._loop_task.get_loop() is not loop:
            # Fresh Events too: an asyncio.Event binds to the loop it was first awaited on.
            self._wakeup = asyncio.Event()
            self._aborts_applied = asyncio.Event()
            self._adopt_departed_streams(loop)
            self._loop_task = loop.create_task(self._run_loop())
        assert self._wakeup is not None
        self._wakeup.set()

    def _adopt_departed_streams(self, loop: asyncio.AbstractEventLoop) -> None:
        """Streams of an event loop that no longer runs have no consumer left (asyncio.run
        returned, or the loop was stopped): abort their requests and free their ids."""
        for request_id, stream in list(self._streams.items()):
            if stream.loop is not loop and not stream.loop.is_running():
                del self._streams[request_id]
                self._pending_aborts.append(request_id)

    def _apply_pending(self) -> tuple[list[str], list[RequestOutput]]:
        """Applies the adds and aborts that came in since the last step; returns the aborted ids and
        their final outputs, which the caller delivers after the previous step's outputs."""
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            if request.request_id not in self._streams:
                continue  # the client left before its request was admitted
            try:
                self.engine.add_request(request)
            except Exception as e:  # queue full, duplicate id: the stream ends with the error
                self._streams.pop(request.request_id).put(e)
        aborts = list(self._pending_aborts)
        if not aborts:
            return [], []
        # The ids stay in _pending_aborts until their outputs are delivered: a generate() reusing
        # one waits for that.
        return aborts, self.engine.abort_requests(aborts)

    def _deliver_in_order(
        self, step_outputs: list[RequestOutput], aborted_ids: list[str], aborted: list[RequestOutput]
    ) -> None:
        """A step's outputs, then the final outputs of the requests aborted after it; then the
        aborted ids are free for reuse."""
        for output in step_outputs:
            self._deliver(output)
        if not aborted_ids:
            return
        for output in aborted:
            self._deliver(output)
        done = set(aborted_ids)
        self._pending_aborts = [rid for rid in self._pending_aborts if rid not in done]
        assert self._aborts_applied is not None
        self._aborts_applied.set()

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished and output.request_id in self._pending_aborts:
            self._pending_aborts.remove(output.request_id)  # it ended anyway; the id is free again
            if self._aborts_applied is not None:
                self._aborts_applied.set()  # wakes a generate() waiting to reuse the id
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finish_reason == "error":
            stream.put(RequestFailedError(f"request {output.request_id!r} failed: {output.error}", output))
        else:
            stream.put(output)
        if output.finished:
            del self._streams[output.request_id]

    async def _run_loop(self) -> None:
        assert self._wakeup is not None
        try:
            outputs: list[RequestOutput] = []
            step, self._inflight_step = self._inflight_step, None
            if step is not None and not step.cancelled():
                # A loop task cancelled mid-step (its event loop closed) left a step computing in
                # the worker thread: engine state may be touched only once it is done. (A step
                # cancelled while still queued never ran: there is nothing to wait for.)
                outputs = await asyncio.wrap_future(step)
                self._notify_step_listeners()
            while True:
                # Engine state is touched here only while no step runs in the worker thread.
                aborted_ids, aborted = self._apply_pending()
                # Between steps, with no step running: the counters as a whole, for scrapes that come
                # from other threads (mid-step, a stop string's correction could show a counter going
                # down). Stepping on this thread, the snapshot after each step serves while busy.
                busy = self.engine.has_unfinished_requests()
                if not (busy and self._step_in_loop_thread):
                    self._stats_snapshot = self.engine.stats()
                if not busy:
                    self._deliver_in_order(outputs, aborted_ids, aborted)
                    outputs = []
                    self._wakeup.clear()
                    if self._pending_adds or self._pending_aborts:
                        continue
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), _IDLE_HEALTH_CHECK_S)
                    except asyncio.TimeoutError:  # noqa: UP041 - not the builtin before Python 3.11
                        # Idle: a worker process that died now is found before the next request.
                        self.engine.check_health()
                    continue
                if self._step_in_loop_thread:
                    self._deliver_in_order([], aborted_ids, aborted)
                    outputs = self.engine.step()
                    self._stats_snapshot = self.engine.stats()  # what goes out with this step's outputs
                    self._deliver_in_order(outputs, [], [])
                    outputs = []
                    self._notify_step_listeners()
                    await asyncio.sleep(0)  # the step's outputs go out; arrivals and aborts come in
                    continue
                # With async_scheduling the step is the pipelined one (EngineCore.advance: step N+1 is
                # launched before step N's results are awaited); either way it runs in the worker thread,
                # which also waits for the device, so the event loop stays free for the streams' I/O.
                self._inflight_step = self._executor.submit(self.engine.step)
                # The previous step's outputs go to their streams while the next step computes: the
                # worker thread does not wait for the streams' handlers (delivery touches only the
                # streams' queues, never the engine).
                self._deliver_in_order(outputs, aborted_ids, aborted)
                outputs = await asyncio.wrap_future(self._inflight_step)
                self._inflight_step = None
                self._notify_step_listeners()
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled, or closed by the garbage collector as a pending task of an event loop
            # that was closed: the loop is gone, not the engine.
            raise
        except BaseException as e:  # the engine is broken: no stream may hang
            if self._closed:
                return  # shutdown() ends the streams; a step cut short by it is no engine fault
            logger.exception("engine loop failed")
            self._dead = EngineDeadError(f"the engine loop failed: {e!r}")
            self._end_all_streams(self._dead)
            for listener in self._death_listeners:
                listener(self._dead)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests submitted whose final output has not come yet (a slow reader's backlog not included)."""
        return len(self._streams)

    def declare_dead(self, reason: str) -> None:
        """From outside (the server's stall watchdog): the engine makes no progress. Ends every stream with
        EngineDeadError(reason) without touching the engine's state, which a hung step may still hold in the
        worker thread; the death listeners hear of it. Nothing if the engine already stopped."""
        if self._dead is not None:
            return
        self._dead = EngineDeadError(reason)
        logger.error("%s", reason)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.loop.is_closed():
                stream.put(EngineDeadError(reason))
        if self._aborts_applied is not None:
            self._aborts_applied.set()
        for listener in self._death_listeners:
            listener(self._dead)

    def _end_all_streams(self, error: EngineDeadError) -> None:
        """Aborts every live request (freeing its KV blocks, best effort) and ends every stream
        with `error`."""
        ids = list(dict.fromkeys([*self._streams, *self._pending_aborts]))
        self._pending_adds, self._pending_aborts = [], []
        try:
            self.engine.abort_requests(ids)
        except Exception:  # a broken engine may fail here too; the streams must end regardless
            logger.exception("could not abort the requests of a stopped engine")
        self._stats_snapshot = None  # the engine is stopped: the current counters are final
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.loop.is_closed():  # a closed loop's stream has no consumer, nor a queue to put to
                stream.put(EngineDeadError(*error.args))
        if self._aborts_applied is not None:
            self._aborts_applied.set()  # callers waiting for an id see the engine is gone

    async def shutdown(self) -> None:
        """Stops the loop; in-flight streams end with EngineDeadError("the engine was shut down"),
        and so do generate() calls made from now on, even while shutdown is still in progress."""
        self._closed = True
        if self._dead is None:
            self._dead = EngineDeadError(_SHUT_DOWN)
        loop = asyncio.get_running_loop()
        try:
            task = self._loop_task
            # A task of a closed event loop can be neither cancelled nor awaited; one of a stopped loop never ends.
            if task is not None and not task.done() and not task.get_loop().is_closed():
                task.cancel()
                if task.get_loop() is loop:
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass

            # Waits for a step still computing in the worker thread before touching engine state,
            # without blocking the event loop.
            await loop.run_in_executor(None, lambda: self._executor.shutdown(wait=True))
            self._end_all_streams(self._dead)
        finally:
            await loop.run_in_executor(None, self.engine.shutdown)  # its threads and worker processes, always

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def stats_snapshot(self) -> dict[str, float]:
        """The counters as of the last point between steps (monotonic for a scraper on another
        thread); the current ones before the loop first ran."""
        snapshot = self._stats_snapshot
        return dict(snapshot) if snapshot is not None else self.engine.stats()
