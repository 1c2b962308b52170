"""Issue 4's executed target at equal memory: on 60 ms links a real three-stage pipeline runs 1F1B and the
latency-aware schedule under the same in-flight cap on every stage (K = 1F1B's own peak), and the executed
ordering matches the timeline's prediction — both ways. With m = 3 micro-batches (all of a step's
micro-batches fit in flight) the latency-aware schedule wins; with m = 12 the cap leaves it only the
deeper warm-up on later stages, which delays gradients, and it loses. Both compute the same update. Runs
``bench/schedule_exec.py``'s experiment on the emulated testbed (one worker per cluster namespace);
afterwards no namespace or worker of the run is left. Needs root and network namespaces.

Measured on the shared 2-core machine (3 rounds each): m = 3 of 4: 1F1B 0.44–0.48 s/step, latency-aware
0.29–0.46 s/step, ratio 1.33× (predicted 1.40×); m = 12 of 1: 1F1B 1.20–1.23 s/step, latency-aware
1.64–1.69 s/step, ratio 0.73× (predicted 0.74×). The test asserts ≥ 1.1× and ≤ 0.9×.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from testbed_fixtures import netns_skip_reason

pytestmark = [pytest.mark.netns, pytest.mark.heavy, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


_REASON = netns_skip_reason("sfprobe-sched")
if _REASON:
    pytest.skip(f"testbed needs root and network namespaces: {_REASON}", allow_module_level=True)


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("schedule_exec", ROOT / "bench" / "schedule_exec.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["schedule_exec"] = mod
    spec.loader.exec_module(mod)
    return mod


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def _workers(spec_dir_hint: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "spiderflow.exec.worker" in line and spec_dir_hint in line]


def _experiment(micro_batches: int, micro_batch: int, repeats: int) -> dict[str, Any]:
    bench = _bench()
    prefix = "sxt" + uuid.uuid4().hex[:5]
    setup = bench.Setup(latency_ms=60.0, mbit=400.0, micro_batches=micro_batches, micro_batch=micro_batch,
                        steps=5)
    try:
        res: dict[str, Any] = bench.experiment(setup, repeats=repeats, prefix=prefix, timeout=120.0,
                                               log=lambda msg: None)
    finally:
        from spiderflow.testbed import cleanup

        cleanup(prefix)
    f1, la = "1f1b", "latency-aware"
    # Equal memory: the same cap K = 3 on every stage; the first stage holds 3 under both schedules and
    # no stage holds more (the same peak activation memory per GPU).
    assert res["max_in_flight"] == 3
    assert res["peak_in_flight"] == {f1: [3, 2, 1], la: [3, 3, 2]}
    # The first stage, which holds the most, is priced the same under both (the last stage's loss is priced
    # per in-flight micro-batch, so the latency-aware schedule's second one there adds its logits).
    assert res["predicted"][la]["memory_gib_per_gpu"][0] == pytest.approx(
        res["predicted"][f1]["memory_gib_per_gpu"][0])
    # Same model, data and micro-batches: the schedules compute the same losses.
    losses = {r["schedule"]: r["losses"] for r in res["runs"]}
    assert losses[f1] == pytest.approx(losses[la], rel=1e-5)
    # The window-blind closed form cannot tell them apart.
    assert res["predicted"][la]["closed_form_s"] == pytest.approx(res["predicted"][f1]["closed_form_s"])
    assert _namespaces(prefix) == []
    assert _workers("schedule-exec-") == []
    return res


def test_at_equal_memory_latency_aware_wins_when_every_micro_batch_fits_in_flight() -> None:
    res = _experiment(3, 4, repeats=2)
    assert res["predicted_timeline_ratio"] > 1.2
    # Measured ~1.3-1.5x; a generous margin against machine load.
    assert res["ratio_1f1b_over_latency_aware"] >= 1.1, res["measured_mean_step_s"]


def test_at_equal_memory_latency_aware_loses_with_many_micro_batches() -> None:
    res = _experiment(12, 1, repeats=1)
    assert res["predicted_timeline_ratio"] < 0.8
    # Measured ~0.73x: the executed pipeline confirms the predicted ordering.
    assert res["ratio_1f1b_over_latency_aware"] <= 0.9, res["measured_mean_step_s"]
