r"""One scheduling cycle, pure: the queue, the jobs holding GPUs, the waits and one topology snapshot in;
the decisions, in the order they were made, and the head's reservation out.

The scheduler service (``services/scheduler/cycle.py``) and the simulator (:mod:`spiderflow.core.sim.engine`)
both call :func:`run_cycle`; they differ only in where the inputs come from and what they do with the
result (the service binds placements with compare-and-swap in etcd and writes notes; the simulator applies
them to its event heap).

The cycle
---------
1. **order** the queue (:func:`spiderflow.core.queueing.order`) with each job's *remaining* work (``steps_left``)
   and network share (measured from its last plan when it had one, else estimated), and the current
   utilisation of the inter-cluster links by the jobs holding GPUs (:func:`network_utilization`).
2. walk the order. A job is **tried** (its policy asked) only when a decision could change its answer
   (:func:`worth_trying`): enough GPUs are free for its minimum, it is not waiting for releases (or the
   GPUs it waits for are all free already), and the pool grew or changed since its last failed decision.
3. each decision calls the job's policy on the snapshot with the GPUs still free; its plan is re-scored on
   the exact timeline (:func:`spiderflow.core.tpa.timeline.result_on_timeline`), the one prediction every
   policy is compared on. With waiting on
   (:attr:`CycleOptions.wait`) every policy is offered it: the budget lists the GPUs expected back
   (:func:`spiderflow.core.queueing.expected_releases`: holders at their estimated ends, and the claims of
   jobs already waiting), a policy that prices waits itself (:class:`~spiderflow.core.placement.base.WaitPricer`,
   e.g. SpinSearch) answers :attr:`~spiderflow.core.domain.PlacementStatus.WAIT` directly, and for any other
   policy the cycle prices a later start with that policy's own placement on the GPUs free at each release
   point (:func:`price_wait`): it waits iff the whole job finishes (or costs) enough less that way.
   Every budget also carries the demand on the pool besides the job (:attr:`~spiderflow.core.domain.Budget.
   demand_gpus`: the GPUs held, including by jobs placed earlier in this cycle, plus the minimum GPUs of the
   other queued jobs not placed yet), which a policy may use to price the GPUs its plan holds (SpinSearch's
   ``gpu_price``). A policy that looks ahead (SpinSearch's ``lookahead``) also gets the
   :attr:`~spiderflow.core.domain.Budget.outlook`: the observed arrival rate and the last
   :data:`OUTLOOK_SIZE` arrivals' specs (:attr:`CycleInput.arrivals`, which the caller keeps).
4. **admit** with EASY backfilling (:func:`spiderflow.core.queueing.admits`): the first job in order that does
   not start becomes the *head* and gets a reservation (at the time it waits for, if it waits); at most
   ``queue.backfill_depth`` jobs behind it are tried, the rest are left pending ("queued behind").
5. a placed job's GPUs are taken from the snapshot before the next decision; a job that waits claims the
   GPUs of the plan it waits for, and the later decisions' releases show that claim.

Outcomes (:class:`Outcome`): ``place`` (with the plan and its estimated end), ``wait`` (typed
:class:`~spiderflow.core.domain.Wait`: until when, the plan it waits for, why), ``pending`` (the binding
constraint and the reason; ``tried`` tells whether the policy was asked), ``reject`` (the job can never fit
this topology: the policy says so, or it does not fit the whole idle pool and the topology cannot change).

Resource constraints (:class:`~spiderflow.core.domain.Constraints`): a job whose constraints no cluster can
satisfy (none allowed, or too few GPUs on the allowed ones) is parked with constraint ``constraints`` like a
job that does not fit the pool; any other constrained job is decided on its view of the snapshot
(:func:`spiderflow.core.constraints.view`: its allowed clusters and the links among them), with their free GPUs
and releases only, whatever the policy.

Choices where the service and the simulator used to differ
----------------------------------------------------------
- *Ordering* uses remaining steps and network share in both (the service used to order by the whole job's
  work and a network share of 0).
- *Unresolvable jobs* are rejected in both: such a job is never the head and never blocks backfilling. The
  simulator gives it up (its topology changes only by the trace's events); the service keeps it PENDING
  with the reason, since clusters may register at any time, and asks again once the topology changes.
- *Behind the head* both stop deciding after ``backfill_depth`` tries; the jobs further back get a
  ``pending`` decision ("queued behind <head>", not tried), which the service writes as a note and the
  simulator ignores. Only jobs actually tried count towards the depth.
- *Holders placed in this cycle* count in the later decisions' releases and in the head's reservation.

Time: ``now`` is the cycle's start. With :attr:`CycleOptions.advance` ``measured`` (the simulator's
default) each decision's measured wall time moves the cycle's clock on (a job placed by the k-th decision
starts after the first k decisions), ``fixed`` moves it by a constant per decision (reproducible), and
``none`` keeps it at ``now`` (the service: real time passes by itself). Pure: no I/O; the only clocks read
are the decision timers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from spiderflow.core.constraints import allowed_clusters, unsatisfiable
from spiderflow.core.constraints import view as constraint_view
from spiderflow.core.costmodel import activation_bytes
from spiderflow.core.domain import (
    Budget,
    JobSpec,
    Objective,
    PlacementResult,
    PlacementStatus,
    Plan,
    Release,
    Topology,
    Wait,
)
from spiderflow.core.errors import SpiderFlowError, UnschedulableError
from spiderflow.core.placement.base import PlacementPolicy, WaitPricer
from spiderflow.core.placement.lookahead import arrivals_outlook
from spiderflow.core.queueing import (
    Claim,
    Holding,
    QueuedJob,
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
from spiderflow.core.tenancy import Entry, TenantQuota, arrange


def result_on_timeline(result: PlacementResult, topo: Topology, job: JobSpec) -> PlacementResult:
    """:func:`spiderflow.core.tpa.timeline.result_on_timeline`, imported on the first decision that has a plan to
    re-score: importing the cycle (every scheduler start) does not load the planner and its compiled kernels."""
    from spiderflow.core.tpa.timeline import result_on_timeline as on_timeline

    return on_timeline(result, topo, job)


__all__ = [
    "Advance",
    "CycleDecision",
    "CycleInput",
    "CycleOptions",
    "CycleResult",
    "Holder",
    "InvalidPlacementError",
    "Outcome",
    "QueueEntry",
    "WaitState",
    "decide",
    "job_free",
    "link_gbps",
    "network_share",
    "network_utilization",
    "price_wait",
    "run_cycle",
    "worth_trying",
]

DEFER_MARGIN = 0.25
"""A later start must beat starting now by this fraction of the objective to wait (SpinSearch's own margin)."""
OUTLOOK_SIZE = 32
"""How many of the most recent arrivals an :class:`~spiderflow.core.domain.Outlook` is built from (the
empirical mix and the observed rate): enough that the trace mix's rarest model (6 %) appears about twice,
few enough that an old mix fades."""
MAX_LOOKAHEAD = 4
"""Release points a generic wait pricing plans at, soonest first (each is one decision of the policy)."""


class InvalidPlacementError(SpiderFlowError):
    """A policy returned a plan that takes more GPUs than a cluster has free (a policy bug)."""


class Outcome(StrEnum):
    PLACE = "place"
    WAIT = "wait"
    PENDING = "pending"
    REJECT = "reject"


class Advance(StrEnum):
    """How a cycle's clock moves on per decision (module docstring)."""

    MEASURED = "measured"
    FIXED = "fixed"
    NONE = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitState:
    """A queued job waiting for releases: it is not decided again before ``until`` (absolute), unless the
    GPUs it claims (``claim``, those of the plan it waits for, ``gpus`` in all) are all free sooner; the
    plan runs ``run_s`` seconds; ``reason`` is the policy's."""

    until: float
    gpus: int
    claim: tuple[tuple[str, int], ...]
    run_s: float
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueEntry:
    """A queued job. ``steps_done`` is its saved progress (the remaining ``spec.steps - steps_done`` are
    planned); ``network_share`` is measured from its last plan (``None``: estimate); ``restart_delay_s`` is
    paid at its next start; ``failed_at`` the (pool version, free GPUs) of its last failed decision;
    ``policy`` overrides the cycle's policy for this job."""

    spec: JobSpec
    enqueued_s: float
    steps_done: float = 0.0
    network_share: float | None = None
    restart_delay_s: float = 0.0
    wait: WaitState | None = None
    failed_at: tuple[int, int] | None = None
    policy: PlacementPolicy | None = None

    @property
    def steps_left(self) -> int:
        return max(1, self.spec.steps - math.floor(self.steps_done))

    def remaining_spec(self) -> JobSpec:
        left = self.steps_left
        return self.spec if left == self.spec.steps else replace(self.spec, steps=left)


@dataclass(frozen=True, slots=True, kw_only=True)
class Holder:
    """A job holding GPUs (``((cluster, count), ...)``) until its estimated end ``end_s`` (absolute); it
    pushes ``link_gbps`` across cluster boundaries (:func:`link_gbps`)."""

    job_id: str
    end_s: float
    gpus: tuple[tuple[str, int], ...]
    link_gbps: float = 0.0
    tenant: str = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleOptions:
    """``budget`` is every decision's search budget (``vary_seed``: decision ``k`` of the run gets seed
    ``budget.seed · 1000003 + k``); ``wait`` offers waiting for releases to every policy; ``advance`` and
    ``fixed_overhead_s``: how the clock moves on per decision (module docstring); ``tenant_quota``: the GPUs a
    tenant may hold (:mod:`spiderflow.core.tenancy`; ``None``: unbounded); ``fair_share``: interleave the order
    between tenants by max-min share of GPUs (:func:`spiderflow.core.tenancy.arrange`; the scheduler service's
    default), else keep the queue policy's order. Jobs that can never fit the pool or are over their
    tenant's quota are parked either way."""

    queue: QueuePolicy = field(default_factory=QueuePolicy)
    budget: Budget = field(default_factory=Budget)
    vary_seed: bool = False
    wait: bool = True
    advance: Advance = Advance.NONE
    fixed_overhead_s: float = 0.01
    tenant_quota: TenantQuota | None = None
    fair_share: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleInput:
    """One cycle's state. ``topology``: one snapshot whose ``free`` GPUs are those not held (lost clusters
    at 0); ``gone``: clusters whose GPUs will not come back (left out of releases); ``version``: the pool
    version (bumped whenever GPUs are given back or the topology changes; a failed decision is tried again
    only after that or when more GPUs are free); ``topology_may_change``: whether the topology may still
    grow (if not, a job that does not fit the whole idle pool is rejected); ``decisions_before``: decisions
    made before this cycle (seeds); ``arrivals``: the most recent arrivals the caller has seen, ``(time_s,
    spec)`` in arrival order (at most :data:`OUTLOOK_SIZE` are used; empty: none known), for a policy that
    looks ahead."""

    topology: Topology
    queue: Sequence[QueueEntry]
    holding: Sequence[Holder]
    now: float
    version: int = 0
    gone: frozenset[str] = frozenset()
    topology_may_change: bool = True
    decisions_before: int = 0
    arrivals: tuple[tuple[float, JobSpec], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleDecision:
    """One decision (module docstring). ``at`` is the cycle clock when it was made and ``start_s`` when the
    placed job starts (``at`` + its decision time); ``est_end_s`` the placed job's estimated end;
    ``seconds``/``cpu_seconds`` the policy's wall/CPU time (0 when ``tried`` is false); ``fed_s`` the time
    the decision moved the clock on; ``result`` the policy's full answer (``None`` when not tried)."""

    job_id: str
    outcome: Outcome
    reason: str = ""
    constraint: str = ""
    tried: bool = False
    plan: Plan | None = None
    wait: WaitState | None = None
    at: float = 0.0
    start_s: float = 0.0
    est_end_s: float = 0.0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    fed_s: float = 0.0
    total_free: int = 0
    result: PlacementResult | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CycleResult:
    """The decisions in order, the head's reservation (``None`` when every tried job started), the clock
    at the end, the time spent ordering, the snapshot after the placements and the decisions made."""

    decisions: tuple[CycleDecision, ...]
    reservation: Reservation | None
    clock: float
    queue_seconds: float
    topology: Topology
    tried: int
    waits: Mapping[str, WaitState] = field(default_factory=dict)

    @property
    def placed(self) -> list[str]:
        return [d.job_id for d in self.decisions if d.outcome is Outcome.PLACE]


# ----------------------------------------------------------------------------------------------------------
# network figures


def network_share(plan: Plan, topo: Topology, job: JobSpec) -> float:
    """Share of ``plan``'s step spent on its cross-cluster boundaries (activations forward and gradients
    back at each boundary's widest-path bandwidth), in [0, 1]."""
    if len(plan.chain) < 2 or plan.step_time_s <= 0:
        return 0.0
    a = activation_bytes(job.model, max(1, job.global_batch // plan.micro_batches), job.seq_len)
    t = 0.0
    for x, y in zip(plan.chain, plan.chain[1:], strict=False):
        bw = topo.bandwidth_gbps(x, y)
        t += 2.0 * plan.micro_batches * a * 8.0 / (bw * 1e9) if bw > 0 else math.inf
    return min(1.0, t / plan.step_time_s) if math.isfinite(t) else 1.0


def link_gbps(plan: Plan, job: JobSpec, step_time: float) -> float:
    """Gbit/s a running plan pushes across cluster boundaries (forward activations + backward gradients)."""
    if len(plan.chain) < 2 or step_time <= 0 or not math.isfinite(step_time):
        return 0.0
    a = activation_bytes(job.model, max(1, job.global_batch // plan.micro_batches), job.seq_len)
    return (len(plan.chain) - 1) * 2.0 * plan.micro_batches * a * 8.0 / 1e9 / step_time


def network_utilization(topo: Topology, holding: Sequence[Holder]) -> float:
    """Cross-cluster Gbit/s of the holders' plans / total link capacity, clipped to [0, 1]."""
    cap = sum(link.bandwidth_gbps * (1 if link.directed else 2) for link in topo.links)
    load = 0.0
    for h in holding:
        load += h.link_gbps
    return min(1.0, load / cap) if cap > 0 else 0.0


# ----------------------------------------------------------------------------------------------------------
# waiting, offered to every policy


def _job_total(objective: Objective, after: float, steps: int, step: float, usd: float) -> float:
    finish, dollars = after + steps * step, steps * usd
    if objective is Objective.COST:
        return dollars
    if objective is Objective.BALANCED:
        return finish * math.sqrt(max(dollars, 0.0))
    return finish


def price_wait(policy: PlacementPolicy, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
    """Start now on ``now`` or wait, for a policy that does not price waits itself: at each release point
    of ``budget.releases`` where some cluster gains GPUs (soonest first, at most :data:`MAX_LOOKAHEAD`),
    the policy places the job on the GPUs free then; the job's ``S`` remaining steps score
    ``V(a, step, usd)`` = finish time ``a + S·step`` (``jct``), dollars (``cost``) or finish × √dollars
    (``balanced``). The best point waits iff it beats starting now by :data:`DEFER_MARGIN`."""
    if not budget.releases or not math.isfinite(now.step_time_s):
        return None
    obj = budget.objective
    v_now = _job_total(obj, 0.0, job.steps, now.step_time_s, now.usd_per_step)
    threshold = (1.0 - DEFER_MARGIN) * v_now
    free = {c.name: c.free for c in topo.clusters}
    best: tuple[float, float, Plan] | None = None
    tried = 0
    i = 0
    rel = budget.releases
    plain = replace(budget, releases=())
    while i < len(rel) and tried < MAX_LOOKAHEAD:
        after = rel[i].after_s
        grew = False
        while i < len(rel) and rel[i].after_s <= after:
            for c, g in rel[i].gpus:
                if c in free:
                    grew = grew or (g > 0 and free[c] + g > 0)
                    free[c] += g
            i += 1
        avail = {c: max(0, g) for c, g in free.items()}
        if not grew or sum(avail.values()) < job.gpus.min:
            continue
        if obj is Objective.JCT and after >= min(threshold, best[1] if best else math.inf):
            break
        tried += 1
        try:
            res = policy.place(topo.with_free(avail), job, plain)
        except SpiderFlowError:
            continue
        if not res.ok or res.plan is None:
            continue
        res = result_on_timeline(res, topo, job)
        assert res.plan is not None
        v = _job_total(obj, after, job.steps, res.plan.step_time_s, res.plan.usd_per_step)
        if v < min(threshold, best[1] if best else math.inf):
            best = (after, v, res.plan)
    if best is None:
        return None
    after, v_wait, plan = best
    return Wait(after_s=after, plan=plan,
                reason=f"waiting {after:.0f} s for GPUs being released scores {v_wait:.4g} instead of "
                       f"{v_now:.4g} when starting now ({obj} of the whole job)")


# ----------------------------------------------------------------------------------------------------------
# the cycle


def worth_trying(entry: QueueEntry, free: Mapping[str, int], total_free: int, clock: float, version: int) -> bool:
    """Whether a decision could change the job's answer (module docstring, step 2)."""
    if total_free < entry.spec.gpus.min:
        return False
    w = entry.wait
    if w is not None and w.until > clock + 1e-6 and (not w.claim or any(free.get(c, 0) < g for c, g in w.claim)):
        return False
    return entry.failed_at is None or entry.failed_at[0] != version or total_free > entry.failed_at[1]


def job_free(spec: JobSpec, topo: Topology, free: Mapping[str, int]) -> tuple[Mapping[str, int], int]:
    """The free GPUs ``spec`` may use and their total: all of ``free`` when it is unconstrained, else those
    of the clusters of ``topo`` its constraints allow (what :func:`worth_trying` should be given)."""
    if spec.constraints.empty:
        return free, sum(free.values())
    mine = {c: free.get(c, 0) for c in allowed_clusters(topo, spec.constraints)}
    return mine, sum(mine.values())


@dataclass(slots=True)
class _State:
    free: dict[str, int]
    total: int
    snap: Topology
    holding: list[Holder]
    waits: dict[str, WaitState]


def _releases(st: _State, clock: float, asking: str, gone: frozenset[str],
              allowed: Sequence[str] | None = None) -> tuple[Release, ...]:
    holding = [Holding(job_id=h.job_id, end_s=h.end_s, gpus=h.gpus) for h in st.holding]
    claims = [Claim(job_id=k, start_s=w.until, run_s=w.run_s, gpus=w.claim)
              for k, w in st.waits.items() if k != asking and w.claim]
    out = expected_releases(holding, claims, clock, gone=gone)
    if allowed is None:
        return out
    keep = set(allowed)  # a constrained job is offered only its allowed clusters' releases
    kept = (Release(after_s=r.after_s, gpus=tuple((c, g) for c, g in r.gpus if c in keep)) for r in out)
    return tuple(r for r in kept if r.gpus)


def _constraint_parked(state: CycleInput, queue: Sequence[QueueEntry], clock: float) -> list[CycleDecision]:
    """The queued jobs whose resource constraints the topology can never satisfy
    (:func:`spiderflow.core.constraints.unsatisfiable`), each with a ``constraints`` decision: ``reject`` when
    the topology cannot change any more, else ``pending`` (never the head, never a backfill slot)."""
    if all(e.spec.constraints.empty for e in queue):
        return []
    held: dict[str, int] = {}
    for h in state.holding:
        for c, g in h.gpus:
            held[c] = held.get(c, 0) + g
    final = not state.gone and not state.topology_may_change
    free_now = state.topology.total_free_gpus
    out: list[CycleDecision] = []
    for e in queue:
        why = unsatisfiable(state.topology, e.spec, held=held)
        if why:
            out.append(CycleDecision(job_id=e.spec.id, outcome=Outcome.REJECT if final else Outcome.PENDING,
                                     constraint="constraints", reason=why, at=clock, total_free=free_now))
    return out


def _queued(e: QueueEntry) -> QueuedJob:
    return queued_job(e.spec, e.enqueued_s, steps_left=e.steps_left, network_share=e.network_share)


def decide(policy: PlacementPolicy, snap: Topology, spec: JobSpec, budget: Budget) -> PlacementResult:
    """One decision: the policy's answer on ``snap``. A policy that prices waits itself
    (:class:`~spiderflow.core.placement.base.WaitPricer`) gets the budget's releases; any other is asked without
    them, and a later start is priced for it with its own placement (:func:`price_wait`) when the budget has
    releases. An :class:`UnschedulableError` or other :class:`SpiderFlowError` becomes the answer."""
    prices_itself = isinstance(policy, WaitPricer)
    try:
        result = policy.place(snap, spec, budget if prices_itself or not budget.releases
                              else replace(budget, releases=()))
    except UnschedulableError as e:
        return PlacementResult(status=PlacementStatus.UNSCHEDULABLE, policy=_name(policy), reason=str(e),
                               constraint=e.constraint)
    except SpiderFlowError as e:
        return PlacementResult(status=PlacementStatus.ERROR, policy=_name(policy), reason=str(e))
    result = result_on_timeline(result, snap, spec)
    if not prices_itself and budget.releases and result.ok and result.plan is not None:
        w = price_wait(policy, snap, spec, result.plan, budget)
        if w is not None:
            return PlacementResult(status=PlacementStatus.WAIT, policy=result.policy, plan=w.plan, wait=w,
                                   reason=w.reason, planning_seconds=result.planning_seconds, stats=result.stats)
    return result


def _name(policy: PlacementPolicy) -> str:
    return policy.name


def run_cycle(state: CycleInput, policy: PlacementPolicy, options: CycleOptions, *,
              queued: Callable[[QueueEntry], QueuedJob] | None = None) -> CycleResult:
    """One scheduling cycle (module docstring). ``queued`` gives the queue's view of an entry (default
    :func:`spiderflow.core.queueing.queued_job` of its remaining steps and network share; a caller may memoise
    it). Raises :class:`InvalidPlacementError` when a policy's plan takes more GPUs than a cluster has free."""
    clock = state.now
    t0 = time.perf_counter()
    entries = {e.spec.id: e for e in state.queue}
    view = queued or _queued
    ordered = order([view(e) for e in state.queue], clock, options.queue,
                    network_utilization(state.topology, state.holding))
    # Jobs whose resource constraints no cluster of this topology can satisfy are parked first.
    cparked = _constraint_parked(state, [entries[q.id] for q in ordered], clock)
    if cparked:
        out_ids = {d.job_id for d in cparked}
        ordered = [q for q in ordered if q.id not in out_ids]
    # Fair share between tenants; park the jobs that can never fit the pool or are over their tenant's quota
    # (spiderflow.core.tenancy): they never become the head nor take a backfill slot.
    held: dict[str, int] = {}
    for h in state.holding:
        held[h.tenant] = held.get(h.tenant, 0) + sum(g for _, g in h.gpus)
    capacity = state.topology.total_free_gpus + sum(held.values())
    arranged = arrange([Entry(job_id=q.id, tenant=entries[q.id].spec.tenant, min_gpus=entries[q.id].spec.gpus.min)
                        for q in ordered], held=held, capacity=capacity, quota=options.tenant_quota)
    parked: list[CycleDecision] = cparked
    free_now = state.topology.total_free_gpus
    final = not state.gone and not state.topology_may_change
    for jid, why in arranged.parked.items():
        if jid in arranged.unresolvable:
            parked.append(CycleDecision(job_id=jid, outcome=Outcome.REJECT if final else Outcome.PENDING,
                                        constraint="capacity", reason=why, at=clock, total_free=free_now))
        else:
            parked.append(CycleDecision(job_id=jid, outcome=Outcome.PENDING, constraint="quota", reason=why,
                                        at=clock, total_free=free_now))
    if options.fair_share:
        by_qid = {q.id: q for q in ordered}
        ordered = [by_qid[i] for i in arranged.order]
    elif parked:
        ordered = [q for q in ordered if q.id not in arranged.parked]
    q_elapsed = time.perf_counter() - t0
    if options.advance is Advance.MEASURED:
        clock += q_elapsed
    topo = state.topology
    st = _State(free={c.name: c.free for c in topo.clusters}, total=topo.total_free_gpus, snap=topo,
                holding=list(state.holding),
                waits={e.spec.id: e.wait for e in state.queue if e.wait is not None})
    seq = state.decisions_before
    out: list[CycleDecision] = parked
    res: Reservation | None = None
    head: str | None = None
    tries_behind = 0
    tried = 0
    final_pool = not state.gone and not state.topology_may_change
    # The demand on the pool (Budget.demand_gpus): the GPUs held plus the queued jobs' minimum GPUs; a job
    # placed in this cycle moves from the second term to the first.
    demand = sum(g for h in st.holding for _, g in h.gpus) + sum(entries[q.id].spec.gpus.min for q in ordered)
    outlook = arrivals_outlook(state.arrivals, OUTLOOK_SIZE) if state.arrivals else None
    for qj in ordered:
        e = entries[qj.id]
        jid = qj.id
        if head is not None and (not options.queue.backfill or tries_behind >= options.queue.backfill_depth):
            out.append(CycleDecision(job_id=jid, outcome=Outcome.PENDING, reason=f"queued behind {head}",
                                     constraint="queue", at=clock, total_free=st.total))
            continue
        wait = st.waits.get(jid)
        entry = e if wait is e.wait else replace(e, wait=wait)
        # A constrained job sees only its allowed clusters: their free GPUs, their releases, their view.
        allowed = None if e.spec.constraints.empty else allowed_clusters(st.snap, e.spec.constraints)
        free_v, total_v = (st.free, st.total) if allowed is None else job_free(e.spec, st.snap, st.free)
        if not worth_trying(entry, free_v, total_v, clock, state.version):
            if wait is not None and wait.until > clock + 1e-6:
                d = CycleDecision(job_id=jid, outcome=Outcome.WAIT, reason=wait.reason, wait=wait, at=clock,
                                  total_free=total_v)
            elif total_v < e.spec.gpus.min:
                where = "" if allowed is None else " on the clusters its constraints allow"
                d = CycleDecision(job_id=jid, outcome=Outcome.PENDING, constraint="free_gpus", at=clock,
                                  reason=f"needs at least {e.spec.gpus.min} GPUs{where}, {total_v} free",
                                  total_free=total_v)
            else:
                d = CycleDecision(job_id=jid, outcome=Outcome.PENDING, constraint="unchanged", at=clock,
                                  reason="nothing changed since its last decision", total_free=total_v)
            out.append(d)
        else:
            if head is not None:
                tries_behind += 1
            tried += 1
            seq += 1
            pol = e.policy or policy
            budget = options.budget
            if options.vary_seed:
                budget = replace(budget, seed=options.budget.seed * 1_000_003 + seq)
            if options.wait:
                budget = replace(budget, releases=_releases(st, clock, jid, state.gone, allowed))
            budget = replace(budget, demand_gpus=max(0, demand - e.spec.gpus.min))
            if outlook is not None and getattr(pol, "lookahead", False):
                budget = replace(budget, outlook=outlook)
            total_before = total_v
            c0 = time.process_time()
            w0 = time.perf_counter()
            spec = e.remaining_spec()
            result = decide(pol, constraint_view(st.snap, spec), spec, budget)
            measured = time.perf_counter() - w0
            cpu = time.process_time() - c0
            fed = measured if options.advance is Advance.MEASURED else (
                options.fixed_overhead_s if options.advance is Advance.FIXED else 0.0)
            decided_at = clock
            clock += fed

            base = CycleDecision(job_id=jid, outcome=Outcome.PENDING, tried=True, at=decided_at, start_s=clock,
                                 seconds=measured, cpu_seconds=cpu, fed_s=fed, total_free=total_before, result=result)
            if result.status is PlacementStatus.WAIT and result.wait is not None:
                later = result.wait.plan
                w = WaitState(until=decided_at + result.wait.after_s, gpus=later.gpus,
                              claim=tuple(sorted(later.gpus_by_cluster().items())),
                              run_s=(e.spec.steps - e.steps_done) * later.step_time_s, reason=result.reason)
                st.waits[jid] = w
                out.append(replace(base, outcome=Outcome.WAIT, reason=result.reason, constraint="wait", plan=later,
                                   wait=w))
            elif result.status is PlacementStatus.SUCCESS and result.plan is not None:
                plan = result.plan
                alloc = plan.gpus_by_cluster()
                for c, g in alloc.items():
                    if c not in st.free:
                        raise InvalidPlacementError(f"job {jid}: plan uses unknown cluster {c!r}")
                    if allowed is not None and c not in allowed:
                        raise InvalidPlacementError(f"job {jid}: plan uses cluster {c!r}, which its constraints "
                                                    "exclude")
                    if g > st.free[c]:
                        raise InvalidPlacementError(f"job {jid}: plan takes {g} GPUs on {c} with {st.free[c]} free")
                est_end = clock + e.restart_delay_s + (e.spec.steps - e.steps_done) * plan.step_time_s
                if admits(res, plan.gpus, est_end, st.total):
                    for c, g in alloc.items():
                        st.free[c] -= g
                    st.total -= plan.gpus
                    st.snap = st.snap.with_free({c: st.free[c] for c in alloc})
                    st.holding.append(Holder(job_id=jid, end_s=est_end, gpus=tuple(alloc.items()),
                                             link_gbps=link_gbps(plan, e.spec, plan.step_time_s),
                                             tenant=e.spec.tenant))
                    st.waits.pop(jid, None)
                    demand += plan.gpus - e.spec.gpus.min
                    res = after_admit(res, plan.gpus, est_end)
                    out.append(replace(base, outcome=Outcome.PLACE, reason=result.reason, plan=plan, est_end_s=est_end))
                    continue
                out.append(replace(base, reason="backfill would delay the reserved head job", constraint="backfill",
                                   plan=plan))
            elif result.status is PlacementStatus.UNRESOLVABLE:
                st.waits.pop(jid, None)
                out.append(replace(base, outcome=Outcome.REJECT, constraint=result.constraint,
                                   reason=result.reason or "the policy reports it can never fit"))
                continue
            elif final_pool and not st.holding:
                st.waits.pop(jid, None)
                out.append(replace(base, outcome=Outcome.REJECT, constraint=result.constraint,
                                   reason=result.reason or "does not fit the idle pool"))
                continue
            else:
                out.append(replace(base, reason=result.reason, constraint=result.constraint))
        if head is None:
            head = jid
            running = [RunningJob(id=h.job_id, gpus=sum(g for _, g in h.gpus), est_end_s=h.end_s)
                       for h in st.holding]
            hw = st.waits.get(jid)
            if hw is not None and hw.until > clock:
                res = reserve_at(jid, hw.gpus, hw.until, st.total, running, clock)
            else:
                res = reserve(jid, e.spec.gpus.min, st.total, running, clock)
    return CycleResult(decisions=tuple(out), reservation=res, clock=clock, queue_seconds=q_elapsed,
                       topology=st.snap, tried=tried, waits=dict(st.waits))
