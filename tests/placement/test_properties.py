"""Property tests: every plan of every policy respects free GPUs, memory, the GPU range and contiguity;
failures are typed and name the binding constraint."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import ModelSpec, model_preset
from spiderflow.core.costmodel import evaluate, fits_memory
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Precision, Topology
from spiderflow.core.placement.bace import Bace
from spiderflow.core.placement.base import Budget, Objective, PlacementStatus
from spiderflow.core.placement.common import check_plan, fallback_plan_chain
from spiderflow.core.placement.firstfit import FirstFit
from spiderflow.core.placement.spinsearch import SpinSearch
from spiderflow.core.topogen import generate_topology

POLICIES = (SpinSearch(planner=None), FirstFit(), Bace(planner=None))


@st.composite
def instances(draw: st.DrawFn) -> tuple[Topology, JobSpec, Budget]:
    n = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 10_000))
    kind = draw(st.sampled_from(["geo", "hub", "mesh"]))
    topo = generate_topology(n, seed, kind)
    rng = np.random.default_rng(seed)
    if draw(st.booleans()):
        topo = topo.with_free({c.name: int(rng.integers(0, c.free + 1)) for c in topo.clusters})
    preset = draw(st.sampled_from(["gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "custom"]))
    model = (
        ModelSpec(name="custom", layers=draw(st.integers(2, 16)), hidden=1024 * draw(st.integers(1, 4)),
                  heads=16, vocab=32000)
        if preset == "custom" else model_preset(preset)
    )
    gmin = draw(st.integers(1, 96))
    gmax = gmin + draw(st.integers(0, 96))
    micro = draw(st.sampled_from([1, 2]))
    job = JobSpec(id="p", model=model, global_batch=micro * draw(st.sampled_from([16, 64, 128])),
                  micro_batch=micro, seq_len=draw(st.sampled_from([512, 2048])), gpus=GpuRange(min=gmin, max=gmax))
    objective = draw(st.sampled_from(list(Objective)))
    return topo, job, Budget(objective=objective, seed=seed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_every_plan_respects_the_hard_constraints(inst: tuple[Topology, JobSpec, Budget]) -> None:
    topo, job, budget = inst
    for policy in POLICIES:
        res = policy.place(topo, job, budget)
        assert res.planning_seconds >= 0
        if res.ok:
            plan = res.plan
            assert plan is not None
            assert check_plan(plan, topo, job) == [], (policy.name, plan)
            # contiguous layers 0..L-1 (Plan checks contiguity; coverage checked here)
            assert plan.stages[0].first_layer == 0 and plan.layers == job.model.layers
            assert job.gpus.min <= plan.gpus <= job.gpus.max
            for name, g in plan.gpus_by_cluster().items():
                assert g <= topo.cluster(name).free
            # predictions are the shared cost model's
            again = evaluate(plan, topo, job)
            assert abs(again.step_time_s - plan.step_time_s) <= 1e-9 * plan.step_time_s
        else:
            assert res.status in (PlacementStatus.UNSCHEDULABLE, PlacementStatus.UNRESOLVABLE), res
            assert res.constraint, res
            assert res.reason


def _topo(*clusters: Cluster) -> Topology:
    from spiderflow.core.domain import Link

    links = tuple(
        Link(a=clusters[i].name, b=clusters[i + 1].name, bandwidth_gbps=5.0, latency_ms=10.0)
        for i in range(len(clusters) - 1)
    )
    return Topology(clusters=clusters, links=links)


def _job(model: str, gmin: int, gmax: int) -> JobSpec:
    return JobSpec(id="u", model=model_preset(model), global_batch=64, gpus=GpuRange(min=gmin, max=gmax))


def test_more_gpus_than_exist_is_unresolvable() -> None:
    topo = _topo(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8),
                 Cluster(name="b", gpu="A100-80G", nodes=1, gpus_per_node=8))
    for policy in POLICIES:
        res = policy.place(topo, _job("gpt3-1.3b", 32, 32))
        assert res.status is PlacementStatus.UNRESOLVABLE
        assert res.constraint == "gpus.min"
        assert "32" in res.reason


def test_more_gpus_than_free_is_unschedulable() -> None:
    topo = _topo(Cluster(name="a", gpu="A100-80G", nodes=2, gpus_per_node=8, free_gpus=4),
                 Cluster(name="b", gpu="A100-80G", nodes=1, gpus_per_node=8, free_gpus=2))
    for policy in POLICIES:
        res = policy.place(topo, _job("gpt3-1.3b", 8, 8))
        assert res.status is PlacementStatus.UNSCHEDULABLE
        assert res.constraint == "free_gpus"


def test_model_too_big_for_memory_names_memory() -> None:
    topo = _topo(Cluster(name="a", gpu="T4", nodes=1, gpus_per_node=4),
                 Cluster(name="b", gpu="T4", nodes=1, gpus_per_node=4))
    for policy in POLICIES:
        res = policy.place(topo, _job("llama3-70b", 1, 8))
        assert res.status is PlacementStatus.UNRESOLVABLE
        assert res.constraint == "memory"


def test_activation_memory_binding_is_reported_by_the_planner() -> None:
    """States fit in aggregate but no split fits per GPU (huge activations): the search ends unschedulable
    with the memory constraint named."""
    topo = _topo(Cluster(name="a", gpu="V100-16G", nodes=1, gpus_per_node=2),
                 Cluster(name="b", gpu="V100-16G", nodes=1, gpus_per_node=2))
    job = JobSpec(id="act", model=model_preset("gpt3-1.3b"), global_batch=64, micro_batch=16, seq_len=8192,
                  gpus=GpuRange(min=1, max=4))
    for policy in POLICIES:
        res = policy.place(topo, job)
        assert not res.ok
        assert res.constraint == "memory", (policy.name, res)


def test_fallback_matches_the_cost_model_and_uses_pipeline_inside_a_cluster_for_memory() -> None:
    topo = generate_topology(6, 4)
    big = max(topo.clusters, key=lambda c: c.free * c.gpu_memory_gib)
    job = JobSpec(id="f", model=model_preset("gpt3-13b"), global_batch=64,
                  gpus=GpuRange(min=1, max=big.free))
    plan = fallback_plan_chain(topo, job, [(big.name, big.free)])
    assert check_plan(plan, topo, job) == []
    assert evaluate(plan, topo, job).step_time_s == plan.step_time_s


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["gpt3-1.3b", "gpt3-13b"]), st.integers(1, 4),
       st.sampled_from(Precision))
def test_level1_planner_mirrors_the_cost_model(seed: int, model: str, k: int, precision: Precision) -> None:
    """The planner's own step-time arithmetic equals spiderflow.core.costmodel.evaluate on the plan it returns, in
    the job's precision."""
    from spiderflow.core.errors import UnschedulableError
    from spiderflow.core.placement.common import _ChainEval

    topo = generate_topology(8, seed)
    rng = np.random.default_rng(seed)
    chosen = [topo.clusters[int(i)] for i in rng.permutation(8)[:k]]
    alloc = [(c.name, c.free) for c in chosen]
    job = JobSpec(id="m", model=model_preset(model), global_batch=128, gpus=GpuRange(min=1, max=10_000),
                  precision=precision)
    try:
        plan = fallback_plan_chain(topo, job, alloc)
    except UnschedulableError as e:
        assert e.constraint in ("memory", "layers")
        return
    ev = _ChainEval(topo, job, alloc, exact_gpus=False)
    sizes: list[int] = []
    pps: list[int] = []
    for name, _ in alloc:
        mine = [s for s in plan.stages if s.cluster == name]
        sizes.append(sum(s.layers for s in mine))
        pps.append(len(mine))
    excess, step, _ = ev.evaluate_split(sizes, pps)
    assert excess == 0
    assert step == pytest.approx(plan.step_time_s, rel=1e-9)


