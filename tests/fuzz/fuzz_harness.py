"""The fuzzing target: the Scheduler, Planner, Topology, Agent and Control servicers on one real gRPC server (loopback,
port 0) over a real etcd, served from a background event loop so hypothesis drives it with blocking
calls; and the oracle every case is judged by.

The agent of cluster ``fz`` is registered at that server's address and keeps worker logs of job ``fz-1``,
so ``GetJobLogs`` relays a real ``ReadLogs`` stream; jobs ``fz-1`` (finished, with metrics points) and
``fz-2`` (running) exist, and ``fz-1`` is put back before a ``DeleteJob`` case when an earlier case deleted
it. ``Agent/ReadLogs`` is also served by a second agent server that authenticates (bearer tokens, as the
agent's mTLS server authenticates certificates): every case is sent there as the control plane
(``service:scheduler``, the scheduler relaying logs), judged by the oracle, and again as a wrong identity
(a tenant, a peer agent), which must be PERMISSION_DENIED whatever the request holds.

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
import itertools
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from idle_agent import IdleAgentState

from agent.registration import Registration
from agent.service import AgentService
from services.planner.service import PlannerService
from services.scheduler.control import ControlService
from services.scheduler.repo import JobRepository
from services.scheduler.service import SchedulerService
from services.topology.graph import GraphConfig
from services.topology.repo import TopologyRepo
from services.topology.service import TopologyService
from spiderflow import joblogs
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobRecord, JobState, Progress
from spiderflow.proto.agent.v1 import agent_pb2_grpc
from spiderflow.proto.control.v1 import control_pb2_grpc
from spiderflow.proto.planner.v1 import planner_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2_grpc
from spiderflow.proto.topology.v1 import topology_pb2_grpc
from spiderflow.rpc.server import RpcServer, channel_options, serve
from spiderflow.security.auth import Authenticator, AuthInterceptor, TokenTable, bearer_metadata
from spiderflow.security.identity import parse_principal
from spiderflow.store import keys, records
from spiderflow.store.base import Lease
from spiderflow.store.etcd import EtcdStore

__all__ = ["ALLOWED", "FuzzTarget"]

T = TypeVar("T")
Code = grpc.StatusCode
ALLOWED = frozenset({Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS,
                     Code.FAILED_PRECONDITION, Code.PERMISSION_DENIED, Code.RESOURCE_EXHAUSTED, Code.ABORTED})
STREAMS = frozenset({"Scheduler/WatchJob", "Scheduler/GetJobLogs", "Topology/WatchTopology", "Agent/ProbeDownload",
                     "Agent/ReadLogs", "Control/Watch"})
FINITE_STREAMS = frozenset({"Agent/ProbeDownload"})
FOLLOW_STREAMS = frozenset({"Scheduler/GetJobLogs", "Agent/ReadLogs"})
"""Streams that end on their own unless the request sets ``follow``."""
UNAVAILABLE_BY_CONTRACT = {"Scheduler/GetJobLogs": ("has no live agent", "no agent is registered")}
"""UNAVAILABLE answers an RPC documents (a cluster whose agent is not registered keeps its logs on its disk
until the agent is back): allowed when the details say so."""
CONTROL_TOKEN = "fz-control-plane-token-0001"
WRONG_TOKENS = {"tenant:alice": "fz-tenant-alice-token-0001", "agent:fz": "fz-agent-fz-token-00000001",
                "agent:other": "fz-agent-other-token-00001"}
"""Bearer tokens of the authenticating agent server: the control plane's, and identities that may not read logs."""
WRONG_IDENTITY = " (wrong identity)"


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
        self._work: Path | None = None
        self._auth_server: RpcServer | None = None
        self._auth_channel: grpc.Channel | None = None
        self._repo: JobRepository | None = None
        self._wrong = itertools.cycle(sorted(WRONG_TOKENS))

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self) -> RpcServer:
        self._store = EtcdStore(self.etcd_endpoint)
        self._control_store = _LongLeases(self.etcd_endpoint)
        repo = JobRepository(self._store)
        topo_repo = TopologyRepo(self._store, GraphConfig())
        # The registration the near-valid topology reports are about (agent "fz-agent" owns cluster "fz").
        lease = await self._store.grant(3600)
        assert self._work is not None
        stdout, stderr = joblogs.rank_log_paths(self._work, job="fz-1", attempt=1, cluster="fz", rank=0)
        stdout.write_bytes(b'{"step": 1, "loss": 2.5}\n' * 40)
        stderr.write_bytes(b"warming up\n" + b"x" * 3000 + b"\nno newline at the end")
        server = await serve([SchedulerService(repo, max_watches=64), PlannerService(),
                              TopologyService(self._store, topo_repo, tick_s=0.2),
                              AgentService(IdleAgentState(), work_dir=self._work, cluster="fz"),
                              ControlService(self._control_store)])
        reg = Registration(cluster="fz", agent_id="fz-agent", principal="fz-agent", address=server.address)
        await self._store.put(keys.cluster_key("fz"), reg.encode(), lease=lease)
        await self._seed_jobs(repo)
        tokens = TokenTable({CONTROL_TOKEN: parse_principal("service:scheduler"),
                             **{tok: parse_principal(who) for who, tok in WRONG_TOKENS.items()}})
        self._auth_server = await serve([AgentService(IdleAgentState(), work_dir=self._work, cluster="fz")],
                                        interceptors=[AuthInterceptor(Authenticator(tokens=tokens))])
        self._repo = repo
        return server

    async def _seed_jobs(self, repo: JobRepository) -> None:
        """``fz-1`` finished (with two metrics points) and ``fz-2`` running, unless they exist."""
        assert self._store is not None
        for jid, state in (("fz-1", JobState.SUCCEEDED), ("fz-2", JobState.RUNNING)):
            if await self._store.get(keys.job_key(jid)) is not None:
                continue
            spec = job_from_dict({"id": jid, "model": "gpt-tiny", "global_batch": 8, "steps": 5,
                                  "gpus": {"min": 1, "max": 1}})
            record = JobRecord(spec=spec, state=state, request_id=f"seed-{jid}", created_at=1.0, updated_at=2.0,
                               attempt=1, progress=Progress(step=2))
            await self._store.put(keys.job_key(jid), records.encode(record))
            await self._store.put(keys.metrics_prefix(jid) + "0", (
                b'[{"attempt": 1, "step": 1, "loss": 2.5, "tokens_per_s": 10.0, "step_time_s": 0.5, '
                b'"predicted_step_time_s": 0.4, "time": 1.5}, {"kind": "stage", "attempt": 1, "step": 1, '
                b'"stage": 0, "busy_s": 0.2, "time": 1.5}, {"attempt": 1, "step": 2, "loss": 2.4, '
                b'"tokens_per_s": 11.0, "step_time_s": 0.5, "predicted_step_time_s": 0.4, "time": 2.0}]'))

    def start(self) -> FuzzTarget:
        self._work = Path(tempfile.mkdtemp(prefix="spiderflow-fuzz-"))
        self._thread.start()
        self._server = self._run(self._start())
        self._channel = grpc.insecure_channel(self._server.address, options=channel_options())
        assert self._auth_server is not None
        self._auth_channel = grpc.insecure_channel(self._auth_server.address, options=channel_options())
        self._stubs = {"Scheduler": scheduler_pb2_grpc.SchedulerStub(self._channel),
                       "Planner": planner_pb2_grpc.PlannerStub(self._channel),
                       "Topology": topology_pb2_grpc.TopologyStub(self._channel),
                       "Agent": agent_pb2_grpc.AgentStub(self._channel),
                       "Control": control_pb2_grpc.ControlStub(self._channel)}
        return self

    def close(self) -> None:
        for channel in (self._channel, self._auth_channel):
            if channel is not None:
                channel.close()
        for server in (self._server, self._auth_server):
            if server is not None:
                self._run(server.stop(grace_s=0))
        for store in (self._store, self._control_store):
            if store is not None:
                self._run(store.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)

    def revision(self) -> int:
        assert self._store is not None
        return self._run(self._store.revision())

    def _call(self, rpc: str, request: Message, *, metadata: tuple[tuple[str, str], ...] = (),
              stub: Any = None, refused: bool = False) -> grpc.StatusCode:
        """The status of one call. A stream is read for ``stream_s`` (its end by that deadline is OK) unless
        ``refused``: a call that must be refused gets the whole deadline, and its answer is returned as is."""
        service, method = rpc.split("/")
        fn = getattr(stub or self._stubs[service], method)
        try:
            if rpc in STREAMS:
                # a stream that ends on its own is read to its end (its status is judged); one that waits for
                # changes (watches, follows) for stream_s, whose deadline then ends it
                waits = rpc not in FINITE_STREAMS and (rpc not in FOLLOW_STREAMS or getattr(request, "follow", True))
                call = fn(request, timeout=self.stream_s if waits and not refused else self.deadline_s,
                          metadata=metadata)
                try:
                    for i, _ in enumerate(call):
                        if i >= 2:
                            break
                finally:
                    call.cancel()
                return Code.OK
            fn(request, timeout=self.deadline_s, metadata=metadata)
            return Code.OK
        except grpc.RpcError as e:
            code: grpc.StatusCode = e.code()
            if refused:
                return code
            if rpc in STREAMS and code in (Code.DEADLINE_EXCEEDED, Code.CANCELLED):
                return Code.OK
            if code is Code.UNAVAILABLE and any(why in (e.details() or "")
                                                for why in UNAVAILABLE_BY_CONTRACT.get(rpc, ())):
                return code
            if code not in ALLOWED:
                raise AssertionError(f"{rpc} answered {code.name}: {e.details()}\nrequest: {request!r}"[:4000]) \
                    from None
            return code

    def check(self, rpc: str, request: Message) -> grpc.StatusCode:
        """Send one request and apply the oracle (module docstring); returns the status code. ``Agent/ReadLogs``
        goes to the authenticating agent server, as the control plane and then as a wrong identity."""
        if rpc == "Scheduler/DeleteJob":
            assert self._repo is not None
            self._run(self._seed_jobs(self._repo))
        before = self.revision()
        if rpc == "Agent/ReadLogs":
            assert self._auth_channel is not None
            stub = agent_pb2_grpc.AgentStub(self._auth_channel)
            code = self._call(rpc, request, metadata=bearer_metadata(CONTROL_TOKEN), stub=stub)
            who = next(self._wrong)
            wrong = self._call(rpc, request, metadata=bearer_metadata(WRONG_TOKENS[who]), stub=stub, refused=True)
            self.codes.setdefault(rpc + WRONG_IDENTITY, Counter())[wrong.name] += 1
            assert wrong is Code.PERMISSION_DENIED, f"{rpc} as {who} answered {wrong.name}: {request!r}"[:4000]
        else:
            code = self._call(rpc, request)
        self.codes.setdefault(rpc, Counter())[code.name] += 1
        if code is not Code.OK:
            after = self.revision()
            assert after == before, f"{rpc} refused with {code.name} but etcd moved {before} -> {after}: {request!r}"
            health = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        return code
