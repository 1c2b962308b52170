"""The paper's comparison, rebuilt: SpinSearch against every baseline, placement only and full system.

One run measures three parts on the same topologies (the pure computation is :mod:`spiderflow.core.sim.grid`):

1. **Placement only** (paired instances). For every topology and seed, ``--instances`` jobs (the trace
   generator's models in turn, each with its GPU range and batch; set ``mix``) and ``--large-instances`` of
   its largest models, llama3-70b first (set ``large``: jobs the pool holds only across clusters, where the
   chain and the split between regions matter) on a partly busy pool; every policy
   decides exactly these instances, one after the other in this process (nothing else of this script runs
   meanwhile), each policy from a cold start (:func:`~spiderflow.core.sim.grid.cold_start`: one untimed
   decision warms the process, then every memo is cleared, so the first policy does not pay the process's
   start-up for the others and none is warmed by another's memos), with its own budget (``ilp``:
   ``--ilp-limit`` s, hinted by the other baselines; ``genetic``: the published population 100 and 4,900
   trials, capped at ``--ilp-limit`` s; ``ilp`` hinted with
   SpinSearch's own plan is the *upper reference*, reported beside the baselines, never counted as one).
   Figures: plan throughput (tokens/s of the plan) in the closed form every policy optimises *and* in the
   exact timeline of one step; SpinSearch ÷ policy as geometric means with 95% intervals over the instances
   both placed; wall and process-CPU time per decision and in total (ratio of means = ratio of the totals of
   the same decisions); how many plans use more than one cluster; per kind, over all, and per instance set.
2. **Quality against time** on ``--curve-instances`` large jobs (gpt3-6.7b, llama3-70b, ...) on each topology
   of ``--curve-kinds`` at seed 1:
   ``ilp`` at each time limit of ``--curve-ilp`` (s) and ``genetic`` at each trial budget of
   ``--curve-genetic`` (population 100, capped at the largest ILP limit), each budget from a cold start as
   in part 1. Each point: plan throughput ÷
   SpinSearch's on the same instance (geometric mean), mean wall and CPU time. "Time to SpinSearch's
   quality" is, per instance, the wall time of the smallest budget whose plan is at least as good as
   SpinSearch's (within 0.1%); an instance no budget reaches counts with the largest budget's time as a
   lower bound.
3. **Full system**: for every topology × load × seed one trace of ``--jobs`` jobs (Poisson arrivals at the
   offered load against the topology's capacity, :func:`spiderflow.core.sim.tracegen.generate_trace`), simulated
   by every policy through the shared scheduling cycle with waiting for releases **on and off for every
   policy** (the cycle prices a later start with each policy's own placement), a fixed 0.01 s overhead per
   decision (so runs are reproducible — except ``ilp``, whose CP-SAT stops on wall-clock time). Budgets in
   the simulations are smaller than in part 1 (``--sim-ilp-limit``, ``--sim-genetic-trials``/
   ``--sim-genetic-population``; part 2 shows what larger budgets add), and these two searching baselines,
   whose decisions take seconds (each wait priced costs up to four more placements), are simulated only on
   ``--sim-search-kinds`` × ``--sim-search-loads`` (every seed); the other policies everywhere. Figures per
   cell (topology, load, wait): for each baseline, per seed on the jobs both completed, mean / median / p95
   JCT ratios (baseline ÷ SpinSearch) and per-job plan-throughput ratios (SpinSearch ÷ baseline; closed form
   and timeline), then the geometric mean over the seeds with a 95% interval; the cell's best baseline is
   the hardest one. Simulations run in ``--workers`` processes (results do not depend on it).
   ``--gpu-price λ`` runs SpinSearch with its priced choice (a shadow price of the GPUs under pressure on the pool)
   in the simulations; 0 (default): its fastest plan. ``--lookahead`` runs SpinSearch with its region matching
   against the arrivals expected while a job runs (:mod:`spiderflow.core.placement.lookahead`).

Topologies (``--kinds``): generated ``geo``, ``hub`` and ``mesh`` (``--clusters`` clusters, the seed is the
topology's seed too) and the bundled presets ``aws-10-dtfm`` and ``ibm-10-latency`` (fixed topology; partly
busy in part 1 by the seed).

Usage::

    .venv/bin/python bench/paper.py --quick --out bench/results/paper-quick.json             # ≤ 5 min
    nice -n 10 .venv/bin/python bench/paper.py --out bench/results/paper-grid.json           # the grid
    .venv/bin/python bench/paper.py --scale-only --out bench/paper-scale.json                # 256 × 2,000

Writes ``--out`` (JSON) and a Markdown report next to it (``.md``), labelled with the command, the commit,
the machine's load average and the run's wall and CPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import structlog

# The checkout this script is in, ahead of any installed one: run from another checkout, it measures that code.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow.cli.common import check_outputs, csv_ints  # noqa: E402
from spiderflow.core.domain import Budget, JobSpec, Topology  # noqa: E402
from spiderflow.core.placement import REGISTRY, load_builtin_policies  # noqa: E402
from spiderflow.core.placement.options import SearchOptions  # noqa: E402
from spiderflow.core.sim.engine import SimConfig, simulate  # noqa: E402
from spiderflow.core.sim.grid import (  # noqa: E402
    REFERENCE,
    PolicySetup,
    budget_curve,
    cold_start,
    decide,
    geomean_ci,
    instance_job,
    mean_ci,
    occupy,
    ratio_summary,
    run_system,
)
from spiderflow.core.sim.metrics import summarize  # noqa: E402
from spiderflow.core.sim.tracegen import MODEL_MIX, generate_trace  # noqa: E402
from spiderflow.core.topogen import TopologyKind, generate_topology  # noqa: E402
from spiderflow.presets import PRESETS, resolve_topology  # noqa: E402

GENERATED = ("geo", "hub", "mesh")
KINDS = (*GENERATED, *PRESETS)
SIM_POLICIES = ("spinsearch", "greedy", "bace", "firstfit", "genetic", "ilp")
PLACE_POLICIES = ("spinsearch", "greedy", "bace", "firstfit", "genetic", "ilp", "ilp-decomposed")
UPPER = "ilp+spinsearch-hint"
"""The upper reference: ``ilp`` hinted with SpinSearch's own plan (reported beside, not a baseline)."""
QUALITY_TOL = 0.999


