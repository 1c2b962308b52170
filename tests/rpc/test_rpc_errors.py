"""Domain errors keep their meaning across a real gRPC call, both ways, unary and streaming."""

from __future__ import annotations

import json

import grpc
import grpc.aio
import pytest
from google.protobuf import json_format
from rpc_helpers import DOMAIN_ERRORS

from spiderflow.core import errors as E
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.errors import (
    ERROR_METADATA_KEY,
    STATUS_CODES,
    RemoteError,
    domain_errors,
    from_rpc_error,
    rpc_method,
    status_for,
)

EXPECTED_CODES = {
    "ValidationError": grpc.StatusCode.INVALID_ARGUMENT,
    "NotFoundError": grpc.StatusCode.NOT_FOUND,
    "AlreadyExistsError": grpc.StatusCode.ALREADY_EXISTS,
    "ConflictError": grpc.StatusCode.ABORTED,
    "PreconditionError": grpc.StatusCode.FAILED_PRECONDITION,
    "UnschedulableError": grpc.StatusCode.FAILED_PRECONDITION,
    "PermissionDeniedError": grpc.StatusCode.PERMISSION_DENIED,
    "ResourceExhaustedError": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UnavailableError": grpc.StatusCode.UNAVAILABLE,
}


def test_table_covers_every_domain_error() -> None:
    domain = {c for c in vars(E).values() if isinstance(c, type) and issubclass(c, E.SpiderFlowError)}
    assert {c for c, _ in STATUS_CODES} == domain - {E.SpiderFlowError}
    for name, code in EXPECTED_CODES.items():
        assert status_for(DOMAIN_ERRORS[name]) is code
    assert grpc.StatusCode.INTERNAL not in {code for _, code in STATUS_CODES}
    assert status_for(NotImplementedError()) is grpc.StatusCode.UNIMPLEMENTED
    assert status_for(KeyError("x")) is grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("name", sorted(DOMAIN_ERRORS))
async def test_unary_domain_error_maps_to_code_and_back(channel: grpc.aio.Channel, name: str) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    sent = DOMAIN_ERRORS[name]
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=name))
    assert raw.value.code() is EXPECTED_CODES[name]
    assert raw.value.details() == str(sent)
    doc = json.loads(dict(raw.value.trailing_metadata())[ERROR_METADATA_KEY])
    assert doc["class"] == name

    with pytest.raises(E.SpiderFlowError) as got, domain_errors():
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=name))
    assert type(got.value) is type(sent)
    assert str(got.value) == str(sent)
    if isinstance(sent, E.ValidationError):
        assert isinstance(got.value, E.ValidationError)
        assert (got.value.field, got.value.reason, got.value.value) == (sent.field, sent.reason, sent.value)
    if isinstance(sent, E.UnschedulableError):
        assert isinstance(got.value, E.UnschedulableError) and got.value.constraint == "memory"


@pytest.mark.parametrize("name", ["ValidationError", "ConflictError", "UnavailableError"])
async def test_streaming_error_after_messages(channel: grpc.aio.Channel, name: str) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    received: list[scheduler_pb2.WatchJobResponse] = []
    with pytest.raises(E.SpiderFlowError) as got, domain_errors():
        async for msg in stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=name)):
            received.append(msg)
    assert [m.revision for m in received] == [1, 2]
    assert type(got.value) is type(DOMAIN_ERRORS[name])
    assert str(got.value) == str(DOMAIN_ERRORS[name])


async def test_huge_error_value_is_clipped(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    with pytest.raises(E.ValidationError) as got, domain_errors():
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="huge"))
    assert got.value.field == "topology.clusters" and got.value.reason == "must be an object"
    assert isinstance(got.value.value, str) and len(got.value.value) <= 512


async def test_stream_without_error_completes(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    with domain_errors():
        got = [m.WhichOneof("event") async for m in stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id="ok"))]
    assert got == ["job", "progress"]


async def test_converter_validation_reaches_client_with_field(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    bad = {"id": "j1", "model": "gpt-99", "global_batch": 8, "gpus": {"min": 1, "max": 2}}
    request = scheduler_pb2.SubmitJobRequest(request_id="r1", job=json_format.ParseDict(bad, types_pb2.JobSpec()))
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.SubmitJob(request)
    assert raw.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert raw.value.details().startswith("job.model: unknown model preset")
    with pytest.raises(E.ValidationError) as got, domain_errors():
        await stub.SubmitJob(request)
    assert got.value.field == "job.model" and got.value.value == "gpt-99"
    good = {**bad, "model": "gpt-tiny"}
    request = scheduler_pb2.SubmitJobRequest(request_id="r1", job=json_format.ParseDict(good, types_pb2.JobSpec()))
    with domain_errors():
        reply = await stub.SubmitJob(request)
    assert reply.created and reply.job.spec.id == "j1" and reply.job.state == types_pb2.JOB_STATE_PENDING


async def test_unexpected_exception_is_internal_without_details(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="runtime"))
    assert raw.value.code() is grpc.StatusCode.INTERNAL
    assert "secret" not in raw.value.details() and "RuntimeError" in raw.value.details()
    with pytest.raises(RemoteError) as got, domain_errors():
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="runtime"))
    assert got.value.code is grpc.StatusCode.INTERNAL
    with pytest.raises(RemoteError) as got, domain_errors():
        async for _ in stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id="runtime")):
            pass
    assert got.value.code is grpc.StatusCode.INTERNAL


async def test_not_implemented(channel: grpc.aio.Channel) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    with pytest.raises(RemoteError) as got, domain_errors():
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="unimplemented"))
    assert got.value.code is grpc.StatusCode.UNIMPLEMENTED and "archived" in got.value.details
    # A method the servicer does not override: the generated base class answers UNIMPLEMENTED.
    with pytest.raises(RemoteError) as got, domain_errors():
        await stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id="j1"))
    assert got.value.code is grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("INVALID_ARGUMENT", E.ValidationError),
        ("NOT_FOUND", E.NotFoundError),
        ("ABORTED", E.ConflictError),
        ("FAILED_PRECONDITION", E.PreconditionError),
        ("UNAVAILABLE", E.UnavailableError),
        ("DEADLINE_EXCEEDED", E.UnavailableError),
        ("UNAUTHENTICATED", E.UnauthenticatedError),
        ("DATA_LOSS", RemoteError),
    ],
)
async def test_servicer_abort_passes_through_and_maps_by_code(
    channel: grpc.aio.Channel, code: str, cls: type[E.SpiderFlowError]
) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as raw:
        await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=f"abort:{code}"))
    assert raw.value.code() is grpc.StatusCode[code]
    assert raw.value.details() == "aborted by the servicer"
    err = from_rpc_error(raw.value)
    assert type(err) is cls
    if isinstance(err, E.ValidationError):
        assert err.field == "request" and err.reason == "aborted by the servicer"


async def test_unreachable_server_is_unavailable() -> None:
    from spiderflow.rpc.server import open_channel

    async with open_channel("127.0.0.1:1") as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        with pytest.raises(E.UnavailableError), domain_errors():
            await stub.GetJob(scheduler_pb2.GetJobRequest(job_id="x"), timeout=2)


def test_rpc_method_rejects_sync_functions() -> None:
    def sync(self, request, context):  # type: ignore[no-untyped-def]
        return None

    with pytest.raises(TypeError):
        rpc_method(sync)
