"""Scheduling overhead on the same decisions: every policy decides exactly the instances one policy met.

``bench/paper.py`` times each policy on its own trajectory: a policy's measured decision times delay its
jobs, so each policy sees other queues and free-GPU states, makes another number of decisions (a GA that
fails quickly on memory is asked again and again), and its mean moves from run to run with the trajectory.
This script takes that out. For each cluster count and each *source* policy (``--sources``, default
SpinSearch) it simulates the source on the paper's topology and trace (same seeds and load as
``bench/paper.py``; ``--overhead fixed`` by default, so the instances are reproducible; ``measured`` gives
the trajectory ``bench/paper.py`` times) in a fresh process and records every decision it makes: the
topology snapshot, the job and the budget (time limit, seed, objective, releases), and the wall and CPU
time of the source's own decision. Every other policy then decides those instances, in the recorded order,
in a fresh process (no policy inherits another's caches), and each decision's wall and CPU time is
measured the same way.

Figures per size, source and policy ``p``: mean and median wall time per instance, mean CPU time, how
many instances ``p`` placed, and against SpinSearch on the same instances ``ratio_of_means`` (mean of
``p`` / mean of SpinSearch: the ratio of the total overheads of the same decisions) and ``median_ratio``
(the median over instances of ``p``'s time / SpinSearch's), and ``by_outcome``: the same instances grouped by
the pair of outcomes (``p`` placed / SpinSearch waits, ``p`` finds nothing that fits memory, ...), with each
group's mean times and share of each policy's total (which decisions the overhead comes from).

Usage::

    .venv/bin/python bench/paired_overhead.py --sizes 8,16,32,64 --time-limit 3 --out bench/results/paired-overhead.json
    .venv/bin/python bench/paired_overhead.py --sizes 8,16,32,64 --time-limit 3 --sources ilp,genetic \
        --overhead measured --policies "" --out bench/results/paired-overhead-baseline-instances.json
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

# The checkout this script is in, ahead of any installed one: run from another checkout, it measures that code.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow.cli.common import check_outputs, csv_ints  # noqa: E402
from spiderflow.core.domain import JobSpec, Topology  # noqa: E402
from spiderflow.core.errors import SpiderFlowError  # noqa: E402
from spiderflow.core.placement import REGISTRY, load_builtin_policies  # noqa: E402
from spiderflow.core.placement.base import Budget, PlacementResult, get_policy  # noqa: E402
from spiderflow.core.sim.engine import OverheadMode, SimConfig, simulate  # noqa: E402
from spiderflow.core.sim.tracegen import generate_trace  # noqa: E402
from spiderflow.core.topogen import generate_topology  # noqa: E402

POLICIES = ("spinsearch", "ilp", "genetic")

Instance = tuple[Topology, JobSpec, Budget]
A = TypeVar("A")
R = TypeVar("R")


Timing = tuple[float, float, str]
"""``(wall s, CPU s, outcome)`` of one decision: ``success``, or ``unschedulable:<constraint>`` (e.g.
``wait`` for a decision to wait, ``unschedulable:memory``), or the error's type name."""


def _outcome(result: PlacementResult) -> str:
    status = str(result.status)
    return f"{status}:{result.constraint}" if result.constraint else status


class _Recorder:
    """A policy that records every decision asked of it, with its wall and CPU time, and answers with the
    wrapped policy."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.seen: list[Instance] = []
        self.timed: list[Timing] = []

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        self.seen.append((topo, job, budget or Budget()))
        c0 = time.process_time()
        t0 = time.perf_counter()
        result: PlacementResult = self.inner.place(topo, job, budget)
        self.timed.append((time.perf_counter() - t0, time.process_time() - c0, _outcome(result)))
        return result


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    load_builtin_policies()


def _in_fresh_process(fn: Callable[[A], R], arg: A) -> R:
    """``fn(arg)`` in a freshly spawned process (no caches inherited from this one)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        res: R = pool.apply(fn, (arg,))
        return res


def _record_child(args: tuple[str, int, int, int, float, float, str]) -> tuple[list[Instance], list[Timing]]:
    _quiet()
    source, clusters, jobs, seed, load, time_limit, overhead = args
    topo = generate_topology(clusters, seed, "geo")
    trace = generate_trace(jobs, seed, load, topo)
    rec = _Recorder(get_policy(source))
    simulate(topo, trace, rec, SimConfig(seed=seed, time_limit_s=time_limit, overhead=OverheadMode(overhead)))
    return rec.seen, rec.timed


def record(clusters: int, jobs: int, *, seed: int, load: float, time_limit: float, source: str = "spinsearch",
           overhead: OverheadMode = OverheadMode.FIXED) -> tuple[list[Instance], list[Timing]]:
    """``source``'s decisions in the simulation of the paper's topology and trace for ``clusters``, and the
    time each took, simulated in a fresh process."""
    return _in_fresh_process(_record_child, (source, clusters, jobs, seed, load, time_limit, overhead.value))


def _time_child(args: tuple[str, list[Instance]]) -> list[Timing]:
    """The :data:`Timing` of ``policy`` deciding each instance, in order."""
    _quiet()
    name, instances = args
    policy = get_policy(name)
    out: list[Timing] = []
    for topo, job, budget in instances:
        c0 = time.process_time()
        t0 = time.perf_counter()
        try:
            outcome = _outcome(policy.place(topo, job, budget))
        except SpiderFlowError as e:
            outcome = type(e).__name__
        out.append((time.perf_counter() - t0, time.process_time() - c0, outcome))
    return out


