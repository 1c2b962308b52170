"""The timeline's steady-state extrapolation: the step of ``m`` micro-batches taken from the simulation of
fewer equals the full simulation of ``m`` (up to float rounding), and it is only used where its check holds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.domain import Schedule
from spiderflow.core.tpa import timeline
from spiderflow.core.tpa.timeline import StageTiming, Timeline, simulate

_SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE, Schedule.INTERLEAVED_1F1B)


def _inputs(compute: list[float], dps: list[int], ser: list[float], lat: list[float]) -> tuple[
        tuple[StageTiming, ...], tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]]:
    n = len(compute)
    stages = tuple(StageTiming(compute_s=t, replicas=d, allreduce_s=0.01 * i)
                   for i, (t, d) in enumerate(zip(compute, dps, strict=True)))
    s = [[0.0] * n for _ in range(n)]
    la = [[0.0] * n for _ in range(n)]
    for i in range(n):  # neighbours both ways, and the interleaving wrap
        j = (i + 1) % n
        s[i][j] = s[j][i] = ser[i]
        la[i][j] = la[j][i] = lat[i]
    return stages, tuple(map(tuple, s)), tuple(map(tuple, la))


def _full(schedule: Schedule, m: int, chunks: int, stages: tuple[StageTiming, ...],
          ser: tuple[tuple[float, ...], ...], lat: tuple[tuple[float, ...], ...],
          cap: int | None = None) -> Timeline:
    orders = timeline.plan_orders(schedule, m, [s.replicas for s in stages], chunks=chunks, max_in_flight=cap)
    return simulate(stages, orders, ser, lat, chunks=chunks, record=False)


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(_SCHEDULES),
    n=st.integers(2, 6),
    data=st.data(),
    m=st.sampled_from([256, 384, 512, 1024]),
)
def test_the_extrapolated_step_is_the_simulated_step(schedule: Schedule, n: int, data: st.DataObject,
                                                     m: int) -> None:
    compute = data.draw(st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n))
    dps = data.draw(st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=n, max_size=n))
    ser = data.draw(st.lists(st.sampled_from([0.0, 0.001, 0.05, 0.3]), min_size=n, max_size=n))
    lat = data.draw(st.lists(st.sampled_from([0.0, 0.002, 0.04]), min_size=n, max_size=n))
    chunks = 2 if schedule is Schedule.INTERLEAVED_1F1B else 1
    cap = None if chunks > 1 else data.draw(st.sampled_from([None, None, 2, 5]))
    if chunks > 1 and (m % n or max(dps) > 1):
        return  # interleaving needs m divisible by the stage count; with data parallelism it can deadlock
    stages, s, la = _inputs(compute, dps, ser, lat)
    got = timeline._steady_extrapolation(schedule, m, chunks, stages, s, la, cap)
    if got is None:
        return  # no period found: the caller simulates m
    want = _full(schedule, m, chunks, stages, s, la, cap)
    assert got.step_s == pytest.approx(want.step_s, rel=1e-12, abs=0.0)
    assert got.makespan_s == pytest.approx(want.makespan_s, rel=1e-12, abs=0.0)


# Interleaving runs without data parallelism only (with it, its orders can deadlock: schedules.replica_ops).
@pytest.mark.parametrize(("schedule", "dps"), [
    *((s, d) for s in (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE)
      for d in ([1, 1, 1, 1], [2, 2, 1, 2], [4, 4, 4, 4])),
    (Schedule.INTERLEAVED_1F1B, [1, 1, 1, 1]),
])
def test_long_steady_pipelines_are_extrapolated_exactly(schedule: Schedule, dps: list[int]) -> None:
    chunks = 2 if schedule is Schedule.INTERLEAVED_1F1B else 1
    stages, s, la = _inputs([0.30, 0.42, 0.35, 0.40], dps, [0.02, 0.2, 0.01, 0.02], [0.004, 0.03, 0.0, 0.0])
    got = timeline._steady_extrapolation(schedule, 1024, chunks, stages, s, la, None)
    assert got is not None, "a pipeline this regular reaches its steady state early"
    want = _full(schedule, 1024, chunks, stages, s, la)
    assert got.step_s == pytest.approx(want.step_s, rel=1e-12, abs=0.0)
    # The memoised entry point returns the same figure.
    timeline._simulate_memo.cache_clear()
    memo = timeline._simulate_memo(schedule, 1024, chunks, stages, s, la, None)
    assert memo.step_s == got.step_s


def test_short_or_unsteady_runs_are_simulated_in_full() -> None:
    stages, s, la = _inputs([0.3, 0.4, 0.35], [1, 1, 1], [0.01, 0.01, 0.01], [0.0, 0.0, 0.0])
    # Too few micro-batches for the check to save anything.
    assert timeline._steady_extrapolation(Schedule.ONE_F_ONE_B, 24, 1, stages, s, la, None) is None
    # GPipe has no steady state of pairs.
    assert timeline._steady_extrapolation(Schedule.GPIPE, 1024, 1, stages, s, la, None) is None
    # A replica layout whose period (lcm 7·9·11) dwarfs m.
    wide, s3, la3 = _inputs([0.3, 0.4, 0.35], [7, 9, 11], [0.01, 0.01, 0.01], [0.0, 0.0, 0.0])
    assert timeline._steady_extrapolation(Schedule.ONE_F_ONE_B, 1024, 1, wide, s3, la3, None) is None


def test_a_found_period_is_checked_not_assumed() -> None:
    # Break periodicity inside the check's window by hand: the check must reject it.
    stages, s, la = _inputs([0.3, 0.4, 0.35, 0.4], [1, 1, 1, 1], [0.01, 0.1, 0.01, 0.01], [0.0, 0.0, 0.0, 0.0])
    reps = tuple(x.replicas for x in stages)
    warm = [timeline.stage_warmup(Schedule.ONE_F_ONE_B, 256, reps, i) for i in range(4)]
    dur_f = [x.compute_s / 3.0 for x in stages]
    dur_b = [x.compute_s * 2.0 / 3.0 for x in stages]
    run = timeline._run_recorded(Schedule.ONE_F_ONE_B, 256, 1, stages, reps, dur_f, dur_b, s, la, None)
    deepest = math.ceil(max(warm))
    assert timeline._steady_period(Schedule.ONE_F_ONE_B, 256, 1, reps, warm, run, deepest, 1) is not None
    tl, orders, ends, arrivals = run
    jm = 2 * 4
    for j in range(0, 256, 2):  # every other micro-batch's first op 1 µs late: no period of 1..32 holds
        ends[j * jm] += 1e-6 * (j + 1)
    assert timeline._steady_period(Schedule.ONE_F_ONE_B, 256, 1, reps, warm, (tl, orders, ends, arrivals),
                                   deepest, 1) is None
