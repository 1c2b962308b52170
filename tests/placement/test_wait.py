"""SpinSearch's start-now-or-wait rule and the chain-plan cache."""

from __future__ import annotations

from typing import Any

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Topology
from spiderflow.core.placement.base import Budget, Objective, PlacementStatus, Release
from spiderflow.core.placement.common import finalise, plan_chain, plan_key
from spiderflow.core.placement.spinsearch import DEFER_MARGIN, MAX_LOOKAHEAD, SpinSearch, wait_or_start


def _topo(free_big: int) -> Topology:
    clusters = (
        Cluster(name="big", gpu="H100-80G", nodes=4, gpus_per_node=8, free_gpus=free_big),
        Cluster(name="small", gpu="A100-40G", nodes=1, gpus_per_node=8),
    )
    return Topology(clusters=clusters, links=(Link(a="big", b="small", bandwidth_gbps=1.0, latency_ms=50.0),))


def _job(steps: int) -> JobSpec:
    return JobSpec(id="j", model=model_preset("gpt3-1.3b"), global_batch=64, steps=steps, gpus=GpuRange(min=8, max=32))


def test_waits_for_a_soon_released_fast_cluster_and_not_for_a_late_one() -> None:
    topo = _topo(0)
    job = _job(2000)
    now = SpinSearch().place(topo, job)
    assert now.ok and now.plan is not None and now.plan.chain == ("small",)
    f_now = job.steps * now.plan.step_time_s
    soon = (Release(after_s=0.05 * f_now, gpus=(("big", 32),)),)
    wait = wait_or_start(topo, job, now.plan, soon)
    assert wait is not None
    after, f_wait, f0, later = wait
    assert after == soon[0].after_s and f0 == f_now and f_wait < (1 - DEFER_MARGIN) * f_now and later.gpus >= 8
    assert later.chain == ("big",) and f_wait == after + job.steps * later.step_time_s
    res = SpinSearch().place(topo, job, Budget(releases=soon))
    assert res.status is PlacementStatus.WAIT and res.wait is not None and not res.ok
    assert res.wait.after_s == after and res.plan is not None and res.wait.plan == res.plan
    assert res.plan.gpus_by_cluster() == later.gpus_by_cluster()
    # Released too late to finish earlier, or a cost objective: start now.
    late = (Release(after_s=0.9 * f_now, gpus=(("big", 32),)),)
    assert wait_or_start(topo, job, now.plan, late) is None
    assert SpinSearch().place(topo, job, Budget(releases=late)).ok
    assert wait_or_start(topo, job, now.plan, ()) is None


def test_a_reservation_by_another_waiting_job_is_not_counted_on() -> None:
    """A negative release is GPUs another waiting job has claimed: with all 32 released GPUs claimed from
    the release on and given back late, waiting no longer pays; given back soon, it pays again."""
    topo = _topo(0)
    job = _job(2000)
    now = SpinSearch().place(topo, job)
    assert now.plan is not None
    f_now = job.steps * now.plan.step_time_s
    t = 0.05 * f_now
    free = Release(after_s=t, gpus=(("big", 32),))
    claimed = (free, Release(after_s=t, gpus=(("big", -32),)), Release(after_s=0.9 * f_now, gpus=(("big", 32),)))
    assert wait_or_start(topo, job, now.plan, (free,)) is not None
    assert wait_or_start(topo, job, now.plan, claimed) is None
    back_soon = (*claimed[:2], Release(after_s=2 * t, gpus=(("big", 32),)))
    wait = wait_or_start(topo, job, now.plan, back_soon)
    assert wait is not None and wait[0] == 2 * t


def test_the_most_promising_release_is_searched_even_behind_many_small_ones() -> None:
    """Seven single-GPU releases of a slow cluster come before 32 fast GPUs: points are searched best-first by
    their lower bound, so the fast one is found although more than MAX_LOOKAHEAD points come first."""
    clusters = (
        Cluster(name="big", gpu="H100-80G", nodes=4, gpus_per_node=8, free_gpus=0),
        Cluster(name="small", gpu="A100-40G", nodes=1, gpus_per_node=8),
        Cluster(name="slow", gpu="V100-32G", nodes=2, gpus_per_node=8, free_gpus=8),
    )
    links = (Link(a="big", b="small", bandwidth_gbps=1.0, latency_ms=50.0),
             Link(a="small", b="slow", bandwidth_gbps=1.0, latency_ms=50.0))
    topo = Topology(clusters=clusters, links=links)
    job = _job(2000)
    now = SpinSearch().place(topo, job)
    assert now.plan is not None
    f_now = job.steps * now.plan.step_time_s
    early = tuple(Release(after_s=0.001 * k * f_now, gpus=(("slow", 1),)) for k in range(1, 8))
    assert len(early) > MAX_LOOKAHEAD
    fast = Release(after_s=0.05 * f_now, gpus=(("big", 32),))
    wait = wait_or_start(topo, job, now.plan, (*early, fast))
    assert wait is not None and wait[0] == fast.after_s and wait[3].chain == ("big",)


