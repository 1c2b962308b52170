"""The placement interface every policy implements (SpinSearch and the baselines alike).

A policy takes an immutable :class:`~spiderflow.domain.Topology` snapshot and a
:class:`~spiderflow.domain.JobSpec` and returns a :class:`PlacementResult`: a typed status, the plan
(stages with clusters, layer ranges, tp/dp, micro-batches, schedule; predictions filled by
:func:`spiderflow.costmodel.evaluate`), the wall time of the search itself, whether optimality was
proven (``None`` when the policy cannot know), and a human-readable reason when unschedulable.

Policies are pure: no I/O, no global RNG (a seeded ``numpy.random.Generator`` is passed in
:class:`Budget`), and they never mutate the topology. They are registered by name in
:data:`REGISTRY`; registering a duplicate name is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from spiderflow.domain import JobSpec, Plan, Topology

__all__ = [
    "REGISTRY",
    "Budget",
    "Objective",
    "PlacementPolicy",
    "PlacementResult",
    "PlacementStatus",
    "Release",
    "get_policy",
    "register_policy",
]


class PlacementStatus(StrEnum):
    """``SUCCESS``; ``UNSCHEDULABLE`` (may fit later, e.g. when GPUs free up); ``UNRESOLVABLE`` (can never
    fit this topology, e.g. the model exceeds total memory); ``ERROR`` (the policy itself failed)."""

    SUCCESS = "success"
    UNSCHEDULABLE = "unschedulable"
    UNRESOLVABLE = "unschedulable-and-unresolvable"
    ERROR = "error"


class Objective(StrEnum):
    """What a policy optimises: step time (``jct``), dollars per step (``cost``), or their product-like
    blend (``balanced``: minimise step_time × usd_per_step^0.5)."""

    JCT = "jct"
    COST = "cost"
    BALANCED = "balanced"


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """GPUs the scheduler expects back ``after_s`` seconds from the decision (a running job's estimated
    end): ``gpus`` is ``((cluster, count), ...)``. A negative count is a reservation: GPUs another job,
    waiting for earlier releases, will take from then on (it gives them back in a later release)."""

    after_s: float
    gpus: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """Search limits. ``time_limit_s`` caps wall time where the policy supports it (ILP, genetic);
    ``seed`` seeds the policy's own ``numpy.random.Generator``; ``objective`` selects the score.

    ``releases`` (sorted by ``after_s``) is what the scheduler knows about GPUs coming back; a policy may
    use it to answer "wait" (``UNSCHEDULABLE`` with ``constraint="deferred"``) when starting later on
    the released GPUs finishes the job earlier than starting now. Empty: no such information."""

    time_limit_s: float | None = None
    seed: int = 0
    objective: Objective = Objective.JCT
    releases: tuple[Release, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementResult:
    """A policy's answer. ``plan`` is set on ``SUCCESS``; on ``UNSCHEDULABLE`` with
    ``constraint="deferred"`` it may hold the plan the policy expects to run once the releases it waits
    for have come (``stats["defer_s"]`` seconds from now), which the scheduler may reserve for it."""

    status: PlacementStatus
    policy: str
    plan: Plan | None = None
    planning_seconds: float = 0.0
    optimal: bool | None = None
    reason: str = ""
    constraint: str = ""
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is PlacementStatus.SUCCESS and self.plan is not None


class PlacementPolicy(Protocol):
    """``place`` must be safe to call concurrently on different inputs and must not mutate them."""

    name: str

    def place(self, topo: Topology, job: JobSpec, budget: Budget = ...) -> PlacementResult: ...


REGISTRY: dict[str, Callable[[], PlacementPolicy]] = {}


def register_policy(name: str, factory: Callable[[], PlacementPolicy]) -> None:
    """Register a policy factory; a second registration of ``name`` raises ``ValueError``."""
    if name in REGISTRY:
        raise ValueError(f"placement policy {name!r} is already registered")
    REGISTRY[name] = factory


def get_policy(name: str) -> PlacementPolicy:
    """Instantiate a registered policy; ``ValidationError`` on ``policy`` for an unknown name."""
    from spiderflow.errors import ValidationError
    from spiderflow.placement import load_builtin_policies

    load_builtin_policies()
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValidationError("policy", f"unknown policy; known: {', '.join(sorted(REGISTRY))}", name) from None
