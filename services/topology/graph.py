"""The live cluster graph as pure functions: stored records, report validation, smoothing of reports,
snapshot assembly and snapshot diffs. No grpc, no etcd: :mod:`services.topology.repo` does the I/O.

Stored records (JSON values, keys from :mod:`spiderflow.store.keys`)
--------------------------------------------------------------------
(every record type and its encoding in :mod:`spiderflow.store.records`)

- ``clusters/<c>``: :class:`~spiderflow.store.records.Registration`, written by the agent under its lease.
- ``profiles/<c>``: :class:`ProfileRecord`, written by the topology service: the cluster as last
  reported, its ``tflops`` replaced by the smoothed figure (a calibrated report is taken whole,
  :func:`apply_profile`), plus the smoothing state.
- ``links/<src>/<dst>``: :class:`LinkRecord`, written by the topology service: the smoothed bandwidth
  and latency of ``src → dst`` (:mod:`services.topology.smoothing` state of each) and when it was last
  updated (the service's clock, which is also what ages it).

Snapshot (:func:`assemble`)
---------------------------
A cluster is in a snapshot iff it is **registered** (its agent's lease is alive) **and profiled**.
A link ``src → dst`` is in it iff both ends are, and it was updated less than ``link_max_age_s`` ago
(stale links age out). Every link is ``directed`` (each direction is measured by its source's agent).
Clusters are sorted by name, links by ``(a, b)``.

``free_gpus`` in a snapshot is the capacity a cluster **offers** to SpiderFlow as its agent reports it
(GPUs not used by anything outside SpiderFlow). It does *not* subtract SpiderFlow's own allocations:
the scheduler subtracts those itself (``allocations/<c>``), so a snapshot never double-counts a job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from services.topology.smoothing import Closeness, Outcome, Series, SmoothingConfig, observe
from spiderflow.core.domain import Cluster, Link, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.store.records import LinkRecord, ProfileRecord, Registration

__all__ = [
    "Change",
    "ChangeKind",
    "ClusterStatus",
    "GraphConfig",
    "LinkRecord",
    "LinkStatus",
    "Measurement",
    "ProfileRecord",
    "Snapshot",
    "apply_changes",
    "apply_measurement",
    "apply_profile",
    "assemble",
    "diff",
    "validate_measurements",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class GraphConfig:
    """Smoothing and ageing. ``bandwidth``/``latency``/``tflops``: :class:`SmoothingConfig` of each
    quantity (latency uses the absolute test with ``outlier_floor`` in ms); ``link_max_age_s``: a link not
    updated for this long leaves snapshots (and is deleted by the service's collector); a stale link's
    smoothing restarts from its next sample."""

    bandwidth: SmoothingConfig = field(default_factory=lambda: SmoothingConfig(alpha=0.5, outlier_ratio=2.0))
    latency: SmoothingConfig = field(
        default_factory=lambda: SmoothingConfig(alpha=0.5, outlier_ratio=2.0, outlier_floor=5.0))
    tflops: SmoothingConfig = field(default_factory=lambda: SmoothingConfig(alpha=0.3, outlier_ratio=2.0))
    link_max_age_s: float = 60.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.link_max_age_s) and self.link_max_age_s > 0):
            raise ValidationError("link_max_age_s", "must be > 0", self.link_max_age_s)


# ---------------------------------------------------------------------------------------------- records


# ``ProfileRecord`` and ``LinkRecord`` are records of :mod:`spiderflow.store.records` (encoded there).


# ---------------------------------------------------------------------------------------------- reports


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One validated link measurement from the reporting cluster to ``target``. ``bandwidth_gbps`` is
    None for a latency-only refresh (no bandwidth probe was made)."""

    target: str
    bandwidth_gbps: float | None
    latency_ms: float
    probe_bytes: int = 0
    rtt_samples: int = 0
    measured_at: float = 0.0


def _number(field: str, value: float, *, positive: bool) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValidationError(field, "must be a finite number", value)
    if value < 0 or (positive and value == 0):
        raise ValidationError(field, "must be > 0" if positive else "must be ≥ 0", value)


def validate_measurements(source: str, raw: Sequence[Measurement]) -> list[Measurement]:
    """Check a link report from ``source``; :class:`ValidationError` naming the field
    (``measurements[2].bandwidth_gbps``) otherwise. Rules: a target is named, differs from ``source``
    and appears once; latency is finite and ≥ 0; bandwidth is finite and > 0, except that a latency-only
    refresh has ``probe_bytes == 0`` and bandwidth 0 (it becomes ``bandwidth_gbps=None``);
    ``probe_bytes``/``rtt_samples`` ≥ 0."""
    seen: set[str] = set()
    out: list[Measurement] = []
    for i, m in enumerate(raw):
        where = f"measurements[{i}]"
        if not m.target or "/" in m.target:
            raise ValidationError(f"{where}.target", "must name a cluster", m.target)
        if m.target == source:
            raise ValidationError(f"{where}.target", "must differ from the reporting cluster", m.target)
        if m.target in seen:
            raise ValidationError(f"{where}.target", "appears twice in the report", m.target)
        seen.add(m.target)
        if m.probe_bytes < 0:
            raise ValidationError(f"{where}.probe_bytes", "must be ≥ 0", m.probe_bytes)
        if m.rtt_samples < 0:
            raise ValidationError(f"{where}.rtt_samples", "must be ≥ 0", m.rtt_samples)
        _number(f"{where}.latency_ms", m.latency_ms, positive=False)
        bw = m.bandwidth_gbps
        if bw is not None:
            _number(f"{where}.bandwidth_gbps", bw, positive=m.probe_bytes > 0)
            if bw == 0:
                bw = None
        elif m.probe_bytes > 0:
            raise ValidationError(f"{where}.bandwidth_gbps", "is required with probe_bytes > 0")
        out.append(replace(m, bandwidth_gbps=bw))
    return out


def apply_measurement(
    prev: LinkRecord | None, source: str, m: Measurement, *, now: float, config: GraphConfig
) -> tuple[LinkRecord | None, bool]:
    """Fold ``m`` into the link's record ``prev`` (None: none yet; a stale one restarts).

    Returns ``(record, accepted)``: ``record`` to store (None: nothing to store — a latency-only refresh
    of a link that has no bandwidth yet), ``accepted`` False when a figure was held back as an outlier
    (or nothing could be stored)."""
    if prev is not None and now - prev.updated_at >= config.link_max_age_s:
        prev = None
    if m.bandwidth_gbps is None:
        if prev is None:
            return None, False
        bw, bw_out = prev.bandwidth, Outcome.SMOOTHED
    else:
        bw, bw_out = observe(prev.bandwidth if prev else None, m.bandwidth_gbps, config.bandwidth, Closeness.RATIO)
    lat, lat_out = observe(prev.latency if prev else None, m.latency_ms, config.latency, Closeness.ABSOLUTE)
    record = LinkRecord(src=source, dst=m.target, bandwidth=bw, latency=lat, measured_at=m.measured_at,
                        updated_at=now, probe_bytes=m.probe_bytes, rtt_samples=m.rtt_samples)
    return record, bw_out.accepted and lat_out.accepted


CALIBRATED_FIELDS = ("tflops", "mfu", "layer_overhead_ms", "optimizer_ms_per_layer", "embedding_us_per_token",
                     "head_us_per_token", "embedding_optimizer_ms", "head_optimizer_ms", "data_ms_per_sample")
"""The fields one calibration measures together (an agent's :func:`agent.profiler.profile_cpu` or
:func:`agent.profiler.calibrate_gpu`: ``mfu`` and the fixed costs are fitted against its ``tflops``)."""


def apply_profile(
    prev: ProfileRecord | None, cluster: Cluster, *, agent_id: str, agent_address: str, measured_at: float,
    now: float, config: GraphConfig,
) -> tuple[ProfileRecord, bool]:
    """The new profile record for a reported ``cluster``: every field as reported, except ``tflops``,
    which is smoothed while the GPU type stays the same (an outlier keeps the previous figure).

    A **calibrated** report (``mfu`` set: the agent measured ``tflops`` and fitted ``mfu`` and the fixed costs
    against it, :data:`CALIBRATED_FIELDS`) is one set of figures whose product is the rate the cost model
    prices: smoothing ``tflops`` alone would pair the new ``mfu`` with a blend of old and new ``tflops``. So it
    is taken whole, through the same outlier test: an outlier keeps the previous calibrated set (until
    ``shift_after`` agreeing samples confirm the change), anything else replaces it.
    Returns ``(record, accepted)`` (False: the tflops sample was held back as an outlier)."""
    series: Series | None = None
    accepted = True
    reported = cluster.tflops
    if reported is not None:
        same = prev is not None and prev.cluster.gpu == cluster.gpu and prev.tflops is not None
        series, outcome = observe(prev.tflops if same and prev else None, reported, config.tflops,
                                  Closeness.RATIO)
        accepted = outcome.accepted
        if cluster.mfu is None:
            cluster = replace(cluster, tflops=series.value)
        elif not accepted and prev is not None:
            cluster = replace(cluster, **{f: getattr(prev.cluster, f) for f in CALIBRATED_FIELDS})
        else:
            series = replace(series, value=reported)
    record = ProfileRecord(cluster=cluster, tflops=series, agent_id=agent_id, agent_address=agent_address,
                           measured_at=measured_at, updated_at=now)
    return record, accepted


# ---------------------------------------------------------------------------------------------- snapshots


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStatus:
    """Freshness of one snapshot link."""

    a: str
    b: str
    updated_at: float
    samples: int
    pending_outliers: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterStatus:
    """The agent behind one snapshot cluster."""

    name: str
    agent_id: str
    agent_address: str
    updated_at: float


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """A topology with its etcd revision, and the status of each of its clusters and links (same order)."""

    topology: Topology
    clusters: tuple[ClusterStatus, ...]
    links: tuple[LinkStatus, ...]

    @property
    def revision(self) -> int:
        return self.topology.revision


def assemble(
    registrations: Mapping[str, Registration],
    profiles: Mapping[str, ProfileRecord],
    links: Mapping[tuple[str, str], LinkRecord],
    *,
    revision: int,
    now: float,
    config: GraphConfig,
) -> Snapshot:
    """The snapshot of the stored records at ``revision`` as of time ``now`` (rules in the module
    docstring)."""
    names = sorted(n for n in registrations if n in profiles)
    present = set(names)
    clusters = tuple(profiles[n].cluster for n in names)
    cstat = tuple(
        ClusterStatus(name=n, agent_id=registrations[n].agent_id, agent_address=registrations[n].address,
                      updated_at=profiles[n].updated_at)
        for n in names
    )
    fresh = sorted(
        (pair, rec) for pair, rec in links.items()
        if pair[0] in present and pair[1] in present and pair[0] != pair[1]
        and now - rec.updated_at < config.link_max_age_s
    )
    topo = Topology(clusters=clusters, links=tuple(rec.link for _, rec in fresh), revision=revision)
    lstat = tuple(
        LinkStatus(a=a, b=b, updated_at=rec.updated_at, samples=rec.bandwidth.samples,
                   pending_outliers=rec.pending_outliers)
        for (a, b), rec in fresh
    )
    return Snapshot(topology=topo, clusters=cstat, links=lstat)


class ChangeKind(StrEnum):
    """Kinds of graph change (as ``TopologyChange.Kind``)."""

    CLUSTER_UPSERTED = "cluster_upserted"
    CLUSTER_REMOVED = "cluster_removed"
    LINK_UPSERTED = "link_upserted"
    LINK_REMOVED = "link_removed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One change: ``cluster`` is set for CLUSTER_UPSERTED, ``link`` for LINK_UPSERTED; removals carry
    only ``name`` (cluster) or ``a``/``b`` (link)."""

    kind: ChangeKind
    name: str = ""
    a: str = ""
    b: str = ""
    cluster: Cluster | None = None
    link: Link | None = None


def diff(old: Topology | None, new: Topology) -> list[Change]:
    """The changes that turn ``old`` (None = empty) into ``new``: removed links, removed clusters,
    upserted (new or changed) clusters, upserted links, each group sorted by name."""
    old_c = {c.name: c for c in old.clusters} if old is not None else {}
    new_c = {c.name: c for c in new.clusters}
    old_l = {(x.a, x.b): x for x in old.links} if old is not None else {}
    new_l = {(x.a, x.b): x for x in new.links}
    out = [Change(kind=ChangeKind.LINK_REMOVED, a=a, b=b) for (a, b) in sorted(old_l) if (a, b) not in new_l]
    out += [Change(kind=ChangeKind.CLUSTER_REMOVED, name=n) for n in sorted(old_c) if n not in new_c]
    out += [Change(kind=ChangeKind.CLUSTER_UPSERTED, name=n, cluster=c) for n, c in sorted(new_c.items())
            if old_c.get(n) != c]
    out += [Change(kind=ChangeKind.LINK_UPSERTED, a=a, b=b, link=x) for (a, b), x in sorted(new_l.items())
            if old_l.get((a, b)) != x]
    return out


def apply_changes(topology: Topology, changes: Sequence[Change], *, revision: int | None = None) -> Topology:
    """A client's view after ``changes`` (as :func:`diff` or a WatchTopology message gives them):
    ``apply_changes(old, diff(old, new)) == new`` up to ordering, which this function normalises (clusters
    by name, links by ``(a, b)``). Removing a cluster also drops the links touching it."""
    clusters = {c.name: c for c in topology.clusters}
    links = {(x.a, x.b): x for x in topology.links}
    for ch in changes:
        if ch.kind is ChangeKind.CLUSTER_UPSERTED and ch.cluster is not None:
            clusters[ch.cluster.name] = ch.cluster
        elif ch.kind is ChangeKind.CLUSTER_REMOVED:
            clusters.pop(ch.name, None)
            links = {p: x for p, x in links.items() if ch.name not in p}
        elif ch.kind is ChangeKind.LINK_UPSERTED and ch.link is not None:
            links[(ch.link.a, ch.link.b)] = ch.link
        elif ch.kind is ChangeKind.LINK_REMOVED:
            links.pop((ch.a, ch.b), None)
    return Topology(clusters=tuple(c for _, c in sorted(clusters.items())),
                    links=tuple(x for _, x in sorted(links.items())),
                    revision=topology.revision if revision is None else revision)
