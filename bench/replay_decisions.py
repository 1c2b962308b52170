"""Record every placement decision of a few simulator runs, and compare two recordings byte for byte.

A refactoring of the scheduling path must not change what the policies decide. This script runs the
simulator (``--overhead fixed``: the simulated clock does not depend on timing noise, so two runs with
the same inputs make the same decisions) on generated topologies and traces and writes, per run, every
decision in order: the job, the outcome (``place``, ``wait``, ``pending``, ``unresolvable``, ``error``),
the reason, the binding constraint, the wait's delay, and the plan (stages with clusters, layer ranges and
degrees, micro-batches, schedule, step time, dollars per step; floats as ``repr``), plus the per-job
outcomes of the run. It also reports the process CPU time per decision, which ``--compare`` sets beside a
baseline's (the decisions must be identical; the CPU time should stay within ±10 %).

Usage::

    .venv/bin/python bench/replay_decisions.py --out /tmp/base.json          # record
    .venv/bin/python bench/replay_decisions.py --out /tmp/new.json --compare /tmp/base.json
    .venv/bin/python bench/replay_decisions.py --runs spinsearch-8 --out /tmp/s8.json
    .venv/bin/python bench/replay_decisions.py --runs spinsearch-8,spinsearch-16 --out /tmp/new.json \
        --compare bench/results/replay-decisions.json                      # against the kept recording

The kept recording, ``bench/results/replay-decisions.json`` (:data:`RECORDING`), holds ``spinsearch-8`` and
``spinsearch-16``; BENCHMARKS.md says which commit made it and what changed the decisions since the one
before. A deliberate change of the cost model or of a policy changes the decisions: record again and say so
there. A refactoring must leave them identical.

Runs (``--runs``, comma-separated; default all): ``spinsearch-8``, ``spinsearch-16`` (no time limit, waiting
on), ``ilp-8`` (1 s per decision), ``genetic-32`` (0.5 s per decision), both without waiting, and
``ilp-8-wait`` (the ILP with the cycle's waiting).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

# The checkout this script is in, ahead of any installed one: run from another checkout, it measures that code.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow.core.domain import JobSpec, Plan, Topology  # noqa: E402
from spiderflow.core.placement import get_policy  # noqa: E402
from spiderflow.core.placement.base import Budget, PlacementResult  # noqa: E402
from spiderflow.core.sim.engine import OverheadMode, SimConfig, simulate  # noqa: E402
from spiderflow.core.sim.tracegen import generate_trace  # noqa: E402
from spiderflow.core.topogen import generate_topology  # noqa: E402

RUNS: dict[str, tuple[str, int, int, float | None, bool]] = {
    # name: (policy, clusters, jobs, time limit per decision, wait for releases)
    "spinsearch-8": ("spinsearch", 8, 150, None, True),
    "spinsearch-16": ("spinsearch", 16, 150, None, True),
    "ilp-8": ("ilp", 8, 30, 1.0, False),
    "genetic-32": ("genetic", 32, 30, 0.5, False),
    "ilp-8-wait": ("ilp", 8, 30, 1.0, True),
}
"""The baselines' runs without waiting are the ones comparable with recordings made before the scheduling
cycle offered waiting to every policy (they ignored the releases then); ``ilp-8-wait`` shows the new
capability."""
SEED = 3
LOAD = 1.5
RECORDING = Path(__file__).resolve().parent / "results" / "replay-decisions.json"
"""The kept recording of ``spinsearch-8`` and ``spinsearch-16`` (see the module docstring)."""


def _plan(plan: Plan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {
        "stages": [[s.cluster, s.first_layer, s.last_layer, s.tp, s.dp] for s in plan.stages],
        "micro_batches": plan.micro_batches, "schedule": str(plan.schedule),
        "step_time_s": repr(plan.step_time_s), "usd_per_step": repr(plan.usd_per_step),
    }


def _outcome(result: PlacementResult) -> tuple[str, str]:
    """(outcome, delay) of a policy's answer, in the same words before and after the typed wait status."""
    status = str(result.status)
    wait = getattr(result, "wait", None)
    if wait is not None:
        return "wait", repr(float(wait.after_s))
    if result.constraint == "deferred":  # the untyped wait of older versions
        return "wait", repr(float(result.stats.get("defer_s", 0.0)))
    return {"success": "place", "unschedulable": "pending", "unschedulable-and-unresolvable": "unresolvable",
            "wait": "wait"}.get(status, status), ""


