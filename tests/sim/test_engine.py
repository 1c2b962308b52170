"""The discrete-event engine: a hand-checked scenario, conservation, determinism, topology events."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Plan, Stage, Topology, Wait
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus
from spiderflow.core.sim.engine import (
    EventKind,
    OverheadMode,
    SimConfig,
    SimResult,
    SimulationError,
    TopologyEvent,
    events_from_dict,
    simulate,
)
from spiderflow.core.sim.metrics import summarize
from spiderflow.core.sim.tracegen import generate_trace
from spiderflow.core.topogen import generate_topology

from .helpers import GreedyPolicy

_DEFAULT_BUDGET = Budget()
FIXED = SimConfig(overhead=OverheadMode.FIXED, fixed_overhead_s=0.5)



def given_step(step: float) -> dict[str, float]:
    """A hand-made plan's step as its timeline step: the scheduling cycle re-scores on the exact timeline only
    plans that do not carry one (TPA's do), so these fakes keep the step they are given."""
    return {"timeline_step_s": step, "closed_form_step_s": step}


class FixedStepPolicy:
    """All of a job's max GPUs on the first cluster with enough free, at a fixed step time."""

    name = "fixed-step"

    def __init__(self, step_time_s: float = 2.0) -> None:
        self.step = step_time_s

    def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
        for c in topo.clusters:
            if c.free >= job.gpus.max:
                plan = Plan(stages=(Stage(cluster=c.name, first_layer=0, last_layer=job.model.layers - 1,
                                          tp=1, dp=job.gpus.max),), micro_batches=1, step_time_s=self.step,
                            extras=given_step(self.step), usd_per_step=0.0)
                return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=plan)
        return PlacementResult(status=PlacementStatus.UNSCHEDULABLE, policy=self.name, reason="no room")


def one_cluster(n: int = 2, gpus: int = 8) -> Topology:
    clusters = tuple(Cluster(name=f"c{i}", gpu="A100-80G", nodes=1, gpus_per_node=gpus,
                             electricity_usd_per_kwh=0.1) for i in range(n))
    links = tuple(Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=1.0, latency_ms=10.0) for i in range(n - 1))
    return Topology(clusters=clusters, links=links)


def job(id: str, steps: int, *, gpus: int = 8, arrival: float = 0.0) -> JobSpec:
    return JobSpec(id=id, model=model_preset("gpt3-1.3b"), global_batch=8, steps=steps,
                   gpus=GpuRange(min=gpus, max=gpus), arrival_s=arrival)


def test_two_jobs_by_hand() -> None:
    """One 8-GPU cluster, two 8-GPU jobs at t=0, 2 s per step, 0.5 s per decision.

    The shorter job A (10 steps) goes first: decided at 0 → starts 0.5, ends 0.5 + 20 = 20.5.
    B (20 steps) cannot fit until then; it is decided at 20.5 → starts 21.0, ends 21 + 40 = 61.
    """
    topo = one_cluster(1)
    jobs = [job("B", 20), job("A", 10)]
    res = simulate(topo, jobs, FixedStepPolicy(2.0), FIXED)
    rec = {r.id: r for r in res.records}
    assert rec["A"].first_start_s == pytest.approx(0.5) and rec["A"].end_s == pytest.approx(20.5)
    assert rec["B"].first_start_s == pytest.approx(21.0) and rec["B"].end_s == pytest.approx(61.0)
    s = summarize(res)
    assert s["completed"] == 2 and s["decisions"] == 2
    assert s["mean_jct_s"] == pytest.approx((20.5 + 61.0) / 2)
    assert s["makespan_s"] == pytest.approx(61.0)
    tokens = 30 * jobs[0].tokens_per_step
    assert s["throughput_tokens_per_s"] == pytest.approx(tokens / 61.0)
    # GPUs held: A 8 × 20 s, B 8 × 40 s, pool of 8 over 61 s.
    assert s["gpu_utilization"] == pytest.approx(8 * 60 / (8 * 61.0))
    # Electricity: 8 A100 × 400 W × 60 s at $0.1/kWh.
    assert s["cost_usd"] == pytest.approx(8 * 0.4 * 60 / 3600 * 0.1)
    assert s["sim_overhead_s"] == pytest.approx(1.0)
    assert s["violations"] == []


