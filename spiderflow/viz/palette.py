"""The one palette of every figure SpiderFlow draws (simulation plots and report, Gantt charts, the cluster
map, the dashboard's charts), so a policy, a cluster or a measured-vs-predicted pair reads the same
everywhere.

- **Policies**: a fixed colour per built-in placement policy (:data:`POLICY_COLORS`); any other name gets one
  of :data:`EXTRA_COLORS` by a stable hash of its name (:func:`policy_color`).
- **Clusters** (Gantt rows, map nodes): :func:`cluster_colors` gives each cluster of a chain its colour in
  chain order (forward blocks light, backward dark).
- **Measured vs predicted** (:data:`MEASURED`, :data:`PREDICTED`): the dashboard's step-time and stage charts
  use the same two colours (its page names them in its script).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CLUSTER_COLORS",
    "EXTRA_COLORS",
    "LINK",
    "MEASURED",
    "NODE",
    "NODE_EDGE",
    "POLICY_COLORS",
    "PREDICTED",
    "cluster_colors",
    "hex_rgb",
    "policy_color",
]

POLICY_COLORS: dict[str, str] = {
    "spinsearch": "#1f77b4",      # blue: ours
    "ilp": "#d62728",             # red
    "ilp-decomposed": "#ff9896",  # light red: the ILP's decomposed variant
    "genetic": "#2ca02c",         # green
    "firstfit": "#7f7f7f",        # grey
    "bace": "#ff7f0e",            # orange
    "greedy": "#8c564b",          # brown
    "bruteforce": "#9467bd",      # purple
}
"""One colour per built-in policy in every figure and in the report's table."""

EXTRA_COLORS = ("#e377c2", "#bcbd22", "#17becf", "#393b79")
"""Colours of policies outside :data:`POLICY_COLORS` (chosen by a stable hash of the name)."""

CLUSTER_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                  "#9c755f", "#bab0ac")
"""Colours of the clusters of a chain, in chain order (repeating after ten)."""

MEASURED = "#ea580c"
PREDICTED = "#16a34a"
LINK = "#4a78b5"
NODE = "#f0a030"
NODE_EDGE = "#804000"


def policy_color(name: str) -> str:
    """The colour of policy ``name``: its fixed one for a built-in policy, else a stable pick by name."""
    if name in POLICY_COLORS:
        return POLICY_COLORS[name]
    return EXTRA_COLORS[sum(name.encode()) % len(EXTRA_COLORS)]


def hex_rgb(colour: str) -> tuple[float, float, float]:
    """``#rrggbb`` as three floats in [0, 1]."""
    c = colour.lstrip("#")
    return (int(c[0:2], 16) / 255.0, int(c[2:4], 16) / 255.0, int(c[4:6], 16) / 255.0)


def cluster_colors(chain: Sequence[str]) -> dict[str, str]:
    """Each distinct cluster of ``chain`` with its colour, in order of first appearance."""
    out: dict[str, str] = {}
    for name in chain:
        if name not in out:
            out[name] = CLUSTER_COLORS[len(out) % len(CLUSTER_COLORS)]
    return out
