"""The Planner gRPC service (``spiderflow.planner.v1.Planner``): a thin, stateless adapter over TPA.

Every request carries the topology it is about, so any replica answers any request and nothing is
stored. The servicer only converts proto → domain (:mod:`spiderflow.rpc.convert`), calls the pure core
(:func:`spiderflow.core.tpa.plan_chain` or a placement policy) in a worker thread so the event loop stays
responsive, and converts back. ``PlanRequest.max_in_flight = K`` caps the micro-batches in flight per stage
replica: TPA on a chain plans under it (:func:`spiderflow.core.tpa.plan_chain`), a policy's plan is held to it
afterwards (:func:`spiderflow.core.tpa.planner.with_in_flight_cap`). Errors keep their meaning
(:mod:`spiderflow.rpc.errors`):

- malformed topology/job/plan → INVALID_ARGUMENT naming the field (``job.gpus.min``, ``max_in_flight``);
- a chain cluster that is not in the topology, or an unknown policy → NOT_FOUND / INVALID_ARGUMENT;
- no feasible plan → FAILED_PRECONDITION whose message names the binding constraint (e.g. which stage
  exceeds memory by how many GiB); the constraint travels in the error metadata too;
- a policy places a job with resource constraints on its allowed clusters only
  (:func:`spiderflow.core.constraints.view`); when none can satisfy them → FAILED_PRECONDITION, constraint
  ``constraints``;
- with authentication on, a tenant may plan only its own tenant's jobs and agents may not call the
  planner (PERMISSION_DENIED; :func:`spiderflow.security.authz.authorize_plan`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

import grpc.aio
import structlog

from spiderflow import metrics
from spiderflow.core import costmodel
from spiderflow.core.constraints import unsatisfiable
from spiderflow.core.constraints import view as constraint_view
from spiderflow.core.domain import JobSpec, Plan, PlanOptions, Topology
from spiderflow.core.errors import NotFoundError, UnschedulableError, ValidationError
from spiderflow.core.placement import Budget, Objective, PlacementResult, PlacementStatus, get_policy
from spiderflow.core.placement.common import Level2, LocalPlanner
from spiderflow.core.tpa.planner import with_in_flight_cap
from spiderflow.core.tpa.timeline import evaluate_on_timeline, result_on_timeline
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.errors import map_domain_errors
from spiderflow.security.authz import authorize_plan
from spiderflow.security.identity import current_principal

__all__ = ["DEFAULT_POLICY", "PlannerService", "allocation_for_chain", "plan_allocation", "plan_on_chain"]

log = structlog.get_logger(__name__)

DEFAULT_POLICY = "spinsearch"


def allocation_for_chain(topo: Topology, job: JobSpec, chain: Sequence[str]) -> list[tuple[str, int]]:
    """GPUs per cluster for a user-given chain: each cluster's free GPUs, in chain order, until the job's
    maximum is reached. Raises NotFound for an unknown cluster, Unschedulable below the job's minimum."""
    if not chain:
        raise ValidationError("chain.clusters", "must name at least one cluster", [])
    if len(set(chain)) != len(chain):
        raise ValidationError("chain.clusters", "a cluster may appear once", list(chain))
    out: list[tuple[str, int]] = []
    left = job.gpus.max
    for name in chain:
        c = topo.cluster(name)  # NotFoundError for an unknown cluster
        take = min(c.free, left)
        if take <= 0:
            raise UnschedulableError(
                f"cluster {name} has no free GPUs left for the chain (free {c.free}, job max {job.gpus.max})",
                constraint="gpus",
            )
        out.append((name, take))
        left -= take
    total = sum(g for _, g in out)
    if total < job.gpus.min:
        raise UnschedulableError(
            f"chain {','.join(chain)} has {total} free GPUs, job needs at least {job.gpus.min}", constraint="gpus"
        )
    return out


def plan_on_chain(
    topo: Topology, job: JobSpec, chain: Sequence[str], objective: Objective = Objective.JCT,
    max_in_flight: int | None = None, level2: Level2 = "exact",
) -> PlacementResult:
    """TPA on a fixed chain (under the in-flight cap ``max_in_flight`` if given, level 2 solved by
    ``level2``), timed; raises :class:`UnschedulableError` when nothing fits."""
    from spiderflow.core.tpa import plan_chain

    t0 = time.perf_counter()
    plan = plan_chain(topo, job, allocation_for_chain(topo, job, chain), objective=objective,
                      max_in_flight=max_in_flight, level2=level2)
    return PlacementResult(
        status=PlacementStatus.SUCCESS, policy="tpa", plan=plan, planning_seconds=time.perf_counter() - t0
    )


def plan_allocation(topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], options: PlanOptions,
                    level2: Level2 = "exact") -> PlacementResult:
    """The in-process planner's plan of exactly ``allocation`` (:class:`LocalPlanner`), timed: what a policy
    planning through this service gets, equal to what it gets in process; raises
    :class:`UnschedulableError` when nothing fits."""
    t0 = time.perf_counter()
    plan = LocalPlanner(level2=level2).plan(topo, job, allocation, options)
    return PlacementResult(
        status=PlacementStatus.SUCCESS, policy="tpa", plan=plan, planning_seconds=time.perf_counter() - t0
    )


