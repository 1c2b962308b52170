"""``spiderflow simulate``: run placement policies over a trace on a topology and compare them."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import structlog
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from spiderflow.cli.common import (
    EXIT_USAGE,
    CliError,
    console,
    err_console,
    fit_table,
    output_dir,
    output_file,
    run_interruptible,
)
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.options import SearchOptions, make_policy

__all__ = ["register", "run_policies"]


def run_policies(topology: str, trace: str, policies: list[str], *, objective: str = "jct", seed: int = 0,
                 time_limit: float | None = None, overhead: str = "measured", events: str | None = None,
                 show_progress: bool = True, releases: bool = True, profile: str | None = None,
                 options: SearchOptions | None = None) -> dict[str, Any]:
    """Simulate each policy in turn on the same inputs; the JSON document the command writes. ``profile``:
    a hardware profile file (``docs/profiles.md``) folded into the topology (rates, bandwidths, memory);
    ``options``: the search budgets of the policies that take them."""
    from spiderflow.core.placement.base import Objective
    from spiderflow.core.sim.engine import OverheadMode, SimConfig, events_from_dict, simulate
    from spiderflow.core.sim.metrics import summarize
    from spiderflow.formats import in_file, load_document, load_trace
    from spiderflow.presets import resolve_topology

    topo = resolve_topology(topology)
    if profile is not None:
        from spiderflow.profile import apply_profile, load_profile

        topo = apply_profile(topo, load_profile(profile))
    jobs = load_trace(trace)
    if not jobs:
        raise CliError(f"{trace}: jobs: the trace has no jobs", EXIT_USAGE)
    evs = in_file(events, lambda d: events_from_dict(d, topo), load_document(events)) if events else []
    cfg = SimConfig(objective=Objective(objective), seed=seed, time_limit_s=time_limit,
                    overhead=OverheadMode(overhead), releases=releases)
    out: dict[str, Any] = {
        "topology": str(topology), "clusters": len(topo.clusters), "pool_gpus": topo.total_free_gpus,
        "trace": str(trace), "jobs": len(jobs), "objective": objective, "seed": seed, "time_limit_s": time_limit,
        "overhead_mode": overhead, "events": len(evs), "releases": releases, "policies": {},
    }
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, disable=not show_progress) as bar:
        for name in policies:
            task = bar.add_task(f"{name:>12}", total=len(jobs))

            def advance(done: int, _total: int, t: TaskID = task) -> None:
                bar.update(t, completed=done)

            res = simulate(topo, jobs, make_policy(name, options), cfg, events=evs, progress=advance)
            summary = summarize(res)
            summary["records"] = [r.to_dict() for r in res.records]
            out["policies"][name] = summary
    return out


def _simulate(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise CliError("--policies: name at least one policy", EXIT_USAGE)
    if len(set(policies)) != len(policies):
        raise CliError(f"--policies: duplicate name in {args.policies!r}", EXIT_USAGE)
    if args.time_limit is not None and not args.time_limit > 0:
        raise CliError(f"--time-limit: must be > 0 (got {args.time_limit})", EXIT_USAGE)
    try:
        options = SearchOptions(trials=args.trials, population=args.population, hint=args.hint,
                                gpu_price=args.gpu_price, lookahead=args.lookahead or None)
        for p in policies:
            make_policy(p, options)  # unknown names and bad options fail before any simulation runs
    except ValidationError as e:
        raise CliError(f"--{e.field.replace('_', '-')}: {e.reason} (got {e.value!r})", EXIT_USAGE) from None
    # Outputs and the scaling input are checked before the simulation: a long run must not end unable to save.
    output_file("--json", args.json)
    if args.plots is not None:
        output_dir("--plots", args.plots)
    rows = _scaling_rows(args.scaling) if args.scaling is not None else None
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    doc = run_interruptible(lambda: run_policies(
        args.topology, args.trace, policies, objective=args.objective, seed=args.seed, time_limit=args.time_limit,
        overhead=args.overhead, events=args.events, show_progress=not args.no_progress, releases=args.wait,
        profile=args.profile, options=options), what=f"the simulation (nothing written to {args.json})")
    args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if args.plots is not None:
        from spiderflow.viz.simplots import write_plots

        write_plots(doc, args.plots, rows)
    table_rows = [(name, f"{s['completed']}/{s['jobs']}",
             "-" if s["mean_jct_s"] is None else f"{s['mean_jct_s'] / 3600:.2f}",
             "-" if s["p95_jct_s"] is None else f"{s['p95_jct_s'] / 3600:.2f}",
             f"{s['throughput_tokens_per_s']:,.0f}", f"{s['sched_overhead_s']:.3g}", str(s["decisions"]),
             f"{100 * s['gpu_utilization']:.0f}%", f"{s['cost_usd']:,.2f}") for name, s in doc["policies"].items()]
    table = fit_table(f"{doc['jobs']} jobs on {doc['clusters']} clusters ({doc['pool_gpus']} GPUs)",
                      ["POLICY", "DONE", "MEAN JCT H", "P95 JCT H", "TOKENS/S", "SCHED S", "DECISIONS", "GPU UTIL",
                       "USD"], table_rows, keep=("POLICY", "DONE", "MEAN JCT H"))
    console.print(table)
    console.print(f"wrote {args.json}" + (f" and plots in {args.plots}" if args.plots else ""), soft_wrap=True)
    return 0


def _scaling_rows(path: Path) -> list[dict[str, Any]]:
    """The per-size, per-policy rows (``clusters``, ``policy``, ``overhead_per_decision_mean_s``) of a
    ``bench/paper.py`` results file, for the overhead-vs-clusters plot: the paired placement decisions of
    the rebuilt grid (``bench/results/paper-grid.json``: mean wall time per decision by topology size), or
    the ``sizes`` of the earlier multi-size format."""
    try:
        bench = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(bench, dict):
            raise ValueError("not a JSON object")
        if isinstance(bench.get("sizes"), list) and bench["sizes"]:
            return [{"clusters": int(size["clusters"]), "policy": p, **v}
                    for size in bench["sizes"] for p, v in size["policies"].items()]
        if isinstance(bench.get("placement"), dict) and isinstance(bench.get("settings"), dict):
            return _grid_overhead_rows(bench)
        raise ValueError("neither a 'placement' part with 'settings' nor a 'sizes' list")
    except OSError as e:
        raise CliError(f"--scaling: cannot read {path}: {e.strerror or e}", EXIT_USAGE) from None
    except (ValueError, TypeError, KeyError, AttributeError, LookupError) as e:
        raise CliError(f"--scaling: {path} is not a bench/paper.py results file ({type(e).__name__}: {e})",
                       EXIT_USAGE) from None


def _grid_overhead_rows(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Mean and p95 wall time per placement decision, per (cluster count, policy label), of a rebuilt
    ``bench/paper.py`` grid: generated topologies have ``settings.clusters`` clusters, presets their own."""
    from spiderflow.core.sim.metrics import percentile
    from spiderflow.presets import PRESETS, resolve_topology

    generated = ("geo", "hub", "mesh")
    sizes: dict[str, int] = {}
    walls: dict[tuple[int, str], list[float]] = {}
    rows = bench["placement"]["rows"]
    if not isinstance(rows, list) or not rows:
        raise ValueError("no placement rows")
    for row in rows:
        kind = str(row["kind"])
        if kind not in sizes:
            if kind not in generated and kind not in PRESETS:
                raise ValueError(f"placement row of unknown topology kind {kind!r}")
            sizes[kind] = (int(bench["settings"]["clusters"]) if kind in generated
                           else len(resolve_topology(kind).clusters))
        walls.setdefault((sizes[kind], str(row["label"])), []).append(float(row["wall_s"]))
    return [{"clusters": n, "policy": label, "decisions": len(ws),
             "overhead_per_decision_mean_s": sum(ws) / len(ws),
             "overhead_per_decision_p95_s": percentile(ws, 95)}
            for (n, label), ws in sorted(walls.items())]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="compare placement policies on a topology and a job trace")
    p.add_argument("--topology", required=True, help="topology file or preset name (e.g. aws-10-dtfm)")
    p.add_argument("--trace", required=True, help="trace file (see `spiderflow trace generate`)")
    p.add_argument("--policies", default="spinsearch,ilp,genetic,firstfit,bace",
                   help="comma-separated policy names (default: %(default)s)")
    p.add_argument("--json", type=Path, required=True, help="write the results document here")
    p.add_argument("--plots", type=Path, help="write PNG figures and report.html into this directory")
    p.add_argument("--scaling", type=Path,
                   help="bench/paper.py results JSON (bench/results/paper-grid.json): plot its measured time "
                        "per placement decision against the cluster count")
    p.add_argument("--objective", choices=["jct", "cost", "balanced"], default="jct")
    p.add_argument("--seed", type=int, default=0, help="seed passed to the policies' budgets")
    p.add_argument("--time-limit", type=float, help="per-decision time limit for policies that support one (s)")
    from spiderflow.cli.commands.plan import add_search_options

    add_search_options(p)
    p.add_argument("--lookahead", action="store_true",
                   help="spinsearch: match jobs to regions against the arrivals expected while each runs (the "
                        "observed rate and mix of the last arrivals; see spiderflow.core.placement.lookahead)")
    p.add_argument("--overhead", choices=["measured", "fixed"], default="measured",
                   help="feed measured decision times into simulated time (default) or a fixed 10 ms")
    p.add_argument("--events", help="topology events file ({\"events\": [...]})")
    p.add_argument("--wait", dest="wait", action=argparse.BooleanOptionalAction, default=True,
                   help="offer every policy to wait for GPUs being released when starting later scores better "
                        "(default; SpinSearch prices it itself, the cycle prices it with any other policy's own "
                        "placement); --no-wait: every job starts on what is free now (the scheduler service "
                        "without --wait-for-releases)")
    p.add_argument("--no-releases", dest="wait", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", help="hardware profile (docs/profiles.md) applied to the topology")
    p.set_defaults(func=_simulate)
