r"""``bace``: a BACE-Pipe-style baseline — bandwidth-feasible path, cheapest electricity first.

1. Target GPUs ``G = min(G_max, Σ free)``. The pipeline's rate is estimated from the clusters taken in
   order of electricity price until ``G`` GPUs: ``τ = 3·(L·f + f_head) / Σ g_c F_c`` (seconds per
   micro-batch at the bottleneck).
2. A hop ``u → v`` is *bandwidth-feasible* when it carries the activation stream at that rate:
   ``P_uv = A / b_uv + l_uv ≤ θ`` with ``θ = τ`` initially.
3. Path: start at the cheapest cluster with free GPUs; repeatedly append the cheapest cluster (ties: the
   faster hop) reachable from the tail by a feasible hop, allocating its free GPUs, until ``G`` GPUs are
   held. Every start cluster is tried in price order; the first path reaching ``G`` (or else the largest
   one holding at least ``G_min``) wins. If none qualifies, ``θ`` doubles (at most 16 times, then all
   hops are feasible).
4. The chain is planned by :func:`~spiderflow.placement.common.finalise` (TPA when available).

O(R·n²) for R threshold rounds.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from spiderflow.domain import JobSpec, Topology
from spiderflow.errors import UnschedulableError
from spiderflow.kernels import warm
from spiderflow.placement.base import Budget, PlacementResult, PlacementStatus, Planner, register_policy
from spiderflow.placement.common import (
    LOCAL_PLANNER,
    diagnose,
    finalise,
    job_consts,
    topo_arrays,
    transfer_matrix,
    unschedulable,
)

__all__ = ["Bace", "bace_allocation"]


def bace_allocation(topo: Topology, job: JobSpec) -> list[tuple[str, int]]:
    """The chain and GPUs of steps 1–3 of the module docstring (empty when nothing holds ``G_min``)."""
    ta = topo_arrays(topo)
    jc = job_consts(job)
    p = transfer_matrix(ta, jc)
    usable = [int(i) for i in np.flatnonzero(ta.free > 0)]
    by_price = sorted(usable, key=lambda i: (float(ta.price[i]), ta.names[i]))
    target = min(jc.gpus_max, int(ta.free[usable].sum()) if usable else 0)
    rate, left = 0.0, target
    for i in by_price:
        take = min(int(ta.free[i]), left)
        rate += take * float(ta.flops[i])
        left -= take
        if left <= 0:
            break
    if rate <= 0:
        return []
    theta = 3.0 * (jc.layers * jc.f + jc.head_f) / rate
    for _ in range(17):
        best: list[tuple[int, int]] = []
        for start in by_price:
            path = [(start, min(int(ta.free[start]), target))]
            held = path[0][1]
            members = {start}
            while held < target and len(path) < jc.layers:
                tail = path[-1][0]
                nxt = [v for v in by_price if v not in members and p[tail, v] <= theta]
                if not nxt:
                    break
                v = min(nxt, key=lambda v: (float(ta.price[v]), float(p[tail, v])))
                take = min(int(ta.free[v]), target - held)
                path.append((v, take))
                members.add(v)
                held += take
            if held >= target:
                best = path
                break
            if held >= jc.gpus_min and held > sum(g for _, g in best):
                best = path
        if best:
            return [(ta.names[i], g) for i, g in best]
        theta = theta * 2 if math.isfinite(theta) else theta
        if _ == 15:
            theta = math.inf
    return []


class Bace:
    """BACE's path, planned by the level-1 planner; its final plan is ``planner``'s plan of that path when
    it is better (in process by default, or the Planner service; ``None``: the level-1 plan)."""

    name = "bace"

    def __init__(self, *, planner: Planner | None = LOCAL_PLANNER) -> None:
        self.planner = planner
        warm()  # the compiled kernels are loaded now, not in the first decision

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget or Budget()
        t0 = time.perf_counter()
        bad = diagnose(topo, job, self.name)
        if bad is not None:
            return replace(bad, planning_seconds=time.perf_counter() - t0)
        alloc = bace_allocation(topo, job)
        if not alloc:
            return unschedulable(self.name, UnschedulableError(
                f"no path of reachable clusters holds {job.gpus.min} free GPUs", constraint="reachability"),
                time.perf_counter() - t0)
        fin = finalise(topo, job, [alloc], objective=budget.objective, planner=self.planner)
        elapsed = time.perf_counter() - t0
        if fin.plan is None:
            err = fin.error or UnschedulableError("the chosen path cannot hold the model", constraint="memory")
            return unschedulable(self.name, err, elapsed)
        return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=fin.plan,
                               planning_seconds=elapsed, optimal=None,
                               stats={"tpa": 1.0 if fin.planner == "tpa" else 0.0})


register_policy("bace", Bace, with_planner=True)
