"""The placement-constraint options of ``submit``, ``plan`` and ``up``: ``--gpus TYPE:N``, ``--gpu-type``,
``--cluster``/``--exclude-cluster``, ``--region``/``--exclude-region``; bad values end with one line and
exit 2 before anything is contacted or started."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from spiderflow.cli.commands import jobs, up
from spiderflow.cli.main import build_parser, main
from spiderflow.mesh import sample_topology

ROOT = Path(__file__).resolve().parents[2]
TOPO = str(ROOT / "examples/topology-3.yaml")


@pytest.mark.parametrize(("value", "parsed"), [
    ("8", {"min": 8, "max": 8}),
    ("2:16", {"min": 2, "max": 16}),
    ("A100:8", {"min": 8, "max": 8, "type": "A100"}),
    ("h100-80g:4:8", {"min": 4, "max": 8, "type": "H100-80G"}),
])
def test_gpus_takes_a_type_and_a_count(value: str, parsed: dict[str, object]) -> None:
    assert jobs.parse_gpus(value) == parsed


@pytest.mark.parametrize("value", ["B999:8", "A100:x", "lots", "A100:"])
def test_bad_gpus_is_a_usage_error(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        jobs.parse_gpus(value)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("argv", "needle"), [
    (["submit", "--model", "gpt-tiny", "--gpu-type", "B999"], "--gpu-type: unknown GPU type"),
    (["submit", "--model", "gpt-tiny", "--gpus", "B999:8"], "--gpus"),
    (["submit", "--model", "gpt-tiny", "--cluster", "ohio", "--exclude-cluster", "ohio"],
     "constraints.exclude_clusters[0]: contradicts clusters"),
    (["plan", "--topology", TOPO, "--model", "gpt3-1.3b", "--gpus", "B999:8"], "--gpus: unknown GPU type"),
    (["plan", "--topology", TOPO, "--model", "gpt3-1.3b", "--gpus", "8", "--cluster", "nowhere"],
     "--cluster: no cluster 'nowhere' in the topology"),
    (["plan", "--topology", TOPO, "--model", "gpt3-1.3b", "--gpus", "8", "--region", "eu", "--exclude-region", "eu"],
     "constraints.exclude_regions[0]: contradicts regions"),
    (["up", "--gpu-type", "Z80"], "--gpu-type: unknown GPU type"),
    (["up", "--exclude-region", "x", "--region", "x"], "constraints.exclude_regions[0]"),
    (["up", "--profile-seconds", "0"], "--profile-seconds: must be > 0"),
])
def test_bad_constraints_end_with_one_line_and_exit_2(argv: list[str], needle: str,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPIDERFLOW_SCHEDULER", "127.0.0.1:1")  # nothing may be contacted
    monkeypatch.setenv("SPIDERFLOW_CONFIG", "/nonexistent/config.yaml")
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_submit_file_options_replace_only_the_lists_they_name(tmp_path: Path) -> None:
    f = tmp_path / "job.yaml"
    f.write_text("id: j\nmodel: gpt-tiny\nglobal_batch: 8\ngpus: {min: 1, max: 4}\n"
                 "constraints: {regions: [us-east], exclude_clusters: [paris]}\n")
    args = build_parser().parse_args(["submit", str(f), "--gpus", "a100:2", "--exclude-cluster", "ohio",
                                      "--exclude-cluster", "oregon"])
    spec = jobs._job_from_file(args)
    assert (spec.gpus.min, spec.gpus.max) == (2, 2)
    assert spec.constraints.regions == ("us-east",)  # kept from the file
    assert spec.constraints.exclude_clusters == ("ohio", "oregon")  # replaced by the options
    assert spec.constraints.gpu_types == ("A100",)
    args = build_parser().parse_args(["submit", str(f), "--steps", "5"])
    assert jobs._job_from_file(args).constraints.exclude_clusters == ("paris",)  # untouched without options


def test_plan_places_only_on_allowed_clusters(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--topology", TOPO, "--model", "gpt3-1.3b", "--global-batch", "32", "--json"]
    code, out, err = _run([*base, "--gpus", "A100:8"], capsys)
    assert code == 0, err
    assert json.loads(out)["chain"] == ["virginia"]
    code, out, err = _run([*base, "--gpus", "16", "--exclude-cluster", "virginia", "--exclude-cluster", "oregon"],
                          capsys)
    assert code == 0 and json.loads(out)["chain"] == ["ohio"], err
    code, out, err = _run([*base, "--gpus", "8", "--gpu-type", "T4"], capsys)
    assert code == 1 and err.strip() == ("error: unschedulable (constraints): its constraints (gpu_types T4) allow "
                                         "no cluster of the topology")


def test_up_sample_job_takes_the_constraints() -> None:
    topo = sample_topology(3)
    parse = build_parser().parse_args
    job: dict[str, object] = {}
    up._apply_constraints(job, topo, parse(["up", "--exclude-cluster", topo.names[0]]))
    assert job == {"constraints": {"exclude_clusters": [topo.names[0]]}, "gpus": {"min": 2, "max": 2}}
    job = {}
    up._apply_constraints(job, topo, parse(["up", "--gpus", "cpu:1"]))
    assert job == {"constraints": {"gpu_types": ["cpu"]}, "gpus": {"min": 1, "max": 1}}
    job = {"gpus": {"min": 3, "max": 3}}
    up._apply_constraints(job, topo, parse(["up"]))
    assert job == {"gpus": {"min": 3, "max": 3}}
