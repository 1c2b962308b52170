r"""The evaluation grid of ``bench/paper.py`` as pure computation: paired placement decisions, full-system
simulations, plans re-scored by the exact timeline, and the statistics that summarise them.

Two views of every policy, on the same topologies:

- **Placement only** (:func:`decide`): one policy decides one instance (a topology snapshot and a job, no
  queue, no releases); the answer's plan is scored twice, by the closed form every policy optimises
  (``plan.step_time_s``, :func:`spiderflow.core.costmodel.evaluate`) and by the exact event-level timeline of
  one step (:func:`spiderflow.core.tpa.timeline.simulate_plan`), and the decision's wall and process CPU time are
  measured. Every policy decides exactly the same instances (paired), so the ratio of mean times is the
  ratio of the total overheads of the same decisions. :func:`budget_curve` runs one policy at several
  budgets (``ilp``'s time limit, ``genetic``'s trials) on the same instances: quality against time.
- **Full system** (:func:`run_system`): one policy simulates one trace
  (:func:`spiderflow.core.sim.engine.simulate`, the scheduling cycle the service runs) with waiting for releases
  on and off (the cycle offers it to every policy), with a fixed overhead per decision so a run is a pure
  function of its inputs — except where a policy stops on wall-clock time (``ilp``'s CP-SAT limit): its
  answers, and so its trajectory, may differ from run to run. Each job's plan (the last it ran on) is
  re-scored by the timeline as above.

Statistics: :func:`mean_ci` (Student-t 95% interval of a mean) and :func:`geomean_ci` (the same on
logarithms, exponentiated: ratios are summarised by geometric means). :func:`ratio_summary` compares
SpinSearch with each baseline per cell: a ratio per seed on the jobs both completed (JCT: baseline /
SpinSearch, > 1 when SpinSearch is better; plan throughput: SpinSearch / baseline), then the geometric
mean over the seeds with its interval; the cell's *best baseline* is the one with the smallest ratio (the
hardest competitor in that cell).

Pure: no I/O; the only clocks read are the decision timers (wall and process CPU time).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spiderflow.core.catalog import model_preset
from spiderflow.core.cycle import CycleResult, Outcome
from spiderflow.core.domain import Budget, GpuRange, JobSpec, Plan, Topology
from spiderflow.core.errors import SpiderFlowError
from spiderflow.core.placement import clear_memos
from spiderflow.core.placement.base import PlacementPolicy
from spiderflow.core.placement.options import SearchOptions, make_policy
from spiderflow.core.sim.engine import OverheadMode, SimConfig, simulate
from spiderflow.core.sim.metrics import percentile
from spiderflow.core.sim.tracegen import MODEL_MIX, SEQ_LEN
from spiderflow.core.tpa.timeline import result_on_timeline, simulate_plan

__all__ = [
    "RATIO_KEYS",
    "REFERENCE",
    "Interval",
    "PolicySetup",
    "budget_curve",
    "decide",
    "geomean_ci",
    "instance_job",
    "mean_ci",
    "occupy",
    "pair_ratios",
    "ratio_summary",
    "run_system",
    "timeline_step_s",
]

REFERENCE = "spinsearch"
"""The policy every ratio compares against the baselines."""

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
"""Two-sided 95% Student-t quantiles for 1–30 degrees of freedom (1.96 beyond)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """An estimate with its 95% confidence interval over ``n`` samples (``low == high`` for ``n = 1``)."""

    estimate: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict[str, float | int]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n}


def mean_ci(xs: Sequence[float]) -> Interval | None:
    """Mean of ``xs`` with the Student-t 95% interval; ``None`` for no values."""
    if not xs:
        return None
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return Interval(estimate=m, low=m, high=m, n=len(xs))
    t = _T975[len(xs) - 2] if len(xs) - 1 <= len(_T975) else 1.96
    h = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return Interval(estimate=m, low=m - h, high=m + h, n=len(xs))