def test_measured_overhead_delays_the_job() -> None:
    """In measured mode the decision's real wall time is what moves the start."""

    class SlowPolicy(FixedStepPolicy):
        def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
            import time

            time.sleep(0.05)
            return super().place(topo, job, budget)

    res = simulate(one_cluster(1), [job("A", 10)], SlowPolicy(), SimConfig(overhead=OverheadMode.MEASURED))
    (r,) = res.records
    assert r.first_start_s is not None and r.first_start_s >= 0.05
    assert r.first_start_s == pytest.approx(res.decision_overheads_s[0] + res.queue_overhead_s, abs=1e-9)


def test_conservation_and_completion_on_a_random_trace() -> None:
    topo = generate_topology(8, 2, "geo")
    jobs = generate_trace(120, 5, 1.5, topo)
    events = [
        TopologyEvent(t_s=jobs[30].arrival_s, kind=EventKind.LINK_CHANGE, a=topo.links[0].a, b=topo.links[0].b,
                      bandwidth_gbps=0.05),
        TopologyEvent(t_s=jobs[40].arrival_s, kind=EventKind.CLUSTER_LOSS, cluster=topo.names[0]),
        TopologyEvent(t_s=jobs[80].arrival_s, kind=EventKind.CLUSTER_RESTORE, cluster=topo.names[0]),
    ]
    policy = GreedyPolicy()
    # Without waiting: every policy call is a decision (with it, the cycle prices later starts with more calls).
    res = simulate(topo, jobs, policy, replace(FIXED, releases=False), events=events)
    assert res.violations == ()
    cap = {c.name: c.free for c in topo.clusters}
    assert all(res.max_gpus_in_use[c] <= cap[c] for c in cap)
    assert len(res.records) == len(jobs)
    assert {r.status for r in res.records} <= {"completed", "unresolvable", "unschedulable"}
    for r in res.records:
        if r.status == "completed":
            assert r.end_s is not None and r.first_start_s is not None
            assert r.arrival_s <= r.first_start_s < r.end_s
        else:
            assert r.reason
    s = summarize(res)
    assert s["completed"] >= 100
    assert s["decisions"] == policy.calls == len(res.decision_overheads_s)
    assert 0.0 < s["gpu_utilization"] <= 1.0


def test_gpu_use_never_exceeds_capacity_at_any_event_time() -> None:
    """Replay every record's hold interval and check the per-cluster sum at every start/end instant."""
    topo = generate_topology(8, 9, "geo")
    jobs = generate_trace(80, 9, 2.0, topo)
    res = simulate(topo, jobs, GreedyPolicy(), FIXED)
    done = [r for r in res.records if r.status == "completed" and r.restarts == 0]
    assert len(done) > 50
    spans = [(r.first_start_s, r.end_s, r.gpus) for r in done if r.first_start_s is not None and r.end_s is not None]
    assert len(spans) == len(done)
    instants = sorted({s for s, _, _ in spans} | {e for _, e, _ in spans})
    total = sum(c.free for c in topo.clusters)
    for t in instants:
        in_use = sum(g for s, e, g in spans if s <= t < e)
        assert in_use <= total


def test_determinism_with_fixed_overhead() -> None:
    topo = generate_topology(8, 4, "geo")
    jobs = generate_trace(60, 4, 1.5, topo)
    events = [TopologyEvent(t_s=jobs[20].arrival_s, kind=EventKind.CLUSTER_LOSS, cluster=topo.names[1])]
    runs = [simulate(topo, jobs, GreedyPolicy(), FIXED, events=events) for _ in range(2)]

    def strip(res: object) -> list[dict[str, object]]:
        out = []
        for r in res.records:  # type: ignore[attr-defined]
            d = r.to_dict()
            d.pop("overhead_s")
            out.append(d)
        return out

    assert strip(runs[0]) == strip(runs[1])
    a, b = (summarize(r) for r in runs)
    for key in ("mean_jct_s", "p95_jct_s", "makespan_s", "throughput_tokens_per_s", "cost_usd", "decisions",
                "completed", "gpu_utilization", "sim_overhead_s"):
        assert a[key] == b[key], key


