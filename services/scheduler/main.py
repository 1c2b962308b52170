"""``spiderflow serve scheduler``: the job API on every replica, scheduling cycles on the elected leader.

Replicas campaign through etcd's Election API (:data:`spiderflow.store.keys.SCHEDULER`) with a lease of
``--lease-ttl`` seconds. The leader runs a cycle when woken (a submission, a cancellation, a finished
job, a topology change) and at least every ``--cycle-interval`` seconds. When the leader dies its lease
ends and another replica becomes leader within the TTL; because every decision is bound with a
compare-and-swap on what was read, a deposed leader that still runs a cycle cannot double-book GPUs.

The leader also deletes finished jobs by the retention policy (``--retain-finished-jobs``,
``--retain-finished-for``; :mod:`services.scheduler.retention`).

A replica campaigns only once the placement kernels are loaded (:func:`spiderflow.core.kernels.warm`, in a
worker thread while the job API already serves): compiling them after an install takes a minute on a busy
machine, and a leader must not hold its lease, nor the first cycle wait, meanwhile.

``--executor sim`` (simulator-backed mode): with no agents, the leader itself runs each placed job for
its predicted duration × ``--sim-time-scale`` (clamped to ``[--sim-min-s, --sim-max-s]``) and then marks
it SUCCEEDED. This is how the scheduler is load-tested without GPUs; with agents, use ``--executor
agents`` (the default) and jobs advance through ``ReportProgress``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import structlog

from services.planner.client import RemotePlanner
from services.scheduler.control import ControlService
from services.scheduler.cycle import SchedulingCycle
from services.scheduler.dashboard import add_dashboard_argument, start_scheduler_dashboard
from services.scheduler.liveness import DEFAULT_STALE_S
from services.scheduler.observe import JobObserver
from services.scheduler.repo import JobRepository, StoredJob
from services.scheduler.retention import RetentionPolicy, add_retention_arguments, policy_from_args, sweep
from services.scheduler.service import SchedulerService
from services.scheduler.topology_source import StaticTopologySource, TopologyServiceSource, TopologySource
from spiderflow.core.errors import ConflictError, NotFoundError, SpiderFlowError, UnavailableError, ValidationError
from spiderflow.core.kernels import warm as warm_kernels
from spiderflow.core.placement import Budget
from spiderflow.core.placement.base import Planner
from spiderflow.core.placement.common import LEVEL2_CHOICES, Level2
from spiderflow.core.placement.options import SearchOptions
from spiderflow.core.tenancy import TenantQuota
from spiderflow.jobs import JobState, Progress
from spiderflow.metrics import RpcMetricsInterceptor, add_metrics_argument, start_metrics_server
from spiderflow.rpc.server import serve
from spiderflow.runtime import parse_hostport, write_ready_file
from spiderflow.security.ratelimit import RateLimiter
from spiderflow.security.tls import add_etcd_arguments, add_server_arguments, etcd_options, server_security
from spiderflow.store import keys, records
from spiderflow.store.base import Compare, CompareFailedError, NotLeaderError, Store

__all__ = ["SchedulerReplica", "SimExecutor", "add_arguments", "run"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

CAMPAIGN_RETRY_MIN_S = 0.5
CAMPAIGN_RETRY_MAX_S = 2.0
"""A campaign that cannot reach etcd is retried after 0.5 s, doubling to 2 s (so a recovered etcd is seen
within 2 s)."""
CAMPAIGN_WARN_EVERY_S = 30.0

BUSY_CYCLE_SHARE = 0.25
"""Default ``--busy-cycle-share``: during a burst of submissions, cycles take at most a quarter of the leader's
time. A cycle costs time in proportion to the queue and competes with SubmitJob for the same core; during a
burst most of what it would decide is the same again (the new jobs queue behind the head), so its pace, not
its outcome, changes. Jobs that finished and topology changes still wake it, at that pace."""
BUSY_PAUSE_MAX_S = 5.0
"""The longest pause the pacing puts between the end of a cycle and the next one (a long cycle, e.g. a big
job's search, does not hold back the next one by four times its length)."""
BURST_SUBMISSIONS = 16
"""A burst: at least this many submissions accepted while the last cycle ran (a few submissions now and
then never delay a cycle)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", required=True, help="etcd endpoint host:port")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--topology-service", metavar="ADDR", help="topology service address (live topology)")
    src.add_argument("--topology", metavar="FILE", help="a topology file (static topology, no agents needed)")
    p.add_argument("--planner", help="planner service address: SpinSearch and bace plan their chosen chains through "
                                     "it (default: plan in-process; the plans are the same)")
    p.add_argument("--policy", default="spinsearch", help="default placement policy")
    p.add_argument("--gpu-price", type=float, default=None,
                   help="spinsearch: shadow price λ ≥ 0 of the GPUs a plan holds on a busy pool (default 0: the "
                        "fastest plan; docs/architecture.md)")
    p.add_argument("--lookahead", action="store_true",
                   help="spinsearch: match jobs to regions against the arrivals expected while each runs (the "
                        "observed rate and mix of the last submissions; docs/architecture.md)")
    p.add_argument("--level2", choices=LEVEL2_CHOICES, default="exact",
                   help="TPA's solver for the blocks of an in-process plan: the exact optimum (default) or the "
                        "CP-SAT model")
    p.add_argument("--executor", choices=["agents", "sim"], default="agents")
    p.add_argument("--sim-time-scale", type=float, default=1e-4, help="wall seconds per predicted second")
    p.add_argument("--sim-min-s", type=float, default=0.05)
    p.add_argument("--sim-max-s", type=float, default=5.0)
    p.add_argument("--cycle-interval", type=float, default=5.0, help="max seconds between cycles")
    p.add_argument("--min-cycle-interval", type=float, default=0.2,
                   help="min seconds between cycle starts (wakes in between coalesce)")
    p.add_argument("--busy-cycle-share", type=float, default=BUSY_CYCLE_SHARE,
                   help="during a burst of submissions, scheduling cycles take at most this share of the leader's "
                        "time: the next cycle starts no earlier than the last one's duration / share after it "
                        "started (a pause of at most 5 s; 1 = cycles back to back)")
    p.add_argument("--lease-ttl", type=int, default=3, help="leader lease TTL in seconds")
    p.add_argument("--max-queued", type=int, default=10_000)
    p.add_argument("--time-limit", type=float, default=30.0, help="search time limit of ilp/genetic policies")
    p.add_argument("--replan-threshold", type=float, default=0.5,
                   help="re-place a running job when its predicted step time grows by this fraction (0 = never)")
    p.add_argument("--wait-for-releases", action="store_true",
                   help="tell the policy which GPUs come back when (running jobs' estimated ends); SpinSearch may "
                        "then keep a job waiting for a faster chain (as the simulator does by default)")
    p.add_argument("--submit-rate", type=float, default=200.0,
                   help="SubmitJob calls per second per client (token bucket; 0 = unlimited)")
    p.add_argument("--submit-burst", type=float, default=400.0, help="SubmitJob burst per client")
    p.add_argument("--max-watches", type=int, default=1000, help="open WatchJob streams at most")
    p.add_argument("--stale-after", type=float, default=DEFAULT_STALE_S,
                   help="re-place a placed/running job whose agents sent no report for this many seconds plus "
                        "3 predicted step times (0: never)")
    p.add_argument("--tenant-max-queued", type=int, default=None,
                   help="queued jobs per tenant at most (default: only --max-queued)")
    p.add_argument("--tenant-max-gpus", type=int, default=None,
                   help="GPUs held by one tenant's running jobs at most (default: unbounded)")
    p.add_argument("--tenant-max-watches", type=int, default=None,
                   help="open WatchJob streams per caller at most (default: only --max-watches)")
    add_retention_arguments(p)
    add_server_arguments(p)
    add_etcd_arguments(p)
    add_metrics_argument(p)
    add_dashboard_argument(p)


class SimExecutor:
    """Runs placed jobs in simulated time (leader only). Idempotent: re-arming a job twice is harmless."""

    def __init__(self, repo: JobRepository, *, scale: float, min_s: float, max_s: float,
                 on_done: asyncio.Event | None = None) -> None:
        self.repo = repo
        self.scale = scale
        self.min_s = min_s
        self.max_s = max_s
        self.on_done = on_done
        self._tasks: dict[tuple[str, int], asyncio.Task[None]] = {}

    def arm(self, stored: StoredJob) -> None:
        key = (stored.record.id, stored.record.attempt)
        if key in self._tasks and not self._tasks[key].done():
            return
        self._tasks[key] = asyncio.create_task(self._run(stored))

    async def adopt(self) -> None:
        """Arm every job that holds a placement (after becoming leader)."""
        stored, _ = await self.repo.list()
        for sj in stored:
            if sj.record.state in (JobState.PLACED, JobState.RUNNING):
                self.arm(sj)

    def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        self._tasks.clear()

    async def _advance(self, known: StoredJob | None, job_id: str, attempt: int,
                       state: JobState) -> StoredJob | None:
        """Move the job's ``attempt`` to ``state``, starting from ``known`` (the record this executor last saw)
        and reading etcd again only after a lost compare. Returns the stored record in ``state``, or ``None``
        when the attempt ended otherwise (cancelled, re-placed, deleted)."""
        sj = known
        for _ in range(20):
            if sj is None:
                try:
                    sj = await self.repo.get(job_id)
                except NotFoundError:
                    return None
            r = sj.record
            if r.attempt != attempt or r.terminal or r.state is state:
                return sj if r.state is state and r.attempt == attempt else None
            steps = r.spec.steps
            if state is JobState.RUNNING:
                new = r.to(state, "simulated execution started", now=self.repo.clock())
            else:
                step_time = r.plan.step_time_s if r.plan else 0.0
                new = replace(r.to(state, f"trained {steps} steps (simulated)", now=self.repo.clock()),
                              progress=Progress(step=steps, steps=steps, step_time_s=step_time,
                                                tokens_per_s=r.spec.tokens_per_step / step_time if step_time else None))
            try:
                return await self.repo.transition(sj, new)
            except CompareFailedError:
                sj = None
        return None

    async def _retry(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op`` until etcd answers: a stalled store delays the simulated job, it never strands it."""
        delay = 0.2
        while True:
            try:
                return await op()
            except UnavailableError as e:
                log.info("scheduler.sim_executor_retry", error=str(e))
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _run(self, placed: StoredJob) -> None:
        job_id, attempt = placed.record.id, placed.record.attempt
        try:
            r = placed.record
            predicted = r.spec.steps * (r.plan.step_time_s if r.plan else 0.0)
            duration = min(self.max_s, max(self.min_s, predicted * self.scale))
            sj: StoredJob | None = placed
            if r.state is JobState.PLACED:
                sj = await self._retry(lambda: self._advance(placed, job_id, attempt, JobState.RUNNING))
                if sj is None:
                    return
            await asyncio.sleep(duration)
            known = sj
            done = await self._retry(lambda: self._advance(known, job_id, attempt, JobState.SUCCEEDED))
            if done is not None and self.on_done is not None:
                self.on_done.set()
        except asyncio.CancelledError:
            return
        except NotFoundError:
            return
        except SpiderFlowError:
            log.exception("scheduler.sim_executor_error", job=job_id)


class SchedulerReplica:
    """One scheduler process: campaigns, and while leader runs cycles until leadership is lost."""

    def __init__(self, store: Store, repo: JobRepository, topology: TopologySource, *, address: str,
                 default_policy: str, planner: Planner | None, executor: SimExecutor | None,
                 wake: asyncio.Event, cycle_interval: float, lease_ttl: int, budget: Budget,
                 replan_threshold: float = 0.5, min_cycle_interval: float = 0.0,
                 wait_for_releases: bool = False, level2: Level2 = "exact",
                 tenant_quota: TenantQuota | None = None, stale_s: float = DEFAULT_STALE_S,
                 retention: RetentionPolicy | None = None, retention_interval_s: float = 60.0,
                 observer: JobObserver | None = None, warm: Callable[[], None] | None = warm_kernels,
                 busy_cycle_share: float = 1.0, submissions: Callable[[], int] | None = None,
                 search_options: SearchOptions | None = None) -> None:
        if not 0.0 < busy_cycle_share <= 1.0:
            raise ValidationError("--busy-cycle-share", "must be in (0, 1]", busy_cycle_share)
        self.busy_cycle_share = busy_cycle_share
        self.submissions = submissions
        """How many jobs this replica's job API has created so far (cycles are paced during bursts)."""
        self.store = store
        self.warm = warm
        self.retention = retention
        self.retention_interval_s = retention_interval_s
        self.observer = observer or JobObserver(repo)
        self.min_cycle_interval = min_cycle_interval
        self.repo = repo
        self.topology = topology
        self.address = address
        self.executor = executor
        self.wake = wake
        self.cycle_interval = cycle_interval
        self.lease_ttl = lease_ttl
        self.is_leader = False
        self.cycle = SchedulingCycle(repo, topology, default_policy=default_policy, planner=planner,
                                     budget=budget, on_placed=executor.arm if executor else None,
                                     replan_threshold=replan_threshold, wait_for_releases=wait_for_releases,
                                     level2=level2, tenant_quota=tenant_quota, stale_s=stale_s,
                                     search_options=search_options)

    async def run(self, stop: asyncio.Event) -> None:
        delay, failing_since, last_warned = CAMPAIGN_RETRY_MIN_S, None, -math.inf
        loop = asyncio.get_running_loop()
        if self.warm is not None:  # before campaigning: no lease is held while the kernels compile
            t0 = loop.time()
            warming = asyncio.ensure_future(asyncio.to_thread(self.warm))
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({warming, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not warming.done():
                return  # asked to stop while compiling (the thread finishes on its own)
            warming.result()
            log.info("scheduler.kernels_ready", seconds=round(loop.time() - t0, 2))
        while not stop.is_set():
            try:
                lease = await self.store.grant(self.lease_ttl)
                campaign = asyncio.create_task(
                    self.store.campaign(keys.election_name(keys.SCHEDULER),
                                        records.encode(records.LeaderRecord(address=self.address)), lease))
                stopper = asyncio.create_task(stop.wait())
                done, _ = await asyncio.wait({campaign, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if stopper in done:
                    campaign.cancel()
                    with contextlib.suppress(BaseException):
                        await campaign
                    with contextlib.suppress(SpiderFlowError):
                        await lease.revoke()
                    return
                stopper.cancel()
                leadership = campaign.result()
            except (UnavailableError, ConflictError) as e:
                # etcd unreachable: retry with backoff; warn at the first failure and then every
                # CAMPAIGN_WARN_EVERY_S (not at every attempt).
                now = loop.time()
                failing_since = now if failing_since is None else failing_since
                if now - last_warned >= CAMPAIGN_WARN_EVERY_S:
                    log.warning("scheduler.campaign_retry", error=str(e), failing_for_s=round(now - failing_since, 1),
                                retry_in_s=delay)
                    last_warned = now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                delay = min(CAMPAIGN_RETRY_MAX_S, delay * 2)
                continue
            delay, failing_since, last_warned = CAMPAIGN_RETRY_MIN_S, None, -math.inf
            log.info("scheduler.leader", address=self.address, lease=lease.id)
            self.is_leader = True
            # Wait records are written only while this term's election key is unchanged (deposed: no write).
            # The key is new (a fresh lease per campaign) and never proclaimed: its mod_revision is its
            # create revision.
            self.cycle.new_term(Compare(key=leadership.key, mod_revision=leadership.revision))
            try:
                await self._lead(leadership.lost, stop)
            except NotLeaderError as e:  # the election key changed under a guarded write: end this term
                log.warning("scheduler.deposed", address=self.address, error=str(e))
                with contextlib.suppress(SpiderFlowError):
                    await lease.revoke()
            finally:
                self.is_leader = False
                if self.executor:
                    self.executor.stop()
                if stop.is_set():
                    with contextlib.suppress(SpiderFlowError):
                        await leadership.resign()
                    with contextlib.suppress(SpiderFlowError):
                        await lease.revoke()
                log.info("scheduler.leadership_ended", address=self.address, stopping=stop.is_set())

    async def _lead(self, lost: asyncio.Event, stop: asyncio.Event) -> None:
        watcher = asyncio.create_task(self._watch_topology())
        retainer = asyncio.create_task(self._retain()) if self.retention is not None else None
        try:
            if self.executor:
                await self.executor.adopt()
            self.wake.set()
            loop = asyncio.get_running_loop()
            last_cycle = loop.time() - self.min_cycle_interval
            last_cycle_s, submitted = 0.0, 0
            while not lost.is_set() and not stop.is_set():
                # A job waiting for releases is due at its wait's end: sleep no longer than that.
                timeout = self.cycle_interval
                due = self.cycle.next_wait_end()
                if due is not None:
                    timeout = min(timeout, max(0.0, due - self.cycle.clock()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wait_any(self.wake, lost, stop), timeout=timeout)
                if lost.is_set() or stop.is_set():
                    return
                # Wakes that arrive within --min-cycle-interval of the last cycle start coalesce into one
                # cycle: a burst of submissions costs one cycle, not one per submission.
                # During a burst of submissions, cycles are also paced by their own duration (--busy-cycle-share).
                pause = last_cycle + self._cycle_gap(last_cycle_s, submitted) - loop.time()
                if pause > 0:
                    await asyncio.sleep(pause)
                last_cycle = loop.time()
                before = self.submissions() if self.submissions is not None else 0
                self.wake.clear()
                try:
                    report = await self.cycle.run()
                    if report.conflict or report.rescheduled:
                        self.wake.set()
                except UnavailableError as e:
                    log.warning("scheduler.cycle_unavailable", error=str(e))
                    await asyncio.sleep(0.5)
                last_cycle_s = loop.time() - last_cycle
                submitted = (self.submissions() if self.submissions is not None else 0) - before
        finally:
            watcher.cancel()
            if retainer is not None:
                retainer.cancel()
                with contextlib.suppress(BaseException):
                    await retainer

    def _cycle_gap(self, last_cycle_s: float, submitted: int) -> float:
        """Least seconds between the start of the last cycle and the next one: ``--min-cycle-interval``; and
        when the last cycle (which took ``last_cycle_s``) saw a burst (``submitted`` ≥ :data:`BURST_SUBMISSIONS`
        jobs created meanwhile), ``last_cycle_s / --busy-cycle-share``, with a pause after it of at most
        :data:`BUSY_PAUSE_MAX_S`."""
        gap = self.min_cycle_interval
        if self.busy_cycle_share < 1.0 and submitted >= BURST_SUBMISSIONS:
            pause = last_cycle_s * (1.0 / self.busy_cycle_share - 1.0)
            gap = max(gap, last_cycle_s + min(BUSY_PAUSE_MAX_S, pause))
        return gap

    async def _retain(self) -> None:
        """While leader: delete the finished jobs the retention policy no longer keeps, at once and then every
        ``retention_interval_s`` (:mod:`services.scheduler.retention`)."""
        assert self.retention is not None
        while True:
            try:
                await sweep(self.repo, self.observer, self.retention, now=self.repo.clock())
            except SpiderFlowError as e:  # etcd away: the next sweep retries
                log.warning("scheduler.retention_failed", error=str(e))
            await asyncio.sleep(self.retention_interval_s)

    @staticmethod
    async def _wait_any(*events: asyncio.Event) -> None:
        tasks = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()

    async def _watch_topology(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            async for _ in self.topology.changes():
                self.wake.set()


GC_YOUNG_THRESHOLD = 10_000
"""Allocations between two young-generation collections of the serving process (CPython's default is 700:
a SubmitJob allocates hundreds of objects, nearly all freed by reference counting, so the default ran the
cycle collector several times per call)."""


def warm_and_freeze() -> None:
    """Load the placement kernels and the planner's timeline (the cycle re-scores plans on it; imported here,
    off the leader's first decision, and not at import time, so the process serves sooner), then move every
    object alive (modules, kernels, the parsed topology) to the collector's permanent generation, so its full
    collections no longer scan the start-up's objects again and again while the process serves."""
    import spiderflow.core.tpa.timeline  # noqa: F401

    warm_kernels()
    gc.freeze()


async def run(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from spiderflow.store.etcd import EtcdStore

    host, port = parse_hostport(args.listen, field="--listen")
    parse_hostport(args.etcd, field="--etcd")
    if not 0.0 < args.busy_cycle_share <= 1.0:
        raise ValidationError("--busy-cycle-share", "must be in (0, 1]", args.busy_cycle_share)
    if args.gpu_price is not None and not (math.isfinite(args.gpu_price) and args.gpu_price >= 0):
        raise ValidationError("--gpu-price", "must be a finite number ≥ 0", args.gpu_price)
    retention = policy_from_args(args)
    security = server_security(args, host=host)
    store = EtcdStore(args.etcd, **etcd_options(args))
    repo = JobRepository(store)
    wake = asyncio.Event()
    topology: TopologySource = (StaticTopologySource.from_file(args.topology) if args.topology
                                else TopologyServiceSource(args.topology_service,
                                                           credentials=security.client_credentials))
    executor = (SimExecutor(repo, scale=args.sim_time_scale, min_s=args.sim_min_s, max_s=args.sim_max_s,
                            on_done=wake) if args.executor == "sim" else None)
    limiter = RateLimiter(rate=args.submit_rate, burst=max(1.0, args.submit_burst))
    quota = TenantQuota(max_queued=args.tenant_max_queued, max_gpus=args.tenant_max_gpus,
                        max_watches=args.tenant_max_watches)
    service = SchedulerService(repo, max_queued=args.max_queued, wake=wake, limiter=limiter,
                               max_watches=args.max_watches, tenant_quota=quota,
                               agent_credentials=security.client_credentials, topology=topology)
    metrics = start_metrics_server(args.metrics_listen)
    # every replica also serves the agents' Control API (their only door to the state: agents hold no etcd
    # credentials), so an agent lists every replica and needs no leader
    server = await serve([service, ControlService(store)], host=host, port=port, credentials=security.credentials,
                         interceptors=[RpcMetricsInterceptor(), *security.interceptors])
    replica = SchedulerReplica(
        store, repo, topology, address=server.address, default_policy=args.policy,
        search_options=(None if args.gpu_price is None and not args.lookahead
                        else SearchOptions(gpu_price=args.gpu_price, lookahead=args.lookahead or None)),
        planner=(RemotePlanner(args.planner, credentials=security.client_credentials) if args.planner
                 else None), executor=executor, wake=wake,
        cycle_interval=args.cycle_interval, min_cycle_interval=args.min_cycle_interval, lease_ttl=args.lease_ttl,
        budget=Budget(time_limit_s=args.time_limit),
        replan_threshold=args.replan_threshold, wait_for_releases=args.wait_for_releases, level2=args.level2,
        tenant_quota=quota, stale_s=args.stale_after,
        retention=retention, retention_interval_s=args.retention_interval, observer=service.observer,
        busy_cycle_share=args.busy_cycle_share, submissions=lambda: service.created, warm=warm_and_freeze,
    )
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    dashboard = await start_scheduler_dashboard(args, repo, topology, service.observer)
    write_ready_file(Path(args.ready_file) if args.ready_file else None, address=server.address,
                     metrics=metrics.address if metrics else None, dashboard=dashboard.url if dashboard else None)
    log.info("scheduler.serving", address=server.address, etcd=args.etcd, executor=args.executor,
             security=security.mode)
    task = asyncio.create_task(replica.run(stop))
    await stop.wait()
    if dashboard is not None:
        await dashboard.stop()
    await server.stop(grace_s=2)
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await asyncio.wait_for(task, timeout=5)
    await topology.close()
    await store.close()
    if metrics:
        metrics.close()
