"""Certificates by role and agents scoped to their own stages, on real gRPC servers (mTLS with the
certificates of ``spiderflow certs init``, bearer tokens) over a real etcd: the fake scheduler, the planner
certificate acting as a tenant, the tenant calling an agent, the forged outcome, malformed and
unauthenticated large requests, and private keys that are never readable by others."""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from idle_agent import IdleAgentState

from agent.service import AgentService
from services.planner.service import PlannerService
from services.scheduler.repo import JobRepository
from services.scheduler.service import SchedulerService
from services.topology.service import check_profile_bounds
from spiderflow.core.domain import Cluster, Plan, Stage
from spiderflow.core.errors import ValidationError
from spiderflow.formats import job_from_dict, load_topology
from spiderflow.jobs import JobState
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.server import RpcServer, open_channel, serve
from spiderflow.security import certs as certs_mod
from spiderflow.security.auth import Authenticator, AuthInterceptor, TokenTable, bearer_metadata
from spiderflow.security.identity import Principal, Role
from spiderflow.security.tls import channel_credentials, server_credentials
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

ROOT = Path(__file__).resolve().parents[2]
Code = grpc.StatusCode
STEPS = 200


async def _code(coro: Any) -> Code:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


def _creds(certs: Path, bundle: str) -> grpc.ChannelCredentials:
    return channel_credentials(certs / bundle)


def _raw_server_credentials(cert: Path, key: Path, ca: Path) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())], root_certificates=ca.read_bytes(),
                                       require_client_auth=True)


@pytest.fixture
async def scheduler(module_etcd: EtcdProcess, certs: Path) -> AsyncIterator[tuple[RpcServer, JobRepository]]:
    store = EtcdStore(module_etcd.endpoint)
    await store.delete_prefix(keys.ROOT)
    repo = JobRepository(store)
    server = await serve([SchedulerService(repo), PlannerService()],
                         credentials=server_credentials(certs / "scheduler"),
                         interceptors=[AuthInterceptor(Authenticator(certificates=True))])
    try:
        yield server, repo
    finally:
        await server.stop(grace_s=0)
        await store.close()


def _job(job_id: str) -> types_pb2.JobSpec:
    spec = convert.job_to_proto(job_from_dict({"id": job_id, "model": "gpt-tiny", "global_batch": 8, "seq_len": 64,
                                               "steps": STEPS, "gpus": {"min": 2, "max": 2}}))
    spec.tenant = ""
    return spec


async def test_a_fake_scheduler_with_a_tenant_or_agent_certificate_gets_no_connection(certs: Path) -> None:
    """Tenant and agent certificates are for client authentication only: an agent (or any client) that
    dials a server presenting one fails the TLS handshake before sending its token."""
    tokens_seen: list[str] = []

    class Spy(scheduler_pb2_grpc.SchedulerServicer):
        async def GetJob(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
            tokens_seen.extend(str(v) for k, v in context.invocation_metadata() or () if k == "authorization")
            return scheduler_pb2.GetJobResponse()

    ca = certs / "scheduler" / "ca.crt"
    for bundle, cert, key in [("tenant-alice", "tls.crt", "tls.key"), ("agent-oregon", "tls.crt", "tls.key")]:
        fake = await serve([Spy()], credentials=_raw_server_credentials(certs / bundle / cert, certs / bundle / key,
                                                                            ca))
        try:
            async with open_channel(fake.address, credentials=_creds(certs, "agent-ohio")) as ch:
                code = await _code(scheduler_pb2_grpc.SchedulerStub(ch).GetJob(
                    scheduler_pb2.GetJobRequest(job_id="j"), metadata=bearer_metadata("agent-secret-0123456789"),
                    timeout=5))
            assert code is Code.UNAVAILABLE, bundle
        finally:
            await fake.stop(grace_s=0)
    assert tokens_seen == []
    # Control: a real service certificate is accepted by the same client.
    real = await serve([Spy()], credentials=server_credentials(certs / "scheduler"))
    try:
        async with open_channel(real.address, credentials=_creds(certs, "agent-ohio")) as ch:
            await scheduler_pb2_grpc.SchedulerStub(ch).GetJob(scheduler_pb2.GetJobRequest(job_id="j"), timeout=5)
    finally:
        await real.stop(grace_s=0)
    # An agent's serving certificate cannot authenticate a client.
    server_only = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(), private_key=(certs / "agent-ohio" / "server.key").read_bytes(),
        certificate_chain=(certs / "agent-ohio" / "server.crt").read_bytes())
    real = await serve([Spy()], credentials=server_credentials(certs / "scheduler"))
    try:
        async with open_channel(real.address, credentials=server_only) as ch:
            code = await _code(scheduler_pb2_grpc.SchedulerStub(ch).GetJob(scheduler_pb2.GetJobRequest(job_id="j"),
                                                                           timeout=5))
        assert code is Code.UNAVAILABLE
    finally:
        await real.stop(grace_s=0)


