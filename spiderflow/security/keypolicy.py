"""Which keys of the control plane's state an agent may touch (the NodeRestriction of SpiderFlow).

Agents hold no etcd credentials: they read and write the few keys they need through the control plane's
``Control`` gRPC API (``services/scheduler/control.py``), which asks :func:`decide` about every key of
every call, with the caller's cluster (its authenticated ``agent:<cluster>`` principal). Pure: the rules
that depend on state (is the cluster assigned this attempt? does it hold this lease?) are returned as a
:class:`Rule` that the server checks against etcd.

===================================  =============================  ========================================
key (under ``/spiderflow/v1/``)      access                         condition
===================================  =============================  ========================================
``clusters/`` (the prefix)           list, watch                    peers' values reduced to cluster and
                                                                    address (:data:`Rule.redact`)
``clusters/<own>``                   read, watch, write             the value is a registration of the
                                                                    caller's cluster, under a lease it holds
``assignments/<own>/`` (prefix)      list, watch                    —
``assignments/<own>/<job>``          read                           —
``rendezvous/<job>/<attempt>``       read, watch, write, delete     the caller's cluster is assigned that
                                                                    attempt of the job
``checkpoints/<job>``                read                           the caller's cluster is assigned the job
``checkpoints/<job>``                compare-and-swap               the manifest names the caller's cluster
                                                                    and the attempt it is assigned
===================================  =============================  ========================================

Everything else (profiles, links, jobs, plans, allocations, queue, metrics, other clusters' keys, any
prefix read beyond the two above) is :class:`~spiderflow.core.errors.PermissionDeniedError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from spiderflow.core.errors import CorruptRecordError, PermissionDeniedError, ValidationError
from spiderflow.security import ids
from spiderflow.store import keys, records
from spiderflow.store.keys import KeyKind

__all__ = ["Access", "Rule", "RuleKind", "checkpoint_claim", "decide"]


class Access(StrEnum):
    """What a call does with a key."""

    READ = "read"
    """Get one key."""
    LIST = "list"
    """Get every key under a prefix."""
    WATCH = "watch"
    """Watch a key or a prefix."""
    WRITE = "write"
    """Put one key (unconditionally or compare-and-swap)."""
    CAS = "cas"
    """Put one key only if its revision is the one read (compare-and-swap)."""
    DELETE = "delete"
    """Delete one key."""


class RuleKind(StrEnum):
    """Why a key is allowed (and what the server still has to check)."""

    OWN_REGISTRATION = "own-registration"
    """``clusters/<own>``: a write must carry the caller's registration and a lease the caller holds."""
    REGISTRATIONS = "registrations"
    """``clusters/``: peers' registrations, reduced to their cluster and address."""
    OWN_ASSIGNMENTS = "own-assignments"
    """``assignments/<own>/``: the caller's assignments, read-only."""
    RENDEZVOUS = "rendezvous"
    """``rendezvous/<job>/<attempt>``: the caller's cluster must be assigned ``attempt`` of ``job``."""
    CHECKPOINT = "checkpoint"
    """``checkpoints/<job>``: the caller's cluster must be assigned ``job`` (and, to write, the manifest's
    attempt)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """The policy's answer for one key: allowed if the server's state checks of ``kind`` pass."""

    kind: RuleKind
    key: str
    job: str = ""
    attempt: int | None = None
    redact: bool = False
    """Values of other clusters' keys are reduced to their cluster and address."""


def _deny(cluster: str, access: Access, key: str, why: str = "") -> PermissionDeniedError:
    return PermissionDeniedError(f"agent:{cluster} may not {access} {key}" + (f": {why}" if why else ""))


def decide(cluster: str, access: Access, key: str) -> Rule:
    """The rule under which ``cluster``'s agent may ``access`` ``key`` (a key, or a prefix for LIST and
    WATCH); :class:`PermissionDeniedError` naming the key when no rule allows it (module docstring)."""
    ids.check_id("cluster", cluster)
    if not isinstance(key, str) or not key:
        raise ValidationError("key", "must be a non-empty string", key)
    if not key.startswith(keys.ROOT):
        raise _deny(cluster, access, key, f"not under {keys.ROOT}")
    try:
        return _rule(cluster, access, key)
    except ValidationError as e:  # a malformed name in the key (``..``, a bad attempt): no rule applies
        raise _deny(cluster, access, key, str(e)) from None


def _rule(cluster: str, access: Access, key: str) -> Rule:
    if key == keys.CLUSTERS and access in (Access.LIST, Access.WATCH):
        return Rule(kind=RuleKind.REGISTRATIONS, key=key, redact=True)
    if key == keys.assignments_prefix(cluster) and access in (Access.LIST, Access.WATCH):
        return Rule(kind=RuleKind.OWN_ASSIGNMENTS, key=key)
    try:
        k = keys.parse(key)  # a key of the layout, in its canonical form (no leading zeros, valid ids)
    except CorruptRecordError:
        raise _deny(cluster, access, key) from None
    if k.kind is KeyKind.REGISTRATION and k.cluster == cluster \
            and access in (Access.READ, Access.WATCH, Access.WRITE, Access.CAS):
        return Rule(kind=RuleKind.OWN_REGISTRATION, key=key)
    if k.kind is KeyKind.ASSIGNMENT and k.cluster == cluster and access is Access.READ:
        return Rule(kind=RuleKind.OWN_ASSIGNMENTS, key=key)
    if k.kind is KeyKind.RENDEZVOUS and access in (Access.READ, Access.WATCH, Access.WRITE, Access.DELETE):
        return Rule(kind=RuleKind.RENDEZVOUS, key=key, job=k.job, attempt=k.attempt)
    if k.kind is KeyKind.CHECKPOINT and access in (Access.READ, Access.CAS):
        return Rule(kind=RuleKind.CHECKPOINT, key=key, job=k.job)
    raise _deny(cluster, access, key)


def checkpoint_claim(value: bytes) -> tuple[int, str]:
    """The ``(attempt, cluster)`` a checkpoint manifest names (the executor writes them beside the
    manifest); :class:`ValidationError` naming ``value`` (``value.attempt``, ...) when it has none."""
    try:
        return records.checkpoint_claim("value", value)
    except CorruptRecordError as e:
        field = e.field if e.field == "value" else f"value.{e.field}"
        raise ValidationError(field, f"a checkpoint manifest must name its writer: {e.reason}", e.value) from None
