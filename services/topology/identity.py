"""Who is calling: the caller's identity and the one authorisation rule of the topology service.

Rule: a report about cluster ``c`` is allowed iff the caller's ``principal`` equals the ``principal``
of ``c``'s live registration (:class:`agent.registration.Registration`). Otherwise the call fails with
PERMISSION_DENIED (:class:`~spiderflow.errors.PermissionDeniedError`).

Today the principal is the ``agent_id`` the agent sends in each report (the instance id it registered
under its lease): :func:`caller_from_request`. With mTLS the servicer is given a resolver that takes the
principal from the verified client certificate instead (e.g. its common name) — only the resolver
changes; registrations then carry the certificate name as ``principal``. The resolver is a plain
callable ``(claimed_agent_id, grpc_context) -> Caller`` handed to the servicer.

Pure: no grpc import (the context is passed through untyped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.registration import Registration
from spiderflow.errors import PermissionDeniedError, ValidationError

__all__ = ["Caller", "IdentityResolver", "authorize", "caller_from_request"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """An authenticated caller: ``principal`` (what registrations are compared with) and the
    ``agent_id`` it claims (recorded with its reports)."""

    principal: str
    agent_id: str


IdentityResolver = Callable[[str, Any], Caller]
"""``(claimed_agent_id, grpc_context) -> Caller``; raises ValidationError/PermissionDeniedError."""


def caller_from_request(agent_id: str, context: Any = None) -> Caller:
    """The caller as the request names it (``agent_id``, required)."""
    if not agent_id:
        raise ValidationError("agent_id", "is required (the agent's registered instance id)")
    return Caller(principal=agent_id, agent_id=agent_id)


def authorize(registration: Registration, caller: Caller) -> None:
    """Allow the caller to report about ``registration.cluster`` or raise PermissionDeniedError."""
    if caller.principal != registration.principal:
        raise PermissionDeniedError(
            f"agent {caller.agent_id!r} may not report for cluster {registration.cluster!r}: "
            f"the cluster is registered by {registration.agent_id!r}"
        )
