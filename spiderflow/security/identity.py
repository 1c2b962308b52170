"""Who is calling: principals, and the principal of the call being served.

A **principal** is a role and a name, written ``role:name``:

==========  =====================  ===================================================================
role        name                   may
==========  =====================  ===================================================================
``tenant``  the tenant (``alice``)  submit jobs for itself; see, watch and cancel only its own jobs
``agent``   the cluster it runs     report progress of jobs whose plan has a stage on its cluster
``service`` the service             call other services on behalf of the system (scheduler → planner)
``admin``   the operator            everything, across tenants
==========  =====================  ===================================================================

The principal comes from the verified client certificate (subject ``OU`` = role, ``CN`` = name; see
:mod:`spiderflow.security.certs`) or from a bearer token (:mod:`spiderflow.security.auth`). While a call
is served, :func:`current_principal` returns it (a context variable set by
:class:`~spiderflow.security.auth.AuthInterceptor`); it is ``None`` when the server runs without
authentication (explicit ``--insecure`` development mode), in which case every call is allowed.

Pure: no grpc import.
"""

from __future__ import annotations

import contextvars
import re
from dataclasses import dataclass
from enum import StrEnum

from spiderflow.core.errors import ValidationError

__all__ = ["Principal", "Role", "current_principal", "parse_principal", "reset_principal", "use_principal"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Role(StrEnum):
    """What a principal is (see the module table)."""

    TENANT = "tenant"
    AGENT = "agent"
    SERVICE = "service"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """An authenticated caller. ``name`` is the tenant, the cluster, the service or the operator."""

    role: Role
    name: str

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValidationError("principal.name", "must be 1–63 characters of [A-Za-z0-9._-]", self.name)

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"

    @property
    def privileged(self) -> bool:
        """Admins and services act across tenants."""
        return self.role in (Role.ADMIN, Role.SERVICE)


def parse_principal(text: str) -> Principal:
    """``role:name`` → :class:`Principal`; ``ValidationError`` otherwise."""
    role, sep, name = text.strip().partition(":")
    if not sep:
        raise ValidationError("principal", "must be role:name (tenant:alice, agent:virginia, admin:ops)", text)
    try:
        r = Role(role)
    except ValueError:
        raise ValidationError("principal.role", f"must be one of {', '.join(Role)}", role) from None
    return Principal(role=r, name=name)


_CURRENT: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("spiderflow_principal", default=None)


def current_principal() -> Principal | None:
    """The principal of the call being served, or ``None`` when the server does not authenticate."""
    return _CURRENT.get()


def use_principal(principal: Principal | None) -> contextvars.Token[Principal | None]:
    """Set the current principal (for the rest of this task); returns the token to reset it."""
    return _CURRENT.set(principal)


def reset_principal(token: contextvars.Token[Principal | None]) -> None:
    """Undo :func:`use_principal`."""
    _CURRENT.reset(token)
