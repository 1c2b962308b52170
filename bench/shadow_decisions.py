"""SpinSearch's own trajectory, with a baseline asked every same question on the same state.

::

    .venv/bin/python bench/shadow_decisions.py --kind aws-10-dtfm --load 1.0 --baseline bace \\
        --out bench/results/shadow-aws-10-dtfm-1.0.json

The full-system comparison of ``bench/paper.py`` lets every policy run its own trajectory: after the
first differing decision the pools the later jobs find differ, so a per-job ratio mixes the quality of a
decision with the state it was taken in. This script separates the two. It simulates ``bench/paper.py``'s
traces (same topology, seeds, load, 12 jobs, fixed 0.01 s overhead, waiting for releases on and off) with
SpinSearch deciding, and at every placement call (decisions now and the cycle's priced futures alike) asks
the baseline to place the same job on the same topology state (``--time-limit``: the baseline's limit per
call, as the grid's ``--sim-ilp-limit`` for ``ilp``). Per call: both plans' GPUs, their step times on the
exact timeline and the plans themselves. Summary per wait setting: calls, the geometric mean of baseline ÷
SpinSearch step time (> 1: SpinSearch's plan faster on the same state), and on how many calls each was
faster by more than 3 %.

::

    .venv/bin/python bench/shadow_decisions.py --kind geo --load 1.0 --baseline ilp --time-limit 0.1 \
        --out bench/results/shadow-geo-1.0-ilp.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.paper import _quiet, _topology  # noqa: E402
from spiderflow.core.domain import JobSpec, Plan, Topology  # noqa: E402
from spiderflow.core.placement import get_policy  # noqa: E402
from spiderflow.core.placement.base import Budget, PlacementResult  # noqa: E402
from spiderflow.core.sim.engine import OverheadMode, SimConfig, simulate  # noqa: E402
from spiderflow.core.sim.grid import timeline_step_s  # noqa: E402
from spiderflow.core.sim.tracegen import generate_trace  # noqa: E402


def describe(plan: Plan) -> str:
    """A plan in one line: each stage as ``cluster[first-last] tp×dp``, then schedule and micro-batches."""
    stages = " → ".join(f"{s.cluster}[{s.first_layer}-{s.last_layer}] {s.tp}×{s.dp}" for s in plan.stages)
    return f"{stages} | {plan.schedule.value}, m={plan.micro_batches}"


class Shadowed:
    """SpinSearch deciding; ``baseline`` asked the same question on the same state, its answer recorded."""

    def __init__(self, baseline: str, time_limit_s: float | None = None) -> None:
        self.main, self.other = get_policy("spinsearch"), get_policy(baseline)
        self.name = "spinsearch"
        self.time_limit_s = time_limit_s
        self.calls: list[dict[str, Any]] = []

    def __getattr__(self, key: str) -> Any:
        return getattr(self.main, key)

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget or Budget()
        res = self.main.place(topo, job, budget)
        asked = budget
        if self.time_limit_s is not None:
            asked = replace(asked, time_limit_s=self.time_limit_s)
        other = self.other.place(topo, job, asked)
        mine = res.plan if res.ok else None
        theirs = other.plan if other.ok else None
        self.calls.append({
            "job": job.id, "free_gpus": sum(c.free for c in topo.clusters),
            "spinsearch_gpus": mine.gpus if mine else None,
            "baseline_gpus": theirs.gpus if theirs else None,
            # Both plans on the exact timeline (a policy may report its plan's closed-form step).
            "spinsearch_step_s": timeline_step_s(mine, topo, job) if mine else None,
            "baseline_step_s": timeline_step_s(theirs, topo, job) if theirs else None,
            "spinsearch_plan": describe(mine) if mine else None,
            "baseline_plan": describe(theirs) if theirs else None})
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="aws-10-dtfm")
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--clusters", type=int, default=12, help="clusters of a generated topology kind")
    ap.add_argument("--baseline", default="bace")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="the baseline's wall-clock limit per call (s), as the grid's --sim-ilp-limit")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.time_limit is not None and not args.time_limit > 0:
        ap.error(f"--time-limit must be > 0 seconds (got {args.time_limit:g})")
    _quiet()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    doc: dict[str, Any] = {"command": " ".join(["bench/shadow_decisions.py", *(argv or sys.argv[1:])]),
                           "kind": args.kind, "load": args.load, "seeds": seeds, "baseline": args.baseline,
                           "time_limit_s": args.time_limit,
                           "summary": {}, "calls": []}
    for wait in (True, False):
        both: list[dict[str, Any]] = []
        for seed in seeds:
            topo = _topology(args.kind, args.clusters, seed)
            trace = generate_trace(args.jobs, seed, args.load, topo)
            policy = Shadowed(args.baseline, args.time_limit)
            cfg = SimConfig(seed=seed, overhead=OverheadMode.FIXED, fixed_overhead_s=0.01, releases=wait)
            simulate(topo, trace, policy, cfg)
            for c in policy.calls:
                doc["calls"].append({"wait": wait, "seed": seed, **c})
            both += [c for c in policy.calls if c["spinsearch_step_s"] and c["baseline_step_s"]]
        ratios = [c["baseline_step_s"] / c["spinsearch_step_s"] for c in both]
        s = {"calls": len(both),
             "baseline_over_spinsearch_step_geomean": math.exp(statistics.fmean(map(math.log, ratios))),
             "spinsearch_faster": sum(r > 1.03 for r in ratios), "baseline_faster": sum(r < 1 / 1.03 for r in ratios),
             "same_gpus": sum(c["spinsearch_gpus"] == c["baseline_gpus"] for c in both),
             "only_spinsearch_placed": sum(1 for c in doc["calls"] if c["wait"] == wait
                                           and c["spinsearch_step_s"] and not c["baseline_step_s"]),
             "only_baseline_placed": sum(1 for c in doc["calls"] if c["wait"] == wait
                                         and c["baseline_step_s"] and not c["spinsearch_step_s"])}
        doc["summary"]["wait" if wait else "no-wait"] = s
        print(f"wait {'on ' if wait else 'off'}: {s['calls']} calls, {args.baseline} ÷ spinsearch step "
              f"{s['baseline_over_spinsearch_step_geomean']:.3f} (geomean); spinsearch faster on "
              f"{s['spinsearch_faster']}, {args.baseline} faster on {s['baseline_faster']}; same GPU count on "
              f"{s['same_gpus']}; only spinsearch placed {s['only_spinsearch_placed']}, only {args.baseline} "
              f"{s['only_baseline_placed']}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
