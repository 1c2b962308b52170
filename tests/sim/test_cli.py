"""``spiderflow trace`` and ``spiderflow simulate`` end to end through the CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest

from spiderflow.cli.main import main
from spiderflow.core.domain import JobSpec, Plan, Topology, Wait
from spiderflow.core.placement.base import REGISTRY, Budget, PlacementResult, register_policy
from spiderflow.presets import PRESETS, preset_source, resolve_topology

from .helpers import GreedyPolicy


class _Spy(GreedyPolicy):
    """Records the most releases each job was told about (it prices waits itself, so it is told them)."""

    told: ClassVar[dict[str, int]] = {}

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        self.told[job.id] = max(self.told.get(job.id, 0), len(budget.releases) if budget else 0)
        return super().place(topo, job, budget or Budget())

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        return None


if "greedy-test" not in REGISTRY:
    register_policy("greedy-test", GreedyPolicy)
if "spy-test" not in REGISTRY:
    register_policy("spy-test", _Spy)


def test_trace_generate_and_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.json"
    assert main(["trace", "generate", "--jobs", "25", "--seed", "3", "--topology", "aws-10-dtfm",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["jobs"]) == 25
    capsys.readouterr()
    assert main(["trace", "validate", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["jobs"] == 25 and sum(summary["models"].values()) == 25
    assert summary["gpus_min"]["min"] >= 4 and summary["arrival_s"]["first"] == 0.0


def test_trace_validate_rejects_bad_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"jobs": [{"id": "a", "model": "gpt3-1.3b", "global_batch": 8,
                                         "gpus": {"min": 9, "max": 4}}]}))
    assert main(["trace", "validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "jobs[0].gpus.min" in err and "9" in err


@pytest.mark.parametrize(("flag", "body", "message"), [
    ("--topology", '{"clusters": 5}', "top.json: clusters: must be a list (got 5)"),
    ("--topology", '"vm"', "top.json: must be an object (got 'vm')"),
    ("--trace", '{"jobs": [{"id": "a"}]}', "trace.json: jobs[0].model: is required"),
    ("--events", '{"events": [{"t_s": -1}]}', "ev.json: events[0].t_s: must be a number ≥ 0 (got -1)"),
    ("--trace", '{"jobs": []}', "trace.json: jobs: the trace has no jobs"),
])
def test_simulate_input_errors_name_the_file_and_the_field(
        flag: str, body: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "ok-trace.json"
    assert main(["trace", "generate", "--jobs", "3", "--seed", "1", "--topology", "aws-10-dtfm",
                 "--out", str(trace)]) == 0
    name = {"--topology": "top.json", "--trace": "trace.json", "--events": "ev.json"}[flag]
    (tmp_path / name).write_text(body)
    args = {"--topology": "aws-10-dtfm", "--trace": str(trace), flag: str(tmp_path / name)}
    out = tmp_path / "sim.json"
    capsys.readouterr()
    assert main(["simulate", *[x for kv in args.items() for x in kv], "--policies", "greedy-test",
                 "--json", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path / name}: {message.split(': ', 1)[1]}"
    assert not out.exists()


@pytest.mark.parametrize(("extra", "message"), [
    (["--json", "{tmp}"], "error: --json: {tmp} is a directory"),
    (["--json", "{tmp}/file/out.json"], "error: --json: cannot create the directory {tmp}/file: File exists"),
    (["--json", "{tmp}/o.json", "--plots", "{tmp}/file"], "error: --plots: {tmp}/file exists and is not a directory"),
    (["--json", "{tmp}/o.json", "--plots", "{tmp}/p", "--scaling", "{tmp}/none.json"],
     "error: --scaling: cannot read {tmp}/none.json: No such file or directory"),
    (["--json", "{tmp}/o.json", "--plots", "{tmp}/p", "--scaling", "{tmp}/file"],
     "error: --scaling: {tmp}/file is not a bench/paper.py results file (ValueError: neither a 'placement' part "
     "with 'settings' nor a 'sizes' list)"),
])
def test_simulate_checks_its_outputs_before_it_runs(extra: list[str], message: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    assert main(["trace", "generate", "--jobs", "3", "--seed", "1", "--topology", "aws-10-dtfm",
                 "--out", str(trace)]) == 0
    (tmp_path / "file").write_text("{}")
    _Spy.told.clear()
    capsys.readouterr()
    argv = ["simulate", "--topology", "aws-10-dtfm", "--trace", str(trace), "--policies", "spy-test",
            "--no-progress", *[a.format(tmp=tmp_path) for a in extra]]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == message.format(tmp=tmp_path)
    assert not _Spy.told  # nothing was simulated
    assert not (tmp_path / "o.json").exists()


def test_a_file_error_anywhere_in_the_cli_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert main(["trace", "generate", "--jobs", "2", "--seed", "1", "--out", str(tmp_path / "file" / "t.json")]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'file' / 't.json'}: Not a directory\n"


def test_simulate_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    assert main(["trace", "generate", "--jobs", "15", "--seed", "1", "--topology", "aws-10-dtfm",
                 "--out", str(trace)]) == 0
    events = tmp_path / "ev.json"
    events.write_text(json.dumps({"events": [{"t_s": 600, "kind": "cluster_loss", "cluster": "tokyo"}]}))
    out = tmp_path / "sim.json"
    plots = tmp_path / "plots"
    scaling = tmp_path / "paper.json"
    scaling.write_text(json.dumps({"sizes": [
        {"clusters": n, "policies": {"a": {"overhead_per_decision_mean_s": 0.01 * n},
                                     "b": {"overhead_per_decision_mean_s": 0.5 * n}}} for n in (8, 16, 32)]}))
    assert main(["simulate", "--topology", "aws-10-dtfm", "--trace", str(trace), "--policies", "greedy-test",
                 "--json", str(out), "--plots", str(plots), "--overhead", "fixed", "--events", str(events),
                 "--scaling", str(scaling), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    s = doc["policies"]["greedy-test"]
    for key in ("mean_jct_s", "p95_jct_s", "makespan_s", "throughput_tokens_per_s", "sched_overhead_s",
                "decisions", "gpu_utilization", "cost_usd", "completed", "overhead_per_decision_mean_s",
                "overhead_per_decision_p95_s", "records"):
        assert key in s
    assert len(s["records"]) == 15 and s["completed"] >= 1 and doc["events"] == 1
    for name in ("jct_cdf.png", "throughput_cost.png", "overhead_vs_clusters.png", "report.html"):
        assert (plots / name).stat().st_size > 1000
    assert "data:image/png;base64," in (plots / "report.html").read_text()


def test_simulate_no_releases_reaches_the_policies(tmp_path: Path) -> None:
    """``--no-wait`` (and its old name ``--no-releases``): no decision is told about GPUs coming back
    (recorded in the JSON too)."""
    trace = tmp_path / "t.json"
    assert main(["trace", "generate", "--jobs", "12", "--seed", "2", "--topology", "aws-10-dtfm", "--load", "3",
                 "--out", str(trace)]) == 0
    told = _Spy.told
    for flag, expect_any in (([], True), (["--wait"], True), (["--no-wait"], False), (["--no-releases"], False)):
        told.clear()
        out = tmp_path / "o.json"
        assert main(["simulate", "--topology", "aws-10-dtfm", "--trace", str(trace), "--policies", "spy-test",
                     "--json", str(out), "--overhead", "fixed", "--no-progress", *flag]) == 0
        assert json.loads(out.read_text())["releases"] is expect_any
        assert any(told.values()) is expect_any


def test_simulate_unknown_policy_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    main(["trace", "generate", "--jobs", "3", "--seed", "1", "--out", str(trace)])
    assert main(["simulate", "--topology", "aws-10-dtfm", "--trace", str(trace), "--policies", "nope",
                 "--json", str(tmp_path / "o.json")]) == 2
    assert "policy" in capsys.readouterr().err


def test_presets_load_and_cite_sources() -> None:
    for name in PRESETS:
        topo = resolve_topology(name)
        assert len(topo.clusters) == 10 and len(topo.links) == 45
        assert len(preset_source(name)) > 100
    aws = resolve_topology("aws-10-dtfm")
    assert aws.bandwidth_gbps("virginia", "ohio") == pytest.approx(1.12)
    link = aws.direct[("oregon", "sydney")]
    assert (link.latency_ms, link.bandwidth_gbps) == (139.0, 0.36)


def test_scaling_reads_the_rebuilt_paper_grid(tmp_path: Path) -> None:
    """``--scaling`` reads ``bench/paper.py``'s rebuilt results (``bench/results/paper-grid.json``): mean and
    p95 wall time per paired placement decision by topology size (generated kinds ``settings.clusters``,
    presets their own) and policy label; the earlier multi-size ``sizes`` format still reads."""
    from spiderflow.cli.commands.simulate import _scaling_rows
    from spiderflow.cli.common import CliError

    doc = {"settings": {"clusters": 12}, "placement": {"rows": [
        {"kind": "geo", "label": "spinsearch", "wall_s": 0.1}, {"kind": "hub", "label": "spinsearch", "wall_s": 0.3},
        {"kind": "geo", "label": "ilp", "wall_s": 3.0},
        {"kind": "aws-10-dtfm", "label": "spinsearch", "wall_s": 0.05}]}}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(doc))
    rows = {(r["clusters"], r["policy"]): r for r in _scaling_rows(path)}
    n_aws = len(resolve_topology("aws-10-dtfm").clusters)
    assert set(rows) == {(12, "spinsearch"), (12, "ilp"), (n_aws, "spinsearch")}
    assert rows[12, "spinsearch"]["overhead_per_decision_mean_s"] == pytest.approx(0.2)
    assert rows[12, "spinsearch"]["decisions"] == 2 and rows[12, "ilp"]["overhead_per_decision_mean_s"] == 3.0
    doc["placement"]["rows"].append({"kind": "nosuch", "label": "x", "wall_s": 1.0})
    path.write_text(json.dumps(doc))
    with pytest.raises(CliError, match="unknown topology kind 'nosuch'"):
        _scaling_rows(path)
    committed = Path(__file__).resolve().parents[2] / "bench" / "results" / "paper-grid.json"
    if committed.exists():  # the stored run itself
        got = _scaling_rows(committed)
        assert {r["policy"] for r in got} >= {"spinsearch", "bace", "greedy", "ilp"}
        assert all(r["overhead_per_decision_mean_s"] > 0 for r in got)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"sizes": [{"clusters": 8, "policies": {"a": {"overhead_per_decision_mean_s": 0.1}}}]}))
    assert _scaling_rows(old) == [{"clusters": 8, "policy": "a", "overhead_per_decision_mean_s": 0.1}]