def _csv_floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not out or any(not math.isfinite(x) or x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers")
    return out


def _csv_kinds(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in KINDS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or 'empty list'}; kinds: {', '.join(KINDS)}")
    return out


def _topology(kind: str, clusters: int, seed: int) -> Topology:
    if kind in GENERATED:
        return generate_topology(clusters, seed, cast(TopologyKind, kind))
    return resolve_topology(kind)


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    load_builtin_policies()


def _commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
        return r.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# part 1: placement only


def placement_setups(limit: float, policies: Sequence[str] = PLACE_POLICIES, *, upper: bool = True,
                     ) -> list[PolicySetup]:
    out = [PolicySetup(label=p, name=p, time_limit_s=limit if p.startswith("ilp") or p == "genetic" else None)
           for p in policies if p in REGISTRY]
    if upper and "ilp" in REGISTRY and "ilp" in policies:
        out.append(PolicySetup(label=UPPER, name="ilp", options=SearchOptions(hint="spinsearch"), time_limit_s=limit))
    return out


def placement_instances(seed: int, per_seed: int, large: int) -> list[tuple[str, JobSpec]]:
    """The placement instances of one topology and seed, as (set, job): ``per_seed`` of the trace mix's models
    in turn (set ``mix``), then ``large`` of its largest models, llama3-70b first (set ``large``; ids
    ``large-…``), which a partly busy pool of regions can hold only across several clusters."""
    out = [("mix", instance_job((seed - 1) * per_seed + i)) for i in range(per_seed)]
    for j in range(large):
        job = instance_job(len(MODEL_MIX) - 1 - j % len(MODEL_MIX))
        out.append(("large", dataclasses.replace(job, id="large-" + job.id.removeprefix("inst-"))))
    return out


def placement_part(kinds: Sequence[str], seeds: Sequence[int], per_seed: int, clusters: int, limit: float,
                   policies: Sequence[str] = PLACE_POLICIES, *, large: int = 0) -> dict[str, Any]:
    setups = placement_setups(limit, policies)
    cases: list[tuple[str, int, Topology]] = []
    for kind in kinds:
        for seed in seeds:
            topo = _topology(kind, clusters, seed)
            if kind not in GENERATED:
                topo = occupy(topo, seed)
            topo.bandwidth_matrix  # noqa: B018 - paths once, outside the timed decisions
            cases.append((kind, seed, topo))
    rows: list[dict[str, Any]] = []
    for s in setups:
        if cases:  # every policy starts cold: the process warmed up, no memo of an earlier policy's left
            cold_start(s, cases[0][2], placement_instances(cases[0][1], per_seed, large)[0][1],
                       [topo for _, _, topo in cases])
        policy = s.build()
        t0 = time.perf_counter()
        n = 0
        for kind, seed, topo in cases:
            for i, (iset, job) in enumerate(placement_instances(seed, per_seed, large)):
                d = decide(policy, topo, job, Budget(time_limit_s=s.time_limit_s, seed=seed * 1000 + i))
                rows.append({"label": s.label, "kind": kind, "seed": seed, "job": job.id, "set": iset,
                             "clusters": len(d.get("chain") or ()), **d})
                n += 1
        _log(f"placement {s.label:>22}: {time.perf_counter() - t0:.1f} s for {n} instances")
    return {"setups": [{"label": s.label, "budget": s.describe()} for s in setups], "rows": rows,
            "summary": placement_summary(rows)}


def placement_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per topology kind (and ``all``, and ``all (set)`` per instance set when there are several) and policy:
    instances placed, plans on more than one cluster, SpinSearch ÷ policy plan throughput
    (geometric mean, 95% CI, over the instances both placed; closed form and timeline), mean wall/CPU per
    decision, totals, and the overhead ratios policy ÷ SpinSearch (ratio of the means of the same
    decisions)."""
    out: list[dict[str, Any]] = []
    kinds = sorted({r["kind"] for r in rows}, key=lambda k: KINDS.index(k) if k in KINDS else 99)
    sets = list(dict.fromkeys(r.get("set", "mix") for r in rows))
    groups = [*kinds, "all", *([f"all ({s})" for s in sets] if len(sets) > 1 else [])]
    for kind in groups:
        sel = [r for r in rows if kind in ("all", r["kind"], f"all ({r.get('set', 'mix')})")]
        ref = {(r["kind"], r["seed"], r["job"]): r for r in sel if r["label"] == REFERENCE}
        labels = list(dict.fromkeys(r["label"] for r in sel))
        for label in labels:
            mine = [r for r in sel if r["label"] == label]
            row: dict[str, Any] = {"kind": kind, "label": label, "instances": len(mine),
                                   "placed": sum(1 for r in mine if r.get("tps")),
                                   "multi_cluster": sum(1 for r in mine if len(r.get("chain") or ()) > 1)}
            for key in ("tps", "tps_timeline"):
                ratios = [ref[k][key] / r[key] for r in mine
                          if (k := (r["kind"], r["seed"], r["job"])) in ref and ref[k].get(key) and r.get(key)]
                ci = geomean_ci(ratios)
                row[f"{key}_ratio"] = None if ci is None else ci.to_dict()
            row["ref_only"] = sum(1 for r in mine if not r.get("tps")
                                  and ref.get((r["kind"], r["seed"], r["job"]), {}).get("tps"))
            row["policy_only"] = sum(1 for r in mine if r.get("tps")
                                     and not ref.get((r["kind"], r["seed"], r["job"]), {}).get("tps"))
            for t in ("wall_s", "cpu_s"):
                xs = [r[t] for r in mine]
                row[f"mean_{t}"] = statistics.fmean(xs)
                row[f"total_{t}"] = sum(xs)
                refs = [ref[(r["kind"], r["seed"], r["job"])][t] for r in mine
                        if (r["kind"], r["seed"], r["job"]) in ref]
                row[f"{t}_ratio"] = sum(xs) / sum(refs) if refs and sum(refs) > 0 else None
            gaps = [r["stats"]["gap"] for r in mine if "gap" in r.get("stats", {})]
            if gaps:
                row["mean_gap"] = statistics.fmean(gaps)
                row["proven"] = sum(1 for g in gaps if g <= 1e-9)
            hints = [r["stats"]["hint_in_model"] for r in mine if "hint_in_model" in r.get("stats", {})]
            if hints:  # ilp: how the best hint entered the model (4 whole, 2/1 structure, 3 own greedy, 0 none)
                row["hint_in_model"] = {str(int(h)): hints.count(h) for h in sorted(set(hints), reverse=True)}
            out.append(row)
    return out


# ---------------------------------------------------------------------------------------------------------
# part 2: quality against time


def curve_part(kinds: Sequence[str], clusters: int, ilp_limits: Sequence[float], trials: Sequence[int],
               n_instances: int) -> dict[str, Any]:
    instances: list[tuple[Topology, JobSpec]] = []
    labels: list[str] = []
    for kind in kinds:
        for i in range(n_instances):
            topo = _topology(kind, clusters, 1)
            if kind not in GENERATED:
                topo = occupy(topo, 1)
            topo.bandwidth_matrix  # noqa: B018
            job = instance_job(i * 3 + 2)  # the larger models first: gpt3-6.7b, llama3-70b, ...
            instances.append((topo, job))
            labels.append(f"{kind}/{job.model.name or job.id}")
    cap = max(ilp_limits)
    setups = [PolicySetup(label="spinsearch", name="spinsearch")]
    if "ilp" in REGISTRY:
        setups += [PolicySetup(label=f"ilp@{t:g}s", name="ilp", time_limit_s=t) for t in ilp_limits]
    if "genetic" in REGISTRY:
        setups += [PolicySetup(label=f"genetic@{n}", name="genetic", options=SearchOptions(trials=n), time_limit_s=cap)
                   for n in trials]
    t0 = time.perf_counter()
    rows = budget_curve(setups, instances, seed=1)
    _log(f"curves: {time.perf_counter() - t0:.1f} s for {len(setups)} budgets × {len(instances)} instances")
    return {"instances": labels, "rows": rows, "summary": curve_summary(rows, ilp_limits, trials)}


def curve_summary(rows: list[dict[str, Any]], ilp_limits: Sequence[float], trials: Sequence[int]) -> dict[str, Any]:
    ref = {r["instance"]: r for r in rows if r["label"] == REFERENCE}
    points: list[dict[str, Any]] = []
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        pt: dict[str, Any] = {"label": label, "instances": len(mine), "placed": sum(1 for r in mine if r.get("tps")),
                              "mean_wall_s": statistics.fmean(r["wall_s"] for r in mine),
                              "mean_cpu_s": statistics.fmean(r["cpu_s"] for r in mine)}
        for key in ("tps", "tps_timeline"):
            q = [r[key] / ref[r["instance"]][key] for r in mine if r.get(key) and ref.get(r["instance"], {}).get(key)]
            ci = geomean_ci(q)
            pt[f"quality_{key}"] = None if ci is None else ci.to_dict()
            pt[f"reaches_{key}"] = sum(1 for x in q if x >= QUALITY_TOL)
        points.append(pt)
    return {"points": points, "time_to_reference_quality": _time_to_quality(rows, ref, ilp_limits, trials, "tps"),
            "time_to_reference_quality_timeline": _time_to_quality(rows, ref, ilp_limits, trials, "tps_timeline")}


def _time_to_quality(rows: list[dict[str, Any]], ref: dict[Any, dict[str, Any]], ilp_limits: Sequence[float],
                     trials: Sequence[int], key: str) -> dict[str, Any]:
    """Per family (``ilp``, ``genetic``): per instance, the smallest budget whose plan's ``key`` (closed-form or
    timeline throughput) reaches SpinSearch's within :data:`QUALITY_TOL`, and its time ÷ SpinSearch's."""
    reach: dict[str, Any] = {}
    for family, budgets in (("ilp", [f"ilp@{t:g}s" for t in ilp_limits]),
                            ("genetic", [f"genetic@{n}" for n in trials])):
        per: list[dict[str, Any]] = []
        for i, r0 in ref.items():
            if not r0.get(key):
                continue
            hit = None
            last = None
            for b in budgets:
                r = next((x for x in rows if x["label"] == b and x["instance"] == i), None)
                if r is None:
                    continue
                last = r
                if r.get(key) and r[key] >= QUALITY_TOL * r0[key]:
                    hit = r
                    break
            if last is None:
                continue
            used = hit or last
            per.append({"instance": i, "reached": hit is not None, "budget": used["label"], "wall_s": used["wall_s"],
                        "cpu_s": used["cpu_s"], "ratio_wall": used["wall_s"] / r0["wall_s"],
                        "ratio_cpu": used["cpu_s"] / max(r0["cpu_s"], 1e-9)})
        if per:
            ci_w = geomean_ci([p["ratio_wall"] for p in per])
            ci_c = geomean_ci([p["ratio_cpu"] for p in per])
            reach[family] = {"per_instance": per, "reached": sum(1 for p in per if p["reached"]),
                             "ratio_wall": None if ci_w is None else ci_w.to_dict(),
                             "ratio_cpu": None if ci_c is None else ci_c.to_dict()}
    return reach


# ---------------------------------------------------------------------------------------------------------
# part 3: full system


def _system_task(args: tuple[str, Topology, list[JobSpec], PolicySetup, int, float]) -> list[dict[str, Any]]:
    _quiet()
    kind, topo, trace, setup, seed, load = args
    out = []
    for wait in (True, False):
        r = run_system(topo, trace, setup, seed=seed, wait=wait)
        out.append({"kind": kind, "load": load, "seed": seed, **r})
    return out


def _searching(name: str) -> bool:
    return name.startswith("ilp") or name == "genetic"


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent reports what finished and ends the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def system_setups(policies: Sequence[str], ilp_limit: float, trials: int, population: int,
                  gpu_price: float = 0.0, lookahead: bool = False) -> list[PolicySetup]:
    out = []
    for p in policies:
        if p not in REGISTRY:
            continue
        if p == REFERENCE and (gpu_price or lookahead):
            out.append(PolicySetup(label=p, name=p, options=SearchOptions(gpu_price=gpu_price or None,
                                                                          lookahead=lookahead or None)))
        elif p.startswith("ilp"):
            out.append(PolicySetup(label=p, name=p, time_limit_s=ilp_limit))
        elif p == "genetic":
            out.append(PolicySetup(label=p, name=p, options=SearchOptions(trials=trials, population=population)))
        else:
            out.append(PolicySetup(label=p, name=p))
    return out


def system_part(kinds: Sequence[str], loads: Sequence[float], seeds: Sequence[int], clusters: int, jobs: int,
                setups: Sequence[PolicySetup], workers: int, *, search_kinds: Sequence[str] | None = None,
                search_loads: Sequence[float] | None = None) -> dict[str, Any]:
    """Every setup on every topology × load × seed, except the searching baselines (``ilp``, ``genetic``:
    seconds per decision), which run only on ``search_kinds`` × ``search_loads`` (``None``: everywhere)."""
    tasks = []
    for seed in seeds:  # seed by seed: a run interrupted early still covers every topology and load
        for kind in kinds:
            topo = _topology(kind, clusters, seed)
            for load in loads:
                trace = generate_trace(jobs, seed, load, topo)
                for s in setups:
                    if _searching(s.name) and ((search_kinds is not None and kind not in search_kinds)
                                               or (search_loads is not None and load not in search_loads)):
                        continue
                    tasks.append((kind, topo, trace, s, seed, load))
    runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    done = 0
    interrupted = False
    try:
        if workers > 1:
            with multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_init) as pool:
                for res in pool.imap(_system_task, tasks, chunksize=1):
                    runs.extend(res)
                    done += 1
                    if done % 10 == 0 or done == len(tasks):
                        _log(f"system: {done}/{len(tasks)} simulation pairs after {time.perf_counter() - t0:.0f} s")
        else:
            for task in tasks:
                runs.extend(_system_task(task))
                done += 1
                if done % 10 == 0 or done == len(tasks):
                    _log(f"system: {done}/{len(tasks)} simulation pairs after {time.perf_counter() - t0:.0f} s")
    except KeyboardInterrupt:  # SIGINT/SIGTERM: report what finished (the report says it is partial)
        interrupted = True
        _log(f"system: interrupted after {done}/{len(tasks)} simulation pairs; reporting those")
    out = {"setups": [{"label": s.label, "budget": s.describe()} for s in setups], "runs": runs,
           "tasks": len(tasks), "tasks_done": done, "interrupted": interrupted}
    return summarize_system(out)


def summarize_system(part: dict[str, Any]) -> dict[str, Any]:
    """``part`` with its summaries computed from its ``runs``: per cell (topology, load, wait), over the whole
    grid per wait setting (every topology × load × seed paired), and per policy."""
    runs = part["runs"]
    part["cells"] = ratio_summary(runs, group=lambda r: (r["kind"], r["load"], r["wait"]))
    part["grid"] = ratio_summary(runs, group=lambda r: (r["wait"],), pair=lambda r: (r["kind"], r["load"], r["seed"]))
    part["policies"] = system_policy_table(runs)
    return part


def system_policy_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per topology kind, load, wait and policy: completed jobs and mean JCT (mean over seeds with 95% CI of
    each run's mean over its own completed jobs), decisions and their measured time per decision."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["kind"], r["load"], r["wait"], r["label"]), []).append(r)
    out = []
    for (kind, load, wait, label), rs in groups.items():
        means = []
        for r in rs:
            j = [v["jct_s"] for v in r["jobs"].values() if v["status"] == "completed"]
            if j:
                means.append(statistics.fmean(j))
        ci = mean_ci(means)
        dec = sum(r["decisions"] for r in rs)
        out.append({"kind": kind, "load": load, "wait": wait, "label": label, "runs": len(rs),
                    "completed": sum(r["completed"] for r in rs), "jobs": sum(len(r["jobs"]) for r in rs),
                    "mean_jct_s": None if ci is None else ci.to_dict(), "decisions": dec,
                    "wall_per_decision_s": sum(r["decision_wall_s"] for r in rs) / dec if dec else None,
                    "cpu_per_decision_s": sum(r["decision_cpu_s"] for r in rs) / dec if dec else None,
                    "sim_cpu_s": sum(r["run_cpu_s"] for r in rs)})
    return out


# ---------------------------------------------------------------------------------------------------------
# targets and report


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sysp = doc.get("system")
    if sysp:
        for wait in (True, False):
            g = next((c for c in sysp["grid"] if c["group"] == [wait]), None)
            cells = [c for c in sysp["cells"] if c["group"][2] == wait]
            if g is None:
                continue
            key = "wait" if wait else "no_wait"
            worst = min(((c["best_tps_ratio"]["estimate"], c["group"], c["best_tps_ratio"]["baseline"])
                         for c in cells if c.get("best_tps_ratio")), default=(None, None, None))
            out[key] = {
                "plan_throughput_vs_best_baseline_grid": g.get("best_tps_ratio"),
                "plan_throughput_timeline_vs_best_baseline_grid": g.get("best_tps_timeline_ratio"),
                "plan_throughput_worst_cell": {"estimate": worst[0], "cell": worst[1], "baseline": worst[2]},
                "mean_jct_vs_best_baseline_grid": g.get("best_mean_jct_ratio"),
                "cells_mean_jct_below_1": sum(1 for c in cells if c.get("best_mean_jct_ratio")
                                              and c["best_mean_jct_ratio"]["estimate"] < 1.0),
                "cells": len(cells),
            }
    cur = doc.get("curves")
    if cur:
        for name, part in (("time_to_spinsearch_quality", "time_to_reference_quality"),
                           ("time_to_spinsearch_quality_timeline", "time_to_reference_quality_timeline")):
            out[name] = {k: {"reached": v["reached"], "of": len(v["per_instance"]), "ratio_wall": v["ratio_wall"],
                             "ratio_cpu": v["ratio_cpu"]}
                         for k, v in cur["summary"].get(part, {}).items()}
    return out


def _ci(v: dict[str, Any] | None, digits: int = 3) -> str:
    if not v:
        return "–"
    if v["n"] < 2:
        return f"{v['estimate']:.{digits}g}"
    return f"{v['estimate']:.{digits}g} [{v['low']:.{digits}g}, {v['high']:.{digits}g}]"


def _f(x: Any, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}g}"


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"Command: `{doc['command']}`  ", f"Commit: `{doc['commit']}`  ", f"Machine: {doc['machine']}  ",
             f"Load average at start / end: {doc['loadavg_start']} / {doc.get('loadavg_end', '–')}  ",
             f"Run time: {doc.get('wall_s', 0):.0f} s wall, {doc.get('cpu_s', 0):.0f} s CPU (this process and its "
             "workers)  "]
    if doc.get("report"):
        lines.append(f"Report: {doc['report']}  ")
    lines.append("")
    pl = doc.get("placement")
    if pl:
        lines += ["## Placement only (paired instances)", "",
                  "Budgets: " + "; ".join(f"{s['label']}: {s['budget']}" for s in pl["setups"]), "",
                  "Plan throughput SpinSearch ÷ policy (geometric mean [95% CI] over the instances both placed; "
                  "closed form and exact timeline); overhead policy ÷ SpinSearch = ratio of the total times of the "
                  "same decisions.", "",
                  "| topology | policy | placed | on > 1 cluster | only SS placed | only policy placed | "
                  "tput ratio (closed form) | tput ratio (timeline) | ms/decision wall | ms/decision CPU | total s | "
                  "overhead ÷ SS wall | CPU | ILP gap / proven |",
                  "|" + "---|" * 14]
        for r in pl["summary"]:
            gap = f"{r['mean_gap']:.2g} / {r['proven']}" if "mean_gap" in r else ""
            if "hint_in_model" in r:
                gap += " (hint in model " + ", ".join(f"{k}: {v}" for k, v in r["hint_in_model"].items()) + ")"
            lines.append(f"| {r['kind']} | {r['label']} | {r['placed']}/{r['instances']} | "
                         f"{r.get('multi_cluster', '–')} | {r['ref_only']} | "
                         f"{r['policy_only']} | {_ci(r['tps_ratio'])} | {_ci(r['tps_timeline_ratio'])} | "
                         f"{1000 * r['mean_wall_s']:.4g} | {1000 * r['mean_cpu_s']:.4g} | {r['total_wall_s']:.4g} | "
                         f"{_f(r['wall_s_ratio'])} | {_f(r['cpu_s_ratio'])} | {gap} |")
    cur = doc.get("curves")
    if cur:
        lines += ["", "## Quality against time (ilp time limits, genetic trial budgets)", "",
                  f"Instances: {', '.join(cur['instances'])}. Quality = plan throughput ÷ SpinSearch's on the same "
                  "instance (geometric mean [95% CI]).", "",
                  "| budget | placed | quality (closed form) | quality (timeline) | ≥ SpinSearch (closed form) | "
                  "≥ SpinSearch (timeline) | mean wall s | mean CPU s |", "|---|---|---|---|---|---|---|---|"]
        for p in cur["summary"]["points"]:
            lines.append(f"| {p['label']} | {p['placed']}/{p['instances']} | {_ci(p['quality_tps'])} | "
                         f"{_ci(p['quality_tps_timeline'])} | {p['reaches_tps']} | "
                         f"{p.get('reaches_tps_timeline', '–')} | {p['mean_wall_s']:.4g} | {p['mean_cpu_s']:.4g} |")
        for part, how in (("time_to_reference_quality", "closed form"),
                          ("time_to_reference_quality_timeline", "exact timeline")):
            for fam, v in cur["summary"].get(part, {}).items():
                lines.append(f"\n{fam} ({how}): reached SpinSearch's plan quality on {v['reached']} of "
                             f"{len(v['per_instance'])} instances; time needed ÷ SpinSearch's time (wall) "
                             f"{_ci(v['ratio_wall'])}, (CPU) {_ci(v['ratio_cpu'])} (an instance not reached counts "
                             "with its largest budget's time: a lower bound)")
    sysp = doc.get("system")
    if sysp:
        lines += ["", "## Full system (simulated traces, same queue powers for every policy)", ""]
        if sysp.get("interrupted"):
            lines += [f"**Partial: interrupted after {sysp['tasks_done']} of {sysp['tasks']} simulation pairs** "
                      "(they run seed by seed).", ""]
        lines += [
                  "Budgets: " + "; ".join(f"{s['label']}: {s['budget']}" for s in sysp["setups"]), "",
                  "Per cell: ratios against each cell's best (hardest) baseline, geometric mean over seeds [95% CI]; "
                  "JCT ratios = baseline ÷ SpinSearch on the jobs both completed; plan throughput = SpinSearch ÷ "
                  "baseline.", "",
                  "| topology | load | wait | mean JCT ratio (baseline) | median JCT ratio | p95 JCT ratio | "
                  "plan tput ratio (baseline) | plan tput ratio, timeline |", "|---|---|---|---|---|---|---|---|"]
        for c in sysp["cells"]:
            kind, load, wait = c["group"]
            b = c.get("best_mean_jct_ratio", {}).get("baseline")
            bt = c.get("best_tps_ratio", {}).get("baseline")
            per = c["baselines"].get(b, {}) if b else {}
            lines.append(f"| {kind} | {load:g} | {'on' if wait else 'off'} | {_ci(c.get('best_mean_jct_ratio'))} "
                         f"({b}) | {_ci(per.get('median_jct_ratio'))} | {_ci(per.get('p95_jct_ratio'))} | "
                         f"{_ci(c.get('best_tps_ratio'))} ({bt}) | {_ci(c.get('best_tps_timeline_ratio'))} |")
        lines += ["", "Whole grid, per baseline (geometric mean over every topology × load × seed):", "",
                  "| wait | baseline | runs | mean JCT ratio | median JCT ratio | p95 JCT ratio | plan tput ratio | "
                  "plan tput ratio, timeline | worst run (tput) |", "|---|---|---|---|---|---|---|---|---|"]
        for g in sysp["grid"]:
            for b, v in g["baselines"].items():
                lines.append(f"| {'on' if g['group'][0] else 'off'} | {b} | {v['seeds']} | "
                             f"{_ci(v['mean_jct_ratio'])} | "
                             f"{_ci(v['median_jct_ratio'])} | {_ci(v['p95_jct_ratio'])} | {_ci(v['tps_ratio'])} | "
                             f"{_ci(v['tps_timeline_ratio'])} | {_f(v['tps_ratio_min'])} |")
        lines += ["", "Per policy (mean JCT: mean over seeds of each run's mean over its completed jobs, [95% CI]):",
                  "",
                  "| topology | load | wait | policy | completed | mean JCT h | decisions | ms/decision (measured) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sysp["policies"]:
            m = r["mean_jct_s"]
            mh = None if m is None else {k: (v / 3600 if k != "n" else v) for k, v in m.items()}
            lines.append(f"| {r['kind']} | {r['load']:g} | {'on' if r['wait'] else 'off'} | {r['label']} | "
                         f"{r['completed']}/{r['jobs']} | {_ci(mh)} | {r['decisions']} | "
                         f"{_f(1000 * r['wall_per_decision_s'] if r['wall_per_decision_s'] else None)} |")
    if doc.get("targets"):
        lines += ["", "## Targets", "", "```json", json.dumps(doc["targets"], indent=1), "```"]
    if doc.get("scale"):
        s = doc["scale"]
        lines += ["", f"Scale run: {s['clusters']} clusters × {s['jobs']} jobs with {s['policy']}: "
                      f"{'finished' if s['finished'] else 'NOT finished'} in {s['wall_s']:.1f} s wall "
                      f"({s['cpu_s']:.1f} s CPU)."]
    return "\n".join(lines) + "\n"


def scale_run(clusters: int, jobs: int, *, seed: int, load: float, budget_s: float) -> dict[str, Any]:
    """Simulate ``jobs`` jobs on ``clusters`` clusters with SpinSearch (measured overhead); report whether it
    finished within ``budget_s`` of wall time."""
    c0, t0 = time.process_time(), time.perf_counter()
    topo = generate_topology(clusters, seed, "geo")
    trace = generate_trace(jobs, seed, load, topo)

    class _OutOfTime(Exception):
        pass

    def progress(done: int, total: int) -> None:
        if time.perf_counter() - t0 > budget_s:
            raise _OutOfTime

    out: dict[str, Any] = {"clusters": clusters, "jobs": jobs, "policy": "spinsearch", "budget_s": budget_s}
    try:
        s = summarize(simulate(topo, trace, "spinsearch", SimConfig(seed=seed), progress=progress))
        out.update(finished=True, summary={k: v for k, v in s.items() if k != "violations"})
    except _OutOfTime:
        out.update(finished=False)
    out.update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - c0)
    return out


def report_from(ap: argparse.ArgumentParser, source: Path, out: Path) -> int:
    """Recompute an earlier run's summaries from its raw rows and runs and write ``out`` and its report."""
    try:
        doc = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        ap.error(f"argument --report-from: cannot read {source}: {e}")
    if doc.get("placement"):
        doc["placement"]["summary"] = placement_summary(doc["placement"]["rows"])
    if doc.get("curves"):
        st = doc["settings"]
        doc["curves"]["summary"] = curve_summary(doc["curves"]["rows"], st["curve_ilp"], st["curve_genetic"])
    if doc.get("system"):
        doc["system"] = summarize_system(doc["system"])
    doc["targets"] = targets(doc)
    doc["report"] = f"summaries recomputed from {source} by: bench/paper.py --report-from {source} --out {out}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    md = markdown(doc)
    out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", type=_csv_kinds, default=list(KINDS), help=f"topologies, from {', '.join(KINDS)}")
    ap.add_argument("--clusters", type=int, default=12, help="clusters of the generated topologies")
    ap.add_argument("--loads", type=_csv_floats, default=[0.3, 0.6, 1.0])
    ap.add_argument("--seeds", type=csv_ints(minimum=1), default=[1, 2, 3, 4, 5])
    ap.add_argument("--jobs", type=int, default=12, help="jobs per simulated trace")
    ap.add_argument("--instances", type=int, default=1, help="placement instances per topology and seed")
    ap.add_argument("--large-instances", type=int, default=1,
                    help="placement instances of the largest models (llama3-70b, gpt3-13b, ...) per topology and "
                         "seed, beside --instances: jobs a partly busy pool holds only across clusters")
    ap.add_argument("--ilp-limit", type=float, default=3.0, help="ilp/genetic limit per placement decision (s)")
    ap.add_argument("--curve-ilp", type=_csv_floats, default=[0.1, 1.0, 3.0, 30.0], help="ilp time limits (s)")
    ap.add_argument("--curve-genetic", type=csv_ints(minimum=0), default=[0, 100, 500, 4900],
                    help="genetic trial budgets")
    ap.add_argument("--curve-instances", type=int, default=2, help="curve instances per topology")
    ap.add_argument("--curve-kinds", type=_csv_kinds, default=["geo", "aws-10-dtfm"], help="topologies of the curves")
    ap.add_argument("--place-policies", default=",".join(PLACE_POLICIES),
                    help="policies of the placement part (ilp adds its upper reference)")
    ap.add_argument("--sim-policies", default=",".join(SIM_POLICIES))
    ap.add_argument("--sim-ilp-limit", type=float, default=0.1, help="ilp limit per decision in the simulations (s)")
    ap.add_argument("--sim-search-kinds", type=_csv_kinds, default=["geo", "aws-10-dtfm"],
                    help="topologies on which ilp and genetic are simulated too (seconds per decision)")
    ap.add_argument("--sim-search-loads", type=_csv_floats, default=[1.0],
                    help="loads at which ilp and genetic are simulated")
    ap.add_argument("--sim-genetic-trials", type=int, default=50)
    ap.add_argument("--sim-genetic-population", type=int, default=10)
    ap.add_argument("--gpu-price", type=float, default=0.0,
                    help="SpinSearch's shadow price λ of the GPUs a plan holds under pressure on the pool, in the "
                         "simulations (default 0: its fastest plan)")
    ap.add_argument("--lookahead", action="store_true",
                    help="SpinSearch's region matching against the expected arrivals, in the simulations")
    ap.add_argument("--workers", type=int, default=2, help="processes for the simulations")
    ap.add_argument("--parts", default="placement,curves,system", help="which parts to run")
    ap.add_argument("--quick", action="store_true",
                    help="a subset: geo and aws-10-dtfm, load 1.0, seeds 1–2, 6 jobs (ilp, genetic simulated on geo), "
                         "placement ilp 0.3 s, curves on one geo instance at 0.1/1 s and 0/100 trials")
    ap.add_argument("--scale-only", action="store_true", help="only the 256-cluster × 2,000-job SpinSearch run")
    ap.add_argument("--scale-budget", type=float, default=600.0)
    ap.add_argument("--report-from", type=Path,
                    help="recompute the summaries, targets and report of an earlier run's JSON (no simulation)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/paper-grid.json"))
    args = ap.parse_args(argv)
    if args.report_from is not None:
        return report_from(ap, args.report_from, args.out)
    check_outputs(ap, {"--out": args.out}, {})
    for name in ("clusters", "jobs", "instances", "workers", "curve_instances", "sim_genetic_population"):
        if getattr(args, name) < 1:
            ap.error(f"argument --{name.replace('_', '-')}: must be ≥ 1 (got {getattr(args, name)})")
    if args.large_instances < 0:
        ap.error(f"argument --large-instances: must be ≥ 0 (got {args.large_instances})")
    for name in ("ilp_limit", "sim_ilp_limit"):
        if not math.isfinite(getattr(args, name)) or getattr(args, name) <= 0:
            ap.error(f"argument --{name.replace('_', '-')}: must be a positive number")
    if not math.isfinite(args.gpu_price) or args.gpu_price < 0:
        ap.error("argument --gpu-price: must be a finite number ≥ 0")
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - {"placement", "curves", "system"}:
        ap.error(f"argument --parts: unknown {', '.join(sorted(parts - {'placement', 'curves', 'system'}))}")
    _quiet()
    sim_policies = [p.strip() for p in args.sim_policies.split(",") if p.strip()]
    place_policies = [p.strip() for p in args.place_policies.split(",") if p.strip()]
    for flag, names in (("--sim-policies", sim_policies), ("--place-policies", place_policies)):
        unknown = [p for p in names if p not in REGISTRY]
        if unknown:
            ap.error(f"argument {flag}: unknown {', '.join(unknown)}")
        if REFERENCE not in names:
            ap.error(f"argument {flag}: must include {REFERENCE} (every ratio is against it)")
    if args.quick:
        given = set(argv if argv is not None else sys.argv[1:])
        defaults = {"--kinds": ("kinds", ["geo", "aws-10-dtfm"]), "--loads": ("loads", [1.0]),
                    "--seeds": ("seeds", [1, 2]), "--jobs": ("jobs", 6), "--instances": ("instances", 1),
                    "--ilp-limit": ("ilp_limit", 0.3), "--curve-ilp": ("curve_ilp", [0.1, 1.0]),
                    "--curve-genetic": ("curve_genetic", [0, 100]), "--curve-kinds": ("curve_kinds", ["geo"]),
                    "--curve-instances": ("curve_instances", 1), "--sim-search-kinds": ("sim_search_kinds", ["geo"])}
        for flag, (attr, value) in defaults.items():
            if flag not in given and not any(g.startswith(flag + "=") for g in given):
                setattr(args, attr, value)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0, c0 = time.perf_counter(), time.process_time()
    doc: dict[str, Any] = {
        "command": " ".join(["bench/paper.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": _commit(),
        "machine": f"{platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} cores shared with "
                   "other work",
        "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
    }
    if args.scale_only:
        doc["scale"] = scale_run(256, 2000, seed=1, load=1.0, budget_s=args.scale_budget)
    else:
        if "placement" in parts:
            doc["placement"] = placement_part(args.kinds, args.seeds, args.instances, args.clusters, args.ilp_limit,
                                              place_policies, large=args.large_instances)
        if "curves" in parts:
            curve_kinds = [k for k in args.curve_kinds if k in args.kinds] or args.kinds[:1]
            doc["curves"] = curve_part(curve_kinds, args.clusters, args.curve_ilp, args.curve_genetic,
                                       args.curve_instances)
        if "system" in parts:
            setups = system_setups(sim_policies, args.sim_ilp_limit, args.sim_genetic_trials,
                                   args.sim_genetic_population, args.gpu_price, args.lookahead)
            doc["system"] = system_part(args.kinds, args.loads, args.seeds, args.clusters, args.jobs, setups,
                                        args.workers, search_kinds=args.sim_search_kinds,
                                        search_loads=args.sim_search_loads)
        doc["targets"] = targets(doc)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    doc["wall_s"] = time.perf_counter() - t0
    doc["cpu_s"] = time.process_time() - c0 + children.ru_utime + children.ru_stime
    doc["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    md = markdown(doc)
    args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
