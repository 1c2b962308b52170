"""Every record SpiderFlow keeps in etcd: one frozen, validated type per key kind, encoded and decoded here only.

Keys are built and parsed by :mod:`spiderflow.store.keys`; this module owns what their values hold. Writers
call :func:`encode` (or a record's ``encode()``); readers call :func:`decode` with the key and the value and
get the record the key's kind holds, or a :class:`~spiderflow.core.errors.CorruptRecordError` naming the key and
the field (``field`` is a dotted path inside the value: ``plan.stages[1].tp``), never a ``KeyError`` or a
``JSONDecodeError``. A service answering a call turns that error into the gRPC status DATA_LOSS
(:mod:`spiderflow.rpc.errors`).

========================  =====================================  ========================================
key kind                  record                                 value
========================  =====================================  ========================================
``clusters/<c>``          :class:`Registration`                  JSON object (full), or ``{"cluster",
                                                                 "address"}`` as peers see it
``leases/<id>``           :class:`LeaseOwner`                    the cluster name (UTF-8)
``profiles/<c>``          :class:`ProfileRecord`                 JSON object
``links/<s>/<d>``         :class:`LinkRecord`                    JSON object
``jobs/<j>``              :class:`~spiderflow.jobs.JobRecord`    JSON object
``requests/...``          :class:`RequestRecord`                 the job id (UTF-8)
``allocations/<c>``       :class:`AllocationRecord`              JSON ``{"<job>": gpus}``
``assignments/<c>/<j>``   :class:`Assignment`                    JSON ``{"job", "attempt", "stages",
                                                                 "plan", "spec"}``
``waits/<j>``             :class:`~spiderflow.core.cycle.WaitState`   JSON ``{"until", "gpus", "claim", "run_s",
                                                                 "reason"}``
``rendezvous/<j>/<a>``    :class:`RendezvousInfo`                JSON ``{"host", "port", "checkpoint_dir",
                                                                 "checkpoint_every", "resume"}``
``checkpoints/<j>``       :class:`CheckpointRecord`              JSON: the manifest + ``attempt``,
                                                                 ``cluster``, ``at``
``metrics/<j>/<a>-<s>``   :class:`MetricsRecord`                 JSON list of points
``metrics/<j>/dropped``   :class:`DroppedPoints`                 a decimal count
``elections/<s>/<id>``    :class:`LeaderRecord`                  the campaigner's address (UTF-8)
========================  =====================================  ========================================

Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from spiderflow.core import ids
from spiderflow.core.domain import Cluster, JobSpec, Link, Plan, Topology
from spiderflow.core.errors import CorruptRecordError, ValidationError
from spiderflow.exec.spec import CheckpointManifest, manifest_from_dict, manifest_to_dict
from spiderflow.formats import (
    job_from_dict,
    job_to_dict,
    plan_from_dict,
    plan_to_dict,
    topology_from_dict,
    topology_to_dict,
)
from spiderflow.jobs import JobRecord, JobState, Progress, Transition
from spiderflow.store import keys
from spiderflow.store.keys import Key, KeyKind

if TYPE_CHECKING:  # imported where a wait is decoded: the cycle loads the planner and its compiled kernels,
    # which the agents, the topology service and the CLI never need
    from spiderflow.core.cycle import WaitState

__all__ = [
    "AllocationRecord",
    "Assignment",
    "CheckpointRecord",
    "DroppedPoints",
    "LeaderRecord",
    "LeaseOwner",
    "LinkRecord",
    "MetricsRecord",
    "PeerAddress",
    "ProfileRecord",
    "Record",
    "Registration",
    "RendezvousInfo",
    "RequestRecord",
    "Series",
    "StageBusyPoint",
    "StepPoint",
    "checkpoint_claim",
    "decode",
    "decode_as",
    "encode",
    "job_state_and_tenant",
    "peer_address",
]

R = TypeVar("R")


# ---------------------------------------------------------------------------------------------- reading


class _Reader:
    """Typed access to one decoded JSON object; every failure is a CorruptRecordError naming the key."""

    __slots__ = ("doc", "key", "where")

    def __init__(self, key: str, raw: Any, where: str) -> None:
        if not isinstance(raw, dict):
            raise CorruptRecordError(key=key, field=where or "value", reason="must be a JSON object",
                                     value=type(raw).__name__)
        self.key, self.doc, self.where = key, raw, where

    def path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def error(self, name: str, reason: str, value: object = None) -> CorruptRecordError:
        return CorruptRecordError(key=self.key, field=self.path(name), reason=reason, value=value)

    def raw(self, name: str, default: Any = ...) -> Any:
        if name not in self.doc:
            if default is ...:
                raise self.error(name, "is required")
            return default
        return self.doc[name]

    def string(self, name: str, default: Any = ..., *, nonempty: bool = False) -> str:
        v = self.raw(name, default)
        if not isinstance(v, str) or (nonempty and not v):
            raise self.error(name, "must be a non-empty string" if nonempty else "must be a string", v)
        return v

    def integer(self, name: str, default: Any = ..., *, minimum: int | None = None) -> int:
        v = self.raw(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
            raise self.error(name, "must be an integer" + (f" ≥ {minimum}" if minimum is not None else ""), v)
        return int(v)

    def number(self, name: str, default: Any = ..., *, finite: bool = True) -> float:
        """A number (``finite``: not NaN nor infinite; a measured figure such as a loss may be either)."""
        v = self.raw(name, default)
        if isinstance(v, bool) or not isinstance(v, int | float) or (finite and not math.isfinite(v)):
            raise self.error(name, "must be a finite number" if finite else "must be a number", v)
        return float(v)

    def opt_float(self, name: str) -> float | None:
        return None if self.doc.get(name) is None else self.number(name, finite=False)

    def opt_int(self, name: str) -> int | None:
        return None if self.doc.get(name) is None else self.integer(name)

    def array(self, name: str, default: Any = ...) -> list[Any]:
        v = self.raw(name, default)
        if not isinstance(v, list):
            raise self.error(name, "must be a list", v)
        return v

    def sub(self, name: str, default: Any = ...) -> _Reader:
        return _Reader(self.key, self.raw(name, default), self.path(name))


def _json(key: str, value: bytes) -> Any:
    try:
        return json.loads(value.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptRecordError(key=key, field="value", reason=f"not JSON: {e}") from None


def _text(key: str, value: bytes, what: str) -> str:
    try:
        text = value.decode()
    except UnicodeDecodeError:
        raise CorruptRecordError(key=key, field="value", reason=f"must be {what} (UTF-8)") from None
    if not text:
        raise CorruptRecordError(key=key, field="value", reason=f"must be {what}, not empty")
    return text


def _dump(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _wrap(key: str, where: str, fn: Callable[[], R]) -> R:
    """Run a validating constructor; its ValidationError becomes a CorruptRecordError of ``key``."""
    try:
        return fn()
    except CorruptRecordError:
        raise
    except ValidationError as e:
        inner = e.field if not where or e.field.startswith(where) else f"{where}.{e.field}"
        raise CorruptRecordError(key=key, field=inner, reason=e.reason, value=e.value) from None


def _check_name(key: str, name: str, got: str, expected: str) -> None:
    if got != expected:
        raise CorruptRecordError(key=key, field=name, reason=f"must be {expected!r} (the key's)", value=got)


# ---------------------------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    """``clusters/<cluster>``: one agent's registration of its cluster, under the agent's lease.

    ``principal`` is the identity the topology service authorises reports against (the agent id without
    certificates, the certificate's cluster with mTLS). A cluster exists exactly while this key exists."""

    cluster: str
    agent_id: str
    principal: str
    address: str
    version: str = ""
    pid: int = 0
    host: str = ""
    started_at: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cluster", "agent_id", "principal", "address"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValidationError(f"registration.{name}", "must be a non-empty string", value)
        if isinstance(self.pid, bool) or not isinstance(self.pid, int):
            raise ValidationError("registration.pid", "must be an integer", self.pid)
        if not isinstance(self.version, str) or not isinstance(self.host, str):
            raise ValidationError("registration.version", "version and host must be strings", self.version)
        if isinstance(self.started_at, bool) or not isinstance(self.started_at, int | float) \
                or not math.isfinite(self.started_at):
            raise ValidationError("registration.started_at", "must be a finite number", self.started_at)

    def encode(self) -> bytes:
        """The JSON value stored in etcd."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes, *, key: str = "registration") -> Registration:
        """Parse a stored value; :class:`CorruptRecordError` (a ValidationError) when malformed."""
        r = _Reader(key, _json(key, value), "")
        return cls(cluster=r.string("cluster", nonempty=True), agent_id=r.string("agent_id", nonempty=True),
                   principal=r.string("principal", nonempty=True), address=r.string("address", nonempty=True),
                   version=r.string("version", ""), pid=r.integer("pid", 0), host=r.string("host", ""),
                   started_at=r.number("started_at", 0.0))


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerAddress:
    """What an agent learns of a peer's registration (the control plane redacts the rest): its cluster and
    the address to probe. Also the value a peer's ``clusters/<c>`` key holds as the agent sees it."""

    cluster: str
    address: str

    def encode(self) -> bytes:
        return json.dumps({"address": self.address, "cluster": self.cluster}, sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes, *, key: str = "registration") -> PeerAddress:
        """The cluster and address of a stored registration (full or reduced)."""
        r = _Reader(key, _json(key, value), "")
        return cls(cluster=r.string("cluster", nonempty=True), address=r.string("address", nonempty=True))


def peer_address(reg: Registration) -> PeerAddress:
    """A registration reduced to what peers may see."""
    return PeerAddress(cluster=reg.cluster, address=reg.address)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseOwner:
    """``leases/<id>``: the cluster an agent lease was granted to (kept under that lease)."""

    cluster: str

    def encode(self) -> bytes:
        return self.cluster.encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class Series:
    """Smoothed state (:mod:`services.topology.smoothing`): ``value`` (``s``), ``samples`` folded in since the
    (re)start, the pending outliers (``pending`` consecutive ones with mean ``pending_mean``), and
    ``settling``: the direction of the level shift the last sample made (+1 up, −1 down, 0 none)."""

    value: float
    samples: int = 1
    pending: int = 0
    pending_mean: float = 0.0
    settling: int = 0


def _series_doc(s: Series | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"value": s.value, "samples": s.samples, "pending": s.pending, "pending_mean": s.pending_mean,
            "settling": s.settling}


def _series(r: _Reader) -> Series:
    return Series(value=r.number("value"), samples=r.integer("samples"), pending=r.integer("pending", 0),
                  pending_mean=r.number("pending_mean", 0.0), settling=r.integer("settling", 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileRecord:
    """``profiles/<c>``: the reported cluster (``tflops`` = smoothed), the smoothing state of tflops,
    who reported it, and when (``measured_at``: the agent's clock; ``updated_at``: the service's)."""

    cluster: Cluster
    tflops: Series | None
    agent_id: str
    agent_address: str
    measured_at: float
    updated_at: float

    def encode(self) -> bytes:
        doc = {
            "cluster": topology_to_dict(Topology(clusters=(self.cluster,)))["clusters"][0],
            "tflops": _series_doc(self.tflops), "agent_id": self.agent_id, "agent_address": self.agent_address,
            "measured_at": self.measured_at, "updated_at": self.updated_at,
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes, *, key: str = "profile") -> ProfileRecord:
        r = _Reader(key, _json(key, value), "")
        raw_cluster = r.raw("cluster")
        cluster = _wrap(key, "", lambda: topology_from_dict({"clusters": [raw_cluster]}).clusters[0])
        return cls(cluster=cluster, tflops=None if r.doc.get("tflops") is None else _series(r.sub("tflops")),
                   agent_id=r.string("agent_id"), agent_address=r.string("agent_address", ""),
                   measured_at=r.number("measured_at", 0.0), updated_at=r.number("updated_at"))


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkRecord:
    """``links/<src>/<dst>``: smoothed bandwidth (Gbit/s) and one-way latency (ms) of ``src → dst``."""

    src: str
    dst: str
    bandwidth: Series
    latency: Series
    measured_at: float
    updated_at: float
    probe_bytes: int = 0
    rtt_samples: int = 0

    @property
    def link(self) -> Link:
        return Link(a=self.src, b=self.dst, bandwidth_gbps=self.bandwidth.value, latency_ms=self.latency.value,
                    directed=True)

    @property
    def pending_outliers(self) -> int:
        return max(self.bandwidth.pending, self.latency.pending)

    def encode(self) -> bytes:
        doc = {
            "src": self.src, "dst": self.dst, "bandwidth": _series_doc(self.bandwidth),
            "latency": _series_doc(self.latency), "measured_at": self.measured_at, "updated_at": self.updated_at,
            "probe_bytes": self.probe_bytes, "rtt_samples": self.rtt_samples,
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes, *, key: str = "link") -> LinkRecord:
        r = _Reader(key, _json(key, value), "")
        return cls(src=r.string("src", nonempty=True), dst=r.string("dst", nonempty=True),
                   bandwidth=_series(r.sub("bandwidth")), latency=_series(r.sub("latency")),
                   measured_at=r.number("measured_at", 0.0), updated_at=r.number("updated_at"),
                   probe_bytes=r.integer("probe_bytes", 0), rtt_samples=r.integer("rtt_samples", 0))


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """``requests/...``: the job a submission's request id created (the idempotency record)."""

    job: str

    def encode(self) -> bytes:
        return self.job.encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationRecord:
    """``allocations/<c>``: the GPUs each job holds on the cluster (the unit of compare-and-swap of a bind)."""

    gpus: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for job, n in self.gpus.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValidationError(job, "must be a number of GPUs ≥ 1", n)
        object.__setattr__(self, "gpus", dict(self.gpus))

    def encode(self) -> bytes:
        return _dump(dict(self.gpus))


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """``assignments/<c>/<j>``: the stages (indices into ``plan.stages``) of attempt ``attempt`` of job ``job``
    that cluster ``c``'s agent runs, with the whole plan and the job's spec."""

    job: str
    attempt: int
    stages: tuple[int, ...]
    plan: Plan
    spec: JobSpec

    def __post_init__(self) -> None:
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int) or self.attempt < 0:
            raise ValidationError("attempt", "must be an integer ≥ 0", self.attempt)
        for i, s in enumerate(self.stages):
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < len(self.plan.stages):
                raise ValidationError(f"stages[{i}]", f"must be a stage of the plan (0..{len(self.plan.stages) - 1})",
                                      s)

    @classmethod
    def of(cls, record: JobRecord, cluster: str) -> Assignment:
        """The assignment of ``cluster`` in ``record``'s plan."""
        if record.plan is None:
            raise ValidationError("plan", f"job {record.id} has no plan to assign")
        return cls(job=record.id, attempt=record.attempt, plan=record.plan, spec=record.spec,
                   stages=tuple(i for i, s in enumerate(record.plan.stages) if s.cluster == cluster))

    def encode(self) -> bytes:
        return _dump({"job": self.job, "attempt": self.attempt, "stages": list(self.stages),
                      "plan": plan_to_dict(self.plan), "spec": job_to_dict(self.spec)})

    @classmethod
    def decode(cls, value: bytes, *, key: str = "assignment") -> Assignment:
        r = _Reader(key, _json(key, value), "")
        plan = _wrap(key, "plan", lambda: plan_from_dict(r.raw("plan")))
        spec = _wrap(key, "spec", lambda: job_from_dict(r.raw("spec"), where="spec"))
        job, attempt = r.string("job", nonempty=True), r.integer("attempt", minimum=0)
        stages = tuple(r.array("stages"))
        return _wrap(key, "", lambda: cls(job=job, attempt=attempt, stages=stages, plan=plan, spec=spec))


@dataclass(frozen=True, slots=True, kw_only=True)
class RendezvousInfo:
    """``rendezvous/<j>/<a>``: what the agent of rank 0 publishes for one attempt: the TCPStore's address, the
    checkpoint directory and cadence every rank uses, and the checkpoint to resume from."""

    host: str
    port: int
    checkpoint_dir: str
    checkpoint_every: int
    resume: CheckpointManifest | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValidationError("host", "must be a non-empty string", self.host)
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValidationError("port", "must be a TCP port (1..65535)", self.port)
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ValidationError("checkpoint_every", "must be an integer ≥ 0", self.checkpoint_every)

    def encode(self) -> bytes:
        return json.dumps({"host": self.host, "port": self.port, "checkpoint_dir": self.checkpoint_dir,
                           "checkpoint_every": self.checkpoint_every,
                           "resume": None if self.resume is None else manifest_to_dict(self.resume)}).encode()

    @classmethod
    def decode(cls, value: bytes, *, key: str = "rendezvous") -> RendezvousInfo:
        r = _Reader(key, _json(key, value), "")
        raw = r.raw("resume", None)
        resume = None if raw is None else _wrap(key, "resume", lambda: manifest_from_dict(raw, where="resume."))
        host, port = r.string("host", nonempty=True), r.integer("port")
        ckpt_dir, every = r.string("checkpoint_dir"), r.integer("checkpoint_every")
        return _wrap(key, "", lambda: cls(host=host, port=port, checkpoint_dir=ckpt_dir, checkpoint_every=every,
                                          resume=resume))


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointRecord:
    """``checkpoints/<j>``: the last complete checkpoint's manifest, committed by the agent of ``cluster``
    running attempt ``attempt`` at ``at`` (its wall clock)."""

    manifest: CheckpointManifest
    attempt: int
    cluster: str
    at: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int) or self.attempt < 0:
            raise ValidationError("attempt", "must be the writer's attempt (an integer ≥ 0)", self.attempt)
        if not isinstance(self.cluster, str) or not self.cluster:
            raise ValidationError("cluster", "must be the writer's cluster", self.cluster)

    def encode(self) -> bytes:
        return json.dumps({**manifest_to_dict(self.manifest), "attempt": self.attempt, "cluster": self.cluster,
                           "at": self.at}).encode()

    @classmethod
    def decode(cls, value: bytes, *, key: str = "checkpoint") -> CheckpointRecord:
        r = _Reader(key, _json(key, value), "")
        attempt = r.integer("attempt", minimum=0)
        cluster = r.string("cluster", nonempty=True)
        at = r.number("at", 0.0)
        manifest_doc = {k: v for k, v in r.doc.items() if k not in ("attempt", "cluster", "at")}
        manifest = _wrap(key, "", lambda: manifest_from_dict(manifest_doc, where=""))
        return cls(manifest=manifest, attempt=attempt, cluster=cluster, at=at)


def checkpoint_claim(key: str, value: bytes) -> tuple[int, str]:
    """The ``(attempt, cluster)`` a checkpoint record names, read before the rest (whether its writer may
    commit it at all); :class:`CorruptRecordError` naming the field when either is missing or mistyped."""
    r = _Reader(key, _json(key, value), "")
    attempt = r.raw("attempt")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise r.error("attempt", "must be the writer's attempt (an integer ≥ 0)", attempt)
    return attempt, r.string("cluster", nonempty=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPoint:
    """One step of a job's last stage as reported: the figures of ``spiderflow metrics``."""

    attempt: int
    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    predicted_step_time_s: float
    stage: int
    busy_s: float
    predicted_stage_busy_s: tuple[float, ...]
    time: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StageBusyPoint:
    """Another stage's busy time in one step."""

    attempt: int
    step: int
    stage: int
    busy_s: float
    time: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsRecord:
    """``metrics/<j>/<attempt>-<step>[-s<stage>]``: the points of one progress report (in step order)."""

    points: tuple[StepPoint | StageBusyPoint, ...]

    def encode(self) -> bytes:
        docs: list[dict[str, Any]] = []
        for p in self.points:
            if isinstance(p, StageBusyPoint):
                docs.append({"kind": "stage", "attempt": p.attempt, "step": p.step, "stage": p.stage,
                             "busy_s": p.busy_s, "time": p.time})
            else:
                docs.append({"attempt": p.attempt, "step": p.step, "loss": p.loss, "tokens_per_s": p.tokens_per_s,
                             "step_time_s": p.step_time_s, "predicted_step_time_s": p.predicted_step_time_s,
                             "stage": p.stage, "busy_s": p.busy_s,
                             "predicted_stage_busy_s": list(p.predicted_stage_busy_s), "time": p.time})
        return json.dumps(docs, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes, *, key: str = "metrics") -> MetricsRecord:
        raw = _json(key, value)
        if not isinstance(raw, list):
            raise CorruptRecordError(key=key, field="value", reason="must be a JSON list of points")
        points: list[StepPoint | StageBusyPoint] = []
        for i, doc in enumerate(raw):
            r = _Reader(key, doc, f"[{i}]")
            if r.doc.get("kind") == "stage":
                points.append(StageBusyPoint(attempt=r.integer("attempt"), step=r.integer("step"),
                                             stage=r.integer("stage"), busy_s=r.number("busy_s", finite=False),
                                             time=r.number("time")))
                continue
            predicted = tuple(float(v) for v in r.array("predicted_stage_busy_s", []) if isinstance(v, int | float))
            points.append(StepPoint(attempt=r.integer("attempt"), step=r.integer("step"),
                                    loss=r.number("loss", finite=False),
                                    tokens_per_s=r.number("tokens_per_s", finite=False),
                                    step_time_s=r.number("step_time_s", finite=False),
                                    predicted_step_time_s=r.number("predicted_step_time_s", 0.0, finite=False),
                                    stage=r.integer("stage", 0), busy_s=r.number("busy_s", 0.0, finite=False),
                                    predicted_stage_busy_s=predicted, time=r.number("time")))
        return cls(points=tuple(points))


@dataclass(frozen=True, slots=True, kw_only=True)
class DroppedPoints:
    """``metrics/<j>/dropped``: how many of the job's points retention dropped."""

    count: int

    def encode(self) -> bytes:
        return str(self.count).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaderRecord:
    """``elections/<service>/<lease>``: a campaigner's proclaimed value, the address it serves on."""

    address: str

    def encode(self) -> bytes:
        return self.address.encode()


Record: TypeAlias = ("Registration | PeerAddress | LeaseOwner | ProfileRecord | LinkRecord | JobRecord"
                     " | RequestRecord | AllocationRecord | Assignment | WaitState | RendezvousInfo"
                     " | CheckpointRecord | MetricsRecord | DroppedPoints | LeaderRecord")
"""Any stored record."""


# ---------------------------------------------------------------------------------------------- jobs


FRAGMENTS_KEPT = 8192
"""Encoded specs and plans kept for reuse at most (oldest dropped first)."""
_fragments: dict[int, tuple[object, str]] = {}


def _fragment(obj: Any, to_doc: Callable[[Any], dict[str, Any]]) -> str:
    """The JSON text of ``to_doc(obj)``, built once per object: a job's spec (and its plan) stay the same
    objects across its record's states, and every state is one more encoding. Keyed by identity with the
    object held, so an id is never reused while its entry lives (specs and plans are frozen)."""
    hit = _fragments.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    text = json.dumps(to_doc(obj), separators=(",", ":"))
    if len(_fragments) >= FRAGMENTS_KEPT:
        _fragments.pop(next(iter(_fragments)), None)
    _fragments[id(obj)] = (obj, text)
    return text


def _encode_job(r: JobRecord) -> bytes:
    """The JSON of :func:`_job_to_doc` (same keys and values; ``spec`` and ``plan`` first), with the spec's and
    the plan's text reused (:func:`_fragment`)."""
    plan = _fragment(r.plan, plan_to_dict) if r.plan else "null"
    rest = json.dumps(_job_state_doc(r), separators=(",", ":"))
    return f'{{"spec":{_fragment(r.spec, job_to_dict)},"plan":{plan},{rest[1:]}'.encode()


_PROGRESS_FIELDS = tuple(Progress.__dataclass_fields__)


def _job_state_doc(r: JobRecord) -> dict[str, Any]:
    """Every field of a job's stored document but its spec and plan (those change far less often)."""
    return {
        "state": r.state.value, "reason": r.reason, "request_id": r.request_id, "created_at": r.created_at,
        "updated_at": r.updated_at, "policy": r.policy, "allocation": dict(r.allocation), "attempt": r.attempt,
        "progress": {k: getattr(r.progress, k) for k in _PROGRESS_FIELDS},
        "history": [{"from": t.from_state.value if t.from_state else None, "to": t.to_state.value,
                     "reason": t.reason, "at": t.at} for t in r.history],
        "topology_revision": r.topology_revision,
    }


def _job_to_doc(r: JobRecord) -> dict[str, Any]:
    return {"spec": job_to_dict(r.spec), "plan": plan_to_dict(r.plan) if r.plan else None, **_job_state_doc(r)}


def _state(r: _Reader, name: str, *, optional: bool = False) -> JobState | None:
    v = r.raw(name)
    if v is None and optional:
        return None
    try:
        return JobState(v)
    except ValueError:
        raise r.error(name, f"must be one of {', '.join(s.value for s in JobState)}", v) from None


def _job_from_doc(key: str, raw: Any) -> JobRecord:
    r = _Reader(key, raw, "")
    spec = _wrap(key, "spec", lambda: job_from_dict(r.raw("spec"), where="spec"))
    raw_plan = r.raw("plan", None)
    plan = None if raw_plan is None else _wrap(key, "plan", lambda: plan_from_dict(raw_plan))
    alloc = r.sub("allocation")
    allocation = {str(c): alloc.integer(c, minimum=1) for c in alloc.doc}
    p = r.sub("progress")
    progress = Progress(step=p.integer("step", 0), steps=p.integer("steps", 0), loss=p.opt_float("loss"),
                        step_time_s=p.opt_float("step_time_s"), tokens_per_s=p.opt_float("tokens_per_s"),
                        checkpoint_step=p.opt_int("checkpoint_step"))
    history = []
    for i, t in enumerate(r.array("history")):
        h = _Reader(key, t, f"history[{i}]")
        to_state = _state(h, "to")
        assert to_state is not None
        history.append(Transition(from_state=_state(h, "from", optional=True), to_state=to_state,
                                  reason=h.string("reason"), at=h.number("at")))
    state = _state(r, "state")
    assert state is not None
    return JobRecord(spec=spec, state=state, reason=r.string("reason"), request_id=r.string("request_id"),
                     created_at=r.number("created_at"), updated_at=r.number("updated_at"), plan=plan,
                     policy=r.string("policy", ""), allocation=allocation, attempt=r.integer("attempt", minimum=0),
                     progress=progress, history=tuple(history),
                     topology_revision=r.integer("topology_revision", 0))


def job_state_and_tenant(key: str, value: bytes) -> tuple[JobState, str]:
    """The state and tenant of the job record ``value`` at ``key``, without decoding the rest (counting jobs
    by state at 10^4 jobs); :class:`CorruptRecordError` naming the key when they are not there."""
    r = _Reader(key, _json(key, value), "")
    state = _state(r, "state")
    assert state is not None
    return state, r.sub("spec").string("tenant", "default")


# ---------------------------------------------------------------------------------------------- waits


def _wait_to_doc(w: WaitState) -> dict[str, Any]:
    return {"until": w.until, "gpus": w.gpus, "claim": [[c, g] for c, g in w.claim], "run_s": w.run_s,
            "reason": w.reason}


def _wait_from_doc(key: str, raw: Any) -> WaitState:
    r = _Reader(key, raw, "")
    claim: list[tuple[str, int]] = []
    for i, item in enumerate(r.array("claim")):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], int) and not isinstance(item[1], bool)):
            raise r.error(f"claim[{i}]", "must be a [cluster, gpus] pair", item)
        claim.append((item[0], item[1]))
    from spiderflow.core.cycle import WaitState

    return WaitState(until=r.number("until"), gpus=r.integer("gpus", minimum=0), claim=tuple(claim),
                     run_s=r.number("run_s"), reason=r.string("reason"))


