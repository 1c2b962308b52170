"""Figures (PNG, matplotlib Agg) and a self-contained HTML report of simulation results.

Inputs are the plain dicts :func:`spiderflow.core.sim.metrics.summarize` returns, plus per-job records
(``{"status", "jct_s", ...}``) for the JCT CDF. The HTML embeds the PNGs as base64 data URIs, so the
single file can be mailed or attached to a CI run.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from spiderflow.viz.palette import POLICY_COLORS, policy_color

__all__ = ["POLICY_COLORS", "html_report", "plot_jct_cdf", "plot_overhead_vs_clusters", "plot_throughput_cost",
           "policy_color", "write_plots"]


def plot_jct_cdf(records_by_policy: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> Path:
    """Empirical CDF of the JCT (hours) of completed jobs, one line per policy."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, recs in records_by_policy.items():
        jcts = np.sort([r["jct_s"] / 3600.0 for r in recs if r.get("status") == "completed" and r.get("jct_s")])
        if len(jcts):
            ax.step(jcts, np.arange(1, len(jcts) + 1) / len(jcts), where="post", label=policy,
                    color=policy_color(policy), linewidth=1.8)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h, log scale)")
    ax.set_ylabel("fraction of completed jobs (0–1)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="policy")
    ax.set_title("Job completion time, cumulative distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput_cost(summaries: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Two bar charts side by side: throughput (tokens/s) and electricity cost ($) per policy."""
    names = list(summaries)
    thr = [float(summaries[n].get("throughput_tokens_per_s") or 0.0) for n in names]
    cost = [float(summaries[n].get("cost_usd") or 0.0) for n in names]
    colors = [policy_color(n) for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    a.bar(names, thr, color=colors)
    a.set_ylabel("tokens per second (mean over the run)")
    a.set_title("Training throughput")
    b.bar(names, cost, color=colors)
    b.set_ylabel("electricity cost (USD, whole trace)")
    b.set_title("Electricity cost")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_overhead_vs_clusters(rows: Sequence[Mapping[str, Any]], path: Path,
                              key: str = "overhead_per_decision_mean_s") -> Path:
    """Scheduling overhead (``key``; default mean seconds per decision) against cluster count, log y.

    ``rows``: ``{"clusters": n, "policy": name, key: value}`` (e.g. from ``bench/paper.py``).
    """
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        v = r.get(key)
        if v is not None and v > 0:
            by_policy.setdefault(str(r["policy"]), []).append((int(r["clusters"]), float(v)))
    sizes = sorted({c for pts in by_policy.values() for c, _ in pts})
    unit = "seconds per placement decision" if key.endswith("_s") else key
    if len(sizes) <= 1:  # one topology: bars per policy (a line through one x would be dots on a vertical)
        names = list(by_policy)  # the document's order, as in the other figures
        ax.bar(names, [by_policy[n][0][1] for n in names], color=[policy_color(n) for n in names])
        ax.set_yscale("log")
        ax.set_ylabel(f"{unit} (log scale)")
        ax.tick_params(axis="x", rotation=30)
        ax.set_title(f"Scheduling overhead on {sizes[0] if sizes else '?'} clusters")
    else:
        for policy, pts in sorted(by_policy.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy, color=policy_color(policy))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [str(c) for c in sizes])
        ax.set_xlabel("clusters in the topology")
        ax.set_ylabel(f"{unit} (log scale)")
        ax.legend(title="policy")
        ax.set_title("Scheduling overhead vs cluster count")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(doc: Mapping[str, Any], out_dir: Path,
                scaling_rows: Sequence[Mapping[str, Any]] | None = None) -> list[Path]:
    """Write every figure for a ``simulate`` JSON document (``doc["policies"][name]`` summaries with
    ``records``) into ``out_dir``, plus ``report.html``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pol = doc["policies"]
    paths = [
        plot_jct_cdf({n: s.get("records", []) for n, s in pol.items()}, out_dir / "jct_cdf.png"),
        plot_throughput_cost(pol, out_dir / "throughput_cost.png"),
    ]
    rows = list(scaling_rows) if scaling_rows else [
        {"clusters": doc.get("clusters", 0), "policy": n, "overhead_per_decision_mean_s":
         s.get("overhead_per_decision_mean_s")} for n, s in pol.items()
    ]
    paths.append(plot_overhead_vs_clusters(rows, out_dir / "overhead_vs_clusters.png"))
    paths.append(html_report(doc, paths, out_dir / "report.html"))
    return paths


_COLUMNS: tuple[tuple[str, str, Any], ...] = (
    ("completed", "Jobs done", lambda s: f"{s.get('completed', 0)}/{s.get('jobs', '?')}"),
    ("mean_jct_s", "Mean JCT (h)", lambda s: _hours(s.get("mean_jct_s"))),
    ("p95_jct_s", "p95 JCT (h)", lambda s: _hours(s.get("p95_jct_s"))),
    ("makespan_s", "Makespan (h)", lambda s: _hours(s.get("makespan_s"))),
    ("throughput_tokens_per_s", "Throughput (tokens/s)", lambda s: _num(s.get("throughput_tokens_per_s"), ",.0f")),
    ("sched_overhead_s", "Scheduling time (s)", lambda s: _sig(s.get("sched_overhead_s"))),
    ("decisions", "Decisions", lambda s: _num(s.get("decisions"), "d")),
    ("overhead_per_decision_mean_s", "Per decision (ms)",
     lambda s: _sig(None if s.get("overhead_per_decision_mean_s") is None
                    else 1000 * s["overhead_per_decision_mean_s"])),
    ("gpu_utilization", "GPU utilisation", lambda s: _num(None if s.get("gpu_utilization") is None
                                                          else 100 * s["gpu_utilization"], ".0f") + " %"),
    ("cost_usd", "Electricity (USD)", lambda s: _num(s.get("cost_usd"), ",.2f")),
    ("restarts", "Restarts", lambda s: _num(s.get("restarts"), "d")),
)


def _num(v: Any, spec: str) -> str:
    if v is None:
        return "–"
    try:
        return format(int(v) if spec == "d" else float(v), spec)
    except (TypeError, ValueError):
        return html.escape(str(v))


def _sig(v: Any) -> str:
    """Three significant digits without an exponent (``0.00663``, ``40.4``, ``4,910``)."""
    if v is None:
        return "–"
    x = float(v)
    return _num(x, ",.0f") if abs(x) >= 100 else _num(x, ".3g")


def _hours(v: Any) -> str:
    return "–" if v is None else f"{float(v) / 3600:.2f}"


_SETTINGS = {
    "topology": "Topology", "clusters": "Clusters", "pool_gpus": "GPUs in the pool", "trace": "Job trace",
    "jobs": "Jobs", "objective": "Objective", "seed": "Random seed", "time_limit_s": "Solver time limit (s)",
    "overhead_mode": "Scheduling overhead", "events": "Topology events", "releases": "Waiting for released GPUs",
}
"""Human names of the settings a ``simulate`` document carries (others: their key, spaced and capitalised)."""


def _setting(v: Any) -> str:
    """A setting as a person reads it: yes/no, – for none, ``key: value`` lists for mappings."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, Mapping):
        return ", ".join(f"{str(k).replace('_', ' ')}: {_setting(x)}" for k, x in v.items()) or "–"
    if isinstance(v, (list, tuple)):
        return ", ".join(_setting(x) for x in v) or "–"
    return str(v)


_CAPTIONS = {
    "jct_cdf": "Job completion time: the fraction of jobs done within a given time (further left is better).",
    "throughput_cost": "Mean training throughput and the electricity bill of the whole trace, per policy.",
    "overhead_vs_clusters": "Wall time the real placement code spent per decision (log scale; lower is better).",
}


def html_report(doc: Mapping[str, Any], images: Sequence[Path], path: Path) -> Path:
    """A single self-contained HTML page: what was simulated, the summary per policy (units in the headers,
    times in hours), the figures inline with captions, and the raw settings at the end."""
    pol = doc["policies"]
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in (("", "Policy", None), *_COLUMNS))
    body = "".join(
        f'<tr><td><span class="dot" style="background:{policy_color(n)}"></span>{html.escape(n)}</td>'
        + "".join(f"<td>{fmt(s)}</td>" for _, _, fmt in _COLUMNS) + "</tr>"
        for n, s in pol.items()
    )
    imgs = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(_CAPTIONS.get(p.stem, p.stem))}'
        "</figcaption></figure>"
        for p in images if p.suffix == ".png"
    )
    facts = [("Topology", f"{doc.get('topology', '?')} ({doc.get('clusters', '?')} clusters, "
                          f"{doc.get('pool_gpus', '?')} GPUs)"),
             ("Trace", f"{doc.get('trace', '?')} ({doc.get('jobs', '?')} jobs)"),
             ("Objective", str(doc.get("objective", "?"))), ("Seed", str(doc.get("seed", "?"))),
             ("Topology events", str(doc.get("events", 0))),
             ("Overhead", "measured wall time of the real code" if doc.get("overhead_mode") == "measured"
              else str(doc.get("overhead_mode", "?")))]
    best = min((n for n in pol if pol[n].get("mean_jct_s")), key=lambda n: pol[n]["mean_jct_s"], default=None)
    lead = (f"<p class=lead>Lowest mean job completion time: <b>{html.escape(best)}</b> "
            f"({_hours(pol[best]['mean_jct_s'])} h).</p>" if best else "")
    settings = "".join(f"<tr><th>{html.escape(_SETTINGS.get(str(k), str(k).replace('_', ' ').capitalize()))}</th>"
                       f"<td>{html.escape(_setting(v))}</td></tr>" for k, v in doc.items() if k != "policies")
    page = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>SpiderFlow simulation report</title>
<style>body{{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1d2330;padding:0 1em}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border-bottom:1px solid #e4e7ec;padding:6px 10px;text-align:right}}
td:first-child,th:first-child{{text-align:left;white-space:nowrap}}th{{background:#f6f7f9;font-weight:600}}
dl{{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px}}dt{{color:#667085}}dd{{margin:0}}
figure{{margin:2em 0}}img{{max-width:100%}}figcaption{{color:#475467}}.lead{{font-size:17px}}
.dot{{display:inline-block;width:10px;height:10px;border-radius:50%;margin-right:8px}}
details{{margin-top:2em;color:#475467}}</style></head><body>
<h1>SpiderFlow simulation report</h1>
<dl>{"".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in facts)}</dl>
{lead}<table><tr>{head}</tr>{body}</table>{imgs}
<details><summary>Settings of the run</summary><table>{settings}</table></details></body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path
