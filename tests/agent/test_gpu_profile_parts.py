"""The parts of ``spiderflow profile`` that a GPU node adds (agent.profiler), run through their CPU path, and
the device-check pricing (``bench/gpu_fidelity.py``) over the committed H200 results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from agent.profiler import (
    build_profile,
    calibrate_gpu,
    calibrate_mfu,
    catalog_name,
    measure_matmul_tflops,
    time_block,
    time_data,
    time_embedding,
    time_head,
    time_optimizer,
)
from spiderflow.exec.runtime import device_memory
from spiderflow.exec.worker import CUDA_ALLOC_CONF, cuda_allocator_env
from spiderflow.profile import parse_profile

ROOT = Path(__file__).resolve().parents[2]


def test_catalog_names_the_h200_and_still_the_h100() -> None:
    assert catalog_name("NVIDIA H200", 139.8) == "H200-141G"
    assert catalog_name("NVIDIA H100 80GB HBM3", 79.6) == "H100-80G"


@pytest.mark.parametrize("precision", ["bf16", "fp32", "tf32"])
def test_blocks_are_timed_as_the_executor_runs_them(precision: str) -> None:
    # fp32 parameters with bf16 autocast (or TF32 matmuls): the flags are restored afterwards
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    fwd, bwd = time_block(hidden=64, heads=4, micro_batch=1, seq_len=16, precision=precision, repeats=1)
    assert fwd > 0.0 and bwd > 0.0
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_embedding_head_and_input_pipeline_are_timed_as_the_executor_runs_them(precision: str) -> None:
    for fn in (time_embedding, time_head):
        fwd, bwd = fn(hidden=32, vocab=64, micro_batch=2, seq_len=8, precision=precision, repeats=1)
        assert fwd > 0.0 and bwd > 0.0
    assert time_data(vocab=64, seq_len=8, samples=2, repeats=1) > 0.0


def test_profile_carries_the_work_outside_the_blocks_and_reads_back() -> None:
    # the same code a CUDA node runs, selected by device: here the CPU
    doc = build_profile(blocks=[(32, 4)], micro_batches=[1, 2], seq_lens=[8], seconds=0.02, repeats=1,
                        outer=[(32, 64)])
    entry = parse_profile(doc).gpus["cpu"]
    assert [(o.micro_batch, o.vocab) for o in entry.embedding] == [(1, 64), (2, 64)]
    assert [(o.micro_batch, o.seq_len) for o in entry.head] == [(1, 8), (2, 8)]
    assert all(o.forward_ms > 0 and o.optimizer_ms for o in (*entry.embedding, *entry.head))
    assert [d.seq_len for d in entry.data] == [8] and entry.data[0].ms_per_sample > 0


def test_workers_expand_cuda_segments_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    cuda_allocator_env(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        mine = {name: "backend:cudaMallocAsync"}
        cuda_allocator_env(mine)
        assert mine == {name: "backend:cudaMallocAsync"}


def test_optimizer_step_and_matmul_rate_are_measured() -> None:
    assert time_optimizer(hidden=64, heads=4, repeats=2) > 0.0
    assert measure_matmul_tflops(size=64, seconds=0.01, precision="fp32") > 0.0


def test_gpu_calibration_fits_the_executor_block_line_on_any_device() -> None:
    # the CUDA agent's calibration, run through its device-generic code on the CPU with a tiny block
    cal = calibrate_gpu(device="cpu", hidden=64, heads=4, seq_len=32, batches=(1, 4), seconds=0.02,
                        matmul_size=64, repeats=1)
    assert len(cal.points) == 2 and cal.points[0][0] < cal.points[1][0]
    assert cal.matmul_tflops > 0.0 and cal.rate_tflops > 0.0 and cal.layer_overhead_ms >= 0.0
    assert cal.optimizer_ms_per_layer > 0.0
    assert 0.0 < calibrate_mfu(cal.matmul_tflops, cal.rate_tflops) <= 1.0


def test_cpu_ranks_report_no_device_memory() -> None:
    assert device_memory(torch.device("cpu")) is None


def test_device_check_pricing_reads_the_committed_h200_run(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_fidelity
    finally:
        sys.path.remove(str(ROOT / "bench"))
    out = tmp_path / "f.json"
    assert gpu_fidelity.main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    summ = doc["summary"]
    assert summ["runs"] == len(doc["rows"]) >= 5
    assert {"defaults", "agent", "profile", "memory", "rank_correlation"} <= set(summ)
    for row in doc["rows"]:  # every run was priced both ways, with a positive prediction
        assert row["default_step_s"] > 0.0 and row["profile_step_s"] > 0.0
    assert gpu_fidelity.main(["--profile", "bf16"]) == 2  # a malformed flag is refused, no traceback
