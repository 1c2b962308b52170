"""Framework options a plan may carry (overlap, op-level selective recomputation, eager fp32 loss), by hand."""

from __future__ import annotations

import pytest

from spiderflow.core import costmodel as cm
from spiderflow.core.catalog import MODEL_PRESETS, ModelSpec
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Plan, Stage, Topology
from spiderflow.core.errors import ValidationError

M = ModelSpec(name="t", layers=4, hidden=1024, heads=8, vocab=1000)
B, S = 2, 512


def _topo() -> Topology:
    c = Cluster(name="a", gpu="H100-80G", nodes=2, gpus_per_node=8, intra_node_gbps=3600.0, inter_node_gbps=400.0)
    return Topology(clusters=(c,), links=())


def _plan(**extras: float) -> Plan:
    st = (Stage(cluster="a", first_layer=0, last_layer=1, tp=4, dp=2),
          Stage(cluster="a", first_layer=2, last_layer=3, tp=4, dp=2))
    return Plan(stages=st, micro_batches=4, extras=dict(extras))


def _job() -> JobSpec:
    return JobSpec(id="j", model=M, global_batch=8, micro_batch=2, seq_len=S, gpus=GpuRange(min=1, max=16))


def test_options_off_price_exactly_as_before() -> None:
    topo, job = _topo(), _job()
    base = cm.evaluate(_plan(), topo, job)
    off = cm.evaluate(_plan(overlap=0.0, selective_recompute=0.0), topo, job)
    assert (off.step_time_s, off.memory_gib_per_gpu) == (base.step_time_s, base.memory_gib_per_gpu)


def test_bad_option_value_names_the_key() -> None:
    with pytest.raises(ValidationError, match=r"plan\.extras\.overlap"):
        cm.plan_options(_plan(overlap=0.5))


def test_overlap_hides_tp_and_dp_communication() -> None:
    topo, job, c = _topo(), _job(), _topo().clusters[0]
    raw = cm.stage_compute_time(M, c, 0, 1, 4, B, S)
    comp = cm.stage_compute_time(M, c, 0, 1, 4, B, S, overlap=False) - 4 * 2 * cm.allreduce_time(
        2.0 * B * S * 1024, 4, 3600.0)
    hidden = cm.stage_compute_time(M, c, 0, 1, 4, B, S, overlap=True)
    comm = raw - comp
    matmuls = 3 * 2 * 2.0 * B * S * M.params_per_layer / (4 * cm.compute_rate_tflops(c) * 1e12)
    assert hidden == pytest.approx(comp + max(comm / 4, comm - matmuls))
    bd_off = cm.breakdown(_plan(), topo, M, micro_batch=B, seq_len=S)
    bd_on = cm.breakdown(_plan(overlap=1.0), topo, M, micro_batch=B, seq_len=S)
    assert all(on <= off for on, off in zip(bd_on.allreduce_s, bd_off.allreduce_s, strict=True))
    # the gradient all-reduce keeps at least its last bucket exposed
    assert cm.exposed_dp_sync(1.0, 10.0, 8e7, 2) == pytest.approx(0.5)
    assert cm.exposed_dp_sync(1.0, 0.2, 8e9, 2) == pytest.approx(0.8)
    assert cm.evaluate(_plan(overlap=1.0), topo, job).step_time_s < cm.evaluate(_plan(), topo, job).step_time_s


def test_selective_recompute_by_hand_on_a_llama_block() -> None:
    m = MODEL_PRESETS["llama3-8b"]
    h, kv, f = 4096, 1024, 14336
    # the 1st, 3rd, 5th and 7th matmuls (wq, wv, w1, w2) are saved; wk, wo and w3 are recomputed
    assert cm.selective_recompute_flops(m, 2, 8192) == pytest.approx(2.0 * 2 * 8192 * h * (kv + h + f))
    saved = cm.selective_saved_bytes(m, 1, 2, 8192)
    assert saved == pytest.approx(2.0 * 2 * 8192 * (h + h + (h + kv + f + h)))  # input + attention out + saved
    c = _topo().clusters[0]
    base = cm.stage_compute_time(m, c, 1, 2, 1, 2, 8192)
    sel = cm.stage_compute_time(m, c, 1, 2, 1, 2, 8192, selective=True)
    assert sel == pytest.approx(base + 2 * cm.selective_recompute_flops(m, 2, 8192) / (c.effective_tflops * 1e12))
    full = cm.stage_memory_bytes(m, 1, 2, 1, 2, 8192, 1, fused_attention=True)
    sac = cm.stage_memory_bytes(m, 1, 2, 1, 2, 8192, 1, fused_attention=True, selective=True)
    act = cm.layer_activation_bytes(m, 1, 2, 8192, fused_attention=True)
    assert sac == pytest.approx(full - 2 * act + 2 * saved + act)


def test_the_loss_is_held_on_the_last_stage_per_in_flight_micro_batch() -> None:
    # the eager fp32 loss (the executor's and torchtitan's), last stage only: the saved log-softmax per in-flight
    # micro-batch, the logits' copies and gradients once; one in flight prices LOGIT_BYTES per logit value
    one = cm.stage_memory_bytes(M, 2, 3, 2, B, S, 1)
    two = cm.stage_memory_bytes(M, 2, 3, 2, B, S, 2)
    blocks = 2 * cm.stage_activation_bytes_per_microbatch(M, 2, 2, 2, B, S)
    assert two - one == pytest.approx(blocks + cm.LOGIT_SAVED_BYTES * B * S * M.vocab / 2)
    idle = cm.stage_memory_bytes(M, 2, 3, 2, B, S, 0)  # state and reserve: nothing in flight, no loss
    assert one - idle == pytest.approx(blocks + cm.LOGIT_BYTES * B * S * M.vocab / 2)
    assert cm.loss_bytes(M, B, S, 2, 1) == cm.LOGIT_BYTES * B * S * M.vocab / 2  # 1F1B's last stage: as before
    assert cm.loss_bytes(M, B, S, 2, 3) == pytest.approx((3 * 4 + 14) * B * S * M.vocab / 2)
    first_one, first_two = cm.stage_memory_bytes(M, 0, 1, 2, B, S, 1), cm.stage_memory_bytes(M, 0, 1, 2, B, S, 2)
    assert first_two - first_one == pytest.approx(2 * cm.stage_activation_bytes_per_microbatch(M, 0, 0, 2, B, S))
