"""Gantt charts of a plan's pipeline schedule, from the exact event-level timeline.

One row per pipeline stage (its data-parallel replicas as thin lanes inside the row), forward blocks
light and backward blocks dark in the colour of the stage's cluster, transfers as thin bars under the
row of the stage that sends them (activations forward, gradients backward), idle time hatched so the
bubbles stand out, and the stage-to-cluster map in the row labels. Formats: ``.png`` and ``.svg`` via
matplotlib's Agg backend, ``.html`` as one self-contained page (inline SVG plus the stage table).
"""

from __future__ import annotations

import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from spiderflow.core.domain import JobSpec, Plan, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.tpa.timeline import Timeline, simulate_plan
from spiderflow.viz.palette import cluster_colors, hex_rgb

__all__ = ["SUPPORTED_SUFFIXES", "render_gantt"]

SUPPORTED_SUFFIXES = (".png", ".svg", ".html")
_PLOT_PX = 1150.0  # width of the plotting area in pixels at 130 dpi (the legend takes the rest)
_DIGIT_PX = 6.5   # width of one digit of a block label (font size 7) plus margins
_Rgb = tuple[float, float, float]


def _palette(clusters: list[str]) -> dict[str, tuple[_Rgb, _Rgb]]:
    """Per cluster: (forward colour, backward colour), from the shared palette (:mod:`spiderflow.viz.palette`)."""
    out: dict[str, tuple[_Rgb, _Rgb]] = {}
    for name, colour in cluster_colors(clusters).items():
        r, g, b = hex_rgb(colour)
        light = (0.45 + 0.55 * r, 0.45 + 0.55 * g, 0.45 + 0.55 * b)
        dark = (0.7 * r, 0.7 * g, 0.7 * b)
        out[name] = (light, dark)
    return out


def _fits_label(duration_s: float, span_s: float, micro_batch: int) -> bool:
    """Whether a block of ``duration_s`` is wide enough, drawn, to hold its micro-batch number without
    touching its neighbours' (the numbers of narrow blocks are left out rather than overlapped)."""
    return duration_s / span_s * _PLOT_PX >= _DIGIT_PX * (len(str(micro_batch)) + 1)


def _figure(plan: Plan, tl: Timeline, title: str) -> Figure:
    n = len(plan.stages)
    chain = list(plan.chain)
    colours = _palette(chain)
    row_h = 1.0
    fig_h = min(2.0 + 0.55 * n, 40.0)
    fig, ax = plt.subplots(figsize=(14, fig_h))
    span = tl.makespan_s if tl.makespan_s > 0 else 1.0
    for i, st in enumerate(plan.stages):
        y0 = (n - 1 - i) * row_h
        d = tl.replicas[i]
        lane = 0.62 / d
        # Idle background: whatever the blocks do not cover is a bubble.
        ax.broken_barh([(0.0, span)], (y0 + 0.3, 0.62), facecolors="none", edgecolors=(0.8, 0.8, 0.8),
                       hatch="////", linewidth=0.0)
        light, dark = colours[st.cluster]
        for r in range(d):
            mine = [o for o in tl.ops if o.stage == i and o.replica == r]
            ly = y0 + 0.3 + (d - 1 - r) * lane
            fwd = [(o.start_s, o.end_s - o.start_s) for o in mine if o.kind == "F"]
            bwd = [(o.start_s, o.end_s - o.start_s) for o in mine if o.kind == "B"]
            ax.broken_barh(fwd, (ly, lane * 0.95), facecolors=light, edgecolors="black", linewidth=0.2)
            ax.broken_barh(bwd, (ly, lane * 0.95), facecolors=dark, edgecolors="black", linewidth=0.2)
            for o in mine:
                if _fits_label(o.end_s - o.start_s, span, o.micro_batch) and lane >= 0.2:
                    ax.text((o.start_s + o.end_s) / 2, ly + lane * 0.47, str(o.micro_batch), ha="center",
                            va="center", fontsize=7, color="black" if o.kind == "F" else "white", clip_on=True)
        # Transfers sent by this stage: activations (forward) and gradients (backward) on a thin strip.
        out_f = [(x.start_s, x.end_s - x.start_s) for x in tl.transfers if x.src == i and x.kind == "F"]
        out_b = [(x.start_s, x.end_s - x.start_s) for x in tl.transfers if x.src == i and x.kind == "B"]
        ax.broken_barh(out_f, (y0 + 0.17, 0.09), facecolors=(0.2, 0.5, 0.2), alpha=0.5, linewidth=0.0)
        ax.broken_barh(out_b, (y0 + 0.06, 0.09), facecolors=(0.6, 0.2, 0.6), alpha=0.5, linewidth=0.0)
    ax.set_yticks([(n - 1 - i) * row_h + 0.6 for i in range(n)])
    ax.set_yticklabels([
        f"stage {i} · {st.cluster} · layers {st.first_layer}–{st.last_layer} · tp{st.tp}×dp{st.dp}"
        for i, st in enumerate(plan.stages)
    ], fontsize=9)
    ax.set_xlim(0.0, span * 1.01)
    ax.set_ylim(-0.05, n * row_h + 0.05)
    ax.set_xlabel("time into the training step (s)")
    ax.set_title(title, fontsize=10)
    handles = [Patch(facecolor=colours[c][0], edgecolor="black", label=f"{c}: forward") for c in chain]
    handles += [Patch(facecolor=colours[c][1], edgecolor="black", label=f"{c}: backward") for c in chain]
    handles += [
        Patch(facecolor=(0.2, 0.5, 0.2), alpha=0.5, label="activation transfer (sent)"),
        Patch(facecolor=(0.6, 0.2, 0.6), alpha=0.5, label="gradient transfer (sent)"),
        Patch(facecolor="none", edgecolor=(0.6, 0.6, 0.6), hatch="////", label="idle (bubble)"),
    ]
    labelled = any(_fits_label(o.end_s - o.start_s, span, o.micro_batch) for o in tl.ops)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="numbers: micro-batches" if labelled else None, title_fontsize=8)
    fig.tight_layout()
    return fig


