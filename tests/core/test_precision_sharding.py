"""Precision, FSDP sharding and recomputation in the cost model, by hand."""

from __future__ import annotations

import pytest

from spiderflow.core import costmodel as cm
from spiderflow.core.catalog import ModelSpec
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Plan, Precision, Sharding, Stage, Topology

M = ModelSpec(name="t", layers=4, hidden=1024, heads=8, vocab=1000)
B, S = 2, 512


def _h100(**kw: object) -> Cluster:
    return Cluster(name="a", gpu="H100-80G", nodes=2, gpus_per_node=8, **kw)  # type: ignore[arg-type]


def test_compute_rate_per_precision_from_the_catalog() -> None:
    c = _h100()
    bf16 = cm.compute_rate_tflops(c, Precision.BF16)
    assert bf16 == c.effective_tflops == cm.compute_rate_tflops(c, Precision.FP16)
    assert cm.compute_rate_tflops(c, Precision.FP32) == pytest.approx(bf16 * 67.0 / 989.0)
    assert cm.compute_rate_tflops(c, Precision.TF32) == pytest.approx(bf16 * 494.5 / 989.0)
    cpu = Cluster(name="c", gpu="cpu", nodes=1, gpus_per_node=1)
    assert cm.compute_rate_tflops(cpu, Precision.FP32) == cpu.effective_tflops  # one calibrated rate (bf16)
    v100 = Cluster(name="v", gpu="V100-32G", nodes=1, gpus_per_node=8)  # no TF32 cores: fp32 rate
    assert cm.compute_rate_tflops(v100, Precision.TF32) == cm.compute_rate_tflops(v100, Precision.FP32)


def test_bytes_per_precision() -> None:
    c, cpu = _h100(), Cluster(name="c", gpu="cpu", nodes=1, gpus_per_node=1)
    assert cm.wire_bytes(c, Precision.BF16) == 2 and cm.wire_bytes(c, Precision.FP32) == 4
    # the executor sends the job's compute dtype on CPU as on GPUs
    assert cm.wire_bytes(cpu, Precision.BF16) == 2 and cm.wire_bytes(cpu, Precision.FP32) == 4
    assert all(cm.grad_bytes_per_value(p) == 4 for p in Precision)  # fp32 gradients are reduced in every precision
    assert cm.state_bytes_per_param(Precision.BF16) == cm.BYTES_PER_PARAM == 18
    assert cm.state_bytes_per_param(Precision.FP32) == 20
    assert cm.state_bytes_per_param(Precision.FP32, Sharding.FSDP) == 16


def test_defaults_are_unchanged_by_the_new_arguments() -> None:
    c = _h100()
    assert cm.stage_compute_time(M, c, 0, 3, 2, B, S) == cm.stage_compute_time(
        M, c, 0, 3, 2, B, S, precision=Precision.BF16, recompute=False)
    assert cm.stage_memory_bytes(M, 0, 3, 1, B, S, 2) == cm.stage_memory_bytes(
        M, 0, 3, 1, B, S, 2, precision=Precision.BF16, sharding=Sharding.REPLICATE, dp=4)


def test_recompute_by_hand() -> None:
    c = _h100()
    base = cm.stage_compute_time(M, c, 1, 2, 1, B, S)  # tp 1: no TP all-reduce, no head
    rec = cm.stage_compute_time(M, c, 1, 2, 1, B, S, recompute=True)
    assert rec == pytest.approx(base * 4.0 / 3.0)
    # memory: inputs (2 bytes·s·b·h) per layer and in-flight micro-batch + one layer's activations
    params = 2 * 12 * 1024**2
    got = cm.stage_memory_bytes(M, 1, 2, 1, B, S, 3, recompute=True)
    act_layer = S * B * 1024 * (10 + 24 + 5 * 8 * S / 1024)
    assert got == pytest.approx(18 * params + 3 * 2 * (2 * S * B * 1024) + act_layer + cm.RESERVED_GIB * cm.GIB)


