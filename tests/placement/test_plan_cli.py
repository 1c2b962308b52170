"""``spiderflow plan`` through ``spiderflow.cli.main.main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spiderflow.cli.main import main
from spiderflow.core.topogen import generate_topology
from spiderflow.formats import topology_to_dict


@pytest.fixture
def topo_file(tmp_path: Path) -> Path:
    path = tmp_path / "topo.json"
    topo = generate_topology(3, 2)
    topo = topo.with_free({c.name: min(c.free, 8) for c in topo.clusters})  # small enough for bruteforce
    path.write_text(json.dumps(topology_to_dict(topo)))
    return path


def test_plan_on_a_bundled_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", "aws-10-dtfm", "--model", "gpt3-1.3b", "--gpus", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sum(s["gpus"] for s in doc["stages"]) == 16
    assert main(["plan", "--topology", "no-such-preset", "--model", "gpt3-1.3b", "--gpus", "16"]) == 2
    assert "neither a file nor a preset" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["spinsearch", "firstfit", "bace", "bruteforce"])
def test_plan_json(topo_file: Path, policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--topology", str(topo_file), "--model", "gpt3-1.3b", "--gpus", "8:24",
                 "--policy", policy, "--global-batch", "64", "--seq-len", "1024", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads(out)
    for key in ("policy", "planning_seconds", "step_time_s", "throughput_tokens_per_s", "optimal", "stages",
                "micro_batches", "schedule", "memory_gib_per_gpu", "usd_per_step"):
        assert key in doc
    assert doc["policy"] == policy
    assert doc["planning_seconds"] > 0
    assert doc["optimal"] is (True if policy == "bruteforce" else None)
    assert doc["stages"][0]["first_layer"] == 0 and doc["stages"][-1]["last_layer"] == 23
    assert 8 <= sum(s["gpus"] for s in doc["stages"]) <= 24
    for s in doc["stages"]:
        assert s["gpus"] == s["tp"] * s["dp"]
    assert doc["throughput_tokens_per_s"] == pytest.approx(64 * 1024 / doc["step_time_s"])


def test_plan_table(topo_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--topology", str(topo_file), "--model", "gpt3-1.3b", "--gpus", "8",
                 "--policy", "firstfit", "--objective", "cost"])
    out = capsys.readouterr().out
    assert code == 0
    assert "tokens/s" in out and "firstfit" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "0"],
        ["--gpus", "8:4"],
        ["--gpus", "lots"],
        ["--model", "gpt-99"],
        ["--policy", "nope"],
        ["--objective", "speed"],
        ["--level2", "gurobi"],
        ["--time-limit", "-1"],
        ["--global-batch", "7", "--micro-batch", "2"],
    ],
)
def test_bad_arguments_exit_2(topo_file: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--topology": str(topo_file), "--model": "gpt3-1.3b", "--gpus": "8"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    argv = ["plan", *[x for kv in base.items() for x in kv]]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse choices
        code = int(e.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err


def test_missing_topology_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--topology", str(tmp_path / "none.json"), "--model", "gpt3-1.3b", "--gpus", "8"])
    assert code == 2
    assert "no such file" in capsys.readouterr().err


def test_unschedulable_exits_1_naming_the_constraint(topo_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--topology", str(topo_file), "--model", "gpt3-1.3b", "--gpus", "100000"])
    assert code == 1
    err = capsys.readouterr().err
    assert "gpus.min" in err and len(err.strip().splitlines()) == 1


def test_bruteforce_refuses_large_topology(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(topology_to_dict(generate_topology(9, 1))))
    code = main(["plan", "--topology", str(path), "--model", "gpt3-1.3b", "--gpus", "8", "--policy", "bruteforce"])
    assert code == 2
    assert "at most 6" in capsys.readouterr().err


def test_gantt_without_renderer_or_with_it(topo_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    out = tmp_path / "g.png"
    code = main(["plan", "--topology", str(topo_file), "--model", "gpt3-1.3b", "--gpus", "8", "--policy",
                 "firstfit", "--gantt", str(out), "--json"])
    if importlib.util.find_spec("spiderflow.viz") is None:
        assert code == 2
        assert "gantt" in capsys.readouterr().err.lower()
    else:
        assert code == 0
        assert out.exists()


def test_plan_with_the_cpsat_level2_solver(topo_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import spiderflow.core.tpa.level2 as l2
    from spiderflow.core.placement.common import plan_cache_clear

    plan_cache_clear()
    l2.cache_clear()
    assert main(["plan", "--topology", str(topo_file), "--model", "gpt3-1.3b", "--gpus", "8:24", "--json",
                 "--level2", "cpsat"]) == 0
    cpsat = json.loads(capsys.readouterr().out)
    assert l2.STATS.cpsat_solves > 0
    assert main(["plan", "--topology", str(topo_file), "--model", "gpt3-1.3b", "--gpus", "8:24", "--json"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert exact["stages"] == cpsat["stages"]
