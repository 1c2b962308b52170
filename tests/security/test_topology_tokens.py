"""Agent identity on the topology path with bearer tokens only (``--tokens``, plaintext, no certificates),
with the topology service as a real process over a real etcd.

The token file binds each token to a principal; an ``agent:<cluster>`` token may report only about that
cluster, whatever ``agent_id`` the request claims: a report about another cluster is PERMISSION_DENIED
even when it names that cluster's registered agent id (which is all an unauthenticated service can check).
The clusters are registered in etcd as agents without certificates register them (principal = the agent's
instance id, under a lease); the reports are sent as an agent sends them, plus the bearer token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

from agent.registration import Registration
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.security.auth import bearer_metadata
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

TOKENS = {
    "virginia-token-0123456789": "agent:virginia",
    "ohio-token-0123456789abc": "agent:ohio",
    "alice-token-0123456789ab": "tenant:alice",
    "admin-token-0123456789ab": "admin:ops",
    "oregon-token-0123456789a": "agent:oregon",
}
VIRGINIA, OHIO, ALICE, ADMIN, OREGON = TOKENS


@pytest.fixture(scope="module")
def topology(module_etcd: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("topology-tokens")
    tokens = d / "tokens.yaml"
    tokens.write_text("tokens:\n" + "".join(f"  {t}: {p}\n" for t, p in TOKENS.items()))
    service = ManagedProcess("topology", spiderflow_argv(
        "serve", "topology", "--listen", "127.0.0.1:0", "--etcd", module_etcd.endpoint, "--tokens", str(tokens),
        "--log-format", "json",
    ), log_dir=d).start(timeout=60)
    try:
        yield service.address
    finally:
        service.stop()


@pytest.fixture
async def registered(module_etcd: EtcdProcess) -> AsyncIterator[dict[str, str]]:
    """virginia and ohio registered by their agents (no certificates: principal = agent id); cluster → agent
    id."""
    store = EtcdStore(module_etcd.endpoint)
    ids = {"virginia": "virginia-7f3a", "ohio": "ohio-1c2d"}
    leases = []
    try:
        for cluster, agent_id in ids.items():
            lease = await store.grant(30)
            leases.append(lease)
            reg = Registration(cluster=cluster, agent_id=agent_id, principal=agent_id, address="127.0.0.1:1")
            await store.put(keys.cluster_key(cluster), reg.encode(), lease=lease)
        yield ids
    finally:
        for lease in leases:
            await lease.revoke()
        await store.close()


def _profile(cluster: str, agent_id: str) -> topology_pb2.ReportProfileRequest:
    msg = types_pb2.Cluster(name=cluster, gpu="A100-80G", nodes=1, gpus_per_node=8, free_gpus=8, tflops=250.0)
    return topology_pb2.ReportProfileRequest(cluster=msg, agent_id=agent_id, agent_address="127.0.0.1:1")


def _links(cluster: str, agent_id: str, target: str) -> topology_pb2.ReportLinksRequest:
    return topology_pb2.ReportLinksRequest(cluster=cluster, agent_id=agent_id, measurements=[
        topology_pb2.LinkMeasurement(target=target, bandwidth_gbps=1.0, latency_ms=10.0, probe_bytes=1 << 20,
                                     rtt_samples=3)])


async def _code(call: Any, request: Any, token: str | None) -> grpc.StatusCode:
    try:
        await call(request, timeout=5, metadata=bearer_metadata(token))
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_agent_tokens_report_only_about_their_own_cluster(topology: str, registered: dict[str, str]) -> None:
    ohio_id, virginia_id = registered["ohio"], registered["virginia"]
    async with open_channel(topology) as ch:
        stub: Any = topology_pb2_grpc.TopologyStub(ch)  # type: ignore[no-untyped-call]
        Code = grpc.StatusCode
        # Each agent reports about its own cluster.
        assert await _code(stub.ReportProfile, _profile("virginia", virginia_id), VIRGINIA) is Code.OK
        assert await _code(stub.ReportProfile, _profile("ohio", ohio_id), OHIO) is Code.OK
        assert await _code(stub.ReportLinks, _links("virginia", virginia_id, "ohio"), VIRGINIA) is Code.OK
        # virginia's token claiming to be ohio's registered agent: refused (the token decides, not agent_id).
        assert await _code(stub.ReportProfile, _profile("ohio", ohio_id), VIRGINIA) is Code.PERMISSION_DENIED
        assert await _code(stub.ReportLinks, _links("ohio", ohio_id, "virginia"), VIRGINIA) \
            is Code.PERMISSION_DENIED
        # Not an agent: refused; no token or an unknown one: unauthenticated.
        for token in (ALICE, ADMIN):
            assert await _code(stub.ReportProfile, _profile("virginia", virginia_id), token) \
                is Code.PERMISSION_DENIED
        assert await _code(stub.ReportProfile, _profile("virginia", virginia_id), None) is Code.UNAUTHENTICATED
        assert await _code(stub.ReportProfile, _profile("virginia", virginia_id), "forged-token-0123456789") \
            is Code.UNAUTHENTICATED
        # A cluster nobody registered cannot be reported into existence, even by its own agent's token.
        assert await _code(stub.ReportProfile, _profile("oregon", "oregon-1"), OREGON) is Code.INVALID_ARGUMENT
        resp = await stub.GetTopology(topology_pb2.GetTopologyRequest(), timeout=5,
                                      metadata=bearer_metadata(ADMIN))
    ohio = next(c for c in resp.topology.clusters if c.name == "ohio")
    assert ohio.free_gpus == 8
    status = {s.name: s.agent_id for s in resp.cluster_status}
    assert status == {"virginia": virginia_id, "ohio": ohio_id}  # the refused reports changed nothing
    assert [(link.a, link.b) for link in resp.topology.links] == [("virginia", "ohio")]