def geomean_ci(ratios: Sequence[float]) -> Interval | None:
    """Geometric mean of positive ``ratios`` with the 95% interval of :func:`mean_ci` on their logarithms;
    ``None`` when there is no positive finite ratio (others are left out)."""
    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    ci = mean_ci(logs)
    if ci is None:
        return None
    return Interval(estimate=math.exp(ci.estimate), low=math.exp(ci.low), high=math.exp(ci.high), n=ci.n)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySetup:
    """One policy as a grid runs it: ``label`` names it in the results, ``name`` is the registered policy,
    ``options`` its search budget (:class:`~spiderflow.core.placement.options.SearchOptions`) and
    ``time_limit_s`` its wall-clock limit per decision (``None``: none)."""

    label: str
    name: str
    options: SearchOptions = field(default_factory=SearchOptions)
    time_limit_s: float | None = None

    def build(self) -> PlacementPolicy:
        return make_policy(self.name, self.options)

    def describe(self) -> str:
        parts = [self.name]
        if self.options.trials is not None:
            parts.append(f"trials {self.options.trials}")
        if self.options.population is not None:
            parts.append(f"population {self.options.population}")
        if self.options.hint is not None:
            parts.append(f"hint {self.options.hint}")
        parts.append("no time limit" if self.time_limit_s is None else f"limit {self.time_limit_s:g} s")
        return ", ".join(parts)


def instance_job(index: int, *, steps: int = 1000) -> JobSpec:
    """The ``index``-th job of the placement instances: the models of
    :data:`~spiderflow.core.sim.tracegen.MODEL_MIX` in turn, each with its GPU range, batch and micro-batch."""
    name, _, gmin, gmax, batch, micro = MODEL_MIX[index % len(MODEL_MIX)]
    return JobSpec(id=f"inst-{index:03d}-{name}", model=model_preset(name), global_batch=batch, micro_batch=micro,
                   seq_len=SEQ_LEN, steps=steps, gpus=GpuRange(min=gmin, max=gmax))


def occupy(topo: Topology, seed: int, *, low: float = 0.25) -> Topology:
    """``topo`` with each cluster's free GPUs drawn uniformly between ``low`` × and all of its free GPUs
    (a seeded ``numpy.random.Generator``): a partly busy pool for the bundled presets, which list only
    idle clusters."""
    rng = np.random.default_rng(seed)
    free = {c.name: int(rng.integers(math.ceil(low * c.free), c.free + 1)) if c.free else 0 for c in topo.clusters}
    return topo.with_free(free)


def timeline_step_s(plan: Plan, topo: Topology, job: JobSpec) -> float | None:
    """The plan's step time in the exact timeline (``None`` if the timeline cannot run it)."""
    try:
        return float(simulate_plan(plan, topo, job, record=False).step_s)
    except (SpiderFlowError, ValueError):
        return None


