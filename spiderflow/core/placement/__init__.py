"""Cross-cluster placement policies: SpinSearch and the baselines, behind one interface (see ``base``)."""

from __future__ import annotations

import importlib

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


def clear_memos() -> None:
    """Forget every process-wide memo of the placement and planning code: SpinSearch's searches and hop
    orders, the chain plans, the level-1 planner's per-cluster figures, level 2's solves and the timeline's
    orders and simulations. Decisions after it are computed from scratch (benchmarks time cold decisions
    this way); the per-topology arrays, which a topology snapshot computes once, are kept."""
    from spiderflow.core import schedules
    from spiderflow.core.placement import common, spinsearch
    from spiderflow.core.tpa import level2, timeline

    spinsearch._SEARCH_CACHE.clear()
    spinsearch._HOP_CACHE.clear()
    common.plan_cache_clear()
    common._POSITIONS.clear()
    level2.cache_clear()
    for fn in (timeline._simulate_memo, timeline._frozen_orders, timeline._stage_order, timeline._frozen_packed):
        fn.cache_clear()
    schedules._directions.cache_clear()

