"""SpinSearch's chain scorer and the level-1 planner rank in the job's precision: compute rates by the GPU
type's per-precision peak, gradient and activation bytes and optimizer state by the precision's sizes."""

from __future__ import annotations

import numpy as np
import pytest

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Precision, Topology
from spiderflow.core.placement.base import Budget
from spiderflow.core.placement.common import fallback_plan_chain, job_consts, score_chains, topo_arrays, transfer_matrix
from spiderflow.core.placement.spinsearch import SpinSearch

MODEL = ModelSpec(name="small", layers=16, hidden=1024, heads=16, vocab=32000)


def _topo() -> Topology:
    """8 A100s (bf16 312 TFLOPS, fp32 19.5) and 8 A10Gs (bf16 70, fp32 31.2) a slow link apart: the A100s
    are 4.5× faster in bf16, the A10Gs 1.6× faster in fp32."""
    return Topology(
        clusters=(Cluster(name="a100", gpu="A100-80G", nodes=1, gpus_per_node=8),
                  Cluster(name="a10g", gpu="A10G", nodes=1, gpus_per_node=8)),
        links=(Link(a="a100", b="a10g", bandwidth_gbps=1.0, latency_ms=50.0),),
    )


def _job(precision: Precision) -> JobSpec:
    return JobSpec(id="p", model=MODEL, global_batch=64, micro_batch=4, seq_len=1024, gpus=GpuRange(min=1, max=8),
                   precision=precision)


@pytest.mark.parametrize(("precision", "fastest"), [(Precision.BF16, "a100"), (Precision.FP32, "a10g"),
                                                     (Precision.TF32, "a100")])
def test_spinsearch_places_on_the_cluster_fastest_in_the_jobs_precision(precision: Precision, fastest: str) -> None:
    topo, job = _topo(), _job(precision)
    res = SpinSearch(planner=None).place(topo, job, Budget())
    assert res.ok and res.plan is not None
    assert {st.cluster for st in res.plan.stages} == {fastest}
    # The cost model agrees: the chosen cluster's plan is the faster one in this precision.
    steps = {name: fallback_plan_chain(topo, job, [(name, 8)]).step_time_s for name in ("a100", "a10g")}
    assert min(steps, key=steps.__getitem__) == fastest


@pytest.mark.parametrize("precision", list(Precision))
def test_scorer_and_fallback_price_single_cluster_chains_in_the_jobs_precision(precision: Precision) -> None:
    """The planner's plan is priced as the cost model prices it; on one cluster the scorer's estimate is within
    5 % of it (the scorer picks its TP degree by its own formula): no bf16 rate or 2-byte gradient left in
    either (the fp32 rate of an A100 is 1/16 of its bf16 rate)."""
    topo, job = _topo(), _job(precision)
    ta, jc = topo_arrays(topo), job_consts(job)
    for i, name in enumerate(ta.names):
        plan = fallback_plan_chain(topo, job, [(name, 8)])
        assert plan.step_time_s == pytest.approx(evaluate(plan, topo, job).step_time_s, rel=1e-12)
        sc = score_chains(ta, jc, transfer_matrix(ta, jc), np.array([[i]]), np.array([[8]]))
        if len(plan.stages) == 1:
            assert sc.step[0] == pytest.approx(plan.step_time_s, rel=0.05)


def test_fp32_state_is_priced_at_20_bytes_per_parameter_in_the_scorer() -> None:
    """A model whose bf16 state (16 B/parameter) fits one GPU and whose fp32 state (20 B) does not: the scorer
    says so (capacity below the layers with one GPU), as the cost model does."""
    model = ModelSpec(name="edge", layers=22, hidden=4096, heads=32, vocab=32000)  # 4.7e9 parameters
    topo = Topology(clusters=(Cluster(name="one", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    ta = topo_arrays(topo)
    fits = {}
    for precision in (Precision.BF16, Precision.FP32):
        job = JobSpec(id="e", model=model, global_batch=1, micro_batch=1, seq_len=128, gpus=GpuRange(min=1, max=1),
                      precision=precision)
        jc = job_consts(job)
        sc = score_chains(ta, jc, transfer_matrix(ta, jc), np.array([[0]]), np.array([[1]]))
        fits[precision] = bool(sc.feasible[0])
    assert fits == {Precision.BF16: True, Precision.FP32: False}
