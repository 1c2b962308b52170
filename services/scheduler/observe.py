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
  job (the oldest reports are deleted first, counted in ``dropped``). Events of the last stage are the
  points (loss, tokens/s, step time); each other stage's event adds that stage's measured busy time to the
  point of the same attempt and step. Each point also carries the cost model's busy time per stage under
  the bound plan (:func:`predicted_stage_busy`, on the topology when the first report of an attempt came).
- **Delete**: a finished job's record, request id, wait, checkpoint record and metrics go in one
  etcd transaction (compared on the record's revision, so a job that changed meanwhile is not deleted);
  a job that has not finished is FAILED_PRECONDITION. The retention sweep
  (:mod:`services.scheduler.retention`) deletes through the same path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import structlog
from google.protobuf import timestamp_pb2  # type: ignore[import-untyped]

from services.scheduler.repo import JobRepository, StoredJob
from services.scheduler.topology_source import TopologySource
from spiderflow.core.domain import JobSpec, Plan, Topology
from spiderflow.core.errors import (
    CorruptRecordError,
    PreconditionError,
    SpiderFlowError,
    UnavailableError,
    ValidationError,
)
from spiderflow.jobs import JobRecord
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.store import keys, records
from spiderflow.store.base import Compare, KeyValue
from spiderflow.store.records import Registration

__all__ = ["FOLLOW_QUIET_S", "MAX_METRIC_POINTS", "JobObserver", "predicted_stage_busy"]

log = structlog.get_logger(__name__)

MAX_METRIC_POINTS = 10_000
PRUNE_EVERY = 32
FOLLOW_QUIET_S = 1.5
_DONE = object()


def predicted_stage_busy(plan: Plan, topo: Topology, spec: JobSpec) -> tuple[float, ...]:
    """The cost model's busy time of each stage of ``plan`` per step, seconds: its micro-batches' forward and
    backward (``ceil(m / dp)`` per replica), its gradient all-reduce and its optimizer step
    (:func:`spiderflow.core.costmodel.breakdown`)."""
    from spiderflow.core.costmodel import breakdown

    bd = breakdown(plan, topo, spec.model, micro_batch=max(1, spec.global_batch // plan.micro_batches),
                   seq_len=spec.seq_len, precision=spec.precision)
    opt = bd.optimizer_s or (0.0,) * len(plan.stages)
    return tuple(-(-plan.micro_batches // st.dp) * c + ar + o
                 for st, c, ar, o in zip(plan.stages, bd.compute_s, bd.allreduce_s, opt, strict=True))


def _ts(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


class JobObserver:
    """Logs, metrics and deletion over a :class:`JobRepository`; ``agent_credentials`` are the channel
    credentials the scheduler dials agents with (None: plaintext)."""

    def __init__(self, repo: JobRepository, *, agent_credentials: grpc.ChannelCredentials | None = None,
                 max_points: int = MAX_METRIC_POINTS, topology: TopologySource | None = None) -> None:
        self.repo = repo
        self.agent_credentials = agent_credentials
        self.max_points = max_points
        self.topology = topology
        self._writes: dict[str, int] = {}
        self._predicted: dict[tuple[str, int], list[float]] = {}

    async def _predicted_stages(self, r: JobRecord) -> list[float]:
        """:func:`predicted_stage_busy` of ``r``'s attempt (computed once per attempt; empty without a plan or
        a topology that has its clusters)."""
        key = (r.id, int(r.attempt))
        if key not in self._predicted:
            out: list[float] = []
            if r.plan is not None and self.topology is not None:
                try:
                    out = list(predicted_stage_busy(r.plan, await self.topology.snapshot(), r.spec))
                except (SpiderFlowError, KeyError, ValueError) as e:
                    log.info("scheduler.stage_prediction_unavailable", job=r.id, error=str(e))
            if len(self._predicted) > 4096:
                self._predicted.clear()
            self._predicted[key] = out
        return self._predicted[key]

    # -- metrics --------------------------------------------------------------------------------------

    async def record(self, r: JobRecord, events: Sequence[types_pb2.ProgressEvent], *, now: float) -> None:
        """Keep the points of one report on ``r``'s attempt: an accepted report's events newer than its progress,
        or, on a job that has ended, another stage's events that arrived after the last stage's success."""
        if not events:
            return
        last = len(r.plan.stages) - 1 if r.plan is not None else 0
        predicted = await self._predicted_stages(r)
        points: list[records.StepPoint | records.StageBusyPoint] = []
        for e in sorted(events, key=lambda e: e.step):
            t = e.time.ToNanoseconds() / 1e9 if e.HasField("time") else now
            stage = int(e.stage) if e.HasField("stage") else last
            if stage != last:  # another stage's busy time for the point of this step
                points.append(records.StageBusyPoint(attempt=int(r.attempt), step=int(e.step), stage=stage,
                                                     busy_s=e.stage_busy_s, time=t))
                continue
            points.append(records.StepPoint(
                attempt=int(r.attempt), step=int(e.step), loss=e.loss, tokens_per_s=e.tokens_per_s,
                step_time_s=e.step_time_s, predicted_step_time_s=r.plan.step_time_s if r.plan is not None else 0.0,
                stage=stage, busy_s=e.stage_busy_s, predicted_stage_busy_s=tuple(predicted), time=t))
        groups: dict[int | None, list[records.StepPoint | records.StageBusyPoint]] = {}
        for p in points:  # one key per stage: two stages' reports that start at the same step never collide
            groups.setdefault(p.stage if isinstance(p, records.StageBusyPoint) else None, []).append(p)
        for group_stage, group in groups.items():
            key = keys.metrics_key(r.id, attempt=int(r.attempt), step=group[0].step, stage=group_stage)
            await self.repo.store.put(key, records.encode(records.MetricsRecord(points=tuple(group))))
        n = self._writes.get(r.id, 0) + 1
        self._writes[r.id] = n
        if n % PRUNE_EVERY == 0:
            await self._prune(r.id)

    @staticmethod
    def _read(items: list[KeyValue]) -> tuple[list[tuple[str, records.MetricsRecord]], records.DroppedPoints | None]:
        """The metrics records of one job's keys (a record that does not decode is logged and skipped) and its
        dropped-points count."""
        out: list[tuple[str, records.MetricsRecord]] = []
        dropped: records.DroppedPoints | None = None
        for kv in items:
            try:
                rec = records.decode(kv.key, kv.value)
            except CorruptRecordError as e:
                log.warning("scheduler.bad_metrics_record", key=kv.key, field=e.field, error=e.reason)
                continue
            if isinstance(rec, records.DroppedPoints):
                dropped = rec
            elif isinstance(rec, records.MetricsRecord):
                out.append((kv.key, rec))
        return out, dropped

    async def _prune(self, job_id: str) -> None:
        items, _ = await self.repo.store.get_prefix(keys.metrics_prefix(job_id))
        kept, dropped = self._read(items)
        sizes = [(k, sum(1 for p in rec.points if isinstance(p, records.StepPoint))) for k, rec in kept]
        total = sum(n for _, n in sizes)
        gone = 0
        for k, n in sizes:
            if total - gone <= self.max_points:
                break
            await self.repo.store.delete(k)
            gone += n
        if gone:
            before = dropped.count if dropped is not None else 0
            await self.repo.store.put(keys.metrics_dropped_key(job_id),
                                      records.encode(records.DroppedPoints(count=before + gone)))

    async def metrics(self, job_id: str, limit: int) -> scheduler_pb2.GetJobMetricsResponse:
        """The kept points of ``job_id``, oldest first (the newest ``limit`` when ``limit`` > 0)."""
        if limit < 0:
            raise ValidationError("limit", "must be ≥ 0 (0: every kept point)", limit)
        items, _ = await self.repo.store.get_prefix(keys.metrics_prefix(job_id))
        out = scheduler_pb2.GetJobMetricsResponse(job_id=job_id)
        kept, dropped = self._read(items)
        if dropped is not None:
            out.dropped = dropped.count
        seen: dict[tuple[int, int], records.StepPoint] = {}
        busy: dict[tuple[int, int], dict[int, float]] = {}
        for _, rec in kept:  # a resumed attempt may report a step again: the newest report wins
            for p in rec.points:
                at = (p.attempt, p.step)
                busy.setdefault(at, {})[p.stage] = p.busy_s
                if isinstance(p, records.StepPoint):
                    seen[at] = p
        ordered = sorted(seen.values(), key=lambda p: (p.time, p.attempt, p.step))
        if limit:
            ordered = ordered[-limit:]
        for p in ordered:
            predicted = list(p.predicted_stage_busy_s)
            measured = busy.get((p.attempt, p.step), {})
            n = max(len(predicted), max(measured, default=-1) + 1) if measured or predicted else 0
            out.points.add(attempt=p.attempt, step=p.step, loss=p.loss, tokens_per_s=p.tokens_per_s,
                           step_time_s=p.step_time_s, predicted_step_time_s=p.predicted_step_time_s,
                           time=_ts(p.time), stage_busy_s=[measured.get(i, 0.0) for i in range(n)] if measured else [],
                           predicted_stage_busy_s=predicted)
        return out

    # -- deletion -------------------------------------------------------------------------------------

    async def delete(self, stored: StoredJob) -> None:
        """Delete a finished job (see the module docstring)."""
        r = stored.record
        if not r.terminal:
            raise PreconditionError(f"job {r.id} is {r.state}: only finished jobs can be deleted "
                                    f"(cancel it first: spiderflow cancel {r.id})")
        deletes = [keys.job_key(r.id), keys.checkpoint_key(r.id), keys.wait_key(r.id)]
        if r.request_id:
            deletes.append(keys.request_key(r.request_id, r.spec.tenant))
        await self.repo.store.commit([Compare(key=keys.job_key(r.id), mod_revision=stored.mod_revision)],
                                     deletes=deletes, delete_prefixes=[keys.metrics_prefix(r.id)])
        self._writes.pop(r.id, None)
        for key in [k for k in self._predicted if k[0] == r.id]:
            del self._predicted[key]

    # -- logs -----------------------------------------------------------------------------------------

    async def _agents(self, cluster: str) -> list[Registration]:
        items, _ = await self.repo.store.get_prefix(keys.CLUSTERS)
        regs: list[Registration] = []
        for kv in items:
            try:
                regs.append(records.decode_as(kv.key, kv.value, Registration))
            except CorruptRecordError as e:
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
