"""Test servicers for the RPC plumbing tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import asyncio

import grpc

from spiderflow.core import costmodel
from spiderflow.core import errors as E
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert as cv
from spiderflow.rpc.errors import map_domain_errors, rpc_method

# One instance of every domain error, as a servicer would raise it.
DOMAIN_ERRORS: dict[str, E.SpiderFlowError] = {
    "ValidationError": E.ValidationError("job.gpus.min", "must be ≤ gpus.max (8)", 16),
    "NotFoundError": E.NotFoundError("job 'j9' does not exist"),
    "AlreadyExistsError": E.AlreadyExistsError("job 'j1' exists"),
    "ConflictError": E.ConflictError("job 'j1' changed since revision 7"),
    "PreconditionError": E.PreconditionError("job 'j1' already finished"),
    "UnschedulableError": E.UnschedulableError("needs 80 GiB per GPU, largest is 40", constraint="memory"),
    "PermissionDeniedError": E.PermissionDeniedError("agent of 'ohio' reported for 'virginia'"),
    "ResourceExhaustedError": E.ResourceExhaustedError("queue holds 10000 jobs"),
    "UnavailableError": E.UnavailableError("etcd is unreachable"),
}


@map_domain_errors
class ErrorScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """A Scheduler whose methods fail on demand (the job id names what to raise)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def SubmitJob(self, request, context):  # type: ignore[no-untyped-def]
        job = cv.job_from_proto(request.job)  # real validation, real field paths
        return scheduler_pb2.SubmitJobResponse(
            job=scheduler_pb2.Job(spec=cv.job_to_proto(job), state=types_pb2.JOB_STATE_PENDING), created=True
        )

    async def GetJob(self, request, context):  # type: ignore[no-untyped-def]
        what = request.job_id
        if what in DOMAIN_ERRORS:
            raise DOMAIN_ERRORS[what]
        if what == "huge":
            raise E.ValidationError("topology.clusters", "must be an object", ["x" * 100] * 1000)
        if what == "runtime":
            raise RuntimeError("secret internal detail")
        if what == "unimplemented":
            raise NotImplementedError("GetJob for archived jobs")
        if what.startswith("abort:"):  # the servicer aborts by itself, without domain metadata
            await context.abort(grpc.StatusCode[what.split(":", 1)[1]], "aborted by the servicer")
        if what == "slow":
            await asyncio.sleep(0.3)
        return scheduler_pb2.GetJobResponse(job=scheduler_pb2.Job(spec=types_pb2.JobSpec(id=what)))

    async def WatchJob(self, request, context):  # type: ignore[no-untyped-def]
        yield scheduler_pb2.WatchJobResponse(revision=1, job=scheduler_pb2.Job(spec=types_pb2.JobSpec(id="j1")))
        if request.job_id == "wait":
            await self.release.wait()
            return
        yield scheduler_pb2.WatchJobResponse(revision=2, progress=types_pb2.ProgressEvent(job_id="j1", step=1))
        if request.job_id in DOMAIN_ERRORS:
            raise DOMAIN_ERRORS[request.job_id]
        if request.job_id == "runtime":
            raise RuntimeError("boom")


class CostPlanner(planner_pb2_grpc.PlannerServicer):
    """A Planner whose Estimate is the real converters + cost model (the shape every servicer has)."""

    @rpc_method
    async def Estimate(self, request, context):  # type: ignore[no-untyped-def]
        topo = cv.topology_from_proto(request.topology)
        job = cv.job_from_proto(request.job)
        plan = cv.plan_from_proto(request.plan)
        for i, stage in enumerate(plan.stages):
            if stage.cluster not in topo.index:
                raise E.NotFoundError(f"plan.stages[{i}].cluster: {stage.cluster!r} is not in the topology")
        plan = costmodel.evaluate(plan, topo, job)
        ok, worst, excess = costmodel.fits_memory(plan, topo)
        return planner_pb2.EstimateResponse(plan=cv.plan_to_proto(plan), fits_memory=ok, worst_stage=worst,
                                            excess_gib=excess)


