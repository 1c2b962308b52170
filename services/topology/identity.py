"""Who is calling: the caller's identity and the one authorisation rule of the topology service.

Rule: a report about cluster ``c`` is allowed iff the caller's ``principal`` equals the ``principal``
of ``c``'s live registration (:class:`agent.registration.Registration`). Otherwise the call fails with
PERMISSION_DENIED (:class:`~spiderflow.errors.PermissionDeniedError`).

Without certificates (plaintext on loopback) the principal is the ``agent_id`` the agent sends in each
report (the instance id it registered under its lease): :func:`caller_from_request`. With mTLS
(``--tls-dir``) the servicer uses :func:`caller_from_certificate`: the principal is the cluster named by the
verified client certificate (``agent:<cluster>``), registrations carry that cluster name as ``principal``,
and a caller may report only about its own cluster (:func:`authorize_cluster`). The resolver is a plain
callable ``(claimed_agent_id, grpc_context) -> Caller`` handed to the servicer.

Pure: no grpc import (the context is passed through untyped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.registration import Registration
from spiderflow.errors import PermissionDeniedError, UnauthenticatedError, ValidationError
from spiderflow.security.identity import Role, current_principal

__all__ = ["Caller", "IdentityResolver", "authorize", "authorize_cluster", "caller_from_certificate",
           "caller_from_request"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    """An authenticated caller: ``principal`` (what registrations are compared with) and the
    ``agent_id`` it claims (recorded with its reports)."""

    principal: str
    agent_id: str
    cluster: str | None = None
    """The one cluster the caller may report about (the certificate's cluster); None: any registered
    under its principal."""


IdentityResolver = Callable[[str, Any], Caller]
"""``(claimed_agent_id, grpc_context) -> Caller``; raises ValidationError/PermissionDeniedError."""


def caller_from_request(agent_id: str, context: Any = None) -> Caller:
    """The caller as the request names it (``agent_id``, required)."""
    if not agent_id:
        raise ValidationError("agent_id", "is required (the agent's registered instance id)")
    return Caller(principal=agent_id, agent_id=agent_id)


def caller_from_certificate(agent_id: str, context: Any = None) -> Caller:
    """The caller as its verified certificate names it: an ``agent`` principal, whose name (the cluster)
    is the principal; other roles may not report (PERMISSION_DENIED)."""
    principal = current_principal()
    if principal is None:
        raise UnauthenticatedError("a client certificate is required")
    if principal.role is not Role.AGENT:
        raise PermissionDeniedError(f"{principal} is not an agent: only agents report topology")
    return Caller(principal=principal.name, agent_id=agent_id or principal.name, cluster=principal.name)


def authorize_cluster(caller: Caller, cluster: str) -> None:
    """Raise PermissionDeniedError when the caller is bound to a cluster other than ``cluster``."""
    if caller.cluster is not None and caller.cluster != cluster:
        raise PermissionDeniedError(f"agent of cluster {caller.cluster!r} may not report for cluster {cluster!r}")


def authorize(registration: Registration, caller: Caller) -> None:
    """Allow the caller to report about ``registration.cluster`` or raise PermissionDeniedError."""
    if caller.principal != registration.principal:
        raise PermissionDeniedError(
            f"agent {caller.agent_id!r} may not report for cluster {registration.cluster!r}: "
            f"the cluster is registered by {registration.agent_id!r}"
        )
