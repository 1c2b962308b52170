"""The executor's SchedulerReporter sends the agent's bearer token with every ReportProgress (and none
without a token), to a real in-process gRPC server."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio

from agent.executor import SchedulerReporter
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc


class _Recorder(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.authorization: list[str | None] = []

    async def ReportProgress(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        md = dict(context.invocation_metadata() or ())
        self.authorization.append(md.get("authorization"))
        return scheduler_pb2.ReportProgressResponse(accepted=True)


async def test_report_progress_carries_the_bearer_token() -> None:
    recorder = _Recorder()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(recorder, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        req = scheduler_pb2.ReportProgressRequest(cluster="virginia", job_id="j1", attempt=1)
        with_token = SchedulerReporter(f"127.0.0.1:{port}", token="virginia-agent-token-0123456789")
        without = SchedulerReporter(f"127.0.0.1:{port}")
        try:
            assert await with_token.report(req) == (True, False)
            assert await without.report(req) == (True, False)
        finally:
            await with_token.close()
            await without.close()
    finally:
        await server.stop(None)
    assert recorder.authorization == ["Bearer virginia-agent-token-0123456789", None]
