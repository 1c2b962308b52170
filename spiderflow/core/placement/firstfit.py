"""``firstfit``: the topology-oblivious baseline.

Clusters are taken in order of free GPUs (descending; name breaks ties), each contributing all its free
GPUs, until the job's maximum GPU count is reached (the last cluster contributes only what is still
needed). The chain is that order; layers are split uniformly (``⌊L/k⌋`` each, the first ``L mod k``
clusters one more); each cluster's tensor/data(/pipeline, when memory needs it) degrees are chosen by the
shared level-1 rule (:func:`~spiderflow.core.placement.common.plan_with_split`). Links are ignored entirely.
O(n log n + L·k).
"""

from __future__ import annotations

import time
from dataclasses import replace

from spiderflow.core.domain import JobSpec, Topology
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus, register_policy
from spiderflow.core.placement.common import check_plan, diagnose, plan_with_split, unschedulable

__all__ = ["FirstFit", "first_fit_allocation", "uniform_split"]


def first_fit_allocation(topo: Topology, job: JobSpec) -> list[tuple[str, int]]:
    """Clusters by free GPUs descending, taking GPUs until ``job.gpus.max`` (at most ``L`` clusters)."""
    order = sorted((c for c in topo.clusters if c.free > 0), key=lambda c: (-c.free, c.name))
    alloc: list[tuple[str, int]] = []
    total = 0
    for c in order:
        if total >= job.gpus.max or len(alloc) >= job.model.layers:
            break
        take = min(c.free, job.gpus.max - total)
        alloc.append((c.name, take))
        total += take
    return alloc


def uniform_split(layers: int, k: int) -> list[int]:
    """``k`` contiguous block sizes differing by at most one, larger ones first."""
    base, rem = divmod(layers, k)
    return [base + 1 if i < rem else base for i in range(k)]


class FirstFit:
    name = "firstfit"

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        t0 = time.perf_counter()
        bad = diagnose(topo, job, self.name)
        if bad is not None:
            return replace(bad, planning_seconds=time.perf_counter() - t0)
        alloc = first_fit_allocation(topo, job)
        if sum(g for _, g in alloc) < job.gpus.min:
            return unschedulable(
                self.name,
                UnschedulableError(f"the first {len(alloc)} clusters hold fewer than {job.gpus.min} GPUs",
                                   constraint="free_gpus"),
                time.perf_counter() - t0,
            )
        try:
            plan = plan_with_split(topo, job, alloc, uniform_split(job.model.layers, len(alloc)))
        except UnschedulableError as e:
            return unschedulable(self.name, e, time.perf_counter() - t0)
        problems = check_plan(plan, topo, job)
        if problems:
            return unschedulable(self.name, UnschedulableError(problems[0], constraint="gpus"),
                                 time.perf_counter() - t0)
        return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=plan,
                               planning_seconds=time.perf_counter() - t0, optimal=None)


register_policy("firstfit", FirstFit)
