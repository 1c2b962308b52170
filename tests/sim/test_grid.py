"""The evaluation grid's statistics and ratios, and ``bench/paper.py``'s smallest cell end to end."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from spiderflow.core.sim.grid import (
    PolicySetup,
    budget_curve,
    cold_start,
    geomean_ci,
    instance_job,
    mean_ci,
    occupy,
    pair_ratios,
    ratio_summary,
    timeline_step_s,
)
from spiderflow.presets import resolve_topology

ROOT = Path(__file__).resolve().parents[2]


def _paper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_paper", ROOT / "bench" / "paper.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mean_and_geometric_mean_intervals() -> None:
    ci = mean_ci([1.0, 2.0, 3.0])
    assert ci is not None and ci.estimate == pytest.approx(2.0) and ci.n == 3
    assert ci.high - ci.estimate == pytest.approx(4.303 * 1.0 / math.sqrt(3))  # t(0.975, 2) · sd / √n
    one = mean_ci([5.0])
    assert one is not None and one.low == one.high == 5.0
    assert mean_ci([]) is None
    g = geomean_ci([2.0, 8.0, 0.0, math.inf])  # non-positive and infinite ratios are left out
    assert g is not None and g.estimate == pytest.approx(4.0) and g.n == 2 and g.low < 4.0 < g.high


def _run(jobs: dict[str, tuple[str, float | None, float | None]]) -> dict[str, Any]:
    return {"jobs": {k: {"status": s, "jct_s": j, "tps": t, "tps_timeline": t} for k, (s, j, t) in jobs.items()}}


def test_pair_ratios_compare_on_the_jobs_both_completed() -> None:
    ss = _run({"a": ("completed", 100.0, 10.0), "b": ("completed", 300.0, 20.0), "c": ("unresolvable", None, None)})
    bl = _run({"a": ("completed", 200.0, 5.0), "b": ("unschedulable", None, None), "c": ("completed", 1.0, 99.0)})
    r = pair_ratios(ss, bl)
    assert r["common"] == 1
    assert r["mean_jct_ratio"] == pytest.approx(2.0) and r["p95_jct_ratio"] == pytest.approx(2.0)
    assert r["tps_ratio"] == pytest.approx(2.0) and r["tps_timeline_ratio"] == pytest.approx(2.0)


def test_ratio_summary_takes_the_hardest_baseline_per_cell() -> None:
    runs = []
    for seed, (easy, hard) in enumerate([(400.0, 110.0), (400.0, 90.0)], 1):
        for label, jct in (("spinsearch", 100.0), ("easy", easy), ("hard", hard)):
            runs.append({"label": label, "seed": seed, "kind": "geo", **_run({"a": ("completed", jct, 1e4 / jct)})})
    (cell,) = ratio_summary(runs, group=lambda r: (r["kind"],))
    assert cell["group"] == ["geo"]
    best = cell["best_mean_jct_ratio"]
    assert best["baseline"] == "hard" and best["estimate"] == pytest.approx(math.sqrt(1.1 * 0.9))
    assert cell["baselines"]["easy"]["mean_jct_ratio"]["estimate"] == pytest.approx(4.0)
    assert cell["baselines"]["hard"]["mean_jct_ratio_min"] == pytest.approx(0.9)
    assert cell["best_tps_ratio"]["baseline"] == "hard"


def test_the_grid_summary_pairs_runs_by_trace_not_by_seed_alone() -> None:
    runs = [{"label": label, "seed": 1, "kind": kind, **_run({"a": ("completed", jct, 1.0)})}
            for kind, base in (("geo", 200.0), ("hub", 400.0)) for label, jct in (("spinsearch", 100.0), ("b", base))]
    with pytest.raises(ValueError, match="pair"):
        ratio_summary(runs, group=lambda r: ())
    (grid,) = ratio_summary(runs, group=lambda r: (), pair=lambda r: (r["kind"], r["seed"]))
    ratio = grid["baselines"]["b"]["mean_jct_ratio"]
    assert ratio["n"] == 2 and ratio["estimate"] == pytest.approx(math.sqrt(2.0 * 4.0))


def test_instances_are_deterministic_and_plans_rescored_by_the_timeline() -> None:
    topo = resolve_topology("aws-10-dtfm")
    busy = occupy(topo, 3)
    assert busy == occupy(topo, 3) and busy != occupy(topo, 4)
    assert all(topo.cluster(c.name).free // 4 <= c.free <= topo.cluster(c.name).free for c in busy.clusters)
    assert [instance_job(i).model.name for i in range(7)][::6] == [instance_job(0).model.name] * 2
    from spiderflow.core.domain import Budget
    from spiderflow.core.placement import get_policy

    job = instance_job(0)
    res = get_policy("spinsearch").place(busy, job, Budget(seed=1))
    assert res.ok and res.plan is not None
    tl = timeline_step_s(res.plan, busy, job)
    assert tl is not None and 0.3 * res.plan.step_time_s < tl < 3.0 * res.plan.step_time_s


def test_paper_bench_smallest_cell_end_to_end(tmp_path: Path) -> None:
    """The whole script on one preset, one seed, one load and two jobs: all three parts, every figure."""
    out = tmp_path / "paper.json"
    argv = ["--kinds", "aws-10-dtfm", "--seeds", "1", "--loads", "1", "--jobs", "2", "--instances", "1",
            "--large-instances", "1", "--place-policies", "spinsearch,bace", "--ilp-limit", "0.05",
            "--curve-ilp", "0.05", "--curve-genetic", "0,4", "--sim-policies", "spinsearch,firstfit", "--workers", "1",
            "--out", str(out)]
    assert _paper().main(argv) == 0
    doc = json.loads(out.read_text())
    labels = {r["label"] for r in doc["placement"]["summary"]}
    assert labels == {"spinsearch", "bace"}
    ss = {r["kind"]: r for r in doc["placement"]["summary"] if r["label"] == "spinsearch"}
    assert ss["all"]["placed"] == 2 and ss["all"]["tps_ratio"]["estimate"] == pytest.approx(1.0)
    # one instance of the trace mix and one llama3-70b, which the partly busy preset holds only across regions
    assert {r["job"]: r["set"] for r in doc["placement"]["rows"] if r["label"] == "spinsearch"} == {
        "inst-000-gpt3-1.3b": "mix", "large-005-llama3-70b": "large"}
    assert (ss["all (mix)"]["instances"], ss["all (large)"]["instances"]) == (1, 1)
    assert ss["all (large)"]["multi_cluster"] == 1
    assert [p["label"] for p in doc["curves"]["summary"]["points"]] == ["spinsearch", "ilp@0.05s", "genetic@0",
                                                                         "genetic@4"]
    runs = doc["system"]["runs"]
    assert {(r["label"], r["wait"]) for r in runs} == {(p, w) for p in ("spinsearch", "firstfit")
                                                      for w in (True, False)}
    assert all(not r["violations"] and len(r["jobs"]) == 2 for r in runs)
    assert {tuple(c["group"]) for c in doc["system"]["cells"]} == {("aws-10-dtfm", 1.0, True),
                                                                  ("aws-10-dtfm", 1.0, False)}
    assert set(doc["targets"]) >= {"wait", "no_wait", "time_to_spinsearch_quality"}
    md = out.with_suffix(".md").read_text()
    assert "## Placement only" in md and "## Full system" in md and doc["commit"] in md


def test_every_setup_starts_cold_warm_process_and_no_memo_of_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cold_start`` decides once untimed and then leaves no memoised plan; ``budget_curve`` runs it before
    every setup, so the setups' timed decisions all start from the same state (and give the same answers as
    decisions without it)."""
    from spiderflow.core.placement import load_builtin_policies
    from spiderflow.core.placement.common import plan_cache_stats
    from spiderflow.core.sim import grid
    from spiderflow.core.topogen import generate_topology

    load_builtin_policies()
    topo = generate_topology(6, 3, "geo")
    job = instance_job(1)
    setup = PolicySetup(label="spinsearch", name="spinsearch")
    cold_start(setup, topo, job, [topo])
    assert plan_cache_stats()["size"] == 0 and len(topo.memo.searches) == len(topo.memo.hops) == 0
    calls: list[str] = []
    real = grid.cold_start
    monkeypatch.setattr(grid, "cold_start", lambda s, *a: (calls.append(s.label), real(s, *a))[-1])
    setups = [setup, PolicySetup(label="greedy", name="greedy")]
    rows = budget_curve(setups, [(topo, job), (topo, instance_job(2))], seed=1)
    assert calls == ["spinsearch", "greedy"] and len(rows) == 4
    again = budget_curve(setups, [(topo, job), (topo, instance_job(2))], seed=1)
    assert [r.get("step_timeline_s") for r in rows] == [r.get("step_timeline_s") for r in again]