def test_cluster_loss_restarts_from_the_last_checkpoint() -> None:
    """A 10,000-step job at 1 s/step on c0; c0 is lost at t = 4000.

    Run started at 0.5 (one 0.5 s decision); checkpoints every 1800 s of run time → the last one at
    0.5 + 3600, so 3600 steps are kept and 399.5 lost. Re-placed on c1 at 4000 + 0.5, it pays the
    120 s restart delay and runs the remaining 6400 steps: ends at 4000.5 + 120 + 6400.
    """
    topo = one_cluster(2)
    ev = [TopologyEvent(t_s=4000.0, kind=EventKind.CLUSTER_LOSS, cluster="c0")]
    res = simulate(topo, [job("A", 10_000)], FixedStepPolicy(1.0), FIXED, events=ev)
    (r,) = res.records
    assert r.status == "completed" and r.restarts == 1
    assert r.steps_lost == pytest.approx(399.5)
    assert r.chain == ("c1",)
    assert r.end_s == pytest.approx(4000.5 + 120.0 + 6400.0)
    assert r.gpu_seconds == pytest.approx(8 * (4000 - 0.5) + 8 * (120 + 6400))


def test_link_change_slows_or_replans_running_jobs() -> None:
    topo = one_cluster(2, gpus=8)
    two = [job("X", 500, gpus=16)]
    base = simulate(topo, two, GreedyPolicy(), FIXED)
    (r0,) = base.records
    assert r0.chain and len(r0.chain) == 2
    mild = [TopologyEvent(t_s=10.0, kind=EventKind.LINK_CHANGE, a="c0", b="c1", bandwidth_gbps=0.999)]
    (r1,) = simulate(topo, two, GreedyPolicy(), FIXED, events=mild).records
    assert r1.restarts == 0 and r1.end_s is not None and r0.end_s is not None and r1.end_s >= r0.end_s
    harsh = [TopologyEvent(t_s=10.0, kind=EventKind.LINK_CHANGE, a="c0", b="c1", bandwidth_gbps=0.01)]
    (r2,) = simulate(topo, two, GreedyPolicy(), FIXED, events=harsh).records
    assert r2.restarts == 1 and r2.status == "completed"


def test_job_that_can_never_fit_is_reported() -> None:
    topo = one_cluster(1)
    res = simulate(topo, [job("big", 10, gpus=8), replace(job("huge", 10), gpus=GpuRange(min=64, max=64))],
                   FixedStepPolicy(), FIXED)
    rec = {r.id: r for r in res.records}
    assert rec["big"].status == "completed"
    assert rec["huge"].status == "unschedulable" and rec["huge"].reason


def test_policy_over_allocation_is_an_error() -> None:
    class Cheat(FixedStepPolicy):
        def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
            plan = Plan(stages=(Stage(cluster="c0", first_layer=0, last_layer=job.model.layers - 1, dp=99),),
                        micro_batches=1, step_time_s=1.0, extras=given_step(1.0))
            return PlacementResult(status=PlacementStatus.SUCCESS, policy="cheat", plan=plan)

    with pytest.raises(SimulationError, match="takes 99 GPUs"):
        simulate(one_cluster(1), [job("A", 10)], Cheat(), FIXED)


def test_events_file_parsing() -> None:
    evs = events_from_dict({"events": [{"t_s": 5, "kind": "cluster_loss", "cluster": "c0"},
                                       {"t_s": 1, "kind": "link_change", "a": "c0", "b": "c1", "bandwidth_gbps": 2}]})
    assert [e.t_s for e in evs] == [1.0, 5.0] and evs[0].kind is EventKind.LINK_CHANGE
    with pytest.raises(ValidationError, match=r"events\[0\]\.kind"):
        events_from_dict({"events": [{"t_s": 1, "kind": "meteor"}]})
    with pytest.raises(ValidationError, match=r"events\[0\]\.t_s"):
        events_from_dict({"events": [{"t_s": -1, "kind": "cluster_loss", "cluster": "x"}]})
    assert math.isfinite(evs[1].t_s)


