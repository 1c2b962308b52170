"""etcd roles of the control-plane services: each service's etcd user may touch only its key prefixes.

Only the control-plane services hold etcd credentials (agents reach their state through the scheduler's
``Control`` API). With etcd authentication on, give each service its own user and the role of
:data:`SERVICE_GRANTS` (``spiderflow serve topology --etcd-user topology``, ``serve scheduler --etcd-user
scheduler``, the password in ``$SPIDERFLOW_ETCD_PASSWORD``); the planner needs no etcd user at all.
:func:`etcdctl_commands` spells the role as ``etcdctl`` arguments:

- **topology**: read-write ``profiles/``, ``links/`` and its election; read ``clusters/``
  (registrations) — and read on the whole tree, because its change stream (WatchTopology) watches
  ``/spiderflow/v1/`` and filters (a narrower read would refuse that watch).
- **scheduler**: read-write on the job state (``jobs/``, ``requests/``, ``allocations/``, ``assignments/``,
  ``checkpoints/``, ``waits/``, ``rendezvous/``, ``metrics/``), on what it keeps for the agents through
  ``Control`` (``clusters/``, ``leases/``) and its election; read ``profiles/`` and ``links/``. It cannot
  write a profile or a link.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from spiderflow.core.errors import ValidationError
from spiderflow.store import keys

__all__ = ["SERVICE_GRANTS", "Grant", "etcdctl_commands"]

Access = Literal["read", "write", "readwrite"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Grant:
    """``access`` to every key under ``prefix``."""

    prefix: str
    access: Access


def _rw(*prefixes: str) -> tuple[Grant, ...]:
    return tuple(Grant(prefix=p, access="readwrite") for p in prefixes)


def _r(*prefixes: str) -> tuple[Grant, ...]:
    return tuple(Grant(prefix=p, access="read") for p in prefixes)


SERVICE_GRANTS: Mapping[str, tuple[Grant, ...]] = {
    "topology": _rw(keys.PROFILES, keys.LINKS, keys.election_name(keys.TOPOLOGY) + "/") + _r(keys.ROOT),
    "scheduler": _rw(keys.JOBS, keys.REQUESTS, keys.ALLOCATIONS, keys.ASSIGNMENTS, keys.CHECKPOINTS, keys.WAITS,
                     keys.RENDEZVOUS, keys.METRICS, keys.CLUSTERS, keys.LEASES,
                     keys.election_name(keys.SCHEDULER) + "/")
    + _r(keys.PROFILES, keys.LINKS),
}
"""The role of each control-plane service (module docstring)."""


def etcdctl_commands(service: str, password: str, *, user: str | None = None) -> list[list[str]]:
    """The ``etcdctl`` argument lists that create role ``service`` with its grants, user ``user`` (default:
    the service's name) with ``password``, and give the user the role. ValidationError naming ``service``
    for a service without etcd state."""
    if service not in SERVICE_GRANTS:
        raise ValidationError("service", f"must be one of {', '.join(sorted(SERVICE_GRANTS))}", service)
    name = user or service
    out = [["role", "add", service]]
    out += [["role", "grant-permission", service, "--prefix=true", g.access, g.prefix]
            for g in SERVICE_GRANTS[service]]
    out += [["user", "add", f"{name}:{password}"], ["user", "grant-role", name, service]]
    return out
