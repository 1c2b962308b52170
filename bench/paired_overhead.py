"""Scheduling overhead on the same decisions: every policy decides exactly the instances SpinSearch decided.

``bench/paper.py`` times each policy on its own trajectory: a policy's measured decision times delay its
jobs, so each policy sees other queues and free-GPU states, makes another number of decisions (a GA that
fails quickly on memory is asked again and again), and its mean moves from run to run with the trajectory.
This script takes that out. For each cluster count it simulates SpinSearch on the paper's topology and trace
(same seeds and load as ``bench/paper.py``, a fixed overhead per decision so the instances are
reproducible) and records every decision it makes: the topology snapshot, the job and the budget (time
limit, seed, objective, releases). Each policy then decides those instances, in the recorded order, in a
fresh process (no policy inherits another's caches), and each decision's wall and CPU time is measured.

Figures per size and policy ``p``: mean and median wall time per instance, mean CPU time, how many
instances ``p`` placed, and against SpinSearch on the same instances ``ratio_of_means`` (mean of ``p`` /
mean of SpinSearch) and ``median_ratio`` (the median over instances of ``p``'s time / SpinSearch's).

Usage::

    .venv/bin/python bench/paired_overhead.py --sizes 8,16,32,64 --time-limit 3 --out bench/results/paired-overhead.json
    .venv/bin/python bench/paired_overhead.py --quick    # 8 clusters, 20 jobs

Writes ``--out`` (JSON) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from spiderflow.cli.common import csv_ints
from spiderflow.domain import JobSpec, Topology
from spiderflow.errors import SpiderFlowError
from spiderflow.placement import REGISTRY, load_builtin_policies
from spiderflow.placement.base import Budget, PlacementResult, get_policy
from spiderflow.sim.engine import OverheadMode, SimConfig, simulate
from spiderflow.sim.tracegen import generate_trace
from spiderflow.topogen import generate_topology

POLICIES = ("spinsearch", "ilp", "genetic")

Instance = tuple[Topology, JobSpec, Budget]


class _Recorder:
    """A policy that records every decision asked of it and answers with the wrapped policy."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.seen: list[Instance] = []

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        self.seen.append((topo, job, budget or Budget()))
        result: PlacementResult = self.inner.place(topo, job, budget)
        return result


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    load_builtin_policies()


def record(clusters: int, jobs: int, *, seed: int, load: float, time_limit: float) -> list[Instance]:
    """SpinSearch's decisions in the simulation of the paper's topology and trace for ``clusters``."""
    topo = generate_topology(clusters, seed, "geo")
    trace = generate_trace(jobs, seed, load, topo)
    rec = _Recorder(get_policy("spinsearch"))
    simulate(topo, trace, rec, SimConfig(seed=seed, time_limit_s=time_limit, overhead=OverheadMode.FIXED))
    return rec.seen


def _time_child(args: tuple[str, list[Instance]]) -> list[tuple[float, float, str]]:
    """``(wall s, CPU s, status)`` of ``policy`` deciding each instance, in order."""
    _quiet()
    name, instances = args
    policy = get_policy(name)
    out: list[tuple[float, float, str]] = []
    for topo, job, budget in instances:
        c0 = time.process_time()
        t0 = time.perf_counter()
        try:
            status = str(policy.place(topo, job, budget).status)
        except SpiderFlowError as e:
            status = type(e).__name__
        out.append((time.perf_counter() - t0, time.process_time() - c0, status))
    return out


def time_policy(name: str, instances: list[Instance]) -> list[tuple[float, float, str]]:
    """:func:`_time_child` in a fresh process."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        res: list[tuple[float, float, str]] = pool.apply(_time_child, ((name, instances),))
        return res


def run_size(clusters: int, jobs: int, *, seed: int, load: float, time_limit: float,
             policies: list[str]) -> dict[str, Any]:
    instances = record(clusters, jobs, seed=seed, load=load, time_limit=time_limit)
    timed = {p: time_policy(p, instances) for p in policies}
    base = [w for w, _, _ in timed["spinsearch"]]
    out: dict[str, Any] = {"clusters": clusters, "jobs": jobs, "instances": len(instances), "policies": {}}
    for p, rows in timed.items():
        walls = [w for w, _, _ in rows]
        fig: dict[str, Any] = {
            "mean_s": statistics.fmean(walls), "median_s": statistics.median(walls),
            "cpu_mean_s": statistics.fmean(c for _, c, _ in rows),
            "placed": sum(1 for _, _, s in rows if s == "success"),
        }
        if p != "spinsearch":
            fig["ratio_of_means"] = fig["mean_s"] / statistics.fmean(base)
            fig["median_ratio"] = statistics.median(w / max(b, 1e-9) for w, b in zip(walls, base, strict=True))
        out["policies"][p] = fig
        print(f"  {clusters:>4} clusters {p:>10}: {len(rows)} instances, mean {fig['mean_s'] * 1e3:.1f} ms, "
              f"median {fig['median_s'] * 1e3:.1f} ms, placed {fig['placed']}"
              + (f", {fig['ratio_of_means']:.1f}x mean, {fig['median_ratio']:.1f}x median"
                 if "ratio_of_means" in fig else ""), flush=True)
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| clusters | instances | spinsearch mean / median ms | policy | mean / median ms | placed | "
             "ratio of means | median ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ss = r["policies"]["spinsearch"]
        for p, f in r["policies"].items():
            if p == "spinsearch":
                continue
            lines.append(f"| {r['clusters']} | {r['instances']} | {ss['mean_s'] * 1e3:.1f} / "
                         f"{ss['median_s'] * 1e3:.1f} | {p} | {f['mean_s'] * 1e3:.0f} / {f['median_s'] * 1e3:.0f} | "
                         f"{f['placed']} (spinsearch {ss['placed']}) | {f['ratio_of_means']:.1f}× | "
                         f"{f['median_ratio']:.1f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", type=csv_ints(minimum=1), default=[8, 16, 32, 64],
                    help="cluster counts, comma-separated")
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--time-limit", type=float, default=3.0, help="per-decision limit in every budget (s)")
    ap.add_argument("--policies", default=",".join(POLICIES[1:]), help="policies timed besides spinsearch")
    ap.add_argument("--quick", action="store_true", help="8 clusters, 20 jobs")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    args = ap.parse_args(argv)
    _quiet()
    sizes = [8] if args.quick else args.sizes
    if not sizes:
        ap.error("argument --sizes: give at least one cluster count")
    jobs = 20 if args.quick else args.jobs
    policies = ["spinsearch", *[p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "spinsearch"]]
    unknown = [p for p in policies if p not in REGISTRY]
    if unknown:
        ap.error(f"argument --policies: unknown {', '.join(unknown)} (known: {', '.join(sorted(REGISTRY))})")
    results = [run_size(n, jobs, seed=args.seed, load=args.load, time_limit=args.time_limit, policies=policies)
               for n in sizes]
    print(table(results))
    if args.out:
        doc = {"command": "bench/paired_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": f"{platform.machine()}, {platform.python_version()}, "
                          f"{multiprocessing.cpu_count()} cores",
               "results": results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
