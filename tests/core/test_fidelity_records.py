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

from spiderflow.core.costmodel import OVERLAP_KEY, SELECTIVE_RECOMPUTE_KEY, evaluate  # noqa: E402


def test_records_carry_sources_and_the_options_their_sources_state() -> None:
    recs = fidelity.load_records()
    assert len(recs) >= 15
    for rec in recs:
        assert rec["source"]["url"].startswith("https://")
        extras = fidelity.framework_extras(rec)
        if "Megatron-LM" in rec["source"]["url"]:
            assert extras == {OVERLAP_KEY: 1.0}
        elif rec["plan"]["activation_checkpointing"] == "selective":
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
