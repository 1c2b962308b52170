"""Failovers that never strand a job: an agent's reports reach another scheduler replica when the one it
used dies (delivered at least once, applied once), and a job whose agents stopped reporting is re-placed
within the stated bound. Real etcd, real scheduler replicas serving mTLS on port 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.control import ReplicaReporter
from services.scheduler.cycle import SchedulingCycle
from services.scheduler.liveness import stale_bound
from services.scheduler.repo import JobRepository
from services.scheduler.service import SchedulerService
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.domain import Plan, Stage
from spiderflow.core.errors import UnavailableError, ValidationError
from spiderflow.formats import job_from_dict, load_topology
from spiderflow.jobs import JobState
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import RpcServer, serve
from spiderflow.security.auth import Authenticator, AuthInterceptor
from spiderflow.security.tls import server_credentials
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

ROOT = Path(__file__).resolve().parents[2]
STEPS = 50


@pytest.fixture
async def repo(module_etcd: EtcdProcess) -> AsyncIterator[JobRepository]:
    store = EtcdStore(module_etcd.endpoint)
    await store.delete_prefix(keys.ROOT)
    try:
        yield JobRepository(store)
    finally:
        await store.close()


async def _placed(repo: JobRepository, job_id: str = "alice~j") -> str:
    spec = job_from_dict({"id": job_id, "tenant": "alice", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64,
                          "steps": STEPS, "gpus": {"min": 1, "max": 1}})
    stored, _ = await repo.submit(spec, f"r-{job_id.replace('~', '-')}")
    plan = Plan(stages=(Stage(cluster="ohio", first_layer=0, last_layer=spec.model.layers - 1),), micro_batches=1,
                step_time_s=0.5)
    placed = stored.record.to(JobState.PLACED, "placed", now=repo.clock(), plan=plan,
                              allocation=plan.gpus_by_cluster(), attempt=1, policy="spinsearch", topology_revision=1)
    current, rev = await repo.allocation("ohio")
    await repo.bind(stored, placed, {"ohio": rev}, {"ohio": current})
    return spec.id


def _report(job: str, step: int, *, done: bool = False) -> scheduler_pb2.ReportProgressRequest:
    req = scheduler_pb2.ReportProgressRequest(job_id=job, attempt=1, cluster="ohio", progress=[
        types_pb2.ProgressEvent(step=step, steps_total=STEPS, loss=2.0, tokens_per_s=100.0, step_time_s=0.5)])
    if done:
        req.outcomes.append(scheduler_pb2.WorkerOutcome(stage=0, succeeded=True))
    return req


async def test_reports_go_to_another_replica_when_one_dies(repo: JobRepository, certs: Path) -> None:
    job = await _placed(repo)

    async def replica() -> RpcServer:
        return await serve([SchedulerService(repo)], credentials=server_credentials(certs / "scheduler"),
                           interceptors=[AuthInterceptor(Authenticator(certificates=True))])

    first, second = await replica(), await replica()
    reporter = ReplicaReporter([first.address, second.address], tls_dir=str(certs / "agent-ohio"), timeout_s=5,
                               backoff_s=0.05, give_up_s=20)
    try:
        assert await reporter.report(_report(job, 10)) == (True, False)
        assert reporter.current == first.address
        await first.stop(grace_s=0)  # the replica the agent talks to dies mid-job
        assert await reporter.report(_report(job, 20)) == (True, False)
        assert reporter.current == second.address
        assert await reporter.report(_report(job, STEPS, done=True)) == (True, True)
        # The outcome delivered again (the agent did not see the answer): applied once.
        assert await reporter.report(_report(job, STEPS, done=True)) == (False, True)
    finally:
        await reporter.close()
        await second.stop(grace_s=0)
    record = (await repo.get(job)).record
    assert record.state is JobState.SUCCEEDED and record.progress.step == STEPS
    assert [t.to_state for t in record.history].count(JobState.SUCCEEDED) == 1
    allocs, _, _ = await repo.allocations()
    assert allocs == {}  # no GPU held by the finished job
    # Every replica gone: the reporter gives up with UNAVAILABLE after its bound (the executor retries).
    gone = ReplicaReporter([first.address, second.address], timeout_s=1, backoff_s=0.05, give_up_s=1)
    try:
        with pytest.raises(UnavailableError, match="no scheduler replica"):
            await gone.report(_report(job, 1))
    finally:
        await gone.close()


async def test_a_job_whose_agents_stopped_reporting_is_re_placed(repo: JobRepository) -> None:
    now = [repo.clock()]
    silent = await _placed(repo, "alice~silent")
    alive = await _placed(repo, "alice~alive")
    cycle = SchedulingCycle(repo, StaticTopologySource(load_topology(ROOT / "examples/topology-3.yaml")),
                            default_policy="firstfit", clock=lambda: now[0], stale_s=5.0)
    bound = stale_bound((await repo.get(silent)).record, 5.0)
    assert bound == pytest.approx(5.0 + 3 * 0.5)
    # Within the bound: nothing happens.
    now[0] += bound - 1.0
    report = await cycle.run()
    assert not report.rescheduled
    # The live job's agent reports; the silent one's does not.
    rec = await repo.get(alive)
    await repo.update(rec, rec.record.to(JobState.RUNNING, "workers started", now=now[0]))
    now[0] += 2.0
    report = await cycle.run()
    assert report.rescheduled == [silent]
    record = (await repo.get(silent)).record  # re-placed (a new attempt) in the same cycle when GPUs allow
    assert any(t.to_state is JobState.RESCHEDULING and "no report from its agents" in t.reason
               for t in record.history)
    assert (await repo.get(alive)).record.state is JobState.RUNNING


async def test_an_etcd_blip_does_not_evict_a_healthy_cluster() -> None:
    """etcd stops for longer than the agent's lease TTL and comes back: etcd still holds the lease (it
    extends every lease when it elects a leader again), and the agent keeps its registration (moved to a new
    lease) instead of revoking it, so the cluster never leaves the topology."""
    import asyncio
    import contextlib

    from agent.agent import Agent
    from agent.config import load_config
    from services.topology.graph import GraphConfig
    from services.topology.repo import TopologyRepo
    from services.topology.service import TopologyService

    etcd = EtcdProcess()
    etcd.start()
    store = EtcdStore(etcd.endpoint)
    server = await serve([TopologyService(store, TopologyRepo(store, GraphConfig()))])
    cfg = load_config(None, {"cluster": "blip", "topology_service": server.address, "etcd": etcd.endpoint,
                             "lease_ttl_s": 2, "gpus": {"gpu": "A100-80G", "nodes": 1, "gpus_per_node": 8},
                             "probe": {"period_s": 60.0}})
    agent = Agent(cfg)
    stop = asyncio.Event()
    await agent.start()
    run = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(agent.registered.wait(), 20)
        first = await store.get(keys.cluster_key("blip"))
        assert first is not None
        etcd.stop()
        for _ in range(200):  # the agent notices (its keep-alive is not acknowledged within the TTL)
            if not agent.registered.is_set():
                break
            await asyncio.sleep(0.05)
        assert not agent.registered.is_set()
        etcd.start()
        await asyncio.wait_for(agent.registered.wait(), 30)
        now = await store.get(keys.cluster_key("blip"))
        # the same key all along (never deleted and created again), now under a new lease
        assert now is not None and now.create_revision == first.create_revision and now.lease != first.lease
    finally:
        stop.set()
        with contextlib.suppress(BaseException):
            await run
        await server.stop(grace_s=0)
        await store.close()
        etcd.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_replica_real_agents_talk_to_is_killed_mid_job(tmp_path: Path) -> None:
    """Real processes: etcd, the topology service, two scheduler replicas and an agent that knows both
    (``--scheduler LEADER,OTHER``) and holds no etcd credentials. The replica it talks to, the leader, is
    SIGKILLed once the job is placed (its workers starting or training): the agent's lease keep-alive,
    assignment watch, checkpoint commits and reports move to the other replica, which becomes leader, and the
    job completes in its first attempt with every step recorded exactly once and no GPU held afterwards."""
    import signal
    import time

    from spiderflow.procs import ManagedProcess, spiderflow_argv
    from spiderflow.sdk import Client

    steps = 16
    etcd = EtcdProcess()
    etcd.start()
    logs = tmp_path / "logs"
    procs: list[ManagedProcess] = []

    def start(name: str, *args: str) -> ManagedProcess:
        p = ManagedProcess(name, spiderflow_argv(*args, "--log-format", "json"), log_dir=logs).spawn()
        procs.append(p)
        return p

    topology = f"127.0.0.1:{_free_port()}"  # known before it listens: the three services start side by side
    try:
        services = [start("topology", "serve", "topology", "--listen", topology, "--etcd", etcd.endpoint)] + [
            start(name, "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd.endpoint,
                  "--topology-service", topology, "--lease-ttl", "2", "--cycle-interval", "1", "--policy", "firstfit")
            for name in ("scheduler-a", "scheduler-b")]
        for p in services:
            p.wait_ready(timeout=90)
        leader = asyncio.run(_leader(etcd.endpoint))
        talks_to = next(p for p in services[1:] if p.address == leader)
        other = next(p for p in services[1:] if p is not talks_to)
        agent = start("agent-ohio", "agent", "--cluster", "ohio", "--topology-service", topology,
                      "--scheduler", f"{talks_to.address},{other.address}", "--gpu", "cpu", "--nodes", "1",
                      "--gpus-per-node", "1", "--tflops", "0.05", "--memory-gib", "4", "--lease-ttl", "4",
                      "--checkpoint-every", "4", "--work-dir", str(tmp_path / "agent")).wait_ready(timeout=90)
        with Client(other.address, topology=topology, timeout_s=10) as sf:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the agent registered and profiled (an empty graph is an error)
                with contextlib.suppress(ValidationError):
                    if sf.topology().clusters:
                        break
                time.sleep(0.2)
            job = sf.submit({"id": "failover", "model": "gpt-tiny", "global_batch": 4, "seq_len": 32,
                             "steps": steps, "gpus": {"min": 1, "max": 1}}, request_id="failover-1").id
            # Kill once the job is placed: its workers are starting or training (starting them takes seconds,
            # so the job cannot have ended on a fast machine either, and a slow one is still mid-job).
            deadline = time.monotonic() + 120
            j = sf.get(job)
            while time.monotonic() < deadline and j.state not in ("PLACED", "RUNNING") and not j.done:
                time.sleep(0.05)
                j = sf.get(job)
            assert j.state in ("PLACED", "RUNNING") and j.progress.get("step", 0) < steps, (j.state, j.reason)
            talks_to.signal(signal.SIGKILL)  # the leader, and the replica the agent talks to, dies mid-job
            killed_at = int(j.progress.get("step", 0))
            deadline = time.monotonic() + 120
            while not j.done and time.monotonic() < deadline:
                time.sleep(0.2)
                j = sf.get(job)
            assert j.state == "SUCCEEDED", (j.state, j.reason, j.progress, agent.tail(20))
            assert j.attempt == 1 and j.progress["step"] == steps  # never re-placed
            assert [t.to_state for t in j.history].count("SUCCEEDED") == 1
            points = [(p.attempt, p.step) for p in sf.metrics(job).points]
            # every step recorded exactly once, before and after the kill (reports are delivered at least once
            # and applied once)
            assert sorted(points) == [(1, step) for step in range(1, steps + 1)], (killed_at, points)
            assert agent.alive()
        assert asyncio.run(_leader(etcd.endpoint, other_than=talks_to.address)) == other.address  # took over
        assert asyncio.run(_allocations(etcd.endpoint)) == {}  # no GPU held by the finished job
    finally:
        for p in reversed(procs):  # side by side: SIGTERM to every process, then wait for each
            with contextlib.suppress(Exception):
                p.signal(signal.SIGTERM)
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop(grace_s=5)
        etcd.close()


async def _leader(endpoint: str, *, other_than: str = "") -> str:
    """The scheduler leader's address (waiting up to 15 s for one, other than ``other_than``)."""
    store = EtcdStore(endpoint)
    try:
        for _ in range(150):
            info = await store.leader(keys.election_name(keys.SCHEDULER))
            if info is not None and info.value.decode() != other_than:
                return info.value.decode()
            await asyncio.sleep(0.1)
        raise AssertionError(f"no scheduler leader other than {other_than!r}")
    finally:
        await store.close()


async def _allocations(endpoint: str) -> dict[str, dict[str, int]]:
    store = EtcdStore(endpoint)
    try:
        allocs, _, _ = await JobRepository(store).allocations()
        return allocs
    finally:
        await store.close()
