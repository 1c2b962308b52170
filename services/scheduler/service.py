"""The Scheduler gRPC service (``spiderflow.scheduler.v1.Scheduler``): the job API.

Any replica answers every RPC (all state is in etcd; writes are compare-and-swap transactions through
:class:`~services.scheduler.repo.JobRepository`); only the elected leader runs scheduling cycles
(:mod:`services.scheduler.cycle`). The servicer converts, validates, and delegates:

- SubmitJob: the job spec is the trace file's job object; ``request_id`` makes it idempotent (a retry
  returns the same job, ``created=false``); a job id taken by another request → ALREADY_EXISTS; a full
  queue → RESOURCE_EXHAUSTED. Validation happens before anything is written (INVALID_ARGUMENT naming the
  field), so etcd never holds a part of a malformed job.
- GetJob / ListJobs (state and tenant filters, pages in submission order) / WatchJob (the record, then
  every state change and, on request, progress, until a terminal state) / CancelJob (releases GPUs;
  FAILED_PRECONDITION for a finished job).
- ReportProgress: agents report steps and worker outcomes; stale attempts are ignored.

Security (:mod:`spiderflow.security`): when the server authenticates, every RPC runs with the caller's
principal and obeys :mod:`spiderflow.security.authz` (tenants see and cancel only their own jobs; another
tenant's job is NOT_FOUND; only the agent of a cluster running a stage reports progress). SubmitJob is
rate-limited per caller (token bucket: RESOURCE_EXHAUSTED with ``retry_after_s`` in the error metadata),
and at most ``max_watches`` WatchJob streams are open at once (RESOURCE_EXHAUSTED beyond), so many idle
or never-reading watchers cannot exhaust etcd watches or memory.

Deadlines: a unary call with a deadline is answered before it (UNAVAILABLE, :data:`DEADLINE_MARGIN_S`
early) when etcd does not answer in time, so a client sees the meaning of the failure instead of its own
DEADLINE_EXCEEDED; every etcd call also has the store's own ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import grpc
import grpc.aio
import structlog
from google.protobuf import timestamp_pb2  # type: ignore[import-untyped]

from services.scheduler.batching import SubmitBatcher
from services.scheduler.observe import JobObserver
from services.scheduler.repo import JobRepository, StoredJob
from spiderflow.errors import (
    NotFoundError,
    PreconditionError,
    ResourceExhaustedError,
    SpiderFlowError,
    UnavailableError,
    ValidationError,
)
from spiderflow.jobs import JobRecord, JobState, Progress, Transition
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.errors import map_domain_errors
from spiderflow.security import authz
from spiderflow.security.auth import client_key
from spiderflow.security.identity import current_principal
from spiderflow.security.ratelimit import RateLimiter
from spiderflow.store import keys
from spiderflow.store.base import CompareFailedError, EventType

__all__ = ["SchedulerService", "job_to_proto"]

log = structlog.get_logger(__name__)

MAX_PAGE = 1000
DEFAULT_PAGE = 100
MAX_REVISION = 2**62
"""WatchJob's ``from_revision`` bound: etcd revisions are int64; a watch starts one past the revision."""
QUEUE_RECOUNT_S = 2.0
"""Longest time the queue bound relies on an estimate (last count + own submissions since)."""
DEADLINE_MARGIN_S = 0.5
"""How long before a call's deadline the service gives up and answers UNAVAILABLE."""

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def within_deadline(fn: F) -> F:
    """Answer a unary call UNAVAILABLE :data:`DEADLINE_MARGIN_S` before its deadline when the work (etcd)
    has not finished by then. Calls without a deadline are bounded by the store's timeouts only."""

    @functools.wraps(fn)
    async def call(self: object, request: object, context: grpc.aio.ServicerContext) -> Any:
        remaining = context.time_remaining()
        if remaining is None or remaining > 3600:
            return await fn(self, request, context)
        budget = max(0.05, remaining - DEADLINE_MARGIN_S)
        try:
            async with asyncio.timeout(budget) as scope:
                return await fn(self, request, context)
        except TimeoutError:
            if scope.expired():
                raise UnavailableError(f"the job store did not answer within the call's deadline "
                                       f"({remaining:.1f} s); retry") from None
            raise

    return call  # type: ignore[return-value]


