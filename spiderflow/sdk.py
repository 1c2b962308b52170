"""The Python SDK: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio), mirroring the CLI.

Submit a job, follow it, read the topology::

    from spiderflow.sdk import Client

    with Client() as sf:                                   # address: see resolve_address()
        job = sf.submit({"id": "demo-1", "model": "gpt-tiny", "global_batch": 8,
                         "gpus": {"min": 1, "max": 3}, "steps": 20})
        for event in sf.watch(job.id):                     # state changes and progress
            print(event)
        print(sf.get(job.id).state)                        # "SUCCEEDED"

The asynchronous client has the same methods as coroutines (``watch`` is an async iterator)::

    async with AsyncClient("127.0.0.1:50051") as sf:
        job = await sf.submit("examples/job.json")
        async for event in sf.watch(job.id):
            ...

Errors are the domain errors of :mod:`spiderflow.core.errors` (``ValidationError`` with the offending field,
``NotFoundError``, ``PreconditionError``, ``UnavailableError``, ...), never raw gRPC errors.

Endpoint resolution (:func:`resolve_address`): an explicit argument, else the environment variable
(``SPIDERFLOW_SCHEDULER``, ``SPIDERFLOW_TOPOLOGY``, ``SPIDERFLOW_PLANNER``), else the current context of
the config file (``$SPIDERFLOW_CONFIG`` or ``~/.config/spiderflow/config.yaml``; ``spiderflow up`` writes
one; see :mod:`spiderflow.contexts`), else ``127.0.0.1:50051`` / ``:50052`` / ``:50053``.

Security: ``tls_dir`` (else ``$SPIDERFLOW_TLS_DIR``) is a certificate bundle (``ca.crt``, ``tls.crt``,
``tls.key``; ``spiderflow certs init`` writes one per tenant): the channel is mTLS and the caller is the
certificate's principal. ``token`` (else ``$SPIDERFLOW_TOKEN``) is sent as ``authorization: Bearer``
metadata on every call. Neither: plaintext, unauthenticated (a loopback development server).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import grpc
import grpc.aio

from spiderflow.contexts import DEFAULT_ADDRESSES, Service, config_path, context_value, resolve_endpoint
from spiderflow.core.domain import JobSpec, Plan, Topology
from spiderflow.core.errors import UnavailableError, ValidationError
from spiderflow.formats import in_file, job_from_dict, job_to_dict, load_document
from spiderflow.jobs import JobState
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.errors import domain_errors, from_rpc_error
from spiderflow.rpc.server import channel_options, open_channel
from spiderflow.security.auth import bearer_metadata
from spiderflow.security.tls import channel_credentials, client_tls_dir, client_token

__all__ = [
    "DEFAULT_ADDRESSES",
    "AsyncClient",
    "Client",
    "Job",
    "JobEvent",
    "LogChunk",
    "MetricPoint",
    "Metrics",
    "Stream",
    "Transition",
    "config_path",
    "resolve_address",
]

_T = TypeVar("_T")


class Stream(Iterator[_T]):
    """A server stream of :class:`Client` (``watch``, ``logs``): iterate it for its items.

    :meth:`cancel` ends it from anywhere (another thread, a signal handler): the iteration blocked on the
    next message returns at once and stops without an error (``StopIteration``), and the server sees the call
    cancelled. Any other end of the call raises its domain error, as a unary call does."""

    __slots__ = ("_call", "_cancelled", "_item")

    def __init__(self, call: Any, item: Callable[[Any], _T]) -> None:
        self._call = call
        self._item = item
        self._cancelled = threading.Event()

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> _T:
        try:
            msg = next(self._call)
        except grpc.RpcError as err:
            if self._cancelled.is_set() and err.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise from_rpc_error(err) from err
        return self._item(msg)

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """End the stream now (idempotent; safe from any thread)."""
        self._cancelled.set()
        self._call.cancel()


def resolve_address(service: Service, explicit: str | None = None) -> str:
    """The endpoint of ``service`` (see :mod:`spiderflow.contexts` for the order)."""
    return resolve_endpoint(service, explicit).address


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition:
    from_state: str
    to_state: str
    reason: str
    time: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A job as the scheduler reports it. ``state`` is a :class:`~spiderflow.jobs.JobState` value."""

    id: str
    state: str
    reason: str
    spec: JobSpec
    plan: Plan | None
    attempt: int
    policy: str
    progress: dict[str, float] = field(default_factory=dict)
    history: tuple[Transition, ...] = ()
    revision: int = 0

    @property
    def done(self) -> bool:
        return self.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    def to_dict(self) -> dict[str, Any]:
        from spiderflow.formats import plan_to_dict

        return {
            "id": self.id, "state": self.state, "reason": self.reason, "attempt": self.attempt,
            "policy": self.policy, "spec": job_to_dict(self.spec),
            "plan": plan_to_dict(self.plan) if self.plan else None, "progress": self.progress,
            "history": [{"from": t.from_state, "to": t.to_state, "reason": t.reason, "time": t.time}
                        for t in self.history],
            "revision": self.revision,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """One WatchJob event: ``kind`` is ``job`` (the record), ``state`` (a transition) or ``progress``."""

    kind: Literal["job", "state", "progress"]
    revision: int
    job: Job | None = None
    transition: Transition | None = None
    progress: dict[str, float] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LogChunk:
    """A piece of one worker's output: ``stream`` is ``stdout`` (JSON events) or ``stderr`` (log events,
    tracebacks); ``offset`` is where ``data`` starts in its file on the agent."""

    cluster: str
    attempt: int
    rank: int
    stream: str
    offset: int
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricPoint:
    """One reported training step: measured figures and the bound plan's predicted step time, and per stage
    of the plan its measured busy time in this step (``stage_busy_s``, 0 where that stage's report did not
    arrive) next to the cost model's (``predicted_stage_busy_s``), seconds."""

    attempt: int
    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    predicted_step_time_s: float
    time: float
    stage_busy_s: tuple[float, ...] = ()
    predicted_stage_busy_s: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "step": self.step, "loss": self.loss, "tokens_per_s": self.tokens_per_s,
                "step_time_s": self.step_time_s, "predicted_step_time_s": self.predicted_step_time_s,
                "time": self.time, "stage_busy_s": list(self.stage_busy_s),
                "predicted_stage_busy_s": list(self.predicted_stage_busy_s)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Metrics:
    """A job's metrics history, oldest first; ``dropped`` points were discarded by the bound."""

    job_id: str
    points: tuple[MetricPoint, ...]
    dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "dropped": self.dropped, "points": [p.to_dict() for p in self.points]}


