"""Placement benchmark: planning time and predicted throughput of every policy on the same instances.

Topologies: ``spiderflow.core.topogen.generate_topology(n, seed=1000 + n, kind="geo")`` for n in ``--sizes``
(default 8, 16, 32, 64, 128, 256). Jobs (global batch 256, micro-batch 1, sequence 2048):

    gpt3-1.3b on 16..32 GPUs, gpt3-6.7b on 32..64, gpt3-13b on 64..128, llama3-70b on 128..256

Policies: every registered one (``spinsearch`` = SpinSearch + the TPA planner when it is importable,
``firstfit``, ``bace``, ``ilp``, ``genetic``; ``bruteforce`` only where it accepts the instance, i.e. never
at these sizes) plus ``spinsearch-l1`` (the same search with the level-1 planner only, to show the search's
own cost). ``ilp`` and ``genetic`` get ``--limit`` seconds per instance (default 20); the others take no
limit. Planning time is the policy's own ``planning_seconds`` (wall time inside ``place``), median over
``--repeats`` runs (``ilp``/``genetic``: ``--slow-repeats``, default 1), each from cold memos
(:func:`spiderflow.core.placement.clear_memos`: no search, plan or solve remembered from the run before);
``cpu_seconds`` is the median process CPU time of the same calls (less sensitive to other load on a
shared machine; CP-SAT's worker threads count in it). The topology's all-pairs widest-path matrices are
computed once per topology before timing (a property of the snapshot, cached per revision, shared by all
policies).

Ratios are against ``spinsearch``: ``time_ratio = t_policy / t_spinsearch`` and
``tput_ratio = throughput_spinsearch / throughput_policy`` (> 1: SpinSearch's plan is faster).

Usage::

    .venv/bin/python bench/placement.py --quick            # 8 and 16 clusters, two jobs, limit 5 s
    .venv/bin/python bench/placement.py --limit 20 --out bench/results/placement.json
    # re-measure some policies, keeping the other policies' rows of an earlier run:
    .venv/bin/python bench/placement.py --policies spinsearch,spinsearch-l1,firstfit,bace \
        --merge bench/results/placement.json --out bench/results/placement.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console
from rich.table import Table

# The checkout this script is in, ahead of any installed one: run from another checkout, it measures that code.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow.cli.common import check_outputs, csv_ints  # noqa: E402
from spiderflow.core.catalog import model_preset  # noqa: E402
from spiderflow.core.domain import GpuRange, JobSpec  # noqa: E402
from spiderflow.core.errors import SpiderFlowError  # noqa: E402
from spiderflow.core.placement import REGISTRY, clear_memos, load_builtin_policies  # noqa: E402
from spiderflow.core.placement.base import Budget, PlacementPolicy  # noqa: E402
from spiderflow.core.placement.spinsearch import SpinSearch  # noqa: E402
from spiderflow.core.topogen import generate_topology  # noqa: E402
from spiderflow.core.tpa.timeline import result_on_timeline  # noqa: E402

JOBS: tuple[tuple[str, int, int], ...] = (
    ("gpt3-1.3b", 16, 32),
    ("gpt3-6.7b", 32, 64),
    ("gpt3-13b", 64, 128),
    ("llama3-70b", 128, 256),
)
SLOW = ("ilp", "genetic")


def _policies(names: list[str] | None) -> dict[str, PlacementPolicy]:
    load_builtin_policies()
    out: dict[str, PlacementPolicy] = {}
    for name in sorted(REGISTRY):
        if name == "bruteforce" or (names and name not in names):
            continue
        out[name] = REGISTRY[name]()
    if not names or "spinsearch-l1" in names:
        out["spinsearch-l1"] = SpinSearch(planner=None)
    return out


def run(sizes: list[int], jobs: list[tuple[str, int, int]], *, policies: list[str] | None, repeats: int,
        slow_repeats: int, limit: float, console: Console) -> dict[str, Any]:
    pols = _policies(policies)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        topo = generate_topology(n, 1000 + n, "geo")
        _ = topo.bandwidth_matrix  # snapshot preprocessing, shared by every policy
        for model, gmin, gmax in jobs:
            job = JobSpec(id=f"{model}-{n}", model=model_preset(model), global_batch=256, micro_batch=1,
                          seq_len=2048, gpus=GpuRange(min=gmin, max=gmax))
            for name, pol in pols.items():
                reps = slow_repeats if name in SLOW else repeats
                budget = Budget(time_limit_s=limit if name in SLOW else None, seed=0)
                times: list[float] = []
                res = None
                error = ""
                cpu: list[float] = []
                for _ in range(reps):
                    clear_memos(topo)  # every repeat is a cold decision (no memoised search, plan or solve)
                    c0 = time.process_time()
                    try:
                        res = pol.place(topo, job, budget)
                    except SpiderFlowError as e:
                        error = str(e)
                        break
                    cpu.append(time.process_time() - c0)
                    times.append(res.planning_seconds)
                    res = result_on_timeline(res, topo, job)  # every policy on the one prediction
                row: dict[str, Any] = {
                    "clusters": n, "model": model, "gpus": f"{gmin}:{gmax}", "policy": name,
                    "status": res.status.value if res else "error", "reason": (res.reason if res else error),
                    "planning_seconds": statistics.median(times) if times else None,
                    "cpu_seconds": statistics.median(cpu) if cpu else None,
                    "repeats": len(times),
                    "throughput_tokens_per_s": res.plan.throughput_tokens_per_s if res and res.plan else None,
                    "step_time_s": res.plan.step_time_s if res and res.plan else None,
                    "gpus_used": res.plan.gpus if res and res.plan else None,
                    "chain_length": len(res.plan.chain) if res and res.plan else None,
                    "optimal": res.optimal if res else None,
                    "tpa": bool(res.stats.get("tpa")) if res else False,
                }
                rows.append(row)
                console.log(f"{n:>4} {model:<11} {name:<14} {row['status']:<14} "
                            f"{(row['planning_seconds'] or 0) * 1e3:9.1f} ms  "
                            f"{row['throughput_tokens_per_s'] or 0:12.0f} tok/s")
    _ratios(rows)
    return {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "cpus": __import__("os").cpu_count()},
        "settings": {"sizes": sizes, "jobs": jobs, "repeats": repeats, "slow_repeats": slow_repeats,
                     "limit_s": limit, "seed": "1000 + clusters", "kind": "geo"},
        "rows": rows,
        "summary": _summary(rows),
    }


def _ratios(rows: list[dict[str, Any]]) -> None:
    ref = {(r["clusters"], r["model"]): r for r in rows if r["policy"] == "spinsearch"}
    for r in rows:
        s = ref.get((r["clusters"], r["model"]))
        r["time_ratio"] = (r["planning_seconds"] / s["planning_seconds"]
                           if s and s["planning_seconds"] and r["planning_seconds"] else None)
        r["tput_ratio"] = (s["throughput_tokens_per_s"] / r["throughput_tokens_per_s"]
                           if s and s["throughput_tokens_per_s"] and r["throughput_tokens_per_s"] else None)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pol in sorted({r["policy"] for r in rows}):
        mine = [r for r in rows if r["policy"] == pol]
        by_size: dict[str, Any] = {}
        for n in sorted({r["clusters"] for r in mine}):
            ts = [r["planning_seconds"] for r in mine if r["clusters"] == n and r["planning_seconds"] is not None]
            by_size[str(n)] = statistics.median(ts) if ts else None
        tr = [r["tput_ratio"] for r in mine if r["tput_ratio"] is not None]
        ti = [r["time_ratio"] for r in mine if r["time_ratio"] is not None]
        out[pol] = {
            "median_planning_seconds_by_clusters": by_size,
            "mean_tput_ratio_spinsearch_over_policy": statistics.mean(tr) if tr else None,
            "min_tput_ratio": min(tr) if tr else None,
            "median_time_ratio_policy_over_spinsearch": statistics.median(ti) if ti else None,
            "successes": sum(1 for r in mine if r["status"] == "success"),
            "instances": len(mine),
            "proved_optimal": sum(1 for r in mine if r["optimal"] is True),
        }
    opt = [r for r in rows if r["policy"] == "ilp" and r["optimal"] is True and r["tput_ratio"] is not None]
    out["spinsearch_vs_proven_ilp"] = {
        "instances": len(opt),
        "min_tput_ratio": min((r["tput_ratio"] for r in opt), default=None),
    }
    return out


def _table(doc: dict[str, Any], console: Console) -> None:
    table = Table(title="placement: median planning time and predicted throughput (ratios vs spinsearch)")
    for col in ("clusters", "model", "policy", "status", "ms", "tokens/s", "time×", "SS tput÷", "opt"):
        table.add_column(col, justify="left" if col in ("model", "policy", "status") else "right")
    for r in doc["rows"]:
        table.add_row(
            str(r["clusters"]), r["model"], r["policy"], r["status"][:14],
            f"{r['planning_seconds'] * 1e3:.1f}" if r["planning_seconds"] is not None else "-",
            f"{r['throughput_tokens_per_s']:.0f}" if r["throughput_tokens_per_s"] else "-",
            f"{r['time_ratio']:.1f}" if r["time_ratio"] else "-",
            f"{r['tput_ratio']:.3f}" if r["tput_ratio"] else "-",
            {True: "yes", False: "no", None: "?"}[r["optimal"]],
        )
    console.print(table)
    console.print_json(json.dumps(doc["summary"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 16 clusters, two jobs, 5 s limit")
    ap.add_argument("--sizes", type=csv_ints(minimum=1), default=[8, 16, 32, 64, 128, 256],
                    help="cluster counts, comma-separated")
    ap.add_argument("--policies", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--slow-repeats", type=int, default=1)
    ap.add_argument("--limit", type=float, default=20.0, help="time limit of ilp and genetic (s)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/placement.json"))
    ap.add_argument("--merge", type=Path, default=None,
                    help="take the rows of policies not run now from this earlier result file")
    args = ap.parse_args(argv)
    check_outputs(ap, {"--out": args.out})
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sizes: list[int] = args.sizes
    jobs = list(JOBS)
    limit = args.limit
    if args.quick:
        sizes, jobs, limit = [8, 16], jobs[:2], min(limit, 5.0)
    console = Console(stderr=True)
    t0 = time.perf_counter()
    doc = run(sizes, jobs, policies=args.policies.split(",") if args.policies else None, repeats=args.repeats,
              slow_repeats=args.slow_repeats, limit=limit, console=console)
    doc["wall_seconds"] = time.perf_counter() - t0
    if args.merge is not None:
        old = json.loads(args.merge.read_text(encoding="utf-8"))
        ran = {r["policy"] for r in doc["rows"]}
        kept = [r for r in old["rows"] if r["policy"] not in ran
                and (r["clusters"], r["model"]) in {(x["clusters"], x["model"]) for x in doc["rows"]}]
        doc["rows"] = sorted(doc["rows"] + kept, key=lambda r: (r["clusters"], r["model"], r["policy"]))
        doc["merged_from"] = {"file": str(args.merge), "policies": sorted({r["policy"] for r in kept}),
                              "settings": old.get("settings")}
        _ratios(doc["rows"])
        doc["summary"] = _summary(doc["rows"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    _table(doc, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
