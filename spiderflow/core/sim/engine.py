r"""The discrete-event, multi-tenant simulator: real placement policies and the real queue on a topology.

Events (processed in time order; at equal times: completions, then topology events, then arrivals, then
scheduling cycles; then insertion order):

- **arrival**: the job joins the queue (:mod:`spiderflow.core.queueing`).
- **cycle**: one :func:`spiderflow.core.cycle.run_cycle` (the scheduler service runs the same function) on an
  immutable topology snapshot whose ``free_gpus`` are the GPUs not held by running jobs, with the real
  policy; its decisions are applied in order (starts, waits, give-ups). Each decision's wall time is
  measured with :func:`time.perf_counter` and advances the scheduler's clock: a job placed by the k-th
  decision of a cycle starts after the first k decisions' overhead, and the next cycle cannot start before
  the scheduler is free. With :attr:`SimConfig.releases` (``simulate --wait``, the default) the cycle offers
  every policy to wait for GPUs being released (:mod:`spiderflow.core.cycle`): a waiting job is not asked again
  before the time it waits for (unless a topology event happens or the GPUs of the plan it waits for are
  all free sooner), as the head its reservation is on that plan's GPUs at that time, and the other jobs'
  releases show its claim. A job the policy calls unresolvable is given up (``unresolvable``); so is one
  that does not fit the idle pool when no topology event is left.
- **completion**: the job's GPUs are released.
- **topology events** (:class:`TopologyEvent`): a link's bandwidth/latency changes, a cluster is lost or
  restored. Every running job's step time is re-evaluated with :func:`spiderflow.core.costmodel.evaluate`
  on the new topology; a job on a lost cluster, or slowed by more than ``replan_slowdown``, is stopped
  and re-queued for re-planning: it keeps the progress of its last checkpoint (taken every
  ``checkpoint_interval_s`` of run time), and its next start pays ``restart_delay_s``. A slowed job below
  the threshold continues at the new speed.

GPU accounting: per cluster, GPUs are taken when a decision places a job and given back at its
completion or stop; a plan asking for more than a cluster has free is an error (``SimulationError``),
so no GPU is ever held twice. Run time of a job = ``steps × plan.step_time_s`` (+ restart delay).

Overhead modes (:class:`OverheadMode`): ``measured`` (default) feeds each decision's measured wall
time into the simulated clock, which is realistic but not reproducible: timing noise changes event
order and hence placements. ``fixed`` feeds a constant ``fixed_overhead_s`` per decision instead, so
two runs with the same inputs produce identical results (the measured times are still reported).

Metrics (:func:`spiderflow.core.sim.metrics.summarize`): JCT = completion − arrival (completed jobs),
makespan = last completion − first arrival, throughput = tokens of completed jobs / makespan,
utilisation = GPU-seconds held / (pool GPUs × makespan), cost = electricity of held GPUs.
Pure: no I/O; the only clocks read are the decision timers (wall and process CPU time).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum, StrEnum
from typing import Any

import structlog

from spiderflow.core.cycle import (
    OUTLOOK_SIZE,
    Advance,
    CycleInput,
    CycleOptions,
    CycleResult,
    Holder,
    InvalidPlacementError,
    Outcome,
    QueueEntry,
    WaitState,
    job_free,
    link_gbps,
    network_share,
    run_cycle,
    worth_trying,
)
from spiderflow.core.domain import JobSpec, Link, Plan, Topology
from spiderflow.core.errors import SpiderFlowError, ValidationError
from spiderflow.core.placement.base import Budget, Objective, PlacementPolicy, PlacementStatus
from spiderflow.core.queueing import QueuedJob, QueuePolicy, queued_job
from spiderflow.core.tpa.timeline import evaluate_on_timeline

__all__ = [
    "EventKind",
    "JobRecord",
    "OverheadMode",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "TopologyEvent",
    "check_events",
    "events_from_dict",
    "simulate",
]

log = structlog.get_logger("spiderflow.core.sim")


class SimulationError(SpiderFlowError):
    """The simulation found an inconsistency (e.g. a policy returned a plan exceeding free GPUs)."""


class OverheadMode(StrEnum):
    MEASURED = "measured"
    FIXED = "fixed"


class EventKind(StrEnum):
    LINK_CHANGE = "link_change"
    CLUSTER_LOSS = "cluster_loss"
    CLUSTER_RESTORE = "cluster_restore"


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyEvent:
    """At ``t_s``: ``link_change`` sets link ``a``–``b``'s bandwidth and/or latency (a link absent from the
    topology is added); ``cluster_loss`` removes ``cluster``'s GPUs; ``cluster_restore`` gives them back."""

    t_s: float
    kind: EventKind
    a: str = ""
    b: str = ""
    bandwidth_gbps: float | None = None
    latency_ms: float | None = None
    cluster: str = ""


