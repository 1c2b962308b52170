"""The calibrated terms (``layer_overhead_ms``: fixed fwd+bwd per layer and micro-batch; ``optimizer_ms_per_layer``:
Adam per layer and step) and the wire format reach the closed form, level 1/2 and the timeline alike:
hand-computed values on a case where they must coincide."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Plan, Schedule, Stage, Topology
from spiderflow.core.tpa import plan_chain, simulate_plan
from spiderflow.core.tpa.level1 import ChainContext, evaluate_split
from spiderflow.core.tpa.planner import plan_from_split

# L=4, h=64, a=4, V=128, s=32, b=1: per-layer forward FLOPs f = 24·32·64² + 4·32²·64 = 3 407 872,
# head forward 2·32·64·128 = 524 288. A cpu "GPU" at 0.05 TFLOPS × mfu 0.5 = 2.5e10 FLOP/s.
MODEL = ModelSpec(name="tiny", layers=4, hidden=64, heads=4, vocab=128)
F = 24 * 32 * 64**2 + 4 * 32**2 * 64
HEAD = 2 * 32 * 64 * 128
RATE = 0.05e12 * 0.5
O_MS = 2.0  # layer_overhead_ms on both clusters
U_MS = {"a": 3.0, "b": 1.0}  # optimizer_ms_per_layer
M = 4


def _topo(overhead_ms: float = O_MS, opt: dict[str, float] | None = None) -> Topology:
    u = U_MS if opt is None else opt
    cs = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1, tflops=0.05, mfu=0.5,
                       layer_overhead_ms=overhead_ms, optimizer_ms_per_layer=u[n]) for n in ("a", "b"))
    return Topology(clusters=cs, links=(Link(a="a", b="b", bandwidth_gbps=10.0, latency_ms=0.0),))


JOB = JobSpec(id="j", model=MODEL, global_batch=M, micro_batch=1, seq_len=32, gpus=GpuRange(min=2, max=2))
STAGES = (Stage(cluster="a", first_layer=0, last_layer=1), Stage(cluster="b", first_layer=2, last_layer=3))


def _hand_step() -> float:
    t0 = 3 * 2 * F / RATE + 2 * O_MS / 1e3  # stage a: 2 layers
    t1 = 3 * (2 * F + HEAD) / RATE + 2 * O_MS / 1e3  # stage b: 2 layers + head (the bottleneck)
    p = 2 * 32 * 64 * 8 / 10e9  # bf16 activations (the job's compute dtype) over 10 Gbit/s, no latency
    # the 1F1B window (2 in flight on stage a) hides the round trip: T_0 + 2P ≤ T_1
    assert t0 + 2 * p <= t1
    opt = max(2 * U_MS["a"], 2 * U_MS["b"]) / 1e3  # stages step in parallel: the slower one, 6 ms
    return (M - 1) * t1 + t0 + t1 + 2 * p + opt


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE])
def test_closed_form_and_timeline_coincide_with_calibrated_terms(schedule: Schedule) -> None:
    """Last stage the bottleneck, the round trip inside every schedule's window, no data parallelism: the
    event timeline's critical path is the closed form's ``(m−1)·T_1 + T_0 + T_1 + 2P`` exactly, and both add
    the slower stage's optimizer step after the drain."""
    topo = _topo()
    plan = evaluate(Plan(stages=STAGES, micro_batches=M, schedule=schedule), topo, JOB)
    want = _hand_step()
    assert plan.step_time_s == pytest.approx(want, rel=1e-12)
    tl = simulate_plan(plan, topo, JOB)
    assert tl.step_s == pytest.approx(want, rel=1e-12)
    assert tl.step_s - tl.makespan_s == pytest.approx(6e-3, rel=1e-9)  # stage a's 2 layers · 3 ms


