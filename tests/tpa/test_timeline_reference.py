"""The timeline simulator against a plain event-queue reference (every op end and every arrival an event)
on random pipelines: identical times for every op and transfer, and the same deadlock verdicts."""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.domain import Schedule
from spiderflow.core.tpa.timeline import Op, StageTiming, plan_orders, simulate


def reference(stages: Sequence[StageTiming], orders: Sequence[Sequence[Sequence[Op]]],
              ser: Sequence[Sequence[float]], lat: Sequence[Sequence[float]], chunks: int
              ) -> tuple[list[tuple[int, int, str, int, int, float, float]], list[tuple[object, ...]], float] | None:
    """Events: (time, 0 arrival | 1 op end, executor, ...). An executor starts its next op when it is idle and
    the op's input has arrived; an op end sends its output over the FIFO link. ``None``: deadlock."""
    n = len(stages)
    nv = n * chunks
    execs = [(i, r) for i in range(n) for r in range(len(orders[i]))]
    ptr = [0] * len(execs)
    idle_since: list[float | None] = [0.0] * len(execs)
    arrived: set[tuple[str, int, int]] = set()
    link_free: dict[tuple[int, int], float] = {}
    ops: list[tuple[int, int, str, int, int, float, float]] = []
    xfers: list[tuple[object, ...]] = []
    events: list[tuple[float, int, int, tuple[str, int, int], float]] = []

    def need(kind: str, j: int, u: int) -> tuple[str, int, int] | None:
        if kind == "F":
            return None if u == 0 else ("F", j, u - 1)
        return ("F", j, u) if u == nv - 1 else ("B", j, u + 1)

    def try_start(e: int, t: float) -> None:
        i, r = execs[e]
        if idle_since[e] is None or ptr[e] >= len(orders[i][r]):
            return
        kind, j, c = orders[i][r][ptr[e]]
        dep = need(kind, j, c * n + i)
        if dep is not None and dep not in arrived:
            return
        idle_since[e] = None
        dur = stages[i].compute_s / 3.0 / chunks if kind == "F" else stages[i].compute_s * 2.0 / 3.0 / chunks
        heapq.heappush(events, (t + dur, 1, e, (kind, j, c), t))

    for e in range(len(execs)):
        try_start(e, 0.0)
    while events:
        t, what, e, (kind, j, c), start = heapq.heappop(events)
        if what == 0:
            arrived.add((kind, j, c))
            for x in range(len(execs)):
                try_start(x, t)
            continue
        i, r = execs[e]
        ops.append((i, r, kind, j, c, start, t))
        u = c * n + i
        out_u = (u + 1 if u < nv - 1 else u) if kind == "F" else u - 1
        if out_u >= 0:
            dst = out_u % n
            if out_u == u or dst == i:
                heapq.heappush(events, (t, 0, -1, (kind, j, u), 0.0))
            else:
                tx = max(t, link_free.get((i, dst), 0.0))
                link_free[(i, dst)] = tx + ser[i][dst]
                at = tx + ser[i][dst] + lat[i][dst]
                xfers.append((i, dst, kind, j, c, tx, at))
                heapq.heappush(events, (at, 0, -1, (kind, j, u), 0.0))
        ptr[e] += 1
        idle_since[e] = t
        try_start(e, t)
    if any(ptr[e] < len(orders[i][r]) for e, (i, r) in enumerate(execs)):
        return None
    ends = [max((o[6] for o in ops if o[0] == i), default=0.0) + stages[i].allreduce_s for i in range(n)]
    return sorted(ops, key=lambda o: (o[0], o[1], o[5])), sorted(xfers, key=repr), max(ends, default=0.0)


@st.composite
def pipelines(draw: st.DrawFn, *, one_replica: bool = False) -> tuple[
        list[StageTiming], list[list[list[Op]]], list[list[float]], list[list[float]], int]:
    n = draw(st.integers(1, 8 if one_replica else 6))
    interleaved = n > 1 and draw(st.booleans()) and draw(st.booleans())
    times = st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0.0, 2.0)
    if interleaved:
        schedule, chunks, reps, m = Schedule.INTERLEAVED_1F1B, 2, [1] * n, n * draw(st.integers(1, 4))
    else:
        schedule = draw(st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE]))
        chunks, reps, m = 1, [1] * n if one_replica else draw(
            st.lists(st.sampled_from([1, 1, 2, 4]), min_size=n, max_size=n)), \
            draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    cap = None if interleaved else draw(st.sampled_from([None, None, 2, 3]))
    orders = plan_orders(schedule, m, reps, chunks=chunks, max_in_flight=cap)
    stages = [StageTiming(compute_s=draw(st.sampled_from([1.0, 0.5]) | st.floats(0.05, 3.0)), replicas=d,
                          allreduce_s=draw(st.floats(0.0, 1.0))) for d in reps]
    ser = [[draw(times) for _ in range(n)] for _ in range(n)]
    lat = [[draw(times) for _ in range(n)] for _ in range(n)]
    return stages, orders, ser, lat, chunks


