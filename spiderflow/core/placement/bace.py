r"""``bace``: a BACE-Pipe-style baseline — bandwidth-feasible, memory-aware paths, cheapest electricity.

What the original does
----------------------
BACE-Pipe schedules a pipeline job over geo-distributed clusters by (a) pruning links that cannot carry
the job's activation stream at the pipeline's rate, (b) finding a path of clusters over the remaining
links that holds the job, preferring cheap electricity, and (c) prioritising queued jobs by remaining
work and network use (the queue part is the shared scheduler cycle's, not this policy's).

What we do
----------
1. **GPU count, by its own rule.** ``G_mem``: the fewest GPUs, cheapest electricity first, whose memory
   (less the reserve) holds the model states (the job's precision: 16 B/param in bf16/fp16, 20 in fp32/tf32;
   :func:`~spiderflow.core.costmodel.state_bytes_per_param`) with :data:`MEMORY_HEADROOM` for activations.
   ``G_bw``: the largest count at which the pipeline's compute per micro-batch still covers the median
   activation transfer between clusters with free GPUs (``3·(L·f + f_head) / (G·F̄) ≥ median P_uv``, ``F̄`` the
   mean rate in the job's precision):
   past it the stream, not compute, sets the pace, so more GPUs buy little — but never below the most
   free GPUs of one cluster, which need no wide-area link. ``G = clamp(max(G_mem,
   G_bw), gpus.min, min(gpus.max, Σ free))`` — not every free GPU up to the maximum.
2. A hop ``u → v`` is *bandwidth-feasible* when ``P_uv = A / b_uv + l_uv ≤ θ``, ``θ`` starting at the
   per-micro-batch compute time of ``G`` GPUs of the cheapest clusters and doubling each round (at most
   16 rounds, then every hop is feasible).
3. **Memory-aware paths.** From every start cluster (price order), append the cheapest cluster (ties: the
   faster hop) reachable from the tail by a feasible hop until the path holds ``G`` GPUs *and* its GPUs'
   memory holds the model states with the headroom (it may then exceed ``G``, up to ``gpus.max``).
4. **Cheapest of all feasible paths.** Every path of the round is planned by the shared level-1 planner
   (exact memory; paths it cannot fit are dropped); the one with the least predicted $ per step (ties:
   step time) wins, and the first round with any feasible path ends the search. Its chain is then
   re-planned by TPA for the budget's objective (:func:`~spiderflow.core.placement.common.finalise`).
   When the level-1 planner fits no path of any round (a model that needs pipelining inside a cluster,
   recomputation or FSDP), TPA is asked for the cheapest path of the first round that had any, as every
   policy's planner step does for its first allocation; when that fails too, steps 2–4 run again with
   twice ``G`` (up to the GPU range's maximum and the free GPUs).

``O(R·n²)`` path construction for ``R`` threshold rounds, plus up to ``n`` level-1 plans per round.

Why it is a fair, competent baseline
------------------------------------
It keeps BACE-Pipe's two ideas — bandwidth-feasible links and cheapest electricity — and gives them the
same cost model, memory model and planner SpinSearch uses, so a loss to SpinSearch is a loss of the
path rule, not of a crippled implementation (it no longer fails on jobs that need high-memory paths, nor
takes GPUs it has no use for).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from spiderflow.core.costmodel import GIB, RESERVED_GIB
from spiderflow.core.domain import JobSpec, Plan, Topology
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.kernels import warm
from spiderflow.core.placement.base import Budget, Objective, PlacementResult, PlacementStatus, Planner, register_policy
from spiderflow.core.placement.common import (
    LOCAL_PLANNER,
    TopoArrays,
    check_plan,
    diagnose,
    finalise,
    job_consts,
    topo_arrays,
    transfer_matrix,
    unschedulable,
)

__all__ = ["MEMORY_HEADROOM", "Bace", "bace_allocation", "bace_gpus", "bace_paths"]

MEMORY_HEADROOM = 1.25


def bace_gpus(topo: Topology, job: JobSpec) -> int:
    """``G`` of step 1 of the module docstring (0 when fewer than ``gpus.min`` GPUs are free)."""
    ta = topo_arrays(topo)
    jc = job_consts(job)
    usable = [int(i) for i in np.flatnonzero(ta.free > 0)]
    total = int(ta.free[usable].sum()) if usable else 0
    hi = min(jc.gpus_max, total)
    if hi < jc.gpus_min:
        return 0
    need = MEMORY_HEADROOM * jc.state_bytes * job.model.total_params
    g_mem = min(_count_to(ta, usable, need), hi)
    p = transfer_matrix(ta, jc)
    sub = p[np.ix_(usable, usable)]
    finite = sub[np.isfinite(sub) & ~np.eye(len(usable), dtype=bool)]
    mean_flops = float(np.average(ta.rate(jc.precision)[usable], weights=ta.free[usable]))
    work = 3.0 * (jc.layers * jc.f + jc.head_f) / mean_flops
    local = int(ta.free[usable].max())  # GPUs inside one cluster never cross a wide-area link
    g_bw = hi if finite.size == 0 else max(local, int(work / float(np.median(finite))))
    return int(min(max(g_mem, g_bw, jc.gpus_min), hi))


def _count_to(ta: TopoArrays, usable: list[int], need: float) -> int:
    """GPUs, cheapest electricity first, whose usable memory reaches ``need`` bytes (all if never)."""
    have, n = 0.0, 0
    for i in sorted(usable, key=lambda i: (float(ta.price[i]), ta.names[i])):
        per = max(float(ta.mem[i]) - RESERVED_GIB * GIB, 0.0)
        for _ in range(int(ta.free[i])):
            if have >= need:
                return n
            have += per
            n += 1
    return n


def bace_paths(topo: Topology, job: JobSpec, gpus: int, theta: float) -> list[list[tuple[str, int]]]:
    """The memory-aware paths of step 3 at threshold ``theta`` (distinct, start clusters in price order)."""
    ta = topo_arrays(topo)
    jc = job_consts(job)
    p = transfer_matrix(ta, jc)
    usable = [int(i) for i in np.flatnonzero(ta.free > 0)]
    by_price = sorted(usable, key=lambda i: (float(ta.price[i]), ta.names[i]))
    need = MEMORY_HEADROOM * jc.state_bytes * job.model.total_params
    per = np.maximum(ta.mem - RESERVED_GIB * GIB, 0.0)
    out: list[list[tuple[str, int]]] = []
    seen: set[tuple[tuple[int, int], ...]] = set()
    for start in by_price:
        path = [(start, min(int(ta.free[start]), gpus))]
        held = path[0][1]
        mem = held * float(per[start])
        members = {start}
        while (held < gpus or mem < need) and held < jc.gpus_max and len(path) < jc.layers:
            tail = path[-1][0]
            nxt = [v for v in by_price if v not in members and p[tail, v] <= theta]
            if not nxt:
                break
            v = min(nxt, key=lambda v: (float(ta.price[v]), float(p[tail, v])))
            want = max(gpus - held, math.ceil((need - mem) / per[v]) if per[v] > 0 and mem < need else 0, 1)
            take = min(int(ta.free[v]), want, jc.gpus_max - held)
            path.append((v, take))
            members.add(v)
            held += take
            mem += take * float(per[v])
        if held < max(gpus, jc.gpus_min) or mem < need:
            continue
        key = tuple(path)
        if key not in seen:
            seen.add(key)
            out.append([(ta.names[i], g) for i, g in path])
    return out


def _initial_theta(topo: Topology, job: JobSpec, gpus: int) -> float:
    ta = topo_arrays(topo)
    jc = job_consts(job)
    rate, left = 0.0, gpus
    flops = ta.rate(jc.precision)
    for i in sorted((int(i) for i in np.flatnonzero(ta.free > 0)), key=lambda i: (float(ta.price[i]), ta.names[i])):
        take = min(int(ta.free[i]), left)
        rate += take * float(flops[i])
        left -= take
        if left <= 0:
            break
    return 3.0 * (jc.layers * jc.f + jc.head_f) / rate if rate > 0 else math.inf


def bace_allocation(topo: Topology, job: JobSpec, *, planner: Planner | None = LOCAL_PLANNER,
                    ) -> tuple[list[tuple[str, int]], int, int]:
    """Steps 1–4 of the module docstring: ``(chain, G, paths planned)``; the chain is empty when no
    bandwidth-feasible path can hold the model. When the level-1 planner fits none of the memory-aware paths
    of any round, ``planner`` is asked for the cheapest path of the first round that had any (it may fit
    it by pipelining inside clusters, recomputation or FSDP, as it does for every policy's final plan); when
    that fails too, the search runs again with twice ``G`` (up to ``min(gpus.max, free GPUs)``). ``G`` in
    the result is the count of the search that succeeded (or the last one tried)."""
    gpus = bace_gpus(topo, job)
    if gpus <= 0:
        return [], 0, 0
    hi = min(job.gpus.max, topo.total_free_gpus)
    planned = 0
    while True:
        theta = _initial_theta(topo, job, gpus)
        first: list[list[tuple[str, int]]] = []
        for rnd in range(17):
            paths = bace_paths(topo, job, gpus, theta if rnd < 16 else math.inf)
            if paths:
                planned += len(paths)
                first = first or paths
                fin = finalise(topo, job, paths, objective=Objective.COST, planner=None)
                if fin.plan is not None and not check_plan(fin.plan, topo, job):
                    return _allocation_of(fin.plan), gpus, planned
            theta = theta * 2 if math.isfinite(theta) else theta
        if first and planner is not None:
            fin = finalise(topo, job, first, objective=Objective.COST, planner=planner)
            if fin.plan is not None and not check_plan(fin.plan, topo, job):
                return _allocation_of(fin.plan), gpus, planned
        if gpus >= hi:
            return [], gpus, planned
        gpus = min(2 * gpus, hi)  # the count's memory did not hold the plan: twice the GPUs, up to the most


def _allocation_of(plan: Plan) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for st in plan.stages:
        if out and out[-1][0] == st.cluster:
            out[-1] = (st.cluster, out[-1][1] + st.gpus)
        else:
            out.append((st.cluster, st.gpus))
    return out


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
        alloc, gpus, planned = bace_allocation(topo, job, planner=self.planner)
        stats = {"target_gpus": float(gpus), "paths_planned": float(planned)}
        if not alloc:
            return replace(unschedulable(self.name, UnschedulableError(
                f"no bandwidth-feasible path of free clusters holds {job.model.name} in memory",
                constraint="memory"), time.perf_counter() - t0), stats=stats)
        fin = finalise(topo, job, [alloc], objective=budget.objective, planner=self.planner)
        elapsed = time.perf_counter() - t0
        if fin.plan is None:
            err = fin.error or UnschedulableError("the chosen path cannot hold the model", constraint="memory")
            return replace(unschedulable(self.name, err, elapsed), stats=stats)
        stats["tpa"] = 1.0 if fin.planner == "tpa" else 0.0
        return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=fin.plan,
                               planning_seconds=elapsed, optimal=None, stats=stats)


register_policy("bace", Bace, with_planner=True)