# ---------------------------------------------------------------------------------------------- the codec


_SELF_ENCODING = (Registration, PeerAddress, LeaseOwner, ProfileRecord, LinkRecord, RequestRecord, AllocationRecord,
                  Assignment, RendezvousInfo, CheckpointRecord, MetricsRecord, DroppedPoints, LeaderRecord)
"""The records that encode themselves (all but :class:`~spiderflow.jobs.JobRecord` and the core's WaitState)."""


def encode(record: Record) -> bytes:
    """The stored value of ``record`` (what :func:`decode` reads back under the record's key)."""
    if isinstance(record, JobRecord):
        return _encode_job(record)
    if isinstance(record, _SELF_ENCODING):
        return record.encode()
    return _dump(_wait_to_doc(record))  # the one record kind defined by the core: a WaitState


def _decode_job(k: Key, value: bytes) -> JobRecord:
    rec = _job_from_doc(k.key, _json(k.key, value))
    _check_name(k.key, "spec.id", rec.id, k.job)
    return rec


def _decode_registration(k: Key, value: bytes) -> Registration | PeerAddress:
    doc = _json(k.key, value)
    if isinstance(doc, dict) and set(doc) == {"cluster", "address"}:
        peer = PeerAddress.decode(value, key=k.key)
        _check_name(k.key, "cluster", peer.cluster, k.cluster)
        return peer
    reg = Registration.decode(value, key=k.key)
    _check_name(k.key, "cluster", reg.cluster, k.cluster)
    return reg


