"""Prometheus ``/metrics`` on every service and agent: the RPC interceptor in process, then real processes
(etcd, ``serve topology|planner|scheduler``, two agents on loopback) scraped over HTTP."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.planner.service import PlannerService
from spiderflow import metrics
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc.server import open_channel, serve
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "examples/topology-3.yaml"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _rpc_count(method: str, code: str) -> float:
    service, _, name = method.lstrip("/").rpartition("/")
    return metrics.REGISTRY.get_sample_value(
        "spiderflow_rpc_requests_total", {"service": service, "method": name, "code": code}) or 0.0


async def test_interceptor_counts_and_times_rpcs_by_method_and_code() -> None:
    server = await serve([PlannerService()], interceptors=[metrics.RpcMetricsInterceptor()])
    channel = open_channel(server.address)
    plan = "/spiderflow.planner.v1.Planner/Plan"
    check = "/grpc.health.v1.Health/Check"
    watch = "/grpc.health.v1.Health/Watch"
    try:
        before = (_rpc_count(plan, "INVALID_ARGUMENT"), _rpc_count(check, "OK"), _rpc_count(watch, "CANCELLED"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            planner: Any = planner_pb2_grpc.PlannerStub(channel)  # type: ignore[no-untyped-call]
            await planner.Plan(planner_pb2.PlanRequest(), timeout=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        health: Any = health_pb2_grpc.HealthStub(channel)
        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        call = health.Watch(health_pb2.HealthCheckRequest())
        await call.read()
        call.cancel()
        deadline = time.monotonic() + 5  # a call is recorded when its handler unwinds (after the status)
        while time.monotonic() < deadline and (_rpc_count(watch, "CANCELLED") == before[2]
                                               or _rpc_count(plan, "INVALID_ARGUMENT") == before[0]):
            await asyncio.sleep(0.05)
        assert _rpc_count(plan, "INVALID_ARGUMENT") == before[0] + 1
        assert _rpc_count(check, "OK") == before[1] + 1
        assert _rpc_count(watch, "CANCELLED") == before[2] + 1
        assert (metrics.REGISTRY.get_sample_value(
            "spiderflow_rpc_duration_seconds_count",
            {"service": "spiderflow.planner.v1.Planner", "method": "Plan", "code": "INVALID_ARGUMENT"}) or 0) >= 1
    finally:
        await channel.close()
        await server.stop(grace_s=0)


def test_metrics_server_serves_the_registry_and_validates_its_address() -> None:
    from spiderflow.core.errors import ValidationError

    assert metrics.start_metrics_server(None) is None
    with pytest.raises(ValidationError, match="--metrics-listen"):
        metrics.start_metrics_server("nonsense")
    server = metrics.start_metrics_server("127.0.0.1:0")
    assert server is not None
    try:
        metrics.observe_plan(0.25, strategy="chain", ok=True)
        body = urllib.request.urlopen(server.url, timeout=5).read().decode()
        assert "spiderflow_planner_plan_seconds_bucket" in body and "process_cpu_seconds_total" in body
    finally:
        server.close()


# ----------------------------------------------------------------------------- real processes
def _scrape(address: str) -> Samples:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _families(address: str) -> set[str]:
    """Names of the metric families ``address`` exposes, whether or not a labelled family has a sample yet
    (a counter by method and code has none until its first call)."""
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {family.name for family in text_string_to_metric_families(body)}


def _value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def _names(samples: Samples) -> set[str]:
    return {n for n, _ in samples}


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.etcd = EtcdProcess()
        self.procs: dict[str, ManagedProcess] = {}

    def start(self, name: str, *args: str) -> ManagedProcess:
        return self.start_all((name, args))[0]

    def start_all(self, *specs: tuple[str, tuple[str, ...]]) -> list[ManagedProcess]:
        """Spawn processes ``(name, args)`` side by side (their interpreter starts overlap), then wait for
        each to be ready."""
        spawned = []
        for name, args in specs:
            proc = ManagedProcess(name, spiderflow_argv(*args, "--log-format", "json", "--metrics-listen",
                                                        "127.0.0.1:0"), log_dir=self.tmp)
            self.procs[name] = proc.spawn()
            spawned.append(proc)
        for proc in spawned:
            proc.wait_ready(timeout=60)
        return spawned

    def metrics(self, name: str) -> str:
        return str(self.procs[name].ready_doc["metrics"])

    def close(self) -> None:
        for name, proc in self.procs.items():  # the agents stop side by side, then the services
            if name.startswith("agent-"):
                proc.signal(signal.SIGTERM)
        for proc in reversed(list(self.procs.values())):
            proc.stop(grace_s=5)
        self.etcd.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("obs"))
    try:
        s.etcd.start()
        etcd = s.etcd.endpoint
        topo, planner = s.start_all(("topology", ("serve", "topology", "--listen", "127.0.0.1:0", "--etcd", etcd)),
                                    ("planner", ("serve", "planner", "--listen", "127.0.0.1:0", "--insecure")))
        s.start("scheduler", "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd, "--topology",
                str(TOPOLOGY), "--planner", planner.address, "--executor", "sim", "--sim-min-s", "0.1",
                "--sim-max-s", "0.2", "--cycle-interval", "1", "--insecure")
        s.start_all(*((f"agent-{name}", (
            "agent", "--cluster", name, "--etcd", etcd, "--topology-service", topo.address, "--listen", "127.0.0.1:0",
            "--gpu", "A100-80G", "--nodes", "1", "--gpus-per-node", "8", "--probe-period", "1", "--probe-bytes",
            "262144", "--probe-chunk-bytes", "65536", "--probe-max-s", "1", "--probe-echoes", "3", "--lease-ttl", "2",
        )) for name in ("a", "b")))
        yield s
    finally:
        s.close()
    assert not any(p.alive() for p in s.procs.values()) and not s.etcd.running


def test_every_process_writes_its_metrics_address_into_the_ready_file(stack: Stack) -> None:
    for name, proc in stack.procs.items():
        host, _, port = str(proc.ready_doc.get("metrics", "")).rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0, (name, proc.ready_doc)
        # The RPC counter is registered before the first call arrives: an agent's first report may come
        # after this scrape, so the family is looked for, not a sample.
        assert "spiderflow_rpc_requests" in _families(stack.metrics(name)) or name != "topology"


async def test_topology_service_counts_rpcs_by_method_and_code(stack: Stack) -> None:
    topo = stack.procs["topology"]
    before = _scrape(stack.metrics("topology"))
    channel = open_channel(topo.address)
    try:
        stub: Any = topology_pb2_grpc.TopologyStub(channel)  # type: ignore[no-untyped-call]
        await stub.GetTopology(topology_pb2.GetTopologyRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReportLinks(topology_pb2.ReportLinksRequest(cluster="nowhere", agent_id="x"), timeout=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
    svc = "spiderflow.topology.v1.Topology"
    expected = [("GetTopology", "OK"), ("ReportLinks", "INVALID_ARGUMENT")]

    def count(samples: Samples, method: str, code: str) -> float:
        return _value(samples, "spiderflow_rpc_requests_total", service=svc, method=method, code=code)

    # An aborted call is recorded when its handler unwinds, which may be just after the client saw the
    # status, and the agents report their profiles after they are ready (a first report may not have come
    # yet): scrape until both calls and both agents' reports are in.
    deadline = time.monotonic() + 30
    while True:
        after = _scrape(stack.metrics("topology"))
        if (all(count(after, m, c) > count(before, m, c) for m, c in expected)
                and count(after, "ReportProfile", "OK") >= 2) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert count(after, "GetTopology", "OK") == count(before, "GetTopology", "OK") + 1  # only this test calls it
    assert count(after, "ReportLinks", "INVALID_ARGUMENT") >= count(before, "ReportLinks", "INVALID_ARGUMENT") + 1
    for method, code in expected:
        assert _value(after, "spiderflow_rpc_duration_seconds_count", service=svc, method=method, code=code) >= 1
    # Agents report to it: their calls are counted too.
    assert count(after, "ReportProfile", "OK") >= 2


async def test_scheduler_and_planner_record_placements_and_plan_times(stack: Stack) -> None:
    job = {"id": "obs-1", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1, "seq_len": 64, "steps": 3,
           "gpus": {"min": 1, "max": 4}, "tenant": "t"}
    from google.protobuf import json_format  # type: ignore[import-untyped]

    req = json_format.ParseDict({"request_id": "obs-req-1", "job": job}, scheduler_pb2.SubmitJobRequest())
    channel = open_channel(stack.procs["scheduler"].address)
    try:
        stub: Any = scheduler_pb2_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
        await stub.SubmitJob(req, timeout=10)
        deadline = time.monotonic() + 60
        while True:
            sched = _scrape(stack.metrics("scheduler"))
            if _value(sched, "spiderflow_scheduler_placements_total") >= 1:
                break
            assert time.monotonic() < deadline, "no placement recorded"
            await asyncio.sleep(0.3)
    finally:
        await channel.close()
    assert {"spiderflow_scheduler_queue_length", "spiderflow_scheduler_cycles_total",
            "spiderflow_scheduler_decisions_total", "spiderflow_scheduler_decision_seconds_bucket"} <= _names(sched)
    assert _value(sched, "spiderflow_scheduler_decision_seconds_count", kind="placed") >= 1
    assert _value(sched, "spiderflow_scheduler_decisions_total", kind="placed") >= 1
    assert _value(sched, "spiderflow_rpc_requests_total", method="SubmitJob", code="OK") >= 1
    plan = _scrape(stack.metrics("planner"))
    assert _value(plan, "spiderflow_planner_plan_seconds_count", strategy="allocation", outcome="planned") >= 1
    assert _value(plan, "spiderflow_rpc_requests_total", service="spiderflow.planner.v1.Planner", method="Plan",
                  code="OK") >= 1


async def test_agents_export_probe_results_per_peer(stack: Stack) -> None:
    deadline = time.monotonic() + 30
    while True:
        a = _scrape(stack.metrics("agent-a"))
        bw = _value(a, "spiderflow_agent_probe_bandwidth_gbps", cluster="a", peer="b")
        lat = [v for (n, ls), v in a.items() if n == "spiderflow_agent_probe_latency_ms"
               and dict(ls) == {"cluster": "a", "peer": "b"}]
        if bw > 0 and lat:
            break
        assert time.monotonic() < deadline, "no probe result exported"
        await asyncio.sleep(0.3)
    assert lat[0] >= 0
    assert _value(a, "spiderflow_agent_probes_total", cluster="a", peer="b", result="ok") >= 1
    # The agent's own gRPC service (probes served to its peer) is counted as well.
    assert _value(a, "spiderflow_rpc_requests_total", service="spiderflow.agent.v1.Agent", code="OK") >= 1
