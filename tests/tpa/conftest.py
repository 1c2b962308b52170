"""Shared fixtures for the TPA tests: small topologies and jobs."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Topology


@pytest.fixture
def three_region_topo() -> Topology:
    clusters = (
        Cluster(name="ohio", gpu="A100-80G", nodes=2, gpus_per_node=8),
        Cluster(name="tokyo", gpu="H100-80G", nodes=1, gpus_per_node=8),
        Cluster(name="paris", gpu="V100-32G", nodes=2, gpus_per_node=4),
    )
    links = (
        Link(a="ohio", b="tokyo", bandwidth_gbps=10, latency_ms=60),
        Link(a="tokyo", b="paris", bandwidth_gbps=5, latency_ms=80),
    )
    return Topology(clusters=clusters, links=links)


@pytest.fixture
def job_6b7() -> JobSpec:
    return JobSpec(id="j", model=model_preset("gpt3-6.7b"), global_batch=64, gpus=GpuRange(min=1, max=64))
