"""Agents as objects in this process against a real etcd and a real Topology server: registration,
discovery, probe rounds, the busy hook (no bulk probes while training, links stay fresh) and clean
deregistration."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import structlog

from agent.agent import Agent
from agent.config import AgentConfig, load_config
from agent.profiler import DeviceProfile
from services.topology.graph import GraphConfig
from services.topology.repo import TopologyRepo
from services.topology.service import TopologyService
from spiderflow.core.errors import ValidationError
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.rpc.server import open_channel, serve
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess, free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def topology(etcd: EtcdProcess) -> AsyncIterator[tuple[str, TopologyRepo]]:
    store = EtcdStore(etcd.endpoint)
    repo = TopologyRepo(store, GraphConfig(link_max_age_s=30.0))
    server = await serve([TopologyService(store, repo)], host="127.0.0.1", port=0)
    try:
        yield server.address, repo
    finally:
        await server.stop(grace_s=0)
        await store.close()


def _agent(name: str, topo: str, etcd: EtcdProcess) -> Agent:
    cfg = load_config(None, {
        "cluster": name, "topology_service": topo, "etcd": etcd.endpoint, "lease_ttl_s": 2,
        "gpus": {"gpu": "A100-80G", "nodes": 1, "gpus_per_node": 8},
        "probe": {"period_s": 60.0, "bulk_bytes": 256 * 1024, "chunk_bytes": 64 * 1024, "echo_count": 3},
    })
    return Agent(cfg)


async def test_probe_rounds_and_busy_hook(topology: tuple[str, TopologyRepo], etcd: EtcdProcess) -> None:
    address, repo = topology
    a, b = _agent("a", address, etcd), _agent("b", address, etcd)
    stop = asyncio.Event()
    runs = []
    for ag in (a, b):
        await ag.start()
        runs.append(asyncio.create_task(ag.run(stop)))
    try:
        for ag in (a, b):
            await asyncio.wait_for(ag.registered.wait(), 10)
        for _ in range(100):  # both profiles reported
            snap = await repo.snapshot()
            if len(snap.topology.clusters) == 2:
                break
            await asyncio.sleep(0.1)
        assert snap.topology.names == ("a", "b")
        await _links_appear(repo, {("a", "b"), ("b", "a")})  # the automatic probes of a new peer, done first
        results = await a.probe_round()
        assert [r.peer for r in results] == ["b"] and results[0].bandwidth_gbps and results[0].probe_bytes > 0
        await b.probe_round()
        topo = (await repo.snapshot()).topology
        assert set(topo.direct) == {("a", "b"), ("b", "a")}
        bw = topo.direct[("a", "b")].bandwidth_gbps
        # Training on a: a sends no bulk probe, and refuses b's; both links stay fresh (latency only).
        a.set_busy(True)
        ra = await a.probe_round()
        rb = await b.probe_round()
        assert ra[0].bandwidth_gbps is None and ra[0].probe_bytes == 0
        assert rb[0].bandwidth_gbps is None and rb[0].probe_bytes == 0
        after = await repo.snapshot()
        assert after.topology.direct[("a", "b")].bandwidth_gbps == pytest.approx(bw)
        channel = open_channel(a.address)
        status = await agent_pb2_grpc.AgentStub(channel).GetStatus(agent_pb2.GetStatusRequest())
        await channel.close()
        assert status.training and status.agent_id == a.agent_id and [p.peer for p in status.probes] == ["b"]
        assert status.cluster.gpu == "A100-80G"
        a.set_busy(False)
        assert (await a.probe_round())[0].probe_bytes > 0
    finally:
        stop.set()
        for t in runs:
            with contextlib.suppress(BaseException):
                await t
    # Stopping revokes the leases: the registrations are gone at once.
    assert await repo.store.get(keys.cluster_key("a")) is None
    assert await repo.store.get(keys.cluster_key("b")) is None


async def _links_appear(repo: TopologyRepo, links: set[tuple[str, str]], within_s: float = 10.0) -> float:
    """Seconds until the graph holds every directed link of ``links`` (fails after ``within_s``)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < within_s:
        if links <= set((await repo.snapshot()).topology.direct):
            return loop.time() - t0
        await asyncio.sleep(0.05)
    raise AssertionError(f"links {sorted(links)} not in the graph within {within_s} s: "
                         f"{sorted((await repo.snapshot()).topology.direct)}")


