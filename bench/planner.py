"""TPA planner benchmark: plan quality and planning time against the joint ILP and brute force.

Three parts (all figures from the real code on this machine; nothing is a constant):

1. ``brute``: tiny random chains (1–3 clusters, ≤ 8 layers, memory often binding). For every micro-batch
   count TPA tries, level 1 + level 2 vs the exhaustive enumeration of every layer split × every
   per-cluster (tp, pp, dp) and sub-split (tests/tpa/bruteforce.py): ratio of closed-form step times.
2. ``ilp``: ``spiderflow.core.topogen.generate_topology(n, seed=2000+n)`` for n in ``--sizes``; the joint
   CP-SAT baseline (``get_policy("ilp")``, ``--limit`` seconds) picks clusters, chain, split and degrees
   for a job needing more GPUs than the largest cluster has free (so the chain spans ≥ 2 clusters);
   TPA then plans the *same* chain and GPUs pinned to the ILP's micro-batch count and 1F1B
   (``plan_chain(..., micro_batches=[m], schedules=[1F1B])``) and unpinned. Reported: closed-form step
   ratio TPA/ILP (< 1: TPA better), exact-timeline step ratio, planning seconds of each. Skipped (with a
   note) when the ``ilp`` policy is not available.
3. ``scale``: TPA on a 64-cluster chain of 256 GPUs (4 per cluster, A100/H100-80G, 10–100 Gbit/s,
   5–80 ms links, llama3-70b, batch 512): first call (cold level-2 cache) and a repeat (warm), with the
   CP-SAT solves, CP-SAT seconds and level-2 lookups of each call (``spiderflow.core.tpa.level2.STATS``), for
   each of ``--scale-solvers``: ``exact`` (the planner's default: every block by the exact solver),
   ``cpsat`` (``level2="cpsat"``: the plan's blocks solved again with CP-SAT) and ``cpsat-search`` (the
   level-1 search scores every trial split with CP-SAT too, instead of the exact optimum).
4. ``level2``: per-call CPU time of the level-2 solvers on random blocks (``--level2`` instances, up to 32
   layers and 16 GPUs, memory often binding): CP-SAT without and with the exact hint, the exact solver,
   and a cached lookup; and the differential count CP-SAT vs the exact optimum (and vs brute force on
   the tiny blocks of the tests).

Usage::

    .venv/bin/python bench/planner.py                 # everything, ILP limit 30 s, sizes 8 16 32
    .venv/bin/python bench/planner.py --quick         # sizes 8 16, limit 10 s, 20 brute instances
    .venv/bin/python bench/planner.py --out bench/results/planner.json
    .venv/bin/python bench/planner.py --parts level2 scale --scale-solvers exact cpsat cpsat-search
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import spiderflow.core.tpa.level1 as level1_mod  # noqa: E402
from spiderflow.cli.common import check_outputs  # noqa: E402
from spiderflow.core.catalog import ModelSpec, model_preset  # noqa: E402
from spiderflow.core.costmodel import evaluate  # noqa: E402
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Schedule, Topology  # noqa: E402
from spiderflow.core.errors import SpiderFlowError  # noqa: E402
from spiderflow.core.tpa import micro_batch_candidates, plan_chain, simulate_plan  # noqa: E402
from spiderflow.core.tpa.level1 import ChainContext, level1, polish  # noqa: E402
from spiderflow.core.tpa.level2 import (  # noqa: E402
    STATS,
    brute_force_block,
    cache_clear,
    solve_block,
    solve_block_cached,
    solve_block_exact,
)
from tests.tpa.bruteforce import brute_force_chain  # noqa: E402
from tests.tpa.test_level2 import _medium, _problem  # noqa: E402

console = Console(width=220)


def _tiny(seed: int) -> tuple[Topology, JobSpec, list[tuple[str, int]]]:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4))
    model = ModelSpec(name="t", layers=int(rng.integers(n, 9)), hidden=int(rng.choice([512, 1024, 2048])), heads=8,
                      vocab=8192)
    types = ["A100-80G", "V100-16G", "T4", "H100-80G", "A10G"]
    clusters = tuple(
        Cluster(name=f"c{i}", gpu=str(rng.choice(types)), nodes=int(rng.integers(1, 3)),
                gpus_per_node=int(rng.choice([2, 4])), memory_gib=float(rng.choice([1.5, 3.0, 8.0, 80.0])))
        for i in range(n)
    )
    links = tuple(
        Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=float(rng.uniform(1, 100)), latency_ms=float(rng.uniform(0, 60)))
        for i in range(n - 1)
    )
    alloc = [(c.name, int(rng.integers(1, c.total_gpus + 1))) for c in clusters]
    m = int(rng.choice([2, 4, 8]))
    job = JobSpec(id="t", model=model, global_batch=m * int(rng.choice([1, 2])), seq_len=1024,
                  gpus=GpuRange(min=1, max=64))
    return Topology(clusters=clusters, links=links), job, alloc


def part_brute(instances: int) -> dict[str, Any]:
    ratios: list[float] = []
    t_tpa: list[float] = []
    t_bf: list[float] = []
    agree = 0
    total = 0
    for seed in range(instances):
        topo, job, alloc = _tiny(seed)
        clusters = [topo.cluster(n) for n, _ in alloc]
        for m in micro_batch_candidates(job.global_batch, len(alloc)):
            ctx = ChainContext.build(topo, clusters, [g for _, g in alloc], job.model,
                                     micro_batch=job.global_batch // m, seq_len=job.seq_len, m=m,
                                     schedule=Schedule.ONE_F_ONE_B)
            t0 = time.perf_counter()
            ref = brute_force_chain(ctx)
            t_bf.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ev = polish(ctx, level1(ctx))
            t_tpa.append(time.perf_counter() - t0)
            total += 1
            agree += ev.feasible == (ref is not None)
            if ref is not None and ev.feasible:
                ratios.append(ev.step_s / ref.step_s)
    out = {
        "cases": total, "feasibility_agrees": agree, "compared": len(ratios),
        "ratio_mean": statistics.fmean(ratios), "ratio_max": max(ratios),
        "within_1pct": sum(r <= 1.01 for r in ratios), "within_3pct": sum(r <= 1.03 for r in ratios),
        "tpa_ms_median": 1e3 * statistics.median(t_tpa), "brute_ms_median": 1e3 * statistics.median(t_bf),
        "brute_ms_max": 1e3 * max(t_bf),
    }
    table = Table(title="TPA level 1+2 vs exhaustive split × degrees (closed-form step, same m, 1F1B)")
    for k in out:
        table.add_column(k)
    table.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in out.values()))
    console.print(table)
    return out


def _job_for(n: int, topo: Topology) -> JobSpec:
    """A job that needs more GPUs than the largest cluster has free, so every plan spans ≥ 2 clusters."""
    preset = "gpt3-6.7b" if n <= 16 else "gpt3-13b"
    biggest = max(c.free for c in topo.clusters)
    return JobSpec(id=f"bench-{n}", model=model_preset(preset), global_batch=256, micro_batch=4, seq_len=2048,
                   gpus=GpuRange(min=biggest + 1, max=2 * biggest + 2))


def part_ilp(sizes: list[int], limit: float) -> list[dict[str, Any]]:
    from spiderflow.core.placement import Budget, get_policy
    from spiderflow.core.topogen import generate_topology

    try:
        ilp = get_policy("ilp")
    except SpiderFlowError as e:
        console.print(f"[yellow]ilp policy unavailable ({e}); skipping the ILP comparison[/]")
        return []
    rows: list[dict[str, Any]] = []
    for n in sizes:
        topo = generate_topology(n, seed=2000 + n)
        _ = topo.bandwidth_matrix  # widest paths once, outside every timing
        job = _job_for(n, topo)
        res = ilp.place(topo, job, Budget(time_limit_s=limit, seed=0))
        row: dict[str, Any] = {"clusters": n, "model": job.model.name, "ilp_status": str(res.status),
                               "ilp_s": res.planning_seconds, "ilp_optimal": res.optimal}
        if not res.ok or res.plan is None:
            rows.append(row)
            continue
        ip = res.plan
        alloc: list[tuple[str, int]] = []
        for st in ip.stages:
            if alloc and alloc[-1][0] == st.cluster:
                alloc[-1] = (st.cluster, alloc[-1][1] + st.gpus)
            else:
                alloc.append((st.cluster, st.gpus))
        cache_clear()
        try:
            t0 = time.perf_counter()
            pinned = plan_chain(topo, job, alloc, micro_batches=[ip.micro_batches],
                                schedules=[Schedule.ONE_F_ONE_B])
            t_pinned = time.perf_counter() - t0
            t0 = time.perf_counter()
            free = plan_chain(topo, job, alloc)
            t_free = time.perf_counter() - t0
        except SpiderFlowError as e:  # reported, not hidden: TPA found no plan where the ILP did
            row["tpa_error"] = str(e)
            rows.append(row)
            continue
        ilp_eval = evaluate(ip, topo, job)
        ilp_sim = simulate_plan(ilp_eval, topo, job, record=False).step_s
        row.update(
            chain=len(alloc), gpus=ip.gpus, m=ip.micro_batches,
            ilp_step=ilp_eval.step_time_s, ilp_sim_step=ilp_sim,
            tpa_pinned_step=pinned.step_time_s, tpa_pinned_sim=pinned.extras["timeline_step_s"],
            tpa_pinned_s=t_pinned,
            tpa_step=free.step_time_s, tpa_sim=free.extras["timeline_step_s"], tpa_s=t_free,
            tpa_schedule=free.schedule.value, tpa_m=free.micro_batches,
            ratio_pinned=pinned.step_time_s / ilp_eval.step_time_s,
            ratio_sim=free.extras["timeline_step_s"] / ilp_sim,
            speedup_pinned=res.planning_seconds / t_pinned,
        )
        rows.append(row)
    table = Table(title=f"TPA on the ILP's chain vs the joint ILP (limit {limit:g} s)")
    cols = ["clusters", "chain", "gpus", "m", "ilp_step", "tpa_pinned_step", "ratio_pinned", "tpa_step", "tpa_m",
            "ilp_sim_step", "tpa_sim", "ratio_sim", "tpa_schedule", "ilp_s", "tpa_pinned_s", "tpa_s", "speedup_pinned",
            "ilp_optimal", "tpa_error"]
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols))
    console.print(table)
    return rows


def part_level2(instances: int) -> dict[str, Any]:
    """Per-call CPU milliseconds of each level-2 solver, and how often CP-SAT's optimum differs."""
    cpu: dict[str, list[float]] = {"cpsat": [], "cpsat_hinted": [], "exact": [], "cached_lookup": []}
    mismatch = {"cpsat_vs_exact": 0, "cpsat_vs_brute": 0, "exact_vs_brute": 0}
    feasible = 0

    def same(a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is b
        return bool(abs(a.objective_s - b.objective_s) <= 1e-9 * b.objective_s)

    cache_clear()
    for seed in range(instances):
        p = _medium(np.random.default_rng(5000 + seed))
        c0 = time.process_time()
        a = solve_block(p)
        cpu["cpsat"].append(time.process_time() - c0)
        c0 = time.process_time()
        e = solve_block_exact(p)
        cpu["exact"].append(time.process_time() - c0)
        c0 = time.process_time()
        h = solve_block(p, hint=e)
        cpu["cpsat_hinted"].append(time.process_time() - c0)
        solve_block_cached(p)
        c0 = time.process_time()
        solve_block_cached(p)
        cpu["cached_lookup"].append(time.process_time() - c0)
        feasible += e is not None
        mismatch["cpsat_vs_exact"] += (not same(a, e)) + (not same(h, e))
    tiny = 0
    for seed in range(instances):
        p = _problem(np.random.default_rng(seed))
        ref = brute_force_block(p)
        tiny += 1
        mismatch["cpsat_vs_brute"] += not same(solve_block(p), ref)
        mismatch["exact_vs_brute"] += not same(solve_block_exact(p), ref)
    out: dict[str, Any] = {"medium_blocks": instances, "medium_feasible": feasible, "tiny_blocks": tiny,
                           **mismatch}
    for k, v in cpu.items():
        out[f"{k}_ms_median"] = 1e3 * statistics.median(v)
        out[f"{k}_ms_p90"] = 1e3 * float(np.percentile(v, 90))
    table = Table(title="Level-2 solvers: per-call CPU ms and optimum mismatches")
    for k in out:
        table.add_column(k)
    table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in out.values()))
    console.print(table)
    return out


