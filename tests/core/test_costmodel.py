"""Hand-computed checks of every cost-model term (DESIGN.md §3; formulas in spiderflow/core/costmodel.py)."""

from __future__ import annotations

import math

import pytest

from spiderflow.core import costmodel as cm
from spiderflow.core.catalog import ModelSpec
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Plan, Precision, Schedule, Stage, Topology

# A small model whose numbers are easy to do by hand: L=4, h=1024, a=8, V=1000.
M = ModelSpec(name="hand", layers=4, hidden=1024, heads=8, vocab=1000)
B, S = 2, 512


def test_layer_flops_by_hand() -> None:
    # 24·b·s·h² + 4·b·s²·h = 24·2·512·1024² + 4·2·512²·1024
    assert cm.layer_fwd_flops(M, B, S) == 24 * 2 * 512 * 1024**2 + 4 * 2 * 512**2 * 1024
    assert cm.layer_fwd_flops(M, B, S) == pytest.approx(2.7917287424e10)


def test_activation_bytes_by_hand() -> None:
    assert cm.activation_bytes(M, B, S) == 2 * 2 * 512 * 1024  # 2 MiB


def test_stage_params_include_embedding_and_head() -> None:
    per_layer = 12 * 1024**2
    assert cm.stage_params(M, 1, 2) == 2 * per_layer
    assert cm.stage_params(M, 0, 0) == per_layer + 1000 * 1024
    assert cm.stage_params(M, 3, 3) == per_layer + 1000 * 1024
    assert cm.stage_params(M, 0, 3) == 4 * per_layer + 2 * 1000 * 1024


def test_transfer_time_by_hand() -> None:
    # 1 GB over 8 Gbit/s = 1 s, plus 20 ms.
    assert cm.transfer_time(1e9, 8.0, 20.0) == pytest.approx(1.02)
    assert cm.transfer_time(1e9, 0.0, 1.0) == math.inf


def test_ring_allreduce_by_hand() -> None:
    # 2(d−1)/d · x/B + 2(d−1)λ with d=4, x=1 GB, B=8 Gbit/s, λ=1 ms → 1.5 s + 6 ms
    assert cm.allreduce_time(1e9, 4, 8.0, 1.0) == pytest.approx(1.506)
    assert cm.allreduce_time(1e9, 1, 8.0, 1.0) == 0.0


def _cluster(name: str, tflops: float = 100.0, mfu: float = 0.5) -> Cluster:
    return Cluster(name=name, gpu="A100-80G", nodes=1, gpus_per_node=8, intra_node_gbps=800,
                   inter_node_gbps=100, tflops=tflops, mfu=mfu, electricity_usd_per_kwh=0.2)


def test_stage_compute_time_by_hand() -> None:
    c = _cluster("x")  # 50 TFLOP/s effective per GPU
    t = cm.stage_compute_time(M, c, 1, 2, 1, B, S)
    assert t == pytest.approx(3 * 2 * 2.7917287424e10 / 50e12)
    # tp=2 halves compute and adds 4 all-reduces per layer of 2 MiB over 800 Gbit/s: 2·(1/2)·x/B each
    t2 = cm.stage_compute_time(M, c, 1, 2, 2, B, S)
    ar = 1.0 * 2 * 2 * 512 * 1024 * 8 / 800e9
    assert t2 == pytest.approx(3 * 2 * 2.7917287424e10 / 100e12 + 8 * ar)


def test_pipeline_step_closed_form_by_hand() -> None:
    # (m−1)·max(T/d, P) + ΣT + 2ΣP with T=(1,2,1), d=(1,2,1), P=(0.5,0.25), m=8
    got = cm.pipeline_step_time([1.0, 2.0, 1.0], [1, 2, 1], [0.5, 0.25], 8)
    assert got == pytest.approx(7 * 1.0 + 4.0 + 2 * 0.75)
    # a slow link becomes the bottleneck
    assert cm.pipeline_step_time([1.0, 1.0], [1, 1], [3.0], 4) == pytest.approx(3 * 3.0 + 2.0 + 6.0)
    # interleaving with v chunks shrinks the fill and multiplies crossings
    assert cm.pipeline_step_time([1.0, 1.0], [1, 1], [0.1], 4, chunks=2) == pytest.approx(3 * 1.0 + 1.0 + 0.4)


