"""The assignment executor: runs the stages the scheduler assigns to this agent's cluster.

Contract with the scheduler (keys in :mod:`spiderflow.store.keys`, read and written through the control
plane's ``Control`` API, :mod:`agent.remote_store`; the agent holds no etcd credentials):

- **Assignments.** A bind writes ``assignments/<cluster>/<job>`` = ``{"job", "attempt", "stages", "plan",
  "spec"}`` (:class:`spiderflow.store.records.Assignment`, the one codec of every stored record; written by
  :mod:`services.scheduler.repo`). The executor lists its prefix, then watches it from the
  revision of the list (no gap, no duplicate). A new ``(job, attempt)`` starts a run; a deleted key (the
  job ended, was cancelled, or is being re-placed) or a PUT of a newer attempt stops the old run's workers
  without reporting anything.
- **Ranks.** :func:`spiderflow.exec.spec.rank_layout` numbers the plan's ranks; this agent starts
  :func:`~spiderflow.exec.spec.ranks_of_cluster` — one ``python -m spiderflow.exec.worker`` process per
  rank (gloo, ``torch.set_num_threads(1)``), each with its stdout events (JSON lines) read here and its
  stdout/stderr kept where :func:`spiderflow.joblogs.rank_log_paths` says
  (``<work_dir>/logs/<job>/attempt-<n>/<cluster>/rank-<r>.{out,log}``, beside the attempt's worker spec).
  The workers start through the cluster's launcher (:mod:`agent.launchers`: local subprocesses, one Slurm
  batch job or one Kubernetes Job per group of consecutive ranks). A launcher that cannot start fails the
  stages with the workload manager's message; workers the workload manager stopped (preemption, node
  failure, time limit, an operator's cancel) are reported as ``preempted`` and the scheduler re-places the
  job, which resumes from its last complete checkpoint.
- **Rendezvous.** The agent hosting rank 0 serves the attempt's ``torch.distributed`` TCPStore itself
  (on its own address, a port the kernel picks: no port race; keys prefixed ``<job>/attempt-<n>/``; torch
  is imported by the agent on first use), chooses the checkpoint to resume from (``checkpoints/<job>``,
  read once for the whole attempt) and only then publishes ``rendezvous/<job>/<attempt>`` = ``{"host",
  "port", "checkpoint_dir", "checkpoint_every", "resume"}``. Every other agent waits for that key
  (list-then-watch), so all ranks agree on the store, the checkpoint cadence and the resume point, and no
  worker dials the store before it listens (through the testbed's delay relay an early dial would be
  accepted by the relay and then reset).
- **Progress.** Step events of the last stage's replica 0 (the one that knows the global batch's loss)
  go to the scheduler's ``ReportProgress`` with the assignment's attempt, coalesced at most every
  ``report_interval_s``: step, loss, step time, tokens/s. ``stop=true`` in the answer stops the run. A run
  stopped by the scheduler or by its assignment's removal reports the events it had not reported yet once,
  best effort (a stage before the last may finish its last steps just after the job ended).
- **Outcomes.** When this agent's workers have exited: one ``WorkerOutcome`` per stage it runs
  (``succeeded`` when every rank of the stage exited 0; otherwise ``error`` = the worker's error event and
  the last lines of its stderr). The final progress travels in the same request as the outcomes, so the
  job's record ends with its last figures. A failure that looks like a lost peer (a closed or reset
  connection, a timeout) is held back for ``failure_grace_s``: when a cluster dies, its agent's lease
  expires and the scheduler re-places the job (deleting this assignment) — that is a re-placement, not a
  failure of the job. Only if the assignment is still there after the grace is the failure reported.
- **Checkpoints.** Every ``checkpoint_every`` steps (the job's own, else the rank-0 agent's
  :attr:`ExecutorSettings.checkpoint_every`) each stage saves its shard under
  ``<checkpoint_dir>/<job>/attempt-<n>/``; once all have saved (a barrier in the workers) rank 0 prints the
  manifest and its agent writes it to ``checkpoints/<job>`` (compare-and-swap, only a newer step
  replaces an older one). A later attempt — any clusters, any layer split — resumes from it by
  re-slicing layers (:mod:`spiderflow.exec.checkpoint`). The shard paths in the manifest must be readable
  by the next attempt's workers: on one machine a shared directory (``spiderflow up`` uses
  ``<mesh>/checkpoints``); on real clusters a file system every agent mounts at the same path
  (NFS, Lustre, a bucket through a FUSE mount). The rank-0 agent's ``checkpoint_dir`` is the one every rank
  uses (it travels in the rendezvous).
- **Workers.** Every rank's state (starting, running with its last step, succeeded, failed with its exit
  code and error, stopped) and the progress events go to the agent's :class:`agent.workers.WorkerBoard`,
  which its ``GetStatus`` and ``WatchWorkers`` RPCs show.
- **Busy.** ``on_busy(True)`` while any worker of this agent runs, ``on_busy(False)`` after the last
  one exited (the agent pauses bulk probes meanwhile: :meth:`agent.agent.Agent.set_busy`).

Local workers die with their agent (``setpriv --pdeathsig KILL``): an agent killed by SIGKILL takes its
ranks with it, as a lost cluster does. Inside the emulated testbed the rendezvous host is the agent's namespace
address and gloo binds the interface named by ``GLOO_SOCKET_IFNAME`` (set by the testbed, inherited by the
workers); on loopback ``GLOO_SOCKET_IFNAME=lo`` is set when the environment does not name one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from agent.launchers.base import GroupResult, Launcher, LaunchError, LaunchHandle, StageGroup, stage_groups
from agent.launchers.local import LocalLauncher
from agent.workers import WorkerBoard
from spiderflow import joblogs
from spiderflow.core.errors import CorruptRecordError, NotFoundError, SpiderFlowError, UnavailableError, ValidationError
from spiderflow.exec.preflight import preflight
from spiderflow.exec.spec import (
    CheckpointManifest,
    RankInfo,
    TrainSpec,
    check_runnable,
    manifest_from_dict,
    rank_layout,
    ranks_of_cluster,
    spec_to_dict,
)
from spiderflow.proto.agent.v1 import agent_pb2
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.security import ids
from spiderflow.store import keys, records
from spiderflow.store.base import CompactedError, CompareFailedError, EventType, Store
from spiderflow.store.records import Assignment, RendezvousInfo

__all__ = [
    "Assignment",
    "Executor",
    "ExecutorSettings",
    "RendezvousInfo",
    "Reporter",
    "SchedulerReporter",
    "executor_for",
    "is_peer_error",
]

log = structlog.get_logger(__name__)

_PEER_ERRORS = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "timeout",
                "connection refused", "socket closed", "read error", "eof", "distbackenderror")


def is_peer_error(text: str) -> bool:
    """Whether a worker's error reads like the loss of another rank rather than a fault of its own."""
    low = text.lower()
    return any(p in low for p in _PEER_ERRORS)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorSettings:
    """``host``: the address this agent's ranks bind and the rank-0 store listens on (the agent's
    advertised host). ``work_dir``: worker specs and logs. ``checkpoint_dir``: the shared checkpoint root.
    ``checkpoint_every``: steps between checkpoints (0: none). ``failure_grace_s``: how long a peer-looking
    failure waits for a re-placement before it is reported. ``python``: the interpreter of the workers (on the
    compute nodes); ``gpus_per_node``: ranks per node of a multi-node launch (Slurm, Kubernetes)."""

    cluster: str
    host: str
    work_dir: Path
    checkpoint_dir: Path
    checkpoint_every: int = 10
    rendezvous_timeout_s: float = 120.0
    failure_grace_s: float = 20.0
    report_interval_s: float = 0.25
    stop_grace_s: float = 3.0
    python: str = sys.executable
    gpus_per_node: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ValidationError("checkpoint_every", "must be an integer ≥ 0", self.checkpoint_every)
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValidationError("gpus_per_node", "must be an integer ≥ 1", self.gpus_per_node)
        for name in ("rendezvous_timeout_s", "failure_grace_s", "report_interval_s", "stop_grace_s"):
            if not getattr(self, name) > 0:
                raise ValidationError(name, "must be > 0", getattr(self, name))


