"""Trace generator: determinism, the model mix, GPU ranges, durations and Poisson arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from spiderflow.core.errors import ValidationError
from spiderflow.core.sim.tracegen import (
    BASE_INTERARRIVAL_S,
    DURATION_RANGE_S,
    MODEL_MIX,
    REFERENCE_TFLOPS,
    generate_trace,
    job_training_flops,
)
from spiderflow.core.topogen import generate_topology


def test_deterministic_for_a_seed() -> None:
    assert generate_trace(200, 7) == generate_trace(200, 7)
    assert generate_trace(200, 7) != generate_trace(200, 8)


def test_statistics_of_a_large_trace() -> None:
    jobs = generate_trace(3000, 1)
    assert len(jobs) == 3000 and len({j.id for j in jobs}) == 3000
    names = [j.model.name for j in jobs]
    for name, share, *_ in MODEL_MIX:
        assert abs(names.count(name) / len(jobs) - share) < 0.035, name
    # More small than large models.
    assert names.count("gpt3-1.3b") > names.count("gpt3-13b") > names.count("llama3-70b")
    sizes = {j.model.total_params for j in jobs}
    assert min(sizes) < 1.5e9 and max(sizes) > 65e9
    # GPU ranges as declared; durations within range on the reference GPU at min GPUs.
    mix = {m[0]: m for m in MODEL_MIX}
    lo, hi = DURATION_RANGE_S
    durations = []
    for j in jobs:
        _, _, gmin, gmax, batch, micro = mix[j.model.name]
        assert (j.gpus.min, j.gpus.max, j.global_batch, j.micro_batch) == (gmin, gmax, batch, micro)
        d = job_training_flops(j) / (j.gpus.min * REFERENCE_TFLOPS * 1e12)
        per_step = job_training_flops(j, 1) / (j.gpus.min * REFERENCE_TFLOPS * 1e12)
        assert lo - per_step <= d <= hi + per_step
        durations.append(d)
    assert np.median(durations) > 1800  # minutes to hours, not seconds
    # Poisson arrivals: sorted, mean gap ≈ BASE_INTERARRIVAL_S, coefficient of variation ≈ 1.
    arr = np.array([j.arrival_s for j in jobs])
    assert arr[0] == 0.0 and np.all(np.diff(arr) >= 0)
    gaps = np.diff(arr)
    assert gaps.mean() == pytest.approx(BASE_INTERARRIVAL_S, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.08)
    prios = [j.priority for j in jobs]
    assert prios.count(0) > prios.count(10) > prios.count(-10) > 0


def test_load_scales_arrival_rate_against_topology_capacity() -> None:
    topo = generate_topology(8, 3, "geo")
    span1 = generate_trace(400, 2, 1.0, topo)[-1].arrival_s
    span2 = generate_trace(400, 2, 2.0, topo)[-1].arrival_s
    assert span2 == pytest.approx(span1 / 2, rel=1e-3)
    jobs = generate_trace(2000, 4, 1.0, topo)
    capacity = sum(c.free * c.effective_tflops * 1e12 for c in topo.clusters)
    offered = sum(job_training_flops(j) for j in jobs) / (jobs[-1].arrival_s * capacity)
    assert offered == pytest.approx(1.0, rel=0.1)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValidationError, match="jobs"):
        generate_trace(0, 1)
    with pytest.raises(ValidationError, match="load"):
        generate_trace(10, 1, load=0.0)
