"""Properties of the pipeline schedule orders in :mod:`spiderflow.core.schedules`."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spiderflow.core.domain import Schedule
from spiderflow.core.errors import ValidationError
from spiderflow.core.schedules import (
    ScheduleDeadlockError,
    default_warmup,
    replay,
    replica_ops,
    stage_ops,
    stage_warmup,
)

SINGLE_CHUNK = [Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE]


def _orders(schedule: Schedule, n: int, m: int, chunks: int = 1) -> list[list[list[tuple[str, int, int]]]]:
    return [[stage_ops(schedule, n, m, s, chunks=chunks)] for s in range(n)]


def _check_stage(ops: list[tuple[str, int, int]], m: int, chunks: int) -> None:
    expected = {(j, c) for j in range(m) for c in range(chunks)}
    fwd = [(j, c) for k, j, c in ops if k == "F"]
    bwd = [(j, c) for k, j, c in ops if k == "B"]
    assert sorted(fwd) == sorted(expected) and len(fwd) == len(expected)
    assert sorted(bwd) == sorted(expected) and len(bwd) == len(expected)
    seen: set[tuple[int, int]] = set()
    for k, j, c in ops:
        if k == "F":
            seen.add((j, c))
        else:
            assert (j, c) in seen, f"B{j}.{c} before its F"
    for c in range(chunks):
        f_c = [j for k, j, cc in ops if k == "F" and cc == c]
        b_c = [j for k, j, cc in ops if k == "B" and cc == c]
        assert f_c == sorted(f_c) and b_c == sorted(b_c)


def test_gpipe_order() -> None:
    assert stage_ops(Schedule.GPIPE, 3, 3, 1) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("B", 1, 0), ("B", 2, 0)
    ]


def test_1f1b_order() -> None:
    # Stage 0 of 3 warms up with 2 forwards, the last stage alternates at once.
    assert stage_ops(Schedule.ONE_F_ONE_B, 3, 4, 0) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0), ("F", 3, 0), ("B", 1, 0), ("B", 2, 0), ("B", 3, 0)
    ]
    assert stage_ops(Schedule.ONE_F_ONE_B, 3, 4, 2) == [
        ("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0), ("F", 2, 0), ("B", 2, 0), ("F", 3, 0), ("B", 3, 0)
    ]


def test_latency_aware_warms_up_deeper_than_1f1b() -> None:
    for s in range(4):
        assert default_warmup(Schedule.LATENCY_AWARE, 4, 16, s) > default_warmup(Schedule.ONE_F_ONE_B, 4, 16, s)
    ops = stage_ops(Schedule.LATENCY_AWARE, 4, 16, 3)
    assert ops[:2] == [("F", 0, 0), ("F", 1, 0)]  # even the last stage runs one forward ahead


def test_interleaved_order_matches_megatron() -> None:
    # 2 stages, 2 chunks, 4 micro-batches: forward groups of S=2 micro-batches per chunk.
    ops = stage_ops(Schedule.INTERLEAVED_1F1B, 2, 4, 0, chunks=2)
    fwd = [(j, c) for k, j, c in ops if k == "F"]
    bwd = [(j, c) for k, j, c in ops if k == "B"]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    # Warm-up 2(S-i-1) + (v-1)S = 4 forwards before the first backward.
    assert [k for k, _, _ in ops[:5]] == ["F"] * 5 and ops[5][0] == "B"


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValidationError):
        stage_ops(Schedule.ONE_F_ONE_B, 2, 4, 2)
    with pytest.raises(ValidationError):
        stage_ops(Schedule.ONE_F_ONE_B, 2, 0, 0)
    with pytest.raises(ValidationError):
        stage_ops(Schedule.GPIPE, 2, 4, 0, chunks=2)
    with pytest.raises(ValidationError):
        stage_ops(Schedule.LATENCY_AWARE, 2, 4, 0, warmup=-1)
    with pytest.raises(ValidationError):
        stage_ops(Schedule.INTERLEAVED_1F1B, 4, 6, 0, chunks=2)
    with pytest.raises(ValueError):
        stage_ops("nonsense", 2, 4, 0)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    schedule=st.sampled_from(SINGLE_CHUNK),
    n=st.integers(1, 6),
    m=st.integers(1, 12),
)
def test_single_chunk_properties(schedule: Schedule, n: int, m: int) -> None:
    orders = _orders(schedule, n, m)
    for s in range(n):
        _check_stage(orders[s][0], m, 1)
    res = replay(orders)
    # In-flight depth: GPipe holds all m; 1F1B at most S - i; latency-aware at most 2(S - i).
    for s in range(n):
        peak = res.peak_in_flight[s][0]
        if schedule is Schedule.GPIPE:
            assert peak == m
        elif schedule is Schedule.ONE_F_ONE_B:
            assert peak == min(m, n - s)
        else:
            assert peak == min(m, 2 * (n - s))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(n=st.integers(1, 5), groups=st.integers(1, 4), chunks=st.integers(1, 4))
def test_interleaved_properties(n: int, groups: int, chunks: int) -> None:
    m = n * groups
    orders = _orders(Schedule.INTERLEAVED_1F1B, n, m, chunks)
    for s in range(n):
        _check_stage(orders[s][0], m, chunks)
    replay(orders, chunks=chunks)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    schedule=st.sampled_from(SINGLE_CHUNK),
    dps=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    m=st.integers(1, 10),
)
def test_data_parallel_replicas_are_deadlock_free(schedule: Schedule, dps: list[int], m: int) -> None:
    n = len(dps)
    orders = [
        [replica_ops(schedule, n, m, s, dp=dp, replica=r, max_dp=max(dps)) for r in range(dp)]
        for s, dp in enumerate(dps)
    ]
    for s, dp in enumerate(dps):
        mbs = sorted(j for r in range(dp) for k, j, _ in orders[s][r] if k == "F")
        assert mbs == list(range(m))
        for r in range(dp):
            assert all(j % dp == r for _, j, _ in orders[s][r])
    replay(orders)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(n=st.integers(1, 5), m=st.integers(1, 10), data=st.data())
def test_non_increasing_custom_warmups_are_deadlock_free(n: int, m: int, data: st.DataObject) -> None:
    ws = sorted(data.draw(st.lists(st.integers(0, m), min_size=n, max_size=n)), reverse=True)
    orders = [[stage_ops(Schedule.LATENCY_AWARE, n, m, s, warmup=ws[s])] for s in range(n)]
    replay(orders)


def test_replay_detects_deadlock() -> None:
    # Stage 0 waits for B0 before F1, but stage 1 wants F1 before B0: a cycle.
    orders = [
        [[("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]],
        [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]],
    ]
    with pytest.raises(ScheduleDeadlockError):
        replay(orders)


def test_replay_timing_shows_latency_aware_hides_slow_links() -> None:
    # 3 stages, a slow link on both boundaries (3× a forward): the deeper warm-up finishes sooner than 1F1B,
    # and GPipe's order is at least as fast as 1F1B (it never waits for a gradient before a forward).
    n, m = 3, 8
    kw = {"forward_s": 1.0, "backward_s": 2.0, "link_s": 3.0}
    t_1f1b = replay(_orders(Schedule.ONE_F_ONE_B, n, m), **kw).makespan  # type: ignore[arg-type]
    t_lat = replay(_orders(Schedule.LATENCY_AWARE, n, m), **kw).makespan  # type: ignore[arg-type]
    t_gpipe = replay(_orders(Schedule.GPIPE, n, m), **kw).makespan  # type: ignore[arg-type]
    assert t_lat < t_1f1b
    assert t_gpipe <= t_1f1b
    # Without link delay, one stage: m forwards and m backwards back to back.
    assert replay(_orders(Schedule.ONE_F_ONE_B, 1, m)).makespan == pytest.approx(3.0 * m)


def test_replay_fill_drain_formula_gpipe() -> None:
    # GPipe, uniform stages, no link delay: (m + S - 1)·(f + b) exactly.
    n, m = 4, 6
    assert replay(_orders(Schedule.GPIPE, n, m)).makespan == pytest.approx((m + n - 1) * 3.0)


def test_uniform_dp_replica_warms_up_like_its_own_pipeline() -> None:
    # dp 2 × pp 3, m = 8: replica 1 of stage 0 runs micro-batches 1, 3, 5, 7 with a 1F1B warm-up of 2.
    ops = replica_ops(Schedule.ONE_F_ONE_B, 3, 8, 0, dp=2, replica=1)
    local = stage_ops(Schedule.ONE_F_ONE_B, 3, 4, 0)
    assert ops == [(k, 2 * j + 1, c) for k, j, c in local]


@settings(max_examples=60, deadline=None, derandomize=True)
@example(dps=[1, 1, 2], groups=3, chunks=2)  # deadlocked when the interleaved warm-up was scaled by max dp
@given(dps=st.lists(st.integers(1, 3), min_size=1, max_size=4), groups=st.integers(1, 3), chunks=st.integers(2, 3))
def test_interleaved_with_data_parallel_replicas_is_deadlock_free(dps: list[int], groups: int, chunks: int) -> None:
    n = len(dps)
    m = n * groups
    orders = [
        [replica_ops(Schedule.INTERLEAVED_1F1B, n, m, s, dp=dp, replica=r, max_dp=max(dps), chunks=chunks)
         for r in range(dp)]
        for s, dp in enumerate(dps)
    ]
    for s, dp in enumerate(dps):
        got = sorted((j, c) for r in range(dp) for k, j, c in orders[s][r] if k == "B")
        assert got == sorted((j, c) for j in range(m) for c in range(chunks))
    replay(orders, chunks=chunks)


def test_stage_warmup_is_what_replica_ops_uses() -> None:
    assert stage_warmup(Schedule.ONE_F_ONE_B, 3, 8, 0, max_dp=2) == 4
    assert stage_warmup(Schedule.LATENCY_AWARE, 3, 8, 2, max_dp=3) == 3
    assert stage_warmup(Schedule.GPIPE, 3, 8, 0, max_dp=2) == 8
    assert stage_warmup(Schedule.INTERLEAVED_1F1B, 2, 4, 0, max_dp=2, chunks=2) == 4  # unscaled
    for sched, chunks in ((Schedule.ONE_F_ONE_B, 1), (Schedule.LATENCY_AWARE, 1), (Schedule.INTERLEAVED_1F1B, 2)):
        w = stage_warmup(sched, 2, 8, 0, max_dp=2, chunks=chunks)
        explicit = replica_ops(sched, 2, 8, 0, dp=2, replica=1, max_dp=2, chunks=chunks, warmup=w)
        assert replica_ops(sched, 2, 8, 0, dp=2, replica=1, max_dp=2, chunks=chunks) == explicit


@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE, Schedule.GPIPE])
@pytest.mark.parametrize(("dps", "m", "cap"), [([1, 1, 1], 6, 2), ([2, 1, 2], 8, 2), ([2, 2, 2], 8, 3),
                                                ([1, 2, 1], 5, None)])
def test_workers_run_the_capped_orders_the_timeline_simulates(
    schedule: Schedule, dps: list[int], m: int, cap: int | None
) -> None:
    """Without explicit warm-ups a worker's order (:func:`rank_ops`) is the timeline's
    (:func:`plan_orders`) under the plan's in-flight cap; no replica holds more than K in flight."""
    from spiderflow.core.catalog import ModelSpec
    from spiderflow.core.domain import Plan, Stage
    from spiderflow.core.tpa.timeline import plan_orders
    from spiderflow.exec.spec import TrainSpec, rank_ops

    stages = tuple(Stage(cluster=f"c{i}", first_layer=i, last_layer=i, dp=d) for i, d in enumerate(dps))
    extras = {} if cap is None else {"max_in_flight": float(cap)}
    plan = Plan(stages=stages, micro_batches=m, schedule=schedule, extras=extras)
    spec = TrainSpec(job_id="j", model=ModelSpec(name="t", layers=3, hidden=8, heads=2, vocab=16), plan=plan,
                     seq_len=4, global_batch=m, steps=1)
    want = plan_orders(schedule, m, dps, max_in_flight=cap)
    got = [[rank_ops(spec, i, r) for r in range(d)] for i, d in enumerate(dps)]
    assert got == want
    if cap is not None and schedule is not Schedule.GPIPE:
        assert max(max(p) for p in replay(got).peak_in_flight) <= cap
    if cap is not None and schedule is Schedule.LATENCY_AWARE and dps == [1, 1, 1]:
        # the cap is what changed the order: uncapped, the first stage warms up 2·3 − 1 = 5 > K − 1 deep
        assert got != plan_orders(schedule, m, dps)
    # an explicit warm-up still wins over the cap
    explicit = TrainSpec(job_id="j", model=spec.model, plan=plan, seq_len=4, global_batch=m, steps=1,
                         warmup=(0, 0, 0))
    assert rank_ops(explicit, 0, 0) == replica_ops(schedule, 3, m, 0, dp=dps[0], replica=0, max_dp=max(dps),
                                                   warmup=0)
