"""The `asyncspec.v1.Generation` servicer on grpc.aio: one AsyncEngine behind every RPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from tokenizers import Tokenizer

from asyncspec.engine.async_engine import AsyncEngine
from asyncspec.engine.engine_process import EngineProcessClient
from asyncspec.errors import (
    EngineDeadError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    QueueFullError,
    RequestFailedError,
)
from asyncspec.server.convert import UsageCounter, max_tokens_per_response, to_engine_request, to_response
from asyncspec.server.metrics import RequestTimer, ServerMetrics
from asyncspec.v1 import asyncspec_pb2 as pb
from asyncspec.v1 import asyncspec_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

ServingEngine = AsyncEngine | EngineProcessClient
"""The engine behind the RPCs: in the server's process, or in one of its own (ServerConfig.engine_process)."""

_MAX_STATUS_BYTES = 4096
"""Bytes a refusal's message may take in its status as gRPC sends it (percent-encoded: a byte outside printable
ASCII takes three); the client's metadata limit is 16 KiB, past which the call ends RESOURCE_EXHAUSTED."""

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
"""asyncspec.v1.Generation: the readiness service name of the health checks."""


_LOADING = "the model is still loading; retry shortly"


class GenerationService(pb_grpc.GenerationServicer):
    """Maps the engine's typed errors onto gRPC status codes; never ends a stream silently."""

    def __init__(
        self,
        get_engine: Callable[[], ServingEngine | None],
        metrics: ServerMetrics,
        is_draining: Callable[[], bool],
        on_engine_dead: Callable[[], None],
        max_message_bytes: int = 16 * 2**20,
    ) -> None:
        self._get_engine = get_engine
        self.max_message_bytes = max_message_bytes
        """The server's message limit: a stream's coalesced responses stay below it."""
        self.metrics = metrics
        self._is_draining = is_draining
        self._on_engine_dead = on_engine_dead
        self._stream_ids: dict[object, str] = {}
        """The request id of each Generate stream in flight, by a token of its own (ids may repeat)."""

    @property
    def num_active_streams(self) -> int:
        return len(self._stream_ids)

    async def abort_streams(self) -> int:
        """Aborts the request of every stream in flight (the end of a drain): each stream then ends with a final
        ABORTED response carrying its usage, as the API documents for a shutdown. Returns how many."""
        engine = self._get_engine()
        request_ids = set(self._stream_ids.values())
        if engine is not None:
            for request_id in request_ids:
                await engine.abort(request_id)
        return len(request_ids)

    async def _engine(self, context: grpc.aio.ServicerContext) -> ServingEngine:
        engine = self._get_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _LOADING)
        assert engine is not None
        return engine

    async def Generate(  # noqa: N802 - the RPC's name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if self._is_draining():
            await self._refuse(
                context, "unavailable", grpc.StatusCode.UNAVAILABLE, "the server is draining; retry on another replica"
            )
        engine = self._get_engine()
        if engine is None:
            await self._refuse(context, "unavailable", grpc.StatusCode.UNAVAILABLE, _LOADING)
        assert engine is not None  # context.abort raises
        try:
            engine_request = to_engine_request(request, engine.engine.sampling_defaults)
        except (InvalidRequestError, InvalidSamplingParamsError, TypeError) as e:
            await self._refuse(context, "invalid_request", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        timer = RequestTimer(self.metrics, time.monotonic())
        usage = UsageCounter()
        # Named here (as the engine would name it) so that a drain can abort it before its first output.
        request_id = engine_request.request_id or uuid.uuid4().hex
        stream_token = object()
        self._stream_ids[stream_token] = request_id
        refused = False  # a typed refusal or the engine's failure: the request never ran to an end of its own
        try:
            # Deltas that piled up while this handler was busy go out as one message.
            stream = engine.generate(
                engine_request.prompt,
                engine_request.params,
                request_id=request_id,
                priority=engine_request.priority,
                coalesce=True,
                # A client that reads slowly gets its piled-up tokens in a few messages rather than one it
                # cannot be sent (RESOURCE_EXHAUSTED, the tokens lost).
                max_coalesced_tokens=max_tokens_per_response(self.max_message_bytes, engine_request.params.logprobs),
            )
            # Closed explicitly (not by the garbage collector) when the client cancels: the abort
            # and the id's release happen at once.
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    now = time.monotonic()
                    timer.on_delta(now, len(delta.token_ids))
                    usage.add(delta)
                    if delta.finished:
                        timer.on_finish(now, delta.finish_reason or "", delta.queued_seconds)
                    yield to_response(delta, usage)
        except (InvalidRequestError, InvalidSamplingParamsError) as e:
            refused = True
            await self._refuse(context, "invalid_request", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            refused = True
            await self._refuse(context, "queue_full", grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RequestFailedError as e:
            # This request alone failed: a final response says so, the stream ends normally.
            timer.on_finish(time.monotonic(), "error")
            if e.output is not None:  # its prompt counts, also when it failed before its first token
                usage.add_failure(e.output)
            yield pb.GenerateResponse(
                request_id=request_id,
                finished=True,
                finish_reason=pb.FINISH_REASON_ERROR,
                error=str(e),
                usage=usage.to_proto(),  # what its outputs so far counted, cached and draft tokens included
            )
        except EngineDeadError as e:
            refused = True
            if self._is_draining():  # shut down at the end of a drain: another replica can serve it
                await context.abort(grpc.StatusCode.UNAVAILABLE, short_status_message(f"the server shut down: {e}"))
            self._on_engine_dead()
            await context.abort(grpc.StatusCode.INTERNAL, short_status_message(str(e)))
        finally:
            del self._stream_ids[stream_token]
            if not refused and not timer.finished:
                # The client cancelled or its deadline passed: closing the stream aborted the request.
                timer.on_finish(time.monotonic(), "abort")

    async def _refuse(
        self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode, message: str
    ) -> None:
        """Counts a Generate call refused before it ran, then ends it with `code`."""
        self.metrics.request_refused.labels(reason).inc()
        await context.abort(code, short_status_message(message))

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:  # noqa: N802
        tokenizer = (await self._engine(context)).engine.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the server runs without a tokenizer")
        assert tokenizer is not None  # context.abort raises
        add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else True
        encoding = await asyncio.get_running_loop().run_in_executor(
            None, lambda: tokenizer.encode(request.text, add_special_tokens=add_special_tokens)
        )
        return pb.TokenizeResponse(token_ids=encoding.ids)

    async def Detokenize(  # noqa: N802
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        llm_engine = (await self._engine(context)).engine
        tokenizer = llm_engine.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the server runs without a tokenizer")
        assert tokenizer is not None  # context.abort raises
        vocab = llm_engine.vocab_size
        token_ids = request.token_ids
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        # Off the event loop, as Tokenize: a long list would stall every stream while it is checked and decoded.
        bad, text = await asyncio.get_running_loop().run_in_executor(
            None, lambda: _checked_decode(tokenizer, token_ids, vocab, skip)
        )
        if bad is not None:
            i, t = bad
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"token_ids[{i}] is {t}, outside the vocabulary [0, {vocab})"
            )
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:  # noqa: N802
        engine = (await self._engine(context)).engine
        config = engine.config
        info = pb.ModelInfo(
            model=config.model,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_ids=sorted(engine.eos_token_ids),
            speculative_method=config.speculative_method or "",
            num_speculative_tokens=config.num_speculative_tokens,
            draft_model=config.draft_model_path or "",
            async_scheduling=config.use_async_scheduling,
            tensor_parallel_size=config.tensor_parallel_size,
        )
        if engine.model_config.bos_token_id is not None:
            info.bos_token_id = engine.model_config.bos_token_id
        return info

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        engine = await self._engine(context)
        found = engine.has_request(request.request_id)
        await engine.abort(request.request_id)
        return pb.AbortResponse(found=found)


def _checked_decode(
    tokenizer: Tokenizer, token_ids: Sequence[int], vocab: int, skip_special_tokens: bool
) -> tuple[tuple[int, int] | None, str]:
    """(the first id outside [0, vocab) with its index, or None; the text, when every id is in range)."""
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab:
            return (i, t), ""
    return None, tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def short_status_message(message: str, max_bytes: int = _MAX_STATUS_BYTES) -> str:
    """`message` cut to what takes at most `max_bytes` once percent-encoded as gRPC sends a status message."""
    size = 0
    for i, char in enumerate(message):
        size += 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            return f"{message[:i]}... ({len(message)} characters)"
    return message
