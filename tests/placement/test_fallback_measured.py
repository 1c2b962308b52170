"""The level-1 fallback planner's search prices the work outside the blocks that a profile measured (the
embedding's and the head's time per micro-batch, their optimizer steps, the input pipeline per sample) and the
clusters' calibrated terms (``layer_overhead_ms``: fixed time per layer and micro-batch; ``optimizer_ms_per_layer``:
optimizer step per layer and training step) as the cost model does: for the plan
:func:`~spiderflow.core.placement.common.fallback_plan_chain` returns, the search's objective (the step of that
split under its blocks' own sub-stage counts) is :func:`~spiderflow.core.costmodel.evaluate`'s step, each term
set alone on generated chains."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import GpuRange, JobSpec, Plan, Topology
from spiderflow.core.placement import common
from spiderflow.core.topogen import generate_topology

TERMS = {  # field: a range of sizes that matters next to these instances' steps
    "embedding_us_per_token": (20.0, 200.0), "head_us_per_token": (20.0, 200.0),
    "embedding_optimizer_ms": (50.0, 500.0), "head_optimizer_ms": (50.0, 500.0), "data_ms_per_sample": (5.0, 50.0),
}

CALIBRATED = {  # a cluster's calibrated field: a range of sizes that matters next to these instances' steps
    "layer_overhead_ms": (2.0, 20.0), "optimizer_ms_per_layer": (10.0, 100.0),
}

Case = tuple[Topology, JobSpec, list[tuple[str, int]]]


def _instance(seed: int) -> Case:
    """A chain of 1-3 distinct clusters of a generated topology with 1-16 GPUs each and a model of 12-32 layers
    of hidden size 4096 (the seeds below: the search's own split ends within memory and keeps the GPU minimum,
    so the plan is the search's; blocks of several sub-stages, the embedding's and the head's included, with
    and without data parallelism, among them)."""
    rng = np.random.default_rng(seed)
    topo = generate_topology(int(rng.integers(3, 7)), seed, "geo")
    k = int(rng.integers(1, 4))
    names = [topo.clusters[int(i)].name for i in rng.permutation(len(topo.clusters))[:k]]
    alloc = [(n, min(topo.cluster(n).free, int(rng.integers(1, 17)))) for n in names]
    model = ModelSpec(name="m", layers=int(rng.integers(k + 3, 25)) + 8, hidden=4096, heads=32, vocab=32000)
    m = int(rng.choice([4, 16, 32]))
    job = JobSpec(id=f"j{seed}", model=model, global_batch=m * 2, micro_batch=2, seq_len=1024,
                  gpus=GpuRange(min=1, max=4096))
    return topo, job, alloc


def _search_step(topo: Topology, job: JobSpec, alloc: list[tuple[str, int]], plan: Plan) -> float:
    """The search's ``(excess, step)`` step for the split of ``plan`` under its blocks' sub-stage counts,
    checking that the blocks the search chooses there are the plan's stages."""
    ev = common._ChainEval(topo, job, alloc, exact_gpus=False)
    groups = [list(g) for _, g in itertools.groupby(plan.stages, key=lambda st: st.cluster)]
    assert [g[0].cluster for g in groups] == [c for c, _ in alloc]
    sizes = [sum(st.layers for st in g) for g in groups]
    excess, step, blocks = ev.evaluate_split(sizes, [len(g) for g in groups])
    assert excess == 0.0
    for g, blk in zip(groups, blocks, strict=True):
        assert blk.sizes == tuple(st.layers for st in g)
        assert {(st.tp, st.dp) for st in g} == {(blk.tp, blk.dp)}
    return step


def _with(topo: Topology, rng: np.random.Generator, ranges: dict[str, tuple[float, float]]) -> Topology:
    """``topo`` with each cluster's ``ranges`` fields drawn uniformly from their ranges."""
    fresh: list[Any] = [replace(c, **{f: float(rng.uniform(*r)) for f, r in ranges.items()})  # type: ignore[arg-type]
                        for c in topo.clusters]
    return Topology(clusters=tuple(fresh), links=topo.links)


SEEDS = [1, 2, 4, 6, 26, 35]


def _check_term(term: str, lo_hi: tuple[float, float]) -> None:
    """``term`` alone, drawn per cluster from ``lo_hi``: the search's step of its plan is ``evaluate``'s, and the
    term moves it on every seed."""
    counted = 0
    for seed in SEEDS:
        bare, job, alloc = _instance(seed)
        rng = np.random.default_rng(1000 + seed)
        topo = _with(bare, rng, {term: lo_hi})
        plan = common.fallback_plan_chain(topo, job, alloc)
        assert plan.step_time_s == evaluate(plan, topo, job).step_time_s
        assert _search_step(topo, job, alloc, plan) == pytest.approx(plan.step_time_s, rel=1e-9), seed
        bare_step = evaluate(plan, bare, job).step_time_s
        counted += abs(plan.step_time_s - bare_step) > 1e-3 * bare_step  # the term counts
    assert counted == len(SEEDS)


@pytest.mark.parametrize("term", sorted(TERMS))
def test_fallback_search_prices_each_measured_term_as_the_cost_model(term: str) -> None:
    _check_term(term, TERMS[term])


@pytest.mark.parametrize("term", sorted(CALIBRATED))
def test_fallback_search_prices_each_calibrated_term_as_the_cost_model(term: str) -> None:
    _check_term(term, CALIBRATED[term])


def test_fallback_search_prices_every_measured_term_at_once_as_the_cost_model() -> None:
    for seed in SEEDS:
        bare, job, alloc = _instance(seed)
        rng = np.random.default_rng(2000 + seed)
        topo = _with(bare, rng, TERMS | CALIBRATED)
        plan = common.fallback_plan_chain(topo, job, alloc)
        assert _search_step(topo, job, alloc, plan) == pytest.approx(plan.step_time_s, rel=1e-9), seed


def test_without_measured_terms_the_search_step_is_the_cost_models() -> None:
    for seed in SEEDS:
        topo, job, alloc = _instance(seed)
        plan = common.fallback_plan_chain(topo, job, alloc)
        assert _search_step(topo, job, alloc, plan) == pytest.approx(plan.step_time_s, rel=1e-9), seed
