"""The fidelity benchmark's records: one loader that further sources append to, and framework options set
only where a record's source states them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import fidelity  # type: ignore[import-not-found]  # noqa: E402

from spiderflow.core.costmodel import (  # noqa: E402
    FSDP_PER_BLOCK_KEY,
    OVERLAP_KEY,
    SELECTIVE_RECOMPUTE_KEY,
    breakdown,
    evaluate,
    fsdp_unsharded_bytes_per_param,
    stage_memory_bytes,
    stage_params,
)
from spiderflow.core.domain import Plan, Sharding  # noqa: E402


def test_records_carry_sources_and_the_options_their_sources_state() -> None:
    recs = fidelity.load_records()
    assert len(recs) >= 15
    for rec in recs:
        assert rec["source"]["url"].startswith("https://")
        extras = fidelity.framework_extras(rec)
        if "Megatron-LM" in rec["source"]["url"]:
            assert extras == {OVERLAP_KEY: 1.0}
            continue
        # every torchtitan record runs FSDP without pipelining: resharded per block after forward
        assert extras.pop(FSDP_PER_BLOCK_KEY) == 1.0 and "reshard_after_forward" in rec["framework"]["fsdp_source"]
        if rec["plan"]["activation_checkpointing"] == "selective":
            assert extras == {SELECTIVE_RECOMPUTE_KEY: 1.0}
        else:
            assert extras == {}


def test_a_further_source_is_one_more_file(tmp_path: Path) -> None:
    extra: dict[str, Any] = json.loads(fidelity.RECORDS.read_text())["records"][0]
    extra = {**extra, "id": "own-gpu-run"}
    path = tmp_path / "own.json"
    path.write_text(json.dumps({"records": [extra]}))
    recs = fidelity.load_records((*fidelity.RECORD_FILES, path))
    assert recs[-1]["id"] == "own-gpu-run" and len(recs) == len(fidelity.load_records()) + 1


@pytest.mark.parametrize("rid", ["tt-2412-t1-fsdp", "megatron-table-70B"])
def test_options_only_change_what_they_describe(rid: str) -> None:
    rec = next(r for r in fidelity.load_records() if r["id"] == rid)
    plan_on, topo, job = fidelity.gpu_case(rec)
    plan_off, _, _ = fidelity.gpu_case(rec, options=False)
    on, off = evaluate(plan_on, topo, job, fused_attention=True), evaluate(plan_off, topo, job, fused_attention=True)
    if rid.startswith("megatron"):  # overlap hides communication, memory unchanged
        assert on.step_time_s < off.step_time_s and on.memory_gib_per_gpu == off.memory_gib_per_gpu
    else:  # selective recomputation costs time and saves activations; the fp32 loss adds its buffers
        assert on.step_time_s > off.step_time_s and max(on.memory_gib_per_gpu) < max(off.memory_gib_per_gpu)


def test_fsdp_per_block_gathers_per_block_and_holds_two_blocks() -> None:
    """torchtitan's FSDP (the option) against the executor's step-granular FSDP on the same plan: the
    gathers move from the step's sync into the micro-batches (bf16, hidden behind compute where it is longer),
    and the stage holds two blocks unsharded instead of all of them."""
    rec = next(r for r in fidelity.load_records() if r["id"] == "tt-2412-t3-fsdp")
    plan, topo, job = fidelity.gpu_case(rec, options=False)
    per_block = Plan(stages=plan.stages, micro_batches=plan.micro_batches, schedule=plan.schedule,
                     extras={FSDP_PER_BLOCK_KEY: 1.0})
    kw = {"micro_batch": job.micro_batch, "seq_len": job.seq_len, "precision": job.precision}
    step, block = breakdown(plan, topo, job.model, **kw), breakdown(per_block, topo, job.model, **kw)
    assert block.allreduce_s[0] < step.allreduce_s[0]  # the reduce-scatter alone
    assert block.compute_s[0] >= step.compute_s[0]
    st = plan.stages[0]
    args = (job.model, st.first_layer, st.last_layer, st.tp, job.micro_batch, job.seq_len, 1)
    whole = stage_memory_bytes(*args, sharding=Sharding.FSDP, dp=st.dp)
    two_blocks = stage_memory_bytes(*args, sharding=Sharding.FSDP, dp=st.dp, fsdp_per_block=True)
    params = stage_params(job.model, st.first_layer, st.last_layer)
    v = job.precision.value_bytes
    assert whole - two_blocks == pytest.approx(
        (fsdp_unsharded_bytes_per_param(job.precision) * params - 2 * 2 * v * job.model.params_per_layer) / st.tp)


def test_a_recalibrated_run_is_priced_on_its_own_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``--recalibrate`` run stores the calibration it was planned on; the record uses it, not the start's."""
    src = ROOT / "bench" / "results" / "testbed_best-slow-link-recal.json"
    doc = json.loads(src.read_text())
    run = next(r for r in doc["runs"] if r.get("measured_step_s"))
    assert "calibration" in run
    base = {**doc, "runs": [{k: v for k, v in run.items() if k != "calibration"}]}
    slower = {**doc, "runs": [{**run, "calibration": {c: {**v, "mfu": v["mfu"] / 2}
                                                      for c, v in run["calibration"].items()}}]}
    (tmp_path / "results").mkdir()
    paths = []
    for name, d in (("testbed_best-start.json", base), ("testbed_best-recal.json", slower)):
        paths.append(tmp_path / "results" / name)
        paths[-1].write_text(json.dumps(d))
    monkeypatch.setattr(fidelity, "TESTBED", paths)
    monkeypatch.setattr(fidelity, "ROOT", tmp_path)
    start, recal = fidelity.testbed_rows()
    assert not start["recalibrated"] and recal["recalibrated"]
    assert recal["predicted_s"] > 1.3 * start["predicted_s"]  # half the rate: compute dominates this plan
