"""Where the scheduler reads its topology snapshots from.

- :class:`TopologyServiceSource`: the live graph from the topology service (``GetTopology`` for one
  snapshot with its etcd revision; ``WatchTopology`` to learn of changes). The production source.
- :class:`StaticTopologySource`: a topology file, never changing. For running the scheduler alone
  (simulator-backed mode, load tests, demos without agents).

``free_gpus`` in a snapshot is what a cluster offers to SpiderFlow; the scheduler subtracts its own
allocations from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

import grpc.aio
import structlog

from spiderflow.core.domain import Topology
from spiderflow.formats import load_topology
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc import convert
from spiderflow.rpc.errors import domain_errors
from spiderflow.rpc.server import open_channel

__all__ = ["StaticTopologySource", "TopologyServiceSource", "TopologySource"]

log = structlog.get_logger(__name__)


class TopologySource(Protocol):
    async def snapshot(self) -> Topology:
        """One immutable snapshot (raises UnavailableError when it cannot be read now)."""
        ...

    def changes(self) -> AsyncIterator[int]:
        """Yields a revision each time the topology changed (may coalesce changes)."""
        ...

    async def close(self) -> None: ...


class StaticTopologySource:
    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    @classmethod
    def from_file(cls, path: str | Path) -> StaticTopologySource:
        return cls(load_topology(path))

    async def snapshot(self) -> Topology:
        return self._topology

    async def changes(self) -> AsyncIterator[int]:
        await asyncio.Event().wait()  # never changes
        yield 0  # pragma: no cover

    async def close(self) -> None:
        return None


class TopologyServiceSource:
    """Reads snapshots from the topology service at ``address`` (deadline ``timeout_s`` per call)."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, credentials: grpc.ChannelCredentials | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = open_channel(address, credentials=credentials)
        self._stub = topology_pb2_grpc.TopologyStub(self._channel)

    async def snapshot(self) -> Topology:
        with domain_errors():
            resp = await self._stub.GetTopology(topology_pb2.GetTopologyRequest(), timeout=self.timeout_s)
        if not resp.topology.clusters:
            # A live graph may be empty (no agent registered, or every cluster lost): a valid snapshot in
            # which jobs holding GPUs must be re-placed, unlike a topology file, which needs a cluster.
            return Topology(clusters=(), links=(), revision=resp.topology.revision)
        return convert.topology_from_proto(resp.topology)

    async def changes(self) -> AsyncIterator[int]:
        """Follows WatchTopology, reconnecting with backoff; yields the revision of each change batch."""
        revision = 0
        delay = 0.2
        while True:
            try:
                # Resume from the last revision seen (the service's contract: events after it; a compacted
                # revision answers with a full snapshot).
                stream = self._stub.WatchTopology(topology_pb2.WatchTopologyRequest(from_revision=revision))
                async for msg in stream:
                    delay = 0.2
                    revision = max(revision, msg.revision)
                    yield msg.revision
            except grpc.aio.AioRpcError as e:
                log.info("scheduler.topology_watch_retry", code=e.code().name, address=self.address)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def close(self) -> None:
        await self._channel.close()
