"""One server interceptor that does, in one pass per call, what the metrics, authentication and decode-guard
interceptors do as a chain.

:func:`spiderflow.rpc.server.serve` puts :class:`~spiderflow.metrics.RpcMetricsInterceptor` (first),
:class:`~spiderflow.security.auth.AuthInterceptor` and :class:`~spiderflow.security.guard.DecodeGuard`
(last) in front of every servicer. As separate grpc.aio interceptors each of them costs every call a
coroutine of its own to find the handler, a new method handler and one more wrapper around the servicer;
the scheduler serves thousands of SubmitJob calls a second on one core, where that was a large share of a
call. :class:`CallPipeline` keeps their behaviour, call for call:

* every call is counted and timed by service, method and final status code (refused ones too);
* every call except health checking and reflection is authenticated: a call its metadata alone refuses (a
  malformed ``authorization``, an unknown bearer token, no credentials on a server without certificates) is
  answered UNAUTHENTICATED before its request is parsed; otherwise it runs with the caller as
  :func:`~spiderflow.security.identity.current_principal` (its bearer token's principal, else its verified
  client certificate's);
* a request that does not decode is answered INVALID_ARGUMENT naming ``request``, after authentication and
  before the servicer sees it.

What it saves: one handler lookup coroutine instead of three, the wrapped handler's parts (guarded
deserializer, metric series) prepared once per method instead of per call, the bearer token read once
per call instead of twice, and the client certificate parsed once per certificate, not per call
(:meth:`~spiderflow.security.auth.Authenticator.from_certificate`), and only when no token names the
caller.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import structlog

from spiderflow.core.errors import UnauthenticatedError
from spiderflow.metrics import RpcMetricsInterceptor
from spiderflow.security.auth import EXEMPT_PREFIXES, Authenticator, AuthInterceptor
from spiderflow.security.guard import Malformed, checked_stream, guard_deserializer, refuse_malformed
from spiderflow.security.identity import Principal, reset_principal, use_principal

__all__ = ["CallPipeline", "fuse"]

log = structlog.get_logger(__name__)

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _skip(data: bytes) -> None:
    """The deserializer of a refused call: the request's bytes are never parsed."""
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Method:
    """What every call of one method shares, prepared at its first call."""

    handler: grpc.RpcMethodHandler
    """The servicer's handler it was prepared from (a different one prepares the method again)."""
    exempt: bool
    request_deserializer: Callable[[bytes], Any] | None
    response_serializer: Callable[[Any], bytes] | None


