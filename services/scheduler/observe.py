"""What the scheduler tells users about a job beyond its record: its workers' logs, its metrics history, and
the deletion of a finished job.

- **Logs** stay on the agents that ran the job (:mod:`spiderflow.joblogs`); ``GetJobLogs`` reads the live
  registrations (``clusters/<cluster>``) and relays each agent's ``ReadLogs`` stream (with the scheduler's
  client credentials under mTLS). Without ``follow`` the clusters are read one after the other; with
  ``follow`` side by side, until the job has ended and no output arrived for :data:`FOLLOW_QUIET_S`.
  An agent that cannot be reached is skipped (logged); asking for one cluster whose agent is not
  registered is UNAVAILABLE.
- **Metrics**: every progress event a report carries is kept under ``metrics/<job>/<attempt>-<step>`` (one
  key per report), with the bound plan's predicted step time; at most :data:`MAX_METRIC_POINTS` points per
  job (the oldest reports are deleted first, counted in ``dropped``).
- **Delete**: a finished job's record, request id, plan, checkpoint record, reports and metrics go in one
  etcd transaction (compared on the record's revision, so a job that changed meanwhile is not deleted);
  a job that has not finished is FAILED_PRECONDITION. The retention sweep
  (:mod:`services.scheduler.retention`) deletes through the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import structlog
from google.protobuf import timestamp_pb2  # type: ignore[import-untyped]

from agent.registration import Registration
from services.scheduler.repo import JobRepository, StoredJob, request_key
from spiderflow.errors import PreconditionError, UnavailableError, ValidationError
from spiderflow.jobs import JobRecord
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.store import keys
from spiderflow.store.base import Compare

__all__ = ["FOLLOW_QUIET_S", "MAX_METRIC_POINTS", "JobObserver"]

log = structlog.get_logger(__name__)

MAX_METRIC_POINTS = 10_000
PRUNE_EVERY = 32
FOLLOW_QUIET_S = 1.5
_DONE = object()


def _ts(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


class JobObserver:
    """Logs, metrics and deletion over a :class:`JobRepository`; ``agent_credentials`` are the channel
    credentials the scheduler dials agents with (None: plaintext)."""

    def __init__(self, repo: JobRepository, *, agent_credentials: grpc.ChannelCredentials | None = None,
                 max_points: int = MAX_METRIC_POINTS) -> None:
        self.repo = repo
        self.agent_credentials = agent_credentials
        self.max_points = max_points
        self._writes: dict[str, int] = {}

    # -- metrics --------------------------------------------------------------------------------------

    async def record(self, r: JobRecord, events: Sequence[types_pb2.ProgressEvent], *, now: float) -> None:
        """Keep the points of one accepted report (events of ``r``'s attempt newer than its progress)."""
        points = [{"attempt": int(r.attempt), "step": int(e.step), "loss": e.loss, "tokens_per_s": e.tokens_per_s,
                   "step_time_s": e.step_time_s,
                   "predicted_step_time_s": r.plan.step_time_s if r.plan is not None else 0.0,
                   "time": e.time.ToNanoseconds() / 1e9 if e.HasField("time") else now}
                  for e in sorted(events, key=lambda e: e.step)]
        if not points:
            return
        key = keys.metrics_key(r.id, attempt=int(r.attempt), step=int(points[0]["step"]))
        await self.repo.store.put(key, json.dumps(points, separators=(",", ":")).encode())
        n = self._writes.get(r.id, 0) + 1
        self._writes[r.id] = n
        if n % PRUNE_EVERY == 0:
            await self._prune(r.id)

    async def _prune(self, job_id: str) -> None:
        items, _ = await self.repo.store.get_prefix(keys.metrics_prefix(job_id))
        sizes = [(kv.key, len(_decode(kv.value))) for kv in items if not kv.key.endswith("/dropped")]
        dropped_kv = next((kv for kv in items if kv.key.endswith("/dropped")), None)
        total = sum(n for _, n in sizes)
        gone = 0
        for k, n in sizes:
            if total - gone <= self.max_points:
                break
            await self.repo.store.delete(k)
            gone += n
        if gone:
            before = int(dropped_kv.value) if dropped_kv is not None else 0
            await self.repo.store.put(keys.metrics_prefix(job_id) + "dropped", str(before + gone).encode())

    async def metrics(self, job_id: str, limit: int) -> scheduler_pb2.GetJobMetricsResponse:
        """The kept points of ``job_id``, oldest first (the newest ``limit`` when ``limit`` > 0)."""
        if limit < 0:
            raise ValidationError("limit", "must be ≥ 0 (0: every kept point)", limit)
        items, _ = await self.repo.store.get_prefix(keys.metrics_prefix(job_id))
        out = scheduler_pb2.GetJobMetricsResponse(job_id=job_id)
        points: list[dict[str, Any]] = []
        for kv in items:
            if kv.key.endswith("/dropped"):
                with contextlib.suppress(ValueError):
                    out.dropped = int(kv.value)
                continue
            points.extend(_decode(kv.value))
        seen: dict[tuple[int, int], dict[str, Any]] = {}
        for p in points:  # a resumed attempt may report a step again: the newest report wins
            seen[(int(p["attempt"]), int(p["step"]))] = p
        ordered = sorted(seen.values(), key=lambda p: (float(p["time"]), int(p["attempt"]), int(p["step"])))
        if limit:
            ordered = ordered[-limit:]
        for p in ordered:
            out.points.add(attempt=int(p["attempt"]), step=int(p["step"]), loss=float(p["loss"]),
                           tokens_per_s=float(p["tokens_per_s"]), step_time_s=float(p["step_time_s"]),
                           predicted_step_time_s=float(p["predicted_step_time_s"]), time=_ts(float(p["time"])))
        return out

    # -- deletion -------------------------------------------------------------------------------------

    async def delete(self, stored: StoredJob) -> None:
        """Delete a finished job (see the module docstring)."""
        r = stored.record
        if not r.terminal:
            raise PreconditionError(f"job {r.id} is {r.state}: only finished jobs can be deleted "
                                    f"(cancel it first: spiderflow cancel {r.id})")
        deletes = [keys.job_key(r.id), keys.plan_key(r.id), keys.checkpoint_key(r.id), keys.wait_key(r.id)]
        if r.request_id:
            deletes.append(request_key(r.request_id))
        await self.repo.store.commit([Compare(key=keys.job_key(r.id), mod_revision=stored.mod_revision)],
                                     deletes=deletes,
                                     delete_prefixes=[keys.metrics_prefix(r.id), keys.reports_prefix(r.id)])
        self._writes.pop(r.id, None)

    # -- logs -----------------------------------------------------------------------------------------

    async def _agents(self, cluster: str) -> list[Registration]:
        items, _ = await self.repo.store.get_prefix(keys.CLUSTERS)
        regs: list[Registration] = []
        for kv in items:
            try:
                regs.append(Registration.decode(kv.value))
            except ValidationError as e:
                log.warning("scheduler.bad_registration", key=kv.key, error=str(e))
        if cluster:
            regs = [r for r in regs if r.cluster == cluster]
            if not regs:
                raise UnavailableError(f"cluster {cluster!r} has no live agent: its logs stay on its disk until "
                                       "the agent is back (spiderflow topology show lists live clusters)")
        if not regs:
            raise UnavailableError("no agent is registered: workers' logs are read from the agents that ran them")
        return sorted(regs, key=lambda r: r.cluster)

    async def logs(self, request: scheduler_pb2.GetJobLogsRequest) -> AsyncIterator[scheduler_pb2.GetJobLogsResponse]:
        """The relayed chunks (see the module docstring)."""
        if request.stream not in ("", "stdout", "stderr"):
            raise ValidationError("stream", "must be stdout, stderr or empty (both)", request.stream)
        if request.attempt < 0:
            raise ValidationError("attempt", "must be ≥ 0 (0: every attempt)", request.attempt)
        regs = await self._agents(request.cluster)
        areq = agent_pb2.ReadLogsRequest(job_id=request.job_id, attempt=request.attempt, rank=request.rank,
                                         follow=request.follow, stream=request.stream)
        queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=256)

        async def pump(reg: Registration) -> None:
            channel = open_channel(reg.address, credentials=self.agent_credentials)
            try:
                async for m in agent_pb2_grpc.AgentStub(channel).ReadLogs(areq):
                    await queue.put(m)
            except grpc.aio.AioRpcError as e:
                log.warning("scheduler.logs_unreachable", cluster=reg.cluster, address=reg.address,
                            code=e.code().name, error=e.details())
            finally:
                await channel.close()

        async def run_all() -> None:
            try:
                if request.follow:
                    await asyncio.gather(*(pump(r) for r in regs))
                else:
                    for r in regs:
                        await pump(r)
            finally:
                await queue.put(_DONE)

        runner = asyncio.create_task(run_all())
        ended = False
        try:
            while True:
                try:
                    m = await asyncio.wait_for(queue.get(), timeout=FOLLOW_QUIET_S if request.follow else None)
                except TimeoutError:
                    if ended:  # quiet for a whole period after the job ended: its output is complete
                        return
                    ended = (await self.repo.get(request.job_id)).record.terminal
                    continue
                if m is _DONE:
                    return
                yield scheduler_pb2.GetJobLogsResponse(cluster=m.cluster, attempt=m.attempt, rank=m.rank,
                                                       stream=m.stream, offset=m.offset, data=m.data)
        finally:
            runner.cancel()
            with contextlib.suppress(BaseException):
                await runner


def _decode(value: bytes) -> list[dict[str, Any]]:
    try:
        doc = json.loads(value)
    except ValueError:
        return []
    return [p for p in doc if isinstance(p, dict)] if isinstance(doc, list) else []