def _decode_profile(k: Key, value: bytes) -> ProfileRecord:
    rec = ProfileRecord.decode(value, key=k.key)
    _check_name(k.key, "cluster.name", rec.cluster.name, k.cluster)
    return rec


def _decode_link(k: Key, value: bytes) -> LinkRecord:
    rec = LinkRecord.decode(value, key=k.key)
    _check_name(k.key, "src", rec.src, k.cluster)
    _check_name(k.key, "dst", rec.dst, k.peer)
    return rec


def _decode_allocation(k: Key, value: bytes) -> AllocationRecord:
    r = _Reader(k.key, _json(k.key, value), "")
    for j in r.doc:
        try:
            ids.check_job_id("job", j)
        except ValidationError as e:
            raise CorruptRecordError(key=k.key, field="value", reason=f"names a malformed job id: {e.reason}",
                                     value=j) from None
    return AllocationRecord(gpus={str(j): r.integer(j, minimum=1) for j in r.doc})


def _decode_assignment(k: Key, value: bytes) -> Assignment:
    a = Assignment.decode(value, key=k.key)
    _check_name(k.key, "job", a.job, k.job)
    return a


def _decode_checkpoint(k: Key, value: bytes) -> CheckpointRecord:
    rec = CheckpointRecord.decode(value, key=k.key)
    _check_name(k.key, "job_id", rec.manifest.job_id, k.job)
    return rec