async def test_a_peer_that_registers_later_is_probed_at_once(
    topology: tuple[str, TopologyRepo], etcd: EtcdProcess
) -> None:
    """The probe period is 60 s: a's link to b can appear within seconds only because a probes a peer it
    has no measurement of as soon as that peer registers (b's first round covers b → a)."""
    address, repo = topology
    a, b = _agent("a", address, etcd), _agent("b", address, etcd)
    stop = asyncio.Event()
    runs = []
    try:
        await a.start()
        runs.append(asyncio.create_task(a.run(stop)))
        await asyncio.wait_for(a.registered.wait(), 10)
        await asyncio.sleep(1.0)  # a's first full round found no peer; the next is 60 s away
        assert not (await repo.snapshot()).topology.direct
        await b.start()
        runs.append(asyncio.create_task(b.run(stop)))
        await asyncio.wait_for(b.registered.wait(), 10)
        assert await _links_appear(repo, {("a", "b"), ("b", "a")}) < 10.0
        assert a.status().probes[0].peer == "b"
    finally:
        stop.set()
        for t in runs:
            with contextlib.suppress(BaseException):
                await t


async def test_agent_registers_again_when_its_registration_disappears(
    topology: tuple[str, TopologyRepo], etcd: EtcdProcess
) -> None:
    address, repo = topology
    a = _agent("a", address, etcd)
    stop = asyncio.Event()
    await a.start()
    run = asyncio.create_task(a.run(stop))
    try:
        await asyncio.wait_for(a.registered.wait(), 10)
        first = await repo.store.get(keys.cluster_key("a"))
        assert first is not None and first.lease
        await repo.store.delete(keys.cluster_key("a"))  # e.g. an operator's mistake, or a restored etcd
        for _ in range(100):
            again = await repo.store.get(keys.cluster_key("a"))
            if again is not None:
                break
            await asyncio.sleep(0.05)
        assert again is not None and again.lease and again.lease != first.lease
        assert again.value == first.value
    finally:
        stop.set()
        with contextlib.suppress(BaseException):
            await run


async def test_agent_registers_again_after_losing_its_lease() -> None:
    """A store outage longer than the TTL loses the lease (the key expires); once the store is back the
    agent registers again with a new lease and re-sends its profile (MemoryStore fault injection)."""
    from spiderflow.store.memory import MemoryStore

    store = MemoryStore(request_timeout=0.5)
    repo = TopologyRepo(store, GraphConfig())
    server = await serve([TopologyService(store, repo)], host="127.0.0.1", port=0)
    cfg = load_config(None, {"cluster": "a", "topology_service": server.address, "etcd": "127.0.0.1:1",
                             "lease_ttl_s": 1, "gpus": {"gpu": "A100-80G", "nodes": 1, "gpus_per_node": 8},
                             "probe": {"period_s": 60.0}})
    agent = Agent(cfg, store_factory=lambda _endpoint: store)
    stop = asyncio.Event()
    await agent.start()
    run = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        first = await store.get(keys.cluster_key("a"))
        assert first is not None
        store.set_available(False)
        for _ in range(100):
            if not agent.registered.is_set():
                break
            await asyncio.sleep(0.05)
        assert not agent.registered.is_set()
        store.set_available(True)
        await asyncio.wait_for(agent.registered.wait(), 10)
        again = await store.get(keys.cluster_key("a"))
        assert again is not None and again.lease != first.lease
        for _ in range(100):
            if (await repo.snapshot()).topology.names == ("a",):
                break
            await asyncio.sleep(0.05)
        assert (await repo.snapshot()).topology.names == ("a",)
    finally:
        stop.set()
        with contextlib.suppress(BaseException):
            await run
        await server.stop(grace_s=0)


async def test_an_unreachable_etcd_is_retried_every_second_with_one_warning_per_30_s() -> None:
    cfg = load_config(None, {
        "cluster": "lonely", "topology_service": f"127.0.0.1:{free_port()}", "etcd": f"127.0.0.1:{free_port()}",
        "lease_ttl_s": 2, "gpus": {"gpu": "A100-80G", "nodes": 1, "gpus_per_node": 8},
    })
    ag = Agent(cfg)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        await ag.start()
        run = asyncio.create_task(ag.run(stop))
        await asyncio.sleep(3.5)
        stop.set()
        await asyncio.wait_for(run, 10)
    failed = [e for e in logs if e["event"] == "agent.register_failed"]
    assert len(failed) == 1 and failed[0]["attempts"] == 1 and not ag.registered.is_set()


