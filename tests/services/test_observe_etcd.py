"""The scheduler's history of a job and its end, as a real process on a real etcd (one replica for the module,
``--executor agents``: the test plays the agents), on two single-GPU clusters:

- per-stage busy time in the metrics history: a two-stage job whose two agents each report their own stage
  (the first stage's last step after the last stage's success ended the job, too), read back through the SDK
  and `spiderflow metrics` at 80 columns;
- retention of finished jobs: the leader deletes the oldest finished jobs with their metrics, reports and
  request ids (``--retain-finished-jobs 1``) while jobs that have not finished stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from scheduler_harness import start_replica

from services.scheduler.repo import request_key
from spiderflow.formats import topology_to_dict
from spiderflow.mesh import sample_topology
from spiderflow.procs import ManagedProcess
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.sdk import AsyncClient
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(120)

TWO_STAGES = {"id": "two-stage", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1, "seq_len": 64,
              "steps": 3, "gpus": {"min": 2, "max": 2}}


class Mesh:
    def __init__(self, etcd: EtcdProcess, sched: ManagedProcess) -> None:
        self.etcd = etcd
        self.sched = sched


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("observe")
    topo = tmp / "two.json"
    topo.write_text(json.dumps(topology_to_dict(sample_topology(2))))
    with EtcdProcess() as etcd:
        sched = start_replica(etcd.endpoint, tmp, "sched", "--executor", "agents", "--retain-finished-jobs", "1",
                              "--retain-finished-for", "forever", "--retention-interval", "0.2", topology=topo)
        try:
            yield Mesh(etcd, sched)
        finally:
            sched.stop()


async def _wait_for(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.1)


def _event(step: int, stage: int, busy: float, loss: float = 0.0) -> types_pb2.ProgressEvent:
    return types_pb2.ProgressEvent(step=step, steps_total=3, loss=loss, tokens_per_s=100.0, step_time_s=0.5,
                                   stage=stage, stage_busy_s=busy)


async def test_each_stage_reports_its_busy_time_next_to_the_prediction(mesh: Mesh) -> None:
    channel = open_channel(mesh.sched.address)
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
        async with AsyncClient(mesh.sched.address) as client:
            await client.submit(TWO_STAGES, request_id="r-two")

            async def placed() -> bool:  # the first cycle of a fresh checkout compiles the kernels
                return (await client.get("two-stage")).plan is not None
            await _wait_for("two-stage placed", placed)
            job = await client.get("two-stage")
            assert job.plan is not None and len(job.plan.stages) == 2, job.reason
            first, last = (st.cluster for st in job.plan.stages)

            async def report(cluster: str, *events: types_pb2.ProgressEvent) -> None:
                await stub.ReportProgress(scheduler_pb2.ReportProgressRequest(
                    cluster=cluster, job_id="two-stage", attempt=job.attempt, progress=events), timeout=5)

            # stage 0 reports first: the job does not move (only the last stage's events carry the loss)
            await report(first, *(_event(s, 0, 0.010 * s) for s in (1, 2)))
            assert (await client.get("two-stage")).progress.get("step", 0) == 0
            await report(last, *(_event(s, 1, 0.020 * s, loss=5.0 - s) for s in (1, 2)))
            # a stage the caller does not run, and one outside the plan: refused, naming the field
            for cluster, stage in ((first, 1), (last, 7)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await report(cluster, _event(3, stage, 0.1))
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "progress[0].stage" in (err.value.details() or "")
            m = await client.metrics("two-stage")
            assert [p.step for p in m.points] == [1, 2]
            assert [p.stage_busy_s for p in m.points] == [(0.010, 0.020), (0.020, 0.040)]
            predicted = m.points[0].predicted_stage_busy_s
            assert len(predicted) == 2 and all(v > 0 for v in predicted)
            assert m.points[0].loss == 4.0
            # the last stage's success ends the job; stage 0's last step, reported after that, is not accepted
            # (the job does not move) but its busy time is kept in the history
            await stub.ReportProgress(scheduler_pb2.ReportProgressRequest(
                cluster=last, job_id="two-stage", attempt=job.attempt, progress=[_event(3, 1, 0.060, loss=2.0)],
                outcomes=[scheduler_pb2.WorkerOutcome(stage=1, succeeded=True)]), timeout=5)
            assert (await client.get("two-stage")).state == "SUCCEEDED"
            late = await stub.ReportProgress(scheduler_pb2.ReportProgressRequest(
                cluster=first, job_id="two-stage", attempt=job.attempt, progress=[_event(3, 0, 0.030)],
                outcomes=[scheduler_pb2.WorkerOutcome(stage=0, succeeded=True)]), timeout=5)
            assert (late.accepted, late.stop) == (False, True)
            m = await client.metrics("two-stage")
            assert [p.step for p in m.points] == [1, 2, 3]
            assert m.points[2].stage_busy_s == (0.030, 0.060)
    finally:
        await channel.close()
    # the CLI table at 80 columns (piped): the per-stage column, no line over 80 characters
    from spiderflow.cli.commands.observe import STAGES_NOTE, metrics_table
    from spiderflow.cli.common import console

    out = io.StringIO()
    width = console.width
    console.width = 80
    try:
        with contextlib.redirect_stdout(out):
            console.print(metrics_table(m, title="two-stage: 2 step(s)"))
            console.print(STAGES_NOTE)
    finally:
        console.width = width
    text = out.getvalue()
    assert "STAGE BUSY MS" in text and "10.0/" in text and "40.0/" in text and "PREDICTED S" in text
    assert max(len(line) for line in text.splitlines()) <= 80, text


def _spec(i: int) -> dict[str, object]:
    return {"id": f"job-{i}", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 5,
            "gpus": {"min": 1, "max": 2}}


async def test_the_leader_deletes_the_oldest_finished_jobs_with_their_keys(mesh: Mesh) -> None:
    store = EtcdStore(mesh.etcd.endpoint)
    try:
        async with AsyncClient(mesh.sched.address) as client:
            for i in range(4):
                await client.submit(_spec(i), request_id=f"req-{i}")
                await store.put(keys.metrics_key(f"job-{i}", attempt=1, step=1), b"[]")

            async def ids() -> set[str]:
                return {j.id for j in await client.list() if j.id.startswith("job-")}

            await client.cancel("job-0")
            await asyncio.sleep(0.6)  # a few sweeps: one finished job is within the policy
            assert await ids() == {"job-0", "job-1", "job-2", "job-3"}
            await client.cancel("job-1")

            async def job0_gone() -> bool:
                return await ids() == {"job-1", "job-2", "job-3"}
            await _wait_for("job-0 deleted", job0_gone, timeout=20)
            await client.cancel("job-2")

            async def job1_gone() -> bool:
                return await ids() == {"job-2", "job-3"}
            await _wait_for("job-1 deleted", job1_gone, timeout=20)
            assert (await client.get("job-3")).state not in ("SUCCEEDED", "FAILED", "CANCELLED")
            for gone in ("job-0", "job-1"):
                assert (await store.get_prefix(keys.metrics_prefix(gone)))[0] == []
                assert await store.get(request_key(gone.replace("job", "req"))) is None
            for kept in ("job-2", "job-3"):
                assert (await store.get_prefix(keys.metrics_prefix(kept)))[0] != []
            # the id of a deleted job is free again
            again = await client.submit(_spec(0), request_id="req-0-again")
            assert again.id == "job-0"
    finally:
        await store.close()
    assert "scheduler.retention_deleted" in Path(mesh.sched.log_path).read_text()
