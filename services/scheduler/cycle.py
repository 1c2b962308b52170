"""The scheduling cycle (leader only): read one snapshot, decide with the pure cycle, bind with compare-and-swap.

1. **snapshot** – one topology snapshot (with its etcd revision) from the :class:`TopologySource`, every
   job record and every allocation key, each with the revision it was read at.
2. **reconcile** – jobs holding GPUs on a cluster that left the graph, or whose plan's predicted step time
   grew by more than ``replan_threshold`` on the current snapshot (a link or cluster degraded), go
   RESCHEDULING (GPUs released, the reason says why); a RESCHEDULING job is queued again like a pending one.
3. **decide** – :func:`spiderflow.core.cycle.run_cycle` (the simulator runs the same function), in a worker
   thread, on ``topology.with_free(free)``: it orders the queued jobs (PENDING, RESCHEDULING) by remaining
   steps, network share and aging, asks each job's policy (default SpinSearch; a job shaped like one already
   decided on the same snapshot reuses that decision: :data:`DECISION_CACHE_SIZE`), offers waiting for
   releases with ``wait_for_releases`` (jobs holding GPUs at their estimated ends, and the claims of jobs
   already waiting), backfills behind the head (EASY) and reserves. The policies that plan their chains
   (SpinSearch, ``bace``) are built with this scheduler's ``planner``: in process, or the Planner service
   (:class:`services.planner.client.RemotePlanner`), which plans the exact allocation the policy chose.
   A failed decision is retried only once the pool changed (a job gave its GPUs back, the topology changed)
   or more GPUs are free.
4. **bind** – the placements in the order they were decided, each one etcd transaction
   (:meth:`JobRepository.bind`) comparing the job record and every allocation key it changes on the
   revisions read in step 1. If one loses, the cycle ends there (the later decisions assumed it; a new cycle
   starts from a fresh snapshot), so no GPU is ever given to two jobs.
5. **record** – a job that waits stays PENDING with the policy's reason; its wait is recorded in etcd
   (``waits/<job>``, deleted when it ends or the job is bound; written only while the term's election key
   holds): a new leader's first cycle adopts them, so a change of leader neither decides a waiting job
   afresh before its time nor forgets the GPUs it claimed. Any other job left queued stays PENDING with a
   reason that says why (the policy's reason naming the binding constraint, the backfilling rule, "queued
   behind <head>"); a job that can never fit this topology keeps PENDING with "cannot fit this topology"
   (also when its resource constraints allow no cluster, or too few GPUs, of it).

Decisions are logged as one structlog event each with the job id, the chain, the topology revision and the
decision's wall time.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import structlog

from services.scheduler.liveness import DEFAULT_STALE_S, stale_reason
from services.scheduler.repo import JobRepository, StoredJob
from services.scheduler.topology_source import TopologySource
from spiderflow import metrics
from spiderflow.core import costmodel
from spiderflow.core.cycle import (
    OUTLOOK_SIZE,
    CycleDecision,
    CycleInput,
    CycleOptions,
    CycleResult,
    Holder,
    InvalidPlacementError,
    Outcome,
    QueueEntry,
    WaitState,
    decide,
    link_gbps,
    network_share,
    run_cycle,
)
from spiderflow.core.domain import JobSpec, Plan, Topology, Wait
from spiderflow.core.errors import SpiderFlowError, ValidationError
from spiderflow.core.placement import Budget, PlacementResult, PlacementStatus, get_policy
from spiderflow.core.placement.base import PlacementPolicy, Planner
from spiderflow.core.placement.common import Level2, LocalPlanner
from spiderflow.core.placement.options import SearchOptions, make_policy
from spiderflow.core.queueing import QueuedJob, QueuePolicy, queued_job
from spiderflow.core.tenancy import TenantQuota
from spiderflow.jobs import JobRecord, JobState
from spiderflow.store import keys
from spiderflow.store.base import Compare, CompareFailedError, NotLeaderError

__all__ = ["CycleReport", "Decision", "DecisionKind", "SchedulingCycle"]

log = structlog.get_logger(__name__)

QUEUED = (JobState.PENDING, JobState.RESCHEDULING)
HOLDING = (JobState.PLACED, JobState.RUNNING)

PLACED_STEP_KEY = "placed_step_time_s"
"""Plan extra: the closed-form step time on the snapshot the plan was bound on."""

BIND_RETRIES = 10
"""Binds of one placement per cycle when only allocation keys changed meanwhile (see ``_bind``). A retry is two
round trips; giving up ends the cycle, and the next one re-reads every job: with short jobs ending on the same
clusters many times a second, three retries lost the race in most cycles of ``bench/load.py``."""

NOTE_WRITES_PER_CYCLE = 100
"""At most this many reason updates of queued jobs per cycle, in queue order (the head first): a long queue
whose head changes is not rewritten record by record every cycle; reasons further back catch up later."""

DECISION_CACHE_SIZE = 512
"""Decisions kept (least recently used dropped). A policy's decision is a function of the snapshot, the job's
shape and the budget only (it reads no job id or tenant but in its logs), so a queue of like jobs (replicas of
one training run, a sweep) costs one search per distinct free-GPU state instead of one per job. The key holds
the whole snapshot (topology, revision, free GPUs): a changed topology or allocation never hits a stale entry."""



class DecisionKind(StrEnum):
    PLACED = "placed"
    UNSCHEDULABLE = "unschedulable"
    UNRESOLVABLE = "unresolvable"
    DEFERRED = "deferred"
    CONFLICT = "conflict"
    ERROR = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    job_id: str
    kind: DecisionKind
    reason: str = ""
    chain: tuple[str, ...] = ()
    seconds: float = 0.0
    gpus: int = 0
    est_end_s: float = 0.0


@dataclass(slots=True, kw_only=True)
class CycleReport:
    topology_revision: int = 0
    decisions: list[Decision] = field(default_factory=list)
    rescheduled: list[str] = field(default_factory=list)
    conflict: bool = False
    seconds: float = 0.0
    cycle: CycleResult | None = None
    """The pure cycle's result this report applied (``None`` when no cycle ran: nothing queued)."""

    @property
    def placed(self) -> list[str]:
        return [d.job_id for d in self.decisions if d.kind is DecisionKind.PLACED]


