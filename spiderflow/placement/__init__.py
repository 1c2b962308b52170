"""Cross-cluster placement policies: SpinSearch and the baselines, behind one interface (see ``base``)."""

from __future__ import annotations

import importlib

from spiderflow.placement.base import (
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
    "get_policy",
    "load_builtin_policies",
    "register_policy",
]

# Modules that register a policy on import. A module that does not exist yet is skipped.
_BUILTIN = ("spinsearch", "firstfit", "bace", "ilp", "genetic", "bruteforce")
_loaded = False


def load_builtin_policies() -> None:
    """Import every built-in policy module once (each registers itself)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN:
        try:
            importlib.import_module(f"spiderflow.placement.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"spiderflow.placement.{mod}":
                raise
