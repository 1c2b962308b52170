"""Requests that do not decode are INVALID_ARGUMENT, never UNKNOWN or INTERNAL.

gRPC Python turns an exception of a request deserializer into an opaque status. :class:`DecodeGuard`
(installed by :func:`spiderflow.rpc.server.serve` on every server, closest to the servicers) wraps each
method's deserializer: bytes that are not a valid message become a :class:`Malformed` marker, and the
call is answered INVALID_ARGUMENT naming ``request`` before the servicer sees anything. For
client-streaming methods the same holds for each message of the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

__all__ = ["DecodeGuard", "Malformed", "checked_stream", "guard_deserializer", "refuse_malformed"]


@dataclass(frozen=True, slots=True)
class Malformed:
    """What a guarded deserializer returns for bytes that do not decode."""

    error: str


def guard_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserialize`` returning :class:`Malformed` instead of raising."""
    if deserialize is None:
        return None

    def call(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # protobuf's DecodeError and whatever a custom deserializer raises
            return Malformed(f"{type(e).__name__}: {e}"[:200])

    return call


async def refuse_malformed(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
    """Answer the call INVALID_ARGUMENT naming ``request`` (its message did not decode)."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: is not a valid message ({bad.error})")


def checked_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """A client stream whose first undecodable message answers the call INVALID_ARGUMENT."""
    async def gen() -> AsyncIterator[Any]:
        async for item in requests:
            if isinstance(item, Malformed):
                await refuse_malformed(context, item)
            yield item
    return gen()


class DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """See the module docstring."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        des, ser = guard_deserializer(handler.request_deserializer), handler.response_serializer
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, Malformed):
                    await refuse_malformed(context, request)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=des, response_serializer=ser)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, Malformed):
                    await refuse_malformed(context, request)
                result = inner_us(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:
                    await result

            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=des,
                                                        response_serializer=ser)

        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                return await inner_su(checked_stream(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=des,
                                                        response_serializer=ser)
        inner_ss = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            result = inner_ss(checked_stream(requests, context), context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                await result

        return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=des, response_serializer=ser)