def _title(plan: Plan, tl: Timeline, job: JobSpec) -> str:
    return (
        f"job {job.id} · {job.model.name} · {plan.schedule.value} · m={plan.micro_batches} · "
        f"{len(plan.stages)} stages on {' → '.join(plan.chain)} · simulated step {tl.step_s:.3f} s "
        f"(closed form {plan.step_time_s:.3f} s)"
    )


def render_gantt(plan: Plan, topo: Topology, job: JobSpec, path: str | Path) -> Path:
    """Draw ``plan``'s simulated step to ``path`` (``.png``, ``.svg`` or ``.html``); returns the path.

    Raises :class:`~spiderflow.core.errors.ValidationError` (field ``path``) for another suffix.
    """
    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValidationError("path", f"unsupported chart format; use one of {', '.join(SUPPORTED_SUFFIXES)}",
                              str(path))
    tl = simulate_plan(plan, topo, job)
    title = _title(plan, tl, job)
    fig = _figure(plan, tl, title)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if suffix in (".png", ".svg"):
            fig.savefig(out, format=suffix[1:], dpi=130)
        else:
            buf = io.StringIO()
            fig.savefig(buf, format="svg")
            svg = buf.getvalue()
            svg = svg[svg.index("<svg"):]  # drop the XML prologue: the SVG is inlined in HTML
            rows = "\n".join(
                f"<tr><td>{i}</td><td>{html.escape(st.cluster)}</td><td>{st.first_layer}–{st.last_layer}</td>"
                f"<td>{st.tp}</td><td>{st.dp}</td><td>{mem:.1f}</td><td>{tl.bubble_fraction(i):.0%}</td></tr>"
                for i, (st, mem) in enumerate(zip(plan.stages, plan.memory_gib_per_gpu or
                                                  (0.0,) * len(plan.stages), strict=True))
            )
            page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:2px 8px;text-align:right}}</style></head>
<body><h2>{html.escape(title)}</h2>
{svg}
<table><tr><th>stage</th><th>cluster</th><th>layers</th><th>tp</th><th>dp</th><th>GiB/GPU</th>
<th>idle</th></tr>
{rows}
</table></body></html>
"""
            out.write_text(page, encoding="utf-8")
    finally:
        plt.close(fig)
    return out