class Reporter(Protocol):
    """Sends a ReportProgress request; returns ``(accepted, stop)``. Raises domain errors
    (:class:`UnavailableError` when the scheduler cannot be reached)."""

    async def report(self, request: scheduler_pb2.ReportProgressRequest) -> tuple[bool, bool]: ...

    async def close(self) -> None: ...


class SchedulerReporter:
    """:class:`Reporter` over a gRPC channel to the Scheduler service (mTLS with ``tls_dir``; the bearer
    ``token`` with every call)."""

    def __init__(self, address: str, *, timeout_s: float = 10.0, tls_dir: str | None = None,
                 token: str | None = None) -> None:
        from spiderflow.proto.scheduler.v1 import scheduler_pb2_grpc
        from spiderflow.rpc.server import open_channel
        from spiderflow.security.auth import bearer_metadata

        credentials = None
        if tls_dir:
            from spiderflow.security.tls import channel_credentials

            credentials = channel_credentials(Path(tls_dir))
        self._channel = open_channel(address, credentials=credentials)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._timeout = timeout_s
        self._metadata = bearer_metadata(token)

    async def report(self, request: scheduler_pb2.ReportProgressRequest) -> tuple[bool, bool]:
        from spiderflow.rpc.errors import domain_errors

        with domain_errors():
            resp = await self._stub.ReportProgress(request, timeout=self._timeout, metadata=self._metadata)
        return bool(resp.accepted), bool(resp.stop)

    async def close(self) -> None:
        await self._channel.close()


