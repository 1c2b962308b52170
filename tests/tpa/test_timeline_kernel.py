"""The compiled eager pass (:func:`spiderflow.core.tpa.timeline._simulate_eager` on
:mod:`spiderflow.core.kernels.timeline`) against its plain Python formulation (:mod:`.eager_reference`) on random
pipelines: bitwise the same makespan, step, recorded op ends and arrivals, and the same deadlock verdicts
and messages."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.domain import Schedule
from spiderflow.core.kernels import timeline as kernels
from spiderflow.core.tpa import timeline
from spiderflow.core.tpa.timeline import Op, ScheduleDeadlockError, StageTiming, Timeline, plan_orders, simulate

from .eager_reference import _simulate_eager as reference_eager

Pipeline = tuple[list[StageTiming], list[list[list[Op]]], list[list[float]], list[list[float]], int]
Outcome = tuple[Timeline | str, list[float] | None, list[float] | None]

_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE, Schedule.INTERLEAVED_1F1B)


@st.composite
def pipelines(draw: st.DrawFn, *, shared: bool = True) -> Pipeline:
    """1F1B, latency-aware, GPipe or interleaved (two chunks) orders of up to 6 stages, one replica per stage
    or (``shared``) a mix of 1–4 (interleaving with several can deadlock), in-flight caps, stage times and
    link figures among round values, zeros and arbitrary doubles (rounding exposes any reordered sum)."""
    n = draw(st.integers(1, 6))
    schedule = draw(st.sampled_from(_SCHEDULES[:3]))
    if n > 1 and draw(st.integers(0, 2)) == 0:
        schedule = Schedule.INTERLEAVED_1F1B
    reps = draw(st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=n, max_size=n)) if shared else [1] * n
    if schedule is Schedule.INTERLEAVED_1F1B:
        chunks, m, cap = 2, n * draw(st.integers(1, 4)), None
    else:
        chunks, m = 1, draw(st.integers(1, 24))
        cap = draw(st.sampled_from([None, None, 1, 2, 3]))
    orders = plan_orders(schedule, m, reps, chunks=chunks, max_in_flight=cap)
    compute = st.sampled_from([1.0, 0.5, 0.3]) | st.floats(0.01, 3.0)
    stages = [StageTiming(compute_s=draw(compute), replicas=d, allreduce_s=draw(st.floats(0.0, 1.0)))
              for d in reps]
    times = st.sampled_from([0.0, 0.0, 0.25, 1.0]) | st.floats(0.0, 2.0)
    ser = [[draw(times) for _ in range(n)] for _ in range(n)]
    lat = [[draw(times) for _ in range(n)] for _ in range(n)]
    return stages, orders, ser, lat, chunks


def _inputs(stages: Sequence[StageTiming], orders: Sequence[Sequence[Sequence[Op]]], chunks: int) -> tuple[
        list[Sequence[Op]], list[tuple[int, int]], list[float], list[float], int]:
    """What :func:`simulate` hands the eager pass: executors' orders and ids, op durations, keys."""
    n = len(stages)
    execs = [(i, r) for i in range(n) for r in range(len(orders[i]))]
    flat = [orders[i][r] for i, r in execs]
    dur_f = [s.compute_s / 3.0 / chunks for s in stages]
    dur_b = [s.compute_s * 2.0 / 3.0 / chunks for s in stages]
    max_j = max((op[1] for order in flat for op in order), default=0)
    return flat, execs, dur_f, dur_b, 2 * n * chunks * (max_j + 1)


def _reference(p: Pipeline, *, record: bool) -> Outcome:
    stages, orders, ser, lat, chunks = p
    flat, execs, dur_f, dur_b, n_keys = _inputs(stages, orders, chunks)
    ends = [math.inf] * n_keys if record else None
    arrivals = [math.inf] * n_keys if record else None
    try:
        got: Timeline | str = reference_eager(stages, flat, execs, chunks, dur_f, dur_b, ser, lat, ends=ends,
                                              arrivals=arrivals)
    except ScheduleDeadlockError as exc:
        got = str(exc)
    return got, ends, arrivals