def record(name: str) -> dict[str, Any]:
    policy_name, clusters, jobs, limit, wait = RUNS[name]
    topo = generate_topology(clusters, SEED, "geo")
    trace = generate_trace(jobs, SEED, LOAD, topo)
    policy = get_policy(policy_name)
    decisions: list[dict[str, Any]] = []
    inner: Callable[..., PlacementResult] = policy.place

    def place(snap: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        result = inner(snap, job, budget or Budget())
        outcome, delay = _outcome(result)
        decisions.append({"job": job.id, "steps": job.steps, "outcome": outcome, "reason": result.reason,
                          "constraint": "" if outcome == "wait" else result.constraint, "delay_s": delay,
                          "plan": _plan(result.plan)})
        return result

    policy.place = place  # type: ignore[method-assign]  # the recorder's tap on each decision
    cfg = SimConfig(seed=SEED, time_limit_s=limit, overhead=OverheadMode.FIXED, fixed_overhead_s=0.05,
                    releases=wait)
    t0 = time.perf_counter()
    res = simulate(topo, trace, policy, cfg)
    wall = time.perf_counter() - t0
    cpu = list(res.decision_cpu_s)
    return {
        "policy": policy_name, "clusters": clusters, "jobs": jobs, "time_limit_s": limit,
        "decisions": decisions,
        "records": [{k: (repr(v) if isinstance(v, float) else v) for k, v in r.to_dict().items()
                     if k not in ("overhead_s",)} for r in res.records],
        "cpu_s_per_decision": sum(cpu) / len(cpu) if cpu else 0.0, "decisions_n": len(cpu), "wall_s": wall,
    }


def compare(new: dict[str, Any], base: dict[str, Any]) -> int:
    bad = 0
    for name, b in base["runs"].items():
        n = new["runs"].get(name)
        if n is None:
            continue
        same_d = n["decisions"] == b["decisions"]
        same_r = n["records"] == b["records"]
        ratio = n["cpu_s_per_decision"] / b["cpu_s_per_decision"] if b["cpu_s_per_decision"] else float("nan")
        print(f"{name}: decisions {len(n['decisions'])} vs {len(b['decisions'])} "
              f"{'identical' if same_d else 'DIFFER'}; job outcomes {'identical' if same_r else 'DIFFER'}; "
              f"CPU per decision {n['cpu_s_per_decision'] * 1e3:.2f} ms vs {b['cpu_s_per_decision'] * 1e3:.2f} ms "
              f"({ratio:.3f}x)")
        if not same_d:
            for i, (x, y) in enumerate(zip(n["decisions"], b["decisions"], strict=False)):
                if x != y:
                    print(f"  first difference at decision {i}:\n    new  {x}\n    base {y}")
                    break
        bad += (not same_d) + (not same_r)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default=",".join(r for r in RUNS if r != "ilp-8-wait"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path,
                    help="a recording to compare with (the kept one: bench/results/replay-decisions.json)")
    args = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    names = [r for r in args.runs.split(",") if r]
    for r in names:
        if r not in RUNS:
            print(f"--runs: unknown run {r!r}; known: {', '.join(RUNS)}", file=sys.stderr)
            return 2
    doc: dict[str, Any] = {"runs": {}}
    for r in names:
        doc["runs"][r] = record(r)
        d = doc["runs"][r]
        print(f"{r}: {d['decisions_n']} decisions, {d['cpu_s_per_decision'] * 1e3:.2f} ms CPU each, "
              f"{d['wall_s']:.1f} s wall", flush=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    if args.compare is not None:
        return compare(doc, json.loads(args.compare.read_text(encoding="utf-8")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
