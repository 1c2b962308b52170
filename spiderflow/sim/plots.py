"""Figures (PNG, matplotlib Agg) and a self-contained HTML report of simulation results.

Inputs are the plain dicts :func:`spiderflow.sim.metrics.summarize` returns, plus per-job records
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

__all__ = ["html_report", "plot_jct_cdf", "plot_overhead_vs_clusters", "plot_throughput_cost", "write_plots"]


def plot_jct_cdf(records_by_policy: Mapping[str, Sequence[Mapping[str, Any]]], path: Path) -> Path:
    """Empirical CDF of the JCT (hours) of completed jobs, one line per policy."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, recs in records_by_policy.items():
        jcts = np.sort([r["jct_s"] / 3600.0 for r in recs if r.get("status") == "completed" and r.get("jct_s")])
        if len(jcts):
            ax.step(jcts, np.arange(1, len(jcts) + 1) / len(jcts), where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h, log scale)")
    ax.set_ylabel("fraction of completed jobs")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("JCT CDF per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput_cost(summaries: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Two bar charts side by side: throughput (tokens/s) and electricity cost ($) per policy."""
    names = list(summaries)
    thr = [float(summaries[n].get("throughput_tokens_per_s") or 0.0) for n in names]
    cost = [float(summaries[n].get("cost_usd") or 0.0) for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    a.bar(names, thr, color="tab:blue")
    a.set_ylabel("tokens / s")
    a.set_title("throughput")
    b.bar(names, cost, color="tab:orange")
    b.set_ylabel("USD")
    b.set_title("electricity cost")
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
    for policy, pts in sorted(by_policy.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("clusters")
    ax.set_ylabel("seconds per decision (log)" if key.endswith("_s") else key)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title("scheduling overhead vs cluster count")
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


_COLUMNS = ("completed", "mean_jct_s", "p95_jct_s", "makespan_s", "throughput_tokens_per_s", "sched_overhead_s",
            "decisions", "overhead_per_decision_mean_s", "gpu_utilization", "cost_usd", "restarts")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "–" if v is None else str(v)


def html_report(doc: Mapping[str, Any], images: Sequence[Path], path: Path) -> Path:
    """A single self-contained HTML page: the summary table per policy and the figures inline."""
    pol = doc["policies"]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ("policy", *_COLUMNS))
    body = "".join(
        "<tr><td>" + html.escape(n) + "</td>" + "".join(f"<td>{_fmt(s.get(c))}</td>" for c in _COLUMNS) + "</tr>"
        for n, s in pol.items()
    )
    imgs = "".join(
        f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{html.escape(p.stem)}</figcaption></figure>'
        for p in images if p.suffix == ".png"
    )
    meta = {k: v for k, v in doc.items() if k != "policies"}
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>SpiderFlow simulation report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}img{{max-width:100%}}</style></head><body>
<h1>SpiderFlow simulation report</h1><pre>{html.escape(repr(meta))}</pre>
<table><tr>{head}</tr>{body}</table>{imgs}</body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path