def time_policy(name: str, instances: list[Instance]) -> list[Timing]:
    """:func:`_time_child` in a fresh process."""
    return _in_fresh_process(_time_child, (name, instances))


def run_size(clusters: int, jobs: int, *, seed: int, load: float, time_limit: float, policies: list[str],
             source: str = "spinsearch", overhead: OverheadMode = OverheadMode.FIXED) -> dict[str, Any]:
    """The figures of the module docstring for ``policies`` (SpinSearch among them) on ``source``'s
    instances at ``clusters``; ``source``'s own times are those of its recorded decisions."""
    instances, own = record(clusters, jobs, seed=seed, load=load, time_limit=time_limit, source=source,
                            overhead=overhead)
    timed = {p: own if p == source else time_policy(p, instances) for p in dict.fromkeys([source, *policies])}
    base = [w for w, _, _ in timed["spinsearch"]]
    out: dict[str, Any] = {"clusters": clusters, "jobs": jobs, "source": source, "overhead": overhead.value,
                           "instances": len(instances), "policies": {}}
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
            fig["by_outcome"] = by_outcome(rows, timed["spinsearch"])
        out["policies"][p] = fig
        print(f"  {clusters:>4} clusters, {source}'s instances, {p:>10}: {len(rows)} instances, "
              f"mean {fig['mean_s'] * 1e3:.1f} ms, median {fig['median_s'] * 1e3:.1f} ms, placed {fig['placed']}"
              + (f", {fig['ratio_of_means']:.1f}x mean, {fig['median_ratio']:.1f}x median"
                 if "ratio_of_means" in fig else ""), flush=True)
        for g in fig.get("by_outcome", []):
            print(f"        {p} {g['policy_outcome']} / spinsearch {g['spinsearch_outcome']}: {g['instances']} "
                  f"instances, {g['mean_s'] * 1e3:.1f} vs {g['spinsearch_mean_s'] * 1e3:.1f} ms "
                  f"({g['share']:.0%} of {p}'s time, {g['spinsearch_share']:.0%} of spinsearch's)", flush=True)
    return out


def by_outcome(rows: list[Timing], base: list[Timing]) -> list[dict[str, Any]]:
    """Where the time of one policy (``rows``) and of SpinSearch (``base``) goes on the same instances,
    grouped by the pair of outcomes (``policy_outcome``, ``spinsearch_outcome``): how many instances, the
    mean wall time of each, and each group's share of each policy's total; largest share of ``rows`` first."""
    total = sum(w for w, _, _ in rows) or 1.0
    total_base = sum(w for w, _, _ in base) or 1.0
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for (w, _, o), (wb, _, ob) in zip(rows, base, strict=True):
        groups.setdefault((o, ob), []).append((w, wb))
    out = [{"policy_outcome": o, "spinsearch_outcome": ob, "instances": len(ws),
            "mean_s": statistics.fmean(w for w, _ in ws), "spinsearch_mean_s": statistics.fmean(wb for _, wb in ws),
            "share": sum(w for w, _ in ws) / total, "spinsearch_share": sum(wb for _, wb in ws) / total_base}
           for (o, ob), ws in groups.items()]
    return sorted(out, key=lambda g: (-g["share"], g["policy_outcome"], g["spinsearch_outcome"]))


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| clusters | instances of | instances | spinsearch mean / median ms | policy | mean / median ms | "
             "placed | ratio of means | median ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ss = r["policies"]["spinsearch"]
        for p, f in r["policies"].items():
            if p == "spinsearch":
                continue
            lines.append(f"| {r['clusters']} | {r.get('source', 'spinsearch')} | {r['instances']} | "
                         f"{ss['mean_s'] * 1e3:.1f} / "
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
    ap.add_argument("--policies", default=",".join(POLICIES[1:]),
                    help="policies timed besides spinsearch and the source (comma-separated; may be empty)")
    ap.add_argument("--sources", default="spinsearch",
                    help="policies whose simulated decisions are the instances (comma-separated)")
    ap.add_argument("--overhead", choices=[m.value for m in OverheadMode], default=OverheadMode.FIXED.value,
                    help="overhead mode of the recording simulations: fixed (reproducible, default) or measured "
                         "(the trajectories bench/paper.py times)")
    ap.add_argument("--quick", action="store_true", help="8 clusters, 20 jobs")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    args = ap.parse_args(argv)
    check_outputs(ap, {"--out": args.out})
    _quiet()
    sizes = [8] if args.quick else args.sizes
    if not sizes:
        ap.error("argument --sizes: give at least one cluster count")
    jobs = 20 if args.quick else args.jobs
    policies = ["spinsearch", *[p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "spinsearch"]]
    sources = list(dict.fromkeys(p.strip() for p in args.sources.split(",") if p.strip()))
    for flag, names in (("--policies", policies), ("--sources", sources)):
        unknown = [p for p in names if p not in REGISTRY]
        if unknown:
            ap.error(f"argument {flag}: unknown {', '.join(unknown)} (known: {', '.join(sorted(REGISTRY))})")
    if not sources:
        ap.error("argument --sources: give at least one policy")
    results = [run_size(n, jobs, seed=args.seed, load=args.load, time_limit=args.time_limit, policies=policies,
                        source=src, overhead=OverheadMode(args.overhead))
               for n in sizes for src in sources]
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