def _compiled(p: Pipeline, *, record: bool) -> Outcome:
    stages, orders, ser, lat, chunks = p
    flat, execs, dur_f, dur_b, n_keys = _inputs(stages, orders, chunks)
    ends = np.full(n_keys, math.inf) if record else None
    arrivals = np.full(n_keys, math.inf) if record else None
    packed = timeline._pack_orders(flat, execs, chunks)
    try:
        got: Timeline | str = timeline._simulate_eager(stages, packed, dur_f, dur_b, ser, lat, ends=ends,
                                                       arrivals=arrivals)
    except ScheduleDeadlockError as exc:
        got = str(exc)
    return got, None if ends is None else ends.tolist(), None if arrivals is None else arrivals.tolist()


def _assert_same(p: Pipeline, *, record: bool) -> Outcome:
    """Both passes on ``p``: equal timelines (floats compared with ``==``) or equal deadlock messages, and
    equal recorded lists (``inf`` where nothing was recorded)."""
    want = _reference(p, record=record)
    got = _compiled(p, record=record)
    assert got == want
    return want


@settings(max_examples=150, deadline=None)
@given(pipelines(), st.booleans())
def test_the_kernel_matches_the_python_pass(p: Pipeline, record: bool) -> None:
    _assert_same(p, record=record)


@settings(max_examples=60, deadline=None)
@given(pipelines(shared=False))
def test_one_replica_pipelines_record_the_same_ends_and_arrivals(p: Pipeline) -> None:
    want, ends, _ = _assert_same(p, record=True)
    if isinstance(want, Timeline):
        assert ends is not None and max(ends) == want.makespan_s


@settings(max_examples=60, deadline=None)
@given(pipelines(), st.data())
def test_perturbed_orders_give_the_same_verdict(p: Pipeline, data: st.DataObject) -> None:
    """One executor's order shuffled (most such orders deadlock): the same times, or the same stuck
    executor and op in the message."""
    stages, orders, ser, lat, chunks = p
    execs = [(i, r) for i in range(len(stages)) for r in range(len(orders[i]))]
    i, r = data.draw(st.sampled_from(execs))
    orders[i][r] = data.draw(st.permutations(orders[i][r]))
    _assert_same((stages, orders, ser, lat, chunks), record=data.draw(st.booleans()))


@settings(max_examples=40, deadline=None)
@given(pipelines(), st.data())
def test_zero_length_ops_and_infinite_links_run_the_same(p: Pipeline, data: st.DataObject) -> None:
    """Outside the eager pass's sound range too (ops of no time with shared links, links that never deliver:
    an arrival of ``inf`` is one that never comes) the two formulations compute the same."""
    stages, orders, ser, lat, chunks = p
    n = len(stages)
    zero = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    stages = [dataclasses.replace(s, compute_s=0.0) if z else s for s, z in zip(stages, zero, strict=True)]
    a, b = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    ser[a][b] = data.draw(st.sampled_from([math.inf, 0.0, 1e-300]))
    _assert_same((stages, orders, ser, lat, chunks), record=data.draw(st.booleans()))


@settings(max_examples=40, deadline=None)
@given(pipelines())
def test_simulate_without_records_is_the_kernels_timeline(p: Pipeline) -> None:
    """The public entry point (orders packed per call) returns the reference pass's timeline."""
    stages, orders, ser, lat, chunks = p
    want, _, _ = _reference(p, record=False)
    if isinstance(want, str):
        with pytest.raises(ScheduleDeadlockError, match=f"^{re.escape(want)}$"):
            simulate(stages, orders, ser, lat, chunks=chunks, record=False)
    else:
        assert simulate(stages, orders, ser, lat, chunks=chunks, record=False) == want