@pytest.mark.parametrize(("event", "field", "why"), [
    ({"kind": "cluster_loss", "cluster": "nope"}, "events[1].cluster", "is not a cluster of the topology"),
    ({"kind": "link_change", "a": "c0", "b": "c9", "latency_ms": 5}, "events[1].b", "is not a cluster"),
    ({"kind": "link_change", "a": "c0", "b": "c0", "latency_ms": 5}, "events[1].b", "must differ from 'a'"),
    ({"kind": "link_change", "a": "c0", "b": "c2", "latency_ms": 5}, "events[1].bandwidth_gbps", "no link"),
    ({"kind": "link_change", "a": "c0", "b": "c1"}, "events[1]", "changes nothing"),
])
def test_events_are_checked_against_the_topology_before_the_simulation(
        event: dict[str, Any], field: str, why: str) -> None:
    topo = Topology(clusters=tuple(Cluster(name=f"c{i}", gpu="A100-80G", nodes=1, gpus_per_node=4) for i in range(3)),
                    links=(Link(a="c0", b="c1", bandwidth_gbps=10.0, latency_ms=5.0),))
    doc = {"events": [{"t_s": 50, "kind": "cluster_loss", "cluster": "c1"}, {"t_s": 10, **event}]}
    with pytest.raises(ValidationError) as e:
        events_from_dict(doc, topo)
    assert e.value.field == field and why in e.value.reason
    if field == "events[1]":
        return  # rejected by the parser alone
    evs = events_from_dict(doc)  # well formed on its own; the engine checks it before running anything
    placed: list[str] = []

    class Spy(GreedyPolicy):
        def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
            placed.append(job.id)
            return super().place(topo, job, budget)

    with pytest.raises(ValidationError) as e:
        simulate(topo, [job("A", 10)], Spy(), FIXED, events=evs)
    assert e.value.field == "events[0]" + field.removeprefix("events[1]") and not placed  # sorted: [0] is t=10


def test_a_link_added_by_an_event_counts_only_from_its_time_on() -> None:
    topo = Topology(clusters=tuple(Cluster(name=f"c{i}", gpu="A100-80G", nodes=1, gpus_per_node=4) for i in range(3)),
                    links=(Link(a="c0", b="c1", bandwidth_gbps=10.0, latency_ms=5.0),))
    add = {"t_s": 100, "kind": "link_change", "a": "c0", "b": "c2", "bandwidth_gbps": 1.0}
    tweak = {"t_s": 50, "kind": "link_change", "a": "c2", "b": "c0", "latency_ms": 9.0}
    with pytest.raises(ValidationError) as e:  # the tweak comes first in time: the link is not there yet
        events_from_dict({"events": [add, tweak]}, topo)
    assert e.value.field == "events[1].bandwidth_gbps"
    events_from_dict({"events": [add, {**tweak, "t_s": 150}]}, topo)  # after the addition: fine


def test_backfilling_in_the_engine_respects_the_head_reservation() -> None:
    """R (4 GPUs) runs until 100.5; urgent H needs all 8 GPUs and becomes the head with a reservation at
    100.5. Short S (4 GPUs, ends at 21.5) is backfilled; long C (4 GPUs, 2000 s) would delay H and must wait."""
    topo = one_cluster(1)
    jobs = [
        job("R", 50, gpus=4, arrival=0.0),
        replace(job("H", 10, gpus=8, arrival=1.0), priority=1000),
        job("S", 10, gpus=4, arrival=1.0),
        job("C", 1000, gpus=4, arrival=1.0),
    ]
    res = simulate(topo, jobs, FixedStepPolicy(2.0), FIXED)
    rec = {r.id: r for r in res.records}
    assert rec["R"].end_s == pytest.approx(100.5)
    assert rec["S"].first_start_s is not None and rec["S"].end_s is not None and rec["S"].end_s <= 100.5
    assert rec["H"].first_start_s == pytest.approx(101.0)
    assert rec["C"].first_start_s is not None and rec["H"].end_s is not None
    assert rec["C"].first_start_s >= rec["H"].end_s
    assert all(r.status == "completed" for r in res.records)
    no_backfill = simulate(topo, jobs, FixedStepPolicy(2.0),
                           replace(FIXED, queue=replace(FIXED.queue, backfill=False)))
    rec2 = {r.id: r for r in no_backfill.records}
    assert rec2["S"].first_start_s is not None and rec2["S"].first_start_s > 100.5  # waits behind the head


def _assert_same_completed_runs(a: SimResult, b: SimResult) -> None:
    """Both runs completed every job without violations and agree on every record except measured overheads."""
    assert a.violations == () and all(r.status == "completed" for r in a.records)
    for x, y in zip(a.records, b.records, strict=True):
        dx, dy = x.to_dict(), y.to_dict()
        dx.pop("overhead_s")
        dy.pop("overhead_s")
        assert dx == dy


