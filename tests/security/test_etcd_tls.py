"""etcd with client TLS (``--cert-file --key-file --trusted-ca-file --client-cert-auth``), alone and combined
with etcd users: a real etcd started by :class:`EtcdProcess` with the ``etcd-server`` bundle of
``spiderflow certs init``, reached by :class:`EtcdStore` and by the services as real processes.

Refused: a plaintext client, a TLS client without a certificate, a client presenting a SpiderFlow
certificate (a tenant's; another CA). Accepted: the ``etcd-client`` bundle, for reads, writes, watches,
leases and leader election; with authentication on, additionally the right user and password (and the
store authenticates again by itself when a restarted etcd forgot its token).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from security_harness import submit_tiny_job_to_success

from spiderflow.core.errors import UnavailableError
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc.server import open_channel
from spiderflow.store import keys
from spiderflow.store.base import EventType
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess
from spiderflow.store.tls import EtcdTLS

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "etcd-tls-secret-pw"


def _etcd(certs: Path) -> EtcdProcess:
    return EtcdProcess(tls=EtcdTLS.from_dir(certs / "etcd-server", require_cert=True))


@pytest.fixture
def tls_etcd(certs: Path) -> Iterator[EtcdProcess]:
    proc = _etcd(certs)
    try:
        proc.start()
        yield proc
    finally:
        proc.close()


def _etcdctl(proc: EtcdProcess, certs: Path, *args: str) -> None:
    client = certs / "etcd-client"
    r = subprocess.run(["etcdctl", "--endpoints", proc.url, "--cacert", str(client / "ca.crt"),
                        "--cert", str(client / "tls.crt"), "--key", str(client / "tls.key"), *args],
                       capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def tls_auth_etcd(tls_etcd: EtcdProcess, certs: Path) -> EtcdProcess:
    """TLS and etcd users: ``root`` with a password, authentication enabled."""
    _etcdctl(tls_etcd, certs, "user", "add", f"root:{PASSWORD}")
    _etcdctl(tls_etcd, certs, "auth", "enable")
    return tls_etcd


async def _refused(endpoint: str, **kwargs: object) -> None:
    store = EtcdStore(endpoint, request_timeout=2.0, **kwargs)  # type: ignore[arg-type]
    try:
        with pytest.raises(UnavailableError):
            await store.put("/spiderflow/v1/probe", b"x")
    finally:
        await store.close()


async def test_plaintext_and_foreign_clients_are_refused(tls_etcd: EtcdProcess, certs: Path) -> None:
    assert tls_etcd.url.startswith("https://")
    etcd_ca = certs / "etcd-client" / "ca.crt"
    await _refused(tls_etcd.endpoint)  # plaintext
    await _refused(tls_etcd.endpoint, tls=EtcdTLS(ca=etcd_ca))  # TLS, no client certificate
    tenant = certs / "tenant-alice"  # a SpiderFlow certificate: another CA
    await _refused(tls_etcd.endpoint, tls=EtcdTLS(ca=etcd_ca, cert=tenant / "tls.crt", key=tenant / "tls.key"))
    # Nothing was written by any of them.
    store = EtcdStore(tls_etcd.endpoint, tls=EtcdTLS.from_dir(certs / "etcd-client"))
    try:
        assert await store.get("/spiderflow/v1/probe") is None
    finally:
        await store.close()


async def test_tls_client_reads_writes_watches_leases_and_elects(tls_etcd: EtcdProcess, certs: Path) -> None:
    tls = EtcdTLS.from_dir(certs / "etcd-client")
    store = EtcdStore(tls_etcd.endpoint, tls=tls)
    other = EtcdStore(tls_etcd.endpoint, tls=tls)
    try:
        rev = await store.put("/t/a", b"1")
        assert (await store.get("/t/a")).value == b"1"  # type: ignore[union-attr]
        async with store.watch_prefix("/t/", start_revision=rev + 1) as watch:
            await other.put("/t/b", b"2")
            ev = await asyncio.wait_for(watch.__anext__(), 10)
            assert (ev.type, ev.key, ev.value) == (EventType.PUT, "/t/b", b"2")
        # A lease kept alive past its TTL, with a key attached that goes away when it is revoked.
        lease = await store.grant(1)
        await store.put("/t/leased", b"x", lease=lease)
        await asyncio.sleep(2.5)
        assert lease.alive and await store.get("/t/leased") is not None
        # Leader election: the first campaign wins, the second waits until the leader resigns.
        won = await store.campaign("tls-election", b"first", lease)
        assert (await other.leader("tls-election")).value == b"first"  # type: ignore[union-attr]
        other_lease = await other.grant(2)
        second = asyncio.create_task(other.campaign("tls-election", b"second", other_lease))
        await asyncio.sleep(0.5)
        assert not second.done()
        await won.resign()
        leadership = await asyncio.wait_for(second, 10)
        assert leadership.value == b"second"
        await lease.revoke()
        assert await store.get("/t/leased") is None
        await leadership.resign()
        await other_lease.revoke()
    finally:
        await store.close()
        await other.close()


async def test_tls_and_users_combined(tls_auth_etcd: EtcdProcess, certs: Path) -> None:
    tls = EtcdTLS.from_dir(certs / "etcd-client")
    endpoint = tls_auth_etcd.endpoint
    # The certificate alone is not enough (etcd takes its CN, "spiderflow", as a user it does not know) ...
    await _refused(endpoint, tls=tls)
    # ... nor a wrong password, nor the right password over plaintext.
    await _refused(endpoint, tls=tls, username="root", password="wrong-password")
    await _refused(endpoint, username="root", password=PASSWORD)
    store = EtcdStore(endpoint, tls=tls, username="root", password=PASSWORD)
    try:
        await store.put("/t/auth", b"1")
        lease = await store.grant(2)
        leadership = await store.campaign("auth-election", b"me", lease)
        # etcd's auth tokens live in its memory: a restart forgets them. The store authenticates again.
        tls_auth_etcd.restart()
        await store.put("/t/auth", b"2")
        assert (await store.get("/t/auth")).value == b"2"  # type: ignore[union-attr]
        async with store.watch_prefix("/t/", start_revision=1) as watch:
            assert (await asyncio.wait_for(watch.__anext__(), 10)).key == "/t/auth"
        await leadership.resign()
    finally:
        await store.close()


def _scheduler_argv(etcd: str, *extra: str) -> list[str]:
    return spiderflow_argv("serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd, "--topology",
                           str(ROOT / "examples/topology-3.yaml"), "--executor", "sim", "--sim-min-s", "0.1",
                           "--sim-max-s", "0.2", "--cycle-interval", "1", "--log-format", "json", *extra)


async def test_services_reach_a_tls_etcd_with_users(tls_auth_etcd: EtcdProcess, certs: Path,
                                                    tmp_path: Path) -> None:
    """The scheduler with flags (``--etcd-tls-dir``, ``--etcd-user``), the topology service with the
    environment (``SPIDERFLOW_ETCD_TLS_DIR``, ``SPIDERFLOW_ETCD_USER``); the password always from
    ``SPIDERFLOW_ETCD_PASSWORD``."""
    endpoint = tls_auth_etcd.endpoint
    client = str(certs / "etcd-client")
    r = subprocess.run(_scheduler_argv(endpoint, "--etcd-tls-dir", str(tmp_path / "missing")), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--etcd-tls-dir" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    sched = ManagedProcess("sched", _scheduler_argv(endpoint, "--etcd-tls-dir", client, "--etcd-user", "root"),
                           log_dir=tmp_path, env={"SPIDERFLOW_ETCD_PASSWORD": PASSWORD}).spawn()
    topo = ManagedProcess("topology", spiderflow_argv(
        "serve", "topology", "--listen", "127.0.0.1:0", "--etcd", endpoint, "--log-format", "json",
    ), log_dir=tmp_path, env={"SPIDERFLOW_ETCD_TLS_DIR": client, "SPIDERFLOW_ETCD_USER": "root",
                              "SPIDERFLOW_ETCD_PASSWORD": PASSWORD}).spawn()  # side by side with the scheduler
    try:
        sched.wait_ready(timeout=60)
        topo.wait_ready(timeout=60)
        await submit_tiny_job_to_success(sched.address, "tls1")
        async with open_channel(topo.address) as ch:
            resp = await topology_pb2_grpc.TopologyStub(ch).GetTopology(  # type: ignore[no-untyped-call]
                topology_pb2.GetTopologyRequest(), timeout=10)
        assert resp.topology.revision > 0  # read from etcd
    finally:
        sched.stop()
        topo.stop()
    store = EtcdStore(endpoint, tls=EtcdTLS.from_dir(client), username="root", password=PASSWORD)
    try:
        jobs, _ = await store.get_prefix(keys.JOBS)
        assert [kv.key for kv in jobs] == [keys.JOBS + "tls1"]
    finally:
        await store.close()
