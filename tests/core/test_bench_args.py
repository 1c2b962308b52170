"""Benchmark scripts reject bad lists of integers with a usage error (exit 2) naming the argument."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from spiderflow.cli.common import csv_ints
from spiderflow.placement.common import LocalPlanner
from spiderflow.placement.spinsearch import SpinSearch

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_csv_ints_parses_and_skips_empty_items() -> None:
    assert csv_ints(minimum=1)(" 8, 16,,32 ") == [8, 16, 32]
    assert csv_ints(minimum=0)("") == []


@pytest.mark.parametrize(("text", "why"), [("8,x", "'x' is not an integer"), ("0", "0 is below the minimum 1")])
def test_csv_ints_names_the_bad_item(text: str, why: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        csv_ints(minimum=1)(text)


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("paper", ["--sizes", "8,x"], "argument --sizes: 'x' is not an integer"),
    ("paper", ["--sizes", ","], "argument --sizes: give at least one cluster count"),
    ("paper", ["--cost-seeds", "-1"], "argument --cost-seeds: -1 is below the minimum 0"),
    ("paper", ["--repeats", "0"], "argument --repeats: must be ≥ 1 (got 0)"),
    ("paper", ["--repeats", "2", "--overhead", "fixed"], "argument --repeats: repeats apply to --overhead measured"),
    ("paired_overhead", ["--sizes", "0"], "argument --sizes: 0 is below the minimum 1"),
    ("paired_overhead", ["--policies", "ilp,nope"], "argument --policies: unknown nope"),
    ("placement", ["--sizes", "a"], "argument --sizes: 'a' is not an integer"),
    ("timeline", ["--sizes", "8"], "argument --sizes: 8 is below the minimum 16"),
    ("timeline", ["--sizes", "100"], "argument --sizes: each must be a multiple of 16"),
    ("timeline", ["--instances", "1"], "argument --instances: at least one per size (3)"),
    # outputs are checked before a run of up to half an hour, not when it ends
    ("paper", ["--out", str(ROOT / "bench")], f"--out: {ROOT / 'bench'} is a directory"),
    ("paper", ["--plots", str(ROOT / "README.md")], f"--plots: {ROOT / 'README.md'} exists and is not a directory"),
    ("paired_overhead", ["--out", str(ROOT / "bench")], f"--out: {ROOT / 'bench'} is a directory"),
    ("placement", ["--out", str(ROOT / "bench")], f"--out: {ROOT / 'bench'} is a directory"),
    ("planner", ["--out", str(ROOT / "bench")], f"--out: {ROOT / 'bench'} is a directory"),
])
def test_bench_scripts_exit_2_on_bad_lists(script: str, argv: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _script(script).main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_overhead_repeats_ratio_of_means_and_run_by_run_range() -> None:
    paper = _script("paper")
    runs = {
        "spinsearch": [{"decisions": 10, "per_decision_s": 0.01, "total_s": 0.1},
                       {"decisions": 10, "per_decision_s": 0.03, "total_s": 0.3}],
        "ilp": [{"decisions": 10, "per_decision_s": 0.5, "total_s": 5.0},
                {"decisions": 20, "per_decision_s": 0.3, "total_s": 6.0}],
    }
    out = paper.overhead_repeats(runs)
    assert out["runs"] is runs and "genetic" not in out
    ilp = out["ilp"]
    assert ilp["per_decision_ratio_of_means"] == pytest.approx(0.4 / 0.02)
    assert ilp["total_ratio_of_means"] == pytest.approx(5.5 / 0.2)
    assert (ilp["per_decision_ratio_min"], ilp["per_decision_ratio_max"]) == pytest.approx((10.0, 50.0))
    assert (ilp["total_ratio_min"], ilp["total_ratio_max"]) == pytest.approx((20.0, 50.0))


def test_overhead_repeats_also_against_the_run_without_tpa() -> None:
    paper = _script("paper")
    runs = {
        "spinsearch": [{"decisions": 10, "per_decision_s": 0.01, "total_s": 0.1}],
        paper.WITHOUT_TPA: [{"decisions": 20, "per_decision_s": 0.004, "total_s": 0.08}],
        "genetic": [{"decisions": 40, "per_decision_s": 0.2, "total_s": 8.0}],
    }
    out = paper.overhead_repeats(runs)
    assert out["genetic"]["per_decision_ratio_of_means"] == pytest.approx(20.0)
    assert out[paper.WITHOUT_TPA]["genetic"]["per_decision_ratio_of_means"] == pytest.approx(50.0)
    assert out[paper.WITHOUT_TPA]["genetic"]["total_ratio_of_means"] == pytest.approx(100.0)
    assert "ilp" not in out[paper.WITHOUT_TPA]
    md = paper.markdown({"command": "c", "machine": "m", "budgets": {}, "sizes": [
        {"clusters": 8, "jobs": 1, "policies": {}, "ratios": {}, "common_completed": 0, "overhead_repeats": out}]})
    assert "| 8 | 1 | 0.004 (without TPA) | genetic | 0.2 | 50 (50–50) | 100 (100–100) |" in md


def test_overhead_repeats_also_against_the_run_with_cpsat_level2() -> None:
    paper = _script("paper")
    runs = {
        "spinsearch": [{"decisions": 10, "per_decision_s": 0.01, "total_s": 0.1}],
        paper.CPSAT_LEVEL2: [{"decisions": 10, "per_decision_s": 0.0125, "total_s": 0.125}],
        "ilp": [{"decisions": 10, "per_decision_s": 0.25, "total_s": 2.5}],
    }
    out = paper.overhead_repeats(runs)
    assert out["ilp"]["per_decision_ratio_of_means"] == pytest.approx(25.0)
    assert out[paper.CPSAT_LEVEL2]["ilp"]["per_decision_ratio_of_means"] == pytest.approx(20.0)
    assert paper.WITHOUT_TPA not in out
    md = paper.markdown({"command": "c", "machine": "m", "budgets": {}, "sizes": [
        {"clusters": 8, "jobs": 1, "policies": {}, "ratios": {}, "common_completed": 0, "overhead_repeats": out}]})
    assert "| 8 | 1 | 0.0125 (CP-SAT level 2) | ilp | 0.25 | 20 (20–20) | 20 (20–20) |" in md
    variant = paper._policy(paper.CPSAT_LEVEL2)
    assert isinstance(variant, SpinSearch) and variant.planner == LocalPlanner(level2="cpsat")


def test_without_tpa_compares_jct_on_the_jobs_both_completed_and_overhead_against_the_baselines() -> None:
    paper = _script("paper")

    class Rec:
        def __init__(self, status: str, jct: float | None) -> None:
            self.status, self.jct_s = status, jct

    summary = {"completed": 2, "mean_jct_s": 150.0, "p95_jct_s": 200.0, "throughput_tokens_per_s": 1.0,
               "decisions": 4, "overhead_per_decision_mean_s": 0.005, "cpu_per_decision_mean_s": 0.005,
               "sched_overhead_s": 0.02, "gpu_utilization": 0.5}
    mine = {"a": Rec("completed", 120.0), "b": Rec("completed", 180.0), "c": Rec("failed", None)}
    full = {"a": Rec("completed", 100.0), "b": Rec("failed", None), "c": Rec("completed", 50.0)}
    pol = {"spinsearch": {**summary, "overhead_per_decision_mean_s": 0.01, "sched_overhead_s": 0.04},
           "ilp": {**summary, "overhead_per_decision_mean_s": 0.3, "cpu_per_decision_mean_s": 0.6,
                   "sched_overhead_s": 1.5}}
    out = paper.without_tpa(summary, mine, pol, {"spinsearch": full, "ilp": {}})
    assert out["common_with_spinsearch"] == 1 and out["jct_vs_spinsearch"] == pytest.approx(1.2)
    assert out["ratios"] == pytest.approx({"overhead_ratio_ilp": 60.0, "total_overhead_ratio_ilp": 75.0,
                                           "cpu_ratio_ilp": 120.0})


def test_paired_overhead_groups_the_same_instances_by_both_outcomes() -> None:
    paired = _script("paired_overhead")
    ilp = [(2.0, 2.0, "unschedulable:memory"), (0.3, 0.6, "success"), (0.5, 1.0, "success"), (0.2, 0.4, "success")]
    ss = [(0.001, 0.001, "unschedulable:memory"), (0.02, 0.02, "success"), (0.01, 0.01, "success"),
          (0.004, 0.004, "unschedulable:deferred")]
    groups = paired.by_outcome(ilp, ss)
    assert [(g["policy_outcome"], g["spinsearch_outcome"], g["instances"]) for g in groups] == [
        ("unschedulable:memory", "unschedulable:memory", 1), ("success", "success", 2),
        ("success", "unschedulable:deferred", 1)]
    placed = groups[1]
    assert placed["mean_s"] == pytest.approx(0.4) and placed["spinsearch_mean_s"] == pytest.approx(0.015)
    assert placed["share"] == pytest.approx(0.8 / 3.0) and placed["spinsearch_share"] == pytest.approx(0.03 / 0.035)
    assert sum(g["share"] for g in groups) == pytest.approx(1.0)
    assert sum(g["spinsearch_share"] for g in groups) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        paired.by_outcome(ilp, ss[:3])  # not the same instances


def test_timeline_bench_compares_the_extrapolation_with_the_full_simulation(tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    assert _script("timeline").main(["--instances", "4", "--sizes", "256,512", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["by_m"]
    assert set(rows) == {"256", "512"}
    for r in rows.values():
        assert 0 <= r["extrapolated"] <= r["pipelines"] <= 2  # two drawn per size
        assert r["max_rel_diff"] <= 1e-12
