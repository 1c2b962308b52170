"""The planner chooses the micro-batch count on the exact timeline: the plan it returns simulates no slower
than the 1F1B plan it would return pinned to any other candidate count."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec, Schedule
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.topogen import generate_topology
from spiderflow.core.tpa import micro_batch_candidates, plan_chain


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 5_000), st.integers(1, 3), st.sampled_from(["gpt3-1.3b", "gpt3-6.7b", "gpt3-13b"]),
       st.sampled_from([32, 64, 128]))
def test_the_chosen_count_has_the_best_simulated_step(seed: int, k: int, model: str, batch: int) -> None:
    topo = generate_topology(6, seed)
    rng = np.random.default_rng(seed)
    alloc = [(topo.clusters[int(i)].name, topo.clusters[int(i)].free) for i in rng.permutation(6)[:k]]
    job = JobSpec(id="m", model=model_preset(model), global_batch=batch, gpus=GpuRange(min=1, max=10_000))
    try:
        plan = plan_chain(topo, job, alloc)
    except UnschedulableError:
        return
    best = plan.extras["timeline_step_s"]
    for m in micro_batch_candidates(batch, k):
        try:
            pinned = plan_chain(topo, job, alloc, micro_batches=[m], schedules=[Schedule.ONE_F_ONE_B])
        except UnschedulableError:
            continue
        assert best <= pinned.extras["timeline_step_s"] * (1 + 1e-9), (m, plan.micro_batches)
