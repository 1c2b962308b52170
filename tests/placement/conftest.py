"""Seeded tiny instances shared by the placement tests."""

from __future__ import annotations

import numpy as np

from spiderflow.catalog import ModelSpec
from spiderflow.domain import GpuRange, JobSpec, Topology
from spiderflow.placement.base import Budget, Objective
from spiderflow.topogen import generate_topology

__all__ = ["tiny_instance"]


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