def events_from_dict(raw: Any, topology: Topology | None = None) -> list[TopologyEvent]:
    """Parse ``{"events": [{"t_s", "kind", ...}]}``, sorted by time; :class:`ValidationError` naming
    ``events[i].field``. With ``topology``, each event is also checked against it (:func:`check_events`)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("events"), list):
        raise ValidationError("events", "must be an object with an 'events' list", raw)
    unknown = set(raw) - {"events"}
    if unknown:
        raise ValidationError(sorted(unknown)[0], "unknown field")
    out: list[TopologyEvent] = []
    allowed = {"t_s", "kind", "a", "b", "bandwidth_gbps", "latency_ms", "cluster"}
    for i, e in enumerate(raw["events"]):
        where = f"events[{i}]"
        if not isinstance(e, dict):
            raise ValidationError(where, "must be an object", e)
        for k in e:
            if k not in allowed:
                raise ValidationError(f"{where}.{k}", "unknown field", e[k])
        t = e.get("t_s")
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValidationError(f"{where}.t_s", "must be a number ≥ 0", t)
        try:
            kind = EventKind(str(e.get("kind")))
        except ValueError:
            raise ValidationError(f"{where}.kind", f"must be one of {', '.join(EventKind)}", e.get("kind")) from None
        for k in ("bandwidth_gbps", "latency_ms"):
            v = e.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0
                                  or (k == "bandwidth_gbps" and v == 0)):
                raise ValidationError(f"{where}.{k}", "must be a positive number", v)
        if kind is EventKind.LINK_CHANGE and (not e.get("a") or not e.get("b")):
            raise ValidationError(f"{where}.a", "link_change needs 'a' and 'b'", e.get("a"))
        if kind is not EventKind.LINK_CHANGE and not e.get("cluster"):
            raise ValidationError(f"{where}.cluster", f"{kind} needs 'cluster'", e.get("cluster"))
        if kind is EventKind.LINK_CHANGE and e.get("bandwidth_gbps") is None and e.get("latency_ms") is None:
            raise ValidationError(where, "link_change needs bandwidth_gbps and/or latency_ms (it changes nothing)")
        out.append(TopologyEvent(
            t_s=float(t), kind=kind, a=str(e.get("a", "")), b=str(e.get("b", "")),
            bandwidth_gbps=None if e.get("bandwidth_gbps") is None else float(e["bandwidth_gbps"]),
            latency_ms=None if e.get("latency_ms") is None else float(e["latency_ms"]),
            cluster=str(e.get("cluster", "")),
        ))
    if topology is not None:
        check_events(topology, out)
    return sorted(out, key=lambda ev: ev.t_s)


def check_events(topo: Topology, events: Sequence[TopologyEvent]) -> None:
    """Every event names clusters of ``topo`` (``a`` ≠ ``b``), and a ``link_change`` between clusters
    with no link yet (none in ``topo`` and none added by an earlier event) gives the new link's bandwidth:
    a :class:`ValidationError` naming ``events[i].field`` (``i`` in the given order) before any simulation,
    not when the event comes. Events are taken in time order, as the simulation applies them."""
    names = set(topo.names)
    linked = {frozenset((link.a, link.b)) for link in topo.links}
    for i, ev in sorted(enumerate(events), key=lambda item: item[1].t_s):
        where = f"events[{i}]"
        for k in ("a", "b") if ev.kind is EventKind.LINK_CHANGE else ("cluster",):
            if getattr(ev, k) not in names:
                raise ValidationError(f"{where}.{k}", "is not a cluster of the topology", getattr(ev, k))
        if ev.kind is not EventKind.LINK_CHANGE:
            continue
        if ev.a == ev.b:
            raise ValidationError(f"{where}.b", "must differ from 'a'", ev.b)
        if frozenset((ev.a, ev.b)) not in linked and ev.bandwidth_gbps is None:
            raise ValidationError(f"{where}.bandwidth_gbps", f"{ev.a}–{ev.b} has no link; a new link needs a bandwidth")
        linked.add(frozenset((ev.a, ev.b)))


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One simulation run. ``time_limit_s`` and ``objective`` go to the policy's :class:`Budget`; with
    ``releases`` the cycle offers waiting for GPUs being released to every policy (the running jobs' GPUs
    at their estimated ends, as the scheduler knows them: :mod:`spiderflow.core.cycle`)."""

    objective: Objective = Objective.JCT
    seed: int = 0
    time_limit_s: float | None = None
    overhead: OverheadMode = OverheadMode.MEASURED
    fixed_overhead_s: float = 0.01
    queue: QueuePolicy = field(default_factory=QueuePolicy)
    checkpoint_interval_s: float = 1800.0
    restart_delay_s: float = 120.0
    replan_slowdown: float = 1.10
    releases: bool = True


