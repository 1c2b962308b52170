"""Synthetic multi-tenant job traces: Poisson arrivals, a realistic model mix, GPU ranges and durations.

Model mix (probability; GPU range; global batch × micro-batch, sequence 2048): more small jobs than large
ones, as in published cluster traces where most jobs are small and a few large ones hold most GPU time.

==============  ======  ============  ==============
model           share   GPUs min–max  batch / micro
==============  ======  ============  ==============
gpt3-1.3b       0.30    4 – 32        256 / 4
gpt3-2.7b       0.22    8 – 64        256 / 4
gpt3-6.7b       0.18    16 – 64       512 / 2
llama3-8b       0.12    16 – 128      512 / 2
gpt3-13b        0.12    32 – 128      1024 / 2
llama3-70b      0.06    64 – 256      1024 / 1
==============  ======  ============  ==============

Duration: a target run time ``D`` on the job's minimum GPU count at a reference GPU
(:data:`REFERENCE_TFLOPS` achieved TFLOPS) is drawn log-uniformly from :data:`DURATION_RANGE_S`
(10 minutes to 8 hours); ``steps = max(1, round(D · min_gpus · F_ref / W_step))`` where ``W_step`` is
the training FLOPs of one step (3 × forward, :func:`spiderflow.core.costmodel.stage_fwd_flops`). Run times on
real plans then differ with the GPUs chosen and the network, as they should.

Arrivals: a Poisson process, exponential inter-arrival gaps of mean ``1/λ``. Without a topology
``λ = load / BASE_INTERARRIVAL_S``. With one, ``λ`` makes the *offered load* equal ``load``:
``λ = load · Σ_c free_c · F_c / E[W_job]`` (``F_c`` achieved FLOP/s per GPU of cluster ``c``, ``E[W_job]``
the mean training FLOPs of the sampled jobs), so ``load = 1`` keeps the pool busy on average.
Priorities: 0 for 85 %, 10 (urgent) for 10 %, −10 (best effort) for 5 %. Tenants ``t0`` … ``t3``.

Deterministic: one ``numpy.random.Generator`` seeded with ``seed``; no global RNG. Cost: O(jobs).
"""

from __future__ import annotations

import math

import numpy as np

from spiderflow.core.catalog import model_preset
from spiderflow.core.costmodel import stage_fwd_flops
from spiderflow.core.domain import GpuRange, JobSpec, Topology
from spiderflow.core.errors import ValidationError

__all__ = [
    "BASE_INTERARRIVAL_S",
    "DURATION_RANGE_S",
    "MODEL_MIX",
    "REFERENCE_TFLOPS",
    "generate_trace",
    "job_training_flops",
]

# (preset, probability, min GPUs, max GPUs, global batch, micro-batch)
MODEL_MIX: tuple[tuple[str, float, int, int, int, int], ...] = (
    ("gpt3-1.3b", 0.30, 4, 32, 256, 4),
    ("gpt3-2.7b", 0.22, 8, 64, 256, 4),
    ("gpt3-6.7b", 0.18, 16, 64, 512, 2),
    ("llama3-8b", 0.12, 16, 128, 512, 2),
    ("gpt3-13b", 0.12, 32, 128, 1024, 2),
    ("llama3-70b", 0.06, 64, 256, 1024, 1),
)
SEQ_LEN = 2048
REFERENCE_TFLOPS = 125.0
DURATION_RANGE_S = (600.0, 8 * 3600.0)
BASE_INTERARRIVAL_S = 600.0
_PRIORITIES = ((0, 0.85), (10, 0.10), (-10, 0.05))
_TENANTS = 4


def job_training_flops(job: JobSpec, steps: int | None = None) -> float:
    """Training FLOPs of ``steps`` steps (default: all of the job's): ``steps · 3 · forward(global batch)``."""
    n = job.steps if steps is None else steps
    per_micro = 3.0 * stage_fwd_flops(job.model, 0, job.model.layers - 1, job.micro_batch, job.seq_len)
    return n * per_micro * job.micro_batches_total


def generate_trace(jobs: int, seed: int, load: float = 1.0, topo: Topology | None = None) -> list[JobSpec]:
    """``jobs`` jobs sorted by arrival, ids ``job-00000`` …; see the module docstring for the distributions.

    Raises :class:`ValidationError` for ``jobs < 1`` or a non-positive or non-finite ``load``.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValidationError("jobs", "must be a positive integer", jobs)
    if not isinstance(load, int | float) or not math.isfinite(load) or load <= 0:
        raise ValidationError("load", "must be a positive number", load)
    rng = np.random.default_rng(seed)
    probs = np.array([m[1] for m in MODEL_MIX])
    kinds = rng.choice(len(MODEL_MIX), size=jobs, p=probs / probs.sum())
    lo, hi = DURATION_RANGE_S
    durations = np.exp(rng.uniform(math.log(lo), math.log(hi), size=jobs))
    prio_vals = np.array([p for p, _ in _PRIORITIES])
    prio_p = np.array([w for _, w in _PRIORITIES])
    priorities = rng.choice(prio_vals, size=jobs, p=prio_p / prio_p.sum())
    tenants = rng.integers(0, _TENANTS, size=jobs)

    specs: list[tuple[str, int, int, int, int, int, int, int]] = []
    total_flops = 0.0
    for i in range(jobs):
        name, _, gmin, gmax, batch, micro = MODEL_MIX[int(kinds[i])]
        probe = JobSpec(id="probe", model=model_preset(name), global_batch=batch, micro_batch=micro,
                        seq_len=SEQ_LEN, steps=1, gpus=GpuRange(min=gmin, max=gmax))
        step_flops = job_training_flops(probe)
        steps = max(1, round(float(durations[i]) * gmin * REFERENCE_TFLOPS * 1e12 / step_flops))
        total_flops += steps * step_flops
        specs.append((name, gmin, gmax, batch, micro, steps, int(priorities[i]), int(tenants[i])))

    if topo is None:
        rate = load / BASE_INTERARRIVAL_S
    else:
        capacity = sum(c.free * c.effective_tflops * 1e12 for c in topo.clusters)
        if capacity <= 0:
            raise ValidationError("topology", "has no free GPUs to offer load against", topo.total_free_gpus)
        rate = load * capacity / (total_flops / jobs)
    gaps = rng.exponential(1.0 / rate, size=jobs)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)

    out: list[JobSpec] = []
    for i, (name, gmin, gmax, batch, micro, steps, prio, tenant) in enumerate(specs):
        out.append(JobSpec(
            id=f"job-{i:05d}", model=model_preset(name), global_batch=batch, micro_batch=micro, seq_len=SEQ_LEN,
            steps=steps, gpus=GpuRange(min=gmin, max=gmax), arrival_s=round(float(arrivals[i]), 3),
            priority=prio, tenant=f"t{tenant}",
        ))
    return out