def _decode_dropped(k: Key, value: bytes) -> DroppedPoints:
    text = _text(k.key, value, "a count")
    if not text.isdigit():
        raise CorruptRecordError(key=k.key, field="value", reason="must be a decimal count", value=text)
    return DroppedPoints(count=int(text))


_DECODERS: dict[KeyKind, Callable[[Key, bytes], Record]] = {
    KeyKind.REGISTRATION: _decode_registration,
    KeyKind.LEASE_OWNER: lambda k, v: LeaseOwner(cluster=_text(k.key, v, "a cluster name")),
    KeyKind.PROFILE: _decode_profile,
    KeyKind.LINK: _decode_link,
    KeyKind.JOB: _decode_job,
    KeyKind.REQUEST: lambda k, v: RequestRecord(job=_text(k.key, v, "a job id")),
    KeyKind.ALLOCATION: _decode_allocation,
    KeyKind.ASSIGNMENT: _decode_assignment,
    KeyKind.WAIT: lambda k, v: _wait_from_doc(k.key, _json(k.key, v)),
    KeyKind.RENDEZVOUS: lambda k, v: RendezvousInfo.decode(v, key=k.key),
    KeyKind.CHECKPOINT: _decode_checkpoint,
    KeyKind.METRICS: lambda k, v: MetricsRecord.decode(v, key=k.key),
    KeyKind.METRICS_DROPPED: _decode_dropped,
    KeyKind.LEADER: lambda k, v: LeaderRecord(address=_text(k.key, v, "an address")),
}


def decode(key: str, value: bytes) -> Record:
    """The record stored at ``key`` (its kind from :func:`spiderflow.store.keys.parse`);
    :class:`~spiderflow.core.errors.CorruptRecordError` naming the key and the field when the key is unknown or the
    value is not that kind's record."""
    parsed = keys.parse(key)
    return _DECODERS[parsed.kind](parsed, bytes(value))


def decode_as(key: str, value: bytes, cls: type[R]) -> R:
    """:func:`decode`, checked to be a ``cls`` (the record the caller expects under ``key``)."""
    rec = decode(key, value)
    if not isinstance(rec, cls):
        raise CorruptRecordError(key=key, field="key", reason=f"holds a {type(rec).__name__}, not a {cls.__name__}")
    return rec
