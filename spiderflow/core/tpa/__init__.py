"""TPA: the two-level planner (level 1 across clusters, level 2 inside each cluster) and pipeline timing.

Entry point: :func:`plan_chain` (pure: no I/O, no RNG). See :mod:`spiderflow.core.tpa.planner` for the contract,
:mod:`spiderflow.core.tpa.level1`, :mod:`spiderflow.core.tpa.level2` and :mod:`spiderflow.core.tpa.timeline`
for the math.
"""

from __future__ import annotations

from spiderflow.core.tpa.planner import micro_batch_candidates, plan_chain
from spiderflow.core.tpa.timeline import Timeline, evaluate_on_timeline, simulate, simulate_plan, stage_ops

__all__ = [
    "Timeline", "evaluate_on_timeline", "micro_batch_candidates", "plan_chain", "simulate", "simulate_plan",
    "stage_ops",
]
