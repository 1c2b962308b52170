"""The simulator honours jobs' resource constraints: it runs the scheduler's own cycle, so every placement is
on allowed clusters, and a job whose constraints no cluster satisfies is given up with the reason."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Cluster, Constraints, GpuRange, JobSpec, Link, Topology
from spiderflow.core.sim.engine import OverheadMode, SimConfig, simulate

TOPO = Topology(
    clusters=(Cluster(name="virginia", gpu="A100-80G", nodes=1, gpus_per_node=8, region="us-east"),
              Cluster(name="ohio", gpu="V100-32G", nodes=2, gpus_per_node=8, region="us-east"),
              Cluster(name="frankfurt", gpu="H100-80G", nodes=1, gpus_per_node=8, region="eu-central"),
              Cluster(name="paris", gpu="A100-40G", nodes=1, gpus_per_node=8, region="eu-west")),
    links=(Link(a="virginia", b="ohio", bandwidth_gbps=10, latency_ms=11),
           Link(a="virginia", b="frankfurt", bandwidth_gbps=5, latency_ms=45),
           Link(a="frankfurt", b="paris", bandwidth_gbps=10, latency_ms=8),
           Link(a="ohio", b="paris", bandwidth_gbps=2, latency_ms=50)),
)
ALLOWED = {
    "no-ohio": {"virginia", "frankfurt", "paris"},
    "a100": {"virginia", "paris"},
    "europe": {"frankfurt", "paris"},
    "anywhere": {"virginia", "ohio", "frankfurt", "paris"},
}


def _job(jid: str, arrival: float, gmin: int, gmax: int, c: Constraints) -> JobSpec:
    return JobSpec(id=jid, model=model_preset("gpt3-1.3b"), global_batch=64, seq_len=1024, steps=200,
                   gpus=GpuRange(min=gmin, max=gmax), arrival_s=arrival, constraints=c)


@pytest.mark.parametrize("policy", ["spinsearch", "bace", "firstfit"])
def test_simulated_jobs_run_only_where_allowed(policy: str) -> None:
    jobs = [
        _job("no-ohio", 0, 8, 16, Constraints(exclude_clusters=("ohio",))),
        _job("a100", 10, 4, 16, Constraints(gpu_types=("A100",))),
        _job("europe", 20, 4, 16, Constraints(regions=("eu-central", "eu-west"))),
        _job("anywhere", 30, 4, 16, Constraints()),
        _job("t4-only", 40, 1, 8, Constraints(gpu_types=("T4",))),
        _job("too-big", 50, 24, 32, Constraints(exclude_regions=("us-east",))),
    ]
    res = simulate(TOPO, jobs, policy, SimConfig(overhead=OverheadMode.FIXED, seed=1))
    assert not res.violations
    by_id = {r.id: r for r in res.records}
    for jid, allowed in ALLOWED.items():
        r = by_id[jid]
        assert r.status == "completed", (policy, jid, r.reason)
        assert r.chain and set(r.chain) <= allowed, (policy, jid, r.chain)
    assert by_id["t4-only"].status == "unresolvable"
    assert "its constraints (gpu_types T4) allow no cluster" in by_id["t4-only"].reason
    assert by_id["too-big"].status == "unresolvable"
    assert by_id["too-big"].reason == ("needs at least 24 GPUs and the clusters its constraints (exclude_regions "
                                       "us-east) allow (frankfurt, paris) offer 16")
