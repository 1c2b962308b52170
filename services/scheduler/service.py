"""The Scheduler gRPC service (``spiderflow.scheduler.v1.Scheduler``): the job API.

Any replica answers every RPC (all state is in etcd; writes are compare-and-swap transactions through
:class:`~services.scheduler.repo.JobRepository`); only the elected leader runs scheduling cycles
(:mod:`services.scheduler.cycle`). The servicer converts, validates, and delegates:

- SubmitJob: the job spec is the trace file's job object; ``request_id`` makes it idempotent (a retry
  returns the same job, ``created=false``); a job id taken by another request of the same tenant →
  ALREADY_EXISTS; a full queue, or a tenant at its queued-jobs quota → RESOURCE_EXHAUSTED. Ids follow the
  grammar of :mod:`spiderflow.security.ids`; on an authenticating server a job is stored under its
  tenant-qualified id (``alice~train``) and request ids are scoped per tenant, so nothing a tenant
  submits reveals or touches another tenant's jobs. Validation happens before anything is written
  (INVALID_ARGUMENT naming the field), so etcd never holds a part of a malformed job.
- GetJob / ListJobs (state and tenant filters, pages in submission order, each token a cursor after the
  previous page's last job) / WatchJob (the record, then every state change and, on request, progress,
  until a terminal state) / CancelJob (releases GPUs;
  FAILED_PRECONDITION for a finished job).
- ReportProgress: agents report steps and worker outcomes; stale attempts are ignored. Reports are
  validated against the job (steps within the job's, finite numbers) and an agent reports outcomes only
  for the stages its cluster runs in the current attempt; the last stage's success counts only once the
  last step was reported, and a job ends once (later outcomes get ``accepted=false, stop=true``). A failed
  outcome fails the job unless every failed outcome is ``preempted`` (the cluster's workload manager stopped
  the workers): the job then goes RESCHEDULING and resumes from its last complete checkpoint.

Security (:mod:`spiderflow.security`): when the server authenticates, every RPC runs with the caller's
principal and obeys :mod:`spiderflow.security.authz` (tenants see and cancel only their own jobs; another
tenant's job is NOT_FOUND; only the agent of a cluster running a stage reports progress). SubmitJob is
rate-limited per caller (token bucket: RESOURCE_EXHAUSTED with ``retry_after_s`` in the error metadata),
and at most ``max_watches`` WatchJob streams are open at once (RESOURCE_EXHAUSTED beyond), so many idle
or never-reading watchers cannot exhaust etcd watches or memory; :class:`TenantQuota` bounds the same per
caller (``max_watches``) and the queued jobs per tenant (``max_queued``), so one tenant cannot exhaust a
bound for the others.

Deadlines: a unary call with a deadline is answered before it (UNAVAILABLE, :data:`DEADLINE_MARGIN_S`
early) when etcd does not answer in time, so a client sees the meaning of the failure instead of its own
DEADLINE_EXCEEDED; every etcd call also has the store's own ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import heapq
import json
import math
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
from services.scheduler.topology_source import TopologySource
from spiderflow.core.errors import (
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    ResourceExhaustedError,
    SpiderFlowError,
    UnavailableError,
    ValidationError,
)
from spiderflow.core.tenancy import TenantQuota
from spiderflow.exec.preflight import check_job_paths
from spiderflow.jobs import JobRecord, JobState, Progress, Transition
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.errors import map_domain_errors
from spiderflow.security import authz, ids
from spiderflow.security.auth import client_key
from spiderflow.security.identity import Principal, Role, current_principal
from spiderflow.security.ratelimit import RateLimiter
from spiderflow.store import keys, records
from spiderflow.store.base import CompareFailedError, EventType

__all__ = ["SchedulerService", "job_to_proto"]

log = structlog.get_logger(__name__)

MAX_PAGE = 1000
DEFAULT_PAGE = 100
MAX_REVISION = 2**62
"""WatchJob's ``from_revision`` bound: etcd revisions are int64; a watch starts one past the revision."""
QUEUE_RECOUNT_S = 2.0
"""Longest time the queue bound relies on an estimate (last count + own submissions since)."""
MAX_REASON = 1024
"""Longest cancellation reason (characters)."""
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
                 tenant_quota: TenantQuota | None = None,
                 agent_credentials: grpc.ChannelCredentials | None = None,
                 topology: TopologySource | None = None) -> None:
        self.repo = repo
        self.tenant_quota = tenant_quota or TenantQuota()
        self._watches_by: dict[str, int] = {}
        self._queued_by: dict[str, int] = {}  # per tenant, at the last recount
        self._created_by: dict[str, int] = {}  # per tenant, created by this replica since the last recount
        self.observer = JobObserver(repo, agent_credentials=agent_credentials, topology=topology)
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
        self.created = 0
        """Jobs this replica created so far (the leader paces its cycles during bursts by it)."""

    async def _get_visible(self, job_id: str, *, write: bool = False) -> StoredJob:
        """The job the caller names ``job_id`` (a tenant names its own jobs by their bare or qualified id),
        NOT_FOUND when it does not exist or the caller may not see it (the same answer: no oracle)."""
        principal = current_principal()
        stored_id = resolve_job_id(principal, job_id)
        try:
            stored = await self.repo.get(stored_id)
        except NotFoundError:
            raise NotFoundError(f"job {job_id!r} not found") from None
        authz.require_visible(principal, job_id, stored.record.spec.tenant, _clusters(stored.record),
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
            created_by_before = dict(self._created_by)
            by_tenant = await self.repo.count_by_tenant((JobState.PENDING, JobState.RESCHEDULING))
            n = sum(by_tenant.values())
            self._created_since -= created_before
            for t, k in created_by_before.items():
                self._created_by[t] -= k
                if not self._created_by[t]:
                    del self._created_by[t]
            self._queued_by = by_tenant
            self._queued_cache = (time.monotonic(), n)
            return n + self._created_since

    async def _queued_of(self, tenant: str) -> int:
        """Queued jobs of ``tenant`` (the same estimate as :meth:`_queued`, recounted when it reaches the
        tenant's bound)."""
        limit = self.tenant_quota.max_queued
        assert limit is not None
        estimate = self._queued_by.get(tenant, 0) + self._created_by.get(tenant, 0)
        if estimate < limit and time.monotonic() - self._queued_cache[0] < QUEUE_RECOUNT_S:
            return estimate
        self._queued_cache = (-QUEUE_RECOUNT_S, self._queued_cache[1])  # force a recount
        await self._queued()
        return self._queued_by.get(tenant, 0) + self._created_by.get(tenant, 0)

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
        ids.check_id("request_id", request.request_id)
        spec = convert.job_from_proto(request.job)
        try:
            check_job_paths(spec)  # data and weights paths: refused now, not first during training
        except ValidationError as e:
            raise ValidationError(f"job.{e.field}", e.reason, e.value) from None
        owner = tenant if tenant not in authz.UNSET_TENANTS else spec.tenant
        # job ids are namespaced per tenant (spiderflow.security.ids); a server that does not authenticate
        # has no tenants to tell apart and keeps ids as given
        job_id = ids.qualify(owner, spec.id) if current_principal() is not None and ids.SEP not in spec.id \
            else spec.id
        if owner != spec.tenant or job_id != spec.id:
            spec = replace(spec, tenant=owner, id=job_id)  # one more validation of the spec, not one per change
        if request.policy:
            from spiderflow.core.placement import get_policy

            get_policy(request.policy)  # ValidationError(policy) for an unknown name
        if await self._queued() >= self.max_queued:
            raise ResourceExhaustedError(f"the queue holds {self.max_queued} jobs; retry later")
        if self.tenant_quota.max_queued is not None and \
                await self._queued_of(spec.tenant) >= self.tenant_quota.max_queued:
            raise ResourceExhaustedError(f"tenant {spec.tenant} has {self.tenant_quota.max_queued} queued jobs "
                                         "(its quota); retry when some have started")
        if self.batcher is not None:
            stored, created = await self.batcher.submit(spec, request.request_id, policy=request.policy)
        else:
            stored, created = await self.repo.submit(spec, request.request_id, policy=request.policy)
        if created:
            self._created_since += 1
            self._created_by[spec.tenant] = self._created_by.get(spec.tenant, 0) + 1
            self.created += 1
            if self.batcher is None:  # the batcher logs one line per transaction, naming every job it created
                log.info("scheduler.submitted", jobs=[spec.id], tenants=[spec.tenant],
                         request_ids=[request.request_id])
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
        after = _parse_page_token(request.page_token) if request.page_token else None
        states = {JobState(convert.job_state_from_proto(s, field="states").upper()) for s in request.states}
        tenant = authz.authorize_list(current_principal(), request.tenant)
        stored, _ = await self.repo.list()
        rows = [s for s in stored
                if (not states or s.record.state in states) and (not tenant or s.record.spec.tenant == tenant)
                and (after is None or _order(s) > after)]
        # the page's rows only (and one more: is there a next page?), not a sort of every job for every page
        page = heapq.nsmallest(size + 1, rows, key=_order)
        nxt = _page_token(_order(page[size - 1])) if len(page) > size else ""
        return scheduler_pb2.ListJobsResponse(jobs=[job_to_proto(s) for s in page[:size]], next_page_token=nxt)

    async def WatchJob(
        self, request: scheduler_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.WatchJobResponse]:
        _require_id(request.job_id)
        if not 0 <= request.from_revision < MAX_REVISION:
            raise ValidationError("from_revision", f"must be in [0, {MAX_REVISION})", request.from_revision)
        current = await self._get_visible(request.job_id)
        if self.watches >= self.max_watches:
            raise ResourceExhaustedError(f"{self.max_watches} job watches are open; retry later", retry_after_s=1.0)
        who = str(current_principal() or "")
        limit = self.tenant_quota.max_watches
        if limit is not None and self._watches_by.get(who, 0) >= limit:
            raise ResourceExhaustedError(f"{who or 'this caller'} has {limit} job watches open (its quota); "
                                         "retry later", retry_after_s=1.0)
        self.watches += 1
        self._watches_by[who] = self._watches_by.get(who, 0) + 1
        try:
            async for msg in self._watch(request, current):
                yield msg
        finally:
            self.watches -= 1
            self._watches_by[who] -= 1
            if not self._watches_by[who]:
                del self._watches_by[who]

    async def _watch(self, request: scheduler_pb2.WatchJobRequest,
                     current: StoredJob) -> AsyncIterator[scheduler_pb2.WatchJobResponse]:
        yield scheduler_pb2.WatchJobResponse(revision=current.mod_revision, job=job_to_proto(current))
        if current.record.terminal:
            return
        last = current.record
        start = max(request.from_revision, current.mod_revision) + 1
        jkey = keys.job_key(current.record.id)
        watch = self.repo.store.watch_prefix(jkey, start_revision=start)
        try:
            async for ev in watch:
                if ev.key != jkey:
                    continue
                if ev.type is EventType.DELETE:
                    return
                rec = records.decode_as(ev.key, ev.value, JobRecord)
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
        if len(request.reason) > MAX_REASON:
            raise ValidationError("reason", f"must be at most {MAX_REASON} characters",
                                  f"{len(request.reason)} characters")
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
        if principal is not None and principal.role is not Role.AGENT:
            raise PermissionDeniedError(f"{principal} is not an agent; only agents report progress")
        for _ in range(10):
            stored = await self.repo.get(request.job_id)
            r = stored.record
            if principal is not None:
                authz.authorize_report(principal, request.cluster, r.id, _clusters(r))
            if request.attempt != r.attempt:
                return scheduler_pb2.ReportProgressResponse(accepted=False, stop=True)
            if r.terminal:
                await self._record_late(request, r, principal.name if principal is not None else request.cluster)
                return scheduler_pb2.ReportProgressResponse(accepted=False, stop=True)
            if request.cluster and request.cluster not in r.allocation:
                raise NotFoundError(f"cluster {request.cluster!r} runs no stage of job {r.id}")
            final_step = _check_report(request, r, principal.name if principal is not None else request.cluster)
            new = r
            driving = [e for e in request.progress if _of_last_stage(e, r)]
            if driving:
                ev = max(driving, key=lambda e: e.step)
                # the first report of an attempt may go back: a re-placed job resumes from its checkpoint
                if ev.step > r.progress.step or r.state is JobState.PLACED:
                    new = _with_progress(new, ev, now=self.repo.clock())
            if new.state is JobState.PLACED and (request.progress or request.outcomes):
                new = new.to(JobState.RUNNING, "workers started", now=self.repo.clock())
            failed = [o for o in request.outcomes if not o.succeeded]
            if failed and all(o.preempted for o in failed):
                new = new.to(JobState.RESCHEDULING, f"stage {failed[0].stage} was stopped by {request.cluster or 'its'}"
                             f" workload manager: {failed[0].error}".strip(), now=self.repo.clock())
            elif failed:
                failed = [o for o in failed if not o.preempted]
                new = new.to(JobState.FAILED, f"stage {failed[0].stage} failed: {failed[0].error}".strip(),
                             now=self.repo.clock())
            elif request.outcomes and r.plan is not None and any(
                    o.stage == len(r.plan.stages) - 1 for o in request.outcomes):
                if max(final_step, r.progress.step) < r.spec.steps:
                    raise PreconditionError(f"the last stage of job {r.id} reported success at step "
                                            f"{max(final_step, r.progress.step)} of {r.spec.steps}; a job "
                                            "succeeds only once its last step is reported")
                new = new.to(JobState.SUCCEEDED, f"trained {r.spec.steps} steps", now=self.repo.clock())
            # other stages' events are kept whatever the progress (a stage may report after the last one)
            fresh = [e for e in request.progress if e.step > r.progress.step or r.state is JobState.PLACED
                     or not _of_last_stage(e, r)]
            if new != r:
                try:
                    await self.repo.transition(stored, new)
                except CompareFailedError:
                    continue
            if fresh:
                try:
                    await self.observer.record(new, fresh, now=self.repo.clock())
                except SpiderFlowError as e:  # the history is best effort; the report itself was recorded
                    log.warning("scheduler.metrics_not_recorded", job=r.id, error=str(e))
            if new == r:
                return scheduler_pb2.ReportProgressResponse(accepted=True, stop=False)
            if new.terminal:
                self._poke()
            return scheduler_pb2.ReportProgressResponse(accepted=True, stop=new.terminal)
        raise PreconditionError(f"job {request.job_id} is changing too fast; retry the report")

    async def _record_late(self, request: scheduler_pb2.ReportProgressRequest, r: JobRecord, cluster: str) -> None:
        """Keep the late stage events of a report on a job that has ended (:func:`_late_events`): the report is
        not accepted (the job does not move), but its stages' busy times are part of the job's history."""
        late = _late_events(request, r, cluster)
        if late:
            try:
                await self.observer.record(r, late, now=self.repo.clock())
            except SpiderFlowError as e:  # best effort, as for an accepted report
                log.warning("scheduler.metrics_not_recorded", job=r.id, error=str(e))


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


MAX_EVENTS = 10_000
"""Progress events in one report at most."""
MAX_ERROR = 4096
"""Longest worker error of an outcome (characters)."""


def _late_events(request: scheduler_pb2.ReportProgressRequest, r: JobRecord,
                 cluster: str) -> list[types_pb2.ProgressEvent]:
    """The events of a report on ``r``'s attempt that arrived after the job ended which still belong in its
    metrics history: another stage's busy times (the last stage's success ends the job, and a stage before
    it may report its last steps after that). None from a cluster that ran no stage of the job, or from a
    report that :func:`_check_report` refuses."""
    if request.cluster and request.cluster not in _clusters(r):  # an ended job has released its allocation
        return []
    try:
        _check_report(request, r, cluster)
    except SpiderFlowError:
        return []
    return [e for e in request.progress if not _of_last_stage(e, r)]


def _check_report(request: scheduler_pb2.ReportProgressRequest, r: JobRecord, cluster: str) -> int:
    """Validate a progress report against the job it is about and return its highest step.

    INVALID_ARGUMENT naming the field: a step outside ``0..steps``, another ``steps_total``, a loss, speed,
    step time or stage busy time that is not a finite number ≥ 0 (loss: finite), a stage outside the plan
    or not run by ``cluster``, another job's or attempt's event, more
    than :data:`MAX_EVENTS` events, an outcome's stage outside the plan or repeated, an error longer than
    :data:`MAX_ERROR`. PERMISSION_DENIED: an outcome for a stage that ``cluster`` (the caller's cluster)
    does not run in this attempt."""
    if len(request.progress) > MAX_EVENTS:
        raise ValidationError("progress", f"at most {MAX_EVENTS} events per report", len(request.progress))
    top = 0
    for i, ev in enumerate(request.progress):
        where = f"progress[{i}]"
        if not 0 <= ev.step <= r.spec.steps:
            raise ValidationError(f"{where}.step", f"must be in 0..{r.spec.steps} (the job's steps)", ev.step)
        if ev.steps_total not in (0, r.spec.steps):
            raise ValidationError(f"{where}.steps_total", f"must be 0 or the job's {r.spec.steps}", ev.steps_total)
        if ev.job_id and ev.job_id != r.id:
            raise ValidationError(f"{where}.job_id", f"must be empty or {r.id!r}", ev.job_id[:80])
        if ev.attempt and ev.attempt != r.attempt:
            raise ValidationError(f"{where}.attempt", f"must be 0 or the report's attempt {r.attempt}", ev.attempt)
        if not math.isfinite(ev.loss):
            raise ValidationError(f"{where}.loss", "must be a finite number", ev.loss)
        for name in ("tokens_per_s", "step_time_s", "stage_busy_s"):
            v = getattr(ev, name)
            if not math.isfinite(v) or v < 0:
                raise ValidationError(f"{where}.{name}", "must be a finite number ≥ 0", v)
        if ev.HasField("stage"):
            plan_stages = r.plan.stages if r.plan is not None else ()
            if not 0 <= ev.stage < len(plan_stages):
                raise ValidationError(f"{where}.stage", f"must be a stage of the plan (0..{len(plan_stages) - 1})",
                                      ev.stage)
            st = plan_stages[ev.stage]
            if cluster and cluster not in {st.cluster, *(share.cluster for share in st.replicas)}:
                raise ValidationError(f"{where}.stage", f"cluster {cluster!r} does not run stage {ev.stage}",
                                      ev.stage)
        if _of_last_stage(ev, r):
            top = max(top, ev.step)
    stages = r.plan.stages if r.plan is not None else ()
    seen: set[int] = set()
    for i, o in enumerate(request.outcomes):
        if not 0 <= o.stage < len(stages) or o.stage in seen:
            raise ValidationError(f"outcomes[{i}].stage", f"must be a stage of the plan (0..{len(stages) - 1}), "
                                  "each once", o.stage)
        seen.add(o.stage)
        if cluster and stages[o.stage].cluster != cluster:
            raise PermissionDeniedError(f"cluster {cluster!r} does not run stage {o.stage} of job {r.id} "
                                        f"(attempt {r.attempt}); it may report only its own stages")
        if len(o.error) > MAX_ERROR:
            raise ValidationError(f"outcomes[{i}].error", f"must be at most {MAX_ERROR} characters", len(o.error))
    return top


def _of_last_stage(ev: types_pb2.ProgressEvent, r: JobRecord) -> bool:
    """Whether ``ev`` is the last stage's (it carries the loss and moves the job): no stage, or the last."""
    return not ev.HasField("stage") or r.plan is None or ev.stage == len(r.plan.stages) - 1


def _clusters(r: JobRecord) -> set[str]:
    """Clusters that run (or ran) a stage of the job: its allocation and its plan's stages."""
    return set(r.allocation) | ({st.cluster for st in r.plan.stages} if r.plan is not None else set())


def _order(sj: StoredJob) -> tuple[float, str]:
    """ListJobs' order: submission time, then id."""
    return sj.record.created_at, sj.record.id


def _page_token(last: tuple[float, str]) -> str:
    """The cursor after the row ``last`` (opaque to clients): the next page starts after it, so jobs created
    or deleted between two pages never shift a row into the next page twice or out of it."""
    return base64.urlsafe_b64encode(json.dumps(list(last)).encode()).decode()


def _parse_page_token(token: str) -> tuple[float, str]:
    try:
        doc = json.loads(base64.urlsafe_b64decode(token.encode()))
        at, job_id = doc
        if not isinstance(at, int | float) or isinstance(at, bool) or not isinstance(job_id, str):
            raise ValueError
        return float(at), job_id
    except (ValueError, TypeError, OverflowError):
        raise ValidationError("page_token", "is not a token this server issued", token[:64]) from None


def _require_id(job_id: str) -> None:
    if not job_id:
        raise ValidationError("job_id", "is required")
    ids.check_job_id("job_id", job_id)


def resolve_job_id(principal: Principal | None, job_id: str) -> str:
    """The stored id of the job a caller names. A tenant names its own jobs by their bare id (qualified
    here) or their qualified id; a qualified id of another tenant raises NOT_FOUND, the answer for a job
    that does not exist. Other callers name jobs by their stored (qualified) id."""
    tenant, bare = ids.split_job_id("job_id", job_id)
    if principal is None or principal.role is not Role.TENANT:
        return job_id
    if ids.SEP in job_id and tenant != principal.name:
        raise NotFoundError(f"job {job_id!r} not found")
    return ids.qualify(principal.name, bare)


def _with_progress(r: JobRecord, ev: types_pb2.ProgressEvent, *, now: float) -> JobRecord:
    return replace(r, updated_at=now, progress=Progress(
        step=int(ev.step), steps=int(ev.steps_total or r.spec.steps), loss=ev.loss, step_time_s=ev.step_time_s,
        tokens_per_s=ev.tokens_per_s, checkpoint_step=r.progress.checkpoint_step,
    ))

