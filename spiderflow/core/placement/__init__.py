"""Cross-cluster placement policies: SpinSearch and the baselines, behind one interface (see ``base``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from spiderflow.core.placement.base import (
    REGISTRY,
    Budget,
    Objective,
    PlacementPolicy,
    PlacementResult,
    PlacementStatus,
    get_policy,
    register_policy,
)

if TYPE_CHECKING:
    from spiderflow.core.domain import Topology

__all__ = [
    "REGISTRY",
    "Budget",
    "Objective",
    "PlacementPolicy",
    "PlacementResult",
    "PlacementStatus",
    "clear_memos",
    "get_policy",
    "load_builtin_policies",
    "register_policy",
]

# Modules that register a policy on import. A module that does not exist yet is skipped.
_BUILTIN = ("spinsearch", "firstfit", "bace", "ilp", "genetic", "bruteforce", "greedy")
_loaded = False


def load_builtin_policies() -> None:
    """Import every built-in policy module once (each registers itself)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN:
        try:
            importlib.import_module(f"spiderflow.core.placement.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"spiderflow.core.placement.{mod}":
                raise


def clear_memos(*topologies: Topology) -> None:
    """Forget the memos of the placement and planning code: the given snapshots' tables
    (``topology.memo``: arrays, SpinSearch's hop orders and searches; shared by their ``with_free``
    copies) and the value-keyed memos of pure functions (chain plans and chain-position rows, level 2's
    solves, the timeline's orders and simulations, the schedules' per-shape orders). Decisions after it
    are computed from scratch (benchmarks time cold decisions this way)."""
    from spiderflow.core import schedules
    from spiderflow.core.placement import common
    from spiderflow.core.tpa import level2, timeline

    for topo in topologies:
        topo.memo.clear()
    common.plan_cache_clear()
    level2.cache_clear()
    timeline.cache_clear()
    schedules.cache_clear()

