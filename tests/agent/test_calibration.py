"""The agent's calibration of training efficiency (``mfu``) and per-layer overhead for CPU clusters
(agent.profiler)."""

from __future__ import annotations

import pytest

from agent.agent import build_cluster
from agent.config import AgentConfig, GpuDeclaration
from agent.profiler import (
    CALIBRATION_SEQ_LENS,
    CALIBRATION_SHAPE,
    DeviceProfile,
    TrainingFit,
    calibrate_mfu,
    fit_rate_overhead,
    measure_training_fit,
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
    assert time.perf_counter() - t0 < 30.0  # bounded, with slack for a loaded machine
    assert 0.0 < achieved < 10.0  # TFLOPS of one CPU thread


def test_profile_cpu_reports_a_calibrated_mfu_and_overhead() -> None:
    prof = profile_cpu(seconds=0.1)
    assert prof.gpu == "cpu" and prof.tflops is not None and prof.tflops > 0
    assert prof.mfu is not None and 0.0 < prof.mfu <= 1.0
    assert 0.0 <= prof.layer_overhead_ms < 1000.0 and 0.0 < prof.optimizer_ms_per_layer < 1000.0
    assert CALIBRATION_SHAPE["hidden"] % CALIBRATION_SHAPE["heads"] == 0


def test_fit_recovers_rate_and_overhead_of_a_line() -> None:
    # t = F / 50 GFLOP/s + 0.4 ms, at two and at three sizes
    pts = [(f, f / 50e9 + 4e-4) for f in (4e7, 4e8)]
    rate, overhead = fit_rate_overhead(pts)
    assert rate == pytest.approx(50e9) and overhead == pytest.approx(4e-4)
    rate, overhead = fit_rate_overhead([*pts, (2e8, 2e8 / 50e9 + 4e-4)])
    assert rate == pytest.approx(50e9) and overhead == pytest.approx(4e-4)


def test_fit_falls_back_to_no_overhead_when_noise_bends_the_line() -> None:
    # the larger size took less time: no physical line; the largest point's rate and no overhead
    assert fit_rate_overhead([(4e7, 2e-3), (4e8, 1e-3)]) == (pytest.approx(4e11), 0.0)
    # a negative intercept (the small size ran faster per FLOP): the same fallback
    assert fit_rate_overhead([(4e7, 1e-4), (4e8, 8e-3)]) == (pytest.approx(5e10), 0.0)
    assert fit_rate_overhead([(4e8, 8e-3)]) == (pytest.approx(5e10), 0.0)
    with pytest.raises(ValueError):
        fit_rate_overhead([(4e7, 0.0), (4e8, 1e-3)])


def test_wall_figures_are_cpu_figures_scaled_by_the_share_of_a_core() -> None:
    fit = TrainingFit(cpu_matmul_tflops=0.1, cpu_rate_tflops=0.06, cpu_layer_overhead_ms=0.5,
                      points=((4e7, 1e-3), (4e8, 7e-3)), share=0.5, cpu_optimizer_ms_per_layer=0.3)
    assert fit.matmul_tflops == pytest.approx(0.05) and fit.rate_tflops == pytest.approx(0.03)
    assert fit.layer_overhead_ms == pytest.approx(1.0) and fit.optimizer_ms_per_layer == pytest.approx(0.6)
    # mfu is a ratio of two rates seen through the same share: the share cancels
    assert calibrate_mfu(fit.matmul_tflops, fit.rate_tflops) == pytest.approx(0.6)


def test_training_fit_measures_two_block_sizes_interleaved() -> None:
    import time

    t0 = time.perf_counter()
    fit = measure_training_fit(hidden=64, heads=2, seq_lens=(16, 128), seconds=0.2, rounds=2)
    assert time.perf_counter() - t0 < 30.0
    assert [f for f, _ in fit.points] == sorted(f for f, _ in fit.points) and len(fit.points) == 2
    assert all(t > 0 for _, t in fit.points)
    assert 0.0 < fit.share <= 1.0 and 0.0 < fit.cpu_rate_tflops < 10.0 and fit.cpu_layer_overhead_ms >= 0.0
    assert 0.0 < fit.cpu_optimizer_ms_per_layer < 1000.0
    assert fit.points[1][1] > fit.points[0][1]  # 8× the FLOPs takes longer
    assert len(CALIBRATION_SEQ_LENS) >= 2


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


def test_calibrated_overhead_reaches_the_cluster_only_with_measured_tflops() -> None:
    measured = DeviceProfile(gpu="cpu", count=1, memory_gib=8.0, tflops=0.02, device_name="cpu", mfu=0.4,
                             layer_overhead_ms=0.7, optimizer_ms_per_layer=0.3)
    for c in (build_cluster(_config(GpuDeclaration(gpu="cpu")), measured), build_cluster(_config(), measured)):
        assert (c.layer_overhead_ms, c.optimizer_ms_per_layer) == (0.7, 0.3)
    declared = build_cluster(_config(GpuDeclaration(gpu="cpu", tflops=0.5)), measured)
    assert (declared.layer_overhead_ms, declared.optimizer_ms_per_layer) == (0.0, 0.0)
