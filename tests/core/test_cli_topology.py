"""`spiderflow topology validate`: summary and exit 0 for valid files; one line and exit 2 otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spiderflow.cli.main", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_validate_prints_summary() -> None:
    r = run("topology", "validate", "examples/topology-3.yaml", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["clusters"] == 3 and s["gpus"] == 40 and s["links"] == 3 and s["components"] == 1
    assert s["gpus_by_type"] == {"A100-80G": 16, "H100-80G": 8, "V100-32G": 16}
    r = run("topology", "validate", "examples/topology-3.yaml")
    assert r.returncode == 0 and "connected components" in r.stdout


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"clusters": [{"name": "a", "gpu": "T4", "nodes": 1, "gpus_per_node": 1}],
          "links": [{"a": "a", "b": "zz", "bandwidth_gbps": 1, "latency_ms": 1}]}, "links[0].b"),
        ({"clusters": [{"name": "a", "gpu": "T4", "nodes": 1, "gpus_per_node": 1},
                       {"name": "b", "gpu": "T4", "nodes": 1, "gpus_per_node": 1}],
          "links": [{"a": "a", "b": "b", "bandwidth_gbps": -3, "latency_ms": 1}]}, "links[0].bandwidth_gbps"),
        ({"clusters": [{"name": "a", "gpu": "Z9", "nodes": 1, "gpus_per_node": 1}]}, "'Z9'"),
    ],
)
def test_validate_rejects_with_one_line(tmp_path: Path, doc: dict[str, object], needle: str) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps(doc))
    r = run("topology", "validate", str(f))
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in r.stderr


def test_bad_arguments_exit_2() -> None:
    assert run("topology", "nonsense").returncode == 2
    assert run("no-such-command").returncode == 2


@pytest.mark.parametrize("argv", [["topology"], ["topology", "validate"], ["plan", "--gpus", "x"],
                                  ["jobs", "--state", "BOGUS"], ["status"], ["no-such-command"]])
def test_usage_errors_are_one_line_exit_2(argv: list[str]) -> None:
    r = run(*argv)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: spiderflow"), r.stderr
