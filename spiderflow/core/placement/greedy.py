r"""``greedy``: a JCT-greedy baseline — the best predicted finish time now, no search.

What it stands for
------------------
The scheduler most production clusters run: place each job, now, where the shared cost model predicts
it finishes first, without any combinatorial search (no beam, no GA, no solver) and without waiting.

What it does
------------
1. Starts: the :data:`STARTS` clusters with the most free compute (free GPUs × achieved FLOP/s; name
   breaks ties), each with free GPUs.
2. GPU counts: ``gpus.min``, ``gpus.max`` and every power of two between them, capped by the free GPUs.
3. For each (start, count): a chain grown one hop at a time from its tail to the reachable cluster not
   yet in it with the widest link (ties: more free compute), each cluster giving ``min(free, count − held)``
   GPUs, until ``count`` GPUs are held (at most ``L`` clusters).
4. Every candidate is planned by the shared level-1 planner (memory is exact: a chain whose GPUs cannot
   hold the model is dropped) and the one with the least predicted finish time — ``steps × step time``
   started now, or the budget's other objective — is re-planned by TPA
   (:func:`~spiderflow.core.placement.common.finalise`).

``O(S·K·(n + L))`` chain construction for ``S`` starts and ``K`` counts, plus ``S·K`` level-1 plans.

Why it is a fair, competent baseline
------------------------------------
It uses the same cost model, the same planner and the same memory model as SpinSearch and it tries
every GPU count the job accepts at powers of two, so it never loses by an obviously poor size or an
infeasible plan; what it lacks is only SpinSearch's search over chains (beam, marginal gains,
swap/reverse/trim refinement), which is exactly what the comparison is meant to measure.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from spiderflow.core.domain import JobSpec, Topology
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus, Planner, register_policy
from spiderflow.core.placement.common import LOCAL_PLANNER, diagnose, finalise, topo_arrays, unschedulable

__all__ = ["STARTS", "Greedy", "greedy_allocations"]

STARTS = 8


def _counts(lo: int, hi: int) -> list[int]:
    out = {lo, hi}
    p = 1
    while p < hi:
        if p > lo:
            out.add(p)
        p *= 2
    return sorted(out)


def greedy_allocations(topo: Topology, job: JobSpec) -> list[list[tuple[str, int]]]:
    """The candidate chains of steps 1–3 of the module docstring (distinct, in generation order)."""
    ta = topo_arrays(topo)
    free = ta.free.astype(np.int64)
    usable = [int(i) for i in np.flatnonzero(free > 0)]
    total = int(free[usable].sum()) if usable else 0
    if total < job.gpus.min:
        return []
    power = free * ta.flops
    starts = sorted(usable, key=lambda i: (-float(power[i]), ta.names[i]))[:STARTS]
    out: list[list[tuple[str, int]]] = []
    seen: set[tuple[tuple[str, int], ...]] = set()
    for count in _counts(job.gpus.min, min(job.gpus.max, total)):
        for s in starts:
            chain = [(s, min(int(free[s]), count))]
            held, members = chain[0][1], {s}
            while held < count and len(chain) < job.model.layers:
                tail = chain[-1][0]
                nxt = [v for v in usable if v not in members and ta.bw[tail, v] > 0]
                if not nxt:
                    break
                v = max(nxt, key=lambda v: (float(ta.bw[tail, v]), float(power[v]), -v))
                take = min(int(free[v]), count - held)
                chain.append((v, take))
                members.add(v)
                held += take
            if held < job.gpus.min:
                continue
            key = tuple((ta.names[i], g) for i, g in chain)
            if key not in seen:
                seen.add(key)
                out.append(list(key))
    return out


class Greedy:
    """The JCT-greedy baseline (module docstring). Its final plan is ``planner``'s plan of the best chain
    when that is better (in process by default, or the Planner service; ``None``: the level-1 plan)."""

    name = "greedy"

    def __init__(self, *, planner: Planner | None = LOCAL_PLANNER) -> None:
        self.planner = planner

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget or Budget()
        t0 = time.perf_counter()
        bad = diagnose(topo, job, self.name)
        if bad is not None:
            return replace(bad, planning_seconds=time.perf_counter() - t0)
        allocs = greedy_allocations(topo, job)
        if not allocs:
            return unschedulable(self.name, UnschedulableError(
                f"no chain of reachable clusters holds {job.gpus.min} free GPUs", constraint="reachability"),
                time.perf_counter() - t0)
        fin = finalise(topo, job, allocs, objective=budget.objective, planner=self.planner)
        elapsed = time.perf_counter() - t0
        if fin.plan is None:
            err = fin.error or UnschedulableError("no candidate chain can hold the model", constraint="memory")
            return unschedulable(self.name, err, elapsed)
        return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=fin.plan,
                               planning_seconds=elapsed, optimal=None,
                               stats={"candidates": float(len(allocs)), "tpa": 1.0 if fin.planner == "tpa" else 0.0})


register_policy("greedy", Greedy, with_planner=True)
