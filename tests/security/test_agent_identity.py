"""``spiderflow agent`` (a real process) against a secured control plane: etcd with client TLS and users, and a
topology service that authenticates with bearer tokens only (``--tokens``) and reaches that etcd itself.

The agent takes its etcd bundle and user from flags, the etcd password and its bearer token from the
environment (``SPIDERFLOW_ETCD_PASSWORD``, ``SPIDERFLOW_TOKEN``). With the token of its own cluster it registers
and reports, and its cluster shows up in GetTopology. With the token of another cluster (PERMISSION_DENIED) or a
token the service does not know (UNAUTHENTICATED) it logs ``agent.refused`` naming the refusal, deregisters and
exits with code 5 and one line on stderr, no traceback; nothing of its cluster reaches the topology.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc.server import open_channel
from spiderflow.security.auth import bearer_metadata
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess
from spiderflow.store.tls import EtcdTLS

PASSWORD = "agent-etcd-secret-pw"
TOKENS = {
    "virginia-agent-token-0123456789": "agent:virginia",
    "ohio-agent-token-0123456789abc": "agent:ohio",
    "admin-token-for-reading-012345": "admin:ops",
}
VIRGINIA, OHIO, ADMIN = TOKENS
EXIT_PERMISSION = 5


@pytest.fixture
def secured_etcd(certs: Path) -> Iterator[EtcdProcess]:
    """etcd requiring client certificates of its own CA, with authentication on (user ``root``)."""
    proc = EtcdProcess(tls=EtcdTLS.from_dir(certs / "etcd-server", require_cert=True))
    try:
        proc.start()
        client = certs / "etcd-client"
        for args in (["user", "add", f"root:{PASSWORD}"], ["auth", "enable"]):
            r = subprocess.run(["etcdctl", "--endpoints", proc.url, "--cacert", str(client / "ca.crt"),
                                "--cert", str(client / "tls.crt"), "--key", str(client / "tls.key"), *args],
                               capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
            assert r.returncode == 0, r.stderr
        yield proc
    finally:
        proc.close()


def _agent(name: str, cluster: str, token: str, etcd: EtcdProcess, topology: str, certs: Path,
           tmp: Path) -> ManagedProcess:
    argv = spiderflow_argv(
        "agent", "--cluster", cluster, "--etcd", etcd.endpoint, "--topology-service", topology,
        "--etcd-tls-dir", str(certs / "etcd-client"), "--etcd-user", "root", "--gpu", "A100-80G", "--nodes", "1",
        "--gpus-per-node", "8", "--lease-ttl", "4", "--probe-period", "1", "--log-format", "json",
    )
    return ManagedProcess(name, argv, log_dir=tmp, env={"SPIDERFLOW_ETCD_PASSWORD": PASSWORD,
                                                        "SPIDERFLOW_TOKEN": token})


def _events(proc: ManagedProcess, event: str) -> list[dict[str, object]]:
    out = []
    for line in proc.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("event") == event:
                out.append(doc)
    return out


async def test_agent_with_etcd_tls_users_and_tokens(secured_etcd: EtcdProcess, certs: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("tokens:\n" + "".join(f"  {t}: {p}\n" for t, p in TOKENS.items()))
    topology = ManagedProcess("topology", spiderflow_argv(
        "serve", "topology", "--listen", "127.0.0.1:0", "--etcd", secured_etcd.endpoint, "--tokens", str(tokens),
        "--etcd-tls-dir", str(certs / "etcd-client"), "--etcd-user", "root", "--log-format", "json",
    ), log_dir=tmp_path, env={"SPIDERFLOW_ETCD_PASSWORD": PASSWORD}).start(timeout=60)
    procs = [topology]
    try:
        good = _agent("agent-virginia", "virginia", VIRGINIA, secured_etcd, topology.address, certs, tmp_path)
        stolen = _agent("agent-ohio", "ohio", VIRGINIA, secured_etcd, topology.address, certs, tmp_path)
        forged = _agent("agent-oregon", "oregon", "forged-agent-token-0123456789", secured_etcd, topology.address,
                        certs, tmp_path)
        procs += [good, stolen, forged]
        for p in (good, stolen, forged):
            p.spawn()
        for p in (good, stolen, forged):
            p.wait_ready(timeout=60)
        # The refused agents stop by themselves, with the permission exit code and no traceback.
        for p, code in ((stolen, "PermissionDeniedError"), (forged, "UnauthenticatedError")):
            assert p.proc is not None
            assert p.proc.wait(timeout=60) == EXIT_PERMISSION, p.tail(20)
            text = p.log_path.read_text(errors="replace")
            assert "Traceback" not in text, text
            refused = _events(p, "agent.refused")
            assert len(refused) == 1 and refused[0]["code"] == code, text
            assert refused[0]["identity"] == "bearer token"
            assert not _events(p, "agent.profile_reported")
        # The accepted agent reported its profile (over the token) and is registered (over TLS + user).
        async with open_channel(topology.address) as ch:
            stub = topology_pb2_grpc.TopologyStub(ch)  # type: ignore[no-untyped-call]
            for _ in range(100):
                resp = await stub.GetTopology(topology_pb2.GetTopologyRequest(), timeout=5,
                                              metadata=bearer_metadata(ADMIN))
                if resp.topology.clusters:
                    break
                await asyncio.sleep(0.1)
        assert [c.name for c in resp.topology.clusters] == ["virginia"]
        assert {s.name: s.agent_id for s in resp.cluster_status} == {"virginia": good.ready_doc["agent_id"]}
        assert good.alive() and _events(good, "agent.profile_reported")
        store = EtcdStore(secured_etcd.endpoint, tls=EtcdTLS.from_dir(certs / "etcd-client"), username="root",
                          password=PASSWORD)
        try:
            regs, _ = await store.get_prefix(keys.CLUSTERS)
        finally:
            await store.close()
        # The refused agents deregistered on their way out.
        assert [kv.key for kv in regs] == [keys.cluster_key("virginia")]
        assert good.stop() == 0
    finally:
        for p in reversed(procs):
            p.stop()

