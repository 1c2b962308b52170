"""The domain error tree.

Every error that can reach a user derives from :class:`SpiderFlowError`. Adapters map the classes to
transport codes in one place (gRPC status codes in ``spiderflow.rpc.errors``, CLI exit codes in the
CLI), so the meaning of an error survives every boundary.

=========================  ==========================  ==================
class                      meaning                     gRPC code
=========================  ==========================  ==================
``ValidationError``        input is malformed          INVALID_ARGUMENT
``CorruptRecordError``     a stored record is unread-  DATA_LOSS
                           able (names key and field)
``NotFoundError``          a named thing is absent     NOT_FOUND
``AlreadyExistsError``     a key is already taken      ALREADY_EXISTS
``ConflictError``          lost a compare-and-swap     ABORTED
``PreconditionError``      valid, but cannot be done   FAILED_PRECONDITION
``UnschedulableError``     no placement satisfies job  FAILED_PRECONDITION
``UnauthenticatedError``  caller proved no identity    UNAUTHENTICATED
``PermissionDeniedError``  caller may not do this      PERMISSION_DENIED
``ResourceExhaustedError`` rate limit or queue bound   RESOURCE_EXHAUSTED
``UnavailableError``       a dependency is down        UNAVAILABLE
=========================  ==========================  ==================
"""

from __future__ import annotations

__all__ = [
    "AlreadyExistsError",
    "ConflictError",
    "CorruptRecordError",
    "NotFoundError",
    "PermissionDeniedError",
    "PreconditionError",
    "ResourceExhaustedError",
    "SpiderFlowError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnschedulableError",
    "ValidationError",
]


class SpiderFlowError(Exception):
    """Base of every error SpiderFlow reports to a user."""


class ValidationError(SpiderFlowError, ValueError):
    """Malformed input. ``field`` is a dotted path (``jobs[3].gpus.min``); ``value`` the offending value."""

    def __init__(self, field: str, reason: str, value: object = None) -> None:
        self.field = field
        self.reason = reason
        self.value = value
        shown = "" if value is None else f" (got {value!r})"
        super().__init__(f"{field}: {reason}{shown}")


class CorruptRecordError(ValidationError):
    """A record read back from the store cannot be decoded: an unknown key, or a value that is not the record
    its key holds. ``key`` is the etcd key, ``field`` the dotted path inside the value (``key`` when the key
    itself is unknown), ``reason`` what is wrong. A :class:`ValidationError` (the data is malformed) that is
    nevertheless no fault of the caller's request: it travels as DATA_LOSS."""

    def __init__(self, *, key: str, field: str, reason: str, value: object = None) -> None:
        self.key = key
        super().__init__(field, reason, value)
        self.args = (f"stored record {key}: {field}: {reason}",)

    def __str__(self) -> str:
        return str(self.args[0])


class NotFoundError(SpiderFlowError, LookupError):
    """A named object (job, cluster, plan, key) does not exist."""


class AlreadyExistsError(SpiderFlowError):
    """A create found the key already present."""


class ConflictError(SpiderFlowError):
    """A compare-and-swap lost: the object changed since it was read."""


class PreconditionError(SpiderFlowError):
    """The request is well formed but the system's state does not allow it."""


class UnschedulableError(PreconditionError):
    """No placement satisfies the job. ``constraint`` names the binding constraint."""

    def __init__(self, reason: str, *, constraint: str = "") -> None:
        self.constraint = constraint
        super().__init__(reason)


class PermissionDeniedError(SpiderFlowError):
    """The caller's identity does not allow the operation."""


class UnauthenticatedError(SpiderFlowError):
    """The call carries no valid identity (no client certificate, a missing or unknown bearer token)."""


class ResourceExhaustedError(SpiderFlowError):
    """A rate limit or a bounded queue refused the request. ``retry_after_s``, when known, is how long the
    caller should wait before retrying (it travels to clients in the error metadata)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class UnavailableError(SpiderFlowError):
    """A dependency (etcd, another service) cannot be reached right now; retrying may succeed."""
