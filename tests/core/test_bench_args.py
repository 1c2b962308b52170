"""Benchmark scripts reject bad lists of integers with a usage error (exit 2) naming the argument."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from spiderflow.cli.common import csv_ints

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
    ("paper", ["--seeds", "1,x"], "argument --seeds: 'x' is not an integer"),
    ("paper", ["--seeds", "0"], "argument --seeds: 0 is below the minimum 1"),
    ("paper", ["--kinds", "geo,nope"], "argument --kinds: unknown nope"),
    ("paper", ["--loads", "0.5,0"], "argument --loads: '0.5,0': give positive numbers"),
    ("paper", ["--jobs", "0"], "argument --jobs: must be ≥ 1 (got 0)"),
    ("paper", ["--large-instances", "-1"], "argument --large-instances: must be ≥ 0 (got -1)"),
    ("paper", ["--sim-policies", "spinsearch,nope"], "argument --sim-policies: unknown nope"),
    ("paper", ["--parts", "placement,nope"], "argument --parts: unknown nope"),
    ("paper", ["--gpu-price", "-1"], "argument --gpu-price: must be a finite number ≥ 0"),
    ("paired_overhead", ["--sizes", "0"], "argument --sizes: 0 is below the minimum 1"),
    ("paired_overhead", ["--policies", "ilp,nope"], "argument --policies: unknown nope"),
    ("placement", ["--sizes", "a"], "argument --sizes: 'a' is not an integer"),
    ("timeline", ["--sizes", "8"], "argument --sizes: 8 is below the minimum 16"),
    ("timeline", ["--sizes", "100"], "argument --sizes: each must be a multiple of 16"),
    ("timeline", ["--instances", "1"], "argument --instances: at least one per size (3)"),
    # outputs are checked before a run of up to half an hour, not when it ends
    ("paper", ["--out", str(ROOT / "bench")], f"--out: {ROOT / 'bench'} is a directory"),
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


def _run(label: str, seed: int, jct: float, tps: float) -> dict[str, object]:
    jobs = {"j": {"status": "completed", "jct_s": jct, "tps": tps, "tps_timeline": tps}}
    return {"label": label, "kind": "geo", "load": 1.0, "seed": seed, "wait": True, "jobs": jobs, "completed": 1,
            "decisions": 1, "decision_wall_s": 0.01, "decision_cpu_s": 0.01, "run_cpu_s": 0.1}


def test_pair_runs_pairs_one_outputs_spinsearch_with_anothers_baselines(tmp_path: Path) -> None:
    base, mine, out = tmp_path / "base.json", tmp_path / "mine.json", tmp_path / "paired.json"
    base.write_text(json.dumps({"system": {"runs": [_run("spinsearch", 1, 100.0, 1.0), _run("bace", 1, 200.0, 1.0),
                                                    _run("spinsearch", 2, 100.0, 1.0), _run("bace", 2, 200.0, 1.0)]}}))
    mine.write_text(json.dumps({"system": {"runs": [_run("spinsearch", s, 50.0, 2.0) for s in (1, 2)]}}))
    assert _script("pair_runs").main(["--baselines", str(base), "--out", str(out), str(mine)]) == 0
    grid = json.loads(out.read_text())["grid"][0]["baselines"]["bace"]
    assert grid["seeds"] == 2 and grid["mean_jct_ratio"]["estimate"] == pytest.approx(4.0)
    assert grid["tps_ratio"]["estimate"] == pytest.approx(2.0)
    with pytest.raises(SystemExit):  # the same trace twice
        _script("pair_runs").main(["--baselines", str(base), "--out", str(out), str(mine), str(mine)])