def test_memory_by_hand() -> None:
    # stage with layers 1..2, tp=1: 18 B/param · 2·12h² + in-flight · activation + reserve
    params = 2 * 12 * 1024**2
    act = 2 * (512 * 2 * 1024 * (10 + 24 + 5 * 8 * 512 / 1024))
    got = cm.stage_memory_bytes(M, 1, 2, 1, B, S, in_flight=3)
    assert got == pytest.approx(18 * params + 3 * act + cm.RESERVED_GIB * cm.GIB)


def test_in_flight_gpipe_vs_1f1b() -> None:
    assert cm.in_flight_microbatches(Schedule.GPIPE, 16, 1, 0, 4) == 16
    assert cm.in_flight_microbatches(Schedule.ONE_F_ONE_B, 16, 1, 0, 4) == 4
    assert cm.in_flight_microbatches(Schedule.ONE_F_ONE_B, 16, 1, 3, 4) == 1
    assert cm.in_flight_microbatches(Schedule.ONE_F_ONE_B, 16, 8, 0, 4) == 2


def test_evaluate_end_to_end_by_hand() -> None:
    topo = Topology(
        clusters=(_cluster("a"), _cluster("b")),
        links=(Link(a="a", b="b", bandwidth_gbps=1.0, latency_ms=10.0),),
    )
    job = JobSpec(id="j", model=M, global_batch=16, micro_batch=2, seq_len=512, steps=1, gpus=GpuRange(min=1, max=8))
    stages = (Stage(cluster="a", first_layer=0, last_layer=1), Stage(cluster="b", first_layer=2, last_layer=3))
    plan = Plan(stages=stages, micro_batches=8, schedule=Schedule.ONE_F_ONE_B)
    out = cm.evaluate(plan, topo, job)
    lf = 2.7917287424e10
    head = 2 * B * S * 1024 * 1000
    t0 = 3 * 2 * lf / 50e12
    t1 = 3 * (2 * lf + head) / 50e12
    p = 2 * 2 * 512 * 1024 * 8 / 1e9 + 0.010
    want = 7 * max(t0, t1, p) + t0 + t1 + 2 * p
    assert out.step_time_s == pytest.approx(want)
    assert out.throughput_tokens_per_s == pytest.approx(16 * 512 / want)
    kw = 400 / 1000
    assert out.usd_per_step == pytest.approx(2 * kw * want / 3600 * 0.2)
    assert len(out.memory_gib_per_gpu) == 2


def test_widest_path_relay() -> None:
    topo = Topology(
        clusters=(_cluster("a"), _cluster("b"), _cluster("c")),
        links=(Link(a="a", b="b", bandwidth_gbps=2.0, latency_ms=5.0),
               Link(a="b", b="c", bandwidth_gbps=1.0, latency_ms=7.0),
               Link(a="a", b="c", bandwidth_gbps=0.5, latency_ms=1.0)),
    )
    # a→c: direct 0.5 Gbit/s vs relay via b with bottleneck 1.0 → relay wins, latency 12 ms
    assert topo.bandwidth_gbps("a", "c") == 1.0
    assert topo.latency_ms("a", "c") == 12.0
    assert topo.components() == [["a", "b", "c"]]