def _force_schedule(plan: Plan, topo: Topology, job: JobSpec, schedule: int) -> Plan:
    if schedule == types_pb2.SCHEDULE_UNSPECIFIED:
        return plan
    forced = convert.schedule_from_proto(schedule, field="schedule")
    return costmodel.evaluate(replace(plan, schedule=forced), topo, job)


@map_domain_errors
class PlannerService(planner_pb2_grpc.PlannerServicer):
    """Stateless; safe to run any number of replicas."""

    def __init__(self, *, default_policy: str = DEFAULT_POLICY, level2: Level2 = "exact") -> None:
        self.default_policy = default_policy
        self.level2: Level2 = level2
        """TPA's level-2 solver (``"exact"`` or ``"cpsat"``), for chains and for policies that plan with TPA."""

    async def Plan(
        self, request: planner_pb2.PlanRequest, context: grpc.aio.ServicerContext
    ) -> planner_pb2.PlanResponse:
        authorize_plan(current_principal(), request.job.tenant)
        if not request.HasField("topology"):
            raise ValidationError("topology", "is required")
        if not request.HasField("job"):
            raise ValidationError("job", "is required")
        topo = convert.topology_from_proto(request.topology)
        job = convert.job_from_proto(request.job)
        budget = convert.budget_from_proto(request.budget) if request.HasField("budget") else Budget()
        cap = convert.max_in_flight_from_proto(request.max_in_flight)
        strategy = request.WhichOneof("strategy")
        t0 = time.perf_counter()
        if strategy == "allocation":
            alloc = convert.allocation_from_proto(request.allocation)
            options = PlanOptions(objective=budget.objective, explain=not request.brief, max_in_flight=cap)
            result = await asyncio.to_thread(plan_allocation, topo, job, alloc, options, self.level2)
        elif strategy == "chain":
            chain = list(request.chain.clusters)
            result = await asyncio.to_thread(plan_on_chain, topo, job, chain, budget.objective, cap, self.level2)
        else:
            name = request.policy if strategy == "policy" else self.default_policy
            policy = get_policy(name, planner=LocalPlanner(level2=self.level2))
            if why := unsatisfiable(topo, job):  # the job's resource constraints: the policy sees its view only
                raise UnschedulableError(why, constraint="constraints")
            result = await asyncio.to_thread(policy.place, constraint_view(topo, job), job, budget)
        metrics.observe_plan(time.perf_counter() - t0, strategy=strategy or "policy", ok=result.ok)
        if not result.ok:
            log.info("planner.unschedulable", job=job.id, policy=result.policy, reason=result.reason,
                     constraint=result.constraint, topology_revision=topo.revision)
            raise UnschedulableError(result.reason or "no feasible plan", constraint=result.constraint)
        assert result.plan is not None
        plan = _force_schedule(result.plan, topo, job, request.schedule)
        if cap is not None:  # a policy's plan (or a forced schedule) held to the cap; TPA's chain plan already is
            plan = with_in_flight_cap(plan, topo, job, cap)
        result = result_on_timeline(replace(result, plan=plan), topo, job)  # every policy on the one prediction
        assert result.plan is not None
        log.info("planner.planned", job=job.id, policy=result.policy, chain=list(plan.chain),
                 step_time_s=result.plan.step_time_s, planning_seconds=result.planning_seconds,
                 topology_revision=topo.revision)
        return convert.placement_result_to_proto(result)

    async def Estimate(
        self, request: planner_pb2.EstimateRequest, context: grpc.aio.ServicerContext
    ) -> planner_pb2.EstimateResponse:
        authorize_plan(current_principal(), request.job.tenant)
        for name in ("topology", "job", "plan"):
            if not request.HasField(name):
                raise ValidationError(name, "is required")
        topo = convert.topology_from_proto(request.topology)
        job = convert.job_from_proto(request.job)
        plan = convert.plan_from_proto(request.plan)
        for i, st in enumerate(plan.stages):
            if st.cluster not in topo.index:
                raise NotFoundError(f"plan.stages[{i}].cluster: cluster {st.cluster!r} is not in the topology")
        if plan.layers != job.model.layers:
            raise ValidationError("plan.stages", f"must cover the model's {job.model.layers} layers",
                                  plan.layers)
        # A plan carrying an in-flight cap (extras["max_in_flight"]) is charged memory under it by evaluate; the
        # step is the exact timeline's, as the planner reports it (the closed form for an order it cannot run).
        try:
            out = evaluate_on_timeline(plan, topo, job)
        except ValueError:
            out = costmodel.evaluate(plan, topo, job)
        ok, worst, excess = costmodel.fits_memory(out, topo)
        return planner_pb2.EstimateResponse(
            plan=convert.plan_to_proto(out), fits_memory=ok, worst_stage=worst, excess_gib=excess
        )