async def test_service_certificates_are_not_tenants_or_admins(
        scheduler: tuple[RpcServer, JobRepository], certs: Path) -> None:
    server, repo = scheduler
    async with open_channel(server.address, credentials=_creds(certs, "tenant-alice")) as ch:
        await scheduler_pb2_grpc.SchedulerStub(ch).SubmitJob(
            scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("a-1")), timeout=10)
    topo = convert.topology_to_proto(load_topology(ROOT / "examples/topology-3.yaml"))
    for bundle in ("planner", "topology"):
        async with open_channel(server.address, credentials=_creds(certs, bundle)) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            assert await _code(stub.ListJobs(scheduler_pb2.ListJobsRequest(), timeout=10)) is Code.PERMISSION_DENIED
            sub = scheduler_pb2.SubmitJobRequest(request_id="r-2", job=_job("x"))
            sub.job.tenant = "alice"
            assert await _code(stub.SubmitJob(sub, timeout=10)) is Code.PERMISSION_DENIED
            for job_id in ("alice~a-1", "a-1"):
                assert await _code(stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id),
                                                  timeout=10)) is Code.NOT_FOUND
                assert await _code(stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id),
                                               timeout=10)) is Code.NOT_FOUND
            plan = planner_pb2_grpc.PlannerStub(ch).Estimate(planner_pb2.EstimateRequest(topology=topo, job=_job("p")),
                                                             timeout=30)
            assert await _code(plan) is Code.PERMISSION_DENIED
    # The scheduler's certificate may use the planner (final plans): past authorisation, the request's
    # missing plan is what is refused. Nothing was changed above.
    async with open_channel(server.address, credentials=_creds(certs, "scheduler")) as ch:
        est = planner_pb2_grpc.PlannerStub(ch).Estimate(planner_pb2.EstimateRequest(topology=topo, job=_job("p")),
                                                        timeout=60)
        assert await _code(est) is Code.INVALID_ARGUMENT
    assert (await repo.get("alice~a-1")).record.state is JobState.PENDING


async def test_an_agent_serves_only_the_control_plane_and_peer_probes(certs: Path) -> None:
    server = await serve([AgentService(IdleAgentState(serve_cap_bytes=8 << 20))],
                         credentials=server_credentials(certs / "agent-ohio"),
                         interceptors=[AuthInterceptor(Authenticator(certificates=True))])
    try:
        async def calls(bundle: str) -> tuple[Code, Code, Code]:
            async with open_channel(server.address, credentials=_creds(certs, bundle)) as ch:
                stub = agent_pb2_grpc.AgentStub(ch)
                status = await _code(stub.GetStatus(agent_pb2.GetStatusRequest(), timeout=10))

                async def download() -> None:
                    async for _ in stub.ProbeDownload(agent_pb2.ProbeDownloadRequest(total_bytes=4 << 20), timeout=30):
                        pass

                async def watch() -> None:  # no worker: an allowed watch stays open until its deadline
                    async for _ in stub.WatchWorkers(agent_pb2.WatchWorkersRequest(), timeout=1):
                        pass

                return status, await _code(download()), await _code(watch())

        assert await calls("tenant-alice") == (Code.PERMISSION_DENIED,) * 3
        # a peer probes, and reads nothing else
        assert await calls("agent-virginia") == (Code.PERMISSION_DENIED, Code.OK, Code.PERMISSION_DENIED)
        assert await calls("topology") == (Code.OK, Code.OK, Code.DEADLINE_EXCEEDED)
        assert await calls("admin") == (Code.OK, Code.OK, Code.DEADLINE_EXCEEDED)
    finally:
        await server.stop(grace_s=0)


