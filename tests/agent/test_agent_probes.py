"""The Agent service's probe RPCs on an in-process server (port 0), and the probing client against it:
echo, bulk upload/download with caps, UNAVAILABLE while busy, latency-only results for a busy peer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest

from agent.config import ProbeConfig
from agent.probe import Ingress, measure_latency, probe_peer
from agent.service import AgentService
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.rpc.server import open_channel, serve

pytestmark = pytest.mark.timeout(60)


@dataclass
class FakeState:
    busy: bool = False
    serve_cap_bytes: int = 1 << 20
    ingress: Ingress = field(default_factory=Ingress)

    def status(self) -> agent_pb2.GetStatusResponse:
        return agent_pb2.GetStatusResponse(agent_id="x-1", training=self.busy)


@pytest.fixture
async def peer() -> AsyncIterator[tuple[FakeState, agent_pb2_grpc.AgentStub]]:
    state = FakeState()
    server = await serve([AgentService(state)], host="127.0.0.1", port=0)
    channel = open_channel(server.address)
    try:
        yield state, agent_pb2_grpc.AgentStub(channel)
    finally:
        await channel.close()
        await server.stop(grace_s=0)


CFG = ProbeConfig(echo_count=3, echo_bytes=16, bulk_bytes=512 * 1024, chunk_bytes=64 * 1024, bulk_max_s=2.0,
                  timeout_s=5.0)


async def test_echo_and_latency(peer: tuple[FakeState, agent_pb2_grpc.AgentStub]) -> None:
    _, stub = peer
    resp = await stub.ProbeEcho(agent_pb2.ProbeEchoRequest(payload=b"abc", sequence=7))
    assert (resp.payload, resp.sequence) == (b"abc", 7)
    latency, samples = await measure_latency(stub, CFG)
    assert samples == 3 and 0 <= latency < 1000
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ProbeEcho(agent_pb2.ProbeEchoRequest(payload=b"x" * (65 * 1024)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "payload" in (info.value.details() or "")


async def test_bulk_probe_measures_and_respects_the_cap(peer: tuple[FakeState, agent_pb2_grpc.AgentStub]) -> None:
    _, stub = peer
    r = await probe_peer(stub, source="a", peer="b", config=CFG, busy=lambda: False)
    assert r.bandwidth_gbps is not None and r.bandwidth_gbps > 0 and r.probe_bytes == 512 * 1024
    assert r.rtt_samples == 3 and r.latency_ms >= 0
    too_big = ProbeConfig(bulk_bytes=2 << 20, chunk_bytes=256 * 1024)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await probe_peer(stub, source="a", peer="b", config=too_big, busy=lambda: False)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data" in (info.value.details() or "")
    # Download: streams exactly what was asked, refuses beyond the cap.
    got = 0
    async for chunk in stub.ProbeDownload(agent_pb2.ProbeDownloadRequest(source="a", total_bytes=300_000,
                                                                         chunk_bytes=100_000)):
        got += len(chunk.data)
    assert got == 300_000
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.ProbeDownload(agent_pb2.ProbeDownloadRequest(source="a", total_bytes=2 << 20)):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "total_bytes" in (info.value.details() or "")


async def test_busy_peer_refuses_bulk_and_gives_latency_only(peer: tuple[FakeState, agent_pb2_grpc.AgentStub]) -> None:
    state, stub = peer
    state.busy = True
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.ProbeDownload(agent_pb2.ProbeDownloadRequest(source="a", total_bytes=1000)):
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    r = await probe_peer(stub, source="a", peer="b", config=CFG, busy=lambda: False)
    assert r.bandwidth_gbps is None and r.probe_bytes == 0 and r.rtt_samples == 3
    assert (await stub.GetStatus(agent_pb2.GetStatusRequest())).training


async def test_busy_prober_sends_no_bulk(peer: tuple[FakeState, agent_pb2_grpc.AgentStub]) -> None:
    _, stub = peer
    r = await probe_peer(stub, source="a", peer="b", config=CFG, busy=lambda: True)
    assert r.bandwidth_gbps is None and r.probe_bytes == 0


async def test_echoes_wait_for_incoming_bulk_probes_to_end(peer: tuple[FakeState, agent_pb2_grpc.AgentStub]) -> None:
    _, stub = peer
    ingress = Ingress()

    async def hold() -> None:
        with ingress.receiving():
            await asyncio.sleep(0.3)

    task = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert ingress.active == 1
    t0 = time.monotonic()
    _, samples = await measure_latency(stub, CFG, ingress)
    assert time.monotonic() - t0 >= 0.25 and samples == 3 and ingress.active == 0
    await task
    # Nothing clean within the bound: all echoes are used.
    short = ProbeConfig(echo_count=3, bulk_max_s=0.05, timeout_s=0.5, bulk_bytes=1024, chunk_bytes=1024)
    with ingress.receiving():
        _, samples = await measure_latency(stub, short, ingress)
    assert samples == 3
