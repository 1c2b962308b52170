"""Long idle streams survive client keepalive pings (no GOAWAY "too_many_pings")."""

from __future__ import annotations

import asyncio

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spiderflow.proto.planner.v1 import planner_pb2_grpc
from spiderflow.rpc.server import serve


class _Planner(planner_pb2_grpc.PlannerServicer):
    pass


async def test_idle_watch_survives_frequent_client_pings() -> None:
    server = await serve([_Planner()], port=0)
    # Pings every 500 ms: far more often than the server's own policy allows, as a stress of the policy.
    channel = grpc.aio.insecure_channel(server.address, options=[
        ("grpc.keepalive_time_ms", 500), ("grpc.keepalive_timeout_ms", 2000),
        ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1),
    ])
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        name = "spiderflow.planner.v1.Planner"
        stream = stub.Watch(health_pb2.HealthCheckRequest(service=name))
        first = await stream.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(4.0)  # idle: only pings flow
        await server.set_serving(name, False)
        nxt = await asyncio.wait_for(stream.read(), timeout=5)
        assert nxt.status == health_pb2.HealthCheckResponse.NOT_SERVING
        stream.cancel()
    finally:
        await channel.close()
        await server.stop(grace_s=0)
