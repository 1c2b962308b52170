"""Queue policy: ordering, aging (no starvation) and EASY backfilling guarantees."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec
from spiderflow.core.errors import ValidationError
from spiderflow.core.queueing import (
    Claim,
    Holding,
    QueuedJob,
    QueuePolicy,
    RunningJob,
    admits,
    after_admit,
    estimate_network_share,
    estimate_work_gpu_s,
    expected_releases,
    order,
    queued_job,
    reserve,
    reserve_at,
    score,
)

POLICY = QueuePolicy(starvation_s=1e12)  # aging only, the starvation override is tested separately


def q(id: str, *, t: float = 0.0, work: float = 3600.0, prio: int = 0, net: float = 0.0, gpus: int = 8) -> QueuedJob:
    return QueuedJob(id=id, enqueued_s=t, min_gpus=gpus, work_gpu_s=work, network_share=net, priority=prio)


def test_short_jobs_go_before_long_ones_to_avoid_head_of_line_blocking() -> None:
    jobs = [q("long", work=1e7), q("short", work=1e3)]
    assert [j.id for j in order(jobs, 0.0, POLICY)] == ["short", "long"]


def test_priority_and_network_use_move_jobs() -> None:
    assert [j.id for j in order([q("a"), q("b", prio=50)], 0.0, POLICY)] == ["b", "a"]
    # With the network busy, the network-heavy job yields; with the network idle the order is by id/ties.
    jobs = [q("heavy", net=0.9), q("light", net=0.0)]
    assert [j.id for j in order(jobs, 0.0, POLICY, network_utilization=1.0)] == ["light", "heavy"]
    assert score(jobs[0], 0.0, POLICY, 0.0) == score(jobs[1], 0.0, POLICY, 0.0)


def test_aging_prevents_starvation_by_a_stream_of_short_jobs() -> None:
    """A huge, low-priority job overtakes every newly arriving short, urgent job after a bounded wait."""
    big = q("big", t=0.0, work=1e9, prio=-10, net=1.0)
    policy = QueuePolicy(starvation_s=1e12, aging_per_hour=1.0, priority_weight=0.1)
    # Upper bound on the wait, from the score formula: priority gap + work gap + network term.
    gap = 0.1 * 20 + math.log10(1 + 1e9 / 3600) + 1.0
    first_win = None
    for hour in range(0, 48):
        now = hour * 3600.0
        newcomer = q(f"short-{hour}", t=now, work=1.0, prio=10)
        if order([big, newcomer], now, policy, network_utilization=1.0)[0].id == "big":
            first_win = hour
            break
    assert first_win is not None and first_win <= math.ceil(gap)
    # And it keeps winning against every later newcomer.
    for hour in range(first_win, first_win + 24):
        now = hour * 3600.0
        assert order([big, q("n", t=now, work=1.0, prio=10)], now, policy, 1.0)[0].id == "big"


def test_starving_jobs_lead_in_fifo_order() -> None:
    policy = QueuePolicy(starvation_s=3600.0)
    jobs = [q("young", t=9000.0, work=1.0, prio=1000), q("old2", t=10.0, work=1e9), q("old1", t=0.0, work=1e9)]
    assert [j.id for j in order(jobs, 10_000.0, policy)] == ["old1", "old2", "young"]


def test_reserve_computes_shadow_time_and_spare() -> None:
    running = [RunningJob(id="a", gpus=4, est_end_s=100.0), RunningJob(id="b", gpus=8, est_end_s=50.0)]
    r = reserve("h", 10, 4, running, now=0.0)
    assert r is not None and r.start_s == 50.0 and r.spare_gpus == 2
    r2 = reserve("h", 3, 4, running, now=0.0)
    assert r2 is not None and r2.start_s == 0.0 and r2.spare_gpus == 1
    assert reserve("h", 100, 4, running, now=0.0) is None


def test_backfill_rules() -> None:
    running = [RunningJob(id="a", gpus=8, est_end_s=100.0)]
    r = reserve("h", 10, 4, running, now=0.0)
    assert r is not None and r.start_s == 100.0 and r.spare_gpus == 2
    assert admits(r, 4, 90.0, 4)           # ends before the head starts
    assert not admits(r, 4, 150.0, 4)      # would still hold 4 GPUs the head needs
    assert admits(r, 2, 1e9, 4)            # uses only spare GPUs
    assert not admits(r, 5, 10.0, 4)       # more than free now
    r2 = after_admit(r, 2, 1e9)
    assert r2 is not None and r2.spare_gpus == 0
    assert not admits(r2, 1, 1e9, 2)
    assert after_admit(r, 4, 90.0) == r
    assert admits(None, 4, 1e9, 4) and not admits(None, 5, 0.0, 4)


@settings(max_examples=200, deadline=None)
@given(
    running=st.lists(st.tuples(st.integers(1, 16), st.floats(1.0, 1000.0)), max_size=6),
    free=st.integers(0, 16),
    head=st.integers(1, 64),
    cands=st.lists(st.tuples(st.integers(1, 16), st.floats(0.0, 2000.0)), max_size=8),
)
def test_backfilling_never_delays_the_head_reservation(
    running: list[tuple[int, float]], free: int, head: int, cands: list[tuple[int, float]]
) -> None:
    """With exact run-time estimates, jobs admitted by admits/after_admit never push the head's start later."""
    now = 0.0
    run = [RunningJob(id=f"r{i}", gpus=g, est_end_s=e) for i, (g, e) in enumerate(running)]
    res = reserve("head", head, free, run, now)
    if res is None or res.start_s == now:
        return
    original = res.start_s
    for i, (g, end) in enumerate(cands):
        if admits(res, g, end, free):
            run.append(RunningJob(id=f"c{i}", gpus=g, est_end_s=end))
            free -= g
            res = after_admit(res, g, end)
            assert res is not None
    again = reserve("head", head, free, run, now)
    assert again is not None and again.start_s <= original


