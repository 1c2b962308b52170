"""The Planner service on a real gRPC server (port 0): plans, estimates and typed errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
import grpc.aio
import pytest

from services.planner.service import PlannerService
from spiderflow.core.domain import Plan, Schedule
from spiderflow.formats import job_from_dict, load_topology
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.server import RpcServer, open_channel, serve

ROOT = Path(__file__).resolve().parents[2]
TOPO = load_topology(ROOT / "examples/topology-3.yaml")
JOB = job_from_dict({"id": "j1", "model": "gpt3-1.3b", "global_batch": 64, "seq_len": 2048,
                     "gpus": {"min": 8, "max": 24}})


@pytest.fixture
async def stub() -> AsyncIterator[planner_pb2_grpc.PlannerStub]:
    server: RpcServer = await serve([PlannerService()], port=0)
    channel = open_channel(server.address)
    try:
        yield planner_pb2_grpc.PlannerStub(channel)
    finally:
        await channel.close()
        await server.stop(grace_s=0)


def _req(**kw: object) -> planner_pb2.PlanRequest:
    req = planner_pb2.PlanRequest(topology=convert.topology_to_proto(TOPO), job=convert.job_to_proto(JOB))
    for k, v in kw.items():
        if k == "chain":
            req.chain.clusters.extend(v)  # type: ignore[arg-type]
        else:
            setattr(req, k, v)
    return req


async def test_plan_with_policy_and_chain(stub: planner_pb2_grpc.PlannerStub) -> None:
    for req in (_req(policy="spinsearch"), _req(chain=["virginia", "ohio"])):
        resp = await stub.Plan(req)
        assert resp.status == types_pb2.PLACEMENT_STATUS_SUCCESS
        plan = convert.plan_from_proto(resp.plan)
        assert plan.layers == JOB.model.layers
        assert JOB.gpus.min <= plan.gpus <= JOB.gpus.max
        assert plan.step_time_s > 0 and resp.planning_seconds >= 0


async def test_estimate_matches_plan(stub: planner_pb2_grpc.PlannerStub) -> None:
    planned = await stub.Plan(_req(chain=["virginia"]))
    est = await stub.Estimate(planner_pb2.EstimateRequest(topology=_req().topology, job=_req().job, plan=planned.plan))
    assert est.fits_memory
    assert est.plan.predictions.step_time_s == pytest.approx(planned.plan.predictions.step_time_s)


async def test_estimate_honours_the_plans_in_flight_cap(stub: planner_pb2_grpc.PlannerStub) -> None:
    """A latency-aware plan capped at K micro-batches in flight is estimated at the capped memory (at
    K = 1F1B's peak its first stage holds what 1F1B's does), not at the uncapped deeper warm-up's."""
    planned = await stub.Plan(_req(chain=["virginia", "ohio"]))
    plan = convert.plan_from_proto(planned.plan)
    n = len(plan.stages)
    la = replace(plan, schedule=Schedule.LATENCY_AWARE, micro_batches=64, extras={})
    f1 = replace(la, schedule=Schedule.ONE_F_ONE_B)
    capped = replace(la, extras={"max_in_flight": float(n)})

    async def mem(p: Plan) -> list[float]:
        est = await stub.Estimate(planner_pb2.EstimateRequest(topology=_req().topology, job=_req().job,
                                                              plan=convert.plan_to_proto(p)))
        return list(est.plan.predictions.memory_gib_per_gpu)

    m_la, m_f1, m_capped = await mem(la), await mem(f1), await mem(capped)
    assert m_capped[0] == pytest.approx(m_f1[0])
    assert all(c <= u + 1e-12 for c, u in zip(m_capped, m_la, strict=True))
    if n > 1:
        assert m_la[0] > m_f1[0]  # the uncapped deeper warm-up holds more


async def test_errors_are_typed(stub: planner_pb2_grpc.PlannerStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Plan(_req(chain=["tokyo"]))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    bad = _req()
    bad.job.gpus.min = 99
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Plan(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job.gpus.min" in (e.value.details() or "")
    huge = job_from_dict({"id": "big", "model": "llama3-70b", "global_batch": 64, "gpus": {"min": 1, "max": 8}})
    req = planner_pb2.PlanRequest(topology=_req().topology, job=convert.job_to_proto(huge))
    req.chain.clusters.append("oregon")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Plan(req)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GiB" in (e.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Plan(_req(policy="no-such-policy"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _peak(plan: Plan) -> int:
    from spiderflow.core.costmodel import in_flight_microbatches
    from spiderflow.core.schedules import plan_max_in_flight

    n = len(plan.stages)
    return max(in_flight_microbatches(plan.schedule, plan.micro_batches, st.dp, i, n,
                                      max_in_flight=plan_max_in_flight(plan))
               for i, st in enumerate(plan.stages))


async def test_plan_honours_max_in_flight(stub: planner_pb2_grpc.PlannerStub) -> None:
    """``max_in_flight = K``: TPA on a chain plans under the cap, a policy's plan is held to it; either way
    no stage replica holds more than K micro-batches and the memory figures are evaluate's under the cap."""
    from spiderflow.core import costmodel

    for req in (_req(chain=["virginia", "ohio"], max_in_flight=1), _req(policy="spinsearch", max_in_flight=1),
                _req(chain=["virginia", "ohio"], max_in_flight=2, schedule=types_pb2.SCHEDULE_GPIPE)):
        resp = await stub.Plan(req)
        assert resp.status == types_pb2.PLACEMENT_STATUS_SUCCESS
        plan = convert.plan_from_proto(resp.plan)
        assert _peak(plan) <= req.max_in_flight
        if plan.schedule in (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE):
            assert plan.extras["max_in_flight"] == req.max_in_flight
        ev = costmodel.evaluate(plan, TOPO, JOB)
        assert list(resp.plan.predictions.memory_gib_per_gpu) == pytest.approx(list(ev.memory_gib_per_gpu))
        assert costmodel.fits_memory(ev, TOPO)[0]
    # 0 (unset): no cap
    plain = convert.plan_from_proto((await stub.Plan(_req(chain=["virginia", "ohio"]))).plan)
    assert "max_in_flight" not in plain.extras


async def test_negative_max_in_flight_is_invalid(stub: planner_pb2_grpc.PlannerStub) -> None:
    for req in (_req(chain=["virginia"], max_in_flight=-1), _req(policy="firstfit", max_in_flight=-3)):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Plan(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_in_flight" in (e.value.details() or "")


@pytest.mark.parametrize("level2", ["exact", "cpsat"])
@pytest.mark.parametrize("strategy", ["chain", "policy"])
async def test_the_services_level2_solver_plans_chains_and_policies(level2: str, strategy: str) -> None:
    import spiderflow.core.tpa.level2 as l2
    from spiderflow.core.placement.common import plan_cache_clear

    plan_cache_clear()
    l2.cache_clear()
    server: RpcServer = await serve([PlannerService(level2=level2)], port=0)  # type: ignore[arg-type]
    channel = open_channel(server.address)
    try:
        req = _req(chain=["virginia", "ohio"]) if strategy == "chain" else _req(policy="spinsearch")
        resp = await planner_pb2_grpc.PlannerStub(channel).Plan(req)
        assert resp.status == types_pb2.PLACEMENT_STATUS_SUCCESS
    finally:
        await channel.close()
        await server.stop(grace_s=0)
    assert (l2.STATS.cpsat_solves > 0) is (level2 == "cpsat")