async def _running_two_cluster_job(repo: JobRepository) -> str:
    """A job of tenant alice placed with stage 0 on virginia and stage 1 on ohio (bound like the cycle)."""
    spec = job_from_dict({"id": "alice~two", "tenant": "alice", "model": "gpt-tiny", "global_batch": 8,
                          "seq_len": 64, "steps": STEPS, "gpus": {"min": 2, "max": 2}})
    stored, _ = await repo.submit(spec, "r-two")
    layers = spec.model.layers
    plan = Plan(stages=(Stage(cluster="virginia", first_layer=0, last_layer=layers // 2 - 1),
                        Stage(cluster="ohio", first_layer=layers // 2, last_layer=layers - 1)), micro_batches=2,
                step_time_s=0.1)
    placed = stored.record.to(JobState.PLACED, "placed", now=repo.clock(), plan=plan, allocation=plan.gpus_by_cluster(),
                              attempt=1, policy="spinsearch", topology_revision=1)
    await repo.bind(stored, placed, {}, {})
    return spec.id


async def test_an_agent_reports_only_its_own_stages_and_valid_progress(
        scheduler: tuple[RpcServer, JobRepository], certs: Path) -> None:
    server, repo = scheduler
    job = await _running_two_cluster_job(repo)

    def report(step: int, *, loss: float = 1.0, outcome: int | None = None) -> scheduler_pb2.ReportProgressRequest:
        req = scheduler_pb2.ReportProgressRequest(job_id=job, attempt=1, progress=[
            types_pb2.ProgressEvent(step=step, steps_total=STEPS, loss=loss, tokens_per_s=10.0, step_time_s=0.1)])
        if outcome is not None:
            req.outcomes.append(scheduler_pb2.WorkerOutcome(stage=outcome, succeeded=True))
        return req

    async with open_channel(server.address, credentials=_creds(certs, "agent-virginia")) as a, \
            open_channel(server.address, credentials=_creds(certs, "agent-ohio")) as b:
        virginia, ohio = scheduler_pb2_grpc.SchedulerStub(a), scheduler_pb2_grpc.SchedulerStub(b)
        # The forged outcome: virginia (stage 0) claims the last stage (ohio's) succeeded at step 4.
        assert await _code(virginia.ReportProgress(report(4, outcome=1), timeout=10)) is Code.PERMISSION_DENIED
        # Even ohio cannot end the job before its last step.
        assert await _code(ohio.ReportProgress(report(4, outcome=1), timeout=10)) is Code.FAILED_PRECONDITION
        for bad in (report(4, loss=math.nan), report(4, loss=math.inf), report(STEPS + 1), report(-1)):
            assert await _code(ohio.ReportProgress(bad, timeout=10)) is Code.INVALID_ARGUMENT
        assert (await repo.get(job)).record.state is JobState.PLACED
        assert (await ohio.ReportProgress(report(4), timeout=10)).accepted
        done = await ohio.ReportProgress(report(STEPS, outcome=1), timeout=10)
        assert done.accepted and done.stop
        # Delivered again (at least once): accepted once, the job stays as it ended.
        again = await ohio.ReportProgress(report(STEPS, outcome=1), timeout=10)
        assert not again.accepted and again.stop
    record = (await repo.get(job)).record
    assert record.state is JobState.SUCCEEDED and record.progress.step == STEPS
    assert [t.to_state for t in record.history].count(JobState.SUCCEEDED) == 1


async def test_malformed_and_unauthenticated_requests(module_etcd: EtcdProcess) -> None:
    store = EtcdStore(module_etcd.endpoint)
    tokens = TokenTable({"alice-token-0123456789": Principal(role=Role.TENANT, name="alice")})
    server = await serve([SchedulerService(JobRepository(store))],
                         interceptors=[AuthInterceptor(Authenticator(tokens=tokens))])
    try:
        async with open_channel(server.address) as ch:
            raw = ch.unary_unary("/spiderflow.scheduler.v1.Scheduler/GetJob")
            good = bearer_metadata("alice-token-0123456789")
            # Bytes that are not a GetJobRequest: INVALID_ARGUMENT, never UNKNOWN or INTERNAL.
            assert await _code(raw(b"\xff\xff\xff\xff", metadata=good, timeout=10)) is Code.INVALID_ARGUMENT
            # Unauthenticated: refused before the request is parsed (malformed bytes are not even looked at,
            # so a large body costs no decoding).
            assert await _code(raw(b"\xff\xff\xff\xff", timeout=10)) is Code.UNAUTHENTICATED
            big = scheduler_pb2.GetJobRequest(job_id="j" * (3 << 20)).SerializeToString()
            for md in ((), bearer_metadata("forged-token-0123456789")):
                assert await _code(raw(big, metadata=md, timeout=30)) is Code.UNAUTHENTICATED
            assert await _code(raw(big, metadata=good, timeout=30)) is Code.INVALID_ARGUMENT
    finally:
        await server.stop(grace_s=0)
        await store.close()


def test_private_keys_are_never_readable_by_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real_replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        seen.append(os.stat(src).st_mode & 0o777)  # the key's mode before it appears under its name
        real_replace(src, dst)

    monkeypatch.setattr(certs_mod.os, "replace", spy)
    old = os.umask(0)
    try:
        certs_mod.init_certs(tmp_path, clusters=("c1",), tenants=("t1",))
    finally:
        os.umask(old)
    assert seen and set(seen) == {0o600}
    keys_written = [p for p in tmp_path.rglob("*.key")]
    assert keys_written and all(p.stat().st_mode & 0o777 == 0o600 for p in keys_written)
    assert not list(tmp_path.rglob("*.tmp"))


def test_profiles_beyond_hardware_bounds_are_refused() -> None:
    ok = Cluster(name="c1", gpu="A100-80G", nodes=2, gpus_per_node=8)
    check_profile_bounds(ok)
    for field, value in (("nodes", 2**31 - 1), ("gpus_per_node", 4096), ("tflops", 1e9)):
        bad = Cluster(**{"name": "c1", "gpu": "A100-80G", "nodes": 2, "gpus_per_node": 8, field: value})
        with pytest.raises(ValidationError, match=field):
            check_profile_bounds(bad)
