"""Domain errors across gRPC, both ways.

Server side: decorate grpc.aio servicer methods (unary or server-streaming) with :func:`rpc_method`, or a
whole servicer class with :func:`map_domain_errors`. A :class:`~spiderflow.core.errors.SpiderFlowError` raised
inside aborts the call with the code of :data:`STATUS_CODES` (the table of :mod:`spiderflow.core.errors`) and
``str(error)`` as the details, e.g. ``INVALID_ARGUMENT: job.gpus.min: must be ≤ gpus.max (8) (got 16)``.
The error's class, field, reason, value and constraint also travel in the binary trailing metadata entry
:data:`ERROR_METADATA_KEY` (JSON), so clients rebuild the same exception. ``NotImplementedError`` becomes
UNIMPLEMENTED; any other exception is logged and becomes INTERNAL with a generic message (never a
traceback, and never for a domain error).

Client side: :func:`from_rpc_error` turns a ``grpc.RpcError`` into the domain error (the exact class when
the server sent the metadata, else by status code; codes with no domain meaning give
:class:`RemoteError`); :func:`domain_errors` is a context manager doing it around calls and streams.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import grpc
import grpc.aio
import structlog

from spiderflow.core import errors as E

__all__ = [
    "ERROR_METADATA_KEY",
    "STATUS_CODES",
    "RemoteError",
    "domain_errors",
    "error_metadata",
    "from_rpc_error",
    "map_domain_errors",
    "rpc_method",
    "status_for",
]

log = structlog.get_logger(__name__)

ERROR_METADATA_KEY = "spiderflow-error-bin"
"""Trailing metadata key carrying ``{"class", "field", "reason", "value", "constraint"}`` as UTF-8 JSON."""

STATUS_CODES: tuple[tuple[type[E.SpiderFlowError], grpc.StatusCode], ...] = (
    (E.CorruptRecordError, grpc.StatusCode.DATA_LOSS),
    (E.ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (E.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (E.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (E.ConflictError, grpc.StatusCode.ABORTED),
    (E.UnschedulableError, grpc.StatusCode.FAILED_PRECONDITION),
    (E.PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (E.UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (E.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (E.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.UnavailableError, grpc.StatusCode.UNAVAILABLE),
)
"""Domain error class -> status code; the first class the error is an instance of wins."""

# Status code -> the class a client raises when the server sent no class in the metadata.
_BY_CODE: dict[grpc.StatusCode, type[E.SpiderFlowError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: E.ValidationError,
    grpc.StatusCode.NOT_FOUND: E.NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: E.AlreadyExistsError,
    grpc.StatusCode.ABORTED: E.ConflictError,
    grpc.StatusCode.FAILED_PRECONDITION: E.PreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: E.UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: E.PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: E.ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: E.UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: E.UnavailableError,
}
_CLASSES: dict[str, type[E.SpiderFlowError]] = {cls.__name__: cls for cls, _ in STATUS_CODES}


class RemoteError(E.SpiderFlowError):
    """A call failed with a status that has no domain meaning (INTERNAL, UNKNOWN, UNIMPLEMENTED,
    CANCELLED, ...). ``code`` is the status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"{code.name}: {details}" if details else code.name)


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status code for an exception: the table for domain errors, UNIMPLEMENTED for
    ``NotImplementedError``, INTERNAL otherwise."""
    for cls, code in STATUS_CODES:
        if isinstance(error, cls):
            return code
    if isinstance(error, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL


_MAX_VALUE_CHARS = 512
_MAX_DETAILS_CHARS = 2048


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _jsonable(value: object) -> object:
    """``value`` if it is JSON and small, else its (clipped) repr: metadata must stay well under the
    8 KiB header limit of gRPC clients."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return _clip(repr(value), _MAX_VALUE_CHARS)
    return value if len(text) <= _MAX_VALUE_CHARS else _clip(repr(value), _MAX_VALUE_CHARS)


