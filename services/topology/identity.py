"""Who is calling: the caller's identity and the one authorisation rule of the topology service.

Two kinds of callers:

* **Authenticated** (the service runs with ``--tls-dir`` and/or ``--tokens``): the principal comes from the
  verified client certificate or the bearer token (:class:`~spiderflow.security.auth.AuthInterceptor`),
  never from the request. Only ``agent`` principals may report, and an agent is bound to the cluster its
  principal names (``agent:virginia`` → ``virginia``): a report about any other cluster is
  PERMISSION_DENIED, whatever ``agent_id`` the request claims (:func:`caller_from_principal`,
  :func:`authorize_cluster`). The cluster must be registered (:class:`agent.registration.Registration`);
  the registration's own ``principal`` field does not widen or narrow this (an agent with a certificate
  writes its cluster name there, one with a token its instance id).
* **Unauthenticated** (plaintext on loopback, no tokens): the principal is the ``agent_id`` the agent sends
  in each report (the instance id it registered under its lease), and a report about cluster ``c`` is allowed
  iff it equals the ``principal`` of ``c``'s live registration (:func:`caller_from_request`).

The resolver is a plain callable ``(claimed_agent_id, grpc_context) -> Caller`` handed to the servicer;
failures are :class:`~spiderflow.core.errors.PermissionDeniedError` (PERMISSION_DENIED).

Pure: no grpc import (the context is passed through untyped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.registration import Registration
from spiderflow.core.errors import PermissionDeniedError, UnauthenticatedError, ValidationError
from spiderflow.security.identity import Role, current_principal

__all__ = ["Caller", "IdentityResolver", "authorize", "authorize_cluster", "caller_from_principal",
           "caller_from_request"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """An authenticated caller: ``principal`` (what registrations are compared with) and the
    ``agent_id`` it claims (recorded with its reports)."""

    principal: str
    agent_id: str
    cluster: str | None = None
    """The one cluster an authenticated caller may report about (its principal's name); None
    (unauthenticated): any cluster registered under its principal."""


IdentityResolver = Callable[[str, Any], Caller]
"""``(claimed_agent_id, grpc_context) -> Caller``; raises ValidationError/PermissionDeniedError."""


def caller_from_request(agent_id: str, context: Any = None) -> Caller:
    """The caller as the request names it (``agent_id``, required)."""
    if not agent_id:
        raise ValidationError("agent_id", "is required (the agent's registered instance id)")
    return Caller(principal=agent_id, agent_id=agent_id)


def caller_from_principal(agent_id: str, context: Any = None) -> Caller:
    """The caller as its authenticated principal (certificate or bearer token) names it: an ``agent``
    principal, bound to the cluster it names; other roles may not report (PERMISSION_DENIED)."""
    principal = current_principal()
    if principal is None:
        raise UnauthenticatedError("a client certificate or a bearer token is required")
    if principal.role is not Role.AGENT:
        raise PermissionDeniedError(f"{principal} is not an agent: only agents report topology")
    return Caller(principal=principal.name, agent_id=agent_id or principal.name, cluster=principal.name)


def authorize_cluster(caller: Caller, cluster: str) -> None:
    """Raise PermissionDeniedError when the caller is bound to a cluster other than ``cluster``."""
    if caller.cluster is not None and caller.cluster != cluster:
        raise PermissionDeniedError(f"agent of cluster {caller.cluster!r} may not report for cluster {cluster!r}")


def authorize(registration: Registration, caller: Caller) -> None:
    """Allow the caller to report about ``registration.cluster`` or raise PermissionDeniedError."""
    if caller.cluster is not None:
        authorize_cluster(caller, registration.cluster)
        return
    if caller.principal != registration.principal:
        raise PermissionDeniedError(
            f"agent {caller.agent_id!r} may not report for cluster {registration.cluster!r}: "
            f"the cluster is registered by {registration.agent_id!r}"
        )
