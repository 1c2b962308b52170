"""An idle agent for tests that serve :class:`agent.service.AgentService` without a whole
:class:`agent.agent.Agent` (the servicer's :class:`~agent.service.AgentState`)."""

from __future__ import annotations

from agent.probe import Ingress
from spiderflow.proto.agent.v1 import agent_pb2


class IdleAgentState:
    """Not training, bulk probes up to ``serve_cap_bytes`` (1 MiB unless given), an empty status."""

    busy = False

    def __init__(self, serve_cap_bytes: int = 1 << 20) -> None:
        self.serve_cap_bytes = serve_cap_bytes
        self.ingress = Ingress()

    def status(self) -> agent_pb2.GetStatusResponse:
        return agent_pb2.GetStatusResponse()
