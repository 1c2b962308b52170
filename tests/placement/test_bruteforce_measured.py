"""The brute-force reference prices the work outside the blocks that a profile measured (the embedding's
and the head's time per micro-batch, their optimizer steps, the input pipeline per sample) and the clusters'
calibrated terms (``layer_overhead_ms``: fixed time per layer and micro-batch; ``optimizer_ms_per_layer``:
optimizer step per layer and training step) as the cost model does: its search objective for the plan it
returns is :func:`~spiderflow.core.costmodel.evaluate`'s step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import GpuRange, JobSpec, Topology
from spiderflow.core.placement.base import Budget, Objective
from spiderflow.core.placement.bruteforce import BruteForce, count_evaluations
from spiderflow.core.topogen import generate_topology

TERMS = {  # field: a range of sizes that matters next to these instances' steps
    "embedding_us_per_token": (2.0, 20.0), "head_us_per_token": (2.0, 20.0), "embedding_optimizer_ms": (5.0, 50.0),
    "head_optimizer_ms": (5.0, 50.0), "data_ms_per_sample": (0.5, 5.0),
}
CALIBRATED = {  # a cluster's calibrated field: a range of sizes that matters next to these instances' steps
    "layer_overhead_ms": (0.2, 2.0), "optimizer_ms_per_layer": (1.0, 10.0),
}


def _instance(seed: int) -> tuple[Topology, JobSpec]:
    rng = np.random.default_rng(seed)
    topo = generate_topology(int(rng.integers(2, 4)), seed)
    topo = topo.with_free({c.name: int(min(c.free, rng.integers(1, 9))) for c in topo.clusters})
    model = ModelSpec(name="tiny", layers=int(rng.integers(4, 9)), hidden=1024, heads=16, vocab=32000)
    total = topo.total_free_gpus
    job = JobSpec(id=f"j{seed}", model=model, global_batch=32, micro_batch=1, seq_len=1024,
                  gpus=GpuRange(min=1, max=total))
    return topo, job


SEEDS = [s for s in range(30) if count_evaluations(*_instance(s)) <= 300_000][:3]


def _check_term(term: str, lo: float, hi: float) -> None:
    """``term`` alone, drawn per cluster from ``[lo, hi)``: the search's objective is the returned plan's step,
    and the term moves that step on every seed."""
    assert len(SEEDS) == 3
    for seed in SEEDS:
        bare, job = _instance(seed)
        rng = np.random.default_rng(1000 + seed)
        topo = Topology(clusters=tuple(replace(c, **{term: float(rng.uniform(lo, hi))}) for c in bare.clusters),
                        links=bare.links)
        res = BruteForce().place(topo, job, Budget(objective=Objective.JCT, seed=seed))
        assert res.ok and res.plan is not None, res.reason
        assert res.stats["objective"] == pytest.approx(res.plan.step_time_s, rel=1e-9)
        assert res.plan.step_time_s > evaluate(res.plan, bare, job).step_time_s * (1 + 1e-3)  # the term counts


@pytest.mark.parametrize("term", sorted(TERMS))
def test_bruteforce_prices_each_measured_term_as_the_cost_model(term: str) -> None:
    _check_term(term, *TERMS[term])


@pytest.mark.parametrize("term", sorted(CALIBRATED))
def test_bruteforce_prices_each_calibrated_term_as_the_cost_model(term: str) -> None:
    _check_term(term, *CALIBRATED[term])
