"""The Topology service over a real etcd and a real gRPC server on port 0: reports flow into snapshots
and watch streams, validation errors carry the right codes and fields, registrations bound identity,
smoothing rejects outliers, stale links age out."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest

from agent.registration import Registration
from services.topology.graph import GraphConfig, apply_changes
from services.topology.repo import TopologyRepo
from services.topology.service import TopologyService, change_from_proto
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.server import open_channel, serve
from spiderflow.store import keys
from spiderflow.store.base import Lease, Store
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(60)


class Clock:
    """A settable wall clock for the service (link ageing without sleeping)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    store: Store
    stub: topology_pb2_grpc.TopologyStub
    clock: Clock
    leases: dict[str, Lease]

    async def register(self, cluster: str, agent_id: str | None = None, ttl: int = 5) -> str:
        lease = await self.store.grant(ttl)
        self.leases[cluster] = lease
        agent_id = agent_id or f"{cluster}-agent"
        reg = Registration(cluster=cluster, agent_id=agent_id, principal=agent_id, address="127.0.0.1:1")
        await self.store.put(keys.cluster_key(cluster), reg.encode(), lease=lease)
        return agent_id

    async def profile(self, cluster: str, agent_id: str | None = None, **kw: object) -> int:
        msg = types_pb2.Cluster(name=cluster, gpu="A100-80G", nodes=1, gpus_per_node=8, free_gpus=6, tflops=250.0)
        for k, v in kw.items():
            setattr(msg, k, v)
        resp = await self.stub.ReportProfile(topology_pb2.ReportProfileRequest(
            cluster=msg, agent_id=agent_id or f"{cluster}-agent", agent_address="127.0.0.1:1"))
        return int(resp.revision)

    async def links(self, src: str, *ms: tuple[str, float, float],
                    agent_id: str | None = None) -> topology_pb2.ReportLinksResponse:
        return await self.stub.ReportLinks(topology_pb2.ReportLinksRequest(
            cluster=src, agent_id=agent_id or f"{src}-agent",
            measurements=[topology_pb2.LinkMeasurement(target=t, bandwidth_gbps=bw, latency_ms=lat,
                                                       probe_bytes=1 << 20, rtt_samples=5) for t, bw, lat in ms]))

    async def topology(self) -> topology_pb2.GetTopologyResponse:
        return await self.stub.GetTopology(topology_pb2.GetTopologyRequest())


@pytest.fixture
async def env(etcd: EtcdProcess) -> AsyncIterator[Env]:
    store = EtcdStore(etcd.endpoint)
    clock = Clock()
    repo = TopologyRepo(store, GraphConfig(link_max_age_s=30.0), clock=clock)
    server = await serve([TopologyService(store, repo, tick_s=0.2)], host="127.0.0.1", port=0)
    channel = open_channel(server.address)
    e = Env(store=store, stub=topology_pb2_grpc.TopologyStub(channel), clock=clock, leases={})
    try:
        yield e
    finally:
        await channel.close()
        await server.stop(grace_s=0)
        await store.close()


