"""AsyncEngine: the asyncio API. One loop task drives the engine; the model runs in a worker thread
so the event loop keeps accepting and streaming while a step computes."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional

from asyncspec.config import EngineConfig
from asyncspec.engine.llm_engine import LLMEngine, PromptType
from asyncspec.errors import EngineDeadError, InvalidRequestError
from asyncspec.outputs import RequestOutput
from asyncspec.request import Request
from asyncspec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """`async for delta in engine.generate(prompt, params, request_id=...)`; `await engine.abort(id)`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = LLMEngine(config)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncspec-worker")
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._wakeup: Optional[asyncio.Event] = None
        self._loop_task: Optional[asyncio.Task] = None
        self._dead: Optional[BaseException] = None
        self._inflight_step: Optional[concurrent.futures.Future] = None

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutput deltas; the last one has finish_reason set."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not serving: {self._dead!r}")
        request = self.engine.make_request(prompt, sampling_params, request_id, priority)
        if request.request_id in self._streams or request.request_id in self._pending_aborts:
            # (A pending abort: a client with this id just left and its request is not freed yet.)
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._pending_adds.append(request)
        self._ensure_loop()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            # Still registered (and so possibly live in the engine) only if the client went away
            # early (cancelled, broke out, closed the iterator): free its KV at once. The identity
            # check leaves alone a newer stream that reuses the id after this one ended.
            if self._streams.get(request.request_id) is queue:
                del self._streams[request.request_id]
                self._pending_aborts.append(request.request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        """Ends the request; its stream receives a final output with finish_reason "abort".
        Unknown or already finished ids are ignored (an abort must never hit a later request
        that reuses the id)."""
        if request_id not in self._streams:
            return
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if not self.is_running or self._loop_task.get_loop() is not loop:  # type: ignore[union-attr]
            # A fresh Event too: an asyncio.Event binds to the loop it was first awaited on, so the
            # engine could not be driven again from a later event loop (a second asyncio.run).
            self._wakeup = asyncio.Event()
            self._loop_task = loop.create_task(self._run_loop())
        assert self._wakeup is not None
        self._wakeup.set()

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            if request.request_id not in self._streams:
                continue  # the client left before its request was admitted
            try:
                self.engine.add_request(request)
            except Exception as e:  # queue full, duplicate id: the stream ends with the error
                self._streams.pop(request.request_id).put_nowait(e)
        aborts, self._pending_aborts = self._pending_aborts, []
        if aborts:
            for output in self.engine.abort_requests(aborts):
                self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        if output.finished and output.request_id in self._pending_aborts:
            self._pending_aborts.remove(output.request_id)  # it ended anyway; the id is free again
        queue = self._streams.get(output.request_id)
        if queue is None:
            return
        queue.put_nowait(output)
        if output.finished:
            del self._streams[output.request_id]

    async def _run_loop(self) -> None:
        assert self._wakeup is not None
        try:
            if self._inflight_step is not None:
                # A loop task cancelled mid-step (its event loop closed) left a step computing in
                # the worker thread: engine state may be touched only once it is done.
                await asyncio.wrap_future(self._inflight_step)
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if self._pending_adds or self._pending_aborts:
                        continue
                    await self._wakeup.wait()
                    continue
                self._inflight_step = self._executor.submit(self.engine.step)
                outputs = await asyncio.wrap_future(self._inflight_step)
                self._inflight_step = None
                for output in outputs:
                    self._deliver(output)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the engine is broken: no stream may hang
            logger.exception("engine loop failed")
            self._dead = e
            self._end_all_streams(EngineDeadError(f"the engine loop failed: {e!r}"))

    def _end_all_streams(self, error: BaseException) -> None:
        """Aborts every live request (freeing its KV blocks, best effort) and ends every stream
        with `error`."""
        ids = list(dict.fromkeys([*self._streams, *self._pending_aborts]))
        self._pending_adds, self._pending_aborts = [], []
        try:
            self.engine.abort_requests(ids)
        except Exception:  # a broken engine may fail here too; the streams must end regardless
            logger.exception("could not abort the requests of a stopped engine")
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(error)

    async def shutdown(self) -> None:
        """Stops the loop; in-flight streams end with EngineDeadError, later generate() calls too."""
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        # Waits for a step still computing in the worker thread before touching engine state.
        # Waiting for a step still in the worker thread must not block the event loop.
        await asyncio.get_running_loop().run_in_executor(None, lambda: self._executor.shutdown(wait=True))
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        self._end_all_streams(EngineDeadError("the engine was shut down"))

    def stats(self) -> dict[str, float]:
        return self.engine.stats()