def test_estimates_from_job_spec() -> None:
    small = JobSpec(id="s", model=model_preset("gpt3-1.3b"), global_batch=256, micro_batch=4, steps=100,
                    gpus=GpuRange(min=4, max=32))
    big = JobSpec(id="b", model=model_preset("llama3-70b"), global_batch=256, micro_batch=4, steps=100,
                  gpus=GpuRange(min=4, max=32))
    assert 0 < estimate_work_gpu_s(small) < estimate_work_gpu_s(big)
    assert estimate_work_gpu_s(small, 50) == pytest.approx(estimate_work_gpu_s(small) / 2)
    assert 0.0 < estimate_network_share(small) < 1.0
    qj = queued_job(small, 5.0, steps_left=10)
    assert qj.min_gpus == 4 and qj.enqueued_s == 5.0 and qj.work_gpu_s == pytest.approx(estimate_work_gpu_s(small, 10))


def test_policy_validation() -> None:
    with pytest.raises(ValidationError, match="aging_per_hour"):
        QueuePolicy(aging_per_hour=0.0)
    with pytest.raises(ValidationError, match="backfill_depth"):
        QueuePolicy(backfill_depth=-1)


def test_expected_releases_show_holders_and_the_claims_of_waiting_jobs() -> None:
    """A holder's GPUs come back at its end; a waiting job's claim is a negative release at its start and
    a positive one at its end; lost clusters, zero counts and claims already due are left out."""
    holding = [Holding(job_id="r1", end_s=130.0, gpus=(("b", 8), ("a", 4), ("gone", 2), ("c", 0))),
               Holding(job_id="r0", end_s=90.0, gpus=(("c", 2),))]
    claims = [Claim(job_id="w", start_s=130.0, run_s=50.0, gpus=(("a", 4), ("b", 8))),
              Claim(job_id="due", start_s=100.0, run_s=10.0, gpus=(("a", 1),))]
    got = expected_releases(holding, claims, 100.0, gone=frozenset({"gone"}))
    assert [(r.after_s, r.gpus) for r in got] == [
        (0.0, (("c", 2),)),                      # already overdue: "now"
        (30.0, (("a", 4), ("b", 8))),            # r1 ends
        (30.0, (("a", -4), ("b", -8))),          # w takes them at its start
        (80.0, (("a", 4), ("b", 8))),            # and gives them back
    ]
    assert expected_releases([], [], 0.0) == ()


def test_reserve_at_counts_the_gpus_free_when_the_waiting_head_starts() -> None:
    running = [RunningJob(id="x", gpus=8, est_end_s=50.0), RunningJob(id="y", gpus=4, est_end_s=200.0)]
    res = reserve_at("h", 10, 60.0, 4, running, 0.0)
    assert (res.start_s, res.spare_gpus) == (60.0, 2)  # 4 free + 8 back at 50, 10 needed
    assert reserve_at("h", 20, 60.0, 4, running, 0.0).spare_gpus == 0
    assert reserve_at("h", 1, 5.0, 4, running, 10.0).start_s == 10.0  # never in the past
