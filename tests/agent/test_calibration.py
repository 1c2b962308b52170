"""The agent's calibration of training efficiency (``mfu``) for CPU clusters (agent.profiler)."""

from __future__ import annotations

import pytest

from agent.agent import build_cluster
from agent.config import AgentConfig, GpuDeclaration
from agent.profiler import (
    CALIBRATION_SHAPE,
    DeviceProfile,
    calibrate_mfu,
    measure_training_tflops,
    profile_cpu,
)


def test_mfu_is_achieved_over_matmul_and_bounded() -> None:
    assert calibrate_mfu(0.04, 0.01) == pytest.approx(0.25)
    assert calibrate_mfu(0.01, 0.03) == 1.0  # the block cannot beat the matmul: bounded to 1
    with pytest.raises(ValueError):
        calibrate_mfu(0.0, 0.01)
    with pytest.raises(ValueError):
        calibrate_mfu(0.01, -1.0)


def test_training_tflops_is_measured_on_a_real_block_and_short() -> None:
    import time

    t0 = time.perf_counter()
    achieved = measure_training_tflops(hidden=64, heads=2, seq_len=32, batch=1, seconds=0.2)
    assert time.perf_counter() - t0 < 5.0
    assert 0.0 < achieved < 10.0  # TFLOPS of one CPU thread


def test_profile_cpu_reports_a_calibrated_mfu() -> None:
    prof = profile_cpu(seconds=0.1)
    assert prof.gpu == "cpu" and prof.tflops is not None and prof.tflops > 0
    assert prof.mfu is not None and 0.0 < prof.mfu <= 1.0
    assert CALIBRATION_SHAPE["hidden"] % CALIBRATION_SHAPE["heads"] == 0


def _config(gpus: GpuDeclaration | None = None) -> AgentConfig:
    return AgentConfig(cluster="c1", topology_service="127.0.0.1:1", etcd="127.0.0.1:2", gpus=gpus)


def test_calibrated_mfu_reaches_the_cluster_only_with_measured_tflops() -> None:
    measured = DeviceProfile(gpu="cpu", count=1, memory_gib=8.0, tflops=0.02, device_name="cpu", mfu=0.4)
    c = build_cluster(_config(GpuDeclaration(gpu="cpu")), measured)
    assert c.tflops == 0.02 and c.mfu == 0.4
    assert c.effective_tflops == pytest.approx(0.008)
    c = build_cluster(_config(), measured)
    assert c.mfu == 0.4
    declared = build_cluster(_config(GpuDeclaration(gpu="cpu", tflops=0.5)), measured)
    assert declared.tflops == 0.5 and declared.mfu is None  # a declared figure keeps the catalog default