def test_boundary_sends_the_jobs_compute_dtype_on_every_device_by_hand() -> None:
    # bf16: A = 2·b·s·h = 2·2·512·1024 = 2 MiB over 1 Gbit/s + 10 ms, on CPU clusters as on GPU clusters;
    # fp32: 4 bytes per value.
    assert cm.activation_bytes(M, B, S, 2) == 2 * 2 * 512 * 1024
    cpu = [Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1, tflops=0.05, mfu=0.5) for n in ("p", "q")]
    topo = Topology(clusters=tuple(cpu), links=(Link(a="p", b="q", bandwidth_gbps=1.0, latency_ms=10.0),))
    a, b = (Stage(cluster=c.name, first_layer=i, last_layer=i) for i, c in enumerate(cpu))
    assert cm.boundary_time(topo, M, a, b, B, S) == pytest.approx(2 * 2 * 512 * 1024 * 8 / 1e9 + 0.010)
    fp32 = cm.boundary_time(topo, M, a, b, B, S, Precision.FP32)
    assert fp32 == pytest.approx(4 * 2 * 512 * 1024 * 8 / 1e9 + 0.010)
    gpu = Topology(clusters=(_cluster("p"), _cluster("q")),
                   links=(Link(a="p", b="q", bandwidth_gbps=1.0, latency_ms=10.0),))
    assert cm.boundary_time(gpu, M, a, b, B, S) == pytest.approx(2 * 2 * 512 * 1024 * 8 / 1e9 + 0.010)


def test_layer_overhead_adds_a_fixed_time_per_layer_and_micro_batch() -> None:
    plain = _cluster("x")
    slow = Cluster(name="x", gpu="A100-80G", nodes=1, gpus_per_node=8, intra_node_gbps=800,
                   inter_node_gbps=100, tflops=100.0, mfu=0.5, electricity_usd_per_kwh=0.2, layer_overhead_ms=1.5)
    base = cm.stage_compute_time(M, plain, 1, 2, 1, B, S)
    # two layers: + 2 · 1.5 ms, whatever the micro-batch size (it is the part that does not scale with b·s)
    assert cm.stage_compute_time(M, slow, 1, 2, 1, B, S) == pytest.approx(base + 2 * 1.5e-3)
    small = cm.stage_compute_time(M, plain, 0, 3, 1, 1, 8)
    assert cm.stage_compute_time(M, slow, 0, 3, 1, 1, 8) == pytest.approx(small + 4 * 1.5e-3)
    # the default (0) leaves every prediction as it was
    assert Cluster(name="x", gpu="A100-80G", nodes=1, gpus_per_node=8).layer_overhead_ms == 0.0


def test_layer_overhead_reaches_the_step_prediction() -> None:
    def topo(overhead: float) -> Topology:
        cs = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1, tflops=0.05, mfu=0.5,
                           layer_overhead_ms=overhead) for n in ("a", "b"))
        return Topology(clusters=cs, links=(Link(a="a", b="b", bandwidth_gbps=1.0, latency_ms=1.0),))

    job = JobSpec(id="j", model=M, global_batch=8, micro_batch=1, seq_len=64, gpus=GpuRange(min=2, max=2))
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1, tp=1, dp=1),
                                    Stage(cluster="b", first_layer=2, last_layer=3, tp=1, dp=1)),
                micro_batches=8, schedule=Schedule.ONE_F_ONE_B)
    base = cm.evaluate(plan, topo(0.0), job).step_time_s
    # every stage's T grows by 2 layers · 2 ms: (m − 1)·ΔT + ΣΔT = 7·4 ms + 8 ms
    assert cm.evaluate(plan, topo(2.0), job).step_time_s == pytest.approx(base + 7 * 4e-3 + 8e-3)


def test_optimizer_time_per_layer_is_charged_once_per_step_on_the_slowest_stage() -> None:
    def topo(opt_a: float, opt_b: float) -> Topology:
        cs = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1, tflops=0.05, mfu=0.5, optimizer_ms_per_layer=u)
                   for n, u in (("a", opt_a), ("b", opt_b)))
        return Topology(clusters=cs, links=(Link(a="a", b="b", bandwidth_gbps=1.0, latency_ms=1.0),))

    job = JobSpec(id="j", model=M, global_batch=8, micro_batch=1, seq_len=64, gpus=GpuRange(min=2, max=2))
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=0, tp=1, dp=1),
                        Stage(cluster="b", first_layer=1, last_layer=3, tp=1, dp=1)),
                micro_batches=8, schedule=Schedule.ONE_F_ONE_B)
    base = cm.evaluate(plan, topo(0.0, 0.0), job).step_time_s
    # stage a: 1 layer · 5 ms, stage b: 3 layers · 1 ms; stages step in parallel, the slower one counts
    assert cm.evaluate(plan, topo(5.0, 1.0), job).step_time_s == pytest.approx(base + 5e-3)
    assert cm.evaluate(plan, topo(1.0, 4.0), job).step_time_s == pytest.approx(base + 12e-3)
    bd = cm.breakdown(plan, topo(1.0, 4.0), M, micro_batch=1, seq_len=64)
    assert bd.optimizer_s == pytest.approx((1e-3, 12e-3)) and bd.dp_sync_s == pytest.approx(12e-3)


