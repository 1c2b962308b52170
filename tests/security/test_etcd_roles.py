"""Per-service etcd roles (``spiderflow.store.roles``): with etcd authentication on, the scheduler and the
topology service run as their own etcd users, each limited to its key prefixes, and do their work; each
is refused the other's keys. Real processes against a real etcd."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from security_harness import submit_tiny_job_to_success

from agent.registration import Registration
from agent.remote_store import RemoteStore
from spiderflow.core.errors import SpiderFlowError, ValidationError
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess
from spiderflow.store.roles import SERVICE_GRANTS, etcdctl_commands

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = {"root": "root-secret-pw", "scheduler": "sched-secret-pw", "topology": "topo-secret-pw"}


def _apply_roles(endpoint: str) -> None:
    """What ``etcdctl_commands`` spells, through etcd's Auth API (one connection, not one etcdctl per line):
    a root user, each service's role and user, then authentication on."""
    import aetcd.rpc as rpc
    import grpc

    from spiderflow.store.base import prefix_range_end

    perm = {"read": rpc.Permission.READ, "write": rpc.Permission.WRITE, "readwrite": rpc.Permission.READWRITE}
    with grpc.insecure_channel(endpoint) as ch:
        auth = rpc.AuthStub(ch)
        auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=PASSWORD["root"]), timeout=10)
        auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=10)
        auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
        for service, grants in SERVICE_GRANTS.items():
            auth.RoleAdd(rpc.AuthRoleAddRequest(name=service), timeout=10)
            for g in grants:
                key = g.prefix.encode()
                auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=service, perm=rpc.Permission(
                    key=key, range_end=prefix_range_end(key), permType=perm[g.access])), timeout=10)
            auth.UserAdd(rpc.AuthUserAddRequest(name=service, password=PASSWORD[service]), timeout=10)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=service, role=service), timeout=10)
        auth.AuthEnable(rpc.AuthEnableRequest(), timeout=10)


@pytest.fixture
def roles_etcd() -> Iterator[EtcdProcess]:
    proc = EtcdProcess()
    try:
        proc.start()
        _apply_roles(proc.endpoint)
        yield proc
    finally:
        proc.close()


def test_the_roles_as_etcdctl_commands() -> None:
    cmds = etcdctl_commands("topology", "pw")
    assert cmds[0] == ["role", "add", "topology"] and cmds[-2:] == [["user", "add", "topology:pw"],
                                                                     ["user", "grant-role", "topology", "topology"]]
    assert ["role", "grant-permission", "topology", "--prefix=true", "readwrite", keys.PROFILES] in cmds
    assert not any(keys.JOBS in c for c in cmds)
    with pytest.raises(ValidationError) as e:
        etcdctl_commands("planner", "pw")  # the planner holds no etcd credentials
    assert e.value.field == "service"


async def test_each_service_runs_as_its_own_etcd_user_limited_to_its_prefixes(roles_etcd: EtcdProcess,
                                                                              tmp_path: Path) -> None:
    etcd = roles_etcd.endpoint
    sched = ManagedProcess("sched", spiderflow_argv(
        "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd, "--etcd-user", "scheduler", "--topology",
        str(ROOT / "examples/topology-3.yaml"), "--executor", "sim", "--sim-min-s", "0.1", "--sim-max-s", "0.2",
        "--cycle-interval", "1", "--log-format", "json"), log_dir=tmp_path,
        env={"SPIDERFLOW_ETCD_PASSWORD": PASSWORD["scheduler"]}).spawn()
    topo = ManagedProcess("topo", spiderflow_argv(
        "serve", "topology", "--listen", "127.0.0.1:0", "--etcd", etcd, "--etcd-user", "topology",
        "--log-format", "json"), log_dir=tmp_path, env={"SPIDERFLOW_ETCD_PASSWORD": PASSWORD["topology"]}).spawn()
    try:
        sched.wait_ready(timeout=90)
        topo.wait_ready(timeout=90)
        # the scheduler: leader election, submissions, placement, the simulated run, releases
        await submit_tiny_job_to_success(sched.address, "roles-1")
        # ... and the agents' Control API: a lease, a registration under it, its keep-alive and revocation
        agent = RemoteStore(sched.address, cluster="ohio")
        try:
            lease = await agent.grant(5)
            reg = Registration(cluster="ohio", agent_id="ohio-1", principal="ohio-1", address="127.0.0.1:1")
            await agent.put_if_absent(keys.cluster_key("ohio"), reg.encode(), lease=lease)
            assert await lease.refresh() > 0
            # the topology service reads the registration and writes the profile
            ch = open_channel(topo.address)
            try:
                stub = topology_pb2_grpc.TopologyStub(ch)  # type: ignore[no-untyped-call]
                await stub.ReportProfile(topology_pb2.ReportProfileRequest(
                    agent_id="ohio-1", agent_address="127.0.0.1:1",
                    cluster=types_pb2.Cluster(name="ohio", gpu="A100-80G", nodes=1, gpus_per_node=2)), timeout=10)
                resp = await stub.GetTopology(topology_pb2.GetTopologyRequest(), timeout=10)
                assert [c.name for c in resp.topology.clusters] == ["ohio"]
            finally:
                await ch.close()
            await lease.revoke()
        finally:
            await agent.close()
    finally:
        for p in (sched, topo):
            p.signal(signal.SIGTERM)
        for p in (sched, topo):
            p.stop()
    # Each user is refused the other's keys (and the scheduler's user cannot forge a profile).
    for user, denied in (("topology", keys.job_key("x")), ("topology", keys.assignment_key("ohio", "x")),
                         ("scheduler", keys.profile_key("ohio")), ("scheduler", keys.link_key("ohio", "va"))):
        store = EtcdStore(etcd, username=user, password=PASSWORD[user], request_timeout=3)
        try:
            with pytest.raises(SpiderFlowError, match="permission denied"):
                await store.put(denied, b"{}")
        finally:
            await store.close()
    store = EtcdStore(etcd, username="topology", password=PASSWORD["topology"], request_timeout=3)
    try:
        with pytest.raises(SpiderFlowError, match="permission denied"):
            await store.put(keys.cluster_key("ohio"), b"{}")  # registrations: read-only for the topology service
    finally:
        await store.close()