@dataclass(slots=True, kw_only=True)
class JobRecord:
    """Per-job outcome. ``status``: ``completed``, ``unresolvable`` (can never fit), ``unschedulable``
    (still waiting when nothing could change any more)."""

    id: str
    arrival_s: float
    status: str = "pending"
    reason: str = ""
    first_start_s: float | None = None
    end_s: float | None = None
    gpus: int = 0
    chain: tuple[str, ...] = ()
    step_time_s: float = 0.0
    plan_tokens_per_s: float = 0.0
    restarts: int = 0
    decisions: int = 0
    overhead_s: float = 0.0
    steps_lost: float = 0.0
    cost_usd: float = 0.0
    gpu_seconds: float = 0.0
    tokens: float = 0.0

    @property
    def jct_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "status": self.status, "reason": self.reason, "arrival_s": self.arrival_s,
            "first_start_s": self.first_start_s, "end_s": self.end_s, "jct_s": self.jct_s, "gpus": self.gpus,
            "chain": list(self.chain), "step_time_s": self.step_time_s,
            "plan_tokens_per_s": self.plan_tokens_per_s, "restarts": self.restarts,
            "decisions": self.decisions, "overhead_s": self.overhead_s, "steps_lost": self.steps_lost,
            "cost_usd": self.cost_usd, "tokens": self.tokens,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """Everything a run produced. ``decision_overheads_s``: measured wall time of every policy call
    (``decision_cpu_s``: CPU time of the process during it, all threads, e.g. a solver's workers);
    ``sim_overhead_s``: the scheduler time fed into the simulated clock (differs in ``fixed`` mode)."""

    policy: str
    records: tuple[JobRecord, ...]
    decision_overheads_s: tuple[float, ...]
    sim_overhead_s: float
    queue_overhead_s: float
    pool_gpus: int
    first_arrival_s: float
    last_end_s: float
    max_gpus_in_use: dict[str, int]
    violations: tuple[str, ...] = ()
    decision_cpu_s: tuple[float, ...] = ()


# ----------------------------------------------------------------------------------------------------------
# internal state


class _Ev(IntEnum):
    COMPLETE = 0
    TOPOLOGY = 1
    ARRIVAL = 2
    CYCLE = 3