def decide(policy: PlacementPolicy, topo: Topology, job: JobSpec, budget: Budget) -> dict[str, Any]:
    """One timed decision: ``status``, ``wall_s``/``cpu_s`` of ``place``, and for a plan its GPUs, chain,
    closed-form and timeline step and tokens/s (``tps``, ``tps_timeline``) and the policy's search
    statistics (``stats``: trials, bound, gap, ...)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    try:
        res = policy.place(topo, job, budget)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        res = result_on_timeline(res, topo, job)
        status, plan, stats, reason = res.status.value, res.plan if res.ok else None, dict(res.stats), res.reason
    except SpiderFlowError as e:
        status, plan, stats, reason = "error", None, {}, str(e)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
    out: dict[str, Any] = {"status": status, "wall_s": wall, "cpu_s": cpu, "stats": stats}
    if plan is None:
        out["reason"] = reason
        return out
    tl = timeline_step_s(plan, topo, job)
    closed = plan.extras.get("closed_form_step_s", plan.step_time_s)
    out.update(gpus=plan.gpus, chain=list(plan.chain), step_s=closed,
               tps=job.tokens_per_step / closed, step_timeline_s=tl,
               tps_timeline=job.tokens_per_step / tl if tl else None)
    return out


WARMUP_LIMIT_S = 0.5
"""Time limit of :func:`cold_start`'s untimed decision (enough for a solver's start-up, not its search)."""


def cold_start(setup: PolicySetup, topo: Topology, job: JobSpec, topologies: Sequence[Topology]) -> None:
    """Put the process where each policy's timed decisions start from: ``setup``'s policy decides ``job`` on
    ``topo`` once, untimed (the process's one-time costs: compiled kernels loaded, modules imported, a
    solver's start-up; limit :data:`WARMUP_LIMIT_S`), then every memo is cleared
    (:func:`spiderflow.core.placement.clear_memos` with ``topologies``). So the first policy of a run does not
    pay the process's start-up for the others, and no policy's decisions are warmed by the memos (plans, level-2
    solves, timelines) an earlier policy left."""
    limit = WARMUP_LIMIT_S if setup.time_limit_s is None else min(setup.time_limit_s, WARMUP_LIMIT_S)
    decide(setup.build(), topo, job, Budget(time_limit_s=limit, seed=0))
    clear_memos(topo, *topologies)


def budget_curve(setups: Sequence[PolicySetup], instances: Sequence[tuple[Topology, JobSpec]], *,
                 seed: int) -> list[dict[str, Any]]:
    """Every setup decides every instance (in order; one policy object per setup), each setup from a cold
    start (:func:`cold_start` on the first instance): rows of ``label``, ``instance`` index and the
    :func:`decide` figures."""
    rows: list[dict[str, Any]] = []
    for s in setups:
        if instances:
            cold_start(s, *instances[0], [t for t, _ in instances])
        policy = s.build()
        for i, (topo, job) in enumerate(instances):
            d = decide(policy, topo, job, Budget(time_limit_s=s.time_limit_s, seed=seed * 1000003 + i))
            rows.append({"label": s.label, "instance": i, **d})
    return rows


def run_system(topo: Topology, trace: Sequence[JobSpec], setup: PolicySetup, *, seed: int, wait: bool,
               fixed_overhead_s: float = 0.01) -> dict[str, Any]:
    """Simulate ``trace`` with ``setup``'s policy, waiting for releases on or off, fixed overhead per
    decision. Per job (completed or not): ``status``, ``jct_s``, and for the last plan it ran on the
    closed-form and timeline tokens/s (``tps``, ``tps_timeline``); per run: decisions, their measured wall
    and CPU time, makespan, system throughput and the run's own wall and CPU time."""
    placed: dict[str, Plan] = {}

    def on_cycle(res: CycleResult) -> None:
        for d in res.decisions:
            if d.tried and d.outcome is Outcome.PLACE and d.plan is not None:
                placed[d.job_id] = d.plan

    cfg = SimConfig(seed=seed, time_limit_s=setup.time_limit_s, overhead=OverheadMode.FIXED,
                    fixed_overhead_s=fixed_overhead_s, releases=wait)
    c0 = time.process_time()
    t0 = time.perf_counter()
    res = simulate(topo, trace, setup.build(), cfg, on_cycle=on_cycle)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    specs = {j.id: j for j in trace}
    jobs: dict[str, dict[str, Any]] = {}
    tokens = 0.0
    for r in res.records:
        row: dict[str, Any] = {"status": r.status, "jct_s": r.jct_s}
        plan = placed.get(r.id)
        if plan is not None:
            job = specs[r.id]
            tl = timeline_step_s(plan, topo, job)
            row.update(tps=job.tokens_per_step / plan.step_time_s,
                       tps_timeline=job.tokens_per_step / tl if tl else None)
        if r.status == "completed":
            tokens += r.tokens
        jobs[r.id] = row
    makespan = max(0.0, res.last_end_s - res.first_arrival_s)
    return {
        "label": setup.label, "wait": wait, "jobs": jobs,
        "completed": sum(1 for r in res.records if r.status == "completed"),
        "decisions": len(res.decision_overheads_s),
        "decision_wall_s": float(sum(res.decision_overheads_s)),
        "decision_cpu_s": float(sum(res.decision_cpu_s)),
        "makespan_s": makespan, "throughput_tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "run_wall_s": wall, "run_cpu_s": cpu, "violations": list(res.violations),
    }


def _jct_stats(jcts: Sequence[float]) -> dict[str, float | None]:
    return {"mean_jct_s": statistics.fmean(jcts) if jcts else None,
            "median_jct_s": statistics.median(jcts) if jcts else None,
            "p95_jct_s": percentile(list(jcts), 95)}


def pair_ratios(ref: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, float | int | None]:
    """SpinSearch's run ``ref`` against a baseline's run ``other`` of the same trace, on the jobs both
    completed (``common``): mean / median / p95 JCT ratios (baseline ÷ SpinSearch) and per-job plan
    throughput ratios (SpinSearch ÷ baseline, closed form and timeline: mean tokens/s over the common
    jobs); ``None`` where undefined."""
    a, b = ref["jobs"], other["jobs"]
    common = sorted(k for k in a if a[k]["status"] == "completed" and b.get(k, {}).get("status") == "completed")
    out: dict[str, float | int | None] = {"common": len(common)}
    sa = _jct_stats([a[k]["jct_s"] for k in common])
    sb = _jct_stats([b[k]["jct_s"] for k in common])
    for key in ("mean_jct_s", "median_jct_s", "p95_jct_s"):
        x, y = sa[key], sb[key]
        out[key.replace("_s", "_ratio")] = y / x if x and y else None
    for key in ("tps", "tps_timeline"):
        xs = [a[k].get(key) for k in common]
        ys = [b[k].get(key) for k in common]
        if common and all(xs) and all(ys):
            out[f"{key}_ratio"] = statistics.fmean(xs) / statistics.fmean(ys)
        else:
            out[f"{key}_ratio"] = None
    return out


RATIO_KEYS = ("mean_jct_ratio", "median_jct_ratio", "p95_jct_ratio", "tps_ratio", "tps_timeline_ratio")


def ratio_summary(runs: Sequence[Mapping[str, Any]], *, group: Callable[[Mapping[str, Any]], tuple[Any, ...]],
                  pair: Callable[[Mapping[str, Any]], tuple[Any, ...]] = lambda r: (r["seed"],),
                  reference: str = REFERENCE) -> list[dict[str, Any]]:
    """Per group of runs (``group(run)``, e.g. topology, load, wait): each baseline's :func:`pair_ratios`
    against ``reference`` on every trace of the group (``pair(run)`` identifies the trace within the group,
    by default the seed; it must not include the policy), their geometric means with 95% intervals
    (:func:`geomean_ci`), and the group's best baseline (smallest mean-JCT and plan-throughput ratio).
    ``runs`` carry ``label`` and ``seed`` beside :func:`run_system`'s figures."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in runs:
        groups.setdefault(group(r), []).append(r)
    out: list[dict[str, Any]] = []
    for key, rs in groups.items():
        by_seed: dict[tuple[Any, ...], dict[str, Mapping[str, Any]]] = {}
        for r in rs:
            runs_of = by_seed.setdefault(pair(r), {})
            if str(r["label"]) in runs_of:
                raise ValueError(f"two runs of {r['label']} on the trace {pair(r)}: pair() must identify the trace")
            runs_of[str(r["label"])] = r
        baselines = sorted({str(r["label"]) for r in rs} - {reference})
        per: dict[str, Any] = {}
        for b in baselines:
            pairs = [pair_ratios(s[reference], s[b]) for s in by_seed.values() if reference in s and b in s]
            agg: dict[str, Any] = {"seeds": len(pairs), "common": [p["common"] for p in pairs]}
            for k in RATIO_KEYS:
                vals = [float(v) for p in pairs if (v := p[k]) is not None]
                ci = geomean_ci(vals)
                agg[k] = None if ci is None else ci.to_dict()
                agg[k + "_min"] = min(vals) if vals else None
            per[b] = agg
        row: dict[str, Any] = {"group": list(key), "baselines": per}
        for k in ("mean_jct_ratio", "tps_ratio", "tps_timeline_ratio"):
            scored = [(v[k]["estimate"], b) for b, v in per.items() if v.get(k)]
            if scored:
                _, b = min(scored)
                row[f"best_{k}"] = {"baseline": b, **per[b][k]}
        out.append(row)
    return out
