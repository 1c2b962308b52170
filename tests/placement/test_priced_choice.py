"""SpinSearch's priced choice: a shadow price of the GPUs a plan holds, by the demand on the pool the cycle passes."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.cycle import CycleInput, CycleOptions, Holder, QueueEntry, run_cycle
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus
from spiderflow.core.placement.options import SearchOptions, make_policy
from spiderflow.core.placement.spinsearch import (
    PRESSURE_CAP,
    SpinSearch,
    fewer_gpus,
    priced_choice,
    priced_value,
    queue_pressure,
)


def _topo() -> Topology:
    clusters = (Cluster(name="fast", gpu="H100-80G", nodes=4, gpus_per_node=8),
                Cluster(name="slow", gpu="V100-32G", nodes=4, gpus_per_node=8))
    return Topology(clusters=clusters, links=(Link(a="fast", b="slow", bandwidth_gbps=1.0, latency_ms=50.0),))


def _job(job_id: str = "j", gmin: int = 4, gmax: int = 32) -> JobSpec:
    return JobSpec(id=job_id, model=model_preset("gpt3-1.3b"), global_batch=256, micro_batch=4, steps=1000,
                   gpus=GpuRange(min=gmin, max=gmax))


def test_queue_pressure_is_the_queued_demand_over_the_free_gpus_capped() -> None:
    assert queue_pressure(0, 64) == 0.0
    assert queue_pressure(16, 0) == 0.0
    assert queue_pressure(16, 64) == 0.25
    assert queue_pressure(64, 64) == 1.0
    assert queue_pressure(10_000, 64) == PRESSURE_CAP


def test_priced_value_is_the_finish_time_times_one_plus_the_price_of_the_share_held() -> None:
    assert priced_value(1000, 0.5, 32, 64, 0.0) == 500.0
    assert priced_value(1000, 0.5, 32, 64, 1.0) == pytest.approx(750.0)
    assert priced_value(1000, 0.5, 16, 64, 2.0) == pytest.approx(750.0)
    assert priced_value(1000, 0.5, 16, 0, 2.0) == 500.0


def test_fewer_gpus_variants_keep_the_chain_and_one_gpu_per_cluster() -> None:
    assert fewer_gpus((("a", 32),), 4) == [(("a", 24),), (("a", 16),), (("a", 8),), (("a", 4),)]
    assert fewer_gpus((("a", 32),), 16) == [(("a", 24),), (("a", 16),)]
    assert fewer_gpus((("a", 16),), 16) == []
    two = fewer_gpus((("a", 24), ("b", 8)), 8)
    assert [sum(g for _, g in v) for v in two] == [24, 16, 8]
    assert all([c for c, _ in v] == ["a", "b"] and all(g >= 1 for _, g in v) for v in two)
    assert two[0] == (("a", 18), ("b", 6))
    # The one-GPU floor: three clusters never go below three GPUs.
    assert all(sum(g for _, g in v) >= 3 for v in fewer_gpus((("a", 1), ("b", 1), ("c", 10)), 1))


def test_priced_choice_keeps_the_fastest_without_a_price_and_fewer_gpus_at_a_high_one() -> None:
    topo, job = _topo(), _job()
    free = priced_choice(topo, job, [(("fast", 32),)], price=0.0)
    dear = priced_choice(topo, job, [(("fast", 32),)], price=8.0)
    assert free is not None and dear is not None
    assert free[0] == (("fast", 32),)
    assert dear[1].gpus < free[1].gpus and dear[1].step_time_s > free[1].step_time_s
    big = JobSpec(id="big", model=model_preset("llama3-70b"), global_batch=1024, micro_batch=1, steps=10,
                  gpus=GpuRange(min=4, max=8))
    assert priced_choice(topo, big, [(("slow", 8),)], price=1.0) is None  # no variant holds it in memory


def test_the_option_reaches_the_plan_only_on_a_busy_pool() -> None:
    topo, job = _topo(), _job()
    off = SpinSearch().place(topo, job, Budget(demand_gpus=128))
    idle = SpinSearch(gpu_price=4.0).place(topo, job, Budget(demand_gpus=0))
    on = SpinSearch(gpu_price=4.0).place(topo, job, Budget(demand_gpus=128))
    assert off.plan is not None and idle.plan is not None and on.plan is not None
    assert idle.plan == off.plan and "gpu_price" not in off.stats
    assert on.plan.gpus < off.plan.gpus and on.stats["gpu_price"] == 4.0 * PRESSURE_CAP
    assert make_policy("spinsearch", SearchOptions(gpu_price=4.0)).place(topo, job, Budget(demand_gpus=128)).plan \
        == on.plan


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True])
def test_a_bad_gpu_price_names_the_field(bad: float) -> None:
    with pytest.raises(ValidationError, match="gpu_price"):
        SpinSearch(gpu_price=bad)
    with pytest.raises(ValidationError, match="gpu_price"):
        SearchOptions(gpu_price=bad)


@dataclass
class _Recorder:
    """A policy that records each decision's demand on the pool and never places."""

    name: str = "recorder"
    seen: dict[str, int] = field(default_factory=dict)

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        self.seen[job.id] = (budget or Budget()).demand_gpus
        return PlacementResult(status=PlacementStatus.UNSCHEDULABLE, policy=self.name, reason="recording")


def test_the_cycle_passes_the_gpus_held_plus_the_other_queued_jobs_minimum_gpus() -> None:
    jobs = [_job("a", 4, 8), _job("b", 8, 16), _job("c", 2, 4)]
    rec = _Recorder()
    held = Holder(job_id="r", end_s=100.0, gpus=(("fast", 12),))
    topo = _topo().with_free({"fast": 20})
    state = CycleInput(topology=topo, queue=[QueueEntry(spec=j, enqueued_s=float(i)) for i, j in enumerate(jobs)],
                       holding=[held], now=10.0)
    run_cycle(state, rec, CycleOptions(wait=False))
    assert rec.seen["a"] == 12 + 8 + 2  # held, then b's and c's minimum
    assert all(rec.seen[k] == 12 + 14 - j.gpus.min for k, j in zip("abc", jobs, strict=True) if k in rec.seen)


def test_a_job_placed_earlier_in_the_cycle_counts_with_the_gpus_it_took() -> None:
    jobs = [_job("a", 4, 8), _job("b", 8, 16)]
    policy = _PlaceFirst()
    state = CycleInput(topology=_topo(), queue=[QueueEntry(spec=j, enqueued_s=float(i)) for i, j in enumerate(jobs)],
                       holding=[], now=10.0)
    run_cycle(state, policy, CycleOptions(wait=False))
    assert policy.seen == {"a": 8, "b": policy.took}


@dataclass
class _PlaceFirst:
    """SpinSearch's plan for the first job it is asked about; records every decision's demand."""

    name: str = "place-first"
    seen: dict[str, int] = field(default_factory=dict)
    took: int = 0

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        self.seen[job.id] = (budget or Budget()).demand_gpus
        if len(self.seen) > 1:
            return PlacementResult(status=PlacementStatus.UNSCHEDULABLE, policy=self.name, reason="recording")
        res = SpinSearch().place(topo, job)
        assert res.plan is not None
        self.took = res.plan.gpus
        return res