@pytest.mark.parametrize(("schedule", "dps", "chunks"), [
    (Schedule.ONE_F_ONE_B, (1, 1, 1, 1, 1, 1, 1, 1), 1),
    (Schedule.ONE_F_ONE_B, (1, 2, 1, 2, 2, 1, 2, 1), 1),
    (Schedule.LATENCY_AWARE, (2, 2, 4, 4), 1),
    (Schedule.INTERLEAVED_1F1B, (1, 1, 1, 1), 2),
])
def test_memoised_packed_orders_record_what_the_reference_records(
        schedule: Schedule, dps: tuple[int, ...], chunks: int) -> None:
    """The hot path (:func:`timeline._run_recorded` on orders packed once per shape) on 64 micro-batches with
    WAN-like links: every op end and arrival as the reference's."""
    n, m = len(dps), 64
    stages = tuple(StageTiming(compute_s=0.03 * d * (1.0 + 0.07 * i), replicas=d, allreduce_s=0.1 * i)
                   for i, d in enumerate(dps))
    ser = [[0.0] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    for i in range(n):
        j = (i + 1) % n
        ser[i][j] = ser[j][i] = 0.0013 * (i + 1)
        lat[i][j] = lat[j][i] = 0.0 if i % 2 else 0.031
    dur_f = [s.compute_s / 3.0 / chunks for s in stages]
    dur_b = [s.compute_s * 2.0 / 3.0 / chunks for s in stages]
    tl, orders, ends, arrivals = timeline._run_recorded(schedule, m, chunks, stages, dps, dur_f, dur_b, ser, lat,
                                                        None)
    want = _reference((list(stages), [[list(r) for r in s] for s in orders], ser, lat, chunks), record=True)
    assert (tl, ends.tolist(), arrivals.tolist()) == want
    assert timeline._frozen_packed(schedule, m, dps, chunks, None) is timeline._frozen_packed(
        schedule, m, dps, chunks, None)


def test_a_malformed_order_names_the_first_stuck_op() -> None:
    stages = [StageTiming(compute_s=1.0), StageTiming(compute_s=1.0)]
    orders: list[list[list[Op]]] = [[[("F", 0, 0), ("B", 0, 0)]], [[("B", 0, 0), ("F", 0, 0)]]]
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    want, _, _ = _assert_same((stages, orders, zeros, zeros, 1), record=False)
    assert want == "op order deadlocks: stage 0 replica 0 waits at ('B', 0, 0)"


def test_equal_time_sends_of_two_replicas_queue_in_executor_order() -> None:
    """Two replicas end their forwards at the same instants and share a 1 s link: replica 0's activation
    goes first (arrives at 2 s), replica 1's after it (3 s)."""
    stages = [StageTiming(compute_s=3.0, replicas=2), StageTiming(compute_s=3.0)]
    orders = plan_orders(Schedule.GPIPE, 2, [2, 1])
    ser = [[0.0, 1.0], [0.0, 0.0]]
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    _, _, arrivals = _assert_same((stages, orders, ser, zeros, 1), record=True)
    assert arrivals is not None and (arrivals[0], arrivals[4]) == (2.0, 3.0)


def test_no_stages_give_an_empty_step() -> None:
    assert _assert_same(([], [], [], [], 1), record=False)[0] == Timeline(
        n_stages=0, replicas=(), ops=(), transfers=(), makespan_s=0.0, step_s=0.0)


@pytest.mark.parametrize(("op", "chunks"), [(("X", 0, 0), 1), (("F", -1, 0), 1), (("F", 0, 2), 2)])
def test_ops_the_simulator_cannot_file_are_rejected(op: Op, chunks: int) -> None:
    with pytest.raises(ValueError, match="orders"):
        timeline._pack_orders([[("F", 0, 0), op]], [(0, 0)], chunks)


def test_one_compiled_specialisation_serves_every_call() -> None:
    kernels._warm()
    p = (
        [StageTiming(compute_s=1.0, replicas=2), StageTiming(compute_s=0.5)],
        plan_orders(Schedule.ONE_F_ONE_B, 8, [2, 1]), [[0.0, 0.1], [0.1, 0.0]], [[0.0, 0.2], [0.2, 0.0]], 1,
    )
    _assert_same(p, record=True)
    _assert_same(p, record=False)
    assert len(kernels.simulate_eager.signatures) == 1
