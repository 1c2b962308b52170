"""The agent's worker board and its WatchWorkers RPC, on a real gRPC server (the board is fed by hand
here; tests/agent/test_executor.py feeds it from real worker processes).

- a watcher gets the current state first, then every change and the progress of its job only;
- GetStatus-style snapshots are ordered by job, attempt and rank; a terminal state is final;
- ended attempts beyond the retention are forgotten, running ones never;
- a watcher that falls behind is ended with RESOURCE_EXHAUSTED after what was queued for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from idle_agent import IdleAgentState

import agent.workers
from agent.service import AgentService
from agent.workers import WorkerBoard
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import RpcServer, open_channel, serve

pytestmark = pytest.mark.timeout(60)

S = agent_pb2


def _w(rank: int, stage: int = 0) -> agent_pb2.Worker:
    return agent_pb2.Worker(rank=rank, stage=stage)


@pytest.fixture
async def served() -> AsyncIterator[tuple[WorkerBoard, RpcServer]]:
    board = WorkerBoard()
    server = await serve([AgentService(IdleAgentState(), workers=board)])
    try:
        yield board, server
    finally:
        await server.stop(grace_s=0)


async def _next(stream: object) -> agent_pb2.WatchWorkersResponse:
    return await asyncio.wait_for(stream.read(), 10)  # type: ignore[attr-defined]


async def test_a_watch_starts_from_the_current_state_then_follows_its_job(
        served: tuple[WorkerBoard, RpcServer]) -> None:
    board, server = served
    board.update("j1", 1, _w(0), S.WORKER_STATE_RUNNING, step=3)
    board.update("other", 1, _w(0), S.WORKER_STATE_STARTING)
    async with open_channel(server.address) as ch:
        stream = agent_pb2_grpc.AgentStub(ch).WatchWorkers(S.WatchWorkersRequest(job_id="j1"))
        first = await _next(stream)
        assert (first.worker.job_id, first.worker.state, first.worker.step) == ("j1", S.WORKER_STATE_RUNNING, 3)
        while board.watchers == 0:  # the server registered the watch once it sent the snapshot
            await asyncio.sleep(0.01)
        board.update("other", 1, _w(0), S.WORKER_STATE_RUNNING, step=1)  # not this watcher's job
        board.progress(types_pb2.ProgressEvent(job_id="j1", attempt=1, step=4, loss=2.5))
        board.update("j1", 1, _w(0), S.WORKER_STATE_RUNNING, step=4)
        board.update("j1", 1, _w(0), S.WORKER_STATE_RUNNING, step=4)  # no change: not sent
        board.update("j1", 1, _w(0), S.WORKER_STATE_SUCCEEDED, exit_code=0)
        got = [await _next(stream) for _ in range(3)]
        assert got[0].progress.step == 4 and got[0].progress.loss == 2.5
        assert [(g.worker.state, g.worker.step) for g in got[1:]] == [(S.WORKER_STATE_RUNNING, 4),
                                                                     (S.WORKER_STATE_SUCCEEDED, 4)]
        stream.cancel()


def test_snapshots_are_ordered_and_terminal_states_final() -> None:
    board = WorkerBoard()
    board.update("b", 2, _w(1, stage=1), S.WORKER_STATE_STARTING)
    board.update("b", 2, _w(0), S.WORKER_STATE_STARTING)
    board.update("a", 1, _w(0), S.WORKER_STATE_FAILED, exit_code=1, error="rank 0: ValueError: x")
    board.update("a", 1, _w(0), S.WORKER_STATE_RUNNING, step=9)  # after a terminal state: ignored
    assert [(s.job_id, s.attempt, s.worker.rank) for s in board.snapshot()] == [("a", 1, 0), ("b", 2, 0), ("b", 2, 1)]
    [failed] = board.snapshot("a")
    assert (failed.state, failed.exit_code, failed.error, failed.step) == (S.WORKER_STATE_FAILED, 1,
                                                                        "rank 0: ValueError: x", 0)
    board.end_attempt("b", 2, reason="assignment removed")
    assert {(s.state, s.error) for s in board.snapshot("b")} == {(S.WORKER_STATE_STOPPED, "assignment removed")}


def test_ended_attempts_beyond_the_retention_are_forgotten() -> None:
    board = WorkerBoard(keep_attempts=2)
    board.update("live", 1, _w(0), S.WORKER_STATE_RUNNING, step=1)
    for i in range(5):
        board.update(f"j{i}", 1, _w(0), S.WORKER_STATE_SUCCEEDED, exit_code=0)
    assert sorted({s.job_id for s in board.snapshot()}) == ["j3", "j4", "live"]


async def test_a_watcher_that_falls_behind_is_ended_after_what_was_queued(
        served: tuple[WorkerBoard, RpcServer], monkeypatch: pytest.MonkeyPatch) -> None:
    board, server = served
    monkeypatch.setattr(agent.workers, "WATCH_QUEUE", 8)
    async with open_channel(server.address) as ch:
        stream = agent_pb2_grpc.AgentStub(ch).WatchWorkers(S.WatchWorkersRequest())
        board.update("j", 1, _w(0), S.WORKER_STATE_RUNNING, step=0)
        await _next(stream)
        while board.watchers == 0:
            await asyncio.sleep(0.01)
        for step in range(1, 40):  # the loop never yields: the server cannot drain the watcher's queue
            board.progress(types_pb2.ProgressEvent(job_id="j", attempt=1, step=step))
        assert board.watchers == 0
        received = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                msg = await _next(stream)
                assert msg is not grpc.aio.EOF
                received += 1
        assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "watch again" in (ended.value.details() or "")
        assert received == 8