def test_real_registered_policy_is_deterministic_in_fixed_mode() -> None:
    """The engine drives a real baseline from the registry (firstfit) on the bundled DT-FM preset."""
    from spiderflow.core.placement import REGISTRY, load_builtin_policies
    from spiderflow.presets import resolve_topology

    load_builtin_policies()
    if "firstfit" not in REGISTRY:
        pytest.skip("firstfit is not registered")
    topo = resolve_topology("aws-10-dtfm")
    jobs = generate_trace(8, 2, 1.0, topo)
    cfg = SimConfig(overhead=OverheadMode.FIXED)
    a, b = (simulate(topo, jobs, "firstfit", cfg) for _ in range(2))
    _assert_same_completed_runs(a, b)


class WaitingPolicy(FixedStepPolicy):
    """Waits for the releases it is told about when the job needs more GPUs than are free; records them."""

    def __init__(self) -> None:
        super().__init__(2.0)
        self.seen: list[tuple[float, tuple[tuple[str, int], ...]]] = []

    def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
        self.seen += [(r.after_s, r.gpus) for r in budget.releases]
        res = super().place(topo, job, budget)
        if not res.ok and budget.releases:
            later = Plan(stages=(Stage(cluster=budget.releases[0].gpus[0][0], first_layer=0,
                                       last_layer=job.model.layers - 1, tp=1, dp=job.gpus.max),),
                         micro_batches=1, step_time_s=self.step, extras=given_step(self.step), usd_per_step=0.0)
            return _waits(self.name, budget.releases[0].after_s, later)
        return res

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        return None  # it prices waits in place()


def _waits(policy: str, after: float, plan: Plan) -> PlacementResult:
    """The typed answer "wait ``after`` seconds, then run ``plan``"."""
    return PlacementResult(status=PlacementStatus.WAIT, policy=policy, plan=plan, reason="wait",
                           wait=Wait(after_s=after, plan=plan, reason="wait"))


def test_releases_reach_the_policy_and_a_deferred_job_is_asked_again_at_the_release() -> None:
    """16 GPUs. A (8 GPUs, 10 steps × 2 s) runs from 0.5 to 20.5. B (8–16 GPUs, placed on 16) arrives at
    t=1, is told A's 8 GPUs come back 19.5 s later and waits; C (8 GPUs, 2 steps) arrives at t=5 and is
    backfilled (it ends at 9.5, before B's reserved start). B is not asked again before 20.5 and starts at
    21.0. Without releases B's reservation is on its 8-GPU minimum from now, which keeps C waiting."""
    topo = one_cluster(1, gpus=16)
    b = JobSpec(id="B", model=model_preset("gpt3-1.3b"), global_batch=8, steps=5, gpus=GpuRange(min=8, max=16),
                arrival_s=1.0)
    jobs = [job("A", 10), b, job("C", 2, arrival=5.0)]
    pol = WaitingPolicy()
    res = simulate(topo, jobs, pol, FIXED)
    rec = {r.id: r for r in res.records}
    assert pol.seen[0][0] == pytest.approx(19.5) and pol.seen[0][1] == (("c0", 8),)
    assert rec["C"].first_start_s == pytest.approx(5.5)
    assert rec["B"].decisions == 2 and rec["B"].first_start_s == pytest.approx(21.0)
    off = simulate(topo, jobs, WaitingPolicy(), replace(FIXED, releases=False))
    rec_off = {r.id: r for r in off.records}
    assert rec_off["C"].first_start_s is not None and rec_off["C"].first_start_s > 20.5


class ClaimingPolicy(FixedStepPolicy):
    """Like :class:`WaitingPolicy`, but the deferred answer carries the plan it waits for (the job's GPUs on
    the cluster of the first release that adds GPUs); records each job's releases."""

    def __init__(self) -> None:
        super().__init__(2.0)
        self.seen: dict[str, tuple[Any, ...]] = {}

    def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
        self.seen.setdefault(job.id, budget.releases)
        res = super().place(topo, job, budget)
        gives = [r for r in budget.releases if all(g > 0 for _, g in r.gpus)]
        if res.ok or not gives:
            return res
        cluster = gives[0].gpus[0][0]
        later = Plan(stages=(Stage(cluster=cluster, first_layer=0, last_layer=job.model.layers - 1, tp=1,
                                   dp=job.gpus.max),), micro_batches=1, step_time_s=self.step,
                     extras=given_step(self.step), usd_per_step=0.0)
        return _waits(self.name, gives[0].after_s, later)

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        return None  # it prices waits in place()