def _serve_store(host: str, world: int, timeout_s: float) -> Any:
    """A ``torch.distributed`` TCPStore server on a free port (torch is imported on first use only)."""
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(host, 0, world + 1, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


@dataclass
class _RankState:
    info: RankInfo
    error: str = ""
    done: bool = False


@dataclass
class _Run:
    assignment: Assignment
    task: asyncio.Task[None] | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""

    def cancel(self, reason: str) -> None:
        if not self.cancelled.is_set():
            self.reason = reason
            self.cancelled.set()


FLUSH_TIMEOUT_S = 5.0
"""How long a stopped run's last progress report may take (:meth:`Executor._flush_progress`)."""


class _Cancelled(Exception):
    """The run was stopped (assignment gone, newer attempt, scheduler said stop, agent shutting down)."""


class Executor:
    """Runs this cluster's assignments (see the module docstring)."""

    def __init__(self, settings: ExecutorSettings, store: Store, reporter: Reporter, *,
                 on_busy: Callable[[bool], None] | None = None, launcher: Launcher | None = None,
                 workers: WorkerBoard | None = None) -> None:
        self.settings = settings
        self.workers = workers if workers is not None else WorkerBoard()
        """Where the state of every rank this executor starts is kept (the agent's RPCs read it)."""
        self.launcher: Launcher = launcher if launcher is not None else LocalLauncher(host=settings.host)
        self.store = store
        self.reporter = reporter
        self.on_busy = on_busy
        self.runs: dict[str, _Run] = {}
        self._finished: set[tuple[str, int]] = set()
        self._busy = 0
        self.owns_clients = False
        self.log = log.bind(cluster=settings.cluster)

    # -- the assignment loop --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """List-then-watch the assignments until ``stop``; then stop every run and wait for it."""
        watcher = asyncio.create_task(self._watch_loop(), name="executor-watch")
        try:
            await stop.wait()
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
            await self.shutdown()
            if self.owns_clients:
                with contextlib.suppress(Exception):
                    await self.reporter.close()
                with contextlib.suppress(Exception):
                    await self.store.close()

    async def shutdown(self) -> None:
        runs = list(self.runs.values())
        for r in runs:
            r.cancel("agent stopping")
        for r in runs:
            if r.task is not None:
                with contextlib.suppress(BaseException):
                    await r.task
        self.runs.clear()

    async def _watch_loop(self) -> None:
        prefix = keys.assignments_prefix(self.settings.cluster)
        while True:
            try:
                items, rev = await self.store.get_prefix(prefix)
                present = {kv.key: kv.value for kv in items}
                for job, run in list(self.runs.items()):
                    if keys.assignment_key(self.settings.cluster, job) not in present:
                        run.cancel("assignment removed")
                for key, value in present.items():
                    self._on_put(key, value)
                async with self.store.watch_prefix(prefix, start_revision=rev + 1) as watch:
                    async for ev in watch:
                        if ev.type is EventType.DELETE:
                            current = self.runs.get(keys.parse(ev.key).job)
                            if current is not None:
                                current.cancel("assignment removed")
                        else:
                            self._on_put(ev.key, ev.value)
            except asyncio.CancelledError:
                raise
            except (CompactedError, SpiderFlowError) as e:
                self.log.warning("executor.watch_failed", error=str(e))
                await asyncio.sleep(1.0)

    def _on_put(self, key: str, value: bytes) -> None:
        try:
            a = records.decode_as(key, value, Assignment)
        except CorruptRecordError as e:
            self.log.warning("executor.bad_assignment", key=key, field=e.field, error=e.reason)
            return
        if (a.job, a.attempt) in self._finished:
            return
        old = self.runs.get(a.job)
        if old is not None:
            if old.assignment.attempt >= a.attempt:
                return
            old.cancel(f"attempt {a.attempt} replaces it")
        run = _Run(assignment=a)
        self.runs[a.job] = run
        run.task = asyncio.create_task(self._run_guarded(run, old), name=f"run-{a.job}-{a.attempt}")

    async def _run_guarded(self, run: _Run, previous: _Run | None) -> None:
        a = run.assignment
        bound = self.log.bind(job=a.job, attempt=a.attempt)
        if previous is not None and previous.task is not None:
            with contextlib.suppress(BaseException):
                await previous.task
        try:
            await self._execute(run, bound)
        except _Cancelled:
            bound.info("executor.run_stopped", reason=run.reason)
        except Exception as e:  # a bug here must not kill the agent; the job is told
            bound.exception("executor.run_crashed")
            with contextlib.suppress(Exception):
                await self._report_outcomes(run, {s: f"agent executor error: {type(e).__name__}: {e}"
                                                  for s in a.stages}, bound)
        finally:
            self.workers.end_attempt(a.job, a.attempt, reason=run.reason or "the agent's run of the attempt ended")
            self._finished.add((a.job, a.attempt))
            if self.runs.get(a.job) is run:
                del self.runs[a.job]

    # -- one run ----------------------------------------------------------------------------------------

    async def _execute(self, run: _Run, bound: Any) -> None:
        a = run.assignment
        s = self.settings
        ranks = ranks_of_cluster(a.plan, s.cluster)
        layout = rank_layout(a.plan)
        if not ranks:
            bound.info("executor.no_ranks")
            return
        hosts_zero = layout[0].cluster == s.cluster
        bound.info("executor.assigned", stages=list(a.stages), ranks=[r.rank for r in ranks], world=len(layout),
                   rank0=hosts_zero)
        rdv_key = keys.rendezvous_key(a.job, a.attempt)
        server: Any = None  # the TCPStore this agent hosts for the attempt (rank 0's agent only)
        if hosts_zero:
            info, server = await self._publish_rendezvous(a, rdv_key, len(layout), bound)
        else:
            info = await self._await_rendezvous(run, rdv_key, bound)
        try:
            await self._run_attempt(run, info, layout, bound)
        finally:
            if hosts_zero:
                with contextlib.suppress(SpiderFlowError):
                    await self.store.delete(rdv_key)
            del server

    async def _run_attempt(self, run: _Run, info: RendezvousInfo, layout: tuple[RankInfo, ...], bound: Any) -> None:
        a = run.assignment
        s = self.settings
        ranks = ranks_of_cluster(a.plan, s.cluster)
        try:
            spec = TrainSpec(
                job_id=a.job, model=a.spec.model, plan=a.plan, seq_len=a.spec.seq_len,
                global_batch=a.spec.global_batch, steps=a.spec.steps, threads=1, data=a.spec.data,
                optimizer=a.spec.optimizer, precision=a.spec.precision,
                checkpoint_dir=info.checkpoint_dir if info.checkpoint_every else None,
                checkpoint_every=info.checkpoint_every, resume_from=info.resume,
            )
            check_runnable(spec)
            # The data and weights are opened here, before any worker starts: a bad path or token fails
            # the job at placement with the field named, never in the middle of training.
            await asyncio.to_thread(preflight, spec)
        except SpiderFlowError as e:
            await self._report_outcomes(run, {st: f"cannot run the plan: {e}" for st in a.stages}, bound)
            return
        # the attempt's worker spec and its ranks' logs (kept by the agent's retention policy, read by ReadLogs)
        run_dir = joblogs.attempt_dir(s.work_dir, job=a.job, attempt=a.attempt, cluster=s.cluster)
        doc = spec_to_dict(spec)
        doc["rendezvous"] = {"host": info.host, "port": info.port, "world_size": len(layout), "rank": 0,
                             "serve": False, "timeout_s": s.rendezvous_timeout_s}
        doc["namespace"] = f"{a.job}/attempt-{a.attempt}/"
        spec_path = run_dir / "worker-spec.json"
        spec_path.write_text(json.dumps(doc, indent=1))
        await self._supervise(run, spec, spec_path, run_dir, ranks, bound)

    async def _publish_rendezvous(self, a: Assignment, key: str, world: int,
                                  bound: Any) -> tuple[RendezvousInfo, Any]:
        s = self.settings
        resume: CheckpointManifest | None = None
        kv = await self.store.get(keys.checkpoint_key(a.job))
        if kv is not None:
            try:
                m = records.decode_as(kv.key, kv.value, records.CheckpointRecord).manifest
                if m.job_id == a.job and m.model.layers == a.spec.model.layers and m.step < a.spec.steps \
                        and all(Path(sh.path).is_file() for sh in m.shards):
                    resume = m
                else:
                    bound.warning("executor.checkpoint_unusable", step=m.step)
            except (ValidationError, ValueError) as e:
                bound.warning("executor.checkpoint_unreadable", error=str(e))
        server = await asyncio.to_thread(_serve_store, s.host, world, s.rendezvous_timeout_s)
        info = RendezvousInfo(
            host=s.host, port=int(server.port),
            checkpoint_dir=str(ids.inside(s.checkpoint_dir, a.job, f"attempt-{a.attempt}").resolve()),
            checkpoint_every=a.spec.checkpoint_every if a.spec.checkpoint_every is not None else s.checkpoint_every,
            resume=resume,
        )
        await self.store.put(key, records.encode(info))
        bound.info("executor.rendezvous_published", host=info.host, port=info.port,
                   resume_step=resume.step if resume else None, checkpoint_every=info.checkpoint_every)
        return info, server

    async def _await_rendezvous(self, run: _Run, key: str, bound: Any) -> RendezvousInfo:
        deadline = time.monotonic() + self.settings.rendezvous_timeout_s

        async def wait() -> RendezvousInfo:
            while True:
                kv = await self.store.get(key)
                if kv is not None:
                    return records.decode_as(kv.key, kv.value, RendezvousInfo)
                rev = await self.store.revision()
                kv = await self.store.get(key)
                if kv is not None:
                    return records.decode_as(kv.key, kv.value, RendezvousInfo)
                async with self.store.watch_prefix(key, start_revision=rev + 1) as watch:
                    async for ev in watch:
                        if ev.key == key and ev.type is EventType.PUT:
                            return records.decode_as(ev.key, ev.value, RendezvousInfo)

        waiter = asyncio.create_task(wait())
        cancelled = asyncio.create_task(run.cancelled.wait())
        try:
            done, _ = await asyncio.wait({waiter, cancelled}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waiter, cancelled):
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        if waiter in done and not waiter.cancelled() and waiter.exception() is None:
            info = waiter.result()
            bound.info("executor.rendezvous_found", host=info.host, port=info.port,
                       resume_step=info.resume.step if info.resume else None)
            return info
        if run.cancelled.is_set():
            raise _Cancelled
        raise UnavailableError(f"no rendezvous for attempt {run.assignment.attempt} of {run.assignment.job} "
                               f"within {self.settings.rendezvous_timeout_s:.0f} s")

    def _set_busy(self, delta: int) -> None:
        before = self._busy > 0
        self._busy += delta
        after = self._busy > 0
        if before != after and self.on_busy is not None:
            self.on_busy(after)

    async def _supervise(self, run: _Run, spec: TrainSpec, spec_path: Path, run_dir: Path,
                         ranks: tuple[RankInfo, ...], bound: Any) -> None:
        a = run.assignment
        s = self.settings
        last_stage = len(a.plan.stages) - 1
        pending: list[types_pb2.ProgressEvent] = []
        new_progress = asyncio.Event()
        state = {r.rank: _RankState(info=r) for r in ranks}
        handles: list[LaunchHandle] = []
        pids: dict[int, int] = {}

        def worker(r: RankInfo) -> agent_pb2.Worker:
            return agent_pb2.Worker(rank=r.rank, stage=r.stage, replica=r.replica, tp_rank=r.tp_rank,
                                    pid=pids.get(r.rank, 0))

        def note_succeeded(results: list[GroupResult]) -> None:
            """Mark the ranks that said they are done and exited 0."""
            for res in results:
                for rank, code in res.exit_codes.items():
                    if code == 0 and state[rank].done:
                        self.workers.update(a.job, a.attempt, worker(state[rank].info),
                                            agent_pb2.WORKER_STATE_SUCCEEDED, exit_code=0)

        async def on_line(rank: int, text: str) -> None:
            w = state.get(rank)
            if w is None:
                return
            try:
                ev = json.loads(text)
            except ValueError:
                return
            if not isinstance(ev, dict):
                return
            kind = ev.get("event")
            if kind == "step":
                with contextlib.suppress(TypeError, ValueError):
                    self.workers.update(a.job, a.attempt, worker(w.info), agent_pb2.WORKER_STATE_RUNNING,
                                        step=int(ev["step"]))
            if kind == "step" and w.info.replica == 0 and w.info.tp_rank == 0:
                # one rank per stage reports: the last stage's event moves the job, the others add their
                # stage's busy time to the metrics history
                pending.append(types_pb2.ProgressEvent(
                    job_id=a.job, attempt=a.attempt, step=int(ev["step"]), steps_total=spec.steps,
                    loss=float(ev.get("loss") or 0.0) if w.info.stage == last_stage else 0.0,
                    tokens_per_s=float(ev["tokens_per_s"]), step_time_s=float(ev["step_time_s"]),
                    stage=w.info.stage, stage_busy_s=max(0.0, float(ev.get("busy_s") or 0.0)),
                ))
                new_progress.set()
                self.workers.progress(pending[-1])
            elif kind == "checkpoint":
                await self._record_checkpoint(run, ev.get("manifest"), bound)
            elif kind == "error":
                w.error = f"{ev.get('type', 'Error')}: {ev.get('message', '')}"
            elif kind == "done":
                w.done = True

        results: list[GroupResult] = []
        launch_error = ""
        self._set_busy(+1)
        try:
            for members in stage_groups(ranks):
                group = StageGroup(job=a.job, attempt=a.attempt, ranks=members, spec_path=spec_path, run_dir=run_dir,
                                   gpus_per_node=s.gpus_per_node, python=s.python)
                try:
                    handle = await self.launcher.launch(group)
                except LaunchError as e:
                    launch_error = str(e)
                    for r in members:
                        self.workers.update(a.job, a.attempt, worker(r), agent_pb2.WORKER_STATE_FAILED,
                                            error=f"{self.launcher.kind.value} launcher: {launch_error}")
                    bound.warning("executor.launch_failed", launcher=self.launcher.kind.value, error=launch_error,
                                  ranks=[r.rank for r in members])
                    break
                handles.append(handle)
                pids.update(handle.pids)
                for r in members:
                    self.workers.update(a.job, a.attempt, worker(r), agent_pb2.WORKER_STATE_STARTING)
            if launch_error:
                for h in handles:
                    await h.stop(s.stop_grace_s)
                self.workers.end_attempt(a.job, a.attempt, reason="stopped: another group of this cluster's ranks "
                                                                  "could not start")
                await self._report_outcomes(run, {st: f"{self.launcher.kind.value} launcher: {launch_error}"
                                                  for st in a.stages}, bound)
                return
            bound.info("executor.workers_started", launcher=self.launcher.kind.value, groups=[h.ident for h in handles],
                       ranks=[r.rank for r in ranks],
                       resume_step=spec.resume_from.step if spec.resume_from else None)

            all_run: asyncio.Future[list[GroupResult]] = asyncio.ensure_future(
                asyncio.gather(*(h.run(on_line) for h in handles)))
            reporter = asyncio.create_task(self._progress_loop(run, pending, new_progress, bound))
            cancelled = asyncio.create_task(run.cancelled.wait())
            try:
                await asyncio.wait([all_run, cancelled], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
            finally:
                reporter.cancel()
                cancelled.cancel()
                with contextlib.suppress(BaseException):
                    await reporter
            if run.cancelled.is_set():
                if not all_run.done() and all(w.done for w in state.values()):
                    # Every rank said it is done (its last checkpoint written) and is tearing down: the job
                    # may already be marked finished from that progress; let the ranks exit on their own
                    # within the grace rather than signalling them mid-exit.
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(asyncio.shield(all_run), s.stop_grace_s)
                if not all_run.done():
                    for h in handles:
                        await h.stop(s.stop_grace_s)
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(all_run, s.stop_grace_s + 30.0)
                if all_run.done() and not all_run.cancelled() and all_run.exception() is None:
                    note_succeeded(all_run.result())  # ranks that finished before the stop reached them
                await self._flush_progress(run, pending, bound)
                raise _Cancelled
            results = await all_run
        finally:
            for h in handles:
                with contextlib.suppress(Exception):
                    await h.cleanup()
            self._set_busy(-1)

        errors: dict[int, str] = {}
        preempted: set[int] = set()
        note_succeeded(results)
        for res in results:
            for rank, code in res.exit_codes.items():
                w = state[rank]
                if code == 0 and w.done:
                    continue
                if res.preempted and not w.error:
                    err = f"stopped by the workload manager: {res.preempted}"
                else:
                    err = w.error or ("worker exited with " + (str(code) if code is not None else "no status"))
                tail = res.errors.get(rank, "")
                text = f"rank {rank}: {err}" + (f"\n{tail}" if tail and tail not in err else "")
                self.workers.update(a.job, a.attempt, worker(w.info), agent_pb2.WORKER_STATE_FAILED,
                                    exit_code=code if code is not None else -1, error=text)
                errors.setdefault(w.info.stage, text)
                if res.preempted:
                    preempted.add(w.info.stage)
        outcomes = {st: errors.get(st, "") for st in a.stages}
        if errors:
            bound.warning("executor.workers_failed", stages=sorted(errors), preempted=sorted(preempted),
                          error=next(iter(errors.values())).splitlines()[0][:300])
            if not preempted and all(is_peer_error(e) for e in errors.values()) \
                    and await self._wait_cancelled(run, self.settings.failure_grace_s):
                raise _Cancelled
        else:
            bound.info("executor.workers_succeeded", stages=list(a.stages))
        await self._report_outcomes(run, outcomes, bound, progress=pending, preempted=preempted)

    async def _wait_cancelled(self, run: _Run, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.cancelled.wait(), seconds)
        return run.cancelled.is_set()

    # -- reports ----------------------------------------------------------------------------------------

    async def _progress_loop(self, run: _Run, pending: list[types_pb2.ProgressEvent], new: asyncio.Event,
                             bound: Any) -> None:
        a = run.assignment
        while True:
            await new.wait()
            new.clear()
            if not pending:
                continue
            batch = list(pending)
            req = scheduler_pb2.ReportProgressRequest(cluster=self.settings.cluster, job_id=a.job,
                                                      attempt=a.attempt, progress=batch)
            try:
                _, stop = await self.reporter.report(req)
            except NotFoundError as e:
                bound.info("executor.report_rejected", error=str(e))
                run.cancel("the scheduler no longer assigns this cluster")
                return
            except SpiderFlowError as e:
                bound.warning("executor.report_failed", error=str(e))
                stop = False
            else:
                del pending[: len(batch)]
            if stop:
                run.cancel("the scheduler asked to stop")
                return
            await asyncio.sleep(self.settings.report_interval_s)

    async def _flush_progress(self, run: _Run, pending: list[types_pb2.ProgressEvent], bound: Any) -> None:
        """Report the progress events a stopped run had not reported yet, once and best effort. A stage that is
        not the last may finish its last steps just after the last stage's success ended the job, which removes
        the assignments; the scheduler keeps such late stage events (their busy times) in the job's metrics
        and ignores events of an attempt that is no longer current."""
        if not pending:
            return
        a = run.assignment
        req = scheduler_pb2.ReportProgressRequest(cluster=self.settings.cluster, job_id=a.job, attempt=a.attempt,
                                                  progress=list(pending))
        try:
            await asyncio.wait_for(self.reporter.report(req), FLUSH_TIMEOUT_S)
        except (SpiderFlowError, TimeoutError) as e:
            bound.info("executor.late_progress_not_reported", events=len(pending), error=str(e))
        else:
            pending.clear()

    async def _report_outcomes(self, run: _Run, outcomes: dict[int, str], bound: Any,
                               progress: list[types_pb2.ProgressEvent] | None = None,
                               preempted: set[int] | frozenset[int] = frozenset()) -> None:
        a = run.assignment
        req = scheduler_pb2.ReportProgressRequest(
            cluster=self.settings.cluster, job_id=a.job, attempt=a.attempt, progress=list(progress or []),
            outcomes=[scheduler_pb2.WorkerOutcome(stage=st, succeeded=not err, error=err, preempted=bool(err)
                                                  and st in preempted)
                      for st, err in sorted(outcomes.items())],
        )
        for attempt in range(8):
            try:
                accepted, stop = await self.reporter.report(req)
            except NotFoundError as e:
                bound.info("executor.outcome_rejected", error=str(e))
                return
            except SpiderFlowError as e:
                bound.warning("executor.outcome_report_failed", error=str(e), retry=attempt)
                await asyncio.sleep(min(4.0, 0.25 * 2 ** attempt))
                continue
            bound.info("executor.outcomes_reported", accepted=accepted, stop=stop,
                       succeeded=[st for st, e in outcomes.items() if not e],
                       failed=[st for st, e in outcomes.items() if e])
            return
        bound.error("executor.outcome_lost", outcomes={st: bool(not e) for st, e in outcomes.items()})

    async def _record_checkpoint(self, run: _Run, raw: Any, bound: Any) -> None:
        """Write a complete checkpoint's manifest to ``checkpoints/<job>`` unless a newer one is there."""
        a = run.assignment
        try:
            m = manifest_from_dict(raw)
        except ValidationError as e:
            bound.warning("executor.bad_manifest", error=str(e))
            return
        if run.cancelled.is_set():
            return
        key = keys.checkpoint_key(a.job)
        value = records.encode(records.CheckpointRecord(manifest=m, attempt=a.attempt, cluster=self.settings.cluster,
                                                        at=time.time()))
        for _ in range(10):
            try:
                kv = await self.store.get(key)
                if kv is not None:
                    with contextlib.suppress(CorruptRecordError):  # an unreadable record is replaced
                        if records.decode_as(kv.key, kv.value, records.CheckpointRecord).manifest.step >= m.step:
                            return
                await self.store.compare_and_swap(key, value, kv.mod_revision if kv else 0)
            except CompareFailedError:
                continue
            except SpiderFlowError as e:
                bound.warning("executor.checkpoint_record_failed", step=m.step, error=str(e))
                return
            bound.info("executor.checkpoint_recorded", step=m.step, shards=len(m.shards))
            return


def executor_for(config: Any, address: str, *, on_busy: Callable[[bool], None] | None = None,
                 workers: WorkerBoard | None = None) -> Executor:
    """The executor of an agent: ``config`` is its :class:`agent.config.AgentConfig` (``scheduler`` must be
    set), ``address`` the agent's advertised ``host:port`` (its host is where ranks bind). The executor
    owns its client of the control plane (:class:`agent.remote_store.RemoteStore`: assignments, rendezvous,
    checkpoint manifests; no etcd credentials) and the scheduler channels (``tls_dir``, ``token``) it creates
    here and closes them when :meth:`Executor.run` returns. Workers start through the
    launcher the config names (:func:`agent.launchers.launcher_for`)."""
    import tempfile

    from agent.launchers import launcher_for
    from agent.remote_store import RemoteStore
    from spiderflow.runtime import parse_hostport

    if not config.scheduler:
        raise ValidationError("scheduler", "is required to execute assignments")
    host, _ = parse_hostport(address, field="address")
    work = Path(config.work_dir) if config.work_dir \
        else Path(tempfile.gettempdir()) / f"spiderflow-agent-{config.cluster}"
    settings = ExecutorSettings(
        cluster=config.cluster, host=host, work_dir=work,
        checkpoint_dir=Path(config.checkpoint_dir) if config.checkpoint_dir else work / "checkpoints",
        checkpoint_every=config.checkpoint_every, failure_grace_s=2.0 * config.lease_ttl_s + 10.0,
        gpus_per_node=config.gpus.gpus_per_node if config.gpus is not None else 1,
    )
    from agent.control import ReplicaReporter  # reports reach any live scheduler replica

    reporter = ReplicaReporter(config.scheduler, tls_dir=getattr(config, "tls_dir", None),
                               token=getattr(config, "token", None))
    store = RemoteStore(config.scheduler, cluster=config.cluster, tls_dir=getattr(config, "tls_dir", None),
                        token=getattr(config, "token", None))
    ex = Executor(settings, store, reporter, on_busy=on_busy, launcher=launcher_for(config, host=host),
                  workers=workers)
    ex.owns_clients = True
    return ex
