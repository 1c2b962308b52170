"""The etcd key layout of the whole system: every key SpiderFlow reads or writes is built here.

All keys live under :data:`ROOT` (``/spiderflow/v1/``). Name components (cluster names, job ids,
tenants) follow the id grammar of :mod:`spiderflow.security.ids`; the builders reject anything else with a
:class:`~spiderflow.core.errors.ValidationError`. Values are JSON documents (UTF-8) unless noted.

=====================================================  ===========================================  =====
key                                                    value                                        lease
=====================================================  ===========================================  =====
``clusters/<cluster>``                                 registration: endpoint, GPUs, agent version  agent
``profiles/<cluster>``                                 measured GPU profile (tflops, mfu, memory)   no
``links/<src>/<dst>``                                  measured link src→dst (bandwidth, latency)   no
``topology/revision``                                  topology generation counter (bumped on edit) no
``jobs/<job>``                                         job record: spec, state, timestamps          no
``queue/<priority:04d>/<arrival:020d>/<job>``          queue entry (ordering key), value = job id   no
``plans/<job>``                                        the bound plan (stages, schedule, prediction) no
``allocations/<cluster>``                              GPUs reserved on the cluster, by job         no
``assignments/<cluster>/<job>``                        the cluster's stages of a job's plan         no
``reports/<job>/<cluster>``                            latest step-time report of a running stage   agent
``checkpoints/<job>``                                  last checkpoint (step, location)             no
``waits/<job>``                                        a queued job's wait for GPUs being released  no
``rendezvous/<job>/<attempt>``                         where an attempt's workers meet (host:port)  no
``metrics/<job>/<attempt:06d>-<step:012d>``            reported steps (one report's points)         no
``elections/<service>``                                leader election name (etcd Election API)     svc
``leases/<lease id hex>``                              the cluster an agent's lease was granted to  agent
=====================================================  ===========================================  =====

Binding a job is one :meth:`~spiderflow.store.base.Store.commit`: compare ``jobs/<job>`` and each
``allocations/<cluster>`` of the chain on their read ``mod_revision``, then put the job's new state,
its plan, the allocations and the assignments together (STYLE.md §3: decide on a snapshot, then bind).
"""

from __future__ import annotations

from spiderflow.core.errors import ValidationError
from spiderflow.security import ids

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
    "PLANS",
    "PROFILES",
    "QUEUE",
    "RENDEZVOUS",
    "REPORTS",
    "ROOT",
    "SCHEDULER",
    "TOPOLOGY",
    "TOPOLOGY_REVISION",
    "WAITS",
    "allocation_key",
    "assignment_key",
    "assignments_prefix",
    "checkpoint_key",
    "cluster_key",
    "election_name",
    "job_key",
    "lease_owner_key",
    "link_key",
    "links_from_prefix",
    "metrics_key",
    "metrics_prefix",
    "name_of",
    "plan_key",
    "profile_key",
    "queue_key",
    "rendezvous_key",
    "report_key",
    "reports_prefix",
    "split",
    "wait_key",
]

ROOT = "/spiderflow/v1/"
CLUSTERS = ROOT + "clusters/"
PROFILES = ROOT + "profiles/"
LINKS = ROOT + "links/"
TOPOLOGY_REVISION = ROOT + "topology/revision"
JOBS = ROOT + "jobs/"
QUEUE = ROOT + "queue/"
PLANS = ROOT + "plans/"
ALLOCATIONS = ROOT + "allocations/"
ASSIGNMENTS = ROOT + "assignments/"
REPORTS = ROOT + "reports/"
CHECKPOINTS = ROOT + "checkpoints/"
WAITS = ROOT + "waits/"
ELECTIONS = ROOT + "elections/"
RENDEZVOUS = ROOT + "rendezvous/"
METRICS = ROOT + "metrics/"
LEASES = ROOT + "leases/"

#: Election names of the leader-elected services.
SCHEDULER = "scheduler"
TOPOLOGY = "topology"


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


def queue_key(job: str, *, priority: int, arrival_ms: int) -> str:
    """Queue entry; keys sort by (priority descending, arrival ascending, id)."""
    if not 0 <= priority <= 9999:
        raise ValidationError("priority", "must be in 0..9999", priority)
    if arrival_ms < 0:
        raise ValidationError("arrival_ms", "must be ≥ 0", arrival_ms)
    return f"{QUEUE}{9999 - priority:04d}/{arrival_ms:020d}/{_part('job', job)}"


def plan_key(job: str) -> str:
    """The bound plan of ``job``."""
    return PLANS + _part("job", job)


def allocation_key(cluster: str) -> str:
    """GPUs reserved on ``cluster`` (one key per cluster, the unit of compare-and-swap when binding)."""
    return ALLOCATIONS + _part("cluster", cluster)


def assignment_key(cluster: str, job: str) -> str:
    """The stages of ``job`` that ``cluster``'s agent runs."""
    return f"{ASSIGNMENTS}{_part('cluster', cluster)}/{_part('job', job)}"


def assignments_prefix(cluster: str) -> str:
    """Prefix an agent watches for its assignments."""
    return f"{ASSIGNMENTS}{_part('cluster', cluster)}/"


def report_key(job: str, cluster: str) -> str:
    """Latest step-time report of ``job``'s stages on ``cluster``."""
    return f"{REPORTS}{_part('job', job)}/{_part('cluster', cluster)}"


def reports_prefix(job: str) -> str:
    """Prefix of every report of ``job``."""
    return f"{REPORTS}{_part('job', job)}/"


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


def lease_owner_key(lease: int) -> str:
    """The owner of agent lease ``lease`` (the control plane's record of which cluster holds it; kept under
    the lease itself, so it goes when the lease does)."""
    if isinstance(lease, bool) or not isinstance(lease, int) or lease <= 0:
        raise ValidationError("lease", "must be a positive integer", lease)
    return f"{LEASES}{lease:x}"


def election_name(service: str) -> str:
    """The election name for ``service`` (``scheduler``, ``topology``, ...)."""
    return ELECTIONS + _part("service", service)


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
