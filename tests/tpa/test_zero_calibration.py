"""Without calibration (``layer_overhead_ms = optimizer_ms_per_layer = 0``, GPU clusters: every simulator
topology) the planner's and the cost model's predictions are exactly those recorded before the calibrated
terms reached level 1, level 2 and the timeline (``data/zero_calibration.json``, written by running this
module as a script on that code: ``python tests/tpa/test_zero_calibration.py --write FILE``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from spiderflow.core.catalog import model_preset
from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import GpuRange, JobSpec, Plan, Stage
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.topogen import generate_topology
from spiderflow.core.tpa import plan_chain, simulate_plan
from spiderflow.core.tpa.timeline import window_estimate

GOLDEN = Path(__file__).parent / "data" / "zero_calibration.json"
TOPOLOGIES = ((4, 0), (6, 1), (8, 2))
JOBS = (("gpt3-1.3b", 64, 2048), ("gpt3-6.7b", 128, 2048))


def _plan_doc(plan: Plan) -> dict[str, Any]:
    return {
        "stages": [[s.cluster, s.first_layer, s.last_layer, s.tp, s.dp] for s in plan.stages],
        "m": plan.micro_batches, "schedule": plan.schedule.value, "step_time_s": plan.step_time_s,
        "memory_gib_per_gpu": list(plan.memory_gib_per_gpu), "usd_per_step": plan.usd_per_step,
        "timeline_step_s": plan.extras.get("timeline_step_s"),
        "closed_form_step_s": plan.extras.get("closed_form_step_s"),
    }


def cases() -> dict[str, Any]:
    """Every prediction the check compares, keyed by case."""
    out: dict[str, Any] = {}
    for n, seed in TOPOLOGIES:
        topo = generate_topology(n, seed)
        for model, gb, seq in JOBS:
            job = JobSpec(id="g", model=model_preset(model), global_batch=gb, seq_len=seq,
                          gpus=GpuRange(min=1, max=64))
            key = f"{n}-{seed}-{model}"
            chain = [c for c in topo.clusters if c.free > 0][:3]
            alloc = [(c.name, min(c.free, 16)) for c in chain]
            try:
                out[key + "-tpa"] = _plan_doc(plan_chain(topo, job, alloc))
            except UnschedulableError as e:
                out[key + "-tpa"] = {"unschedulable": str(e)}
            # A fixed hand-made plan: one stage per chain cluster, layers split evenly, 1F1B.
            layers = job.model.layers
            k = len(chain)
            first, stages = 0, []
            for i, c in enumerate(chain):
                cnt = layers // k + (1 if i < layers % k else 0)
                g = min(c.free, 8)
                stages.append(Stage(cluster=c.name, first_layer=first, last_layer=first + cnt - 1, tp=g))
                first += cnt
            fixed = evaluate(Plan(stages=tuple(stages), micro_batches=8), topo, job)
            doc = _plan_doc(fixed)
            doc["timeline_s"] = simulate_plan(fixed, topo, job).step_s
            doc["window_s"] = window_estimate(fixed, topo, job)
            out[key + "-fixed"] = doc
    return out


def test_uncalibrated_predictions_are_unchanged() -> None:
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(cases()))  # the same float round trip as the recorded file
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: test_zero_calibration.py --write FILE")
    Path(sys.argv[2]).write_text(json.dumps(cases(), indent=1, sort_keys=True) + "\n")
