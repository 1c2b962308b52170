"""The Planner service as a :class:`~spiderflow.core.placement.base.Planner`: the seam a policy plans through.

:class:`RemotePlanner` sends the topology, the job, the whole ordered allocation and the objective
(``PlanRequest.allocation``, ``budget.objective``, ``brief``) and returns the service's plan, which is the plan
:class:`~spiderflow.core.placement.common.LocalPlanner` makes of the same inputs in process (the service runs it).
A policy built with it (``get_policy(name, planner=RemotePlanner(...))``) decides as in process, except that
its chain plans come from the service. Blocking (a policy decides in a worker thread): one synchronous gRPC
channel, a deadline per call; errors come back as the domain's (:func:`spiderflow.rpc.errors.from_rpc_error`:
an :class:`~spiderflow.core.errors.UnschedulableError` with its binding constraint when nothing fits, an
:class:`~spiderflow.core.errors.UnavailableError` when the service cannot be reached).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from spiderflow.core.domain import Budget, JobSpec, Plan, PlanOptions, Topology
from spiderflow.proto.planner.v1 import planner_pb2, planner_pb2_grpc
from spiderflow.rpc import convert
from spiderflow.rpc.errors import from_rpc_error
from spiderflow.rpc.server import channel_options

__all__ = ["RemotePlanner"]


class RemotePlanner:
    """Plans allocations through the Planner service at ``address`` (TLS with ``credentials``)."""

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        opts = channel_options()
        self._channel = (grpc.secure_channel(address, credentials, options=opts) if credentials is not None
                         else grpc.insecure_channel(address, options=opts))
        self._stub = planner_pb2_grpc.PlannerStub(self._channel)

    @property
    def name(self) -> str:
        return f"remote/{self.address}"

    def plan(self, topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], options: PlanOptions) -> Plan:
        """The service's plan of ``allocation`` (see :class:`~spiderflow.core.placement.base.Planner`)."""
        req = planner_pb2.PlanRequest(
            topology=convert.topology_to_proto(topo), job=convert.job_to_proto(job),
            allocation=convert.allocation_to_proto(allocation),
            budget=convert.budget_to_proto(Budget(objective=options.objective)),
            max_in_flight=options.max_in_flight or 0, brief=not options.explain,
        )
        try:
            resp = self._stub.Plan(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return convert.plan_from_proto(resp.plan, field="response.plan")

    def close(self) -> None:
        self._channel.close()
