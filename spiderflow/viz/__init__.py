"""Pictures of plans: Gantt charts of the simulated pipeline schedule (:mod:`spiderflow.viz.gantt`)."""

from __future__ import annotations

from spiderflow.viz.gantt import render_gantt

__all__ = ["render_gantt"]