async def _code(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


async def test_report_flows_into_get_topology(env: Env) -> None:
    await env.register("a")
    await env.register("b")
    await env.profile("a")
    rev = await env.profile("b", gpu="H100-80G")
    resp = await env.links("a", ("b", 10.0, 5.0))
    assert resp.accepted == 1 and list(resp.rejected) == []
    assert resp.revision > rev
    snap = await env.topology()
    topo = convert.topology_from_proto(snap.topology)
    assert topo.names == ("a", "b")
    assert topo.revision >= resp.revision
    assert topo.cluster("b").gpu == "H100-80G" and topo.cluster("a").free == 6
    assert topo.cluster("a").tflops == pytest.approx(250.0)
    assert topo.direct[("a", "b")].bandwidth_gbps == pytest.approx(10.0)
    assert topo.direct[("a", "b")].latency_ms == pytest.approx(5.0)
    assert ("b", "a") not in topo.direct  # only a -> b was measured
    assert [(s.a, s.b, s.samples) for s in snap.link_status] == [("a", "b", 1)]
    assert [s.agent_id for s in snap.cluster_status] == ["a-agent", "b-agent"]


async def test_registered_but_unprofiled_cluster_is_not_in_snapshot(env: Env) -> None:
    await env.register("a")
    snap = await env.topology()
    assert list(snap.topology.clusters) == []


async def test_validation_errors_name_the_field(env: Env) -> None:
    await env.register("a")
    await env.register("b")
    await env.profile("a")
    await env.profile("b")
    cases = [
        (("b", -1.0, 5.0), "measurements[0].bandwidth_gbps"),
        (("b", math.nan, 5.0), "measurements[0].bandwidth_gbps"),
        (("b", 1.0, -3.0), "measurements[0].latency_ms"),
        (("b", 1.0, math.nan), "measurements[0].latency_ms"),
        (("zz", 1.0, 1.0), "measurements[0].target"),
        (("a", 1.0, 1.0), "measurements[0].target"),
    ]
    for m, field in cases:
        err = await _code(env.links("a", m))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (m, err)
        assert field in (err.details() or ""), (m, err.details())
    # A malformed profile names the field.
    err = await _code(env.profile("a", gpu="B9000"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cluster.gpu" in (err.details() or "")
    err = await _code(env.profile("a", free_gpus=99))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cluster.free_gpus" in (err.details() or "")
    err = await _code(env.profile("a", tflops=math.nan))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cluster.tflops" in (err.details() or "")
    # Unknown (unregistered) cluster.
    err = await _code(env.profile("ghost", agent_id="ghost-agent"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cluster.name" in (err.details() or "")
    err = await _code(env.links("ghost", ("a", 1.0, 1.0)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cluster" in (err.details() or "")
    # Missing agent id.
    err = await _code(env.stub.ReportProfile(topology_pb2.ReportProfileRequest(
        cluster=types_pb2.Cluster(name="a", gpu="cpu", nodes=1, gpus_per_node=1))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "agent_id" in (err.details() or "")


async def test_report_for_another_cluster_is_permission_denied(env: Env) -> None:
    await env.register("a")
    await env.register("b")
    await env.profile("b")
    err = await _code(env.profile("a", agent_id="b-agent"))  # b's agent reports a's profile
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    err = await _code(env.links("a", ("b", 1.0, 1.0), agent_id="b-agent"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    err = await _code(env.links("a", ("b", 1.0, 1.0), agent_id="impostor"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_smoothing_rejects_an_outlier_and_follows_a_level_shift(env: Env) -> None:
    for c in ("a", "b"):
        await env.register(c)
        await env.profile(c)
    for bw in (1.0, 1.1, 0.9):
        assert (await env.links("a", ("b", bw, 10.0))).accepted == 1
    resp = await env.links("a", ("b", 50.0, 10.0))  # a spike
    assert resp.accepted == 0 and list(resp.rejected) == ["b"]
    link = convert.topology_from_proto((await env.topology()).topology).direct[("a", "b")]
    assert 0.9 <= link.bandwidth_gbps <= 1.1
    assert (await env.links("a", ("b", 1.0, 10.0))).accepted == 1  # back to normal: spike forgotten
    # A real change (re-shaped link): two agreeing samples move the figure to the new level.
    assert list((await env.links("a", ("b", 0.2, 40.0))).rejected) == ["b"]
    assert (await env.links("a", ("b", 0.2, 40.0))).accepted == 1
    link = convert.topology_from_proto((await env.topology()).topology).direct[("a", "b")]
    assert link.bandwidth_gbps == pytest.approx(0.2, rel=0.05)
    assert link.latency_ms == pytest.approx(40.0, rel=0.05)


async def test_latency_only_refresh_keeps_bandwidth(env: Env) -> None:
    for c in ("a", "b"):
        await env.register(c)
        await env.profile(c)
    req = topology_pb2.ReportLinksRequest(cluster="a", agent_id="a-agent", measurements=[
        topology_pb2.LinkMeasurement(target="b", bandwidth_gbps=0.0, latency_ms=4.0, probe_bytes=0, rtt_samples=3)])
    resp = await env.stub.ReportLinks(req)
    assert list(resp.rejected) == ["b"]  # nothing to refresh yet
    await env.links("a", ("b", 2.0, 4.0))
    env.clock.now += 20
    resp = await env.stub.ReportLinks(req)
    assert resp.accepted == 1
    env.clock.now += 20  # 40 s after the bandwidth probe, 20 s after the refresh: still fresh
    link = convert.topology_from_proto((await env.topology()).topology).direct[("a", "b")]
    assert link.bandwidth_gbps == pytest.approx(2.0)


async def test_stale_links_age_out_and_are_collected(env: Env, etcd: EtcdProcess) -> None:
    for c in ("a", "b"):
        await env.register(c)
        await env.profile(c)
    await env.links("a", ("b", 2.0, 4.0))
    await env.links("b", ("a", 2.0, 4.0))
    env.clock.now += 20
    await env.links("b", ("a", 2.0, 4.0))
    env.clock.now += 15  # a->b is 35 s old, b->a 15 s
    topo = convert.topology_from_proto((await env.topology()).topology)
    assert list(topo.direct) == [("b", "a")]
    repo = TopologyRepo(env.store, GraphConfig(link_max_age_s=30.0), clock=env.clock)
    assert await repo.collect_stale_links() == 1
    assert await env.store.get(keys.link_key("a", "b")) is None
    assert await env.store.get(keys.link_key("b", "a")) is not None


async def _next(stream: AsyncIterator[topology_pb2.WatchTopologyResponse]) -> topology_pb2.WatchTopologyResponse:
    return await asyncio.wait_for(stream.__anext__(), 10)


async def test_watch_streams_changes_and_cluster_removal(env: Env) -> None:
    for c in ("a", "b"):
        await env.register(c)
        await env.profile(c)
    call = env.stub.WatchTopology(topology_pb2.WatchTopologyRequest(from_revision=0))
    stream = call.__aiter__()
    first = await _next(stream)
    assert first.resync and [c.name for c in first.snapshot.clusters] == ["a", "b"]
    resp = await env.links("a", ("b", 3.0, 7.0))
    msg = await _next(stream)
    assert msg.revision == resp.revision and not msg.resync
    assert [(c.kind, c.link.a, c.link.b, c.link.bandwidth_gbps) for c in msg.changes] == [
        (topology_pb2.TopologyChange.KIND_LINK_UPSERTED, "a", "b", 3.0)]
    # The agent of b goes away: its cluster and the links touching it are removed.
    await env.leases["b"].revoke()
    msg = await _next(stream)
    kinds = sorted((c.kind, c.cluster.name or c.link.a) for c in msg.changes)
    assert kinds == [(topology_pb2.TopologyChange.KIND_CLUSTER_REMOVED, "b"),
                     (topology_pb2.TopologyChange.KIND_LINK_REMOVED, "a")]
    # Resuming from the last revision with no change since: no resync, just new changes.
    call.cancel()
    call2 = env.stub.WatchTopology(topology_pb2.WatchTopologyRequest(from_revision=msg.revision))
    stream2 = call2.__aiter__()
    await call2.initial_metadata()  # the stream is established
    await env.profile("a", free_gpus=2)
    msg2 = await _next(stream2)
    assert not msg2.resync
    assert [(c.kind, c.cluster.name, c.cluster.free_gpus) for c in msg2.changes] == [
        (topology_pb2.TopologyChange.KIND_CLUSTER_UPSERTED, "a", 2)]
    call2.cancel()
    # Resuming from an older revision after changes: a resync snapshot first.
    call3 = env.stub.WatchTopology(topology_pb2.WatchTopologyRequest(from_revision=msg.revision))
    stream3 = call3.__aiter__()
    msg3 = await _next(stream3)
    assert msg3.resync and [c.name for c in msg3.snapshot.clusters] == ["a"]
    assert msg3.snapshot.clusters[0].free_gpus == 2
    call3.cancel()


async def test_watch_resyncs_after_compaction(env: Env) -> None:
    await env.register("a")
    await env.profile("a")
    old = await env.store.revision()
    await env.profile("a", free_gpus=1)
    await env.profile("a", free_gpus=3)
    await env.store.compact(await env.store.revision())
    call = env.stub.WatchTopology(topology_pb2.WatchTopologyRequest(from_revision=old))
    msg = await _next(call.__aiter__())
    assert msg.resync and msg.snapshot.clusters[0].free_gpus == 3
    call.cancel()


async def test_watch_reports_link_ageing(env: Env) -> None:
    for c in ("a", "b"):
        await env.register(c)
        await env.profile(c)
    await env.links("a", ("b", 3.0, 7.0))
    call = env.stub.WatchTopology(topology_pb2.WatchTopologyRequest(from_revision=0, full_snapshots=True))
    stream = call.__aiter__()
    assert len((await _next(stream)).snapshot.links) == 1
    env.clock.now += 31
    msg = await _next(stream)  # within one tick, no key changed
    assert [(c.kind, c.link.a, c.link.b) for c in msg.changes] == [
        (topology_pb2.TopologyChange.KIND_LINK_REMOVED, "a", "b")]
    assert len(msg.snapshot.links) == 0
    call.cancel()


async def test_a_view_kept_from_the_stream_matches_snapshots(env: Env) -> None:
    for c in ("a", "b", "c"):
        await env.register(c)
    await env.profile("a")
    call = env.stub.WatchTopology(topology_pb2.WatchTopologyRequest(from_revision=0))
    stream = call.__aiter__()
    first = await _next(stream)
    view = convert.topology_from_proto(first.snapshot)
    await env.profile("b")
    await env.profile("c", gpu="H100-80G")
    await env.links("a", ("b", 1.0, 2.0), ("c", 5.0, 1.0))
    await env.links("c", ("a", 4.0, 1.0))
    await env.profile("b", free_gpus=1)
    await env.leases["c"].revoke()
    await env.links("b", ("a", 2.0, 2.0))
    final = await env.store.revision()
    while view.revision < final:
        msg = await _next(stream)
        view = apply_changes(view, [change_from_proto(c) for c in msg.changes], revision=msg.revision)
    call.cancel()
    snap = convert.topology_from_proto((await env.topology()).topology)
    assert view.clusters == snap.clusters and view.links == snap.links
    assert view.names == ("a", "b") and set(view.direct) == {("a", "b"), ("b", "a")}


async def test_any_replica_answers(env: Env, etcd: EtcdProcess) -> None:
    """Two service instances over one etcd: a report through one is visible through the other."""
    store = EtcdStore(etcd.endpoint)
    other = await serve([TopologyService(store, TopologyRepo(store, GraphConfig(), clock=env.clock))],
                        host="127.0.0.1", port=0)
    channel = open_channel(other.address)
    try:
        await env.register("a")
        rev = await env.profile("a")
        resp = await topology_pb2_grpc.TopologyStub(channel).GetTopology(topology_pb2.GetTopologyRequest())
        assert [c.name for c in resp.topology.clusters] == ["a"] and resp.topology.revision >= rev
    finally:
        await channel.close()
        await other.stop(grace_s=0)
        await store.close()
