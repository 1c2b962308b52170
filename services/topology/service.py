"""The Topology gRPC service (``spiderflow.topology.v1.Topology``): a thin, stateless adapter.

Every RPC converts proto → domain, calls :class:`~services.topology.repo.TopologyRepo` (etcd through the
Store) and the pure graph functions (:mod:`services.topology.graph`), and converts back. Any replica
answers any request; the graph lives in etcd only.

Errors (mapped by :func:`~spiderflow.rpc.errors.map_domain_errors`):

- INVALID_ARGUMENT naming the field: a malformed profile (``cluster.gpu``, ``cluster.free_gpus``, ...),
  a NaN/negative/zero bandwidth or a NaN/negative latency (``measurements[1].bandwidth_gbps``), a missing
  ``agent_id``, a reporting cluster that is not registered (``cluster.name`` / ``cluster``) or a target
  that is not (``measurements[0].target``);
- PERMISSION_DENIED: the caller's identity is not the one that registered the cluster
  (:mod:`services.topology.identity`);
- UNAVAILABLE: etcd cannot be reached.

WatchTopology
-------------
``from_revision = 0``: the first message is a full snapshot (``resync``), then changes as they happen.
``from_revision = r > 0``: changes after ``r``. If anything in the graph's records changed between ``r``
and the current revision, or ``r`` was compacted, the stream starts with a resync snapshot (the state at
``r`` cannot be rebuilt); otherwise it streams changes only. Each message's ``revision`` is the etcd
revision after its changes: pass it back as ``from_revision`` to resume. Links ageing out (no key change)
are reported within ``tick_s`` with the revision of the last change. ``full_snapshots`` adds the full
graph to every message. The server sends initial metadata (``x-spiderflow-revision``: the revision the
stream started from) once the etcd watch is established, so ``await call.initial_metadata()`` returns
when a change made afterwards is sure to be streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc.aio
import structlog
from google.protobuf import timestamp_pb2  # type: ignore[import-untyped]

from services.topology.graph import Change, ChangeKind, Measurement, Snapshot, diff
from services.topology.identity import IdentityResolver, authorize_cluster, caller_from_request
from services.topology.repo import RawState, TopologyRepo, record_of
from spiderflow.core.domain import Cluster
from spiderflow.core.errors import ValidationError
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc import convert
from spiderflow.rpc.errors import map_domain_errors
from spiderflow.runtime import parse_hostport
from spiderflow.security import ids
from spiderflow.store import keys
from spiderflow.store.base import CompactedError, EventType, Store, Watch, WatchEvent

PROFILE_BOUNDS: dict[str, float] = {
    "nodes": 100_000, "gpus_per_node": 64, "intra_node_gbps": 100_000.0, "inter_node_gbps": 100_000.0,
    "tflops": 100_000.0, "memory_gib": 10_000.0, "layer_overhead_ms": 60_000.0, "optimizer_ms_per_layer": 60_000.0,
}
"""Largest value an agent may report for each profile field: a profile is measured hardware, so a cluster
of 2^31 nodes or a GPU of 10^9 TFLOPS is a forged or broken report (INVALID_ARGUMENT naming the field)."""


def check_profile_bounds(cluster: Cluster) -> None:
    """Refuse a reported profile with a field beyond :data:`PROFILE_BOUNDS` or a name outside the id
    grammar (cluster names become etcd keys)."""
    ids.check_id("cluster.name", cluster.name, max_len=63)
    for name, bound in PROFILE_BOUNDS.items():
        v = getattr(cluster, name)
        if v is not None and v > bound:
            raise ValidationError(f"cluster.{name}", f"must be at most {bound:g}", v)


__all__ = [
    "PROFILE_BOUNDS",
    "TopologyService",
    "change_from_proto",
    "change_to_proto",
    "check_profile_bounds",
    "snapshot_to_proto",
    "timestamp",
]

log = structlog.get_logger(__name__)

_OURS = (keys.CLUSTERS, keys.PROFILES, keys.LINKS)

_KINDS = {
    ChangeKind.CLUSTER_UPSERTED: topology_pb2.TopologyChange.KIND_CLUSTER_UPSERTED,
    ChangeKind.CLUSTER_REMOVED: topology_pb2.TopologyChange.KIND_CLUSTER_REMOVED,
    ChangeKind.LINK_UPSERTED: topology_pb2.TopologyChange.KIND_LINK_UPSERTED,
    ChangeKind.LINK_REMOVED: topology_pb2.TopologyChange.KIND_LINK_REMOVED,
}


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    """A protobuf Timestamp of epoch ``seconds``."""
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def snapshot_to_proto(snap: Snapshot) -> topology_pb2.GetTopologyResponse:
    return topology_pb2.GetTopologyResponse(
        topology=convert.topology_to_proto(snap.topology),
        link_status=[
            topology_pb2.LinkStatus(a=s.a, b=s.b, updated_at=timestamp(s.updated_at), samples=s.samples,
                                    pending_outliers=s.pending_outliers)
            for s in snap.links
        ],
        cluster_status=[
            topology_pb2.ClusterStatus(name=s.name, agent_id=s.agent_id, agent_address=s.agent_address,
                                       updated_at=timestamp(s.updated_at))
            for s in snap.clusters
        ],
    )


def change_to_proto(change: Change) -> topology_pb2.TopologyChange:
    msg = topology_pb2.TopologyChange(kind=_KINDS[change.kind])
    if change.cluster is not None:
        msg.cluster.CopyFrom(convert.cluster_to_proto(change.cluster))
    elif change.kind is ChangeKind.CLUSTER_REMOVED:
        msg.cluster.name = change.name
    if change.link is not None:
        msg.link.CopyFrom(convert.link_to_proto(change.link))
    elif change.kind is ChangeKind.LINK_REMOVED:
        msg.link.a, msg.link.b = change.a, change.b
    return msg


_KINDS_BACK = {int(v): k for k, v in _KINDS.items()}


def change_from_proto(msg: topology_pb2.TopologyChange) -> Change:
    """The domain :class:`Change` of a streamed change (for clients that keep a view with
    :func:`services.topology.graph.apply_changes`)."""
    kind = _KINDS_BACK.get(int(msg.kind))
    if kind is None:
        raise ValidationError("changes.kind", "unknown change kind", int(msg.kind))
    if kind is ChangeKind.CLUSTER_UPSERTED:
        cluster = convert.cluster_from_proto(msg.cluster, field="changes.cluster")
        return Change(kind=kind, name=cluster.name, cluster=cluster)
    if kind is ChangeKind.CLUSTER_REMOVED:
        return Change(kind=kind, name=msg.cluster.name)
    if kind is ChangeKind.LINK_UPSERTED:
        link = convert.link_from_proto(msg.link, field="changes.link")
        return Change(kind=kind, a=link.a, b=link.b, link=link)
    return Change(kind=kind, a=msg.link.a, b=msg.link.b)


def _seconds(ts: timestamp_pb2.Timestamp, default: float, field: str = "measured_at") -> float:
    """Seconds of a timestamp (``default`` when unset); INVALID_ARGUMENT for one out of the valid range."""
    if not (ts.seconds or ts.nanos):
        return default
    # google.protobuf.Timestamp's valid range: 0001-01-01 .. 9999-12-31, nanos in [0, 1e9).
    if not (-62135596800 <= ts.seconds <= 253402300799) or not (0 <= ts.nanos < 1_000_000_000):
        raise ValidationError(field, "is not a valid timestamp", f"{ts.seconds}s {ts.nanos}ns")
    return float(ts.seconds) + float(ts.nanos) / 1e9


def _ours(key: str) -> bool:
    return key.startswith(_OURS)


@map_domain_errors
class TopologyService(topology_pb2_grpc.TopologyServicer):
    """Stateless; safe to run any number of replicas over the same etcd. ``identity`` resolves the
    caller (see :mod:`services.topology.identity`); ``tick_s`` is how often watch streams re-check
    link ages."""

    def __init__(self, store: Store, repo: TopologyRepo, *, identity: IdentityResolver = caller_from_request,
                 tick_s: float = 1.0) -> None:
        self.store = store
        self.repo = repo
        self.identity = identity
        self.tick_s = tick_s

    async def ReportProfile(
        self, request: topology_pb2.ReportProfileRequest, context: grpc.aio.ServicerContext
    ) -> topology_pb2.ReportProfileResponse:
        caller = self.identity(request.agent_id, context)
        if not request.HasField("cluster"):
            raise ValidationError("cluster", "is required")
        cluster = convert.cluster_from_proto(request.cluster, field="cluster")
        check_profile_bounds(cluster)
        authorize_cluster(caller, cluster.name)
        if request.agent_address:
            parse_hostport(request.agent_address, field="agent_address")
        now = self.repo.clock()
        rev = await self.repo.report_profile(cluster, caller, agent_address=request.agent_address,
                                             measured_at=_seconds(request.measured_at, now))
        return topology_pb2.ReportProfileResponse(revision=rev)

    async def ReportLinks(
        self, request: topology_pb2.ReportLinksRequest, context: grpc.aio.ServicerContext
    ) -> topology_pb2.ReportLinksResponse:
        caller = self.identity(request.agent_id, context)
        authorize_cluster(caller, request.cluster)
        now = self.repo.clock()
        raw = [
            Measurement(target=m.target, bandwidth_gbps=m.bandwidth_gbps, latency_ms=m.latency_ms,
                        probe_bytes=m.probe_bytes, rtt_samples=m.rtt_samples,
                        measured_at=_seconds(m.measured_at, now))
            for m in request.measurements
        ]
        out = await self.repo.report_links(request.cluster, caller, raw)
        return topology_pb2.ReportLinksResponse(revision=out.revision, accepted=out.accepted,
                                                rejected=list(out.rejected))

    async def GetTopology(
        self, request: topology_pb2.GetTopologyRequest, context: grpc.aio.ServicerContext
    ) -> topology_pb2.GetTopologyResponse:
        return snapshot_to_proto(await self.repo.snapshot())

    async def WatchTopology(
        self, request: topology_pb2.WatchTopologyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[topology_pb2.WatchTopologyResponse]:
        from_rev = request.from_revision
        if from_rev < 0:
            raise ValidationError("from_revision", "must be ≥ 0", from_rev)
        state = await self.repo.read()
        base = state.revision
        view = self.repo.assemble(state)
        resync = from_rev == 0
        scanning = 0 < from_rev < base  # history (from_rev, base] decides whether a resync is needed
        queue: asyncio.Queue[WatchEvent | BaseException] = asyncio.Queue()

        async def pump(watch: Watch) -> None:
            try:
                async with watch:
                    async for event in watch:
                        queue.put_nowait(event)
            except Exception as e:  # handed to the stream, which ends with this error
                queue.put_nowait(e)

        async def open_watch(start: int) -> asyncio.Task[None]:
            watch = self.store.watch_prefix(keys.ROOT, start_revision=start)
            await watch.start()
            return asyncio.create_task(pump(watch), name="topology-watch")

        try:
            reader = await open_watch(from_rev + 1 if scanning else base + 1)
        except CompactedError:
            log.info("topology.watch_compacted", from_revision=from_rev, revision=base)
            scanning, resync = False, True
            reader = await open_watch(base + 1)

        def snapshot_message(snap: Snapshot) -> topology_pb2.WatchTopologyResponse:
            return topology_pb2.WatchTopologyResponse(
                revision=snap.revision, resync=True, snapshot=convert.topology_to_proto(snap.topology))

        log.info("topology.watch_started", from_revision=from_rev, revision=base, resync=resync)
        # Initial metadata tells the client that the stream is established: a change made after it has
        # arrived is delivered (``await call.initial_metadata()``).
        await context.send_initial_metadata((("x-spiderflow-revision", str(base)),))
        try:
            if resync and not scanning:
                yield snapshot_message(view)
                resync = False
            while True:
                batch: list[WatchEvent] = []
                try:
                    item = await asyncio.wait_for(queue.get(), self.tick_s)
                    while True:
                        if isinstance(item, CompactedError) and scanning:
                            # History before ``base`` is gone: resync and follow from ``base``.
                            log.info("topology.watch_compacted", from_revision=from_rev, revision=base)
                            scanning, resync, batch = False, True, []
                            await _stop(reader)
                            reader = await open_watch(base + 1)
                            yield snapshot_message(view)
                            resync = False
                            break
                        if isinstance(item, BaseException):
                            raise item
                        batch.append(item)
                        if queue.empty():
                            break
                        item = queue.get_nowait()
                except TimeoutError:
                    pass
                revision = view.revision
                touched = False
                for event in batch:
                    if event.mod_revision <= base:
                        resync = resync or (scanning and _ours(event.key))
                        continue
                    if _ours(event.key):
                        record_of(event.key, None if event.type is EventType.DELETE else event.value, state)
                        touched = True
                    revision = max(revision, event.mod_revision)
                if scanning and (not batch or revision > base):
                    # The history up to ``base`` has been delivered: the client's view is stale if any
                    # of our records changed in it.
                    scanning = False
                    if resync:
                        yield snapshot_message(view)
                        resync = False
                if batch and not touched:
                    continue  # only other keys changed
                if not batch and self.repo.clock() < _next_expiry(state, self.repo.config.link_max_age_s):
                    continue  # nothing can have aged out yet
                new_view = self.repo.assemble(replace(state, revision=revision))
                changes = diff(view.topology, new_view.topology)
                view = new_view
                if changes:
                    msg = topology_pb2.WatchTopologyResponse(
                        revision=view.revision, changes=[change_to_proto(c) for c in changes])
                    if request.full_snapshots:
                        msg.snapshot.CopyFrom(convert.topology_to_proto(view.topology))
                    yield msg
        finally:
            await _stop(reader)
            log.info("topology.watch_ended", revision=view.revision)


def _next_expiry(state: RawState, max_age_s: float) -> float:
    """When the oldest stored link of ``state`` leaves snapshots (inf without links)."""
    return min((rec.updated_at for rec in state.links.values()), default=math.inf) + max_age_s


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