def test_a_waiting_jobs_claim_shows_in_the_other_jobs_releases() -> None:
    """16 GPUs. A (8 GPUs, 10 steps × 2 s) runs 0.5–20.5. B (8–16 GPUs, 5 steps) arrives at 1 and waits for A's
    GPUs with a plan on all 16; C (the same shape) arrives at 5 and is told, relative to its decision at 5:
    A's 8 GPUs come back at 15.5, B takes 16 then and gives them back at its estimated end 25.5."""
    topo = one_cluster(1, gpus=16)
    wide = [JobSpec(id=i, model=model_preset("gpt3-1.3b"), global_batch=8, steps=5, gpus=GpuRange(min=8, max=16),
                    arrival_s=t) for i, t in (("B", 1.0), ("C", 5.0))]
    pol = ClaimingPolicy()
    res = simulate(topo, [job("A", 10), *wide], pol, FIXED)
    assert all(r.status == "completed" for r in res.records) and res.violations == ()
    def seen(jid: str) -> list[tuple[float, tuple[tuple[str, int], ...]]]:
        return [(round(r.after_s, 9), r.gpus) for r in pol.seen[jid]]

    assert seen("B") == [(19.5, (("c0", 8),))]
    assert seen("C") == [(15.5, (("c0", 8),)), (15.5, (("c0", -16),)), (25.5, (("c0", 16),))]
    off = ClaimingPolicy()
    simulate(topo, [job("A", 10), replace(wide[1], arrival_s=0.75)], off, FIXED)
    assert len(off.seen["C"]) == 1  # nobody waiting: only A's release


class PessimisticWaitPolicy(FixedStepPolicy):
    """Places like :class:`FixedStepPolicy`; a job that does not fit waits for 8 GPUs of ``c0``, expected
    100 s after the decision (far later than they come back)."""

    def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
        res = super().place(topo, job, budget)
        if res.ok:
            return res
        later = Plan(stages=(Stage(cluster="c0", first_layer=0, last_layer=job.model.layers - 1, tp=1, dp=8),),
                     micro_batches=1, step_time_s=self.step, extras=given_step(self.step), usd_per_step=0.0)
        return _waits(self.name, 100.0, later)

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        return None  # it prices waits in place()


def test_a_wait_ends_when_the_claimed_gpus_are_free() -> None:
    """Two 8-GPU clusters. A (4 GPUs, 10 steps × 2 s) runs on c0 0.5–20.5, C (8 GPUs, 100 steps) on c1 from 1.0.
    B (4–8 GPUs, wants 8) arrives at 2 and waits for c0's 8 GPUs, expecting them 100 s later; they are free at
    A's end, so B is decided again then and starts at 20.5 + 0.5 instead of after 102."""
    topo = one_cluster(2, gpus=8)
    b = JobSpec(id="B", model=model_preset("gpt3-1.3b"), global_batch=8, steps=5, gpus=GpuRange(min=4, max=8),
                arrival_s=2.0)
    res = simulate(topo, [job("A", 10, gpus=4), job("C", 100), b], PessimisticWaitPolicy(), FIXED)
    by_id = {r.id: r for r in res.records}
    assert by_id["A"].end_s == pytest.approx(20.5) and by_id["C"].first_start_s == pytest.approx(1.0)
    assert by_id["B"].first_start_s == pytest.approx(21.0) and by_id["B"].chain == ("c0",)
    assert by_id["B"].decisions == 2


def test_spinsearch_waiting_is_deterministic_in_fixed_mode() -> None:
    from spiderflow.core.placement import load_builtin_policies

    load_builtin_policies()
    topo = generate_topology(8, 1, "geo")
    jobs = generate_trace(14, 1, 1.0, topo)
    cfg = SimConfig(overhead=OverheadMode.FIXED)
    a, b = (simulate(topo, jobs, "spinsearch", cfg) for _ in range(2))
    _assert_same_completed_runs(a, b)
