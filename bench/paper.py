"""Reproduce the paper's comparison in the simulator: SpinSearch against every baseline in one run.

For each cluster count (default 8, 16, 32, 64; topologies from ``spiderflow.topogen``, kind ``geo``, fixed
seed) one trace is generated against that topology's capacity, and every policy simulates the same trace
on the same topology with the same queue policy. Budgets are stated in the output: policies that take a
time limit (``ilp``, ``genetic``) get the same ``--time-limit`` per decision; SpinSearch, firstfit and bace
take none. Decisions' wall time is measured (``--overhead measured``) and delays the jobs, as in the
service; their process CPU time is reported too (less sensitive to other load on a shared machine). Each
policy's simulation runs in a fresh process (``--no-isolate`` to share one), so no policy inherits the
plan caches another one warmed.

Figures, each a ratio against the best *baseline* of the same run (a baseline is any policy other than
``spinsearch``):

- ``jct_ratio`` = best baseline mean JCT / SpinSearch mean JCT (> 1: SpinSearch is better), computed over
  the jobs every policy completed (so a policy that gives up on hard jobs gets no credit for it);
- ``throughput_ratio`` = SpinSearch system throughput (tokens of completed jobs / makespan) / the best
  baseline's; ``plan_throughput_ratio`` = SpinSearch's mean per-job training throughput (tokens/s of the
  job's plan) / the best baseline's, over the jobs every policy completed;
- ``overhead_ratio_<p>`` = mean per-decision overhead (wall) of ``p`` / SpinSearch's, for ``p`` in ilp,
  genetic; ``cpu_ratio_<p>`` the same with process CPU time; ``total_overhead_ratio_<p>`` with the sums;
- cost run (``--cost``): SpinSearch with ``--objective cost`` and ``balanced`` against ``bace``: electricity
  $ and mean JCT ratios, per seed of ``--cost-seeds`` with a fixed overhead per decision (reproducible),
  and their mean ± sd;
- ``--wait-ablation``: SpinSearch again with no releases passed (it always starts on what is free now),
  to show what the start-now-or-wait step contributes.
- ``--tpa-ablation``: SpinSearch again with its chains planned by the level-1 planner only (the job's
  micro-batch count and 1F1B, no TPA): the planning scope of ``ilp`` and ``genetic``, which place with the
  job's micro-batch count too. It separates what TPA adds to a decision's time from what it adds to the
  JCT; its overhead ratios against ``ilp`` and ``genetic`` are reported beside the full system's (and
  repeated with ``--repeats``). The issue's targets are judged on the full system.
- ``--level2-ablation``: SpinSearch again with TPA's level 2 solved by the CP-SAT model
  (``level2="cpsat"``: the chosen split's blocks and their re-solves under other schedules) instead of
  the exact solver, reported and repeated the same way: what the CP-SAT solves cost a decision.
- ``--repeats R``: the measured main comparison R times per size. Each policy's trajectory moves with its
  own measured decision times (they delay its jobs, so it meets other queues), and ``ilp``'s and the GA's
  decision times move with it: one run is one sample. The table adds every run's time per decision and,
  against ``ilp`` and ``genetic``, the ratio of the means over the runs with the range of run-by-run
  ratios. JCT and throughput stay those of the first run.

A separate scale run (``--scale-clusters 256 --scale-jobs 2000``) times the whole simulation of
SpinSearch alone (wall clock of the run, the 10-minute target).

Usage::

    .venv/bin/python bench/paper.py --quick                 # 8 and 16 clusters, 30 jobs, 1 s limit
    .venv/bin/python bench/paper.py --sizes 8,16,32,64 --jobs 200 --time-limit 5 --scale
    .venv/bin/python bench/paper.py --scale-only

Writes ``--out`` (JSON, default ``bench/paper-results.json``), a Markdown table (``.md`` next to it)
and, with ``--plots DIR``, the figures of :mod:`spiderflow.sim.plots` including overhead vs clusters.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog

from spiderflow.cli.common import check_outputs, csv_ints
from spiderflow.domain import JobSpec, Topology
from spiderflow.errors import SpiderFlowError
from spiderflow.placement import REGISTRY, load_builtin_policies
from spiderflow.placement.base import Objective, PlacementPolicy
from spiderflow.placement.common import LocalPlanner
from spiderflow.placement.spinsearch import SpinSearch
from spiderflow.queueing import QueuePolicy
from spiderflow.sim.engine import OverheadMode, SimConfig, SimResult, simulate
from spiderflow.sim.metrics import summarize
from spiderflow.sim.tracegen import generate_trace
from spiderflow.topogen import generate_topology

ALL_POLICIES = ("spinsearch", "ilp", "genetic", "firstfit", "bace")


def _simulate_child(args: tuple[Any, ...]) -> SimResult:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    load_builtin_policies()
    topo, trace, policy, cfg = args
    return simulate(topo, trace, policy, cfg)


WITHOUT_TPA = "spinsearch_without_tpa"
"""The key of the ``--tpa-ablation`` run (SpinSearch with ``planner=None``: level-1 plans only) in the results."""
CPSAT_LEVEL2 = "spinsearch_cpsat_level2"
"""The key of the ``--level2-ablation`` run (SpinSearch with TPA's level 2 solved by CP-SAT) in the results."""
VARIANTS = (WITHOUT_TPA, CPSAT_LEVEL2)
"""SpinSearch variants the ablation flags add, in the order they run."""
_VARIANT_LABELS = {WITHOUT_TPA: "without TPA", CPSAT_LEVEL2: "CP-SAT level 2"}


def _policy(name: str) -> str | PlacementPolicy:
    if name == WITHOUT_TPA:
        return SpinSearch(planner=None)
    if name == CPSAT_LEVEL2:
        return SpinSearch(planner=LocalPlanner(level2="cpsat"))
    return name


def _simulate(topo: Topology, trace: list[JobSpec], policy: str, cfg: SimConfig, *, isolate: bool) -> SimResult:
    """One simulation; with ``isolate`` in a fresh process, so no policy starts with caches another one
    (or an earlier size) warmed: every policy pays its own cold start."""
    if not isolate:
        return simulate(topo, trace, _policy(policy), cfg)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        res: SimResult = pool.apply(_simulate_child, ((topo, trace, _policy(policy), cfg),))
        return res


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_size(clusters: int, jobs: int, policies: list[str], *, seed: int, load: float, time_limit: float,
             objective: Objective = Objective.JCT, overhead: OverheadMode = OverheadMode.MEASURED,
             wait_ablation: bool = False, tpa_ablation: bool = False, level2_ablation: bool = False,
             isolate: bool = True, repeats: int = 1) -> dict[str, Any]:
    topo = generate_topology(clusters, seed, "geo")
    trace = generate_trace(jobs, seed, load, topo)
    cfg = SimConfig(objective=objective, seed=seed, time_limit_s=time_limit, overhead=overhead)
    out: dict[str, Any] = {"clusters": clusters, "jobs": jobs, "pool_gpus": topo.total_free_gpus,
                           "links": len(topo.links), "policies": {}}
    records: dict[str, dict[str, Any]] = {}
    for p in policies:
        t0 = time.perf_counter()
        try:
            res = _simulate(topo, trace, p, cfg, isolate=isolate)
        except SpiderFlowError as e:  # a policy bug must not hide the other policies' figures
            out.setdefault("errors", {})[p] = f"{type(e).__name__}: {e}"
            print(f"  {clusters:>4} clusters {p:>10}: ERROR {e}", flush=True)
            continue
        wall = time.perf_counter() - t0
        s = summarize(res)
        s["wall_s"] = wall
        out["policies"][p] = s
        records[p] = {r.id: r for r in res.records}
        print(f"  {clusters:>4} clusters {p:>10}: {s['completed']}/{jobs} done, mean JCT "
              f"{(s['mean_jct_s'] or 0) / 3600:.2f} h, {s['throughput_tokens_per_s']:.4g} tok/s, "
              f"{s['decisions']} decisions, {s['overhead_per_decision_mean_s'] or 0:.4f} s/decision, "
              f"wall {wall:.1f} s", flush=True)
    done_sets = [{k for k, r in recs.items() if r.status == "completed"} for recs in records.values()]
    common = set.intersection(*done_sets) if done_sets else set()
    out["common_completed"] = len(common)
    for p in records:
        jcts = [records[p][k].jct_s for k in common]
        out["policies"][p]["mean_jct_common_s"] = _mean([j for j in jcts if j is not None])
        out["policies"][p]["mean_plan_tokens_per_s_common"] = _mean([records[p][k].plan_tokens_per_s for k in common])
    out["ratios"] = ratios(out["policies"])
    extra: dict[str, dict[str, Any]] = {}
    wanted = {WITHOUT_TPA: tpa_ablation, CPSAT_LEVEL2: level2_ablation}
    for variant in (v for v in VARIANTS if wanted[v] and "spinsearch" in policies):
        res = _simulate(topo, trace, variant, cfg, isolate=isolate)
        s = summarize(res)
        extra[variant] = s
        out[variant] = without_tpa(s, {r.id: r for r in res.records}, out["policies"], records)
        print(f"  {clusters:>4} clusters spinsearch, {_VARIANT_LABELS[variant]}: {s['completed']}/{jobs} done, "
              f"mean JCT {(s['mean_jct_s'] or 0) / 3600:.2f} h, {s['decisions']} decisions, "
              f"{s['overhead_per_decision_mean_s'] or 0:.4f} s/decision", flush=True)
    if repeats > 1 and overhead is OverheadMode.MEASURED:
        runs = {p: [_overhead_of(s)] for p, s in {**out["policies"], **extra}.items()}
        for rep in range(2, repeats + 1):
            for p in runs:
                s = summarize(_simulate(topo, trace, p, cfg, isolate=isolate))
                runs[p].append(_overhead_of(s))
                print(f"  {clusters:>4} clusters {p:>10}: run {rep}/{repeats}: {s['decisions']} decisions, "
                      f"{s['overhead_per_decision_mean_s'] or 0:.4f} s/decision, total {s['sched_overhead_s']:.4g} s",
                      flush=True)
        out["overhead_repeats"] = overhead_repeats(runs)
    if wait_ablation and "spinsearch" in policies:
        # SpinSearch without the releases (always starts on what is free now), same trace and budgets.
        s = summarize(_simulate(topo, trace, "spinsearch", replace(cfg, releases=False), isolate=isolate))
        out["spinsearch_start_now"] = {k: s[k] for k in ("completed", "mean_jct_s", "p95_jct_s",
                                                         "throughput_tokens_per_s", "decisions",
                                                         "overhead_per_decision_mean_s", "gpu_utilization")}
        print(f"  {clusters:>4} clusters spinsearch without releases: {s['completed']}/{jobs} done, mean JCT "
              f"{(s['mean_jct_s'] or 0) / 3600:.2f} h, {s['throughput_tokens_per_s']:.4g} tok/s", flush=True)
    return out


def without_tpa(s: dict[str, Any], recs: dict[str, Any], pol: dict[str, dict[str, Any]],
                records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures of a SpinSearch variant (``--tpa-ablation``, ``--level2-ablation``): the run's summary
    fields, its mean JCT against SpinSearch's over the jobs both completed (``jct_vs_spinsearch`` > 1:
    slower than SpinSearch), and the overhead ratios of ``ilp`` and ``genetic`` against it (per decision,
    CPU, total), as :func:`ratios` computes them against SpinSearch."""
    out: dict[str, Any] = {k: s[k] for k in ("completed", "mean_jct_s", "p95_jct_s", "throughput_tokens_per_s",
                                             "decisions", "overhead_per_decision_mean_s", "cpu_per_decision_mean_s",
                                             "sched_overhead_s", "gpu_utilization")}
    full = records.get("spinsearch", {})
    both = [k for k, r in recs.items() if r.status == "completed" and k in full and full[k].status == "completed"]
    if both:
        mine = _mean([recs[k].jct_s for k in both if recs[k].jct_s is not None])
        theirs = _mean([full[k].jct_s for k in both if full[k].jct_s is not None])
        out["jct_vs_spinsearch"] = mine / theirs if mine and theirs else None
        out["common_with_spinsearch"] = len(both)
    r = ratios({**{k: v for k, v in pol.items() if k != "spinsearch"}, "spinsearch": s})
    out["ratios"] = {k: v for k, v in r.items() if k.startswith(("overhead_ratio_", "cpu_ratio_", "total_overhead_"))
                     and k.endswith(("_ilp", "_genetic"))}
    return out


def ratios(pol: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures of the module docstring (``None`` where a policy is missing or a value undefined)."""
    if "spinsearch" not in pol:
        return {}
    ss = pol["spinsearch"]
    base = {k: v for k, v in pol.items() if k != "spinsearch"}
    r: dict[str, Any] = {}
    jcts = {k: v["mean_jct_common_s"] for k, v in base.items() if v.get("mean_jct_common_s")}
    if jcts and ss.get("mean_jct_common_s"):
        best = min(jcts, key=lambda k: jcts[k])
        r["jct_best_baseline"] = best
        r["jct_ratio"] = jcts[best] / ss["mean_jct_common_s"]
    thr = {k: v["throughput_tokens_per_s"] for k, v in base.items() if v.get("throughput_tokens_per_s")}
    if thr and ss.get("throughput_tokens_per_s"):
        best = max(thr, key=lambda k: thr[k])
        r["throughput_best_baseline"] = best
        r["throughput_ratio"] = ss["throughput_tokens_per_s"] / thr[best]
    ptr = {k: v["mean_plan_tokens_per_s_common"] for k, v in base.items() if v.get("mean_plan_tokens_per_s_common")}
    if ptr and ss.get("mean_plan_tokens_per_s_common"):
        best = max(ptr, key=lambda k: ptr[k])
        r["plan_throughput_best_baseline"] = best
        r["plan_throughput_ratio"] = ss["mean_plan_tokens_per_s_common"] / ptr[best]
    for p in ("ilp", "genetic", "firstfit", "bace"):
        if p in base and base[p].get("overhead_per_decision_mean_s") and ss.get("overhead_per_decision_mean_s"):
            r[f"overhead_ratio_{p}"] = base[p]["overhead_per_decision_mean_s"] / ss["overhead_per_decision_mean_s"]
            r[f"total_overhead_ratio_{p}"] = (base[p]["sched_overhead_s"] / ss["sched_overhead_s"]
                                              if ss["sched_overhead_s"] else None)
        if p in base and base[p].get("cpu_per_decision_mean_s") and ss.get("cpu_per_decision_mean_s"):
            r[f"cpu_ratio_{p}"] = base[p]["cpu_per_decision_mean_s"] / ss["cpu_per_decision_mean_s"]
    return r


def _overhead_of(s: dict[str, Any]) -> dict[str, Any]:
    return {"decisions": s["decisions"], "per_decision_s": s["overhead_per_decision_mean_s"],
            "total_s": s["sched_overhead_s"]}


def overhead_repeats(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Overhead over repeated measured runs of the same trace (each policy's trajectory moves with its own
    measured decision times, so one run is one sample): every run's figures, and for ``ilp`` and
    ``genetic`` the ratio of their mean over the runs to SpinSearch's (per decision and total) and the
    range of the run-by-run ratios (run ``i`` of the baseline over run ``i`` of SpinSearch). With a
    variant's runs (:data:`VARIANTS`), the same against them under ``out[variant]``."""
    out: dict[str, Any] = {"runs": runs}
    out.update(_repeat_ratios(runs, "spinsearch"))
    for variant in VARIANTS:
        if variant in runs:
            out[variant] = _repeat_ratios(runs, variant)
    return out


def _repeat_ratios(runs: dict[str, list[dict[str, Any]]], reference: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ss = runs.get(reference)
    if not ss or any(not r["per_decision_s"] or not r["total_s"] for r in ss):
        return out
    for p in ("ilp", "genetic"):
        rs = runs.get(p)
        if not rs or any(r["per_decision_s"] is None for r in rs):
            continue
        per = [b["per_decision_s"] / a["per_decision_s"] for a, b in zip(ss, rs, strict=True)]
        tot = [b["total_s"] / a["total_s"] for a, b in zip(ss, rs, strict=True)]
        out[p] = {
            "per_decision_ratio_of_means": statistics.fmean(r["per_decision_s"] for r in rs)
            / statistics.fmean(r["per_decision_s"] for r in ss),
            "total_ratio_of_means": statistics.fmean(r["total_s"] for r in rs)
            / statistics.fmean(r["total_s"] for r in ss),
            "per_decision_ratio_min": min(per), "per_decision_ratio_max": max(per),
            "total_ratio_min": min(tot), "total_ratio_max": max(tot),
        }
    return out


def cost_run(clusters: int, jobs: int, *, seeds: list[int], load: float, time_limit: float) -> dict[str, Any]:
    """SpinSearch under each objective against ``bace`` on the same trace, for every seed, with a fixed
    overhead per decision (so a seed's figures are reproducible); mean ± sd over the seeds."""
    runs = [("bace", Objective.JCT), ("spinsearch", Objective.JCT), ("spinsearch", Objective.COST),
            ("spinsearch", Objective.BALANCED)]
    out: dict[str, Any] = {"clusters": clusters, "jobs": jobs, "seeds": seeds, "overhead": "fixed", "per_seed": {},
                           "runs": {}}
    for seed in seeds:
        topo = generate_topology(clusters, seed, "geo")
        trace = generate_trace(jobs, seed, load, topo)
        per: dict[str, Any] = {}
        for p, obj in runs:
            if p not in REGISTRY:
                continue
            cfg = SimConfig(objective=obj, seed=seed, time_limit_s=time_limit, overhead=OverheadMode.FIXED)
            s = summarize(simulate(topo, trace, p, cfg))
            key = f"{p}/{obj.value}"
            per[key] = {k: s[k] for k in ("completed", "mean_jct_s", "cost_usd", "throughput_tokens_per_s")}
            print(f"  cost run seed {seed} {key:>22}: ${s['cost_usd']:.4g}, mean JCT "
                  f"{(s['mean_jct_s'] or 0) / 3600:.2f} h, {s['completed']} done", flush=True)
        b = per.get("bace/jct")
        if b:
            for key, v in per.items():
                if key.startswith("spinsearch") and b["cost_usd"] and b["mean_jct_s"] and v["mean_jct_s"]:
                    v["cost_vs_bace"] = v["cost_usd"] / b["cost_usd"] - 1.0
                    v["jct_vs_bace"] = v["mean_jct_s"] / b["mean_jct_s"] - 1.0
        out["per_seed"][str(seed)] = per
    keys = {k for per in out["per_seed"].values() for k in per}
    for key in sorted(keys, key=lambda k: [f"{p}/{o.value}" for p, o in runs].index(k)):
        vals = [per[key] for per in out["per_seed"].values() if key in per]
        agg: dict[str, Any] = {"seeds": len(vals)}
        for f in ("completed", "mean_jct_s", "cost_usd", "cost_vs_bace", "jct_vs_bace"):
            xs = [float(v[f]) for v in vals if v.get(f) is not None]
            if xs:
                agg[f] = statistics.fmean(xs)
                agg[f + "_sd"] = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out["runs"][key] = agg
    return out


def seed_sweep(sizes: list[int], seeds: list[int], jobs: int, *, load: float, time_limit: float,
               policies: tuple[str, ...] = ("spinsearch", "bace")) -> dict[str, Any]:
    """SpinSearch against ``bace`` (the cheap baseline that was best in most main-run figures) on more
    seeds, fixed overhead per decision: JCT ratio over the jobs both completed and throughput ratio."""
    rows: list[dict[str, Any]] = []
    for n in sizes:
        for seed in seeds:
            topo = generate_topology(n, seed, "geo")
            trace = generate_trace(jobs, seed, load, topo)
            cfg = SimConfig(seed=seed, time_limit_s=time_limit, overhead=OverheadMode.FIXED)
            res = {p: simulate(topo, trace, p, cfg) for p in policies if p in REGISTRY}
            if len(res) < 2:
                continue
            recs = {p: {r.id: r for r in v.records} for p, v in res.items()}
            common = set.intersection(*[{k for k, r in rr.items() if r.status == "completed"} for rr in recs.values()])
            sm = {p: summarize(v) for p, v in res.items()}
            row: dict[str, Any] = {"clusters": n, "seed": seed, "common": len(common)}
            for p in res:
                jcts = [recs[p][k].jct_s or 0.0 for k in common]
                row[p] = {"completed": sm[p]["completed"], "mean_jct_common_s": _mean(jcts),
                          "throughput_tokens_per_s": sm[p]["throughput_tokens_per_s"]}
            a, b = row[policies[0]], row[policies[1]]
            row["jct_ratio"] = (b["mean_jct_common_s"] / a["mean_jct_common_s"]
                                if a["mean_jct_common_s"] and b["mean_jct_common_s"] else None)
            row["throughput_ratio"] = (a["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
                                       if b["throughput_tokens_per_s"] else None)
            rows.append(row)
            print(f"  sweep {n:>3} clusters seed {seed}: JCT ratio {row['jct_ratio'] or 0:.3g}, throughput ratio "
                  f"{row['throughput_ratio'] or 0:.3g} ({policies[0]} vs {policies[1]})", flush=True)
    return {"policies": list(policies), "jobs": jobs, "overhead": "fixed", "rows": rows}


def queue_ablation(clusters: int, jobs: int, *, seed: int, load: float, time_limit: float,
                   policy: str = "spinsearch") -> dict[str, Any]:
    """The same policy under the full queue policy and under FIFO-by-priority without backfilling."""
    topo = generate_topology(clusters, seed, "geo")
    trace = generate_trace(jobs, seed, load, topo)
    fifo = QueuePolicy(work_weight=0.0, network_weight=0.0, aging_per_hour=1e-9, backfill=False)
    out: dict[str, Any] = {"clusters": clusters, "jobs": jobs, "policy": policy, "runs": {}}
    for name, q in (("bace-style queue + backfill", QueuePolicy()), ("fifo by priority", fifo)):
        s = summarize(simulate(topo, trace, policy, SimConfig(seed=seed, time_limit_s=time_limit, queue=q)))
        out["runs"][name] = {k: s[k] for k in ("completed", "mean_jct_s", "p95_jct_s", "mean_queue_s",
                                               "throughput_tokens_per_s", "gpu_utilization")}
        print(f"  queue ablation {name:>28}: mean JCT {(s['mean_jct_s'] or 0) / 3600:.2f} h, "
              f"p95 {(s['p95_jct_s'] or 0) / 3600:.2f} h, {s['completed']} done", flush=True)
    return out


class _OutOfTime(Exception):
    pass


def scale_run(clusters: int, jobs: int, *, seed: int, load: float, policy: str = "spinsearch",
              budget_s: float = 600.0) -> dict[str, Any]:
    """Simulate ``jobs`` jobs on ``clusters`` clusters with ``policy``; stop after ``budget_s`` of wall time
    and report how far it got (jobs finished or given up, simulated time reached) if it did not finish."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    topo = generate_topology(clusters, seed, "geo")
    trace = generate_trace(jobs, seed, load, topo)
    t1 = time.perf_counter()
    seen = {"done": 0}

    def progress(done: int, total: int) -> None:
        seen["done"] = done
        if done % 100 == 0:
            print(f"    {done}/{total} jobs after {time.perf_counter() - t0:.0f} s wall, "
                  f"{time.process_time() - c0:.0f} s CPU", flush=True)
        if time.perf_counter() - t0 > budget_s:
            raise _OutOfTime

    out: dict[str, Any] = {"clusters": clusters, "jobs": jobs, "policy": policy, "budget_s": budget_s,
                           "setup_s": t1 - t0}
    try:
        res = simulate(topo, trace, policy, SimConfig(seed=seed), progress=progress)
    except _OutOfTime:
        out.update(finished=False, jobs_done=seen["done"], wall_s=time.perf_counter() - t0,
                   cpu_s=time.process_time() - c0)
        print(f"  scale {clusters} clusters x {jobs} jobs ({policy}): NOT finished within {budget_s:.0f} s wall: "
              f"{seen['done']} jobs done, {out['cpu_s']:.0f} s CPU of this process", flush=True)
        return out
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    s = summarize(res)
    print(f"  scale {clusters} clusters x {jobs} jobs ({policy}): {wall:.1f} s wall, {cpu:.1f} s CPU of this "
          f"process (setup {t1 - t0:.1f} s), {s['decisions']} decisions, {s['completed']} done", flush=True)
    out.update(finished=True, jobs_done=jobs, wall_s=wall, cpu_s=cpu,
               summary={k: v for k, v in s.items() if k != "violations"})
    return out


def _section(title: str, columns: list[str]) -> list[str]:
    """A blank line, ``title``, a blank line and the header of a Markdown table with ``columns``."""
    return ["", title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"Command: `{doc['command']}`  ", f"Machine: {doc['machine']}  ", f"Budgets: {doc['budgets']}  ",
             f"Overhead mode: {doc.get('overhead', 'measured')}", ""]
    lines.append("| clusters | policy | done | mean JCT h (common) | p95 JCT h | tokens/s | decisions | "
                 "s/decision | CPU s/decision | total overhead s | util | $ |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in doc["sizes"]:
        for p, s in size["policies"].items():
            lines.append(
                f"| {size['clusters']} | {p} | {s['completed']}/{size['jobs']} | "
                f"{(s['mean_jct_common_s'] or 0) / 3600:.2f} | {(s['p95_jct_s'] or 0) / 3600:.2f} | "
                f"{s['throughput_tokens_per_s']:.4g} | {s['decisions']} | "
                f"{s['overhead_per_decision_mean_s'] or 0:.4g} | {s.get('cpu_per_decision_mean_s') or 0:.4g} | "
                f"{s['sched_overhead_s']:.4g} | "
                f"{s['gpu_utilization']:.2f} | {s['cost_usd']:.4g} |")
    lines += ["", "| clusters | common jobs | JCT ratio (vs best baseline) | throughput ratio | "
              "plan throughput ratio | "
              "overhead ilp/ss | overhead genetic/ss | CPU ilp/ss | CPU genetic/ss | total overhead ilp/ss | "
              "total overhead genetic/ss |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x: Any) -> str:
        return "–" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))

    for size in doc["sizes"]:
        r = size["ratios"]
        lines.append(f"| {size['clusters']} | {size['common_completed']} | "
                     f"{f(r.get('jct_ratio'))} ({r.get('jct_best_baseline', '–')}) | "
                     f"{f(r.get('throughput_ratio'))} ({r.get('throughput_best_baseline', '–')}) | "
                     f"{f(r.get('plan_throughput_ratio'))} ({r.get('plan_throughput_best_baseline', '–')}) | "
                     f"{f(r.get('overhead_ratio_ilp'))} | {f(r.get('overhead_ratio_genetic'))} | "
                     f"{f(r.get('cpu_ratio_ilp'))} | {f(r.get('cpu_ratio_genetic'))} | "
                     f"{f(r.get('total_overhead_ratio_ilp'))} | {f(r.get('total_overhead_ratio_genetic'))} |")
    if any("overhead_repeats" in size for size in doc["sizes"]):
        lines += _section("Overhead over repeated measured runs (same trace; ratio of the means over the runs, and "
                          "the range of run-by-run ratios):",
                          ["clusters", "runs", "spinsearch s/decision (each run)", "baseline",
                           "baseline s/decision (each run)", "per decision: ratio of means (range)",
                           "total: ratio of means (range)"])
        for size in doc["sizes"]:
            rep = size.get("overhead_repeats")
            if not rep:
                continue
            for ref, label in (("spinsearch", ""), *((v, f" ({_VARIANT_LABELS[v]})") for v in VARIANTS)):
                ratios_of = rep if ref == "spinsearch" else rep.get(ref, {})
                ss_runs = rep["runs"].get(ref, [])
                for p in ("ilp", "genetic"):
                    if p not in ratios_of:
                        continue
                    v = ratios_of[p]
                    mine = ", ".join(f"{r['per_decision_s']:.4g}" for r in ss_runs)
                    theirs = ", ".join(f"{r['per_decision_s']:.4g}" for r in rep["runs"][p])
                    lines.append(
                        f"| {size['clusters']} | {len(ss_runs)} | {mine}{label} | {p} | {theirs} | "
                        f"{v['per_decision_ratio_of_means']:.3g} ({v['per_decision_ratio_min']:.3g}–"
                        f"{v['per_decision_ratio_max']:.3g}) | {v['total_ratio_of_means']:.3g} "
                        f"({v['total_ratio_min']:.3g}–{v['total_ratio_max']:.3g}) |")
    if doc.get("cost"):
        c = doc["cost"]
        lines += ["", f"Cost run ({c['clusters']} clusters, {c['jobs']} jobs, seeds {c['seeds']}, fixed overhead per "
                      "decision; mean ± sd over the seeds):", "",
                  "| run | done | mean JCT h | $ | $ vs bace | JCT vs bace |", "|---|---|---|---|---|---|"]

        def pm(v: dict[str, Any], k: str, scale: float = 1.0, pct: bool = False) -> str:
            if v.get(k) is None:
                return "–"
            if pct:
                return f"{100 * v[k]:+.1f}% ± {100 * v[k + '_sd']:.1f}"
            return f"{v[k] / scale:.3g} ± {v[k + '_sd'] / scale:.2g}"

        for key, v in c["runs"].items():
            lines.append(f"| {key} | {pm(v, 'completed')} | {pm(v, 'mean_jct_s', 3600)} | {pm(v, 'cost_usd')} | "
                         f"{pm(v, 'cost_vs_bace', pct=True)} | {pm(v, 'jct_vs_bace', pct=True)} |")
    titles = {
        WITHOUT_TPA: "SpinSearch without TPA (level-1 plans with the job's micro-batch count, 1F1B: the planning "
                     "scope of ilp and genetic; same trace):",
        CPSAT_LEVEL2: "SpinSearch with TPA's level 2 solved by CP-SAT (the plan's blocks and their re-solves; same "
                      "trace):",
    }
    for variant in (v for v in VARIANTS if any(v in size for size in doc["sizes"])):
        lines += _section(titles[variant],
                          ["clusters", "done", "mean JCT h", "JCT vs spinsearch", "tokens/s", "decisions", "s/decision",
                           "overhead ilp/it", "overhead genetic/it", "total overhead ilp/it",
                           "total overhead genetic/it"])
        for size in doc["sizes"]:
            v = size.get(variant)
            if v:
                r = v["ratios"]
                lines.append(f"| {size['clusters']} | {v['completed']}/{size['jobs']} | "
                             f"{(v['mean_jct_s'] or 0) / 3600:.2f} | {f(v.get('jct_vs_spinsearch'))} | "
                             f"{v['throughput_tokens_per_s']:.4g} | {v['decisions']} | "
                             f"{v['overhead_per_decision_mean_s'] or 0:.4g} | {f(r.get('overhead_ratio_ilp'))} | "
                             f"{f(r.get('overhead_ratio_genetic'))} | {f(r.get('total_overhead_ratio_ilp'))} | "
                             f"{f(r.get('total_overhead_ratio_genetic'))} |")
    if any("spinsearch_start_now" in size for size in doc["sizes"]):
        lines += ["", "SpinSearch without the start-now-or-wait step (no releases passed; same trace):", "",
                  "| clusters | done | mean JCT h | p95 JCT h | tokens/s | decisions | s/decision |",
                  "|---|---|---|---|---|---|---|"]
        for size in doc["sizes"]:
            v = size.get("spinsearch_start_now")
            if v:
                lines.append(f"| {size['clusters']} | {v['completed']}/{size['jobs']} | "
                             f"{(v['mean_jct_s'] or 0) / 3600:.2f} | {(v['p95_jct_s'] or 0) / 3600:.2f} | "
                             f"{v['throughput_tokens_per_s']:.4g} | {v['decisions']} | "
                             f"{v['overhead_per_decision_mean_s'] or 0:.4g} |")
    if doc.get("sweep"):
        sw = doc["sweep"]
        a, b = sw["policies"]
        lines += ["", f"Seed sweep ({a} vs {b}, {sw['jobs']} jobs, fixed overhead per decision):", "",
                  "| clusters | seed | common jobs | JCT ratio | throughput ratio |", "|---|---|---|---|---|"]
        for r in sw["rows"]:
            lines.append(f"| {r['clusters']} | {r['seed']} | {r['common']} | {f(r['jct_ratio'])} | "
                         f"{f(r['throughput_ratio'])} |")
        for key in ("jct_ratio", "throughput_ratio"):
            xs = [r[key] for r in sw["rows"] if r.get(key)]
            if xs:
                lines.append(f"\n{key}: geometric mean {math.exp(statistics.fmean(math.log(x) for x in xs)):.3g}, "
                             f"min {min(xs):.3g}, max {max(xs):.3g} over {len(xs)} runs")
    if doc.get("queue_ablation"):
        qa = doc["queue_ablation"]
        lines += ["", f"Queue ablation ({qa['policy']}, {qa['clusters']} clusters, {qa['jobs']} jobs):", "",
                  "| queue | done | mean JCT h | p95 JCT h | mean queueing h | util |", "|---|---|---|---|---|---|"]
        for key, v in qa["runs"].items():
            lines.append(f"| {key} | {v['completed']} | {(v['mean_jct_s'] or 0) / 3600:.2f} | "
                         f"{(v['p95_jct_s'] or 0) / 3600:.2f} | {(v['mean_queue_s'] or 0) / 3600:.2f} | "
                         f"{v['gpu_utilization']:.2f} |")
    if doc.get("scale"):
        s = doc["scale"]
        if s["finished"]:
            lines += ["", f"Scale run: {s['clusters']} clusters × {s['jobs']} jobs with {s['policy']}: "
                          f"{s['wall_s']:.1f} s wall ({s['cpu_s']:.1f} s CPU of the process; the 2 cores are "
                          f"shared), {s['summary']['decisions']} decisions, {s['summary']['completed']} completed, "
                          f"{s['summary']['overhead_per_decision_mean_s']:.3g} s per decision."]
        else:
            lines += ["", f"Scale run: {s['clusters']} clusters × {s['jobs']} jobs with {s['policy']}: NOT finished "
                          f"within {s['budget_s']:.0f} s wall; {s['jobs_done']} jobs done by then "
                          f"({s['cpu_s']:.1f} s CPU of the process; the 2 cores are shared)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=csv_ints(minimum=1), default=[8, 16, 32, 64],
                    help="cluster counts, comma-separated")
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--load", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=5.0, help="per-decision limit for ilp and genetic (s)")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES))
    ap.add_argument("--quick", action="store_true", help="sizes 8,16; 30 jobs; 1 s limit; small cost run")
    ap.add_argument("--cost", action="store_true", help="also run the cost-objective comparison against bace")
    ap.add_argument("--cost-seeds", type=csv_ints(minimum=0), default=[1, 2, 3],
                    help="seeds of the cost run (fixed overhead mode)")
    ap.add_argument("--overhead", choices=[m.value for m in OverheadMode], default="measured",
                    help="measured: decisions' wall time delays jobs (default); fixed: 0.01 s each (reproducible)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the measured main comparison this many times per size (overhead mean and range)")
    ap.add_argument("--no-isolate", action="store_true",
                    help="run the main comparison's simulations in this process (caches shared across policies)")
    ap.add_argument("--sweep-seeds", type=csv_ints(minimum=0), default=[],
                    help="also run spinsearch vs bace on these seeds at every size")
    ap.add_argument("--wait-ablation", action="store_true",
                    help="also run SpinSearch without releases (start-now only) at every size")
    ap.add_argument("--tpa-ablation", action="store_true",
                    help="also run SpinSearch without TPA (level-1 plans with the job's micro-batch count)")
    ap.add_argument("--level2-ablation", action="store_true",
                    help="also run SpinSearch with TPA's level 2 solved by CP-SAT instead of the exact solver")
    ap.add_argument("--queue-ablation", action="store_true",
                    help="also run SpinSearch under a FIFO-by-priority queue without backfilling")
    ap.add_argument("--scale", action="store_true", help="also run the 256-cluster scale run")
    ap.add_argument("--scale-only", action="store_true")
    ap.add_argument("--scale-clusters", type=int, default=256)
    ap.add_argument("--scale-jobs", type=int, default=2000)
    ap.add_argument("--scale-budget", type=float, default=600.0, help="wall-time budget of the scale run (s)")
    ap.add_argument("--out", type=Path, default=Path("bench/paper-results.json"))
    ap.add_argument("--plots", type=Path)
    args = ap.parse_args(argv)
    check_outputs(ap, {"--out": args.out}, {"--plots": args.plots})
    if not args.sizes and not (args.scale_only or args.quick):
        ap.error("argument --sizes: give at least one cluster count")
    if args.repeats < 1:
        ap.error(f"argument --repeats: must be ≥ 1 (got {args.repeats})")
    if args.repeats > 1 and args.overhead != OverheadMode.MEASURED.value:
        ap.error("argument --repeats: repeats apply to --overhead measured only (fixed-overhead runs are identical)")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    load_builtin_policies()
    if args.quick:
        args.sizes, args.jobs, args.time_limit, args.cost, args.queue_ablation = [8, 16], 30, 1.0, True, True
    wanted = [p.strip() for p in args.policies.split(",") if p.strip()]
    policies = [p for p in wanted if p in REGISTRY]
    missing = [p for p in wanted if p not in REGISTRY]
    if missing:
        print(f"not registered (skipped): {', '.join(missing)}", flush=True)
    doc: dict[str, Any] = {
        "command": " ".join(["bench/paper.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": f"{platform.machine()}, {platform.python_version()}, 2 shared cores",
        "budgets": {"ilp": f"{args.time_limit} s per decision", "genetic": f"{args.time_limit} s per decision",
                    "spinsearch": "none (runs to completion)", "firstfit": "none", "bace": "none"},
        "overhead": args.overhead,
        "seed": args.seed, "load": args.load, "policies": policies, "missing": missing, "sizes": [],
    }
    if not args.scale_only:
        for n in args.sizes:
            doc["sizes"].append(run_size(n, args.jobs, policies, seed=args.seed, load=args.load,
                                         time_limit=args.time_limit, overhead=OverheadMode(args.overhead),
                                         wait_ablation=args.wait_ablation, tpa_ablation=args.tpa_ablation,
                                         level2_ablation=args.level2_ablation,
                                         isolate=not args.no_isolate,
                                         repeats=args.repeats))
        if args.cost:
            doc["cost"] = cost_run(args.sizes[0], args.jobs, seeds=args.cost_seeds,
                                   load=args.load, time_limit=args.time_limit)
        if args.sweep_seeds:
            doc["sweep"] = seed_sweep(args.sizes, args.sweep_seeds, args.jobs, load=args.load,
                                      time_limit=args.time_limit)
        if args.queue_ablation and "spinsearch" in REGISTRY:
            doc["queue_ablation"] = queue_ablation(args.sizes[0], args.jobs, seed=args.seed, load=args.load,
                                                   time_limit=args.time_limit)
    if (args.scale or args.scale_only) and "spinsearch" in REGISTRY:
        doc["scale"] = scale_run(args.scale_clusters, args.scale_jobs, seed=args.seed, load=args.load,
                                 budget_s=args.scale_budget)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    md = markdown(doc)
    args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    if args.plots is not None and doc["sizes"]:
        from spiderflow.sim.plots import plot_overhead_vs_clusters, plot_throughput_cost

        args.plots.mkdir(parents=True, exist_ok=True)
        rows = [{"clusters": s["clusters"], "policy": p, **v} for s in doc["sizes"] for p, v in s["policies"].items()]
        plot_overhead_vs_clusters(rows, args.plots / "overhead_vs_clusters.png")
        plot_throughput_cost(doc["sizes"][-1]["policies"], args.plots / "throughput_cost.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
