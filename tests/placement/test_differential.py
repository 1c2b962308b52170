"""SpinSearch against the brute-force reference on seeded tiny instances (≤ 4 clusters)."""

from __future__ import annotations

import numpy as np
import pytest

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.domain import GpuRange, JobSpec, Topology
from spiderflow.core.placement.base import Budget, Objective
from spiderflow.core.placement.bruteforce import BruteForce, count_evaluations
from spiderflow.core.placement.common import check_plan, plan_objective
from spiderflow.core.placement.spinsearch import SpinSearch
from spiderflow.core.topogen import generate_topology


def tiny_instance(seed: int, *, max_clusters: int = 4) -> tuple[Topology, JobSpec, Budget]:
    """2..max_clusters clusters with 1..8 free GPUs each, a 4–12 layer model and a random GPU range."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, max_clusters + 1))
    topo = generate_topology(n, seed)
    topo = topo.with_free({c.name: int(min(c.free, rng.integers(1, 9))) for c in topo.clusters})
    layers = int(rng.integers(4, 13))
    hidden = int(rng.choice([1024, 2048, 4096]))
    model = ModelSpec(name="tiny", layers=layers, hidden=hidden, heads=16, vocab=32000)
    total = topo.total_free_gpus
    gmin = int(rng.integers(1, total + 1))
    gmax = int(rng.integers(gmin, total + 8))
    job = JobSpec(
        id=f"j{seed}", model=model, global_batch=int(rng.choice([32, 64, 128])), micro_batch=1,
        seq_len=int(rng.choice([512, 1024, 2048])), gpus=GpuRange(min=gmin, max=gmax),
    )
    objective = (Objective.JCT, Objective.COST, Objective.BALANCED)[seed % 3]
    return topo, job, Budget(objective=objective, seed=seed)


SEEDS = [s for s in range(40) if count_evaluations(*tiny_instance(s)[:2]) <= 3_000_000][:24]


@pytest.mark.parametrize("seed", SEEDS)
def test_spinsearch_within_3_percent_of_bruteforce(seed: int) -> None:
    topo, job, budget = tiny_instance(seed)
    ref = BruteForce().place(topo, job, budget)
    got = SpinSearch(planner=None).place(topo, job, budget)
    assert ref.ok, ref.reason
    assert ref.optimal is True
    assert got.ok, got.reason
    assert ref.plan is not None and got.plan is not None
    assert check_plan(got.plan, topo, job) == []
    best = plan_objective(ref.plan, budget.objective)
    mine = plan_objective(got.plan, budget.objective)
    assert mine <= best * 1.03, (seed, budget.objective, mine, best, got.plan.stages, ref.plan.stages)


def test_enough_differential_instances() -> None:
    assert len(SEEDS) >= 20


@pytest.mark.parametrize("seed", [11, 14, 21])
def test_bruteforce_is_exact_on_two_cluster_instances(seed: int) -> None:
    """Independent enumeration of the same space with the cost model itself: nothing beats bruteforce."""
    import itertools

    from spiderflow.core.costmodel import evaluate
    from spiderflow.core.domain import Plan, Stage
    from spiderflow.core.placement.bruteforce import cluster_options

    topo, job, budget = tiny_instance(seed)
    assert len(topo.clusters) == 2
    ref = BruteForce().place(topo, job, budget)
    assert ref.ok and ref.plan is not None
    best = plan_objective(ref.plan, budget.objective)
    names = [c.name for c in topo.clusters]
    L = job.model.layers
    checked = 0
    for chain in ([names[0]], [names[1]], names, names[::-1]):
        splits = [[L]] if len(chain) == 1 else [[a, L - a] for a in range(1, L)]
        for sizes in splits:
            for opts in itertools.product(*[cluster_options(topo.cluster(c)) for c in chain]):
                stages, first = [], 0
                for c, (tp, dp), sz in zip(chain, opts, sizes, strict=True):
                    stages.append(Stage(cluster=c, first_layer=first, last_layer=first + sz - 1, tp=tp, dp=dp))
                    first += sz
                plan = evaluate(Plan(stages=tuple(stages), micro_batches=job.micro_batches_total), topo, job)
                if check_plan(plan, topo, job):
                    continue
                checked += 1
                assert plan_objective(plan, budget.objective) >= best * (1 - 1e-9), (plan, ref.plan)
    assert checked > 0


def test_bruteforce_refuses_more_than_six_clusters() -> None:
    from spiderflow.core.errors import ValidationError
    from spiderflow.core.topogen import generate_topology

    topo = generate_topology(7, 0)
    _, job, _ = tiny_instance(0)
    with pytest.raises(ValidationError, match="at most 6"):
        BruteForce().place(topo, job)