def _ts(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return ts


def _state(s: JobState | None) -> types_pb2.JobState:
    return types_pb2.JOB_STATE_UNSPECIFIED if s is None else convert.job_state_to_proto(s.value)


def transition_to_proto(t: Transition) -> scheduler_pb2.StateTransition:
    return scheduler_pb2.StateTransition(from_state=_state(t.from_state), to_state=_state(t.to_state),
                                         reason=t.reason, time=_ts(t.at))


def progress_to_proto(r: JobRecord) -> types_pb2.ProgressEvent:
    p = r.progress
    return types_pb2.ProgressEvent(
        job_id=r.id, attempt=r.attempt, step=p.step, steps_total=p.steps or r.spec.steps, loss=p.loss or 0.0,
        tokens_per_s=p.tokens_per_s or 0.0, step_time_s=p.step_time_s or 0.0, time=_ts(r.updated_at),
    )


def job_to_proto(sj: StoredJob) -> scheduler_pb2.Job:
    r = sj.record
    msg = scheduler_pb2.Job(
        spec=convert.job_to_proto(r.spec), state=_state(r.state), reason=r.reason, attempt=r.attempt,
        history=[transition_to_proto(t) for t in r.history], request_id=r.request_id, policy=r.policy,
        submitted_at=_ts(r.created_at), updated_at=_ts(r.updated_at), revision=sj.mod_revision,
    )
    if r.plan is not None:
        msg.plan.CopyFrom(convert.plan_to_proto(r.plan))
    if r.progress.step:
        msg.progress.CopyFrom(progress_to_proto(r))
    return msg


@map_domain_errors
class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """``max_queued`` bounds PENDING+RESCHEDULING jobs; ``wake`` is called after writes that give the
    leader work (a submission, a cancellation, a finished job). With ``group_commit`` (default) concurrent
    submissions share etcd transactions (:mod:`services.scheduler.batching`); without, each submission is
    its own transaction."""

    def __init__(self, repo: JobRepository, *, max_queued: int = 10_000, wake: asyncio.Event | None = None,
                 known_policies: frozenset[str] | None = None, limiter: RateLimiter | None = None,
                 max_watches: int = 1000, group_commit: bool = True,
                 agent_credentials: grpc.ChannelCredentials | None = None) -> None:
        self.repo = repo
        self.observer = JobObserver(repo, agent_credentials=agent_credentials)
        self.batcher = SubmitBatcher(repo) if group_commit else None
        self.max_queued = max_queued
        self.wake = wake
        self.known_policies = known_policies
        self.limiter = limiter
        self.max_watches = max_watches
        self.watches = 0
        self._queued_cache: tuple[float, int] = (-QUEUE_RECOUNT_S, 0)
        self._created_since = 0
        self._recount = asyncio.Lock()

    async def _get_visible(self, job_id: str, *, write: bool = False) -> StoredJob:
        stored = await self.repo.get(job_id)
        authz.require_visible(current_principal(), job_id, stored.record.spec.tenant, _clusters(stored.record),
                              write=write)
        return stored

    def _poke(self) -> None:
        if self.wake is not None:
            self.wake.set()

    async def _queued(self) -> int:
        """Queued jobs (PENDING + RESCHEDULING), for the queue bound: the last count plus the jobs this
        replica created since, recounted at most every :data:`QUEUE_RECOUNT_S` seconds, and at once when
        that estimate reaches the bound. One recount at a time: concurrent submissions share it."""
        at, n = self._queued_cache
        estimate = n + self._created_since
        if time.monotonic() - at < QUEUE_RECOUNT_S and estimate < self.max_queued:
            return estimate
        async with self._recount:
            if self._queued_cache[0] != at:  # recounted while this call waited
                return self._queued_cache[1] + self._created_since
            created_before = self._created_since
            n = await self.repo.count_in((JobState.PENDING, JobState.RESCHEDULING))
            self._created_since -= created_before
            self._queued_cache = (time.monotonic(), n)
            return n + self._created_since

    @within_deadline
    async def SubmitJob(
        self, request: scheduler_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SubmitJobResponse:
        if not request.request_id:
            raise ValidationError("request_id", "is required (a client-chosen id that makes retries safe)")
        if not request.HasField("job"):
            raise ValidationError("job", "is required")
        tenant = authz.submit_tenant(current_principal(), request.job.tenant)
        if self.limiter is not None:
            wait = self.limiter.take(client_key(context))
            if wait > 0:
                raise ResourceExhaustedError(f"submission rate limit reached; retry in {wait:.2f} s",
                                             retry_after_s=wait)
        spec = convert.job_from_proto(request.job)
        if tenant not in authz.UNSET_TENANTS and tenant != spec.tenant:
            spec = replace(spec, tenant=tenant)
        if request.policy:
            from spiderflow.placement import get_policy

            get_policy(request.policy)  # ValidationError(policy) for an unknown name
        if await self._queued() >= self.max_queued:
            raise ResourceExhaustedError(f"the queue holds {self.max_queued} jobs; retry later")
        if self.batcher is not None:
            stored, created = await self.batcher.submit(spec, request.request_id, policy=request.policy)
        else:
            stored, created = await self.repo.submit(spec, request.request_id, policy=request.policy)
        if created:
            self._created_since += 1
            log.info("scheduler.submitted", job=spec.id, tenant=spec.tenant, request_id=request.request_id)
            self._poke()
        return scheduler_pb2.SubmitJobResponse(job=job_to_proto(stored), created=created)

    @within_deadline
    async def GetJob(
        self, request: scheduler_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetJobResponse:
        _require_id(request.job_id)
        return scheduler_pb2.GetJobResponse(job=job_to_proto(await self._get_visible(request.job_id)))

    @within_deadline
    async def ListJobs(
        self, request: scheduler_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListJobsResponse:
        if request.page_size < 0:
            raise ValidationError("page_size", "must be ≥ 0", request.page_size)
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        try:
            offset = int(request.page_token or "0")
            if offset < 0:
                raise ValueError
        except ValueError:
            raise ValidationError("page_token", "is not a token this server issued", request.page_token) from None
        states = {JobState(convert.job_state_from_proto(s, field="states").upper()) for s in request.states}
        tenant = authz.authorize_list(current_principal(), request.tenant)
        stored, _ = await self.repo.list()
        rows = [s for s in stored
                if (not states or s.record.state in states) and (not tenant or s.record.spec.tenant == tenant)]
        rows.sort(key=lambda s: (s.record.created_at, s.record.id))
        page = rows[offset: offset + size]
        nxt = str(offset + size) if offset + size < len(rows) else ""
        return scheduler_pb2.ListJobsResponse(jobs=[job_to_proto(s) for s in page], next_page_token=nxt)

    async def WatchJob(
        self, request: scheduler_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.WatchJobResponse]:
        _require_id(request.job_id)
        if not 0 <= request.from_revision < MAX_REVISION:
            raise ValidationError("from_revision", f"must be in [0, {MAX_REVISION})", request.from_revision)
        current = await self._get_visible(request.job_id)
        if self.watches >= self.max_watches:
            raise ResourceExhaustedError(f"{self.max_watches} job watches are open; retry later", retry_after_s=1.0)
        self.watches += 1
        try:
            async for msg in self._watch(request, current):
                yield msg
        finally:
            self.watches -= 1

    async def _watch(self, request: scheduler_pb2.WatchJobRequest,
                     current: StoredJob) -> AsyncIterator[scheduler_pb2.WatchJobResponse]:
        yield scheduler_pb2.WatchJobResponse(revision=current.mod_revision, job=job_to_proto(current))
        if current.record.terminal:
            return
        last = current.record
        start = max(request.from_revision, current.mod_revision) + 1
        watch = self.repo.store.watch_prefix(keys.job_key(request.job_id), start_revision=start)
        try:
            async for ev in watch:
                if ev.key != keys.job_key(request.job_id):
                    continue
                if ev.type is EventType.DELETE:
                    return
                rec = JobRecord.from_json(ev.value)
                for t in rec.history[len(last.history):]:
                    yield scheduler_pb2.WatchJobResponse(revision=ev.mod_revision,
                                                         state_change=transition_to_proto(t))
                if request.include_progress and rec.progress != last.progress and rec.progress.step:
                    yield scheduler_pb2.WatchJobResponse(revision=ev.mod_revision, progress=progress_to_proto(rec))
                last = rec
                if rec.terminal:
                    return
        finally:
            await watch.aclose()

    @within_deadline
    async def CancelJob(
        self, request: scheduler_pb2.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.CancelJobResponse:
        _require_id(request.job_id)
        for _ in range(10):
            stored = await self._get_visible(request.job_id, write=True)
            if stored.record.terminal:
                raise PreconditionError(f"job {request.job_id} already ended ({stored.record.state})")
            reason = request.reason or "cancelled by the user"
            try:
                done = await self.repo.transition(stored, stored.record.to(JobState.CANCELLED, reason,
                                                                           now=self.repo.clock()))
            except CompareFailedError:
                continue
            log.info("scheduler.cancelled", job=request.job_id, reason=reason)
            self._poke()
            return scheduler_pb2.CancelJobResponse(job=job_to_proto(done))
        raise PreconditionError(f"job {request.job_id} is changing too fast to cancel; retry")

    @within_deadline
    async def ReportProgress(
        self, request: scheduler_pb2.ReportProgressRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReportProgressResponse:
        _require_id(request.job_id)
        principal = current_principal()
        for _ in range(10):
            stored = await self.repo.get(request.job_id)
            r = stored.record
            if principal is not None:
                authz.authorize_report(principal, request.cluster, r.id, _clusters(r))
            if r.terminal or request.attempt != r.attempt:
                return scheduler_pb2.ReportProgressResponse(accepted=False, stop=True)
            if request.cluster and request.cluster not in r.allocation:
                raise NotFoundError(f"cluster {request.cluster!r} runs no stage of job {r.id}")
            new = r
            if request.progress:
                ev = max(request.progress, key=lambda e: e.step)
                # the first report of an attempt may go back: a re-placed job resumes from its checkpoint
                if ev.step > r.progress.step or r.state is JobState.PLACED:
                    new = _with_progress(new, ev, now=self.repo.clock())
            if new.state is JobState.PLACED and (request.progress or request.outcomes):
                new = new.to(JobState.RUNNING, "workers started", now=self.repo.clock())
            failed = [o for o in request.outcomes if not o.succeeded]
            if failed:
                new = new.to(JobState.FAILED, f"stage {failed[0].stage} failed: {failed[0].error}".strip(),
                             now=self.repo.clock())
            elif request.outcomes and r.plan is not None and any(
                    o.stage == len(r.plan.stages) - 1 for o in request.outcomes):
                new = new.to(JobState.SUCCEEDED, f"trained {r.spec.steps} steps", now=self.repo.clock())
            if new == r:
                return scheduler_pb2.ReportProgressResponse(accepted=True, stop=False)
            try:
                await self.repo.transition(stored, new)
            except CompareFailedError:
                continue
            fresh = [e for e in request.progress if e.step > r.progress.step or r.state is JobState.PLACED]
            if fresh:
                try:
                    await self.observer.record(new, fresh, now=self.repo.clock())
                except SpiderFlowError as e:  # the history is best effort; the report itself was recorded
                    log.warning("scheduler.metrics_not_recorded", job=r.id, error=str(e))
            if new.terminal:
                self._poke()
            return scheduler_pb2.ReportProgressResponse(accepted=True, stop=new.terminal)
        raise PreconditionError(f"job {request.job_id} is changing too fast; retry the report")


    async def GetJobLogs(
        self, request: scheduler_pb2.GetJobLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.GetJobLogsResponse]:
        _require_id(request.job_id)
        await self._get_visible(request.job_id)
        async for chunk in self.observer.logs(request):
            yield chunk

    @within_deadline
    async def GetJobMetrics(
        self, request: scheduler_pb2.GetJobMetricsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.GetJobMetricsResponse:
        _require_id(request.job_id)
        await self._get_visible(request.job_id)
        return await self.observer.metrics(request.job_id, request.limit)

    @within_deadline
    async def DeleteJob(
        self, request: scheduler_pb2.DeleteJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DeleteJobResponse:
        _require_id(request.job_id)
        for _ in range(10):
            stored = await self._get_visible(request.job_id, write=True)
            try:
                await self.observer.delete(stored)
            except CompareFailedError:
                continue
            log.info("scheduler.deleted", job=request.job_id)
            return scheduler_pb2.DeleteJobResponse(job=job_to_proto(stored))
        raise PreconditionError(f"job {request.job_id} is changing too fast to delete; retry")


def _clusters(r: JobRecord) -> set[str]:
    """Clusters that run (or ran) a stage of the job: its allocation and its plan's stages."""
    return set(r.allocation) | ({st.cluster for st in r.plan.stages} if r.plan is not None else set())


def _require_id(job_id: str) -> None:
    if not job_id:
        raise ValidationError("job_id", "is required")


def _with_progress(r: JobRecord, ev: types_pb2.ProgressEvent, *, now: float) -> JobRecord:
    return replace(r, updated_at=now, progress=Progress(
        step=int(ev.step), steps=int(ev.steps_total or r.spec.steps), loss=ev.loss, step_time_s=ev.step_time_s,
        tokens_per_s=ev.tokens_per_s, checkpoint_step=r.progress.checkpoint_step,
    ))