@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_the_simulator_matches_the_event_queue_reference(p: tuple[list[StageTiming], list[list[list[Op]]],
                                                                    list[list[float]], list[list[float]], int]) -> None:
    stages, orders, ser, lat, chunks = p
    want = reference(stages, orders, ser, lat, chunks)
    try:
        got = simulate(stages, orders, ser, lat, chunks=chunks)
    except ValueError:
        assert want is None
        with pytest.raises(ValueError):
            simulate(stages, orders, ser, lat, chunks=chunks, record=False)
        return
    assert want is not None
    ops, xfers, step = want
    assert [dataclasses.astuple(o) for o in got.ops] == ops
    assert sorted((dataclasses.astuple(x) for x in got.transfers), key=repr) == xfers
    assert got.step_s == step and got.makespan_s == max((o[6] for o in ops), default=0.0)
    # Without records, pipelines of one replica per stage take the path without an event queue.
    quick = simulate(stages, orders, ser, lat, chunks=chunks, record=False)
    assert (quick.step_s, quick.makespan_s) == (step, got.makespan_s)


@settings(max_examples=300, deadline=None)
@given(pipelines(one_replica=True))
def test_one_replica_pipelines_without_records_match_the_reference(
        p: tuple[list[StageTiming], list[list[list[Op]]], list[list[float]], list[list[float]], int]) -> None:
    """One replica per stage: the simulation without an event queue gives the reference's step and makespan
    exactly, and deadlocks where the reference does."""
    _without_records_matches_the_reference(*p)


def _without_records_matches_the_reference(stages: list[StageTiming], orders: list[list[list[Op]]],
                                           ser: list[list[float]], lat: list[list[float]], chunks: int) -> None:
    """``record=False`` gives the reference's step and makespan exactly, and deadlocks where it does."""
    want = reference(stages, orders, ser, lat, chunks)
    if want is None:
        with pytest.raises(ValueError):
            simulate(stages, orders, ser, lat, chunks=chunks, record=False)
        return
    ops, _, step = want
    got = simulate(stages, orders, ser, lat, chunks=chunks, record=False)
    assert got.ops == () and got.step_s == step and got.makespan_s == max((o[6] for o in ops), default=0.0)


def test_a_malformed_one_replica_order_deadlocks_without_records() -> None:
    """Stage 1 starts with a backward whose forward it has not run, so stage 0 waits for that backward
    forever: the quick path names the first stuck op, as the event loop does."""
    stages = [StageTiming(compute_s=1.0), StageTiming(compute_s=1.0)]
    orders: list[list[list[Op]]] = [[[("F", 0, 0), ("B", 0, 0)]], [[("B", 0, 0), ("F", 0, 0)]]]
    zeros = [[0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match=r"deadlocks: stage 0 replica 0 waits at \('B', 0, 0\)"):
        simulate(stages, orders, zeros, zeros, record=False)
    with pytest.raises(ValueError, match=r"deadlocks: stage 0 replica 0 waits at \('B', 0, 0\)"):
        simulate(stages, orders, zeros, zeros)


def test_equal_time_transfers_of_two_replicas_queue_in_replica_order() -> None:
    """Stage 0 has two replicas that end their forwards at the same instants; both send over one link of
    1 s per activation: replica 0's activation goes first, replica 1's waits for it."""
    stages = [StageTiming(compute_s=3.0, replicas=2), StageTiming(compute_s=3.0)]
    orders = plan_orders(Schedule.GPIPE, 2, [2, 1])
    ser = [[0.0, 1.0], [0.0, 0.0]]
    tl = simulate(stages, orders, ser, [[0.0, 0.0], [0.0, 0.0]])
    fwd = sorted((x.micro_batch, x.start_s, x.end_s) for x in tl.transfers if x.src == 0)
    assert fwd == [(0, 1.0, 2.0), (1, 2.0, 3.0)]
    assert not math.isinf(tl.step_s) and tl.step_s == pytest.approx(reference(stages, orders, ser, [[0.0] * 2] * 2,
                                                                               1)[2])  # type: ignore[index]


@settings(max_examples=200, deadline=None)
@given(pipelines(), st.data())
def test_without_records_zero_length_ops_take_the_event_loop_and_agree(
        p: tuple[list[StageTiming], list[list[list[Op]]], list[list[float]], list[list[float]], int],
        data: st.DataObject) -> None:
    """Ops of zero length (a stage with no compute) make the queue of shared-link sends unsound, so such
    pipelines run the event loop: the step and makespan still match the reference, replicas or not."""
    stages, orders, ser, lat, chunks = p
    zero = data.draw(st.lists(st.booleans(), min_size=len(stages), max_size=len(stages)))
    stages = [dataclasses.replace(s, compute_s=0.0) if z else s for s, z in zip(stages, zero, strict=True)]
    _without_records_matches_the_reference(stages, orders, ser, lat, chunks)


@settings(max_examples=200, deadline=None)
@given(
    schedule=st.sampled_from(list(Schedule)), n=st.integers(1, 5), m=st.integers(1, 12),
    reps=st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=5, max_size=5),
    cap=st.sampled_from([None, None, 1, 2, 4]), chunks=st.sampled_from([1, 1, 2]),
)
def test_plan_orders_deal_out_exactly_the_replica_orders_execution_runs(
        schedule: Schedule, n: int, m: int, reps: list[int], cap: int | None, chunks: int) -> None:
    """Every replica's order is :func:`spiderflow.core.schedules.replica_ops`' (the order its worker runs)."""
    from spiderflow.core.schedules import replica_ops

    if schedule is not Schedule.INTERLEAVED_1F1B:
        chunks = 1
    if chunks > 1:
        m = n * max(1, m // n)
    replicas = reps[:n]
    got = plan_orders(schedule, m, replicas, chunks=chunks, max_in_flight=cap)
    want = [[replica_ops(schedule, n, m, i, dp=d, replica=r, max_dp=max(replicas), chunks=chunks,
                         max_in_flight=cap, min_dp=min(replicas)) for r in range(d)]
            for i, d in enumerate(replicas)]
    assert got == want
