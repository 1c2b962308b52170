"""An in-process grpc.aio server on port 0 serving the test servicers, and a channel to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc.aio
import pytest
from rpc_helpers import CostPlanner, ErrorScheduler

from spiderflow.rpc.server import RpcServer, open_channel, serve


@pytest.fixture
def scheduler_servicer() -> ErrorScheduler:
    return ErrorScheduler()


@pytest.fixture
async def server(scheduler_servicer: ErrorScheduler) -> AsyncIterator[RpcServer]:
    srv = await serve([scheduler_servicer, CostPlanner()], host="127.0.0.1", port=0)
    try:
        yield srv
    finally:
        scheduler_servicer.release.set()
        await srv.stop(grace_s=0)


@pytest.fixture
async def channel(server: RpcServer) -> AsyncIterator[grpc.aio.Channel]:
    ch = open_channel(server.address)
    try:
        yield ch
    finally:
        await ch.close()
