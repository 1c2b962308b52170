"""One prediction: the planner chooses the micro-batch count and the schedule on the exact timeline and reports
that timeline's step, so no pinned count or schedule beats the plan it returns on the figure it reports.

The corpus: the 4-region 40 Gbit/s chain at 100 ms (where the closed form once chose latency-aware, m = 8)
and 12 chains of 1–3 clusters of generated topologies (GPT-3 1.3B/6.7B/13B, global batch 128)."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import ModelSpec, model_preset
from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Schedule, Topology
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.topogen import generate_topology
from spiderflow.core.tpa import evaluate_on_timeline, micro_batch_candidates, plan_chain, simulate_plan

Case = tuple[str, Topology, JobSpec, list[tuple[str, int]]]


def _corpus() -> list[Case]:
    model = ModelSpec(name="wan", layers=16, hidden=2048, heads=16, vocab=32000)
    clusters = tuple(Cluster(name=f"r{i}", gpu="A100-80G", nodes=1, gpus_per_node=4) for i in range(4))
    links = tuple(Link(a=f"r{i}", b=f"r{i + 1}", bandwidth_gbps=40.0, latency_ms=100.0) for i in range(3))
    wan = JobSpec(id="wan", model=model, global_batch=64, seq_len=2048, gpus=GpuRange(min=16, max=16))
    out: list[Case] = [("wan-100ms", Topology(clusters=clusters, links=links), wan, [(f"r{i}", 4) for i in range(4)])]
    for seed in range(4):
        topo = generate_topology(8, seed)
        for k, name in enumerate(("gpt3-1.3b", "gpt3-6.7b", "gpt3-13b")):
            n = 1 + (seed + k) % 3
            alloc = [(c.name, min(c.free, 16)) for c in [c for c in topo.clusters if c.free > 0][:n]]
            job = JobSpec(id="g", model=model_preset(name), global_batch=128, seq_len=2048,
                          gpus=GpuRange(min=1, max=64))
            out.append((f"{seed}-{name}-{n}", topo, job, alloc))
    return out


CORPUS = _corpus()


@pytest.mark.parametrize("case", CORPUS, ids=[c[0] for c in CORPUS])
def test_no_pinned_count_or_schedule_beats_the_plan_on_its_reported_step(case: Case) -> None:
    _, topo, job, alloc = case
    plan = plan_chain(topo, job, alloc)
    # What it reports is the exact timeline of what it returns (memory and the closed form: the cost model's).
    assert plan.step_time_s == simulate_plan(plan, topo, job, record=False).step_s
    assert plan.extras["timeline_step_s"] == plan.step_time_s
    assert plan.extras["closed_form_step_s"] == evaluate(plan, topo, job).step_time_s
    assert evaluate_on_timeline(plan, topo, job).step_time_s == plan.step_time_s
    assert plan.throughput_tokens_per_s == pytest.approx(job.tokens_per_step / plan.step_time_s)
    for m in micro_batch_candidates(job.global_batch, len(alloc)):
        try:
            pinned = plan_chain(topo, job, alloc, micro_batches=[m])
        except UnschedulableError:
            continue
        assert plan.step_time_s <= pinned.step_time_s * (1 + 1e-9), m
    for sched in Schedule:
        try:
            pinned = plan_chain(topo, job, alloc, micro_batches=[plan.micro_batches], schedules=[sched])
        except UnschedulableError:
            continue
        assert plan.step_time_s <= pinned.step_time_s * (1 + 1e-9), sched


def test_the_slow_chain_moves_to_the_count_the_timeline_prefers() -> None:
    """At 100 ms the closed form's choice (latency-aware, m = 8) simulates at 1.795 s; the timeline's is GPipe
    with m = 64 (every micro-batch in flight hides the round trips), 1.312 s."""
    _, topo, job, alloc = CORPUS[0]
    plan = plan_chain(topo, job, alloc)
    assert (plan.micro_batches, plan.schedule) == (64, Schedule.GPIPE)
    assert plan.step_time_s == pytest.approx(1.3122, rel=1e-3)
    old = plan_chain(topo, job, alloc, micro_batches=[8], schedules=[Schedule.LATENCY_AWARE])
    assert old.step_time_s > 1.3 * plan.step_time_s


def test_stage_times_given_to_the_timeline_must_be_finite() -> None:
    """An infinite stage time (a caller's measured one) is refused naming the stage, not reported as an op
    order that deadlocks."""
    import dataclasses

    from spiderflow.core.errors import ValidationError
    from spiderflow.core.tpa.timeline import plan_stage_timing

    _, topo, job, alloc = CORPUS[0]
    plan = plan_chain(topo, job, alloc)
    stages, ser, lat, chunks = plan_stage_timing(plan, topo, job)
    assert simulate_plan(plan, topo, job, record=False, timing=(stages, ser, lat, chunks)).step_s == plan.step_time_s
    broken = [dataclasses.replace(stages[0], compute_s=float("inf")), *stages[1:]]
    for record in (False, True):
        with pytest.raises(ValidationError, match=r"timing\.stages\[0\]\.compute_s"):
            simulate_plan(plan, topo, job, record=record, timing=(broken, ser, lat, chunks))
