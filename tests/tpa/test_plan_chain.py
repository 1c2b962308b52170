"""plan_chain: the contract other components rely on."""

from __future__ import annotations

import pytest

from spiderflow.costmodel import evaluate
from spiderflow.domain import JobSpec, Topology
from spiderflow.errors import UnschedulableError, ValidationError
from spiderflow.tpa import plan_chain


def test_plan_uses_the_allocation_in_chain_order(three_region_topo: Topology, job_6b7: JobSpec) -> None:
    alloc = [("ohio", 16), ("tokyo", 8), ("paris", 8)]
    plan = plan_chain(three_region_topo, job_6b7, alloc)
    assert plan.chain == ("ohio", "tokyo", "paris")
    assert plan.gpus_by_cluster() == dict(alloc)
    assert plan.layers == job_6b7.model.layers
    assert job_6b7.global_batch % plan.micro_batches == 0
    # Predictions are the shared cost model's, and the plan fits memory.
    again = evaluate(plan, three_region_topo, job_6b7)
    assert again.step_time_s == pytest.approx(plan.step_time_s)
    for st, mem in zip(plan.stages, plan.memory_gib_per_gpu, strict=True):
        assert mem <= three_region_topo.cluster(st.cluster).gpu_memory_gib
    assert plan.extras["timeline_step_s"] > 0


def test_unknown_cluster_is_a_validation_error(three_region_topo: Topology, job_6b7: JobSpec) -> None:
    with pytest.raises(ValidationError, match=r"allocation\[1\]\.cluster"):
        plan_chain(three_region_topo, job_6b7, [("ohio", 8), ("nowhere", 8)])


def test_more_gpus_than_free_is_unschedulable(three_region_topo: Topology, job_6b7: JobSpec) -> None:
    with pytest.raises(UnschedulableError) as ei:
        plan_chain(three_region_topo, job_6b7, [("tokyo", 9)])
    assert ei.value.constraint == "free_gpus"