def error_metadata(error: E.SpiderFlowError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that lets a client rebuild ``error`` (see :data:`ERROR_METADATA_KEY`)."""
    cls = next((c for c, _ in STATUS_CODES if type(error) is c), None) or next(
        (c for c, _ in STATUS_CODES if isinstance(error, c)), E.SpiderFlowError
    )
    doc: dict[str, object] = {"class": cls.__name__}
    if isinstance(error, E.CorruptRecordError):
        doc["key"] = _clip(error.key, _MAX_VALUE_CHARS)
    if isinstance(error, E.ValidationError):
        doc.update(field=error.field, reason=_clip(error.reason, _MAX_DETAILS_CHARS),
                   value=_jsonable(error.value))
    if isinstance(error, E.UnschedulableError):
        doc["constraint"] = error.constraint
    if isinstance(error, E.ResourceExhaustedError) and error.retry_after_s is not None:
        doc["retry_after_s"] = round(float(error.retry_after_s), 3)
    return ((ERROR_METADATA_KEY, json.dumps(doc, ensure_ascii=False).encode()),)


async def _abort(context: grpc.aio.ServicerContext, error: Exception, method: str) -> None:
    code = status_for(error)
    if isinstance(error, E.SpiderFlowError):
        log.info("rpc.error", method=method, code=code.name, error=str(error), error_class=type(error).__name__)
        details = _clip(str(error), _MAX_DETAILS_CHARS)
        await context.abort(code, details, trailing_metadata=error_metadata(error))
    elif code is grpc.StatusCode.UNIMPLEMENTED:
        await context.abort(code, str(error) or f"{method} is not implemented")
    else:
        log.exception("rpc.internal_error", method=method, error_class=type(error).__name__)
        await context.abort(code, f"internal error in {method} ({type(error).__name__})")


F = TypeVar("F", bound=Callable[..., Any])


def rpc_method(fn: F) -> F:
    """Decorate a grpc.aio servicer method ``(self, request, context)``: unary (``async def``) or
    server-streaming (``async def`` with ``yield``). Errors are mapped as the module docstring says;
    ``grpc.aio.AbortError`` (the servicer aborted by itself) and cancellation pass through."""
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "rpc"))
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: object, request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await _abort(context, error, name)

        return cast(F, stream)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{name}: rpc_method needs an async def servicer method")

    @functools.wraps(fn)
    async def unary(self: object, request: object, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await cast(Callable[..., Awaitable[Any]], fn)(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort(context, error, name)
            raise AssertionError("unreachable: context.abort raises") from error

    return cast(F, unary)


C = TypeVar("C", bound=type)


def map_domain_errors(cls: C) -> C:
    """Class decorator: apply :func:`rpc_method` to every RPC method the class defines itself (public
    ``async def`` methods whose name starts with an upper-case letter, as gRPC method names do)."""
    for attr, value in list(vars(cls).items()):
        if attr[:1].isupper() and (inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value)):
            setattr(cls, attr, rpc_method(value))
    return cls


# ---------------------------------------------------------------------------------------------- client


def _metadata_doc(err: grpc.RpcError) -> dict[str, Any] | None:
    trailing = getattr(err, "trailing_metadata", None)
    if trailing is None:
        return None
    try:
        items = trailing() or ()
    except Exception:  # pragma: no cover - defensive: metadata of a broken call
        return None
    for key, value in items:
        if key == ERROR_METADATA_KEY:
            try:
                doc = json.loads(value.decode() if isinstance(value, bytes) else value)
            except (ValueError, UnicodeDecodeError):
                return None
            return doc if isinstance(doc, dict) else None
    return None


def from_rpc_error(err: grpc.RpcError) -> E.SpiderFlowError:
    """The domain error a failed call stands for.

    With the server's metadata, the exact class with its field/reason/value/constraint; without it, the
    class of the status code (INVALID_ARGUMENT -> ValidationError with field ``request``, DEADLINE_EXCEEDED
    -> UnavailableError, ...); other codes -> :class:`RemoteError`.
    """
    code: grpc.StatusCode = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details: str = (err.details() if callable(getattr(err, "details", None)) else "") or ""
    doc = _metadata_doc(err)
    cls = _CLASSES.get(str(doc.get("class"))) if doc else None
    if cls is None:
        cls = _BY_CODE.get(code)
    if cls is None:
        return RemoteError(code, details)
    if issubclass(cls, E.CorruptRecordError):
        if doc and "field" in doc:
            return cls(key=str(doc.get("key", "")), field=str(doc["field"]), reason=str(doc.get("reason", "")),
                       value=doc.get("value"))
        return cls(key="", field="record", reason=details)  # pragma: no cover - only with metadata
    if issubclass(cls, E.ValidationError):
        if doc and "field" in doc:
            return cls(str(doc["field"]), str(doc.get("reason", "")), doc.get("value"))
        return cls("request", details)
    if issubclass(cls, E.UnschedulableError):
        return cls(details, constraint=str(doc.get("constraint", "")) if doc else "")
    if issubclass(cls, E.ResourceExhaustedError):
        retry = doc.get("retry_after_s") if doc else None
        return cls(details, retry_after_s=float(retry) if isinstance(retry, int | float) else None)
    return cls(details)


@contextmanager
def domain_errors() -> Iterator[None]:
    """Raise the domain error of any ``grpc.RpcError`` raised inside the block (unary calls and the
    iteration of streams alike; usable in async code, the block may contain ``await``)."""
    try:
        yield
    except grpc.RpcError as err:
        raise from_rpc_error(err) from err
