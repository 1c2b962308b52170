"""The fused server interceptor (:mod:`spiderflow.rpc.pipeline`) on real gRPC servers: metrics, authentication
and the decode guard keep their order and meaning in one pass (a refused call is counted and never parsed;
an authenticated call with undecodable bytes is INVALID_ARGUMENT naming ``request``; health checking needs no
identity), and a client certificate is parsed once, not at every call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spiderflow import metrics
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.rpc.pipeline import CallPipeline, fuse
from spiderflow.rpc.server import open_channel, serve
from spiderflow.security import auth as auth_module
from spiderflow.security.auth import Authenticator, AuthInterceptor, TokenTable, bearer_metadata
from spiderflow.security.guard import DecodeGuard
from spiderflow.security.identity import Principal, Role, current_principal
from spiderflow.security.tls import channel_credentials, server_credentials

PLAN = "/spiderflow.planner.v1.Planner/Plan"
TOKEN = "carol-token-0123456789"


class Whoami(planner_pb2_grpc.PlannerServicer):
    """Answers every Plan call NOT_FOUND with the caller's principal as the details."""

    async def Plan(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.NOT_FOUND, str(current_principal()))


def _count(code: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "spiderflow_rpc_requests_total",
        {"service": "spiderflow.planner.v1.Planner", "method": "Plan", "code": code}) or 0.0


async def _raw_plan(channel: grpc.aio.Channel, payload: bytes, metadata: Any = ()) -> grpc.aio.AioRpcError:
    call = channel.unary_unary(PLAN, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(payload, timeout=10, metadata=metadata)
    return err.value


def test_the_services_interceptors_become_one() -> None:
    tokens = TokenTable({TOKEN: Principal(role=Role.TENANT, name="carol")})
    for given in ([metrics.RpcMetricsInterceptor(), AuthInterceptor(Authenticator(tokens=tokens))],
                  [metrics.RpcMetricsInterceptor()], [AuthInterceptor(Authenticator(tokens=tokens))], []):
        fused = fuse(list(given))
        assert len(fused) == 1 and isinstance(fused[0], CallPipeline)
    other = DecodeGuard()  # an interceptor it does not know: the chain stays, the guard last
    chain = fuse([metrics.RpcMetricsInterceptor(), other])
    assert chain[:2] == [chain[0], other] and isinstance(chain[-1], DecodeGuard) and len(chain) == 3


async def test_one_pass_keeps_refusal_before_parsing_the_guard_and_the_metrics() -> None:
    tokens = TokenTable({TOKEN: Principal(role=Role.TENANT, name="carol")})
    server = await serve([Whoami()], interceptors=[metrics.RpcMetricsInterceptor(),
                                                   AuthInterceptor(Authenticator(tokens=tokens))])
    channel = open_channel(server.address)
    try:
        before = {c: _count(c) for c in ("UNAUTHENTICATED", "INVALID_ARGUMENT", "NOT_FOUND")}
        # undecodable bytes without a token: refused for the missing identity, never parsed
        err = await _raw_plan(channel, b"\xff\xff\xff")
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED
        err = await _raw_plan(channel, b"\xff\xff\xff", bearer_metadata("unknown-token-0123456789"))
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED and "unknown bearer token" in (err.details() or "")
        # the same bytes from an authenticated caller: the guard names the request
        err = await _raw_plan(channel, b"\xff\xff\xff", bearer_metadata(TOKEN))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and (err.details() or "").startswith("request:")
        # a valid request runs as the token's principal
        stub: Any = planner_pb2_grpc.PlannerStub(channel)  # type: ignore[no-untyped-call]
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Plan(planner_pb2.PlanRequest(), timeout=10, metadata=bearer_metadata(TOKEN))
            assert caught.value.code() is grpc.StatusCode.NOT_FOUND and caught.value.details() == "tenant:carol"
        # health checking needs no identity
        health: Any = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert _count("UNAUTHENTICATED") == before["UNAUTHENTICATED"] + 2  # refused calls are counted
        assert _count("INVALID_ARGUMENT") == before["INVALID_ARGUMENT"] + 1
        assert _count("NOT_FOUND") == before["NOT_FOUND"] + 2
    finally:
        await channel.close()
        await server.stop(grace_s=0)


async def test_a_client_certificate_is_parsed_once_and_names_its_caller_at_every_call(
        certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    real = auth_module.principal_of_pem  # type: ignore[attr-defined]

    def counting(pem: bytes) -> Principal | None:
        parsed.append(pem)
        return real(pem)

    monkeypatch.setattr(auth_module, "principal_of_pem", counting)
    server = await serve([Whoami()], credentials=server_credentials(certs / "scheduler"),
                         interceptors=[metrics.RpcMetricsInterceptor(),
                                       AuthInterceptor(Authenticator(certificates=True))])
    try:
        for bundle, name in (("tenant-alice", "tenant:alice"), ("tenant-bob", "tenant:bob")):
            channel = open_channel(server.address, credentials=channel_credentials(certs / bundle))
            stub: Any = planner_pb2_grpc.PlannerStub(channel)  # type: ignore[no-untyped-call]
            try:
                for _ in range(3):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stub.Plan(planner_pb2.PlanRequest(), timeout=10)
                    assert caught.value.code() is grpc.StatusCode.NOT_FOUND and caught.value.details() == name
            finally:
                await channel.close()
        assert len(parsed) == 2 and parsed[0] != parsed[1]  # once per certificate, not per call
    finally:
        await server.stop(grace_s=0)