@dataclass(slots=True)
class _Job:
    spec: JobSpec
    record: JobRecord
    steps_done: float = 0.0            # saved progress (checkpointed) before the current run
    enqueued_s: float = 0.0
    pending_delay_s: float = 0.0       # restart delay to pay at the next start
    network_share: float | None = None
    failed_at: tuple[int, int] | None = None  # (state version, free GPUs) of the last failed decision
    defer_until: float = 0.0                  # the policy chose to wait for releases until then
    defer_gpus: int = 0
    defer_claim: tuple[tuple[str, int], ...] = ()  # the GPUs of the plan it waits for
    defer_run_s: float = 0.0                  # and that plan's estimated run time
    # current run
    plan: Plan | None = None
    alloc: dict[str, int] = field(default_factory=dict)
    held_since: float = 0.0
    run_start: float = 0.0             # first step begins (after restart delay)
    seg_start: float = 0.0             # current constant-speed segment
    seg_steps: float = 0.0             # progress at seg_start (within this run, from steps_done)
    epoch: int = 0
    usd_per_s: float = 0.0


def _usd_per_s(plan: Plan, topo: Topology) -> float:
    rate = 0.0
    for st in plan.stages:
        c = topo.cluster(st.cluster)
        rate += st.gpus * c.power_w / 1000.0 / 3600.0 * c.electricity_usd_per_kwh
    return rate