def part_scale(repeats: int, solver: str = "exact") -> dict[str, Any]:
    rng = np.random.default_rng(0)
    gpus = ["A100-80G", "H100-80G"]
    clusters = tuple(Cluster(name=f"c{i}", gpu=gpus[int(rng.integers(2))], nodes=1, gpus_per_node=4)
                     for i in range(64))
    links = tuple(Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=float(rng.uniform(10, 100)),
                       latency_ms=float(rng.uniform(5, 80))) for i in range(63))
    topo = Topology(clusters=clusters, links=links)
    _ = topo.bandwidth_matrix
    job = JobSpec(id="scale", model=model_preset("llama3-70b"), global_batch=512, gpus=GpuRange(min=1, max=512))
    alloc = [(c.name, 4) for c in clusters]
    cache_clear()
    times = []
    cpu = []
    solves: list[int] = []
    solve_s: list[float] = []
    lookups: list[int] = []
    plan = None
    saved = level1_mod.block_bound_cached
    if solver == "cpsat-search":  # the level-1 search scores trial splits with CP-SAT too
        level1_mod.block_bound_cached = solve_block_cached
    try:
        for _ in range(repeats):
            n0, s0, l0 = STATS.cpsat_solves, STATS.cpsat_seconds, STATS.lookups
            t0, c0 = time.perf_counter(), time.process_time()
            plan = plan_chain(topo, job, alloc, level2="exact" if solver == "exact" else "cpsat")
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            solves.append(STATS.cpsat_solves - n0)
            solve_s.append(STATS.cpsat_seconds - s0)
            lookups.append(STATS.lookups - l0)
    finally:
        level1_mod.block_bound_cached = saved
    assert plan is not None
    out = {"clusters": 64, "solver": solver, "gpus": plan.gpus, "stages": len(plan.stages),
           "m": plan.micro_batches, "schedule": plan.schedule.value, "cold_s": times[0], "cold_cpu_s": cpu[0],
           "cold_cpsat_solves": solves[0], "cold_cpsat_s": solve_s[0], "cold_level2_lookups": lookups[0],
           "warm_s_median": statistics.median(times[1:] or times),
           "warm_cpu_s_median": statistics.median(cpu[1:] or cpu),
           "warm_cpsat_solves": solves[-1], "load_avg_1min": os.getloadavg()[0],
           "step_s": plan.step_time_s, "timeline_step_s": plan.extras["timeline_step_s"],
           "cpsat_improved_hint": STATS.cpsat_improved_hint}
    table = Table(title=f"TPA on a 64-cluster chain of 256 GPUs (llama3-70b), level 2: {solver}")
    for k in out:
        table.add_column(k)
    table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in out.values()))
    console.print(table)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--limit", type=float, default=30.0, help="ILP time limit per instance (s)")
    ap.add_argument("--brute", type=int, default=60, help="tiny instances for the brute-force comparison")
    ap.add_argument("--repeats", type=int, default=3, help="plan_chain calls on the 64-cluster chain")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", nargs="*", default=["brute", "ilp", "scale", "level2"])
    ap.add_argument("--level2", type=int, default=200, help="random blocks for the level-2 solver timings")
    ap.add_argument("--scale-solvers", choices=["exact", "cpsat", "cpsat-search"], nargs="*",
                    default=["exact", "cpsat"],
                    help="level-2 solvers of the scale part: exact (the default planner), cpsat (the plan's blocks "
                         "by CP-SAT), cpsat-search (every trial split scored by CP-SAT too)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    check_outputs(ap, {"--out": args.out})
    if args.quick:
        args.sizes, args.limit, args.brute = [8, 16], 10.0, 20
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    report: dict[str, Any] = {}
    if "brute" in args.parts:
        report["brute"] = part_brute(args.brute)
    if "ilp" in args.parts:
        report["ilp"] = part_ilp(args.sizes, args.limit)
    if "scale" in args.parts:
        report["scale"] = [part_scale(args.repeats, solver) for solver in args.scale_solvers]
    if "level2" in args.parts:
        report["level2"] = part_level2(args.level2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
