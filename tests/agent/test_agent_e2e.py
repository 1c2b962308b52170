"""End to end on loopback with real processes: etcd, ``spiderflow serve topology`` and several
``spiderflow agent`` processes. Agents discover each other and their probed links appear; ``topology
show`` prints them (table and ``--json``); an agent killed with SIGKILL leaves the graph within its
lease TTL and comes back when restarted. Loopback figures are large and noisy, so links are checked
for presence and sanity, not for values."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spiderflow.core.domain import Topology
from spiderflow.formats import topology_from_dict
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc import convert
from spiderflow.rpc.server import open_channel
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
TTL = 2
CLI = [sys.executable, "-m", "spiderflow.cli.main"]
FAST_PROBES = ["--probe-period", "1", "--probe-bytes", "262144", "--probe-chunk-bytes", "65536",
               "--probe-max-s", "1", "--probe-echoes", "3", "--lease-ttl", str(TTL)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["SPIDERFLOW_LOG_FORMAT"] = "json"
    return env


class Procs:
    """Processes started by a test; all of them are killed and reaped afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], timeout: float = 30.0) -> dict[str, object]:
        ready = self.tmp / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        log = (self.tmp / f"{name}.log").open("ab")
        proc = subprocess.Popen([*CLI, *args, "--ready-file", str(ready)], cwd=ROOT, env=_env(),
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = proc
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready.exists():
                return dict(json.loads(ready.read_text()))
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}: {self.log(name)[-2000:]}")
            time.sleep(0.05)
        raise AssertionError(f"{name} not ready after {timeout} s: {self.log(name)[-2000:]}")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout=10)

    def close(self) -> None:
        for name in list(self.procs):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def service(procs: Procs, etcd: EtcdProcess) -> str:
    ready = procs.start("topology", ["serve", "topology", "--listen", "127.0.0.1:0", "--etcd", etcd.endpoint,
                                     "--link-max-age", "30"])
    return str(ready["address"])


def _agent_args(name: str, service: str, etcd: EtcdProcess, *, declared: bool = True) -> list[str]:
    args = ["agent", "--cluster", name, "--topology-service", service, "--etcd", etcd.endpoint,
            "--listen", "127.0.0.1:0", *FAST_PROBES]
    if declared:
        args += ["--gpu", "A100-80G", "--nodes", "1", "--gpus-per-node", "8", "--free-gpus", "6"]
    else:
        args += ["--profile-seconds", "0.2"]
    return args


async def _snapshot(address: str) -> Topology:
    channel = open_channel(address)
    try:
        resp = await topology_pb2_grpc.TopologyStub(channel).GetTopology(topology_pb2.GetTopologyRequest(), timeout=5)
    finally:
        await channel.close()
    if not resp.topology.clusters:
        return Topology(clusters=(), revision=resp.topology.revision)
    return convert.topology_from_proto(resp.topology)


async def _wait_for(address: str, pred: Callable[[Topology], bool], timeout: float) -> Topology:
    deadline = time.monotonic() + timeout
    while True:
        topo = await _snapshot(address)
        if pred(topo):
            return topo
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s; last snapshot {topo}")
        await asyncio.sleep(0.2)