class _Sim:
    def __init__(self, topo: Topology, jobs: Sequence[JobSpec], policy: PlacementPolicy, config: SimConfig,
                 events: Sequence[TopologyEvent], progress: Callable[[int, int], None] | None,
                 on_cycle: Callable[[CycleResult], None] | None = None) -> None:
        self.on_cycle = on_cycle
        self.cfg = config
        self.policy = policy
        self.options = CycleOptions(
            queue=config.queue, budget=Budget(time_limit_s=config.time_limit_s, seed=config.seed,
                                              objective=config.objective),
            vary_seed=True, wait=config.releases, fixed_overhead_s=config.fixed_overhead_s,
            advance=Advance.MEASURED if config.overhead is OverheadMode.MEASURED else Advance.FIXED)
        self.base = topo
        self.topo = topo
        self.capacity: dict[str, int] = {c.name: c.free for c in topo.clusters}
        self.lost: set[str] = set()
        self.used: dict[str, int] = dict.fromkeys(self.capacity, 0)
        self.max_used: dict[str, int] = dict.fromkeys(self.capacity, 0)
        self.jobs: dict[str, _Job] = {}
        for j in jobs:
            if j.id in self.jobs:
                raise ValidationError("jobs.id", "duplicate job id", j.id)
            self.jobs[j.id] = _Job(spec=j, record=JobRecord(id=j.id, arrival_s=j.arrival_s))
        self.queue: dict[str, None] = {}
        self.arrivals: deque[tuple[float, JobSpec]] = deque(maxlen=OUTLOOK_SIZE)  # for a policy that looks ahead
        self.running: dict[str, None] = {}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.counter = 0
        self.sched_free_s = 0.0
        self.cycle_pending = False
        self.version = 0
        self.snapshot: Topology | None = None
        self.free_cache: dict[str, int] | None = None
        self.snap_base: Topology | None = None
        self.qcache: dict[str, tuple[tuple[float, int, float | None], QueuedJob]] = {}
        self.decision_times: list[float] = []
        self.decision_cpu: list[float] = []
        self.sim_overhead = 0.0
        self.queue_overhead = 0.0
        self.decision_seq = 0
        self.progress = progress
        self.done = 0
        self.violations: list[str] = []
        self.pending_restores = sum(1 for e in events if e.kind is EventKind.CLUSTER_RESTORE)
        self.pending_topology = len(events)
        for j in jobs:
            self._push(j.arrival_s, _Ev.ARRIVAL, j.id)
        for e in events:
            self._push(e.t_s, _Ev.TOPOLOGY, e)

    # -- event plumbing -------------------------------------------------------------------------------
    def _push(self, t: float, kind: _Ev, payload: Any) -> None:
        self.counter += 1
        heapq.heappush(self.heap, (t, int(kind), self.counter, payload))

    def _request_cycle(self, now: float) -> None:
        if not self.cycle_pending and self.queue:
            self.cycle_pending = True
            self._push(max(now, self.sched_free_s), _Ev.CYCLE, None)

    def run(self) -> None:
        while self.heap:
            t, kind, _, payload = heapq.heappop(self.heap)
            if kind == _Ev.COMPLETE:
                job_id, epoch = payload
                j = self.jobs[job_id]
                if j.epoch == epoch and job_id in self.running:
                    self._complete(j, t)
                    self._request_cycle(t)
            elif kind == _Ev.TOPOLOGY:
                self.pending_topology -= 1
                self._topology_event(payload, t)
                self._request_cycle(t)
            elif kind == _Ev.ARRIVAL:
                j = self.jobs[payload]
                j.enqueued_s = t
                self.queue[payload] = None
                self.arrivals.append((t, j.spec))
                self._request_cycle(t)
            else:
                self.cycle_pending = False
                self._cycle(t)
        for jid in list(self.queue):
            j = self.jobs[jid]
            j.record.status = "unschedulable"
            j.record.reason = j.record.reason or "still queued when the simulation ended"
            self._tick()

    def _tick(self) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, len(self.jobs))

    # -- GPU accounting -------------------------------------------------------------------------------
    def _free(self) -> dict[str, int]:
        if self.free_cache is None:
            self.free_cache = {c: (0 if c in self.lost else self.capacity[c] - self.used[c]) for c in self.capacity}
        return self.free_cache

    def _changed(self) -> None:
        self.snapshot = None
        self.free_cache = None

    def _snapshot(self) -> Topology:
        """The topology the next decision sees; only clusters whose free GPUs changed are rebuilt."""
        if self.snapshot is None:
            free = self._free()
            base = self.snap_base
            if base is None:
                self.snapshot = self.topo.with_free(free)
            else:
                diff = {c: f for c, f in free.items() if base.clusters[base.index[c]].free != f}
                self.snapshot = base.with_free(diff) if diff else base
            self.snap_base = self.snapshot
        return self.snapshot

    def _check_fits(self, j: _Job, alloc: dict[str, int]) -> None:
        free = self._free()
        for c, g in alloc.items():
            if c not in free:
                raise SimulationError(f"job {j.spec.id}: plan uses unknown cluster {c!r}")
            if g > free[c]:
                raise SimulationError(f"job {j.spec.id}: plan takes {g} GPUs on {c} with {free[c]} free")

    def _take(self, j: _Job, alloc: dict[str, int], now: float) -> None:
        self._check_fits(j, alloc)
        for c, g in alloc.items():
            self.used[c] += g
            self.max_used[c] = max(self.max_used[c], self.used[c])
            if self.used[c] > self.capacity[c]:
                self.violations.append(f"t={now}: {c} over-allocated ({self.used[c]} > {self.capacity[c]})")
        j.alloc = dict(alloc)
        self._changed()

    def _release(self, j: _Job, now: float) -> None:
        for c, g in j.alloc.items():
            self.used[c] -= g
            if self.used[c] < 0:
                self.violations.append(f"t={now}: {c} released below zero")
        held = sum(j.alloc.values())
        j.record.gpu_seconds += held * (now - j.held_since)
        j.record.cost_usd += j.usd_per_s * (now - j.held_since)
        j.alloc = {}
        self.version += 1
        self._changed()

    # -- job progress ---------------------------------------------------------------------------------
    def _steps_at(self, j: _Job, t: float) -> float:
        """Progress within the current run at time ``t`` (steps since ``run_start``)."""
        assert j.plan is not None
        if t <= j.seg_start:
            return j.seg_steps
        return j.seg_steps + (t - j.seg_start) / j.plan.step_time_s

    def _schedule_completion(self, j: _Job) -> None:
        assert j.plan is not None
        left = j.spec.steps - j.steps_done - j.seg_steps
        end = j.seg_start + max(0.0, left) * j.plan.step_time_s
        j.epoch += 1
        self._push(end, _Ev.COMPLETE, (j.spec.id, j.epoch))

    def _start(self, j: _Job, plan: Plan, now: float) -> None:
        alloc = plan.gpus_by_cluster()
        if not j.spec.gpus.min <= plan.gpus <= j.spec.gpus.max:
            self.violations.append(f"job {j.spec.id}: plan uses {plan.gpus} GPUs outside "
                                   f"[{j.spec.gpus.min}, {j.spec.gpus.max}]")
        if not (plan.step_time_s > 0 and math.isfinite(plan.step_time_s)):
            raise SimulationError(f"job {j.spec.id}: plan has no finite step time ({plan.step_time_s})")
        self._take(j, alloc, now)
        j.plan = plan
        j.held_since = now
        j.run_start = now + j.pending_delay_s
        j.pending_delay_s = 0.0
        j.seg_start = j.run_start
        j.seg_steps = 0.0
        j.usd_per_s = _usd_per_s(plan, self.topo)
        j.network_share = network_share(plan, self.topo, j.spec)
        rec = j.record
        if rec.first_start_s is None:
            rec.first_start_s = now
        rec.gpus = plan.gpus
        rec.chain = plan.chain
        rec.step_time_s = plan.step_time_s
        rec.plan_tokens_per_s = j.spec.tokens_per_step / plan.step_time_s
        self.queue.pop(j.spec.id, None)
        self.running[j.spec.id] = None
        self._schedule_completion(j)

    def _complete(self, j: _Job, now: float) -> None:
        self._release(j, now)
        self.running.pop(j.spec.id, None)
        rec = j.record
        rec.status = "completed"
        rec.end_s = now
        rec.tokens = float(j.spec.steps * j.spec.tokens_per_step)
        j.steps_done = float(j.spec.steps)
        j.plan = None
        self._tick()

    def _stop(self, j: _Job, now: float, reason: str) -> None:
        """Stop a running job for re-planning: keep the last checkpoint's progress, re-queue it."""
        assert j.plan is not None
        ran = max(0.0, now - j.run_start)
        ckpt_t = j.run_start + math.floor(ran / self.cfg.checkpoint_interval_s) * self.cfg.checkpoint_interval_s
        now_steps = min(self._steps_at(j, now), j.spec.steps - j.steps_done)
        saved = min(math.floor(self._steps_at(j, ckpt_t)) if ckpt_t > j.run_start else 0, math.floor(now_steps))
        self._release(j, now)
        self.running.pop(j.spec.id, None)
        j.record.steps_lost += max(0.0, now_steps - saved)
        j.steps_done += saved
        j.record.restarts += 1
        j.record.reason = reason
        j.pending_delay_s = self.cfg.restart_delay_s
        j.plan = None
        j.epoch += 1
        j.enqueued_s = now
        j.failed_at = None
        self.queue[j.spec.id] = None
        log.info("sim.replan", job=j.spec.id, t=now, reason=reason, steps_saved=j.steps_done)

    # -- topology events ------------------------------------------------------------------------------
    def _topology_event(self, ev: TopologyEvent, now: float) -> None:
        if ev.kind is EventKind.LINK_CHANGE:
            links = list(self.topo.links)
            for i, link in enumerate(links):
                if {link.a, link.b} == {ev.a, ev.b}:
                    links[i] = replace(
                        link,
                        bandwidth_gbps=link.bandwidth_gbps if ev.bandwidth_gbps is None else ev.bandwidth_gbps,
                        latency_ms=link.latency_ms if ev.latency_ms is None else ev.latency_ms,
                    )
                    break
            else:
                if ev.bandwidth_gbps is None:
                    raise ValidationError("events.bandwidth_gbps", "a new link needs a bandwidth", None)
                links.append(Link(a=ev.a, b=ev.b, bandwidth_gbps=ev.bandwidth_gbps, latency_ms=ev.latency_ms or 0.0))
            self.topo = Topology(clusters=self.topo.clusters, links=tuple(links), revision=self.topo.revision + 1)
            self.topo.bandwidth_matrix  # noqa: B018 - recompute paths once, outside the timed decisions
            self.snap_base = None
        elif ev.kind is EventKind.CLUSTER_LOSS:
            self.topo.cluster(ev.cluster)
            self.lost.add(ev.cluster)
        else:
            self.topo.cluster(ev.cluster)
            self.lost.discard(ev.cluster)
            self.pending_restores -= 1
        self.version += 1
        self._changed()
        for jid in self.queue:
            self.jobs[jid].defer_until = 0.0
        for jid in list(self.running):
            j = self.jobs[jid]
            assert j.plan is not None
            if any(c in self.lost for c in j.alloc):
                self._stop(j, now, f"cluster lost at t={now:g}")
                continue
            if ev.kind is not EventKind.LINK_CHANGE:
                continue
            new = evaluate_on_timeline(j.plan, self.topo, j.spec)
            if math.isclose(new.step_time_s, j.plan.step_time_s, rel_tol=1e-12):
                continue
            if new.step_time_s > j.plan.step_time_s * self.cfg.replan_slowdown:
                self._stop(j, now, f"link {ev.a}-{ev.b} changed at t={now:g}: step time "
                                   f"{j.plan.step_time_s:.3g}s -> {new.step_time_s:.3g}s")
                continue
            # Continue at the new speed from here.
            j.seg_steps = self._steps_at(j, max(now, j.run_start))
            j.seg_start = max(now, j.run_start)
            j.plan = new
            j.record.step_time_s = new.step_time_s
            j.record.plan_tokens_per_s = j.spec.tokens_per_step / new.step_time_s
            self._schedule_completion(j)

    # -- scheduling cycle -----------------------------------------------------------------------------
    def _entry(self, j: _Job) -> QueueEntry:
        wait = (WaitState(until=j.defer_until, gpus=j.defer_gpus, claim=j.defer_claim, run_s=j.defer_run_s)
                if j.defer_until > 0.0 or j.defer_claim else None)
        return QueueEntry(spec=j.spec, enqueued_s=j.enqueued_s, steps_done=j.steps_done,
                          network_share=j.network_share, restart_delay_s=j.pending_delay_s, wait=wait,
                          failed_at=j.failed_at)

    def _queued(self, e: QueueEntry) -> QueuedJob:
        key = (e.enqueued_s, e.steps_left, e.network_share)
        hit = self.qcache.get(e.spec.id)
        if hit is None or hit[0] != key:
            hit = (key, queued_job(e.spec, e.enqueued_s, steps_left=e.steps_left, network_share=e.network_share))
            self.qcache[e.spec.id] = hit
        return hit[1]

    def _holders(self) -> list[Holder]:
        out: list[Holder] = []
        for jid in self.running:
            j = self.jobs[jid]
            assert j.plan is not None
            out.append(Holder(job_id=jid, end_s=self._est_end(j), gpus=tuple(j.alloc.items()), tenant=j.spec.tenant,
                              link_gbps=link_gbps(j.plan, j.spec, j.plan.step_time_s)))
        return out

    def _drop(self, j: _Job, status: str, reason: str) -> None:
        self.queue.pop(j.spec.id, None)
        j.record.status = status
        j.record.reason = reason
        self._tick()

    def _cycle(self, now: float) -> None:
        """One :func:`spiderflow.core.cycle.run_cycle` on the current state, its result applied in order."""
        if not self.queue:
            return
        clock = max(now, self.sched_free_s)
        state = CycleInput(
            topology=self._snapshot(), queue=[self._entry(self.jobs[jid]) for jid in self.queue],
            holding=self._holders(), now=clock, version=self.version, gone=frozenset(self.lost),
            topology_may_change=self.pending_topology > 0, decisions_before=self.decision_seq,
            arrivals=tuple(self.arrivals),
        )
        try:
            result = run_cycle(state, self.policy, self.options, queued=self._queued)
        except InvalidPlacementError as e:
            raise SimulationError(str(e)) from None
        self.queue_overhead += result.queue_seconds
        if self.on_cycle is not None:
            self.on_cycle(result)
        for d in result.decisions:
            if not d.tried:
                if d.constraint == "constraints":  # parked: its resource constraints cannot be satisfied
                    if d.outcome is Outcome.REJECT:
                        self._drop(self.jobs[d.job_id], "unresolvable", d.reason)
                    else:
                        self.jobs[d.job_id].record.reason = d.reason
                continue
            j = self.jobs[d.job_id]
            self.decision_seq += 1
            self.decision_cpu.append(d.cpu_seconds)
            self.decision_times.append(d.seconds)
            self.sim_overhead += d.fed_s
            j.record.decisions += 1
            j.record.overhead_s += d.seconds
            if d.outcome is Outcome.WAIT and d.wait is not None:
                j.defer_until, j.defer_gpus = d.wait.until, d.wait.gpus
                j.defer_claim, j.defer_run_s = d.wait.claim, d.wait.run_s
            if d.outcome is Outcome.PLACE and d.plan is not None:
                self._start(j, d.plan, d.start_s)
            elif d.outcome is Outcome.REJECT:
                status = "unresolvable" if d.result is not None and \
                    d.result.status is PlacementStatus.UNRESOLVABLE else "unschedulable"
                self._drop(j, status, d.reason)
            else:
                j.failed_at = (self.version, d.total_free)
                j.record.reason = d.reason
        self.snapshot = self.snap_base = result.topology
        self.sched_free_s = clock = result.clock
        # A job that could not be tried because nothing changed waits for the next event; if nothing is
        # running and no event can change the pool, whatever is left can never start.
        if self.queue and not self.running and not any(k in (_Ev.COMPLETE, _Ev.TOPOLOGY, _Ev.ARRIVAL)
                                                        for _, k, _, _ in self.heap):
            for jid in self.queue:  # nothing left to wait for
                self.jobs[jid].defer_until = 0.0
            free = self._free()
            snap = self._snapshot()
            if any(worth_trying(self._entry(self.jobs[jid]), *job_free(self.jobs[jid].spec, snap, free), clock,
                                self.version) for jid in self.queue):
                self._request_cycle(clock)
                return
            for jid in list(self.queue):
                j = self.jobs[jid]
                self._drop(j, "unschedulable", j.record.reason or "needs more GPUs than the pool has")

    def _est_end(self, j: _Job) -> float:
        assert j.plan is not None
        left = j.spec.steps - j.steps_done - j.seg_steps
        return j.seg_start + max(0.0, left) * j.plan.step_time_s


