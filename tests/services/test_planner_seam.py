"""The planning seam through a real Planner gRPC server (port 0): the remote planner gives the in-process
planner's plan for the same inputs, and a decision made through the service equals the in-process one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from services.planner.client import RemotePlanner
from services.planner.service import PlannerService
from spiderflow.core.domain import Budget, JobSpec, Objective, PlacementResult, Plan, PlanOptions, Topology
from spiderflow.core.errors import UnschedulableError, ValidationError
from spiderflow.core.placement import get_policy
from spiderflow.core.placement.common import LocalPlanner, plan_cache_clear
from spiderflow.core.sim.tracegen import generate_trace
from spiderflow.core.topogen import generate_topology
from spiderflow.rpc.server import RpcServer, serve

TOPO = generate_topology(8, 3, "geo")
JOBS = generate_trace(6, 3, 1.5, TOPO)
"""Recorded instances: the first jobs of the replay recorder's trace on its 8-cluster topology."""


@pytest.fixture
async def remote() -> AsyncIterator[RemotePlanner]:
    server: RpcServer = await serve([PlannerService()], port=0)
    planner = RemotePlanner(server.address, timeout_s=60.0)
    try:
        yield planner
    finally:
        planner.close()
        await server.stop(grace_s=0)


def _same(a: Plan, b: Plan) -> None:
    """Equal plans: stages, micro-batches, schedule and every prediction, bit for bit; of the extras all but
    the planner's own wall time (``plan_seconds``)."""
    strip = {k: v for k, v in a.extras.items() if k != "plan_seconds"}
    assert replace(a, extras=strip) == replace(b, extras={k: v for k, v in b.extras.items() if k != "plan_seconds"})


def _place(topo: Topology, job: JobSpec, planner: LocalPlanner | RemotePlanner,
           objective: Objective) -> PlacementResult:
    return get_policy("spinsearch", planner=planner).place(topo, job, Budget(objective=objective))


@pytest.mark.parametrize("objective", [Objective.JCT, Objective.COST])
async def test_a_decision_through_the_planner_service_equals_the_in_process_one(
        remote: RemotePlanner, objective: Objective) -> None:
    for job in JOBS:
        plan_cache_clear()  # the server (in this process) plans afresh, not from the local memo
        here = await asyncio.to_thread(_place, TOPO, job, LocalPlanner(), objective)
        plan_cache_clear()
        there = await asyncio.to_thread(_place, TOPO, job, remote, objective)
        assert here.status is there.status and here.reason == there.reason, job.id
        if here.plan is not None:
            assert there.plan is not None
            _same(here.plan, there.plan)
            alloc = list(here.plan.gpus_by_cluster().items())  # in chain order
            plan_cache_clear()
            local = LocalPlanner().plan(TOPO, job, alloc, PlanOptions(objective=objective))
            plan_cache_clear()
            _same(local, await asyncio.to_thread(remote.plan, TOPO, job, alloc, PlanOptions(objective=objective)))


async def test_remote_errors_keep_their_meaning(remote: RemotePlanner) -> None:
    """Nothing fits: the binding constraint comes back; a malformed allocation names its field."""
    job = JOBS[0]
    tiny = [(TOPO.names[0], 1)]
    with pytest.raises(UnschedulableError) as local_err:
        LocalPlanner().plan(TOPO, replace(job, gpus=replace(job.gpus, min=1)), tiny, PlanOptions())
    with pytest.raises(UnschedulableError) as remote_err:
        await asyncio.to_thread(remote.plan, TOPO, replace(job, gpus=replace(job.gpus, min=1)), tiny, PlanOptions())
    assert remote_err.value.constraint == local_err.value.constraint
    with pytest.raises(ValidationError) as bad:
        await asyncio.to_thread(remote.plan, TOPO, job, [(TOPO.names[0], 1), (TOPO.names[0], 1)], PlanOptions())
    assert bad.value.field == "allocation.clusters[1].cluster"


def test_an_unreachable_planner_service_is_unavailable() -> None:
    from spiderflow.core.errors import UnavailableError

    planner = RemotePlanner("127.0.0.1:9", timeout_s=2.0)
    try:
        with pytest.raises(UnavailableError):
            planner.plan(TOPO, JOBS[0], [(TOPO.names[0], 8)], PlanOptions())
    finally:
        planner.close()