def _metrics(resp: scheduler_pb2.GetJobMetricsResponse) -> Metrics:
    return Metrics(job_id=resp.job_id, dropped=int(resp.dropped), points=tuple(
        MetricPoint(attempt=int(p.attempt), step=int(p.step), loss=p.loss, tokens_per_s=p.tokens_per_s,
                    step_time_s=p.step_time_s, predicted_step_time_s=p.predicted_step_time_s,
                    time=p.time.ToNanoseconds() / 1e9, stage_busy_s=tuple(p.stage_busy_s),
                    predicted_stage_busy_s=tuple(p.predicted_stage_busy_s)) for p in resp.points))


def _chunk(m: scheduler_pb2.GetJobLogsResponse) -> LogChunk:
    return LogChunk(cluster=m.cluster, attempt=int(m.attempt), rank=int(m.rank), stream=m.stream,
                    offset=int(m.offset), data=bytes(m.data))


def _logs_request(job_id: str, follow: bool, attempt: int | None, cluster: str | None, rank: int | None,
                  stream: str | None) -> scheduler_pb2.GetJobLogsRequest:
    return scheduler_pb2.GetJobLogsRequest(job_id=job_id, follow=follow, attempt=attempt or 0,
                                           cluster=cluster or "", rank=-1 if rank is None else rank,
                                           stream=stream or "")


def _state_name(value: int) -> str:
    return "" if value == types_pb2.JOB_STATE_UNSPECIFIED else convert.job_state_from_proto(value).upper()


