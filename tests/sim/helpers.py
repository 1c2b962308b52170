"""A small greedy policy for engine tests (independent of the real policies' code)."""

from __future__ import annotations

from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import JobSpec, Plan, Stage, Topology
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus

_DEFAULT_BUDGET = Budget()


class GreedyPolicy:
    """Fill clusters by most free GPUs until ``gpus.max``; layers split in proportion; tp = 1."""

    name = "greedy-test"

    def __init__(self, *, max_clusters: int = 4) -> None:
        self.max_clusters = max_clusters
        self.calls = 0

    def place(self, topo: Topology, job: JobSpec, budget: Budget = _DEFAULT_BUDGET) -> PlacementResult:
        self.calls += 1
        if job.gpus.min > sum(c.total_gpus for c in topo.clusters):
            return PlacementResult(status=PlacementStatus.UNRESOLVABLE, policy=self.name, reason="too big")
        picked: list[tuple[str, int]] = []
        need = job.gpus.max
        for c in sorted(topo.clusters, key=lambda c: (-c.free, c.name)):
            if need <= 0 or len(picked) >= min(self.max_clusters, job.model.layers):
                break
            g = min(c.free, need)
            if g > 0:
                picked.append((c.name, g))
                need -= g
        total = sum(g for _, g in picked)
        if total < job.gpus.min:
            return PlacementResult(status=PlacementStatus.UNSCHEDULABLE, policy=self.name, reason="not enough GPUs")
        layers = job.model.layers
        stages = []
        first = 0
        for i, (name, g) in enumerate(picked):
            n = layers - first if i == len(picked) - 1 else max(1, round(layers * g / total))
            n = min(n, layers - first - (len(picked) - 1 - i))
            stages.append(Stage(cluster=name, first_layer=first, last_layer=first + n - 1, tp=1, dp=g))
            first += n
        plan = evaluate(Plan(stages=tuple(stages), micro_batches=job.micro_batches_total), topo, job)
        return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=plan)
