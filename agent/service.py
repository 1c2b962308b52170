"""The Agent gRPC service (``spiderflow.agent.v1.Agent``): the probe RPCs peers call, and GetStatus.

- ``ProbeEcho`` returns the payload (≤ 64 KiB, else INVALID_ARGUMENT naming ``payload``).
- ``ProbeUpload`` counts the bytes it receives and the seconds between the first and the last chunk's
  arrival. More than the agent's cap (``probe.serve_cap_bytes``) → INVALID_ARGUMENT (``data``).
- ``ProbeDownload`` streams ``total_bytes`` (``0 < total_bytes ≤ cap``) in ``chunk_bytes`` messages
  (0 = 256 KiB, at most 4 MiB).
- While the cluster trains (:meth:`agent.agent.Agent.set_busy`), both bulk probes are refused (or cut
  short) with UNAVAILABLE; echoes are still answered.
- ``GetStatus``: the reported profile, the agent's identity and address, ``training``, the latest probe
  of each peer, and every worker of the attempts this agent runs or recently ran
  (:class:`agent.workers.WorkerBoard`).
- ``WatchWorkers``: the current state of each known worker (of ``job_id``, or all), then every change
  and the training progress as they happen, until the caller cancels. A watcher that falls
  :data:`agent.workers.WATCH_QUEUE` events behind is ended with RESOURCE_EXHAUSTED and watches again.

- ``ReadLogs``: the workers' output this agent keeps (:mod:`spiderflow.joblogs`), from byte offsets
  (``0 ≤ offset ≤`` :data:`MAX_LOG_OFFSET`, else INVALID_ARGUMENT naming ``offsets[i].offset``; ``attempt``
  ≥ 0); with ``follow``, new output as it is written. On an mTLS server only a service or admin certificate may read
  (PERMISSION_DENIED otherwise): tenants read their logs through the scheduler, which checks the job's
  tenant.

Workers start and stop only through the scheduler's assignments (:mod:`agent.executor`): a job is
stopped with the scheduler's ``CancelJob``, which the agent follows; there is no RPC that starts or
stops workers behind the scheduler's back.

Callers (when the server authenticates, i.e. serves mTLS): the probes only peer agents, the control-plane
services and the admin; GetStatus, WatchWorkers and ReadLogs only the control plane and the admin. A
tenant's certificate is PERMISSION_DENIED on every RPC (:func:`require_caller`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import grpc.aio

from agent.probe import Ingress
from agent.workers import WATCH_QUEUE, WorkerBoard
from spiderflow import joblogs
from spiderflow.core.errors import PermissionDeniedError, ResourceExhaustedError, UnavailableError, ValidationError
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.rpc.errors import map_domain_errors
from spiderflow.security.identity import Role, current_principal

__all__ = ["MAX_CHUNK_BYTES", "MAX_ECHO_BYTES", "AgentService", "AgentState", "require_caller"]

PROBE_CALLERS = frozenset({Role.AGENT, Role.SERVICE, Role.ADMIN})
STATUS_CALLERS = frozenset({Role.SERVICE, Role.ADMIN})


def require_caller(roles: frozenset[Role], what: str) -> None:
    """PERMISSION_DENIED unless the caller's role is one of ``roles`` (anyone when the server does not
    authenticate)."""
    principal = current_principal()
    if principal is not None and principal.role not in roles:
        raise PermissionDeniedError(f"{principal} may not call {what} on an agent")

MAX_ECHO_BYTES = 64 * 1024
MAX_LOG_OFFSET = 1 << 53
"""Largest ``ReadLogs`` resume offset (bytes): far beyond any log file, and exact in JSON and doubles."""
DEFAULT_CHUNK_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024


class AgentState(Protocol):
    """What the servicer needs from the agent."""

    @property
    def busy(self) -> bool: ...

    @property
    def serve_cap_bytes(self) -> int: ...

    @property
    def ingress(self) -> Ingress: ...

    def status(self) -> agent_pb2.GetStatusResponse: ...


LOG_CHUNK_BYTES = 256 * 1024
LOG_POLL_S = 0.25


@map_domain_errors
class AgentService(agent_pb2_grpc.AgentServicer):
    """Thin adapter over an :class:`AgentState`."""

    def __init__(self, state: AgentState, *, work_dir: Path | None = None, cluster: str = "",
                 workers: WorkerBoard | None = None) -> None:
        self.state = state
        self.work_dir = work_dir
        self.cluster = cluster
        self.workers = workers if workers is not None else WorkerBoard()

    async def ProbeEcho(
        self, request: agent_pb2.ProbeEchoRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.ProbeEchoResponse:
        require_caller(PROBE_CALLERS, "ProbeEcho")
        if len(request.payload) > MAX_ECHO_BYTES:
            raise ValidationError("payload", f"must be ≤ {MAX_ECHO_BYTES} bytes", len(request.payload))
        return agent_pb2.ProbeEchoResponse(payload=request.payload, sequence=request.sequence)

    async def ProbeUpload(
        self, request_iterator: AsyncIterator[agent_pb2.ProbeUploadRequest], context: grpc.aio.ServicerContext
    ) -> agent_pb2.ProbeUploadResponse:
        require_caller(PROBE_CALLERS, "ProbeUpload")
        cap = self.state.serve_cap_bytes
        received = 0
        first = last = 0.0
        with self.state.ingress.receiving():
            async for chunk in request_iterator:
                now = time.perf_counter()
                if self.state.busy:
                    raise UnavailableError("busy training: bulk probes are paused; retry after the next period")
                if received == 0:
                    first = now
                last = now
                received += len(chunk.data)
                if received > cap:
                    raise ValidationError("data", f"a bulk probe may send at most {cap} bytes", received)
        return agent_pb2.ProbeUploadResponse(bytes_received=received, seconds=last - first)

    async def ProbeDownload(
        self, request: agent_pb2.ProbeDownloadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.ProbeDownloadResponse]:
        require_caller(PROBE_CALLERS, "ProbeDownload")
        cap = self.state.serve_cap_bytes
        if not 0 < request.total_bytes <= cap:
            raise ValidationError("total_bytes", f"must be in 1..{cap}", request.total_bytes)
        if request.chunk_bytes < 0 or request.chunk_bytes > MAX_CHUNK_BYTES:
            raise ValidationError("chunk_bytes", f"must be in 0..{MAX_CHUNK_BYTES}", request.chunk_bytes)
        size = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        chunk = b"\x00" * size
        sent = 0
        while sent < request.total_bytes:
            if self.state.busy:
                raise UnavailableError("busy training: bulk probes are paused; retry after the next period")
            n = min(size, request.total_bytes - sent)
            yield agent_pb2.ProbeDownloadResponse(data=chunk[:n])
            sent += n

    async def GetStatus(
        self, request: agent_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.GetStatusResponse:
        require_caller(STATUS_CALLERS, "GetStatus")
        return self.state.status()

    async def WatchWorkers(
        self, request: agent_pb2.WatchWorkersRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.WatchWorkersResponse]:
        require_caller(STATUS_CALLERS, "WatchWorkers")
        with self.workers.watch(request.job_id) as watch:
            overflow = asyncio.ensure_future(watch.overflowed.wait())
            try:
                while True:
                    if watch.queue.empty():
                        got = asyncio.ensure_future(watch.queue.get())
                        await asyncio.wait([got, overflow], return_when=asyncio.FIRST_COMPLETED)
                        if not got.done():
                            got.cancel()
                            break
                        yield got.result()
                    else:
                        yield watch.queue.get_nowait()
            finally:
                overflow.cancel()
        raise ResourceExhaustedError(f"this watch fell {WATCH_QUEUE} events behind and was ended; watch again "
                                     "(the current state comes first)")

    async def ReadLogs(
        self, request: agent_pb2.ReadLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.ReadLogsResponse]:
        require_caller(STATUS_CALLERS, "ReadLogs")  # the scheduler relays logs to their job's tenant
        if not request.job_id:
            raise ValidationError("job_id", "is required")
        if request.stream not in ("", *joblogs.LogStream):
            raise ValidationError("stream", "must be stdout, stderr or empty", request.stream)
        if request.attempt < 0:
            raise ValidationError("attempt", "must be ≥ 0 (0: every attempt)", request.attempt)
        for i, o in enumerate(request.offsets):
            if not 0 <= o.offset <= MAX_LOG_OFFSET:
                raise ValidationError(f"offsets[{i}].offset", f"must be in [0, {MAX_LOG_OFFSET}]", o.offset)
        streams = frozenset(joblogs.LogStream) if not request.stream else frozenset({joblogs.LogStream(request.stream)})
        offsets = {(o.attempt, o.rank, o.stream): o.offset for o in request.offsets}
        if self.work_dir is None:
            return
        while True:
            files = await asyncio.to_thread(
                joblogs.find_logs, self.work_dir, job=request.job_id, attempt=request.attempt or None,
                cluster=self.cluster or None, rank=None if request.rank < 0 else request.rank, streams=streams)
            sent = False
            for f in files:
                key = (f.attempt, f.rank, str(f.stream))
                while True:
                    at = offsets.get(key, 0)
                    try:
                        data = await asyncio.to_thread(joblogs.read_chunk, f.path, at, LOG_CHUNK_BYTES)
                    except FileNotFoundError:  # pruned (log retention) since it was listed
                        break
                    if not data:
                        break
                    offsets[key] = at + len(data)
                    sent = True
                    yield agent_pb2.ReadLogsResponse(cluster=f.cluster, attempt=f.attempt, rank=f.rank,
                                                     stream=str(f.stream), offset=at, data=data)
            if not request.follow:
                return
            if not sent:
                await asyncio.sleep(LOG_POLL_S)
