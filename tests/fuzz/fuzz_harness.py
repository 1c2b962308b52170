"""The fuzzing target: the Scheduler, Planner, Topology, Agent and Control servicers on one real gRPC server (loopback,
port 0) over a real etcd, served from a background event loop so hypothesis drives it with blocking
calls; and the oracle every case is judged by.

Oracle (:meth:`FuzzTarget.check`):

1. the status is one the API documents (OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS,
   FAILED_PRECONDITION, PERMISSION_DENIED, RESOURCE_EXHAUSTED, ABORTED); never INTERNAL, UNKNOWN,
   UNIMPLEMENTED, DATA_LOSS — nor UNAVAILABLE, since etcd is healthy throughout; a stream may also be cut
   by the client's own deadline (it waits for changes that do not come);
2. the server still answers (a health check after every failed case);
3. a refused request wrote nothing: the etcd revision is unchanged (nothing else writes meanwhile: no
   scheduler leader runs here).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.probe import Ingress
from agent.registration import Registration
from agent.service import AgentService
from services.planner.service import PlannerService
from services.scheduler.control import ControlService
from services.scheduler.repo import JobRepository
from services.scheduler.service import SchedulerService
from services.topology.graph import GraphConfig
from services.topology.repo import TopologyRepo
from services.topology.service import TopologyService
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.proto.control.v1 import control_pb2_grpc
from spiderflow.proto.planner.v1 import planner_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2_grpc
from spiderflow.proto.topology.v1 import topology_pb2_grpc
from spiderflow.rpc.server import RpcServer, channel_options, serve
from spiderflow.store import keys
from spiderflow.store.base import Lease
from spiderflow.store.etcd import EtcdStore

__all__ = ["ALLOWED", "FuzzTarget"]

T = TypeVar("T")
Code = grpc.StatusCode
ALLOWED = frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS,
                     Code.FAILED_PRECONDITION, Code.PERMISSION_DENIED, Code.RESOURCE_EXHAUSTED, Code.ABORTED})
STREAMS = frozenset({"Scheduler/WatchJob", "Topology/WatchTopology", "Agent/ProbeDownload", "Control/Watch"})


class _AgentState:
    """An idle agent for :class:`~agent.service.AgentService` (bulk probes up to 1 MiB)."""

    busy = False
    serve_cap_bytes = 1 << 20
    ingress = Ingress()

    def status(self) -> agent_pb2.GetStatusResponse:
        return agent_pb2.GetStatusResponse()


class _LongLeases(EtcdStore):
    """The Control service's store here: every lease it grants lives an hour, so no lease granted by an earlier
    case expires during a later one (an expiry moves etcd's revision, which oracle 3 reads as a write)."""

    async def grant(self, ttl: int, *, keepalive: bool = True, on_lost: Any = None) -> Lease:
        return await super().grant(max(ttl, 3600), keepalive=keepalive, on_lost=on_lost)


class FuzzTarget:
    """Start with :meth:`start`, call :meth:`check` per case, :meth:`close` at the end."""

    def __init__(self, etcd_endpoint: str, *, deadline_s: float = 30.0, stream_s: float = 0.4) -> None:
        self.etcd_endpoint = etcd_endpoint
        self.deadline_s = deadline_s
        self.stream_s = stream_s
        self.codes: dict[str, Counter[str]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fuzz-server", daemon=True)
        self._server: RpcServer | None = None
        self._store: EtcdStore | None = None
        self._control_store: EtcdStore | None = None
        self._channel: grpc.Channel | None = None
        self._stubs: dict[str, Any] = {}

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> RpcServer:
        self._store = EtcdStore(self.etcd_endpoint)
        self._control_store = _LongLeases(self.etcd_endpoint)
        repo = JobRepository(self._store)
        topo_repo = TopologyRepo(self._store, GraphConfig())
        # The registration the near-valid topology reports are about (agent "fz-agent" owns cluster "fz").
        lease = await self._store.grant(3600)
        reg = Registration(cluster="fz", agent_id="fz-agent", principal="fz-agent", address="127.0.0.1:1")
        await self._store.put(keys.cluster_key("fz"), reg.encode(), lease=lease)
        return await serve([SchedulerService(repo, max_watches=64), PlannerService(),
                            TopologyService(self._store, topo_repo, tick_s=0.2), AgentService(_AgentState()),
                            ControlService(self._control_store)])

    def start(self) -> FuzzTarget:
        self._thread.start()
        self._server = self._run(self._start())
        self._channel = grpc.insecure_channel(self._server.address, options=channel_options())
        self._stubs = {"Scheduler": scheduler_pb2_grpc.SchedulerStub(self._channel),
                       "Planner": planner_pb2_grpc.PlannerStub(self._channel),
                       "Topology": topology_pb2_grpc.TopologyStub(self._channel),
                       "Agent": agent_pb2_grpc.AgentStub(self._channel),
                       "Control": control_pb2_grpc.ControlStub(self._channel)}
        return self

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._server is not None:
            self._run(self._server.stop(grace_s=0))
        for store in (self._store, self._control_store):
            if store is not None:
                self._run(store.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def revision(self) -> int:
        assert self._store is not None
        return self._run(self._store.revision())

    def _call(self, rpc: str, request: Message) -> grpc.StatusCode:
        service, method = rpc.split("/")
        fn = getattr(self._stubs[service], method)
        try:
            if rpc in STREAMS:
                call = fn(request, timeout=self.stream_s)
                try:
                    for i, _ in enumerate(call):
                        if i >= 2:
                            break
                finally:
                    call.cancel()
                return Code.OK
            fn(request, timeout=self.deadline_s)
            return Code.OK
        except grpc.RpcError as e:
            code: grpc.StatusCode = e.code()
            if rpc in STREAMS and code in (Code.DEADLINE_EXCEEDED, Code.CANCELLED):
                return Code.OK
            if code not in ALLOWED:
                raise AssertionError(f"{rpc} answered {code.name}: {e.details()}\nrequest: {request!r}"[:4000]) \
                    from None
            return code

    def check(self, rpc: str, request: Message) -> grpc.StatusCode:
        """Send one request and apply the oracle (module docstring); returns the status code."""
        before = self.revision()
        code = self._call(rpc, request)
        self.codes.setdefault(rpc, Counter())[code.name] += 1
        if code is not Code.OK:
            after = self.revision()
            assert after == before, f"{rpc} refused with {code.name} but etcd moved {before} -> {after}: {request!r}"
            health = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        return code
