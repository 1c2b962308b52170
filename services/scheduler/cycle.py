"""The scheduling cycle (leader only): decide on one snapshot, then bind with compare-and-swap.

One cycle, as named extension points (STYLE.md §2–3):

1. **snapshot** – one topology snapshot (with its etcd revision) from the :class:`TopologySource`, every
   job record and every allocation key, each with the revision it was read at.
2. **reconcile** – jobs holding GPUs on a cluster that left the graph, or whose plan's predicted step time
   grew by more than ``replan_threshold`` on the current snapshot (a link or cluster degraded), go
   RESCHEDULING (GPUs released, the reason says why); a RESCHEDULING job is queued again like a pending one.
3. **sort** – queued jobs (PENDING, RESCHEDULING) ordered by :func:`spiderflow.queueing.order`:
   priorities, BACE-Pipe-style dynamic prioritisation (remaining work, network share × link utilisation),
   aging so nothing starves.
4. **filter** – clusters with no free GPU left are dropped from the snapshot the policy sees; a job whose
   minimum exceeds all free GPUs is not even tried (its reason says so).
5. **place** – the job's policy (default SpinSearch) on ``topology.with_free(free)`` (a job shaped like one
   already decided on the same snapshot reuses that decision: :data:`DECISION_CACHE_SIZE`). With a Planner
   service configured (``finalize``), the policies that plan their chain with TPA themselves (SpinSearch,
   ``bace``: ``tpa_final``) only choose the chain and its level-1 plan here, the Planner service plans that
   chain with TPA, and the better of the two plans by the objective is kept — the same rule as
   in-process (:func:`spiderflow.placement.common.finalise`); the other baselines keep their own plans, as
   in the simulator. With ``wait_for_releases``
   the policy is also told which GPUs come back when (:func:`spiderflow.queueing.expected_releases`: jobs
   holding GPUs at their estimated ends, and the claims of jobs already waiting) and may answer "wait"
   (SpinSearch's start-now-or-wait step, as in the simulator): the job stays PENDING with the policy's
   reason, is not decided again before the time it waits for (unless a cluster it claimed leaves the
   graph or its claimed GPUs are free sooner), its claim shows in the other jobs' releases, and as the
   head it is reserved at that time
   (:func:`spiderflow.queueing.reserve_at`). Each wait is also recorded in etcd (``waits/<job>``, deleted
   when it ends or the job is bound; written only while the term's election key holds): a new leader's
   first cycle adopts them, so a change of leader neither decides a waiting job afresh before its time nor
   forgets the GPUs it claimed.
6. **admit** – EASY backfilling (:func:`spiderflow.queueing.admits`): once the first job in order cannot
   start (the *head*), later jobs start only if they do not delay the head's reserved start.
7. **reserve** – the placement's GPUs are subtracted from the in-memory free map (the *assumed* state).
8. **bind** – one etcd transaction (:meth:`JobRepository.bind`) comparing the job record and every
   allocation key it changes on the revisions read in step 1. If it loses, the reservation is undone and
   the cycle ends early (a new one starts from a fresh snapshot), so no GPU is ever given to two jobs.

A job that cannot be placed stays PENDING with a reason that says why (the policy's reason naming the
binding constraint, or the backfilling rule). Decisions are logged as one structlog event each with the
job id, the chain, the topology revision and the decision's wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import structlog

from services.scheduler.liveness import DEFAULT_STALE_S, stale_reason
from services.scheduler.repo import JobRepository, StoredJob
from services.scheduler.topology_source import TopologySource
from spiderflow import costmodel, metrics
from spiderflow.domain import JobSpec, Plan, Topology
from spiderflow.errors import SpiderFlowError, UnavailableError, UnschedulableError, ValidationError
from spiderflow.jobs import JobRecord, JobState
from spiderflow.placement import Budget, PlacementResult, PlacementStatus, get_policy
from spiderflow.placement.common import Level2, plan_objective, set_level2
from spiderflow.queueing import (
    Claim,
    Holding,
    QueuePolicy,
    Reservation,
    RunningJob,
    admits,
    after_admit,
    expected_releases,
    order,
    queued_job,
    reserve,
    reserve_at,
)
from spiderflow.security.tenancy import Entry, TenantQuota, arrange
from spiderflow.store import keys
from spiderflow.store.base import Compare, CompareFailedError, NotLeaderError

__all__ = ["CycleReport", "Decision", "DecisionKind", "PlanFinalizer", "SchedulingCycle"]

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

PlanFinalizer = Callable[[Topology, JobSpec, Plan], Awaitable[Plan]]
"""Turns a policy's plan into the final plan (the Planner service's TPA plan of the same chain)."""


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

    @property
    def placed(self) -> list[str]:
        return [d.job_id for d in self.decisions if d.kind is DecisionKind.PLACED]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Wait:
    """A queued job whose policy chose to wait for releases: until when, the plan's GPUs it claims then and
    that plan's estimated run time, and the policy's reason."""

    until: float
    gpus: int
    claim: tuple[tuple[str, int], ...]
    run_s: float
    reason: str

    def to_doc(self) -> dict[str, Any]:
        """The JSON document stored at ``waits/<job>``."""
        return {"until": self.until, "gpus": self.gpus, "claim": [[c, g] for c, g in self.claim],
                "run_s": self.run_s, "reason": self.reason}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> _Wait | None:
        """A stored wait, or ``None`` when the document is not one (missing or mistyped fields)."""
        try:
            until, run_s, gpus, reason = doc["until"], doc["run_s"], doc["gpus"], doc["reason"]
            claim = tuple((str(c), int(g)) for c, g in doc["claim"])
        except (KeyError, TypeError, ValueError):
            return None
        numbers_ok = all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                         for x in (until, run_s))
        if not numbers_ok or isinstance(gpus, bool) or not isinstance(gpus, int) or not isinstance(reason, str):
            return None
        return cls(until=float(until), gpus=gpus, claim=claim, run_s=float(run_s), reason=reason)


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
        finalize: PlanFinalizer | None = None,
        queue_policy: QueuePolicy | None = None,
        budget: Budget | None = None,
        clock: Callable[[], float] = time.time,
        on_placed: Callable[[StoredJob], None] | None = None,
        replan_threshold: float = 0.5,
        wait_for_releases: bool = False,
        level2: Level2 = "exact",
        tenant_quota: TenantQuota | None = None,
        stale_s: float = DEFAULT_STALE_S,
    ) -> None:
        self.repo = repo
        self.stale_s = stale_s
        """Silence after which a job holding GPUs is re-placed (:mod:`services.scheduler.liveness`)."""
        self.tenant_quota = tenant_quota
        """Per-tenant GPU quota applied when the queue is arranged (:func:`spiderflow.security.tenancy.arrange`)."""
        self.level2: Level2 = level2
        """TPA's level-2 solver for policies that plan in-process (``"exact"`` or ``"cpsat"``)."""
        self.topology = topology
        self.default_policy = default_policy
        self.finalize = finalize
        self.queue_policy = queue_policy or QueuePolicy()
        self.budget = budget or Budget(time_limit_s=30.0)
        self.clock = clock
        self.on_placed = on_placed
        self.replan_threshold = replan_threshold
        self.wait_for_releases = wait_for_releases
        self._waits: dict[str, _Wait] = {}
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

    async def _put_wait(self, job_id: str, doc: Mapping[str, Any]) -> None:
        try:
            await self.repo.put_wait(job_id, doc, guard=self._guard)
        except CompareFailedError:
            raise NotLeaderError(f"leadership lost: the wait of {job_id} was not recorded") from None

    async def _delete_wait(self, job_id: str) -> None:
        try:
            await self.repo.delete_wait(job_id, guard=self._guard)
        except CompareFailedError:
            raise NotLeaderError(f"leadership lost: the wait of {job_id} was not deleted") from None

    async def _adopt_waits(self) -> None:
        """Replace the in-memory waits with those recorded in etcd; a malformed record is deleted, and so is
        every record when this scheduler runs without ``wait_for_releases``."""
        waits: dict[str, _Wait] = {}
        for job_id, doc in (await self.repo.waits()).items():
            w = _Wait.from_doc(doc)
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
        if not self._adopted:
            await self._adopt_waits()
        stored, _ = await self.repo.list()
        allocs, alloc_revs, _ = await self.repo.allocations()
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
            stored, _ = await self.repo.list()
            allocs, alloc_revs, _ = await self.repo.allocations()

        used: dict[str, int] = {c: sum(a.values()) for c, a in allocs.items()}
        free = {c.name: max(0, c.free - used.get(c.name, 0)) for c in topo.clusters}
        by_id = {sj.record.id: sj for sj in stored}
        queue = [sj for sj in stored if sj.record.state in QUEUED]
        if not queue:
            await self._end_waits(list(self._waits))
            report.seconds = time.perf_counter() - t_start
            metrics.observe_cycle((), queued=0)
            return report

        # 3. sort
        ordered = order(
            [queued_job(sj.record.spec, sj.record.created_at) for sj in queue], now, self.queue_policy
        )
        # fair share between tenants; jobs that can never fit the pool or are over their tenant's GPU quota
        # are parked with their reason, never becoming the head (spiderflow.security.tenancy)
        held: dict[str, int] = {}
        for sj in stored:
            if sj.record.state in HOLDING:
                held[sj.record.spec.tenant] = held.get(sj.record.spec.tenant, 0) + sum(sj.record.allocation.values())
        arranged = arrange([Entry(job_id=q.id, tenant=by_id[q.id].record.spec.tenant,
                                  min_gpus=by_id[q.id].record.spec.gpus.min) for q in ordered],
                           held=held, capacity=sum(c.free for c in topo.clusters), quota=self.tenant_quota)
        for job_id, why in arranged.parked.items():
            kind = DecisionKind.UNRESOLVABLE if job_id in arranged.unresolvable else DecisionKind.DEFERRED
            decision = Decision(job_id=job_id, kind=kind, reason=why)
            report.decisions.append(decision)
            await self._note(by_id[job_id], decision)
        by_qid = {q.id: q for q in ordered}
        ordered = [by_qid[i] for i in arranged.order]
        running = [
            RunningJob(id=sj.record.id, gpus=sum(sj.record.allocation.values()), est_end_s=self._est_end(sj, now))
            for sj in stored if sj.record.state in HOLDING
        ]
        queued_ids = {sj.record.id for sj in queue}
        await self._end_waits([k for k in self._waits if k not in queued_ids])
        holding = [Holding(job_id=r.id, end_s=r.est_end_s, gpus=tuple(by_id[r.id].record.allocation.items()))
                   for r in running]
        gone = frozenset(c for sj in stored for c in sj.record.allocation if c not in topo.index)
        res: Reservation | None = None
        head_seen = False
        behind_head = 0
        for qj in ordered:
            sj = by_id[qj.id]
            total_free = sum(free.values())
            wait = self._waits.get(qj.id)
            if wait is not None and (wait.until <= now or any(c not in topo.index for c, _ in wait.claim)
                                     or all(free.get(c, 0) >= g for c, g in wait.claim)):
                # Its time has come, a cluster it claimed left, or the GPUs it waits for are free already
                # (a job ended before its estimate): decide again.
                await self._end_waits([qj.id])
                wait = None
            if wait is not None and not head_seen:
                decision = Decision(job_id=qj.id, kind=DecisionKind.DEFERRED, reason=wait.reason)
                report.decisions.append(decision)
                await self._note(sj, decision)
                head_seen = True
                res = reserve_at(qj.id, wait.gpus, wait.until, total_free, running, now)
                continue
            if head_seen and (not self.queue_policy.backfill or behind_head >= self.queue_policy.backfill_depth):
                decision = Decision(job_id=qj.id, kind=DecisionKind.DEFERRED,
                                    reason=f"queued behind {res.job_id if res else 'the head job'}")
                await self._note(sj, decision)
                report.decisions.append(decision)
                continue
            if head_seen:
                behind_head += 1
            # 4. filter
            if total_free < sj.record.spec.gpus.min:
                decision = Decision(job_id=qj.id, kind=DecisionKind.UNSCHEDULABLE,
                                    reason=f"needs at least {sj.record.spec.gpus.min} GPUs, {total_free} free")
            elif wait is not None:  # waiting behind the head: it is not asked again before its time
                decision = Decision(job_id=qj.id, kind=DecisionKind.DEFERRED, reason=wait.reason)
            else:
                budget = self.budget
                if self.wait_for_releases:
                    claims = [Claim(job_id=k, start_s=w.until, run_s=w.run_s, gpus=w.claim)
                              for k, w in self._waits.items() if k != qj.id]
                    budget = replace(budget, releases=expected_releases(holding, claims, now, gone=gone))
                decision = await self._place_one(sj, topo, free, now, res, allocs, alloc_revs, budget)
                if decision.kind is DecisionKind.DEFERRED and (new_wait := self._waits.get(qj.id)) is not None:
                    await self._put_wait(qj.id, new_wait.to_doc())
            report.decisions.append(decision)
            if decision.kind is DecisionKind.CONFLICT:
                report.conflict = True
                break
            if decision.kind is DecisionKind.PLACED:
                res = after_admit(res, decision.gpus, decision.est_end_s)
                continue
            await self._note(sj, decision)
            if not head_seen and decision.kind is not DecisionKind.UNRESOLVABLE:  # it would block the queue for ever
                head_seen = True
                w = self._waits.get(qj.id)
                res = (reserve_at(qj.id, w.gpus, w.until, total_free, running, now) if w is not None
                       else reserve(qj.id, sj.record.spec.gpus.min, total_free, running, now))
        report.seconds = time.perf_counter() - t_start
        metrics.observe_cycle(report.decisions, queued=len(queue))
        log.info("scheduler.cycle", topology_revision=topo.revision, queued=len(queue), placed=len(report.placed),
                 seconds=round(report.seconds, 4), conflict=report.conflict, cached=self.cache_hits - hits_before,
                 notes=NOTE_WRITES_PER_CYCLE - self._notes_left)
        return report

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

    def _service_plans(self, policy: object) -> bool:
        """Whether the Planner service makes ``policy``'s final plan: one is configured and the policy plans
        its chain with TPA itself (``tpa_final``)."""
        return self.finalize is not None and bool(getattr(policy, "tpa_final", False))

    async def _decide(self, spec: JobSpec, policy_name: str, snap: Topology, budget: Budget) -> PlacementResult:
        """The policy's decision, from the decision cache when a job of the same shape was decided on the same
        snapshot (same topology, free GPUs and revision) with the same budget (and releases) before."""
        key = (policy_name, _shape(spec), snap, budget)
        hit = self._decisions.get(key)
        if hit is not None:
            self._decisions.move_to_end(key)
            self.cache_hits += 1
            return hit
        policy = get_policy(policy_name)
        set_level2(policy, self.level2)
        if self._service_plans(policy):
            policy.planner = "fallback"  # type: ignore[attr-defined]  # the Planner service plans the chain
        result = await asyncio.to_thread(policy.place, snap, spec, budget)
        self._decisions[key] = result
        if len(self._decisions) > DECISION_CACHE_SIZE:
            self._decisions.popitem(last=False)
        return result

    async def _place_one(
        self, sj: StoredJob, topo: Topology, free: dict[str, int], now: float, res: Reservation | None,
        allocs: dict[str, dict[str, int]], alloc_revs: dict[str, int], budget: Budget,
    ) -> Decision:
        r = sj.record
        policy_name = r.policy or self.default_policy
        snap = topo.with_free(free)
        t0 = time.perf_counter()
        try:
            result = await self._decide(r.spec, policy_name, snap, budget)
            if result.constraint == "deferred" and result.plan is not None and budget.releases:
                later = result.plan
                left = max(1, r.spec.steps - r.progress.step)
                self._waits[r.id] = _Wait(
                    until=now + float(result.stats.get("defer_s", 0.0)), gpus=later.gpus,
                    claim=tuple(sorted(later.gpus_by_cluster().items())), run_s=left * later.step_time_s,
                    reason=result.reason)
                log.info("scheduler.waiting", job=r.id, until=self._waits[r.id].until, chain=list(later.chain),
                         reason=result.reason)
                return Decision(job_id=r.id, kind=DecisionKind.DEFERRED, reason=result.reason,
                                seconds=time.perf_counter() - t0)
            if not result.ok:
                kind = DecisionKind.UNRESOLVABLE if result.status is PlacementStatus.UNRESOLVABLE else \
                    DecisionKind.UNSCHEDULABLE
                return Decision(job_id=r.id, kind=kind, reason=result.reason or "no feasible placement",
                                seconds=time.perf_counter() - t0)
            assert result.plan is not None
            plan = result.plan
            if self.finalize is not None and self._service_plans(get_policy(policy_name)):
                final = await self.finalize(snap, r.spec, plan)
                if plan_objective(final, budget.objective) <= plan_objective(plan, budget.objective):
                    plan = final
        except UnschedulableError as e:
            return Decision(job_id=r.id, kind=DecisionKind.UNSCHEDULABLE, reason=str(e),
                            seconds=time.perf_counter() - t0)
        except UnavailableError as e:
            return Decision(job_id=r.id, kind=DecisionKind.ERROR, reason=f"planner unavailable: {e}",
                            seconds=time.perf_counter() - t0)
        except SpiderFlowError as e:
            return Decision(job_id=r.id, kind=DecisionKind.ERROR, reason=str(e), seconds=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        allocation = plan.gpus_by_cluster()
        # Remember the closed-form prediction on this snapshot: later snapshots are compared against it.
        plan = replace(plan, extras={**plan.extras,
                                     PLACED_STEP_KEY: costmodel.evaluate(plan, snap, r.spec).step_time_s})
        # 6. admit (EASY backfilling)
        total_free = sum(free.values())
        est_end = now + r.spec.steps * plan.step_time_s
        if any(free.get(c, 0) < g for c, g in allocation.items()) or not admits(res, plan.gpus, est_end, total_free):
            return Decision(job_id=r.id, kind=DecisionKind.DEFERRED, reason="starting it now would delay the "
                            f"reserved start of job {res.job_id if res else '?'}", seconds=seconds)
        # 7. reserve (assume)
        for c, g in allocation.items():
            free[c] -= g
        # 8. bind
        chain = ",".join(plan.chain)
        placed = r.to(
            JobState.PLACED, f"placed on {chain} by {result.policy}", now=self.clock(), plan=plan,
            allocation=allocation, attempt=r.attempt + 1, policy=policy_name, topology_revision=topo.revision,
        )
        bound = await self._bind(sj, placed, topo, allocs, alloc_revs)
        if bound is None:
            for c, g in allocation.items():
                free[c] += g  # unreserve
            log.info("scheduler.bind_conflict", job=r.id, chain=list(plan.chain))
            return Decision(job_id=r.id, kind=DecisionKind.CONFLICT, reason="state changed; retrying",
                            seconds=seconds)
        for c, g in allocation.items():
            allocs.setdefault(c, {})[r.id] = g
            alloc_revs[c] = bound.mod_revision
        log.info("scheduler.placed", job=r.id, chain=list(plan.chain), gpus=plan.gpus, policy=result.policy,
                 step_time_s=round(plan.step_time_s, 6), decision_s=round(seconds, 4), attempt=placed.attempt,
                 topology_revision=topo.revision)
        if self.on_placed is not None:
            self.on_placed(bound)
        return Decision(job_id=r.id, kind=DecisionKind.PLACED, reason=placed.reason, chain=plan.chain,
                        seconds=seconds, gpus=plan.gpus, est_end_s=est_end)

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

    async def _note(self, sj: StoredJob, decision: Decision) -> None:
        """Record why a queued job was not placed (only when the reason changed: no write storms)."""
        r = sj.record
        if decision.kind is DecisionKind.UNRESOLVABLE:
            reason = f"cannot fit this topology: {decision.reason}"
        else:
            reason = decision.reason
        if reason and reason != r.reason and self._notes_left > 0:
            self._notes_left -= 1
            with contextlib.suppress(CompareFailedError):
                await self.repo.update(sj, r.with_reason(reason, now=self.clock()))