def test_fsdp_by_hand() -> None:
    params = 2 * 12 * 1024**2
    got = cm.stage_memory_bytes(M, 1, 2, 1, B, S, 1, sharding=Sharding.FSDP, dp=4)
    # the whole stage unsharded through a step: fp32 parameters and accumulated fp32 gradients, and
    # autocast's bf16 copy of every weight
    assert cm.fsdp_unsharded_bytes_per_param(Precision.BF16) == 10
    assert cm.fsdp_unsharded_bytes_per_param(Precision.FP32) == 8
    work = 10 * params
    # so FSDP needs less memory than replicas only from three shards on (16/d + 10 < 18 in bf16)
    for d, fewer in ((2, False), (3, True)):
        replica = cm.stage_memory_bytes(M, 1, 2, 1, B, S, 1)
        assert (cm.stage_memory_bytes(M, 1, 2, 1, B, S, 1, sharding=Sharding.FSDP, dp=d) < replica) is fewer
    act = 2 * S * B * 1024 * (10 + 24 + 5 * 8 * S / 1024)
    assert got == pytest.approx(16 * params / 4 + work + act + cm.RESERVED_GIB * cm.GIB)
    fused = cm.stage_memory_bytes(M, 1, 2, 1, B, S, 1, sharding=Sharding.FSDP, dp=4, fused_attention=True)
    assert got - fused == pytest.approx(2 * S * B * 1024 * 5 * 8 * S / 1024)  # no stored s×s scores
    # as the executor runs FSDP2 in a pipeline: one all-gather of the fp32 parameters per step (not per
    # micro-batch, not twice), with the gradients' fp32 reduce-scatter after the drain; nothing per micro-batch
    slow = _h100(inter_node_gbps=1.0)
    st = Stage(cluster="a", first_layer=1, last_layer=2, dp=16, sharding=Sharding.FSDP)
    assert cm.PARAM_GATHER_BYTES == 4
    sync = cm._dp_sync_time(M, st, slow, Precision.BF16)
    assert sync == pytest.approx(15 / 16 * 4 * params * 8 / 1e9 + 15 / 16 * 4 * params * 8 / 1e9)
    assert cm._dp_sync_time(M, st, slow, Precision.FP32) == sync  # fp32 master weights in every precision
    topo = Topology(clusters=(slow,))
    job = JobSpec(id="j", model=M, global_batch=64, micro_batch=2, seq_len=S, gpus=GpuRange(min=1, max=16))
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=3, dp=16, sharding=Sharding.FSDP),),
                micro_batches=32)
    bd = cm.evaluate_with_breakdown(plan, topo, job)[1]
    assert bd.compute_s[0] == cm.stage_compute_time(M, slow, 0, 3, 1, B, S)
    full = cm.stage_params(M, 0, 3)
    assert bd.dp_sync_s == pytest.approx(2 * 15 / 16 * 4 * full * 8 / 1e9)


def test_evaluate_prices_sharding_recompute_and_precision() -> None:
    topo = Topology(clusters=(_h100(),))
    job = JobSpec(id="j", model=M, global_batch=16, micro_batch=2, seq_len=S, gpus=GpuRange(min=1, max=16))
    rep = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=3, dp=8),), micro_batches=8)
    fsdp = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=3, dp=8, sharding=Sharding.FSDP,
                              recompute=True),), micro_batches=8)
    r, f = cm.evaluate(rep, topo, job), cm.evaluate(fsdp, topo, job)
    assert f.memory_gib_per_gpu[0] < r.memory_gib_per_gpu[0]
    assert f.step_time_s > r.step_time_s  # recomputation costs a forward
    fp32 = cm.evaluate(rep, topo, JobSpec(id="j", model=M, global_batch=16, micro_batch=2, seq_len=S,
                                          gpus=GpuRange(min=1, max=16), precision=Precision.FP32))
    # fp32 compute is far slower; the gradient all-reduce moves fp32 values in both precisions
    assert fp32.step_time_s > 4 * r.step_time_s and fp32.memory_gib_per_gpu[0] > r.memory_gib_per_gpu[0]
