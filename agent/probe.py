"""Probing a peer agent: latency by echo round trips, bandwidth by a timed bulk upload.

- **Latency**: ``echo_count`` sequential ``ProbeEcho`` calls with an ``echo_bytes`` payload; one-way
  latency = median round-trip time / 2 (the median ignores a scheduling hiccup or two). Echo replies
  come back over the peer → self direction, which a bulk probe *into* this agent may be filling at that
  moment (queueing would inflate the round trip). So the echoes wait (bounded) until no bulk probe is
  being received (:class:`Ingress`), and an echo during which one was received is only used when no
  clean echo exists.
- **Bandwidth** ``self → peer``: one ``ProbeUpload`` stream of up to ``bulk_bytes`` in ``chunk_bytes``
  messages, stopped early after ``bulk_max_s`` seconds or when this cluster becomes busy. The peer
  timestamps the arrival of the first and the last chunk; bandwidth = bytes after the first chunk /
  that interval (so connection set-up and the path's latency do not count). A peer that is busy
  training refuses with UNAVAILABLE: the result then has latency only.

Every call has a deadline (``timeout_s``, plus ``bulk_max_s`` for the bulk stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc
import grpc.aio
import structlog

from agent.config import ProbeConfig
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc

__all__ = ["Ingress", "ProbeResult", "measure_latency", "measure_upload", "probe_peer"]

log = structlog.get_logger(__name__)


class Ingress:
    """Bulk probes this agent is receiving right now. ``generation`` changes whenever one starts or
    ends, so a caller can tell whether one overlapped an interval."""

    def __init__(self) -> None:
        self.active = 0
        self.generation = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Mark one bulk probe as being received for the duration of the block."""
        self.active += 1
        self.generation += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            self.generation += 1
            if self.active == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is received (at most ``timeout`` s); True if idle."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self.active == 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """One probe of ``peer``: one-way ``latency_ms`` from ``rtt_samples`` echoes, and
    ``bandwidth_gbps`` from ``probe_bytes`` bulk bytes (None/0 when no bulk probe was made)."""

    peer: str
    latency_ms: float
    rtt_samples: int
    bandwidth_gbps: float | None
    probe_bytes: int
    measured_at: float


async def measure_latency(
    stub: agent_pb2_grpc.AgentStub, config: ProbeConfig, ingress: Ingress | None = None
) -> tuple[float, int]:
    """``(one-way latency ms, samples used)``: median echo round trip / 2 (clean echoes preferred, see
    the module docstring)."""
    payload = b"\x00" * config.echo_bytes
    if ingress is not None:
        await ingress.wait_idle(config.bulk_max_s + config.timeout_s)
    clean: list[float] = []
    dirty: list[float] = []
    for seq in range(config.echo_count):
        generation = ingress.generation if ingress else 0
        quiet = ingress is None or ingress.active == 0
        t0 = time.perf_counter()
        resp = await stub.ProbeEcho(agent_pb2.ProbeEchoRequest(payload=payload, sequence=seq),
                                    timeout=config.timeout_s)
        rtt = time.perf_counter() - t0
        if resp.sequence != seq:
            continue
        if quiet and (ingress is None or ingress.generation == generation):
            clean.append(rtt)
        else:
            dirty.append(rtt)
    rtts = clean or dirty
    if not rtts:
        raise ValueError("no echo came back intact")
    return statistics.median(rtts) * 1000.0 / 2.0, len(rtts)


async def measure_upload(
    stub: agent_pb2_grpc.AgentStub, source: str, config: ProbeConfig, busy: Callable[[], bool]
) -> tuple[float, int] | None:
    """``(Gbit/s, bytes sent)`` of a bulk upload to the peer, or None when it could not be measured
    (interrupted because this cluster became busy, or too little arrived to time)."""
    chunk = b"\x00" * config.chunk_bytes
    first = min(config.chunk_bytes, config.bulk_bytes)
    interrupted = False

    async def chunks() -> AsyncIterator[agent_pb2.ProbeUploadRequest]:
        nonlocal interrupted
        sent = 0
        t0 = time.monotonic()
        while sent < config.bulk_bytes:
            if busy():
                interrupted = True
                return
            if sent and time.monotonic() - t0 >= config.bulk_max_s:
                return
            n = min(config.chunk_bytes, config.bulk_bytes - sent)
            yield agent_pb2.ProbeUploadRequest(source=source if sent == 0 else "", data=chunk[:n])
            sent += n

    resp = await stub.ProbeUpload(chunks(), timeout=config.timeout_s + config.bulk_max_s)
    if interrupted or resp.seconds <= 0 or resp.bytes_received <= first:
        return None
    gbps = (resp.bytes_received - first) * 8 / resp.seconds / 1e9
    return gbps, int(resp.bytes_received)


async def probe_peer(
    stub: agent_pb2_grpc.AgentStub, *, source: str, peer: str, config: ProbeConfig, busy: Callable[[], bool],
    bulk: bool = True, ingress: Ingress | None = None,
) -> ProbeResult:
    """Latency, then (if ``bulk`` and not busy) bandwidth to ``peer``. Raises ``grpc.RpcError`` when
    the peer cannot be reached for the latency probe."""
    latency, samples = await measure_latency(stub, config, ingress)
    bandwidth: float | None = None
    nbytes = 0
    if bulk and not busy():
        try:
            out = await measure_upload(stub, source, config, busy)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            log.info("agent.bulk_probe_refused", cluster=source, peer=peer, reason=e.details())
            out = None
        if out is not None:
            bandwidth, nbytes = out
    return ProbeResult(peer=peer, latency_ms=latency, rtt_samples=samples, bandwidth_gbps=bandwidth,
                       probe_bytes=nbytes, measured_at=time.time())
