"""SpinSearch's region matching by look-ahead: the rule on hand-built states, and the option reaching the plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.cycle import OUTLOOK_SIZE, CycleInput, CycleOptions, QueueEntry, run_cycle
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Outlook, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus
from spiderflow.core.placement.lookahead import (
    MARGIN,
    Prices,
    arrivals_outlook,
    cluster_class,
    cluster_prices,
    lookahead_choice,
    single_cluster_allocs,
)
from spiderflow.core.placement.options import SearchOptions, make_policy
from spiderflow.core.placement.spinsearch import SpinSearch
from spiderflow.core.sim.tracegen import generate_trace
from spiderflow.presets import resolve_topology


def _topo(fast: int = 1, slow: int = 1, mid: int = 0) -> Topology:
    clusters = tuple(Cluster(name=f"fast{i}", gpu="H100-80G", nodes=4, gpus_per_node=8,
                             electricity_usd_per_kwh=0.1 + i / 100) for i in range(fast))
    clusters += tuple(Cluster(name=f"mid{i}", gpu="A100-80G", nodes=4, gpus_per_node=8) for i in range(mid))
    clusters += tuple(Cluster(name=f"slow{i}", gpu="V100-32G", nodes=4, gpus_per_node=8) for i in range(slow))
    names = [c.name for c in clusters]
    links = tuple(Link(a=a, b=b, bandwidth_gbps=1.0, latency_ms=50.0)
                  for i, a in enumerate(names) for b in names[i + 1:])
    return Topology(clusters=clusters, links=links)


def _job(job_id: str = "j", model: str = "gpt3-1.3b", steps: int = 1000, gmin: int = 4, gmax: int = 32) -> JobSpec:
    return JobSpec(id=job_id, model=model_preset(model), global_batch=256, micro_batch=4, steps=steps,
                   gpus=GpuRange(min=gmin, max=gmax))


def test_outlook_is_the_rate_and_mix_of_the_last_arrivals() -> None:
    jobs = [_job(f"j{i}") for i in range(5)]
    assert arrivals_outlook([], 4) is None
    assert arrivals_outlook([(0.0, jobs[0])], 4) is None
    assert arrivals_outlook([(5.0, jobs[0]), (5.0, jobs[1])], 4) is None  # no time between them
    o = arrivals_outlook([(float(10 * i), j) for i, j in enumerate(jobs)], 4)
    assert o is not None
    assert o.rate_per_s == pytest.approx(3 / 30)  # the last four: three gaps over 30 s
    assert [j.id for j in o.mix] == ["j1", "j2", "j3", "j4"]
    with pytest.raises(ValidationError, match="rate_per_s"):
        Outlook(rate_per_s=0.0, mix=(jobs[0],))
    with pytest.raises(ValidationError, match="mix"):
        Outlook(rate_per_s=1.0, mix=())


def test_clusters_of_one_class_differ_only_in_name_place_and_price() -> None:
    t = _topo(fast=2)
    assert cluster_class(t.cluster("fast0")) == cluster_class(t.cluster("fast1"))
    assert cluster_class(t.cluster("fast0")) != cluster_class(t.cluster("slow0"))
    # one whole-cluster candidate per class
    assert single_cluster_allocs(t, _job()) == [(("fast0", 32),), (("slow0", 32),)]


def test_prices_are_the_arrivals_speedup_over_the_slowest_class_discounted_by_free_peers() -> None:
    t = _topo(fast=1)
    mix = tuple(_job(f"m{i}") for i in range(4))
    busy = cluster_prices(t, Outlook(rate_per_s=1.0, mix=mix))  # arrivals far beyond the pool: load 1
    assert busy.load == 1.0
    assert busy.weight["slow0"] == 0.0
    assert busy.weight["fast0"] > 0.5  # an H100 region runs gpt3-1.3b several times faster than a V100 one
    # two fast regions and a light load: an arrival probably finds the other one free
    light = cluster_prices(_topo(fast=2), Outlook(rate_per_s=1e-6, mix=mix))
    assert 0 < light.load < 0.1
    assert light.weight["fast0"] == pytest.approx(light.load * busy.weight["fast0"])


def test_value_is_the_log_run_time_plus_the_expected_loss_of_the_next_arrival() -> None:
    p = Prices(weight={"a": 1.0, "b": 0.0}, size={"a": 32, "b": 32}, rate_per_s=0.01, load=1.0)
    assert p.value(100.0, (("b", 32),)) == pytest.approx(math.log(100.0))
    assert p.value(100.0, (("a", 32),)) == pytest.approx(math.log(100.0) + (1 - math.exp(-1.0)))
    assert p.value(100.0, (("a", 16),)) == pytest.approx(math.log(100.0) + (1 - math.exp(-1.0)) / 2)


def test_without_comparative_advantage_the_fast_region_is_kept() -> None:
    """Every job of the mix is the job in hand: its own speedup equals the arrivals'; the finalist stands."""
    t = _topo()
    job = _job()
    out = lookahead_choice(t, job, [(("fast0", 32),)], Outlook(rate_per_s=1.0, mix=(job,) * 8))
    assert out is None or out.finalist


