"""The assignment executor against an in-memory store and a recording reporter, with real worker processes
(one rank: the whole gpt-tiny model on this agent's single stage).

- an assignment runs: progress reaches the scheduler with the assignment's attempt, checkpoints land in
  ``checkpoints/<job>``, the stage's outcome is reported once (with the final progress), busy goes on and
  off, the rendezvous key is removed afterwards, worker logs are in the work dir;
- the agent's worker board follows each rank (starting, running with its step, succeeded; stopped when
  the assignment goes) and carries the progress events, which a watcher sees in order;
- a deleted assignment stops its workers without an outcome; the progress it had not reported yet is
  reported once; a job's own checkpoint interval overrides the agent's;
- a plan the executor cannot run (tensor parallelism) fails its stage at once, with the reason;
- values: assignment and rendezvous round trips, peer-looking errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.executor import Assignment, Executor, ExecutorSettings, RendezvousInfo, is_peer_error
from spiderflow.core.catalog import MODEL_PRESETS
from spiderflow.core.domain import Plan, Schedule, Stage
from spiderflow.formats import job_from_dict, job_to_dict, plan_to_dict
from spiderflow.proto.agent.v1 import agent_pb2
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.store import keys
from spiderflow.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(180)

CLUSTER = "solo"


class Recorder:
    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.ReportProgressRequest] = []
        self.outcome = asyncio.Event()
        self.progress = asyncio.Event()

    async def report(self, request: scheduler_pb2.ReportProgressRequest) -> tuple[bool, bool]:
        self.requests.append(request)
        if request.progress:
            self.progress.set()
        if request.outcomes:
            self.outcome.set()
        return True, False

    async def close(self) -> None:
        return None


def _assignment(job: str, steps: int, attempt: int = 1, tp: int = 1, checkpoint_every: int | None = None) -> bytes:
    spec = job_from_dict({"id": job, "model": "gpt-tiny", "global_batch": 4, "micro_batch": 2, "seq_len": 32,
                          "steps": steps, "gpus": {"min": 1, "max": tp}, "checkpoint_every": checkpoint_every})
    plan = Plan(stages=(Stage(cluster=CLUSTER, first_layer=0, last_layer=MODEL_PRESETS["gpt-tiny"].layers - 1,
                              tp=tp),),
                micro_batches=2, schedule=Schedule.ONE_F_ONE_B)
    return json.dumps({"job": job, "attempt": attempt, "stages": [0], "plan": plan_to_dict(plan),
                       "spec": job_to_dict(spec)}).encode()


@contextlib.asynccontextmanager
async def _executor(tmp_path: Path, every: int = 2, rec: Recorder | None = None) -> AsyncIterator[
        tuple[Executor, MemoryStore, Recorder, list[bool]]]:
    store = MemoryStore()
    rec = rec or Recorder()
    busy: list[bool] = []
    settings = ExecutorSettings(cluster=CLUSTER, host="127.0.0.1", work_dir=tmp_path / "work",
                                checkpoint_dir=tmp_path / "ckpt", checkpoint_every=every, failure_grace_s=1.0)
    ex = Executor(settings, store, rec, on_busy=busy.append)
    stop = asyncio.Event()
    task = asyncio.create_task(ex.run(stop))
    try:
        yield ex, store, rec, busy
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await store.close()


async def test_an_assignment_runs_reports_and_checkpoints(tmp_path: Path) -> None:
    async with _executor(tmp_path) as (ex, store, rec, busy):
        with ex.workers.watch("j1") as watch:
            await store.put(keys.assignment_key(CLUSTER, "j1"), _assignment("j1", steps=4))
            await asyncio.wait_for(rec.outcome.wait(), 150)
        seen = [watch.queue.get_nowait() for _ in range(watch.queue.qsize())]
        states = [(e.worker.state, e.worker.step) for e in seen if e.HasField("worker")]
        assert states == [(agent_pb2.WORKER_STATE_STARTING, 0)] + [(agent_pb2.WORKER_STATE_RUNNING, s)
                                                                   for s in (1, 2, 3, 4)] \
            + [(agent_pb2.WORKER_STATE_SUCCEEDED, 4)]
        assert [e.progress.step for e in seen if e.HasField("progress")] == [1, 2, 3, 4]
        [final_worker] = ex.workers.snapshot("j1")
        assert (final_worker.attempt, final_worker.worker.rank, final_worker.exit_code) == (1, 0, 0)
        assert final_worker.worker.pid > 0 and not final_worker.error
        final = rec.requests[-1]
        assert [(o.stage, o.succeeded, o.error) for o in final.outcomes] == [(0, True, "")]
        assert all(r.attempt == 1 and r.cluster == CLUSTER and r.job_id == "j1" for r in rec.requests)
        steps = sorted({p.step for r in rec.requests for p in r.progress})
        assert steps[-1] == 4
        last = max((p for r in rec.requests for p in r.progress), key=lambda p: p.step)
        assert last.loss > 0 and last.step_time_s > 0 and last.tokens_per_s > 0 and last.steps_total == 4
        kv = await store.get(keys.checkpoint_key("j1"))
        assert kv is not None and json.loads(kv.value)["step"] == 4
        assert await store.get(keys.rendezvous_key("j1", 1)) is None
        for _ in range(50):
            if busy == [True, False]:
                break
            await asyncio.sleep(0.1)
        assert busy == [True, False]
        run_dir = tmp_path / "work" / "logs" / "j1" / "attempt-1"
        assert next(run_dir.glob("*/rank-0.out")).read_text().count('"event": "step"') == 4
        # the workers train in the job's precision (the JobSpec default, bf16), not the worker file's fp32
        assert json.loads(next(run_dir.glob("*/worker-spec.json")).read_text())["precision"] == "bf16"
        assert not ex.runs


async def test_a_deleted_assignment_stops_its_workers_silently(tmp_path: Path) -> None:
    async with _executor(tmp_path, every=0) as (ex, store, rec, busy):
        key = keys.assignment_key(CLUSTER, "j2")
        # the agent saves no checkpoint (every=0), the job asks for one every step: the job's setting wins
        await store.put(key, _assignment("j2", steps=10_000, checkpoint_every=1))
        await asyncio.wait_for(rec.progress.wait(), 150)
        for _ in range(300):
            if await store.get(keys.checkpoint_key("j2")) is not None:
                break
            await asyncio.sleep(0.1)
        assert await store.get(keys.checkpoint_key("j2")) is not None
        await _remove(ex, store, key)
        assert busy == [True, False]
        assert not any(r.outcomes for r in rec.requests)
        [stopped] = ex.workers.snapshot("j2")
        assert stopped.state == agent_pb2.WORKER_STATE_STOPPED and stopped.error == "assignment removed"


class HeldRecorder(Recorder):
    """A recorder whose first progress report hangs (a slow scheduler), so that step events pile up."""

    def __init__(self) -> None:
        super().__init__()
        self.first = True

    async def report(self, request: scheduler_pb2.ReportProgressRequest) -> tuple[bool, bool]:
        if request.progress and self.first:
            self.first = False
            self.progress.set()
            await asyncio.Event().wait()  # cancelled with the run
        return await super().report(request)


async def _remove(ex: Executor, store: MemoryStore, key: str) -> None:
    """Delete an assignment and wait until its run has stopped."""
    await store.delete(key)
    for _ in range(100):
        if not ex.runs:
            break
        await asyncio.sleep(0.1)
    assert not ex.runs


async def test_a_stopped_run_reports_the_progress_it_had_not_reported(tmp_path: Path) -> None:
    async with _executor(tmp_path, every=0, rec=HeldRecorder()) as (ex, store, rec, _):
        key = keys.assignment_key(CLUSTER, "j5")
        with ex.workers.watch("j5") as watch:
            await store.put(key, _assignment("j5", steps=10_000))
            await asyncio.wait_for(rec.progress.wait(), 150)  # the first report hangs from here on
            seen = 0
            while seen < 3:  # three more steps run meanwhile
                ev = await asyncio.wait_for(watch.queue.get(), 60)
                seen += ev.HasField("progress")
        await _remove(ex, store, key)
        [late] = rec.requests  # the flush after the stop, not the hung report
        assert not late.outcomes and late.attempt == 1 and late.job_id == "j5"
        steps = [p.step for p in late.progress]
        assert steps == sorted(steps) and steps[0] == 1 and steps[-1] >= 3  # beyond the hung report's step 1


async def test_a_plan_the_executor_cannot_run_fails_the_stage_with_the_reason(tmp_path: Path) -> None:
    async with _executor(tmp_path) as (_, store, rec, busy):
        # tp 3 does not divide gpt-tiny's 4 heads: refused before any worker starts
        await store.put(keys.assignment_key(CLUSTER, "j4"), _assignment("j4", steps=2, tp=3))
        await asyncio.wait_for(rec.outcome.wait(), 30)
        [outcome] = rec.requests[-1].outcomes
        assert not outcome.succeeded and "tensor parallelism shards whole heads" in outcome.error
        assert busy == []  # no worker was started


def test_values_round_trip() -> None:
    a = Assignment.decode(_assignment("j3", steps=7, attempt=3))
    assert (a.job, a.attempt, a.stages, a.spec.steps, a.plan.stages[0].cluster) == ("j3", 3, (0,), 7, CLUSTER)
    info = RendezvousInfo(host="10.0.0.1", port=24000, checkpoint_dir="/ckpt/j3/attempt-3", checkpoint_every=5)
    assert RendezvousInfo.decode(info.encode()) == info
    assert is_peer_error("RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    assert not is_peer_error("ValueError: world size 3 != ranks the plan needs (2)")
