"""The placement interface every policy implements (SpinSearch and the baselines alike).

A policy takes an immutable :class:`~spiderflow.core.domain.Topology` snapshot and a
:class:`~spiderflow.core.domain.JobSpec` and returns a :class:`PlacementResult`: a typed status, the plan
(stages with clusters, layer ranges, tp/dp, micro-batches, schedule; predictions filled by
:func:`spiderflow.core.costmodel.evaluate`), the wall time of the search itself, whether optimality was
proven (``None`` when the policy cannot know), and a human-readable reason when unschedulable.

Policies are pure: no I/O, no global RNG (a seeded ``numpy.random.Generator`` is passed in
:class:`Budget`), and they never mutate the topology. They are registered by name in
:data:`REGISTRY`; registering a duplicate name is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from spiderflow.core.domain import (
    Budget,
    JobSpec,
    Objective,
    PlacementResult,
    PlacementStatus,
    Plan,
    PlanOptions,
    Release,
    Topology,
    Wait,
)

__all__ = [
    "REGISTRY",
    "Budget",
    "Objective",
    "PlacementPolicy",
    "PlacementResult",
    "PlacementStatus",
    "PlanOptions",
    "Planner",
    "Release",
    "Wait",
    "WaitPricer",
    "get_policy",
    "register_policy",
]


class PlacementPolicy(Protocol):
    """``place`` must be safe to call concurrently on different inputs and must not mutate them."""

    name: str

    def place(self, topo: Topology, job: JobSpec, budget: Budget = ...) -> PlacementResult: ...


@runtime_checkable
class WaitPricer(Protocol):
    """A policy that prices waiting itself: given ``Budget.releases`` its :meth:`place` may answer
    :attr:`~spiderflow.core.domain.PlacementStatus.WAIT` (SpinSearch weighs the future with the same search,
    which is cheaper than asking it once per release point). For every other policy the scheduling cycle
    prices a later start with the policy's own placement (:func:`spiderflow.core.cycle.price_wait`)."""

    name: str

    def place(self, topo: Topology, job: JobSpec, budget: Budget = ...) -> PlacementResult: ...

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        """Start on ``now`` or wait for ``budget.releases``: the wait when it scores better."""
        ...


class Planner(Protocol):
    """Plans one ordered allocation of ``(cluster, GPUs)`` on a topology for a job: the layer split, the
    per-cluster degrees, the micro-batch count and the schedule; the plan uses exactly the allocation's GPUs
    and is evaluated by the shared cost model. Raises
    :class:`~spiderflow.core.errors.UnschedulableError` (naming the binding constraint) when nothing fits and
    :class:`~spiderflow.core.errors.ValidationError` for a malformed allocation. Implementations: in process
    (:class:`spiderflow.core.tpa.planner.LocalPlanner`) and through the Planner service
    (``services.planner.client.RemotePlanner``); both give the same plan for the same inputs."""

    @property
    def name(self) -> str:
        """Identifies the planner and its settings (memo keys of plans it made include it)."""
        ...

    def plan(self, topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]],
             options: PlanOptions) -> Plan: ...


REGISTRY: dict[str, Callable[[], PlacementPolicy]] = {}
PLANNED: dict[str, Callable[[Planner | None], PlacementPolicy]] = {}
"""Factories of the registered policies that plan their chains with a :class:`Planner` (by name)."""


def register_policy(name: str, factory: Callable[..., PlacementPolicy], *, with_planner: bool = False) -> None:
    """Register a policy factory; a second registration of ``name`` raises ``ValueError``. With
    ``with_planner`` the factory takes ``planner=`` (a :class:`Planner`, or ``None`` for level-1 plans only)
    and :func:`get_policy` passes the one it is given."""
    if name in REGISTRY:
        raise ValueError(f"placement policy {name!r} is already registered")
    REGISTRY[name] = factory
    if with_planner:
        PLANNED[name] = lambda planner: factory(planner=planner)


def get_policy(name: str, *, planner: Planner | None = None) -> PlacementPolicy:
    """Instantiate a registered policy; ``ValidationError`` on ``policy`` for an unknown name. A policy that
    plans its chains gets ``planner`` (default: its own default, the in-process planner); the others ignore
    it."""
    from spiderflow.core.errors import ValidationError
    from spiderflow.core.placement import load_builtin_policies

    load_builtin_policies()
    if name not in REGISTRY:
        raise ValidationError("policy", f"unknown policy; known: {', '.join(sorted(REGISTRY))}", name)
    if planner is not None and name in PLANNED:
        return PLANNED[name](planner)
    return REGISTRY[name]()
