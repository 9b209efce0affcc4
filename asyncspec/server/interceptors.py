"""INVALID_ARGUMENT for a request message protobuf cannot parse, where grpc itself answers UNKNOWN."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _MalformedRequest:
    """What the wrapped deserializer hands the handler in place of a message it could not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A unary request that fails to parse (a string field with invalid UTF-8, a truncated message) ends with
    INVALID_ARGUMENT naming protobuf's error, as every other bad request does; grpc alone answers UNKNOWN,
    which clients and retry policies read as a server fault."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse: Callable[[bytes], Any] = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as e:
                return _MalformedRequest(str(e))

        kwargs = dict(request_deserializer=deserialize, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_checked_unary(handler.unary_unary), **kwargs)
        return grpc.unary_stream_rpc_method_handler(_checked_stream(handler.unary_stream), **kwargs)


async def _refuse(request: _MalformedRequest, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"malformed request: {request.error} (string fields must be valid UTF-8; send raw tokens as token_ids)",
    )


def _checked_unary(behavior):
    async def unary(request, context):
        if isinstance(request, _MalformedRequest):
            await _refuse(request, context)
        return await behavior(request, context)

    return unary


def _checked_stream(behavior):
    # A servicer's streaming method is either an async generator or a coroutine that writes with context.write.
    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            if isinstance(request, _MalformedRequest):
                await _refuse(request, context)
            async for response in behavior(request, context):
                yield response

        return stream

    async def writing(request, context):
        if isinstance(request, _MalformedRequest):
            await _refuse(request, context)
        return await behavior(request, context)

    return writing
