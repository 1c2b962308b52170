"""``spiderflow trace``: generate synthetic job traces and validate trace files."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from spiderflow.cli.common import EXIT_USAGE, CliError, add_json_flag, console, print_json
from spiderflow.core.domain import JobSpec
from spiderflow.formats import load_trace, trace_to_dict

__all__ = ["register", "summarize_trace"]


def summarize_trace(jobs: list[JobSpec]) -> dict[str, Any]:
    """Jobs, models, GPU demand range, step range, arrival span, tenants and priorities of a trace."""
    arrivals = [j.arrival_s for j in jobs]
    return {
        "jobs": len(jobs),
        "models": dict(Counter(j.model.name for j in jobs).most_common()),
        "gpus_min": {"min": min(j.gpus.min for j in jobs), "max": max(j.gpus.min for j in jobs)},
        "gpus_max": {"min": min(j.gpus.max for j in jobs), "max": max(j.gpus.max for j in jobs)},
        "steps": {"min": min(j.steps for j in jobs), "max": max(j.steps for j in jobs)},
        "arrival_s": {"first": min(arrivals), "last": max(arrivals), "span": max(arrivals) - min(arrivals)},
        "tenants": len({j.tenant for j in jobs}),
        "priorities": dict(sorted(Counter(j.priority for j in jobs).items())),
    }


def _validate(args: argparse.Namespace) -> int:
    jobs = load_trace(args.file)
    if not jobs:
        raise CliError(f"{args.file}: jobs: the trace has no jobs", EXIT_USAGE)
    s = summarize_trace(jobs)
    if args.json:
        print_json(s)
        return 0
    t = Table(title=f"{args.file}: valid trace", show_header=False)
    t.add_row("jobs", str(s["jobs"]))
    t.add_row("models", ", ".join(f"{m} ×{n}" for m, n in s["models"].items()))
    t.add_row("GPU demand (min–max)", f"{s['gpus_min']['min']} – {s['gpus_max']['max']}")
    t.add_row("steps", f"{s['steps']['min']} – {s['steps']['max']}")
    a = s["arrival_s"]
    t.add_row("arrivals (s)", f"{a['first']:g} – {a['last']:g} (span {a['span'] / 3600:.2f} h)")
    t.add_row("tenants", str(s["tenants"]))
    t.add_row("priorities", ", ".join(f"{p}: {n}" for p, n in s["priorities"].items()))
    console.print(t)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from spiderflow.core.sim.tracegen import generate_trace
    from spiderflow.presets import resolve_topology

    if args.jobs < 1 or args.jobs > 1_000_000:
        raise CliError("--jobs: must be between 1 and 1000000", EXIT_USAGE)
    if not args.load > 0:
        raise CliError(f"--load: must be > 0 (got {args.load})", EXIT_USAGE)
    topo = resolve_topology(args.topology) if args.topology else None
    jobs = generate_trace(args.jobs, args.seed, args.load, topo)
    doc = trace_to_dict(jobs)
    out: Path | None = args.out
    if out is None:
        print(json.dumps(doc, indent=1))
        return 0
    text = yaml.safe_dump(doc, sort_keys=False) if out.suffix in {".yaml", ".yml"} else json.dumps(doc, indent=1)
    out.write_text(text + "\n", encoding="utf-8")
    span = jobs[-1].arrival_s - jobs[0].arrival_s
    console.print(f"wrote {out}: {len(jobs)} jobs over {span / 3600:.2f} h")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="generate or validate job traces")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION", required=True)

    g = tsub.add_parser("generate", help="write a synthetic trace (Poisson arrivals, mixed model sizes)")
    g.add_argument("--jobs", type=int, required=True, help="number of jobs")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--load", type=float, default=1.0,
                   help="offered load; with --topology relative to its GPU capacity (default 1.0)")
    g.add_argument("--topology", help="topology file or preset name that --load is scaled against")
    g.add_argument("--out", type=Path, help="output file (.json or .yaml); stdout when omitted")
    g.set_defaults(func=_generate)

    v = tsub.add_parser("validate", help="check a trace file and print a summary")
    v.add_argument("file", type=Path)
    add_json_flag(v)
    v.set_defaults(func=_validate)
