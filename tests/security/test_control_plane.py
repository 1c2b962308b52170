"""Agents hold no etcd credentials: everything they keep in the control plane's state goes through the
scheduler's ``Control`` API, which authorises every key against the caller's cluster certificate.

Real processes: a TLS etcd that requires client certificates of its own CA, the scheduler and the
topology service serving mTLS (``spiderflow serve ... --tls-dir``); the agents' side is the agent's own
client (:class:`agent.remote_store.RemoteStore`) with the certificates of ``spiderflow certs init``."""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from agent.registration import PeerAddress, Registration
from agent.remote_store import RemoteStore
from services.scheduler.repo import REQUESTS, JobRepository
from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Plan, Stage
from spiderflow.core.errors import PermissionDeniedError, ValidationError
from spiderflow.exec.spec import CheckpointManifest, ShardInfo
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.control.v1 import control_pb2, control_pb2_grpc
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.security.tls import channel_credentials
from spiderflow.store import keys, records
from spiderflow.store.base import CompareFailedError
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess
from spiderflow.store.tls import EtcdTLS

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "examples/topology-3.yaml"


@pytest.fixture(scope="module")
def plane(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A TLS etcd (client certificates of the etcd CA required), the scheduler and the topology service
    over mTLS. Returns the addresses."""
    etcd = EtcdProcess(tls=EtcdTLS.from_dir(certs / "etcd-server", require_cert=True))
    etcd.start()
    logs = tmp_path_factory.mktemp("control-plane-logs")
    etcd_client = ["--etcd", etcd.endpoint, "--etcd-tls-dir", str(certs / "etcd-client")]
    procs: list[ManagedProcess] = []
    try:
        procs.append(ManagedProcess("topology", spiderflow_argv(
            "serve", "topology", "--listen", "127.0.0.1:0", *etcd_client, "--tls-dir", str(certs / "topology"),
            "--log-format", "json"), log_dir=logs).spawn())
        procs.append(ManagedProcess("scheduler", spiderflow_argv(
            "serve", "scheduler", "--listen", "127.0.0.1:0", *etcd_client, "--topology", str(TOPOLOGY),
            "--tls-dir", str(certs / "scheduler"), "--cycle-interval", "60", "--log-format", "json"),
            log_dir=logs).spawn())
        for p in procs:
            p.wait_ready(timeout=90)
        yield {"etcd": etcd.endpoint, "topology": procs[0].address, "scheduler": procs[1].address}
    finally:
        for p in procs:  # side by side: SIGTERM to every process, then wait for each
            p.signal(signal.SIGTERM)
        for p in procs:
            p.stop()
        etcd.close()


@pytest.fixture
async def repo(plane: dict[str, str], certs: Path) -> AsyncIterator[JobRepository]:
    """The control plane's own view of etcd (the test places jobs as the scheduler would)."""
    store = EtcdStore(plane["etcd"], tls=EtcdTLS.from_dir(certs / "etcd-client"))
    for prefix in (keys.JOBS, keys.ALLOCATIONS, keys.ASSIGNMENTS, keys.RENDEZVOUS, keys.CHECKPOINTS, keys.WAITS,
                   REQUESTS):
        await store.delete_prefix(prefix)
    try:
        yield JobRepository(store)
    finally:
        await store.close()


def _agent(plane: dict[str, str], certs: Path, cluster: str, *, as_cluster: str | None = None) -> RemoteStore:
    """The client an agent of ``cluster`` uses (its certificate); ``as_cluster`` claims another cluster."""
    return RemoteStore(plane["scheduler"], cluster=as_cluster or cluster, tls_dir=str(certs / f"agent-{cluster}"),
                       request_timeout=10)


async def _place(repo: JobRepository, job_id: str, cluster: str) -> str:
    spec = job_from_dict({"id": job_id, "tenant": "alice", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64,
                          "steps": 10, "gpus": {"min": 1, "max": 1}})
    stored, _ = await repo.submit(spec, f"r-{job_id.replace('~', '-')}")
    plan = Plan(stages=(Stage(cluster=cluster, first_layer=0, last_layer=spec.model.layers - 1),), micro_batches=1,
                step_time_s=0.5)
    placed = stored.record.to(JobState.PLACED, "placed", now=repo.clock(), plan=plan,
                              allocation=plan.gpus_by_cluster(), attempt=1, policy="spinsearch", topology_revision=1)
    current, rev = await repo.allocation(cluster)
    await repo.bind(stored, placed, {cluster: rev}, {cluster: current})
    return spec.id


def _registration(cluster: str) -> bytes:
    return Registration(cluster=cluster, agent_id=f"{cluster}-1", principal=cluster,
                        address="127.0.0.1:1").encode()


async def _denied(call: Any, key: str) -> None:
    with pytest.raises(PermissionDeniedError) as e:
        await call
    assert key in str(e.value)


async def test_an_agent_credential_cannot_touch_another_clusters_keys_or_any_tenants_jobs(
        plane: dict[str, str], certs: Path, repo: JobRepository) -> None:
    job = await _place(repo, "alice~secret", "virginia")
    ohio = _agent(plane, certs, "ohio")
    try:
        # profiles and links are the topology service's: not even its own through this door
        for key in (keys.profile_key("virginia"), keys.profile_key("ohio"), keys.link_key("virginia", "ohio")):
            await _denied(ohio.put(key, b'{"gpus": 32}'), key)
        # another cluster's registration, assignments and keys
        await _denied(ohio.put(keys.cluster_key("virginia"), _registration("virginia")), keys.cluster_key("virginia"))
        await _denied(ohio.get(keys.cluster_key("virginia")), keys.cluster_key("virginia"))
        await _denied(ohio.get_prefix(keys.assignments_prefix("virginia")), keys.assignments_prefix("virginia"))
        await _denied(ohio.get(keys.assignment_key("virginia", job)), keys.assignment_key("virginia", job))
        await _denied(ohio.put(keys.allocation_key("virginia"), b"{}"), keys.allocation_key("virginia"))
        # tenants' job records, plans, the queue, metrics: not readable, not listable, not writable
        for key in (keys.job_key(job), keys.wait_key(job), keys.metrics_prefix(job)):
            await _denied(ohio.get(key), key)
        for prefix in (keys.JOBS, keys.ROOT, keys.WAITS, keys.ALLOCATIONS):
            await _denied(ohio.get_prefix(prefix), prefix)
        await _denied(ohio.delete(keys.job_key(job)), keys.job_key(job))
        # the rendezvous and checkpoint of a job its cluster does not run
        await _denied(ohio.put(keys.rendezvous_key(job, 1), b"{}"), keys.rendezvous_key(job, 1))
        await _denied(ohio.get(keys.checkpoint_key(job)), keys.checkpoint_key(job))
        manifest = json.dumps({"step": 5, "attempt": 1, "cluster": "ohio"}).encode()
        await _denied(ohio.compare_and_swap(keys.checkpoint_key(job), manifest, 0), keys.checkpoint_key(job))
        with pytest.raises(PermissionDeniedError):  # watching another cluster's assignments
            async with ohio.watch_prefix(keys.assignments_prefix("virginia")):
                pass
    finally:
        await ohio.close()
    # Claiming another cluster with ohio's certificate, or calling with a tenant's: refused.
    claims = _agent(plane, certs, "ohio", as_cluster="virginia")
    try:
        with pytest.raises(PermissionDeniedError, match="may not act for cluster 'virginia'"):
            await claims.get_prefix(keys.assignments_prefix("virginia"))
    finally:
        await claims.close()
    ch = open_channel(plane["scheduler"], credentials=channel_credentials(certs / "tenant-alice"))
    try:
        stub: Any = control_pb2_grpc.ControlStub(ch)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Get(control_pb2.GetRequest(cluster="ohio", key=keys.job_key(job)), timeout=10)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    finally:
        await ch.close()
    # The agent's certificate does not open etcd (its own CA only), so the control API is the only door.
    bypass = EtcdStore(plane["etcd"], tls=EtcdTLS(ca=certs / "agent-ohio/ca.crt", cert=certs / "agent-ohio/tls.crt",
                                                  key=certs / "agent-ohio/tls.key"), request_timeout=2)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the TLS handshake fails (UNAVAILABLE)
            await bypass.get(keys.job_key(job))
    finally:
        await bypass.close()


async def test_the_forged_profile_is_refused_end_to_end(plane: dict[str, str], certs: Path,
                                                        repo: JobRepository) -> None:
    """The attack: ohio's agent claims 32 GPUs for virginia (a 1-GPU cluster). Every path is closed: the
    control API refuses the keys, the topology service refuses the report, and the graph keeps virginia's
    own profile."""
    virginia, ohio = _agent(plane, certs, "virginia"), _agent(plane, certs, "ohio")
    topo_ch = {c: open_channel(plane["topology"], credentials=channel_credentials(certs / f"agent-{c}"))
               for c in ("virginia", "ohio")}
    try:
        # virginia registers under its lease and reports its 1 GPU, as its agent does
        lease = await virginia.grant(10)
        await virginia.put_if_absent(keys.cluster_key("virginia"), Registration(
            cluster="virginia", agent_id="virginia-1", principal="virginia", address="127.0.0.1:1").encode(),
            lease=lease)
        stub: Any = topology_pb2_grpc.TopologyStub(topo_ch["virginia"])  # type: ignore[no-untyped-call]
        await stub.ReportProfile(topology_pb2.ReportProfileRequest(agent_id="virginia-1", agent_address="127.0.0.1:1",
                                 cluster=types_pb2.Cluster(name="virginia", gpu="A100-80G", nodes=1, gpus_per_node=1)),
                                 timeout=10)
        # ohio forges: the profile key, virginia's registration (under its own lease and under virginia's)
        await _denied(ohio.put(keys.profile_key("virginia"), b'{"nodes": 4, "gpus_per_node": 8}'),
                      keys.profile_key("virginia"))
        await _denied(ohio.put(keys.cluster_key("virginia"), _registration("virginia")), keys.cluster_key("virginia"))
        own = await ohio.grant(10)
        with pytest.raises(PermissionDeniedError, match="may not register cluster 'virginia'"):
            await ohio.put(keys.cluster_key("ohio"), _registration("virginia"), lease=own)
        with pytest.raises(PermissionDeniedError, match=f"holds no lease {lease.id:x}"):
            await ohio.put(keys.cluster_key("ohio"), _registration("ohio"), lease=lease.id)
        with pytest.raises(PermissionDeniedError, match=f"holds no lease {lease.id:x}"):
            await ohio.revoke_lease(lease.id)  # nor end virginia's registration
        # ... and through the topology service: virginia's profile reported by ohio's agent
        forged = topology_pb2_grpc.TopologyStub(topo_ch["ohio"])  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await forged.ReportProfile(topology_pb2.ReportProfileRequest(
                agent_id="virginia-1", agent_address="127.0.0.1:1",
                cluster=types_pb2.Cluster(name="virginia", gpu="A100-80G", nodes=4, gpus_per_node=8)), timeout=10)
        assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
        # peers see virginia's address only, never its lease or agent id
        items, _ = await ohio.get_prefix(keys.CLUSTERS)
        seen = {kv.key: kv for kv in items}
        assert json.loads(seen[keys.cluster_key("virginia")].value) == {"cluster": "virginia",
                                                                        "address": "127.0.0.1:1"}
        assert seen[keys.cluster_key("virginia")].lease == 0
        assert PeerAddress.decode(seen[keys.cluster_key("virginia")].value).address == "127.0.0.1:1"
        # the graph: virginia with its one GPU
        graph: Any = topology_pb2_grpc.TopologyStub(topo_ch["virginia"])  # type: ignore[no-untyped-call]
        resp = await graph.GetTopology(topology_pb2.GetTopologyRequest(), timeout=10)
        clusters = {c.name: c for c in resp.topology.clusters}
        assert clusters["virginia"].nodes * clusters["virginia"].gpus_per_node == 1
        await lease.revoke()
        assert await virginia.get(keys.cluster_key("virginia")) is None
    finally:
        for ch in topo_ch.values():
            await ch.close()
        await virginia.close()
        await ohio.close()


async def test_rendezvous_and_checkpoints_only_for_the_assigned_attempt(plane: dict[str, str], certs: Path,
                                                                       repo: JobRepository) -> None:
    job = await _place(repo, "alice~train", "ohio")
    ohio, virginia = _agent(plane, certs, "ohio"), _agent(plane, certs, "virginia")
    try:
        items, _ = await ohio.get_prefix(keys.assignments_prefix("ohio"))
        assert [json.loads(kv.value)["attempt"] for kv in items] == [1]
        with pytest.raises(ValidationError) as bad_value:  # only a rendezvous record goes under a rendezvous key
            await ohio.put(keys.rendezvous_key(job, 1), b'{"host": "127.0.0.1", "port": 1}')
        assert bad_value.value.field == "value.checkpoint_dir", bad_value.value
        await ohio.put(keys.rendezvous_key(job, 1), records.encode(records.RendezvousInfo(
            host="127.0.0.1", port=1, checkpoint_dir="/c", checkpoint_every=0)))
        assert (await ohio.get(keys.rendezvous_key(job, 1))) is not None
        await _denied(ohio.put(keys.rendezvous_key(job, 2), b"{}"), keys.rendezvous_key(job, 2))
        await _denied(virginia.get(keys.rendezvous_key(job, 1)), keys.rendezvous_key(job, 1))
        # a checkpoint manifest: only for the current attempt, only naming the writer's cluster
        key = keys.checkpoint_key(job)
        gpt = model_preset("gpt-tiny")
        ok = records.encode(records.CheckpointRecord(
            manifest=CheckpointManifest(job_id=job, step=5, model=gpt, shards=(
                ShardInfo(first_layer=0, last_layer=gpt.layers - 1, path="/c/step-5/.metadata"),)),
            attempt=1, cluster="ohio"))
        rev = await ohio.compare_and_swap(key, ok, 0)
        with pytest.raises(CompareFailedError):
            await ohio.compare_and_swap(key, ok, 0)  # a compare that fails is not a refusal
        for bad in ({"step": 9, "attempt": 2, "cluster": "ohio"}, {"step": 9, "attempt": 1, "cluster": "virginia"}):
            await _denied(ohio.compare_and_swap(key, json.dumps(bad).encode(), rev), key)
        await _denied(ohio.put(key, ok), key)  # only compare-and-swap
        await _denied(virginia.compare_and_swap(key, json.dumps({"step": 9, "attempt": 1, "cluster": "virginia"})
                                                .encode(), rev), key)
        # the job ends: its assignment and rendezvous go, and so does the agent's access
        stored = await repo.get(job)
        await repo.transition(stored, stored.record.to(JobState.SUCCEEDED, "done", now=repo.clock()))
        assert await repo.store.get(keys.rendezvous_key(job, 1)) is None
        await _denied(ohio.get(keys.rendezvous_key(job, 1)), keys.rendezvous_key(job, 1))
        await _denied(ohio.compare_and_swap(key, ok, rev), key)
    finally:
        await ohio.close()
        await virginia.close()


async def test_an_agent_refused_by_the_control_plane_stops(plane: dict[str, str], certs: Path) -> None:
    """An agent whose certificate names another cluster is refused by the control plane at registration:
    it logs ``agent.refused`` and stops (``spiderflow agent`` exits with code 5) instead of retrying."""
    import asyncio

    from agent.agent import Agent
    from agent.config import load_config

    cfg = load_config(None, {"cluster": "ohio", "topology_service": plane["topology"], "scheduler": plane["scheduler"],
                             "tls_dir": str(certs / "agent-virginia"), "lease_ttl_s": 3,
                             "gpus": {"gpu": "A100-80G", "nodes": 1, "gpus_per_node": 1},
                             "probe": {"period_s": 60.0}})
    agent = Agent(cfg)
    stop = asyncio.Event()
    await asyncio.wait_for(agent.run(stop), 30)
    assert isinstance(agent.refused, PermissionDeniedError)
    assert "may not act for cluster 'ohio'" in str(agent.refused)
