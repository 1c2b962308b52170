"""The in-flight cap of the 1F1B family: every stage holds at most ``K`` micro-batches, orders stay
deadlock-free, an inactive cap changes nothing, and the plan key round-trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.domain import Plan, Schedule, Stage
from spiderflow.core.errors import ValidationError
from spiderflow.core.schedules import (
    MAX_IN_FLIGHT_KEY,
    default_warmup,
    peak_in_flight,
    plan_max_in_flight,
    replay,
    replica_ops,
)

FAMILY = [Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE]


@settings(max_examples=120, deadline=None, derandomize=True)
@given(schedule=st.sampled_from(FAMILY), n=st.integers(1, 6), m=st.integers(1, 16), cap=st.integers(1, 12),
       dps=st.lists(st.sampled_from([1, 2]), min_size=6, max_size=6), lat=st.sampled_from([0.0, 0.5, 3.0]))
def test_capped_orders_hold_at_most_k_and_never_deadlock(schedule: Schedule, n: int, m: int, cap: int,
                                                         dps: list[int], lat: float) -> None:
    dp = dps[:n]
    top = max(dp)
    for low in (min(dp), None):  # the pipeline's smallest dp, or the safe default
        orders = [[replica_ops(schedule, n, m, i, dp=d, replica=r, max_dp=top, max_in_flight=cap, min_dp=low)
                   for r in range(d)] for i, d in enumerate(dp)]
        res = replay(orders, forward_s=1.0, backward_s=2.0, link_s=lat)  # raises on a deadlock
        for i, peaks in enumerate(res.peak_in_flight):
            assert max(peaks) <= cap
            if dp == [1] * n:
                assert max(peaks) == peak_in_flight(schedule, n, m, i, max_in_flight=cap)


@pytest.mark.parametrize("schedule", FAMILY)
def test_a_cap_at_or_above_the_depth_changes_nothing(schedule: Schedule) -> None:
    n, m = 4, 12
    for i in range(n):
        depth = peak_in_flight(schedule, n, m, i)
        for cap in (depth, depth + 1, 50):
            assert replica_ops(schedule, n, m, i, max_in_flight=cap) == replica_ops(schedule, n, m, i)


def test_equal_memory_caps_latency_aware_at_the_1f1b_peak() -> None:
    n, m = 3, 12
    f1 = [peak_in_flight(Schedule.ONE_F_ONE_B, n, m, i) for i in range(n)]
    la = [peak_in_flight(Schedule.LATENCY_AWARE, n, m, i) for i in range(n)]
    la_k = [peak_in_flight(Schedule.LATENCY_AWARE, n, m, i, max_in_flight=max(f1)) for i in range(n)]
    assert f1 == [3, 2, 1] and la == [6, 4, 2]
    assert la_k == [3, 3, 2] and max(la_k) == max(f1)
    assert [default_warmup(Schedule.LATENCY_AWARE, n, m, i, max_in_flight=3) for i in range(n)] == [2, 2, 1]


def test_gpipe_ignores_the_cap_and_bad_caps_are_rejected() -> None:
    assert replica_ops(Schedule.GPIPE, 3, 6, 0, max_in_flight=2) == replica_ops(Schedule.GPIPE, 3, 6, 0)
    with pytest.raises(ValidationError, match="max_in_flight"):
        default_warmup(Schedule.ONE_F_ONE_B, 3, 6, 0, max_in_flight=0)


def test_plan_key_round_trips() -> None:
    stages = (Stage(cluster="a", first_layer=0, last_layer=1),)
    assert plan_max_in_flight(Plan(stages=stages, micro_batches=4, schedule=Schedule.ONE_F_ONE_B)) is None
    plan = Plan(stages=stages, micro_batches=4, schedule=Schedule.LATENCY_AWARE, extras={MAX_IN_FLIGHT_KEY: 3.0})
    assert plan_max_in_flight(plan) == 3
    with pytest.raises(ValidationError):
        plan_max_in_flight(Plan(stages=stages, micro_batches=4, schedule=Schedule.LATENCY_AWARE,
                                extras={MAX_IN_FLIGHT_KEY: 2.5}))