def test_in_flight_cap_bounds_1f1b_and_latency_aware_only() -> None:
    # 4 stages, m=16: 1F1B holds 4,3,2,1; latency-aware 8,6,4,2; under K=3: min(κ, 3).
    f1 = [cm.in_flight_microbatches(Schedule.ONE_F_ONE_B, 16, 1, i, 4, max_in_flight=3) for i in range(4)]
    la = [cm.in_flight_microbatches(Schedule.LATENCY_AWARE, 16, 1, i, 4, max_in_flight=3) for i in range(4)]
    assert f1 == [3, 3, 2, 1] and la == [3, 3, 3, 2]
    # GPipe and interleaved orders are not shortened by the cap
    assert cm.in_flight_microbatches(Schedule.GPIPE, 16, 1, 0, 4, max_in_flight=3) == 16
    assert cm.in_flight_microbatches(Schedule.INTERLEAVED_1F1B, 16, 1, 0, 4, max_in_flight=3) == 4


def test_evaluate_charges_memory_under_the_plans_in_flight_cap_by_hand() -> None:
    topo = Topology(clusters=(_cluster("a"), _cluster("b")),
                    links=(Link(a="a", b="b", bandwidth_gbps=1.0, latency_ms=10.0),))
    job = JobSpec(id="j", model=M, global_batch=16, micro_batch=2, seq_len=512, steps=1, gpus=GpuRange(min=1, max=8))
    stages = (Stage(cluster="a", first_layer=0, last_layer=1), Stage(cluster="b", first_layer=2, last_layer=3))
    la = Plan(stages=stages, micro_batches=8, schedule=Schedule.LATENCY_AWARE)
    capped = Plan(stages=stages, micro_batches=8, schedule=Schedule.LATENCY_AWARE, extras={"max_in_flight": 2.0})
    # Activation bytes per micro-batch and layer (tp=1): s·b·h·(10 + 24 + 5·a·s/h) = 512·2·1024·54
    act = 512 * 2 * 1024 * (10 + 24 + 5 * 8 * 512 / 1024)
    saved = cm.LOGIT_SAVED_BYTES * 2 * 512 * 1000  # per in-flight micro-batch
    once = cm.LOGIT_ONCE_BYTES * 2 * 512 * 1000  # once on the last stage
    fixed0 = 18 * (2 * 12 * 1024**2 + 1000 * 1024) + cm.RESERVED_GIB * cm.GIB
    fixed1 = fixed0
    # uncapped latency-aware: stage 0 holds min(8, 2·2) = 4, stage 1 min(8, 2) = 2; capped at K=2: 2 and 2
    want_la = ((fixed0 + 4 * 2 * act) / cm.GIB, (fixed1 + 2 * (2 * act + saved) + once) / cm.GIB)
    want_cap = ((fixed0 + 2 * 2 * act) / cm.GIB, (fixed1 + 2 * (2 * act + saved) + once) / cm.GIB)
    assert cm.evaluate(la, topo, job).memory_gib_per_gpu == pytest.approx(want_la)
    out = cm.evaluate(capped, topo, job)
    assert out.memory_gib_per_gpu == pytest.approx(want_cap)
    # the cap changes memory only: the closed-form step is the same
    assert out.step_time_s == cm.evaluate(la, topo, job).step_time_s