class CallPipeline(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Metrics (``metrics``, optional), authentication (``authenticator``, optional) and the decode guard,
    in that order, as one interceptor (see the module docstring)."""

    def __init__(self, *, metrics: RpcMetricsInterceptor | None = None,
                 authenticator: Authenticator | None = None) -> None:
        self.metrics = metrics
        self.authenticator = authenticator
        self._methods: dict[str, _Method] = {}  # only served methods reach here: bounded by the services

    def _prepare(self, method: str, handler: grpc.RpcMethodHandler) -> _Method:
        prepared = _Method(handler=handler, exempt=method.startswith(EXEMPT_PREFIXES),
                           request_deserializer=guard_deserializer(handler.request_deserializer),
                           response_serializer=handler.response_serializer)
        self._methods[method] = prepared
        return prepared

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        prepared = self._methods.get(method)
        if prepared is None or prepared.handler is not handler:
            prepared = self._prepare(method, handler)
        principal: Principal | None = None
        authenticate = self.authenticator is not None and not prepared.exempt
        if authenticate:
            assert self.authenticator is not None
            try:
                principal = self.authenticator.identify(handler_call_details.invocation_metadata)
            except UnauthenticatedError as e:
                return self._refusing(method, prepared, e)
        des, ser = prepared.request_deserializer, prepared.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary, authenticate, principal),
                request_deserializer=des, response_serializer=ser)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream, authenticate, principal),
                request_deserializer=des, response_serializer=ser)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(method, handler.stream_unary, authenticate, principal, streaming=True),
                request_deserializer=des, response_serializer=ser)
        return grpc.stream_stream_rpc_method_handler(
            self._stream(method, handler.stream_stream, authenticate, principal, streaming=True),
            request_deserializer=des, response_serializer=ser)

    async def _caller(self, method: str, context: grpc.aio.ServicerContext, principal: Principal | None) -> Principal:
        """The call's principal: its token's (found before), else its certificate's; UNAUTHENTICATED otherwise."""
        if principal is not None:
            return principal
        assert self.authenticator is not None
        try:
            return self.authenticator.from_certificate(context.auth_context())
        except UnauthenticatedError as e:
            log.info("auth.refused", method=method, peer=context.peer(), error=str(e))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            raise AssertionError("unreachable: abort raises") from e

    def _unary(self, method: str, behavior: Behavior, authenticate: bool, principal: Principal | None, *,
               streaming: bool = False) -> Behavior:
        metrics = self.metrics

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, error = (metrics.now() if metrics is not None else 0.0), None
            try:
                token = use_principal(await self._caller(method, context, principal)) if authenticate else None
                try:
                    if streaming:
                        request = checked_stream(request, context)
                    elif isinstance(request, Malformed):
                        await refuse_malformed(context, request)
                    return await behavior(request, context)
                finally:
                    if token is not None:
                        reset_principal(token)
            except BaseException as e:
                error = e
                raise
            finally:
                if metrics is not None:
                    metrics.record(method, context, error, started)

        return call

    def _stream(self, method: str, behavior: Behavior, authenticate: bool, principal: Principal | None, *,
                streaming: bool = False) -> Behavior:
        metrics = self.metrics

        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started, error = (metrics.now() if metrics is not None else 0.0), None
            try:
                if authenticate:  # for the rest of the stream (an async generator has its own context)
                    use_principal(await self._caller(method, context, principal))
                if streaming:
                    request = checked_stream(request, context)
                elif isinstance(request, Malformed):
                    await refuse_malformed(context, request)
                result = behavior(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:
                    await result
            except BaseException as e:
                error = e
                raise
            finally:
                if metrics is not None:
                    metrics.record(method, context, error, started)

        return call

    def _refusing(self, method: str, prepared: _Method, error: UnauthenticatedError) -> grpc.RpcMethodHandler:
        """A handler of the same kind as the method's that answers UNAUTHENTICATED without parsing the request
        (and is counted like any call)."""
        metrics = self.metrics

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = metrics.now() if metrics is not None else 0.0
            log.info("auth.refused", method=method, peer=context.peer(), error=str(error))
            try:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
            except BaseException as e:
                if metrics is not None:
                    metrics.record(method, context, e, started)
                raise

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await refuse(request, context)
            yield None  # unreachable: abort raises

        handler, ser = prepared.handler, prepared.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=_skip, response_serializer=ser)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, request_deserializer=_skip,
                                                        response_serializer=ser)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=_skip, response_serializer=ser)
        return grpc.stream_stream_rpc_method_handler(refuse_stream, request_deserializer=_skip,
                                                     response_serializer=ser)


def fuse(interceptors: list[grpc.aio.ServerInterceptor]) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a server runs, decode guard included: one :class:`CallPipeline` when ``interceptors``
    are at most an :class:`~spiderflow.metrics.RpcMetricsInterceptor` followed by at most one
    :class:`~spiderflow.security.auth.AuthInterceptor` (what every SpiderFlow service passes); otherwise
    the given chain followed by a :class:`~spiderflow.security.guard.DecodeGuard`, as before."""
    rest = list(interceptors)
    metrics = rest.pop(0) if rest and isinstance(rest[0], RpcMetricsInterceptor) else None
    auth = rest.pop(0) if rest and isinstance(rest[0], AuthInterceptor) else None
    if rest:
        from spiderflow.security.guard import DecodeGuard

        return [*interceptors, DecodeGuard()]
    return [CallPipeline(metrics=metrics, authenticator=auth.authenticator if auth is not None else None)]