def test_level1_estimate_equals_evaluate_with_calibrated_terms() -> None:
    """Level 1's step estimate of a split (level-2 configurations) is ``evaluate``'s step of the plan it
    makes, per-layer overhead and optimizer step included."""
    topo = _topo()
    ctx = ChainContext.build(topo, list(topo.clusters), [1, 1], MODEL, micro_batch=1, seq_len=32, m=M,
                             schedule=Schedule.ONE_F_ONE_B)
    ev = evaluate_split(ctx, (2, 2))
    assert ev.feasible
    assert ev.step_s == pytest.approx(_hand_step(), rel=1e-12)
    plan = evaluate(plan_from_split(ctx, ev), topo, JOB)
    assert plan.step_time_s == pytest.approx(ev.step_s, rel=1e-12)
    # Each term moves the level-1 estimate as it moves evaluate.
    for t in (_topo(overhead_ms=0.0), _topo(opt={"a": 0.0, "b": 5.0})):
        c = ChainContext.build(t, list(t.clusters), [1, 1], MODEL, micro_batch=1, seq_len=32, m=M,
                               schedule=Schedule.ONE_F_ONE_B)
        e = evaluate_split(c, (2, 2))
        assert e.step_s == pytest.approx(evaluate(plan_from_split(c, e), t, JOB).step_time_s, rel=1e-12)


def test_planner_prediction_timeline_and_closed_form_agree_on_calibrated_clusters() -> None:
    """The planner's prediction (``step_time_s``, what ``spiderflow up`` prints) is evaluate's, and its
    timeline step carries the same optimizer step; here the two coincide (single replica, bottleneck last)."""
    topo = _topo()
    plan = plan_chain(topo, JOB, [("a", 1), ("b", 1)], micro_batches=[M], schedules=[Schedule.ONE_F_ONE_B])
    assert plan.step_time_s == pytest.approx(evaluate(plan, topo, JOB).step_time_s, rel=1e-12)
    assert plan.extras["closed_form_step_s"] == plan.step_time_s
    split = tuple(st.layers for st in plan.stages)
    if split == (2, 2):
        assert plan.step_time_s == pytest.approx(_hand_step(), rel=1e-12)
    assert plan.extras["timeline_step_s"] == pytest.approx(simulate_plan(plan, topo, JOB).step_s, rel=1e-12)
    bd_opt = max(st.layers * U_MS[st.cluster] for st in plan.stages) / 1e3
    tl = simulate_plan(plan, topo, JOB)
    assert tl.step_s - tl.makespan_s >= bd_opt - 1e-12


@pytest.mark.parametrize("seed", [1, 2])
def test_level1_estimate_equals_evaluate_with_measured_outer_work_on_generated_chains(seed: int) -> None:
    """With a profile's measured embedding, head (and loss), optimizer steps and input pipeline on every
    cluster, level 1's step estimate of a split — built from level 2's configurations — is ``evaluate``'s step
    of the plan it makes (to 1e-9 relative), and the measured terms move it: the compiled searches price the
    work outside the blocks as the closed form does."""
    from dataclasses import replace

    from spiderflow.core.catalog import model_preset
    from spiderflow.core.topogen import generate_topology

    base = generate_topology(8, seed, "geo")
    chain = [c for c in base.clusters if c.free >= 8][:3]
    model = model_preset("gpt3-1.3b")
    job = JobSpec(id="j", model=model, global_batch=64, micro_batch=4, seq_len=2048, gpus=GpuRange(min=1, max=64))
    measured = replace(base, clusters=tuple(
        replace(c, embedding_us_per_token=0.05 + 0.01 * i, head_us_per_token=0.4 + 0.1 * i,
                embedding_optimizer_ms=6.0, head_optimizer_ms=5.0 + i, data_ms_per_sample=0.3)
        for i, c in enumerate(base.clusters)))
    split = (8, 8, model.layers - 16)
    steps = []
    for topo in (base, measured):
        cl = [topo.cluster(c.name) for c in chain]
        ctx = ChainContext.build(topo, cl, [8, 8, 8], model, micro_batch=4, seq_len=2048, m=16,
                                 schedule=Schedule.ONE_F_ONE_B)
        ev = evaluate_split(ctx, split)
        assert ev.feasible
        plan = evaluate(plan_from_split(ctx, ev), topo, job)
        assert plan.step_time_s == pytest.approx(ev.step_s, rel=1e-9)
        steps.append(ev.step_s)
    assert steps[1] != steps[0]