def _kind(d: CycleDecision) -> DecisionKind:
    """How the service reports a decision that placed nothing."""
    if d.outcome is Outcome.REJECT or d.constraint in ("capacity", "constraints"):
        return DecisionKind.UNRESOLVABLE
    if d.outcome is Outcome.WAIT or d.constraint in ("queue", "backfill"):
        return DecisionKind.DEFERRED
    if d.result is not None and d.result.status is PlacementStatus.ERROR:
        return DecisionKind.ERROR
    return DecisionKind.UNSCHEDULABLE


class _Cached:
    """A policy behind the scheduler's decision cache (:meth:`SchedulingCycle.place_cached`), built on its
    first decision (in the cycle's worker thread: building one may load compiled kernels). It answers waits
    as the cycle would (:func:`spiderflow.core.cycle.decide`): the policy's own pricing, or the cycle's."""

    def __init__(self, owner: SchedulingCycle, name: str) -> None:
        self.owner = owner
        self.name = name
        self._inner: PlacementPolicy | None = None

    @property
    def inner(self) -> PlacementPolicy:
        if self._inner is None:
            self._inner = self.owner.build_policy(self.name)
        return self._inner

    @property
    def lookahead(self) -> bool:
        """Whether the policy looks ahead (the cycle then passes it the arrivals' outlook)."""
        return bool(getattr(self.inner, "lookahead", False))

    def place(self, topo: Topology, job: JobSpec, budget: Budget = Budget()) -> PlacementResult:  # noqa: B008
        return self.owner.place_cached(self.name, self.inner, topo, job, budget)

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        """Never called: :meth:`place` already prices the wait (this makes the cycle hand it the releases)."""
        return None


def _shape(spec: JobSpec) -> JobSpec:
    """The job without its identity (id, tenant): what a placement decision depends on."""
    return replace(spec, id="shape", tenant="default")