async def test_agents_discover_each_other_and_links_appear(procs: Procs, service: str, etcd: EtcdProcess) -> None:
    procs.start("agent-a", _agent_args("a", service, etcd))
    procs.start("agent-b", _agent_args("b", service, etcd))
    procs.start("agent-c", _agent_args("c", service, etcd, declared=False), timeout=60)  # measures the CPU
    topo = await _wait_for(service, lambda t: len(t.clusters) == 3 and len(t.links) == 6, 45)
    assert topo.names == ("a", "b", "c") and topo.revision > 0
    for link in topo.links:
        assert link.directed
        assert 0.001 < link.bandwidth_gbps < 10_000 and math.isfinite(link.bandwidth_gbps)
        assert 0 <= link.latency_ms < 1_000
    a, c = topo.cluster("a"), topo.cluster("c")
    assert (a.gpu, a.total_gpus, a.free) == ("A100-80G", 8, 6)
    assert c.gpu == "cpu" and c.tflops is not None and c.tflops > 0  # measured, not the catalog's
    assert c.memory_gib is not None and c.memory_gib > 0.1
    # topology show: --json in the file format plus the revision, and the table; address from the env.
    env = {**_env(), "SPIDERFLOW_TOPOLOGY": service}
    out = subprocess.run([*CLI, "topology", "show", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    shown = topology_from_dict(doc)
    assert shown.names == ("a", "b", "c") and len(shown.links) >= 6 and doc["revision"] >= topo.revision
    table = subprocess.run([*CLI, "topology", "show"], cwd=ROOT, env={**env, "COLUMNS": "160"},
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0, table.stderr
    # a measured loopback link shows in Gbit/s or, on a loaded machine, in Mbit/s
    assert "A100-80G" in table.stdout and "bit/s" in table.stdout and "cpu" in table.stdout


async def test_killed_agent_leaves_within_ttl_and_comes_back(procs: Procs, service: str, etcd: EtcdProcess) -> None:
    procs.start("agent-a", _agent_args("a", service, etcd))
    procs.start("agent-b", _agent_args("b", service, etcd))
    await _wait_for(service, lambda t: len(t.clusters) == 2 and len(t.links) == 2, 30)
    channel = open_channel(service)
    try:
        call = topology_pb2_grpc.TopologyStub(channel).WatchTopology(topology_pb2.WatchTopologyRequest())
        stream = call.__aiter__()
        first = await asyncio.wait_for(stream.__anext__(), 10)
        assert first.resync and len(first.snapshot.clusters) == 2
        killed = time.monotonic()
        procs.kill("agent-b")
        removed_after = None
        while removed_after is None:
            msg = await asyncio.wait_for(stream.__anext__(), TTL + 5)
            for ch in msg.changes:
                if ch.kind == topology_pb2.TopologyChange.KIND_CLUSTER_REMOVED and ch.cluster.name == "b":
                    removed_after = time.monotonic() - killed
        # etcd expires the lease ≤ TTL after the last keep-alive (+ its 0.5 s expiry check); measured
        # 1.8-1.9 s with TTL 2. The slack covers delivery on a loaded machine.
        assert removed_after <= TTL + 1.0, removed_after
        topo = await _snapshot(service)
        assert topo.names == ("a",) and topo.links == ()
        procs.start("agent-b", _agent_args("b", service, etcd))
        back = False
        while not back:
            msg = await asyncio.wait_for(stream.__anext__(), 20)
            back = any(ch.kind == topology_pb2.TopologyChange.KIND_CLUSTER_UPSERTED and ch.cluster.name == "b"
                       for ch in msg.changes)
        call.cancel()
    finally:
        await channel.close()
    await _wait_for(service, lambda t: t.names == ("a", "b") and len(t.links) == 2, 30)
    # SIGTERM: the agent revokes its lease, so its cluster goes at once.
    procs.kill("agent-a", signal.SIGTERM)
    topo = await _wait_for(service, lambda t: t.names == ("b",), 2)
    assert topo.links == ()


async def test_sighup_remeasures_the_cpu_and_reports_it(procs: Procs, service: str, etcd: EtcdProcess) -> None:
    """``SIGHUP``: the agent calibrates its CPU again and the topology service carries the new figures. (The
    profile is re-sent every second: on a loaded machine the new TFLOPS may be more than 2× off the first,
    an outlier that the topology service takes once the next report agrees.)"""
    procs.start("agent-c", [*_agent_args("c", service, etcd, declared=False), "--profile-interval", "1"], timeout=60)
    first = (await _wait_for(service, lambda t: t.names == ("c",), 30)).cluster("c")
    procs.procs["agent-c"].send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    event: dict[str, object] | None = None
    while event is None:
        assert time.monotonic() < deadline, procs.log("agent-c")[-2000:]
        for line in procs.log("agent-c").splitlines():
            if '"agent.recalibrated"' in line:
                event = json.loads(line)
        await asyncio.sleep(0.2)
    assert event["previous_tflops"] == pytest.approx(first.tflops)
    now = await _wait_for(service, lambda t: t.cluster("c").tflops == pytest.approx(event["tflops"]), 10)
    assert now.cluster("c").mfu == pytest.approx(event["mfu"])
    assert procs.procs["agent-c"].poll() is None  # SIGHUP does not stop it
