"""mTLS on the topology path with real processes: the topology service started with ``--tls-dir``, an agent
with its cluster's certificate; plaintext clients are refused and an agent certificate may report only about
its own cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc.server import open_channel
from spiderflow.security.tls import channel_credentials
from spiderflow.store.process import EtcdProcess


@pytest.fixture(scope="module")
def topology(module_etcd: EtcdProcess, certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("topology-mtls-logs")
    service = ManagedProcess("topology", spiderflow_argv(
        "serve", "topology", "--listen", "127.0.0.1:0", "--etcd", module_etcd.endpoint,
        "--tls-dir", str(certs / "topology"), "--log-format", "json",
    ), log_dir=logs).start(timeout=60)
    agent: ManagedProcess | None = None
    try:
        agent = ManagedProcess("agent-virginia", spiderflow_argv(
            "agent", "--cluster", "virginia", "--topology-service", service.address, "--etcd", module_etcd.endpoint,
            "--tls-dir", str(certs / "agent-virginia"), "--gpu", "A100-80G", "--nodes", "1", "--gpus-per-node", "2",
            "--probe-period", "1", "--profile-interval", "1", "--log-format", "json",
        ), log_dir=logs).start(timeout=60)
        yield service.address
    finally:
        if agent is not None:
            agent.stop()
        service.stop()


async def _topology(address: str, bundle: Path | None) -> Any:
    ch = open_channel(address, credentials=channel_credentials(bundle) if bundle else None)
    try:
        stub: Any = topology_pb2_grpc.TopologyStub(ch)  # type: ignore[no-untyped-call]
        return await stub.GetTopology(topology_pb2.GetTopologyRequest(), timeout=5)
    finally:
        await ch.close()


def test_agent_reports_over_mtls(topology: str, certs: Path) -> None:
    deadline = time.monotonic() + 30
    names: list[str] = []
    while time.monotonic() < deadline:
        resp = asyncio.run(_topology(topology, certs / "scheduler"))
        names = [c.name for c in resp.topology.clusters]
        if "virginia" in names:
            break
        time.sleep(0.2)
    assert "virginia" in names


def test_plaintext_client_is_refused(topology: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_topology(topology, None))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_agent_certificate_reports_only_its_own_cluster(topology: str, certs: Path) -> None:
    async def go() -> None:
        resp = await _topology(topology, certs / "scheduler")
        virginia = next(c for c in resp.topology.clusters if c.name == "virginia")
        other = topology_pb2.ReportProfileRequest(agent_id="ohio-1", agent_address="127.0.0.1:1")
        other.cluster.CopyFrom(virginia)
        other.cluster.name = "ohio"
        ch = open_channel(topology, credentials=channel_credentials(certs / "agent-virginia"))
        try:
            stub: Any = topology_pb2_grpc.TopologyStub(ch)  # type: ignore[no-untyped-call]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ReportProfile(other, timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ReportLinks(topology_pb2.ReportLinksRequest(cluster="ohio", agent_id="ohio-1"), timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            await ch.close()

    test_agent_reports_over_mtls(topology, certs)
    asyncio.run(go())
