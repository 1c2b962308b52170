"""Per-policy summary figures of a simulation (the JSON the ``simulate`` command writes).

Definitions (``C`` = completed jobs):

- ``mean_jct_s``, ``p95_jct_s``: mean and 95th percentile (linear interpolation) of completion − arrival
  over ``C``; ``mean_queue_s``: first start − arrival.
- ``makespan_s``: last completion − first arrival.
- ``throughput_tokens_per_s``: Σ tokens of ``C`` / makespan (system throughput);
  ``mean_plan_tokens_per_s``: mean over ``C`` of each job's training throughput on its (last) plan.
- ``sched_overhead_s``: total measured wall time of all placement decisions; ``decisions``: their number;
  ``overhead_per_decision_mean_s`` / ``_p95_s`` over decisions; ``cpu_per_decision_mean_s``: mean process
  CPU time per decision (all threads; less sensitive to other load on the machine than wall time).
- ``gpu_utilization``: GPU-seconds held by jobs / (pool GPUs × makespan).
- ``cost_usd``: electricity of the GPUs held (power × time × the cluster's $/kWh), including lost work.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spiderflow.core.sim.engine import SimResult

__all__ = ["percentile", "summarize"]


def percentile(values: list[float], q: float) -> float | None:
    """``q``-th percentile with linear interpolation; ``None`` for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(result: SimResult) -> dict[str, Any]:
    """The summary dict of the module docstring (per-job records not included)."""
    done = [r for r in result.records if r.status == "completed" and r.end_s is not None]
    jcts = [r.jct_s for r in done if r.jct_s is not None]
    queue = [r.first_start_s - r.arrival_s for r in done if r.first_start_s is not None]
    makespan = max(0.0, result.last_end_s - result.first_arrival_s) if done else 0.0
    tokens = sum(r.tokens for r in done)
    gpu_s = sum(r.gpu_seconds for r in result.records)
    dec = list(result.decision_overheads_s)
    by_status: dict[str, int] = {}
    for r in result.records:
        by_status[r.status] = by_status.get(r.status, 0) + 1
    return {
        "policy": result.policy,
        "jobs": len(result.records),
        "completed": len(done),
        "by_status": by_status,
        "mean_jct_s": float(np.mean(jcts)) if jcts else None,
        "p95_jct_s": percentile(jcts, 95),
        "mean_queue_s": float(np.mean(queue)) if queue else None,
        "makespan_s": makespan,
        "throughput_tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "mean_plan_tokens_per_s": float(np.mean([r.plan_tokens_per_s for r in done])) if done else None,
        "sched_overhead_s": float(sum(dec)),
        "sim_overhead_s": result.sim_overhead_s,
        "queue_overhead_s": result.queue_overhead_s,
        "decisions": len(dec),
        "overhead_per_decision_mean_s": float(np.mean(dec)) if dec else None,
        "overhead_per_decision_p95_s": percentile(dec, 95),
        "cpu_per_decision_mean_s": float(np.mean(result.decision_cpu_s)) if result.decision_cpu_s else None,
        "gpu_utilization": gpu_s / (result.pool_gpus * makespan) if makespan > 0 and result.pool_gpus else 0.0,
        "cost_usd": float(sum(r.cost_usd for r in result.records)),
        "restarts": sum(r.restarts for r in result.records),
        "steps_lost": float(sum(r.steps_lost for r in result.records)),
        "violations": list(result.violations),
    }
