"""The level-1 planner's memory-first structures: they exist exactly when some plan of the planner's space
(degrees per cluster, balanced sub-stages) fits memory, their plan fits, and the planner uses them when
its search ends over memory, and proves infeasibility with them at once when nothing fits."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from chains import memory_bound_chain

from spiderflow.core.catalog import ModelSpec, model_preset
from spiderflow.core.costmodel import evaluate, fits_memory
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Plan, Schedule, Stage, Topology
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.placement import common
from spiderflow.core.placement.common import _ChainEval, fallback_plan_chain, memory_first_split


def _tiny(seed: int) -> tuple[Topology, JobSpec, list[tuple[str, int]]]:
    """One or two small clusters with 1.5-8 GiB GPUs, so memory binds in many instances."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3))
    model = ModelSpec(name="t", layers=int(rng.integers(n, 7)), hidden=int(rng.choice([512, 1024, 2048])), heads=8,
                      vocab=8192)
    clusters = tuple(
        Cluster(name=f"c{i}", gpu=str(rng.choice(["A100-80G", "V100-16G", "T4"])), nodes=1,
                gpus_per_node=int(rng.choice([2, 4])), memory_gib=float(rng.choice([1.5, 3.0, 8.0])))
        for i in range(n)
    )
    links = tuple(Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=10.0, latency_ms=5.0) for i in range(n - 1))
    alloc = [(c.name, int(rng.integers(1, c.total_gpus + 1))) for c in clusters]
    m = int(rng.choice([2, 4, 8]))
    job = JobSpec(id="t", model=model, global_batch=m, micro_batch=1, seq_len=1024, gpus=GpuRange(min=1, max=64))
    return Topology(clusters=clusters, links=links), job, alloc


def _balanced(nl: int, pp: int, big_first: bool) -> list[int]:
    base, rem = divmod(nl, pp)
    return [base + 1] * rem + [base] * (pp - rem) if big_first else [base] * (pp - rem) + [base + 1] * rem


def _any_plan_fits(topo: Topology, job: JobSpec, alloc: list[tuple[str, int]]) -> bool:
    """Exhaustive: every split, and per cluster every degree and balanced sub-stage order the level-1
    planner can form, evaluated by the cost model."""
    L, k = job.model.layers, len(alloc)
    per_block: list[list[tuple[int, int, int]]] = []
    for name, g in alloc:
        c = topo.cluster(name)
        opts = []
        tp = 1
        while tp <= min(8, c.gpus_per_node, g):
            opts += [(tp, pp, g // (tp * pp)) for pp in (1, 2, 3, 4, 5, 6, 8, 12, 16) if tp * pp <= g]
            tp *= 2
        per_block.append(opts)
    for cut in itertools.combinations(range(1, L), k - 1):
        sizes = [b - a for a, b in zip((0, *cut), (*cut, L), strict=True)]
        for degrees in itertools.product(*per_block):
            if any(pp > nl for (_, pp, _), nl in zip(degrees, sizes, strict=True)):
                continue
            for orders in itertools.product((False, True), repeat=k):
                stages, first = [], 0
                for (name, _), nl, (tp, pp, dp), big in zip(alloc, sizes, degrees, orders, strict=True):
                    for sz in _balanced(nl, pp, big):
                        stages.append(Stage(cluster=name, first_layer=first, last_layer=first + sz - 1, tp=tp, dp=dp))
                        first += sz
                plan = evaluate(Plan(stages=tuple(stages), micro_batches=job.global_batch // job.micro_batch,
                                     schedule=Schedule.ONE_F_ONE_B), topo, job)
                if fits_memory(plan, topo)[0]:
                    return True
    return False


@pytest.mark.parametrize("seed", range(120))
def test_a_memory_first_structure_exists_exactly_when_some_plan_fits(seed: int) -> None:
    topo, job, alloc = _tiny(seed)
    ev = _ChainEval(topo, job, alloc, exact_gpus=False)
    most, found = memory_first_split(ev)
    assert (found is not None) == _any_plan_fits(topo, job, alloc), seed
    assert (most >= job.model.layers) == (found is not None)
    if found is not None:
        plan = common._memory_first_plan(ev, alloc)
        assert plan is not None and fits_memory(evaluate(plan, topo, job), topo)[0]


def test_instances_cover_both_outcomes() -> None:
    outcomes = {memory_first_split(_ChainEval(*_tiny(s), exact_gpus=False))[1] is None for s in range(120)}
    assert outcomes == {True, False}


def test_the_planner_falls_back_to_the_memory_first_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    topo, job, alloc = memory_bound_chain()
    plan = fallback_plan_chain(topo, job, alloc)
    assert fits_memory(plan, topo)[0]
    assert [(st.cluster, st.layers) for st in plan.stages] == [("montreal", 1), ("tokyo", 31)]
    # Without it, the search's own split does not fit.
    monkeypatch.setattr(common, "_memory_first_plan", lambda ev, allocation: None)
    with pytest.raises(UnschedulableError, match="GiB"):
        fallback_plan_chain(topo, job, alloc)


def test_nothing_fits_is_proven_before_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama3-70b on 2 T4s: the memory-first structures hold a few of its 80 layers, so the planner names
    the bound at once and never searches splits."""
    topo = Topology(clusters=(Cluster(name="a", gpu="T4", nodes=1, gpus_per_node=8, free_gpus=2),), links=())
    job = JobSpec(id="j", model=model_preset("llama3-70b"), global_batch=64, gpus=GpuRange(min=1, max=8))

    def no_search(*_a: object, **_k: object) -> None:
        raise AssertionError("searched")

    monkeypatch.setattr(common._ChainEval, "optimise", no_search)
    with pytest.raises(UnschedulableError, match=r"hold at most [0-9]+ at any degrees") as e:
        fallback_plan_chain(topo, job, [("a", 2)])
    assert e.value.constraint == "memory"


def test_finalise_asks_tpa_for_a_brief_answer_only_when_it_holds_a_level1_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a level-1 plan of the chain in hand, a TPA failure is not reported (the level-1 plan is kept), so
    TPA is asked not to explain it — for the allocation, for the GPUs the level-1 plan uses, which leave some
    idle, and for those of the level-1 plan with every shape competing; without one (``force=True``), its
    explanation is the answer."""
    import spiderflow.core.tpa as tpa

    topo, job, alloc = memory_bound_chain()
    job = replace(job, gpus=GpuRange(min=1, max=128))  # the memory-first plan leaves 7 of tokyo's GPUs idle
    seen: list[bool] = []

    def failing(*_a: object, explain: bool = True, **_k: object) -> None:
        seen.append(explain)
        raise UnschedulableError("does not fit", constraint="memory")

    monkeypatch.setattr(tpa, "plan_chain", failing)
    common.plan_cache_clear()
    fin = common.finalise(topo, job, [alloc])
    assert fin.plan is not None and fin.planner == "fallback" and seen == [False, False, False]
    small = Topology(clusters=(Cluster(name="a", gpu="T4", nodes=1, gpus_per_node=8, free_gpus=2),), links=())
    big = JobSpec(id="j", model=model_preset("llama3-70b"), global_batch=64, gpus=GpuRange(min=1, max=8))
    fin = common.finalise(small, big, [[("a", 2)]], force=True)
    assert fin.plan is None and seen == [False, False, False, True] and fin.error is not None
    common.plan_cache_clear()
