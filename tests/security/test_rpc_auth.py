"""Authentication, tenant isolation and bounds of the Scheduler and Planner services on real gRPC servers
(mTLS with the certificates of ``spiderflow certs init``, bearer tokens) over a real etcd.

Every RPC of both services is called unauthenticated (refused: UNAUTHENTICATED, or no TLS handshake at
all for a client without a certificate) and as the wrong tenant (refused: NOT_FOUND for another
tenant's job, PERMISSION_DENIED for acting as another tenant or outside one's role).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.planner.service import PlannerService
from services.scheduler.cycle import SchedulingCycle
from services.scheduler.repo import JobRepository
from services.scheduler.service import SchedulerService
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.errors import ResourceExhaustedError
from spiderflow.core.placement import Budget
from spiderflow.formats import job_from_dict, load_topology
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.errors import from_rpc_error
from spiderflow.rpc.server import RpcServer, open_channel, serve
from spiderflow.security.auth import Authenticator, AuthInterceptor, TokenTable, bearer_metadata
from spiderflow.security.identity import Principal, Role
from spiderflow.security.ratelimit import RateLimiter
from spiderflow.security.tls import channel_credentials, server_credentials
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "examples/topology-3.yaml"
TOKENS = {"alice-token-0123456789": Principal(role=Role.TENANT, name="alice"),
          "bob-token-000123456789": Principal(role=Role.TENANT, name="bob"),
          "ohio-token-00123456789": Principal(role=Role.AGENT, name="ohio")}
Code = grpc.StatusCode


@dataclass(kw_only=True)
class Mesh:
    store: EtcdStore
    repo: JobRepository
    mtls: RpcServer
    plain: RpcServer
    certs: Path

    def channel(self, bundle: str | None) -> grpc.aio.Channel:
        if bundle is None:
            return open_channel(self.plain.address)
        return open_channel(self.mtls.address, credentials=channel_credentials(self.certs / bundle))


@pytest.fixture
async def mesh(module_etcd: EtcdProcess, certs: Path) -> AsyncIterator[Mesh]:
    store = EtcdStore(module_etcd.endpoint)
    await store.delete_prefix(keys.ROOT)
    repo = JobRepository(store)
    tokens = TokenTable(TOKENS)

    def servicers() -> list[object]:
        return [SchedulerService(repo, max_watches=4, limiter=RateLimiter(rate=2.0, burst=5.0)), PlannerService()]

    mtls = await serve(servicers(), credentials=server_credentials(certs / "scheduler"),
                       interceptors=[AuthInterceptor(Authenticator(tokens=tokens, certificates=True))])
    plain = await serve(servicers(), interceptors=[AuthInterceptor(Authenticator(tokens=tokens))])
    try:
        yield Mesh(store=store, repo=repo, mtls=mtls, plain=plain, certs=certs)
    finally:
        await mtls.stop(grace_s=0)
        await plain.stop(grace_s=0)
        await store.close()


def _job(job_id: str, tenant: str = "") -> types_pb2.JobSpec:
    doc: dict[str, Any] = {"id": job_id, "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 5,
                           "gpus": {"min": 1, "max": 2}}
    spec = convert.job_to_proto(job_from_dict(doc))
    spec.tenant = tenant
    return spec


def _plan_request(tenant: str) -> planner_pb2.PlanRequest:
    return planner_pb2.PlanRequest(topology=convert.topology_to_proto(load_topology(TOPOLOGY)),
                                   job=_job("p1", tenant))


def _estimate_request(tenant: str) -> planner_pb2.EstimateRequest:
    return planner_pb2.EstimateRequest(topology=convert.topology_to_proto(load_topology(TOPOLOGY)),
                                       job=_job("p1", tenant))


async def _call(channel: grpc.aio.Channel, rpc: str, request: Any, metadata: Any = ()) -> Any:
    """One call of ``rpc`` (``Service/Method``); streams are read to the end. Returns the response(s)."""
    service, method = rpc.split("/")
    stub: Any = (scheduler_pb2_grpc.SchedulerStub(channel) if service == "Scheduler"
                 else planner_pb2_grpc.PlannerStub(channel))
    fn = getattr(stub, method)
    if method == "WatchJob":
        return [m async for m in fn(request, metadata=metadata, timeout=10)]
    return await fn(request, metadata=metadata, timeout=10)


async def _code(channel: grpc.aio.Channel, rpc: str, request: Any, metadata: Any = ()) -> grpc.StatusCode:
    try:
        await _call(channel, rpc, request, metadata)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


def _every_rpc(job_id: str, tenant: str) -> list[tuple[str, Any]]:
    return [
        ("Scheduler/SubmitJob", scheduler_pb2.SubmitJobRequest(request_id=f"r-{job_id}", job=_job(job_id, tenant))),
        ("Scheduler/GetJob", scheduler_pb2.GetJobRequest(job_id=job_id)),
        ("Scheduler/ListJobs", scheduler_pb2.ListJobsRequest(tenant=tenant)),
        ("Scheduler/WatchJob", scheduler_pb2.WatchJobRequest(job_id=job_id)),
        ("Scheduler/CancelJob", scheduler_pb2.CancelJobRequest(job_id=job_id)),
        ("Scheduler/ReportProgress", scheduler_pb2.ReportProgressRequest(job_id=job_id, cluster="ohio", attempt=1)),
        ("Planner/Plan", _plan_request(tenant)),
        ("Planner/Estimate", _estimate_request(tenant)),
    ]


async def test_every_rpc_refuses_unauthenticated_calls(mesh: Mesh, other_ca: Path) -> None:
    # A job exists, so a refusal is about the caller and not about a missing job.
    async with mesh.channel("tenant-alice") as ch:
        await _call(ch, "Scheduler/SubmitJob", _every_rpc("a-1", "")[0][1])
    async with mesh.channel(None) as plain:
        for rpc, req in _every_rpc("a-1", "alice"):
            assert await _code(plain, rpc, req) is Code.UNAUTHENTICATED, rpc
            assert await _code(plain, rpc, req, bearer_metadata("forged-token-0123456789")) is Code.UNAUTHENTICATED
            assert await _code(plain, rpc, req, [("authorization", "Basic YWxpY2U=")]) is Code.UNAUTHENTICATED
        # Health checking needs no identity (load balancers).
        health = await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # mTLS: without a client certificate, with one from another CA, or in plaintext there is no connection.
    ca = (mesh.certs / "scheduler" / "ca.crt").read_bytes()
    foreign = other_ca / "tenant-alice"
    for creds in [grpc.ssl_channel_credentials(root_certificates=ca),
                  grpc.ssl_channel_credentials(root_certificates=ca, private_key=(foreign / "tls.key").read_bytes(),
                                               certificate_chain=(foreign / "tls.crt").read_bytes()),
                  None]:
        async with open_channel(mesh.mtls.address, credentials=creds) as ch:
            for rpc, req in _every_rpc("a-1", "alice"):
                assert await _code(ch, rpc, req) is Code.UNAVAILABLE, rpc
    assert [j.record.id for j in (await mesh.repo.list())[0]] == ["alice~a-1"]  # nothing written by a refused call


async def _place(mesh: Mesh) -> None:
    cycle = SchedulingCycle(mesh.repo, StaticTopologySource.from_file(TOPOLOGY), default_policy="spinsearch",
                            budget=Budget(time_limit_s=5.0))
    await cycle.run()


async def test_every_rpc_refuses_the_wrong_tenant(mesh: Mesh) -> None:
    async with mesh.channel("tenant-alice") as alice, mesh.channel("tenant-bob") as bob, \
            mesh.channel("admin") as admin:
        sub = scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("a-1"))
        resp = await _call(alice, "Scheduler/SubmitJob", sub)
        assert resp.created and resp.job.spec.tenant == "alice"  # the tenant comes from the certificate
        await _call(bob, "Scheduler/SubmitJob", scheduler_pb2.SubmitJobRequest(request_id="r-2", job=_job("b-1")))
        expected = {
            "Scheduler/SubmitJob": Code.PERMISSION_DENIED,  # submitting for tenant alice
            "Scheduler/GetJob": Code.NOT_FOUND,  # another tenant's job looks like no job
            "Scheduler/ListJobs": Code.PERMISSION_DENIED,  # listing tenant alice
            "Scheduler/WatchJob": Code.NOT_FOUND,
            "Scheduler/CancelJob": Code.NOT_FOUND,
            "Scheduler/ReportProgress": Code.PERMISSION_DENIED,  # a tenant is not an agent
            "Planner/Plan": Code.PERMISSION_DENIED,  # planning tenant alice's job
            "Planner/Estimate": Code.PERMISSION_DENIED,
        }
        for rpc, req in _every_rpc("a-1", "alice"):
            assert await _code(bob, rpc, req) is expected[rpc], rpc
        # Bob's own view: only his job; Alice's job untouched.
        listed = await _call(bob, "Scheduler/ListJobs", scheduler_pb2.ListJobsRequest())
        assert [j.spec.id for j in listed.jobs] == ["bob~b-1"]
        got = await _call(alice, "Scheduler/GetJob", scheduler_pb2.GetJobRequest(job_id="a-1"))
        assert got.job.state == types_pb2.JOB_STATE_PENDING
        # Alice may use the planner for her own jobs; the admin sees everything.
        assert (await _call(alice, "Planner/Plan", _plan_request(""))).plan.stages
        listed = await _call(admin, "Scheduler/ListJobs", scheduler_pb2.ListJobsRequest())
        assert sorted(j.spec.id for j in listed.jobs) == ["alice~a-1", "bob~b-1"]
        # A token over an mTLS connection acts as the token's principal.
        tok = await _call(admin, "Scheduler/ListJobs", scheduler_pb2.ListJobsRequest(),
                          bearer_metadata("bob-token-000123456789"))
        assert [j.spec.id for j in tok.jobs] == ["bob~b-1"]


async def test_progress_only_from_an_agent_running_a_stage(mesh: Mesh) -> None:
    async with mesh.channel("tenant-alice") as alice:
        await _call(alice, "Scheduler/SubmitJob",
                    scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("a-1")))
    await _place(mesh)
    record = (await mesh.repo.get("alice~a-1")).record
    assert record.plan is not None
    running = {s.cluster for s in record.plan.stages}
    idle = sorted({"virginia", "ohio", "oregon"} - running)
    on, off = sorted(running)[0], idle[0]
    report = scheduler_pb2.ReportProgressRequest(job_id="alice~a-1", attempt=record.attempt,
                                                 progress=[types_pb2.ProgressEvent(step=2, steps_total=5)])
    async with mesh.channel(f"agent-{off}") as stranger, mesh.channel(f"agent-{on}") as agent, \
            mesh.channel("admin") as admin:
        assert await _code(stranger, "Scheduler/ReportProgress", report) is Code.PERMISSION_DENIED
        claimed = scheduler_pb2.ReportProgressRequest()
        claimed.CopyFrom(report)
        claimed.cluster = off
        assert await _code(agent, "Scheduler/ReportProgress", claimed) is Code.PERMISSION_DENIED
        assert await _code(admin, "Scheduler/ReportProgress", report) is Code.PERMISSION_DENIED
        assert await _code(stranger, "Scheduler/GetJob",
                           scheduler_pb2.GetJobRequest(job_id="alice~a-1")) is Code.NOT_FOUND
        resp = await _call(agent, "Scheduler/ReportProgress", report)
        assert resp.accepted and not resp.stop
        # The agent sees the job it runs, but may not cancel it or submit or list.
        seen = await _call(agent, "Scheduler/GetJob", scheduler_pb2.GetJobRequest(job_id="alice~a-1"))
        assert seen.job.progress.step == 2
        assert await _code(agent, "Scheduler/CancelJob",
                           scheduler_pb2.CancelJobRequest(job_id="alice~a-1")) is Code.PERMISSION_DENIED
        assert await _code(agent, "Scheduler/ListJobs", scheduler_pb2.ListJobsRequest()) is Code.PERMISSION_DENIED
        assert await _code(agent, "Planner/Plan", _plan_request("")) is Code.PERMISSION_DENIED
    assert (await mesh.repo.get("alice~a-1")).record.progress.step == 2


async def test_submit_rate_limit_per_client(mesh: Mesh) -> None:
    async with mesh.channel("tenant-alice") as alice, mesh.channel("tenant-bob") as bob:
        codes = [await _code(alice, "Scheduler/SubmitJob",
                             scheduler_pb2.SubmitJobRequest(request_id=f"r-{i}", job=_job(f"a-{i}")))
                 for i in range(8)]
        assert codes[:5] == [Code.OK] * 5 and Code.RESOURCE_EXHAUSTED in codes[5:]
        try:
            await _call(alice, "Scheduler/SubmitJob", scheduler_pb2.SubmitJobRequest(request_id="r-x",
                                                                                     job=_job("a-x")))
            raise AssertionError("expected RESOURCE_EXHAUSTED")
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e)
            assert isinstance(err, ResourceExhaustedError) and err.retry_after_s and 0 < err.retry_after_s <= 0.5
            assert "retry in" in (e.details() or "")
        # Bob has his own bucket.
        assert await _code(bob, "Scheduler/SubmitJob",
                           scheduler_pb2.SubmitJobRequest(request_id="r-b", job=_job("b-1"))) is Code.OK
        await asyncio.sleep(0.6)  # refills at 2/s
        assert await _code(alice, "Scheduler/SubmitJob",
                           scheduler_pb2.SubmitJobRequest(request_id="r-y", job=_job("a-y"))) is Code.OK
    ids = sorted(j.record.id for j in (await mesh.repo.list())[0])
    assert ids == sorted([f"alice~a-{i}" for i in range(8) if codes[i] is Code.OK] + ["bob~b-1", "alice~a-y"])


async def test_watchers_that_never_read_cannot_stall_the_service(mesh: Mesh) -> None:
    async with mesh.channel("admin") as admin:
        await _call(admin, "Scheduler/SubmitJob", scheduler_pb2.SubmitJobRequest(request_id="r-1", job=_job("w-1")))
        stub = scheduler_pb2_grpc.SchedulerStub(admin)
        # Four streams (the bound) that are opened and never read past their first message.
        idle = [stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id="w-1")) for _ in range(4)]
        for call in idle:
            first = await call.read()
            assert first.job.spec.id == "w-1"  # the admin submitted it for the default tenant
        with pytest.raises(grpc.aio.AioRpcError) as over:
            await _call(admin, "Scheduler/WatchJob", scheduler_pb2.WatchJobRequest(job_id="w-1"))
        assert over.value.code() is Code.RESOURCE_EXHAUSTED
        # Everything else still answers promptly.
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(20):
            await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="w-1"), timeout=2)
        assert loop.time() - t0 < 10
        # A state change still reaches the idle watchers' buffers; closing them frees their slots.
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id="w-1"), timeout=5)
        for call in idle:
            call.cancel()
        await asyncio.sleep(0.3)
        events = await _call(admin, "Scheduler/WatchJob", scheduler_pb2.WatchJobRequest(job_id="w-1"))
        assert events[0].job.state == types_pb2.JOB_STATE_CANCELLED


async def test_max_message_size_is_enforced() -> None:
    server = await serve([PlannerService()], max_message_bytes=4096)
    try:
        async with open_channel(server.address) as ch:
            big = _plan_request("")
            big.job.id = "x" * 10_000
            assert await _code(ch, "Planner/Plan", big) is Code.RESOURCE_EXHAUSTED
            small = _plan_request("")
            assert await _code(ch, "Planner/Estimate", small) is not Code.RESOURCE_EXHAUSTED
    finally:
        await server.stop(grace_s=0)


async def test_queue_bound_counts_exactly_at_the_limit(module_etcd: EtcdProcess) -> None:
    store = EtcdStore(module_etcd.endpoint)
    await store.delete_prefix(keys.ROOT)
    server = await serve([SchedulerService(JobRepository(store), max_queued=3)])
    try:
        async with open_channel(server.address) as ch:
            def sub(i: int) -> scheduler_pb2.SubmitJobRequest:
                return scheduler_pb2.SubmitJobRequest(request_id=f"q-{i}", job=_job(f"q-{i}"))

            assert [await _code(ch, "Scheduler/SubmitJob", sub(i)) for i in range(3)] == [Code.OK] * 3
            assert await _code(ch, "Scheduler/SubmitJob", sub(3)) is Code.RESOURCE_EXHAUSTED
            await _call(ch, "Scheduler/CancelJob", scheduler_pb2.CancelJobRequest(job_id="q-0"))
            assert await _code(ch, "Scheduler/SubmitJob", sub(4)) is Code.OK  # recounted at the bound
            assert await _code(ch, "Scheduler/SubmitJob", sub(5)) is Code.RESOURCE_EXHAUSTED
    finally:
        await server.stop(grace_s=0)
        await store.close()