class SchedulingCycle:
    """Runs cycles for the leader. ``clock`` is wall time; ``budget`` the policies' search limits."""

    def __init__(
        self,
        repo: JobRepository,
        topology: TopologySource,
        *,
        default_policy: str = "spinsearch",
        planner: Planner | None = None,
        queue_policy: QueuePolicy | None = None,
        budget: Budget | None = None,
        clock: Callable[[], float] = time.time,
        on_placed: Callable[[StoredJob], None] | None = None,
        replan_threshold: float = 0.5,
        wait_for_releases: bool = False,
        level2: Level2 = "exact",
        tenant_quota: TenantQuota | None = None,
        stale_s: float = DEFAULT_STALE_S,
        fair_share: bool = True,
        search_options: SearchOptions | None = None,
    ) -> None:
        self.repo = repo
        self.search_options = search_options
        """Options of the policies it builds (:func:`spiderflow.core.placement.options.make_policy`), e.g.
        SpinSearch's ``gpu_price``; ``None``: their defaults."""
        self.planner: Planner = planner if planner is not None else LocalPlanner(level2=level2)
        """What the policies that plan their chains (SpinSearch, ``bace``) plan them with: the Planner
        service (:class:`services.planner.client.RemotePlanner`) or in process (TPA's level 2: ``level2``)."""
        self.stale_s = stale_s
        """Silence after which a job holding GPUs is re-placed (:mod:`services.scheduler.liveness`)."""
        self.tenant_quota = tenant_quota
        self.fair_share = fair_share
        """Interleave the queue between tenants by max-min share of GPUs (:func:`spiderflow.core.tenancy.arrange`)."""
        """Per-tenant GPU quota applied when the queue is arranged (:func:`spiderflow.core.tenancy.arrange`)."""
        self.topology = topology
        self.default_policy = default_policy
        self.queue_policy = queue_policy or QueuePolicy()
        self.budget = budget or Budget(time_limit_s=30.0)
        self.clock = clock
        self.on_placed = on_placed
        self.replan_threshold = replan_threshold
        self.wait_for_releases = wait_for_releases
        self._waits: dict[str, WaitState] = {}
        self._failed: dict[str, tuple[int, int]] = {}  # job -> (pool version, free GPUs) of its last failure
        # the queue's view of each queued job, kept between cycles (its estimates cost ~0.1 ms a job, paid
        # by every queued job in every cycle otherwise): keyed by what it is computed from
        self._views: dict[tuple[str, float, int, float | None], QueuedJob] = {}
        self._arrivals: deque[tuple[float, JobSpec]] = deque(maxlen=OUTLOOK_SIZE)
        """The most recent submissions seen in the queue, ``(created_at, spec)`` in that order: the outlook of a
        policy that looks ahead (:attr:`spiderflow.core.cycle.CycleInput.arrivals`)."""
        self._arrival_ids: dict[str, None] = {}
        self._version = 0
        self._pool_revision = -1
        self._holders: set[str] = set()
        self._policies: dict[str, PlacementPolicy] = {}

        self._adopted = False  # whether this term's waits were read from etcd (see ``new_term``)
        self._guard: Compare | None = None  # this term's election-key compare (see ``new_term``)
        self._notes_left = NOTE_WRITES_PER_CYCLE
        self._decisions: OrderedDict[tuple[str, JobSpec, Topology, Budget], PlacementResult] = OrderedDict()
        self.cache_hits = 0
        """Decisions answered by the decision cache (for tests and measurements)."""

    def new_term(self, guard: Compare | None = None) -> None:
        """Leadership was (re)gained: the next cycle first adopts the waits recorded in etcd (another leader
        may have changed them since this process last led). ``guard`` (the compare of this term's election
        key) guards every write of a wait record: once it fails, leadership is gone and :meth:`run` raises
        :class:`~spiderflow.store.base.NotLeaderError` without writing."""
        self._adopted = False
        self._guard = guard

    async def _put_wait(self, job_id: str, wait: WaitState) -> None:
        try:
            await self.repo.put_wait(job_id, wait, guard=self._guard)
        except CompareFailedError:
            raise NotLeaderError(f"leadership lost: the wait of {job_id} was not recorded") from None

    async def _delete_wait(self, job_id: str) -> None:
        try:
            await self.repo.delete_wait(job_id, guard=self._guard)
        except CompareFailedError:
            raise NotLeaderError(f"leadership lost: the wait of {job_id} was not deleted") from None

    async def _adopt_waits(self, recorded: Mapping[str, WaitState | None]) -> None:
        """Replace the in-memory waits with those recorded in etcd (read in the cycle's snapshot); a malformed
        record is deleted, and so is every record when this scheduler runs without ``wait_for_releases``."""
        waits: dict[str, WaitState] = {}
        for job_id, w in recorded.items():
            if w is None or not self.wait_for_releases:
                why = "malformed wait record" if w is None else "this scheduler does not wait for releases"
                log.warning("scheduler.wait_dropped", job=job_id, reason=why)
                await self._delete_wait(job_id)
                continue
            waits[job_id] = w
        self._waits = waits
        self._adopted = True
        if waits:
            log.info("scheduler.waits_adopted", jobs=sorted(waits))

    async def _end_waits(self, job_ids: list[str]) -> None:
        """Forget the waits of ``job_ids``, in memory and in etcd."""
        for job_id in job_ids:
            self._waits.pop(job_id, None)
            await self._delete_wait(job_id)

    def next_wait_end(self) -> float | None:
        """The earliest time (``clock`` seconds) at which a job waiting for releases is due to be decided
        again, or ``None`` when no job waits: the leader runs a cycle then."""
        return min((w.until for w in self._waits.values()), default=None)

    async def run(self) -> CycleReport:
        t_start = time.perf_counter()
        hits_before = self.cache_hits
        self._notes_left = NOTE_WRITES_PER_CYCLE
        report = CycleReport()
        # 1. snapshot
        try:
            topo = await self.topology.snapshot()
        except ValidationError as e:  # no cluster registered yet: nothing to place on, nothing to reconcile
            log.info("scheduler.no_topology", reason=str(e))
            report.seconds = time.perf_counter() - t_start
            return report
        report.topology_revision = topo.revision
        # jobs, allocations and waits in one read at one etcd revision (a consistent view)
        state = await self.repo.snapshot()
        if not self._adopted:
            await self._adopt_waits(state.waits)
        stored, allocs, alloc_revs = state.jobs, state.allocations, state.allocation_revisions
        now = self.clock()

        # 2. reconcile
        for sj in stored:
            why = self._material_change(sj, topo) or stale_reason(sj.record, now, stale_s=self.stale_s)
            if why:
                try:
                    await self.repo.transition(sj, sj.record.to(JobState.RESCHEDULING, why, now=now))
                    report.rescheduled.append(sj.record.id)
                    log.info("scheduler.rescheduling", job=sj.record.id, reason=why, topology_revision=topo.revision)
                except CompareFailedError:
                    report.conflict = True
        if report.rescheduled or report.conflict:
            state = await self.repo.snapshot()
            stored, allocs, alloc_revs = state.jobs, state.allocations, state.allocation_revisions

        used: dict[str, int] = {c: sum(a.values()) for c, a in allocs.items()}
        free = {c.name: max(0, c.free - used.get(c.name, 0)) for c in topo.clusters}
        by_id = {sj.record.id: sj for sj in stored}
        queue = [sj for sj in stored if sj.record.state in QUEUED]
        if not queue:
            await self._end_waits(list(self._waits))
            report.seconds = time.perf_counter() - t_start
            metrics.observe_cycle((), queued=0)
            return report

        # 3–7. one pure cycle (spiderflow.core.cycle): order, filter, place, wait, admit, reserve
        holders = [sj for sj in stored if sj.record.state in HOLDING]
        self._bump_version(topo.revision, {sj.record.id for sj in holders})
        queued_ids = {sj.record.id for sj in queue}
        stale = [k for k, w in self._waits.items() if k not in queued_ids or w.until <= now
                 or any(c not in topo.index for c, _ in w.claim)]
        await self._end_waits(stale)
        gone = frozenset(c for sj in stored for c in sj.record.allocation if c not in topo.index)
        holding = [Holder(job_id=sj.record.id, end_s=self._est_end(sj, now), gpus=tuple(sj.record.allocation.items()),
                          tenant=sj.record.spec.tenant,
                          link_gbps=(link_gbps(sj.record.plan, sj.record.spec, sj.record.plan.step_time_s)
                                     if sj.record.plan is not None else 0.0)) for sj in holders]
        try:
            # In a worker thread: building a policy may load compiled kernels, and deciding takes CPU time;
            # the event loop keeps the lease alive meanwhile.
            result = await asyncio.to_thread(self._decide, topo, free, queue, holding, now, gone)
        except InvalidPlacementError as e:
            log.error("scheduler.invalid_placement", error=str(e))
            report.seconds = time.perf_counter() - t_start
            return report
        report.cycle = result
        # 8. bind the placements in order with compare-and-swap; write the waits; then the notes, batched
        notes: list[tuple[StoredJob, JobRecord]] = []
        for d in result.decisions:
            sj = by_id[d.job_id]
            if d.tried and d.outcome is not Outcome.PLACE:
                self._failed[d.job_id] = (self._version, d.total_free)
            if d.outcome is Outcome.PLACE:
                decision = await self._bind_placed(sj, d, topo, free, allocs, alloc_revs)
                report.decisions.append(decision)
                if decision.kind is DecisionKind.CONFLICT:
                    report.conflict = True
                    break  # later decisions assumed this placement: decide again on a fresh snapshot
                self._failed.pop(d.job_id, None)
                # a holder from now on: if it is gone by the next cycle, its release bumps the pool version
                # (as the simulator's release does), however short its run
                self._holders.add(d.job_id)
                await self._end_waits([d.job_id] if d.job_id in self._waits else [])
                continue
            if d.outcome is Outcome.WAIT and d.tried and d.wait is not None:
                self._waits[d.job_id] = d.wait
                await self._put_wait(d.job_id, d.wait)
                log.info("scheduler.waiting", job=d.job_id, until=d.wait.until, reason=d.reason)
            decision = Decision(job_id=d.job_id, kind=_kind(d), reason=d.reason, seconds=d.seconds)
            report.decisions.append(decision)
            note = self._note(sj, decision)
            if note is not None:
                notes.append((sj, note))
        await self.repo.update_many(notes)  # queued jobs changed meanwhile (cancelled, re-bound) are left alone
        report.seconds = time.perf_counter() - t_start
        metrics.observe_cycle(report.decisions, queued=len(queue))
        log.info("scheduler.cycle", topology_revision=topo.revision, queued=len(queue), placed=len(report.placed),
                 seconds=round(report.seconds, 4), conflict=report.conflict, cached=self.cache_hits - hits_before,
                 notes=NOTE_WRITES_PER_CYCLE - self._notes_left)
        return report

    def _decide(self, topo: Topology, free: dict[str, int], queue: list[StoredJob], holding: list[Holder],
                now: float, gone: frozenset[str]) -> CycleResult:
        """One pure cycle (:func:`spiderflow.core.cycle.run_cycle`) on this snapshot."""
        if self.search_options is not None and self.search_options.lookahead:
            self._note_arrivals(queue)  # only a policy that looks ahead reads them: no per-cycle scan otherwise
        state = CycleInput(topology=topo.with_free(free), now=now, version=self._version, gone=gone,
                           queue=[self._entry(sj, topo) for sj in queue], holding=holding,
                           arrivals=tuple(self._arrivals))
        options = CycleOptions(queue=self.queue_policy, budget=self.budget, wait=self.wait_for_releases,
                               tenant_quota=self.tenant_quota, fair_share=self.fair_share)
        views = self._views
        kept: dict[tuple[str, float, int, float | None], QueuedJob] = {}

        def view(e: QueueEntry) -> QueuedJob:
            # a job's spec never changes under its id and enqueue time; its remaining steps and measured
            # network share are in the key
            key = (e.spec.id, e.enqueued_s, e.steps_left, e.network_share)
            q = views.get(key)
            if q is None:
                q = queued_job(e.spec, e.enqueued_s, steps_left=e.steps_left, network_share=e.network_share)
            kept[key] = q
            return q

        try:
            return run_cycle(state, self._policy(self.default_policy), options, queued=view)
        finally:
            self._views = kept  # only the jobs still queued

    def _bump_version(self, revision: int, holders: set[str]) -> None:
        """The pool version grows when the topology changes or a job gave its GPUs back (as in the simulator:
        a failed decision is retried only then, or when more GPUs are free)."""
        if revision != self._pool_revision or not self._holders <= holders:
            self._version += 1
        self._pool_revision, self._holders = revision, set(holders)

    def _note_arrivals(self, queue: list[StoredJob]) -> None:
        """Add the queued jobs not seen before to the recent arrivals, by submission time."""
        new = sorted((sj.record.created_at, sj.record.id, sj.record.spec) for sj in queue
                     if sj.record.id not in self._arrival_ids)
        for at, jid, spec in new:
            self._arrival_ids[jid] = None
            if not self._arrivals or at >= self._arrivals[-1][0]:
                self._arrivals.append((at, spec))
        while len(self._arrival_ids) > 16 * OUTLOOK_SIZE:  # ids of old arrivals: oldest first
            del self._arrival_ids[next(iter(self._arrival_ids))]

    def _entry(self, sj: StoredJob, topo: Topology) -> QueueEntry:
        """The cycle's view of a queued job: its remaining steps from its last checkpoint, the network share
        of its last plan (re-placed jobs) on the current topology, its wait and its last failure."""
        r = sj.record
        share = None
        if r.plan is not None and all(c in topo.index for c in r.plan.chain):
            share = network_share(r.plan, topo, r.spec)
        return QueueEntry(spec=r.spec, enqueued_s=r.created_at, steps_done=float(r.progress.checkpoint_step or 0),
                          network_share=share, wait=self._waits.get(r.id), failed_at=self._failed.get(r.id),
                          policy=self._policy(r.policy) if r.policy and r.policy != self.default_policy
                          else None)

    def _policy(self, name: str) -> PlacementPolicy:
        """The named policy, built once per scheduler, behind the decision cache (and the Planner service)."""
        pol = self._policies.get(name)
        if pol is None:
            pol = self._policies[name] = _Cached(self, name)
        return pol

    def build_policy(self, name: str) -> PlacementPolicy:
        """A new instance of the named policy, with this scheduler's planner."""
        if self.search_options is not None:
            return make_policy(name, self.search_options, planner=self.planner)
        return get_policy(name, planner=self.planner)

    def place_cached(self, name: str, inner: PlacementPolicy, snap: Topology, spec: JobSpec,
                     budget: Budget) -> PlacementResult:
        """The policy's decision, from the decision cache when a job of the same shape was decided on the same
        snapshot (same topology, free GPUs and revision) with the same budget (and releases) before. The demand
        on the pool (``Budget.demand_gpus``) is part of the key only for a policy that prices GPUs by it
        (SpinSearch with ``gpu_price`` > 0); for any other it is left out, so a growing queue does not
        defeat the cache."""
        if not getattr(inner, "gpu_price", 0.0):
            budget = replace(budget, demand_gpus=0)
        key = (name, _shape(spec), snap, budget)
        hit = self._decisions.get(key)
        if hit is not None:
            self._decisions.move_to_end(key)
            self.cache_hits += 1
            return hit
        result = decide(inner, snap, spec, budget)
        self._decisions[key] = result
        if len(self._decisions) > DECISION_CACHE_SIZE:
            self._decisions.popitem(last=False)
        return result

    def _material_change(self, sj: StoredJob, topo: Topology) -> str:
        """Why a job holding GPUs must be re-placed on ``topo`` ("" when it need not): one of its clusters
        left the graph, or its plan's predicted step time grew by more than ``replan_threshold`` (a link or a
        cluster degraded) relative to the prediction on the topology it was placed on."""
        r = sj.record
        if r.state not in HOLDING:
            return ""
        lost = sorted(c for c in r.allocation if c not in topo.index)
        if lost:
            return f"cluster {','.join(lost)} left the topology; re-placing"
        if r.plan is None or self.replan_threshold <= 0:
            return ""
        placed_at = r.plan.extras.get(PLACED_STEP_KEY)
        if not placed_at:
            return ""
        try:
            now_s = costmodel.evaluate(r.plan, topo, r.spec).step_time_s
        except SpiderFlowError:
            return ""
        if now_s > placed_at * (1.0 + self.replan_threshold):
            return (f"predicted step time grew from {placed_at:.3g} s to {now_s:.3g} s on the current topology "
                    f"(links or clusters of {','.join(r.plan.chain)} degraded); re-placing")
        return ""

    def _est_end(self, sj: StoredJob, now: float) -> float:
        """When a job holding GPUs is expected to give them back: ``now`` plus its remaining steps at the
        plan's step time once its workers report progress; before the first report, its placement time plus
        all the steps from its checkpoint (so the estimate does not slide forward while no report comes)."""
        r = sj.record
        if r.plan is None:
            return now
        step = r.plan.step_time_s
        if r.progress.step <= 0:
            placed = next((t.at for t in reversed(r.history) if t.to_state is JobState.PLACED), None)
            if placed is not None:
                start = r.progress.checkpoint_step or 0
                return max(now, placed + max(0, r.spec.steps - start) * step)
        return now + max(0, r.spec.steps - r.progress.step) * step

    async def _bind_placed(self, sj: StoredJob, d: CycleDecision, topo: Topology, free: dict[str, int],
                           allocs: dict[str, dict[str, int]], alloc_revs: dict[str, int]) -> Decision:
        """Bind one placement of the cycle (one etcd transaction compared on the revisions read)."""
        r = sj.record
        assert d.plan is not None and d.result is not None
        plan = d.plan
        allocation = plan.gpus_by_cluster()
        # Remember the closed-form prediction on this snapshot: later snapshots are compared against it.
        plan = replace(plan, extras={**plan.extras,
                                     PLACED_STEP_KEY: costmodel.evaluate(plan, topo, r.spec).step_time_s})
        policy_name = r.policy or self.default_policy
        chain = ",".join(plan.chain)
        placed = r.to(
            JobState.PLACED, f"placed on {chain} by {d.result.policy}", now=self.clock(), plan=plan,
            allocation=allocation, attempt=r.attempt + 1, policy=policy_name, topology_revision=topo.revision,
        )
        bound = await self._bind(sj, placed, topo, allocs, alloc_revs)
        if bound is None:
            log.info("scheduler.bind_conflict", job=r.id, chain=list(plan.chain))
            return Decision(job_id=r.id, kind=DecisionKind.CONFLICT, reason="state changed; retrying",
                            seconds=d.seconds)
        for c, g in allocation.items():
            free[c] -= g
            allocs.setdefault(c, {})[r.id] = g
            alloc_revs[c] = bound.mod_revision
        log.info("scheduler.placed", job=r.id, chain=list(plan.chain), gpus=plan.gpus, policy=d.result.policy,
                 step_time_s=round(plan.step_time_s, 6), decision_s=round(d.seconds, 4), attempt=placed.attempt,
                 topology_revision=topo.revision)
        if self.on_placed is not None:
            self.on_placed(bound)
        return Decision(job_id=r.id, kind=DecisionKind.PLACED, reason=placed.reason, chain=plan.chain,
                        seconds=d.seconds, gpus=plan.gpus, est_end_s=d.est_end_s)

    async def _bind(self, sj: StoredJob, placed: JobRecord, topo: Topology, allocs: dict[str, dict[str, int]],
                    alloc_revs: dict[str, int]) -> StoredJob | None:
        """Bind ``placed``; None when the job record changed or the GPUs are no longer there.

        A bind that lost only on allocation keys (jobs ending or placed on the same clusters since the
        snapshot) re-reads those keys and binds again, compared on the new revisions, when the chosen GPUs
        still fit under each cluster's capacity in ``topo``: finishing jobs do not end the cycle."""
        for c, g in placed.allocation.items():  # jobs that ended since the snapshot: bind on the newer value
            known = self.repo.known_allocation(c)
            if known is not None and known[1] > alloc_revs.get(c, 0) and \
                    sum(known[0].values()) + g <= topo.cluster(c).free:
                allocs[c], alloc_revs[c] = known
        for _ in range(BIND_RETRIES):
            try:
                return await self.repo.bind(sj, placed, alloc_revs, allocs)
            except CompareFailedError as e:
                if keys.job_key(placed.id) in e.current:
                    return None
            for c, g in placed.allocation.items():
                current, rev = await self.repo.allocation(c)
                if sum(current.values()) + g > topo.cluster(c).free:
                    return None
                allocs[c], alloc_revs[c] = current, rev
        return None

    def _note(self, sj: StoredJob, decision: Decision) -> JobRecord | None:
        """The record saying why a queued job was not placed, to be written (only when the reason changed: no
        write storms; at most :data:`NOTE_WRITES_PER_CYCLE` a cycle). The cycle writes its notes together
        (:meth:`JobRepository.update_many`: one transaction per 64 records, each compared on its own revision)."""
        r = sj.record
        if decision.kind is DecisionKind.UNRESOLVABLE:
            reason = f"cannot fit this topology: {decision.reason}"
        else:
            reason = decision.reason
        if reason and reason != r.reason and self._notes_left > 0:
            self._notes_left -= 1
            return r.with_reason(reason, now=self.clock())
        return None
