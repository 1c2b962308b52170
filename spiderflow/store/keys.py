"""The etcd key layout of the whole system: every key SpiderFlow reads or writes is built here.

All keys live under :data:`ROOT` (``/spiderflow/v1/``). Name components (cluster names, job ids,
tenants) follow the id grammar of :mod:`spiderflow.security.ids`; the builders reject anything else with a
:class:`~spiderflow.core.errors.ValidationError`. Values are JSON documents (UTF-8) unless noted.

=====================================================  ===========================================  =====
key                                                    value (record of :mod:`~spiderflow.store.records`)  lease
=====================================================  ===========================================  =====
``clusters/<cluster>``                                 registration: endpoint, GPUs, agent version  agent
``leases/<lease id hex>``                              the cluster an agent's lease was granted to  agent
``profiles/<cluster>``                                 measured GPU profile (tflops, mfu, memory)   no
``links/<src>/<dst>``                                  measured link src→dst (bandwidth, latency)   no
``jobs/<job>``                                         job record: spec, state, plan, progress      no
``requests/<request>``, ``requests/<tenant>/<request>``  the job a submission created (idempotency)    no
``allocations/<cluster>``                              GPUs reserved on the cluster, by job         no
``assignments/<cluster>/<job>``                        the cluster's stages of a job's plan         no
``waits/<job>``                                        a queued job's wait for GPUs being released  no
``rendezvous/<job>/<attempt>``                         where an attempt's workers meet (host:port)  no
``checkpoints/<job>``                                  last complete checkpoint's manifest          no
``metrics/<job>/<attempt:06d>-<step:012d>[-s<stage>]``  reported steps (one report's points)         no
``metrics/<job>/dropped``                              how many points retention dropped            no
``elections/<service>/<lease id hex>``                 a campaigner's address (etcd Election API)   svc
=====================================================  ===========================================  =====

Every key is built by a function of this module and read back by :func:`parse` (a :class:`Key`: its
:class:`KeyKind` and name components); a key under :data:`ROOT` that no builder makes is refused with a
:class:`~spiderflow.core.errors.CorruptRecordError` naming it. The value of each kind is encoded and decoded by
:mod:`spiderflow.store.records` only.

Binding a job is one :meth:`~spiderflow.store.base.Store.commit`: compare ``jobs/<job>`` and each
``allocations/<cluster>`` of the chain on their read ``mod_revision``, then put the job's new state,
its plan, the allocations and the assignments together (STYLE.md §3: decide on a snapshot, then bind).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from spiderflow.core import ids
from spiderflow.core.errors import CorruptRecordError, ValidationError

__all__ = [
    "ALLOCATIONS",
    "ASSIGNMENTS",
    "CHECKPOINTS",
    "CLUSTERS",
    "ELECTIONS",
    "JOBS",
    "LEASES",
    "LINKS",
    "METRICS",
    "PROFILES",
    "RENDEZVOUS",
    "REQUESTS",
    "ROOT",
    "SCHEDULER",
    "TOPOLOGY",
    "WAITS",
    "Key",
    "KeyKind",
    "allocation_key",
    "assignment_key",
    "assignments_prefix",
    "checkpoint_key",
    "cluster_key",
    "election_name",
    "job_key",
    "leader_key",
    "lease_owner_key",
    "link_key",
    "links_from_prefix",
    "metrics_dropped_key",
    "metrics_key",
    "metrics_prefix",
    "name_of",
    "parse",
    "profile_key",
    "rendezvous_key",
    "request_key",
    "split",
    "wait_key",
]

ROOT = "/spiderflow/v1/"
CLUSTERS = ROOT + "clusters/"
PROFILES = ROOT + "profiles/"
LINKS = ROOT + "links/"
JOBS = ROOT + "jobs/"
REQUESTS = ROOT + "requests/"
ALLOCATIONS = ROOT + "allocations/"
ASSIGNMENTS = ROOT + "assignments/"
CHECKPOINTS = ROOT + "checkpoints/"
WAITS = ROOT + "waits/"
ELECTIONS = ROOT + "elections/"
RENDEZVOUS = ROOT + "rendezvous/"
METRICS = ROOT + "metrics/"
LEASES = ROOT + "leases/"

#: Election names of the leader-elected services.
SCHEDULER = "scheduler"
TOPOLOGY = "topology"

_DROPPED = "dropped"


def _part(fieldname: str, value: str) -> str:
    """A name component: an id of :mod:`spiderflow.security.ids`' grammar (a job id may be qualified by
    its tenant), so no key component is empty, ``.``/``..``, or holds ``/``, NUL or a newline."""
    if fieldname == "job":
        return ids.check_job_id(fieldname, value)
    return ids.check_id(fieldname, value)


def cluster_key(cluster: str) -> str:
    """Registration of ``cluster`` (under the agent's lease)."""
    return CLUSTERS + _part("cluster", cluster)


def profile_key(cluster: str) -> str:
    """Measured GPU profile of ``cluster``."""
    return PROFILES + _part("cluster", cluster)


def link_key(src: str, dst: str) -> str:
    """Measured link ``src → dst``."""
    return f"{LINKS}{_part('src', src)}/{_part('dst', dst)}"


def links_from_prefix(src: str) -> str:
    """Prefix of every link measured from ``src``."""
    return f"{LINKS}{_part('src', src)}/"


def job_key(job: str) -> str:
    """The record of job ``job``."""
    return JOBS + _part("job", job)


def request_key(request_id: str, tenant: str = ids.DEFAULT_TENANT) -> str:
    """Idempotency record of tenant ``tenant``'s submission ``request_id`` (value: the job id). Request ids are
    scoped by tenant (``requests/<tenant>/<request_id>``; the default tenant's directly under ``requests/``), so
    a tenant reusing another tenant's request id creates its own job and learns nothing."""
    ids.check_id("request_id", request_id)
    if tenant == ids.DEFAULT_TENANT:
        return REQUESTS + request_id
    return f"{REQUESTS}{ids.check_tenant('tenant', tenant)}/{request_id}"


def allocation_key(cluster: str) -> str:
    """GPUs reserved on ``cluster`` (one key per cluster, the unit of compare-and-swap when binding)."""
    return ALLOCATIONS + _part("cluster", cluster)


def assignment_key(cluster: str, job: str) -> str:
    """The stages of ``job`` that ``cluster``'s agent runs."""
    return f"{ASSIGNMENTS}{_part('cluster', cluster)}/{_part('job', job)}"


def assignments_prefix(cluster: str) -> str:
    """Prefix an agent watches for its assignments."""
    return f"{ASSIGNMENTS}{_part('cluster', cluster)}/"


def wait_key(job: str) -> str:
    """The wait of queued job ``job`` for GPUs being released (the scheduler leader's, so that the next
    leader honours it)."""
    return WAITS + _part("job", job)


def checkpoint_key(job: str) -> str:
    """Last checkpoint of ``job``."""
    return CHECKPOINTS + _part("job", job)


def rendezvous_key(job: str, attempt: int) -> str:
    """Where the workers of ``job``'s execution attempt ``attempt`` meet (published by the agent of rank 0)."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValidationError("attempt", "must be an integer ≥ 0", attempt)
    return f"{RENDEZVOUS}{_part('job', job)}/{attempt}"


def metrics_key(job: str, *, attempt: int, step: int, stage: int | None = None) -> str:
    """The points of one progress report of ``job`` (attempt ``attempt``, first step ``step``; ``stage``:
    the busy times another stage than the last reported): keys sort by attempt, then step."""
    for name, v in (("attempt", attempt), ("step", step), ("stage", 0 if stage is None else stage)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValidationError(name, "must be an integer ≥ 0", v)
    return f"{METRICS}{_part('job', job)}/{attempt:06d}-{step:012d}" + (f"-s{stage:04d}" if stage is not None else "")


def metrics_prefix(job: str) -> str:
    """Prefix of every metrics key of ``job``."""
    return f"{METRICS}{_part('job', job)}/"


def metrics_dropped_key(job: str) -> str:
    """How many of ``job``'s points retention dropped (beside its metrics keys)."""
    return f"{metrics_prefix(job)}{_DROPPED}"


def lease_owner_key(lease: int) -> str:
    """The owner of agent lease ``lease`` (the control plane's record of which cluster holds it; kept under
    the lease itself, so it goes when the lease does)."""
    if isinstance(lease, bool) or not isinstance(lease, int) or lease <= 0:
        raise ValidationError("lease", "must be a positive integer", lease)
    return f"{LEASES}{lease:x}"


def election_name(service: str) -> str:
    """The election name for ``service`` (``scheduler``, ``topology``, ...)."""
    return ELECTIONS + _part("service", service)


def leader_key(service: str, lease: int) -> str:
    """The key a campaigner holding ``lease`` owns in ``service``'s election (named so by etcd's Election API:
    :func:`spiderflow.store.base.election_key` of :func:`election_name`)."""
    if isinstance(lease, bool) or not isinstance(lease, int) or lease <= 0:
        raise ValidationError("lease", "must be a positive integer", lease)
    return f"{election_name(service)}/{lease:x}"


def split(key: str, prefix: str) -> list[str]:
    """The name components of ``key`` below ``prefix`` (``split(link_key("a", "b"), LINKS) == ["a", "b"]``)."""
    if not key.startswith(prefix):
        raise ValidationError("key", f"is not under {prefix}", key)
    return key[len(prefix):].split("/")


def name_of(key: str, prefix: str) -> str:
    """The single name component of ``key`` below ``prefix`` (``name_of(job_key("j1"), JOBS) == "j1"``)."""
    parts = split(key, prefix)
    if len(parts) != 1:
        raise ValidationError("key", f"has {len(parts)} components below {prefix}, expected 1", key)
    return parts[0]


# -- parsing ----------------------------------------------------------------------------------------------


class KeyKind(StrEnum):
    """What a key under :data:`ROOT` holds (one record type of :mod:`spiderflow.store.records` each)."""

    REGISTRATION = "registration"
    LEASE_OWNER = "lease-owner"
    PROFILE = "profile"
    LINK = "link"
    JOB = "job"
    REQUEST = "request"
    ALLOCATION = "allocation"
    ASSIGNMENT = "assignment"
    WAIT = "wait"
    RENDEZVOUS = "rendezvous"
    CHECKPOINT = "checkpoint"
    METRICS = "metrics"
    METRICS_DROPPED = "metrics-dropped"
    LEADER = "leader"


@dataclass(frozen=True, slots=True, kw_only=True)
class Key:
    """A parsed key: its kind and the name components it carries (the others stay empty/None)."""

    key: str
    kind: KeyKind
    cluster: str = ""
    """``clusters/``, ``profiles/``, ``allocations/``, ``assignments/`` keys' cluster; a link's source."""
    peer: str = ""
    """A link's destination."""
    job: str = ""
    tenant: str = ""
    """A request key's tenant (:data:`spiderflow.core.ids.DEFAULT_TENANT` when unqualified)."""
    request_id: str = ""
    attempt: int | None = None
    step: int | None = None
    stage: int | None = None
    lease: int | None = None
    service: str = ""


_METRICS_NAME = re.compile(r"(\d{6})-(\d{12})(?:-s(\d{4}))?")
_HEX = re.compile(r"[0-9a-f]+")


def _unknown(key: str, why: str) -> CorruptRecordError:
    return CorruptRecordError(key=key, field="key", reason=why)


def parse(key: str) -> Key:
    """The :class:`Key` that ``key`` is: exactly what one builder of this module makes (canonical: built
    again from its parts it is the same string). :class:`~spiderflow.core.errors.CorruptRecordError` naming the key
    (field ``key``) for anything else: outside :data:`ROOT`, an unknown directory, a malformed name."""
    if not isinstance(key, str) or not key.startswith(ROOT):
        raise _unknown(str(key), f"is not under {ROOT}")
    try:
        parsed = _parse(key)
    except ValidationError as e:
        raise _unknown(key, f"malformed {e.field}: {e.reason}") from None
    if parsed is None:
        raise _unknown(key, "is not a key of the layout (spiderflow.store.keys)")
    return parsed


def _parse(key: str) -> Key | None:
    top, _, rest = key[len(ROOT):].partition("/")
    parts = rest.split("/")
    n = len(parts)
    out: Key | None = None
    if top == "clusters" and n == 1:
        out = Key(key=key, kind=KeyKind.REGISTRATION, cluster=parts[0])
        built = cluster_key(parts[0])
    elif top == "leases" and n == 1 and _HEX.fullmatch(parts[0]):
        out = Key(key=key, kind=KeyKind.LEASE_OWNER, lease=int(parts[0], 16))
        built = lease_owner_key(int(parts[0], 16))
    elif top == "profiles" and n == 1:
        out = Key(key=key, kind=KeyKind.PROFILE, cluster=parts[0])
        built = profile_key(parts[0])
    elif top == "links" and n == 2:
        out = Key(key=key, kind=KeyKind.LINK, cluster=parts[0], peer=parts[1])
        built = link_key(parts[0], parts[1])
    elif top == "jobs" and n == 1:
        out = Key(key=key, kind=KeyKind.JOB, job=parts[0])
        built = job_key(parts[0])
    elif top == "requests" and n in (1, 2):
        tenant = parts[0] if n == 2 else ids.DEFAULT_TENANT
        out = Key(key=key, kind=KeyKind.REQUEST, tenant=tenant, request_id=parts[-1])
        built = request_key(parts[-1], tenant)
    elif top == "allocations" and n == 1:
        out = Key(key=key, kind=KeyKind.ALLOCATION, cluster=parts[0])
        built = allocation_key(parts[0])
    elif top == "assignments" and n == 2:
        out = Key(key=key, kind=KeyKind.ASSIGNMENT, cluster=parts[0], job=parts[1])
        built = assignment_key(parts[0], parts[1])
    elif top == "waits" and n == 1:
        out = Key(key=key, kind=KeyKind.WAIT, job=parts[0])
        built = wait_key(parts[0])
    elif top == "rendezvous" and n == 2 and parts[1].isdigit():
        out = Key(key=key, kind=KeyKind.RENDEZVOUS, job=parts[0], attempt=int(parts[1]))
        built = rendezvous_key(parts[0], int(parts[1]))
    elif top == "checkpoints" and n == 1:
        out = Key(key=key, kind=KeyKind.CHECKPOINT, job=parts[0])
        built = checkpoint_key(parts[0])
    elif top == "metrics" and n == 2 and parts[1] == _DROPPED:
        out = Key(key=key, kind=KeyKind.METRICS_DROPPED, job=parts[0])
        built = metrics_dropped_key(parts[0])
    elif top == "metrics" and n == 2 and (m := _METRICS_NAME.fullmatch(parts[1])):
        stage = int(m[3]) if m[3] is not None else None
        out = Key(key=key, kind=KeyKind.METRICS, job=parts[0], attempt=int(m[1]), step=int(m[2]), stage=stage)
        built = metrics_key(parts[0], attempt=int(m[1]), step=int(m[2]), stage=stage)
    elif top == "elections" and n == 2 and _HEX.fullmatch(parts[1]):
        out = Key(key=key, kind=KeyKind.LEADER, service=parts[0], lease=int(parts[1], 16))
        built = leader_key(parts[0], int(parts[1], 16))
    else:
        return None
    return out if built == key else None