def test_level1_planner_mirrors_the_cost_model_for_llama() -> None:
    """A 70B chain on small GPUs (16 GiB V100s first) whose split search ends over memory: the plan is then
    the memory-first structure, priced by the cost model itself; any plan the search itself returns mirrors
    level 1's arithmetic (the property above)."""
    from spiderflow.core.placement.common import _ChainEval, _memory_first_plan

    topo = generate_topology(8, 0)
    rng = np.random.default_rng(0)
    alloc = [(topo.clusters[int(i)].name, topo.clusters[int(i)].free) for i in rng.permutation(8)[:4]]
    job = JobSpec(id="m", model=model_preset("llama3-70b"), global_batch=128, gpus=GpuRange(min=1, max=10_000))
    plan = fallback_plan_chain(topo, job, alloc)
    structure = _memory_first_plan(_ChainEval(topo, job, alloc, exact_gpus=False), alloc)
    if structure is not None and plan.stages == structure.stages:
        assert evaluate(plan, topo, job).step_time_s == pytest.approx(plan.step_time_s, rel=1e-12)
        assert fits_memory(plan, topo)[0]
    else:
        test_level1_planner_mirrors_the_cost_model.hypothesis.inner_test(  # type: ignore[attr-defined]
            0, "llama3-70b", 4, Precision.BF16)
