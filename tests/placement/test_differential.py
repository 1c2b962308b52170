"""SpinSearch against the brute-force reference on seeded tiny instances (≤ 4 clusters)."""

from __future__ import annotations

import pytest

from spiderflow.placement.bruteforce import BruteForce, count_evaluations
from spiderflow.placement.common import check_plan, plan_objective
from spiderflow.placement.spinsearch import SpinSearch
from tests.placement.conftest import tiny_instance

SEEDS = [s for s in range(40) if count_evaluations(*tiny_instance(s)[:2]) <= 3_000_000][:24]


@pytest.mark.parametrize("seed", SEEDS)
def test_spinsearch_within_3_percent_of_bruteforce(seed: int) -> None:
    topo, job, budget = tiny_instance(seed)
    ref = BruteForce().place(topo, job, budget)
    got = SpinSearch(planner="fallback").place(topo, job, budget)
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


def test_bruteforce_is_exhaustive_on_a_two_cluster_instance() -> None:
    """On a 2-cluster instance every single/pair chain is checked: no chain of the same space beats it."""
    from spiderflow.placement.bruteforce import cluster_options
    from spiderflow.placement.common import plan_with_split

    topo, job, budget = tiny_instance(11)
    ref = BruteForce().place(topo, job, budget)
    assert ref.ok and ref.plan is not None
    best = plan_objective(ref.plan, budget.objective)
    names = [c.name for c in topo.clusters]
    for chain in ([names[0]], [names[1]], names, names[::-1]):
        for sizes in ([job.model.layers],) if len(chain) == 1 else (
            [a, job.model.layers - a] for a in range(1, job.model.layers)
        ):
            grids = [[tp * dp for tp, dp in cluster_options(topo.cluster(c))] for c in chain]
            import itertools

            for gp in itertools.product(*grids):
                if not job.gpus.min <= sum(gp) <= job.gpus.max:
                    continue
                try:
                    plan = plan_with_split(topo, job, list(zip(chain, gp, strict=True)), list(sizes))
                except Exception:
                    continue
                if check_plan(plan, topo, job) or any(s.cluster != c for s, c in zip(plan.stages, chain)):
                    continue
                if len(plan.stages) != len(chain):
                    continue
                assert plan_objective(plan, budget.objective) >= best * (1 - 1e-9)


def test_bruteforce_refuses_more_than_six_clusters() -> None:
    from spiderflow.errors import ValidationError
    from spiderflow.topogen import generate_topology

    topo = generate_topology(7, 0)
    _, job, _ = tiny_instance(0)
    with pytest.raises(ValidationError, match="at most 6"):
        BruteForce().place(topo, job)
