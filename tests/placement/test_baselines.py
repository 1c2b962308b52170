"""The ``bace`` and ``greedy`` baselines: memory-aware paths, the cheapest feasible path, a GPU count by
bace's own rule, greedy's best finish time over its candidates."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec, Topology
from spiderflow.core.placement.bace import Bace, bace_gpus, bace_paths
from spiderflow.core.placement.base import REGISTRY
from spiderflow.core.placement.common import check_plan, finalise
from spiderflow.core.placement.greedy import Greedy, greedy_allocations
from spiderflow.core.topogen import generate_topology


def _llama(k: int) -> JobSpec:
    return JobSpec(id=f"l{k}", model=model_preset("llama3-70b"), global_batch=256, seq_len=2048,
                   gpus=GpuRange(min=16, max=64))


def _take(topo: Topology, used: dict[str, int]) -> Topology:
    return topo.with_free({c.name: c.free - used.get(c.name, 0) for c in topo.clusters})


def test_bace_places_three_llama3_70b_jobs_on_an_idle_pool() -> None:
    topo = generate_topology(8, 1)
    pol = Bace()
    for k in range(3):
        res = pol.place(topo, _llama(k))
        assert res.ok and res.plan is not None, res.reason
        assert not check_plan(res.plan, topo, _llama(k))
        topo = _take(topo, res.plan.gpus_by_cluster())


def test_bace_counts_gpus_by_its_own_rule_and_keeps_the_cheapest_feasible_path() -> None:
    topo = generate_topology(8, 1)
    job = _llama(0)
    g = bace_gpus(topo, job)
    assert job.gpus.min <= g < min(job.gpus.max, topo.total_free_gpus)  # not every free GPU up to the max
    res = Bace().place(topo, job)
    assert res.ok and res.stats["target_gpus"] == g and res.stats["paths_planned"] >= 2
    paths = bace_paths(topo, job, g, float("inf"))
    from spiderflow.core.placement.base import Objective

    cheapest = finalise(topo, job, paths, objective=Objective.COST, planner=None).plan
    assert cheapest is not None
    for path in paths:  # no other feasible path is cheaper than the one whose chain bace planned
        other = finalise(topo, job, [path], objective=Objective.COST, planner=None).plan
        if other is not None:
            assert cheapest.usd_per_step <= other.usd_per_step + 1e-12


def test_bace_fits_a_model_across_regions_with_the_planner_then_with_more_gpus() -> None:
    """llama3-70b on partly busy 12-region pools, where the level-1 planner fits no path of bace's 64 GPUs:
    TPA fits the cheapest one (seed 1); where it cannot either, the search runs again at twice the GPUs
    (seed 2)."""
    from spiderflow.core.placement.bace import bace_allocation
    from spiderflow.core.sim.grid import instance_job

    job = instance_job(5)
    assert job.model.name == "llama3-70b"
    topo = generate_topology(12, 1, "geo")
    assert bace_gpus(topo, job) == 64
    level1, g1, _ = bace_allocation(topo, job, planner=None)
    planned, g, _ = bace_allocation(topo, job)
    assert (g1, g) == (128, 64) and sum(n for _, n in planned) == 64 < sum(n for _, n in level1)
    topo = generate_topology(12, 2, "geo")
    res = Bace().place(topo, job)
    assert res.ok and res.plan is not None and not check_plan(res.plan, topo, job)
    assert bace_gpus(topo, job) == 64 and res.stats["target_gpus"] == 128.0 and len(res.plan.chain) > 1


def test_greedy_is_registered_and_beats_every_single_candidate_it_tried() -> None:
    assert REGISTRY["greedy"] is Greedy
    topo = generate_topology(8, 1)
    job = _llama(0)
    res = Greedy().place(topo, job)
    assert res.ok and res.plan is not None and not check_plan(res.plan, topo, job)
    allocs = greedy_allocations(topo, job)
    assert res.stats["candidates"] == len(allocs) > 1
    counts = {sum(g for _, g in a) for a in allocs}
    assert min(counts) == job.gpus.min and len(counts) >= 3  # it compares several GPU counts
    for a in allocs[:6]:
        one = finalise(topo, job, [a], planner=None).plan
        if one is not None:
            assert res.plan.step_time_s <= one.step_time_s * (1 + 1e-9)


def test_greedy_and_bace_report_unschedulable_jobs() -> None:
    topo = generate_topology(4, 0)
    busy = topo.with_free({c.name: 0 for c in topo.clusters})
    for pol in (Greedy(), Bace()):
        res = pol.place(busy, _llama(0))
        assert not res.ok and res.reason and res.constraint
    with pytest.raises(KeyError):
        REGISTRY["no-such-policy"]
