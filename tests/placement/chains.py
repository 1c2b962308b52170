"""Chains the placement tests share."""

from __future__ import annotations

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Topology

__all__ = ["memory_bound_chain"]


def memory_bound_chain() -> tuple[Topology, JobSpec, list[tuple[str, int]]]:
    """One free RTX 3090 and 15 V100-32G across a slow link: llama3-8b's 32 layers fit only as a 1 + 31 split
    with the V100s at tensor degree 8; the planner's search from proportional splits ends over memory, the
    memory-first plan fits."""
    clusters = (
        Cluster(name="montreal", gpu="RTX3090", nodes=6, gpus_per_node=4, intra_node_gbps=128.0, inter_node_gbps=25.0,
                free_gpus=1),
        Cluster(name="tokyo", gpu="V100-32G", nodes=5, gpus_per_node=8, intra_node_gbps=1200.0, inter_node_gbps=100.0,
                free_gpus=15),
    )
    topo = Topology(clusters=clusters, links=(Link(a="montreal", b="tokyo", bandwidth_gbps=1.13, latency_ms=149.0),))
    job = JobSpec(id="j", model=model_preset("llama3-8b"), global_batch=512, micro_batch=2, seq_len=2048,
                  gpus=GpuRange(min=16, max=128))
    return topo, job, [("montreal", 1), ("tokyo", 15)]