def test_cost_objective_waits_only_for_cheaper_dollars_whatever_the_delay() -> None:
    """For ``cost`` the whole job's dollars decide, not the finish time: a release far in the future is
    still worth waiting for when the job's dollars drop by more than the margin there, never otherwise."""
    topo = _topo(0)
    job = _job(2000)
    now = SpinSearch().place(topo, job, Budget(objective=Objective.COST))
    assert now.ok and now.plan is not None
    far = (Release(after_s=1e7, gpus=(("big", 32),)),)
    wait = wait_or_start(topo, job, now.plan, far, objective=Objective.COST)
    # The 32 fast GPUs cost ~0.58x the dollars per step of the small cluster's plan here.
    assert wait is not None and wait[0] == 1e7 and wait[2] == job.steps * now.plan.usd_per_step
    assert wait[1] < (1 - DEFER_MARGIN) * wait[2]
    jct_now = SpinSearch().place(topo, job)
    assert jct_now.plan is not None and wait_or_start(topo, job, jct_now.plan, far) is None


def test_plan_cache_matches_the_planner_and_keys_on_what_the_plan_depends_on() -> None:
    a, b = _topo(32), _topo(24)
    job = _job(10)
    alloc = [("big", 16), ("small", 8)]
    assert plan_key(a, job, alloc, Objective.JCT) == plan_key(b, job, alloc, Objective.JCT)
    other = JobSpec(id="other", model=job.model, global_batch=64, steps=99, gpus=job.gpus, arrival_s=5.0)
    assert plan_key(a, other, alloc, Objective.JCT) == plan_key(a, job, alloc, Objective.JCT)
    slower = Topology(clusters=a.clusters, links=(Link(a="big", b="small", bandwidth_gbps=0.5, latency_ms=50.0),))
    assert plan_key(slower, job, alloc, Objective.JCT) != plan_key(a, job, alloc, Objective.JCT)
    assert plan_key(_topo(8), job, alloc, Objective.JCT) is None  # more GPUs than free: not cacheable
    p1, p2 = plan_chain(a, job, alloc), plan_chain(b, job, alloc)
    assert p1.stages == p2.stages and p1.step_time_s == p2.step_time_s
    f = finalise(slower, job, [alloc], planner=None)
    assert f.plan is not None and f.plan.step_time_s > plan_chain(a, job, alloc).step_time_s * 0.999


def test_tpa_plan_key_ignores_the_micro_batch_and_gpu_range_the_fallback_key_does_not() -> None:
    a = _topo(32)
    job = _job(10)
    other = JobSpec(id="o", model=job.model, global_batch=64, micro_batch=2, gpus=GpuRange(min=4, max=64))
    alloc = [("big", 16)]
    assert plan_key(a, job, alloc, Objective.JCT, tpa_only=True) == plan_key(a, other, alloc, Objective.JCT,
                                                                              tpa_only=True)
    assert plan_key(a, job, alloc, Objective.JCT) != plan_key(a, other, alloc, Objective.JCT)


def test_plan_key_covers_every_cluster_field_but_free_gpus() -> None:
    import dataclasses

    a = _topo(32)
    job = _job(10)
    alloc = [("big", 16)]
    base = plan_key(a, job, alloc, Objective.JCT)
    for f in dataclasses.fields(Cluster):
        if f.name in ("name", "free_gpus"):
            continue
        v = getattr(a.clusters[0], f.name)
        new: Any = {"gpu": "A100-80G", "region": "x"}.get(f.name, 1 if v is None else v)
        if isinstance(v, bool | int | float) and v is not None:
            new = type(v)(v * 2 + 1) if not isinstance(v, bool) else not v
        try:
            c = dataclasses.replace(a.clusters[0], **{f.name: new})
        except Exception:  # a value the cluster refuses: nothing to key on
            continue
        b = Topology(clusters=(c, a.clusters[1]), links=a.links)
        assert plan_key(b, job, alloc, Objective.JCT) != base, f.name
