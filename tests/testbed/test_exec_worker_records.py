"""``bench/testbed_exec.py`` finds every rank's ``done`` event where the executor keeps a worker's stdout
(:func:`spiderflow.joblogs.rank_log_paths` under each agent's work dir ``<agents_dir>/<cluster>``), so its
worker-measured step time is reported instead of ``null``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from spiderflow import joblogs

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("testbed_exec", ROOT / "bench" / "testbed_exec.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("testbed_exec", mod)
    spec.loader.exec_module(mod)
    return mod


def _write(agents: Path, cluster: str, job: str, attempt: int, rank: int, lines: list[str]) -> None:
    out, err = joblogs.rank_log_paths(agents / cluster, job=job, attempt=attempt, cluster=cluster, rank=rank)
    out.write_text("".join(f"{x}\n" for x in lines))
    err.write_text('{"event": "done", "rank": 99}\n')  # stderr is never read as a record


def _done(rank: int, times: list[float]) -> str:
    return json.dumps({"event": "done", "rank": rank, "step_times_s": times, "phases": {"forward": 0.1}})


def test_done_events_are_read_from_every_agents_worker_stdout(tmp_path: Path) -> None:
    bench = _bench()
    agents = tmp_path / "agents"
    _write(agents, "alpha", "job-1", 1, 0, ['{"event": "step", "step": 1}', "not json", _done(0, [0.5, 0.2])])
    _write(agents, "bravo", "job-1", 1, 1, [_done(1, [0.6, 0.3, 0.3])])
    _write(agents, "bravo", "job-1", 2, 1, [_done(1, [9.0])])  # another attempt
    _write(agents, "bravo", "job-2", 1, 2, [_done(2, [9.0])])  # another job
    done = bench.worker_done_events(agents, "job-1")
    assert sorted(done) == [0, 1] and done[0]["phases"] == {"forward": 0.1}
    assert bench.worker_step_times(agents, "job-1") == {0: [0.5, 0.2], 1: [0.6, 0.3, 0.3]}
    assert bench.worker_step_times(agents, "job-1", attempt=2) == {1: [9.0]}
    assert bench.worker_done_events(tmp_path / "absent", "job-1") == {}


def test_runs_of_one_plan_are_grouped_whichever_policy_chose_it() -> None:
    bench = _bench()
    stages = [{"cluster": "a", "layers": [0, 1], "gpus": 1}, {"cluster": "b", "layers": [2, 2], "gpus": 1}]
    run = {"chain": ["a", "b"], "stages": stages, "schedule": "gpipe", "micro_batches": 8}
    results = [run | {"policy": "spinsearch", "measured_step_s": 0.40},
               run | {"policy": "ilp", "measured_step_s": 0.50},
               run | {"policy": "bace", "measured_step_s": 0.45, "micro_batches": 16},  # another plan
               run | {"policy": "greedy", "measured_step_s": None}]  # did not run
    (spread,) = bench.plan_spread(results)
    assert spread["policies"] == ["spinsearch", "ilp"] and spread["measured_s"] == [0.40, 0.50]
    assert abs(spread["max_over_min"] - 1.25) < 1e-12


def test_cpu_quota_option() -> None:
    bench = _bench()
    assert bench.cpu_quota("none", 2, 4) is None
    assert bench.cpu_quota("auto", 2, 4) == 0.4 and bench.cpu_quota("auto", 16, 4) == 1.0
    assert bench.cpu_quota("0.25", 2, 4) == 0.25
    for bad in ("0", "-1", "lots", "inf"):
        with pytest.raises(ValueError):
            bench.cpu_quota(bad, 2, 4)


def test_calibration_events_are_read_in_order(tmp_path: Path) -> None:
    """Each ``agent.calibrated`` event of an agent's log (at start, then one per re-calibration): the first is
    the start's (``calibration_share``), the last the one a ``--recalibrate`` run was planned on."""
    bench = _bench()
    log = tmp_path / "agent-alpha.log"
    events = [{"event": "agent.calibrated", "share": 0.40, "cpu_training_tflops": 0.075, "mfu": 0.4},
              {"event": "agent.recalibrated", "tflops": 0.08},
              {"event": "agent.calibrated", "share": 0.41, "cpu_training_tflops": 0.068}]
    log.write_text("not json\n" + "".join(json.dumps(e) + "\n" for e in events))
    assert bench.calibration_events(log) == [{"share": 0.40, "cpu_training_tflops": 0.075},
                                             {"share": 0.41, "cpu_training_tflops": 0.068}]
    assert bench.calibration_share(log) == {"share": 0.40, "cpu_training_tflops": 0.075}
    assert bench.calibration_share(tmp_path / "missing.log") == {}
    assert bench._last_event(log, "agent.recalibrated") == {"event": "agent.recalibrated", "tflops": 0.08}