class _Rates:
    """A measurement that reports 1, 2, 3 … TFLOPS in turn; ``during`` runs inside each measurement."""

    def __init__(self) -> None:
        self.calls = 0
        self.during: Callable[[], None] = lambda: None

    def __call__(self, _config: AgentConfig) -> DeviceProfile:
        self.calls += 1
        self.during()
        return DeviceProfile(gpu="cpu", count=1, memory_gib=4.0, tflops=float(self.calls), device_name="test",
                             mfu=0.5, layer_overhead_ms=0.1 * self.calls)


def _measured_agent(topo: str, etcd: EtcdProcess, rates: _Rates, **extra: object) -> Agent:
    cfg = load_config(None, {"cluster": "m", "topology_service": topo, "etcd": etcd.endpoint, "lease_ttl_s": 2,
                             "probe": {"period_s": 60.0}, **extra})
    return Agent(cfg, measure=rates)


@contextlib.asynccontextmanager
async def _running(agent: Agent) -> AsyncIterator[Agent]:
    """``agent`` started and running until the block ends."""
    stop = asyncio.Event()
    await agent.start()
    run = asyncio.create_task(agent.run(stop))
    try:
        yield agent
    finally:
        stop.set()
        with contextlib.suppress(BaseException):
            await run


async def _reported_tflops(repo: TopologyRepo, value: float, within_s: float = 10.0) -> None:
    for _ in range(int(within_s / 0.05)):
        snap = await repo.snapshot()
        if snap.topology.clusters and snap.topology.cluster("m").tflops == value:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"tflops {value} not reported: {(await repo.snapshot()).topology.clusters}")


async def test_recalibration_on_request_reports_the_new_figures(
    topology: tuple[str, TopologyRepo], etcd: EtcdProcess
) -> None:
    address, repo = topology
    rates = _Rates()
    async with _running(_measured_agent(address, etcd, rates)) as agent:
        await _reported_tflops(repo, 1.0)  # the measurement at start
        agent.request_recalibration()
        await _reported_tflops(repo, 2.0)
        assert agent.cluster is not None and agent.cluster.layer_overhead_ms == pytest.approx(0.2)
        # while the cluster trains, a request waits for the next idle moment
        agent.set_busy(True)
        agent.request_recalibration()
        await asyncio.sleep(0.3)
        assert rates.calls == 2
        agent.set_busy(False)
        await _reported_tflops(repo, 3.0)


async def test_a_measurement_overlapped_by_a_job_is_discarded(
    topology: tuple[str, TopologyRepo], etcd: EtcdProcess
) -> None:
    address, _ = topology
    rates = _Rates()
    agent = _measured_agent(address, etcd, rates)
    await agent.start()
    try:
        loop = asyncio.get_running_loop()
        rates.during = lambda: asyncio.run_coroutine_threadsafe(_busy(agent), loop).result(5)
        assert await agent.recalibrate() is False  # the job started while measuring
        assert rates.calls == 2 and agent.cluster is not None and agent.cluster.tflops == 1.0
        assert await agent.recalibrate() is False  # and nothing is measured while it runs
        assert rates.calls == 2
        rates.during = lambda: None
        agent.set_busy(False)
        assert await agent.recalibrate() is True and agent.cluster.tflops == 3.0
    finally:
        await agent.close()


async def _busy(agent: Agent) -> None:
    agent.set_busy(True)


async def test_recalibration_interval_remeasures_while_idle(
    topology: tuple[str, TopologyRepo], etcd: EtcdProcess
) -> None:
    address, repo = topology
    rates = _Rates()
    async with _running(_measured_agent(address, etcd, rates, recalibrate_interval_s=0.2)):
        await _reported_tflops(repo, 3.0)


def test_recalibration_interval_is_validated() -> None:
    with pytest.raises(ValidationError, match="recalibrate_interval_s"):
        load_config(None, {"cluster": "m", "topology_service": "127.0.0.1:1", "etcd": "127.0.0.1:2",
                           "recalibrate_interval_s": -1})


async def test_a_request_made_while_measuring_at_start_is_answered_by_that_measurement(
    topology: tuple[str, TopologyRepo], etcd: EtcdProcess
) -> None:
    address, repo = topology
    rates = _Rates()
    agent = _measured_agent(address, etcd, rates)
    loop = asyncio.get_running_loop()
    # a SIGHUP while the agent measures at start (the signal handler runs on the loop)
    rates.during = lambda: asyncio.run_coroutine_threadsafe(_request(agent), loop).result(5)
    async with _running(agent):
        rates.during = lambda: None
        await _reported_tflops(repo, 1.0)
        await asyncio.sleep(0.3)
        assert rates.calls == 1


async def _request(agent: Agent) -> None:
    agent.request_recalibration()
