"""Authentication of gRPC calls: bearer tokens, client certificates, and the server interceptor.

Every call a service serves with authentication on is either

* refused with UNAUTHENTICATED (no client certificate with a SpiderFlow role and no bearer token, or a
  bearer token the tokens file does not list), or
* served with :func:`~spiderflow.security.identity.current_principal` set to the caller.

A bearer token (``authorization: Bearer <token>`` metadata) wins over the certificate, so an operator
can act as a tenant over an mTLS connection. Health checking and server reflection are exempt (load
balancers and grpcurl ``list`` need no identity).

Tokens file (YAML or JSON): a mapping ``token -> principal``, e.g.::

    tokens:
      7f3c9a...e1: tenant:alice
      0b41d2...9c: admin:ops
      c2e8f0...47: agent:virginia

Tokens must be at least 16 characters; only their SHA-256 digests are kept in memory.

A call refused from its metadata alone (no or an unknown token on a server without certificates) is
refused before its request is parsed: an unauthenticated client cannot make the server decode a large
message (with mTLS, the TLS handshake authenticates before any byte of a request arrives).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import structlog
import yaml

from spiderflow.core.errors import UnauthenticatedError, ValidationError
from spiderflow.security.certs import principal_of_pem
from spiderflow.security.identity import Principal, current_principal, parse_principal, reset_principal, use_principal

__all__ = [
    "EXEMPT_PREFIXES",
    "AuthInterceptor",
    "Authenticator",
    "TokenTable",
    "bearer_metadata",
    "client_key",
]

log = structlog.get_logger(__name__)

EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
"""Methods served without authentication."""

MIN_TOKEN_CHARS = 16
CERTIFICATE_CACHE = 1024
"""Client certificates whose principal is remembered (least recently used beyond)."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Bearer token → principal. Build with :meth:`load` (a file) or from a mapping."""

    def __init__(self, tokens: Mapping[str, Principal]) -> None:
        for t in tokens:
            if len(t) < MIN_TOKEN_CHARS:
                raise ValidationError("tokens", f"a token must have at least {MIN_TOKEN_CHARS} characters",
                                      len(t))
        self._by_digest = {_digest(t): p for t, p in tokens.items()}

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        """Read a tokens file (see the module docstring); ``ValidationError`` naming the file otherwise."""
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValidationError(str(path), f"cannot read the tokens file: {e}") from None
        table = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(table, dict):
            raise ValidationError(f"{path}: tokens", "must be a mapping token -> role:name")
        out: dict[str, Principal] = {}
        for token, who in table.items():
            if not isinstance(token, str) or not isinstance(who, str):
                raise ValidationError(f"{path}: tokens", "keys and values must be strings")
            out[token] = parse_principal(who)
        return cls(out)

    def lookup(self, token: str) -> Principal | None:
        return self._by_digest.get(_digest(token))

    def __len__(self) -> int:
        return len(self._by_digest)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` (empty when there is none)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise UnauthenticatedError("the authorization metadata must be 'Bearer <token>'")
            return token.strip()
    return None


class Authenticator:
    """Who a call comes from: its bearer token (when ``tokens`` are configured) or its verified client
    certificate (when ``certificates``: the server runs mTLS)."""

    def __init__(self, *, tokens: TokenTable | None = None, certificates: bool = False) -> None:
        self.tokens = tokens
        self.certificates = certificates
        # a certificate's principal, parsed once per certificate (its bytes are the key: every call of a
        # connection presents the same verified certificate, and it names the same principal every time)
        self._principal_of_certificate = functools.lru_cache(maxsize=CERTIFICATE_CACHE)(principal_of_pem)

    def identify(self, metadata: Sequence[tuple[str, Any]] | None) -> Principal | None:
        """The caller its metadata names (its bearer token), or None when only its certificate can tell
        (mTLS: the TLS handshake already verified it). Raises :class:`UnauthenticatedError` when the
        metadata alone refuses the call: before its request is read or parsed."""
        token = _bearer(metadata)
        if token is None:
            if self.certificates:
                return None
            raise UnauthenticatedError("no credentials: present a client certificate or a bearer token")
        if self.tokens is None:
            raise UnauthenticatedError("this server accepts no bearer tokens (use a client certificate)")
        principal = self.tokens.lookup(token)
        if principal is None:
            raise UnauthenticatedError("unknown bearer token")
        return principal

    def refuse_early(self, metadata: Sequence[tuple[str, Any]] | None) -> UnauthenticatedError | None:
        """Why a call is refused from its metadata alone (before its request is read or parsed), or None
        when it may go on (:meth:`identify`)."""
        try:
            self.identify(metadata)
        except UnauthenticatedError as e:
            return e
        return None

    def from_certificate(self, auth_context: Mapping[str, Sequence[bytes]] | None) -> Principal:
        """The principal of the verified client certificate of the call's connection; raises
        :class:`UnauthenticatedError` when there is none (or it names no SpiderFlow role). A certificate is
        parsed once, not at every call (the last :data:`CERTIFICATE_CACHE` certificates are remembered)."""
        if self.certificates and auth_context:
            pems = auth_context.get("x509_pem_cert") or ()
            if pems:
                principal = self._principal_of_certificate(bytes(pems[0]))
                if principal is None:
                    raise UnauthenticatedError("the client certificate names no SpiderFlow role (OU)")
                return principal
        raise UnauthenticatedError("no credentials: present a client certificate or a bearer token")

    def authenticate(self, metadata: Sequence[tuple[str, Any]] | None,
                     auth_context: Mapping[str, Sequence[bytes]] | None) -> Principal:
        """The caller's principal: its bearer token's, else its certificate's; raises
        :class:`UnauthenticatedError`."""
        principal = self.identify(metadata)
        return principal if principal is not None else self.from_certificate(auth_context)


def _skip(data: bytes) -> None:
    """The deserializer of a refused call: the request's bytes are never parsed."""
    return None


def _refusing(handler: grpc.RpcMethodHandler, method: str, error: UnauthenticatedError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED without parsing the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        log.info("auth.refused", method=method, peer=context.peer(), error=str(error))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(request, context)
        yield None  # unreachable: abort raises

    ser = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=_skip, response_serializer=ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, request_deserializer=_skip, response_serializer=ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, request_deserializer=_skip, response_serializer=ser)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, request_deserializer=_skip, response_serializer=ser)


def client_key(context: grpc.aio.ServicerContext) -> str:
    """The key a caller is rate-limited under: its principal, else its IP address."""
    principal = current_principal()
    if principal is not None:
        return str(principal)
    peer = context.peer() or ""
    host = peer.split(":", 1)[1] if ":" in peer else peer  # "ipv4:127.0.0.1:5555" -> "127.0.0.1:5555"
    return host.rsplit(":", 1)[0] or "unknown"


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates every call (except :data:`EXEMPT_PREFIXES`) and serves it with the caller as the
    current principal; refuses it with UNAUTHENTICATED otherwise."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def _principal(self, details: grpc.HandlerCallDetails, context: grpc.aio.ServicerContext) -> Principal:
        try:
            principal = self.authenticator.identify(details.invocation_metadata)
            # the connection's certificate is read only when no token names the caller
            return principal if principal is not None else self.authenticator.from_certificate(context.auth_context())
        except UnauthenticatedError as e:
            log.info("auth.refused", method=details.method, peer=context.peer(), error=str(e))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            raise AssertionError("unreachable: abort raises") from e

    def _unary(self, details: grpc.HandlerCallDetails, behavior: Behavior) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            token = use_principal(await self._principal(details, context))
            try:
                return await behavior(request, context)
            finally:
                reset_principal(token)

        return call

    def _stream(self, details: grpc.HandlerCallDetails, behavior: Behavior) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            use_principal(await self._principal(details, context))
            result = behavior(request, context)
            if hasattr(result, "__aiter__"):
                async for item in result:
                    yield item
            else:
                await result

        return call

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        refused = self.authenticator.refuse_early(handler_call_details.invocation_metadata)
        if refused is not None:
            return _refusing(handler, handler_call_details.method, refused)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler_call_details, handler.unary_unary),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler_call_details, handler.unary_stream),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler_call_details, handler.stream_unary),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._stream(handler_call_details, handler.stream_stream),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