def simulate(topo: Topology, jobs: Sequence[JobSpec], policy: PlacementPolicy | str, config: SimConfig | None = None,
             *, events: Iterable[TopologyEvent] = (), progress: Callable[[int, int], None] | None = None,
             on_cycle: Callable[[CycleResult], None] | None = None) -> SimResult:
    """Run one policy over a trace. ``policy`` is an instance or a registered name.

    ``progress(done, total)`` is called whenever a job completes or is given up; ``on_cycle(result)`` with
    every scheduling cycle's :class:`~spiderflow.core.cycle.CycleResult` before it is applied. Raises
    :class:`SimulationError` if the policy returns a plan that exceeds the GPUs free in a cluster.
    """
    cfg = config or SimConfig()
    if isinstance(policy, str):
        from spiderflow.core.placement import get_policy

        policy = get_policy(policy)
    evs = list(events)
    check_events(topo, evs)
    topo.bandwidth_matrix  # noqa: B018 - compute the path matrices once, outside every timed decision
    sim = _Sim(topo, jobs, policy, cfg, evs, progress, on_cycle)
    sim.run()
    records = tuple(sim.jobs[j.id].record for j in jobs)
    ends = [r.end_s for r in records if r.end_s is not None]
    return SimResult(
        policy=getattr(policy, "name", type(policy).__name__),
        records=records,
        decision_overheads_s=tuple(sim.decision_times),
        decision_cpu_s=tuple(sim.decision_cpu),
        sim_overhead_s=sim.sim_overhead,
        queue_overhead_s=sim.queue_overhead,
        pool_gpus=sum(sim.capacity.values()),
        first_arrival_s=min((j.arrival_s for j in jobs), default=0.0),
        last_end_s=max(ends, default=0.0),
        max_gpus_in_use=dict(sim.max_used),
        violations=tuple(sim.violations),
    )