def test_a_job_that_gains_less_than_the_arrivals_leaves_them_the_fast_region() -> None:
    """A job gaining only a few per cent from the fast cluster (its finalist pairs it with a slow one it
    cannot do without) against arrivals gaining several times: the alternative without it wins."""
    t = _topo(fast=1, mid=1, slow=2)
    big = JobSpec(id="big", model=model_preset("llama3-70b"), global_batch=1024, micro_batch=1, steps=50,
                  gpus=GpuRange(min=64, max=64))
    mix = tuple(_job(f"m{i}") for i in range(8))
    finalist = (("fast0", 32), ("slow0", 32))
    alternative = (("mid0", 32), ("slow1", 32))
    out = lookahead_choice(t, big, [finalist], Outlook(rate_per_s=1.0, mix=mix), [alternative])
    assert out is not None and not out.finalist and out.allocation == alternative
    assert out.best_value - out.value > MARGIN


def test_the_option_reaches_the_plan_on_a_constructed_state() -> None:
    """On the aws-10-dtfm preset with one H100 region free, llama3-70b's fastest plan pairs it with a V100
    region; with the look-ahead (arrivals of the trace mix at the observed rate) it takes A100 + V100."""
    topo = resolve_topology("aws-10-dtfm")
    trace = generate_trace(12, 101, 1.0, topo)
    job = next(j for j in trace[1:] if j.model.name == "llama3-70b")
    free = {c.name: (32 if c.name in ("ireland", "seoul", "singapore", "virginia") else 0) for c in topo.clusters}
    snap = topo.with_free(free)
    seen = [j for j in trace if j.arrival_s < job.arrival_s]
    outlook = arrivals_outlook([(j.arrival_s, j) for j in seen], OUTLOOK_SIZE)
    assert outlook is not None
    off = SpinSearch(planner=None).place(snap, job, Budget(outlook=outlook))
    on = SpinSearch(planner=None, lookahead=True).place(snap, job, Budget(outlook=outlook))
    assert off.status is PlacementStatus.SUCCESS and on.status is PlacementStatus.SUCCESS
    gpu = {c.name: c.gpu for c in topo.clusters}
    assert off.plan is not None and on.plan is not None
    assert "H100-80G" in {gpu[c] for c in off.plan.chain}
    assert "H100-80G" not in {gpu[c] for c in on.plan.chain}
    assert on.stats["lookahead_gain"] > MARGIN
    # without an outlook the option changes nothing
    none = SpinSearch(planner=None, lookahead=True).place(snap, job, Budget())
    assert none.plan == off.plan


def test_option_validation_and_make_policy() -> None:
    with pytest.raises(ValidationError, match="lookahead"):
        SpinSearch(lookahead=1)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="lookahead"):
        SearchOptions(lookahead="yes")  # type: ignore[arg-type]
    pol = make_policy("spinsearch", SearchOptions(lookahead=True))
    assert isinstance(pol, SpinSearch) and pol.lookahead
    assert not make_policy("spinsearch").lookahead  # type: ignore[attr-defined]


@dataclass
class _Recorder:
    """A policy recording the budgets it is given (``lookahead`` as SpinSearch's option)."""

    lookahead: bool
    budgets: list[Budget] = field(default_factory=list)
    name: str = "recorder"

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        self.budgets.append(budget or Budget())
        return PlacementResult(status=PlacementStatus.UNSCHEDULABLE, policy=self.name, reason="recording")


@pytest.mark.parametrize("looks", [True, False])
def test_the_cycle_passes_the_outlook_only_to_a_policy_that_looks_ahead(looks: bool) -> None:
    t = _topo()
    jobs = [_job(f"j{i}") for i in range(3)]
    state = CycleInput(topology=t, queue=[QueueEntry(spec=jobs[2], enqueued_s=20.0)], holding=[], now=20.0,
                       arrivals=tuple((10.0 * i, j) for i, j in enumerate(jobs)))
    pol = _Recorder(lookahead=looks)
    run_cycle(state, pol, CycleOptions(wait=False))  # type: ignore[arg-type]
    assert pol.budgets
    got = pol.budgets[0].outlook
    if looks:
        assert got is not None and got.rate_per_s == pytest.approx(0.1) and len(got.mix) == 3
    else:
        assert got is None
