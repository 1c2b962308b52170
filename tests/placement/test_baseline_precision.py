"""The baselines price in the job's precision, as SpinSearch's scorer does: compute rates by the GPU type's
per-precision peak, gradient, activation and state bytes by the precision's sizes (the same information for
every policy)."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Precision, Topology
from spiderflow.core.placement.base import Budget, get_policy
from spiderflow.core.placement.bruteforce import BruteForce

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


@pytest.mark.parametrize("policy", ["bruteforce", "ilp", "genetic"])
@pytest.mark.parametrize(("precision", "fastest"), [(Precision.BF16, "a100"), (Precision.FP32, "a10g")])
def test_baselines_place_on_the_cluster_fastest_in_the_jobs_precision(
    policy: str, precision: Precision, fastest: str
) -> None:
    res = get_policy(policy).place(_topo(), _job(precision), Budget())
    assert res.ok and res.plan is not None
    assert {st.cluster for st in res.plan.stages} == {fastest}


def test_bruteforce_prices_fp32_state_at_20_bytes_per_parameter() -> None:
    """A model whose bf16 state fits one GPU and whose fp32 state does not: bruteforce's exact tables say so
    (unschedulable on memory), as the cost model does."""
    model = ModelSpec(name="edge", layers=22, hidden=4096, heads=32, vocab=32000)  # 4.7e9 parameters
    topo = Topology(clusters=(Cluster(name="one", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    ok = {}
    for precision in (Precision.BF16, Precision.FP32):
        job = JobSpec(id="e", model=model, global_batch=1, micro_batch=1, seq_len=128, gpus=GpuRange(min=1, max=1),
                      precision=precision)
        ok[precision] = BruteForce().place(topo, job, Budget()).ok
    assert ok == {Precision.BF16: True, Precision.FP32: False}