def _progress(p: types_pb2.ProgressEvent) -> dict[str, float]:
    return {"step": p.step, "steps": p.steps_total, "loss": p.loss, "tokens_per_s": p.tokens_per_s,
            "step_time_s": p.step_time_s, "attempt": p.attempt}


def _transition(t: scheduler_pb2.StateTransition) -> Transition:
    return Transition(from_state=_state_name(t.from_state), to_state=_state_name(t.to_state), reason=t.reason,
                      time=t.time.ToNanoseconds() / 1e9)


def job_from_proto(msg: scheduler_pb2.Job) -> Job:
    return Job(
        id=msg.spec.id, state=_state_name(msg.state), reason=msg.reason, spec=convert.job_from_proto(msg.spec),
        plan=convert.plan_from_proto(msg.plan) if msg.HasField("plan") else None, attempt=msg.attempt,
        policy=msg.policy, progress=_progress(msg.progress) if msg.HasField("progress") else {},
        history=tuple(_transition(t) for t in msg.history), revision=msg.revision,
    )


def _event(msg: scheduler_pb2.WatchJobResponse) -> JobEvent:
    kind = msg.WhichOneof("event")
    if kind == "job":
        return JobEvent(kind="job", revision=msg.revision, job=job_from_proto(msg.job))
    if kind == "state_change":
        return JobEvent(kind="state", revision=msg.revision, transition=_transition(msg.state_change))
    return JobEvent(kind="progress", revision=msg.revision, progress=_progress(msg.progress))


def _spec(job: JobSpec | Mapping[str, Any] | str | Path) -> JobSpec:
    """A validated job; a model given by entry point (``"pkg.mod:fn"``) is measured here first, and a
    Hugging Face ``config.json`` is read here, so the scheduler receives the resolved architecture."""
    if isinstance(job, JobSpec):
        return job
    if isinstance(job, str | Path):
        return in_file(job, lambda doc: _one_job(_resolved(doc)), load_document(job))
    return job_from_dict(_resolved(dict(job)))


def _resolved(doc: Any) -> Any:
    from spiderflow.exec.custom import resolve_job_model

    if isinstance(doc, dict) and isinstance(doc.get("jobs"), list):
        return {**doc, "jobs": [resolve_job_model(j) if isinstance(j, dict) else j for j in doc["jobs"]]}
    return resolve_job_model(doc) if isinstance(doc, dict) else doc


def _one_job(doc: Any) -> JobSpec:
    """A job object, or a trace document holding exactly one job."""
    if isinstance(doc, dict) and "jobs" in doc:
        jobs = doc["jobs"]
        if not isinstance(jobs, list):
            raise ValidationError("jobs", "must be a list", jobs)
        if len(jobs) != 1:
            raise ValidationError("jobs", "a job file must hold one job (use a trace for several)", len(jobs))
        return job_from_dict(jobs[0], where="jobs[0]")
    return job_from_dict(doc)


def _submit_request(job: JobSpec | Mapping[str, Any] | str | Path, request_id: str | None,
                    policy: str | None) -> scheduler_pb2.SubmitJobRequest:
    spec = _spec(job)
    return scheduler_pb2.SubmitJobRequest(request_id=request_id or f"{spec.id}-{uuid.uuid4().hex[:12]}",
                                          job=convert.job_to_proto(spec), policy=policy or "")


def _security(credentials: grpc.ChannelCredentials | None, tls_dir: str | Path | None,
              token: str | None) -> tuple[grpc.ChannelCredentials | None, tuple[tuple[str, str], ...]]:
    if credentials is None:
        bundle = client_tls_dir(tls_dir)
        if bundle is None and (ctx_dir := context_value("tls_dir")):
            bundle = Path(ctx_dir).expanduser()
        credentials = channel_credentials(bundle) if bundle is not None else None
    return credentials, bearer_metadata(client_token(token) or context_value("token"))


def _list_request(states: Sequence[str] | None, tenant: str | None, page_size: int,
                  token: str) -> scheduler_pb2.ListJobsRequest:
    return scheduler_pb2.ListJobsRequest(
        states=[convert.job_state_to_proto(s.lower()) for s in states or ()], tenant=tenant or "",
        page_size=page_size, page_token=token,
    )


class Client:
    """Blocking client. ``timeout_s`` bounds every unary call (watch streams are unbounded)."""

    def __init__(self, scheduler: str | None = None, *, topology: str | None = None, timeout_s: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None, tls_dir: str | Path | None = None,
                 token: str | None = None) -> None:
        self.scheduler_address = resolve_address("scheduler", scheduler)
        self._topology_address = topology
        self.timeout_s = timeout_s
        self._credentials, self._md = _security(credentials, tls_dir, token)
        self._call: dict[str, Any] = {"timeout": timeout_s, "metadata": self._md}
        self._channel = self._open(self.scheduler_address)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def _open(self, address: str) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(address, self._credentials, options=channel_options())
        return grpc.insecure_channel(address, options=channel_options())

    def submit(self, job: JobSpec | Mapping[str, Any] | str | Path, *, request_id: str | None = None,
               policy: str | None = None) -> Job:
        """Submit a job (a JobSpec, a trace-format dict, or a JSON/YAML file). Retrying with the same
        ``request_id`` returns the same job."""
        req = _submit_request(job, request_id, policy)
        with domain_errors():
            return job_from_proto(self._stub.SubmitJob(req, **self._call).job)

    def get(self, job_id: str) -> Job:
        with domain_errors():
            return job_from_proto(self._stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id),
                                                    **self._call).job)

    def list(self, *, states: Sequence[str] | None = None, tenant: str | None = None) -> list[Job]:
        """Every job matching the filters (all pages), in submission order."""
        out: list[Job] = []
        token = ""
        with domain_errors():
            while True:
                resp = self._stub.ListJobs(_list_request(states, tenant, 1000, token), **self._call)
                out.extend(job_from_proto(j) for j in resp.jobs)
                token = resp.next_page_token
                if not token:
                    return out

    def watch(self, job_id: str, *, include_progress: bool = True, from_revision: int = 0) -> Stream[JobEvent]:
        """The job's record, then its state changes (and progress) until it ends; :meth:`Stream.cancel` stops
        watching."""
        req = scheduler_pb2.WatchJobRequest(job_id=job_id, include_progress=include_progress,
                                            from_revision=from_revision)
        return Stream(self._stub.WatchJob(req, metadata=self._md), _event)

    def follow(self, job_id: str, *, deadline: float, include_progress: bool = True) -> Iterator[JobEvent]:
        """:meth:`watch` until the job ends, watching again from the last revision seen when the stream breaks
        (a scheduler restart, an idle connection closed by the server) until ``deadline``
        (``time.monotonic()`` seconds); after it an :class:`UnavailableError` is raised."""
        revision = 0
        while True:
            try:
                for ev in self.watch(job_id, include_progress=include_progress, from_revision=revision):
                    revision = max(revision, ev.revision)
                    yield ev
                return
            except UnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def cancel(self, job_id: str, reason: str = "") -> Job:
        with domain_errors():
            return job_from_proto(self._stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id, reason=reason),
                                                       **self._call).job)

    def delete(self, job_id: str) -> Job:
        """Delete a finished job (its record, metrics and request id); returns its last record.
        ``PreconditionError`` while it has not finished."""
        with domain_errors():
            return job_from_proto(self._stub.DeleteJob(scheduler_pb2.DeleteJobRequest(job_id=job_id),
                                                       **self._call).job)

    def metrics(self, job_id: str, *, limit: int = 0) -> Metrics:
        """Every kept training step of the job (the newest ``limit`` when > 0)."""
        with domain_errors():
            return _metrics(self._stub.GetJobMetrics(scheduler_pb2.GetJobMetricsRequest(job_id=job_id, limit=limit),
                                                     **self._call))

    def logs(self, job_id: str, *, follow: bool = False, attempt: int | None = None, cluster: str | None = None,
             rank: int | None = None, stream: str | None = None) -> Stream[LogChunk]:
        """The workers' output of the job, relayed from the agents that keep it; with ``follow``, until the
        job has ended (or :meth:`Stream.cancel`). Filters: ``attempt``, ``cluster``, ``rank``, ``stream``
        (``stdout``/``stderr``)."""
        req = _logs_request(job_id, follow, attempt, cluster, rank, stream)
        return Stream(self._stub.GetJobLogs(req, metadata=self._md), _chunk)

    def topology(self) -> Topology:
        """The live topology snapshot from the topology service."""
        channel = self._open(resolve_address("topology", self._topology_address))
        try:
            with domain_errors():
                resp = topology_pb2_grpc.TopologyStub(channel).GetTopology(topology_pb2.GetTopologyRequest(),
                                                                          **self._call)
            return convert.topology_from_proto(resp.topology)
        finally:
            channel.close()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the methods of :class:`Client` as coroutines."""

    def __init__(self, scheduler: str | None = None, *, topology: str | None = None, timeout_s: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None, tls_dir: str | Path | None = None,
                 token: str | None = None) -> None:
        self.scheduler_address = resolve_address("scheduler", scheduler)
        self._topology_address = topology
        self.timeout_s = timeout_s
        self._credentials, self._md = _security(credentials, tls_dir, token)
        self._call: dict[str, Any] = {"timeout": timeout_s, "metadata": self._md}
        self._channel = open_channel(self.scheduler_address, credentials=self._credentials)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def submit(self, job: JobSpec | Mapping[str, Any] | str | Path, *, request_id: str | None = None,
                     policy: str | None = None) -> Job:
        req = _submit_request(job, request_id, policy)
        with domain_errors():
            return job_from_proto((await self._stub.SubmitJob(req, **self._call)).job)

    async def get(self, job_id: str) -> Job:
        with domain_errors():
            resp = await self._stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job_id), **self._call)
        return job_from_proto(resp.job)

    async def list(self, *, states: Sequence[str] | None = None, tenant: str | None = None) -> list[Job]:
        out: list[Job] = []
        token = ""
        with domain_errors():
            while True:
                resp = await self._stub.ListJobs(_list_request(states, tenant, 1000, token), **self._call)
                out.extend(job_from_proto(j) for j in resp.jobs)
                token = resp.next_page_token
                if not token:
                    return out

    async def watch(self, job_id: str, *, include_progress: bool = True,
                    from_revision: int = 0) -> AsyncIterator[JobEvent]:
        req = scheduler_pb2.WatchJobRequest(job_id=job_id, include_progress=include_progress,
                                            from_revision=from_revision)
        with domain_errors():
            async for msg in self._stub.WatchJob(req, metadata=self._md):
                yield _event(msg)

    async def cancel(self, job_id: str, reason: str = "") -> Job:
        with domain_errors():
            resp = await self._stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job_id, reason=reason),
                                              **self._call)
        return job_from_proto(resp.job)

    async def delete(self, job_id: str) -> Job:
        with domain_errors():
            resp = await self._stub.DeleteJob(scheduler_pb2.DeleteJobRequest(job_id=job_id), **self._call)
        return job_from_proto(resp.job)

    async def metrics(self, job_id: str, *, limit: int = 0) -> Metrics:
        with domain_errors():
            return _metrics(await self._stub.GetJobMetrics(
                scheduler_pb2.GetJobMetricsRequest(job_id=job_id, limit=limit), **self._call))

    async def logs(self, job_id: str, *, follow: bool = False, attempt: int | None = None,
                   cluster: str | None = None, rank: int | None = None,
                   stream: str | None = None) -> AsyncIterator[LogChunk]:
        req = _logs_request(job_id, follow, attempt, cluster, rank, stream)
        with domain_errors():
            async for m in self._stub.GetJobLogs(req, metadata=self._md):
                yield _chunk(m)

    async def topology(self) -> Topology:
        channel = open_channel(resolve_address("topology", self._topology_address), credentials=self._credentials)
        try:
            with domain_errors():
                resp = await topology_pb2_grpc.TopologyStub(channel).GetTopology(topology_pb2.GetTopologyRequest(),
                                                                                **self._call)
            return convert.topology_from_proto(resp.topology)
        finally:
            await channel.close()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
