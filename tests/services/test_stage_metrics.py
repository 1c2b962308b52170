"""Per-stage busy time in the metrics history: a real scheduler process on a real etcd, a two-stage job, its
two agents played by the test (each reports its own stage), read back through the SDK and `spiderflow
metrics` at 80 columns."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from pathlib import Path

import grpc
import grpc.aio
import pytest
from scheduler_harness import start_replica

from spiderflow.formats import topology_to_dict
from spiderflow.mesh import sample_topology
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.sdk import AsyncClient
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(90)

JOB = {"id": "two-stage", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1, "seq_len": 64, "steps": 3,
       "gpus": {"min": 2, "max": 2}}


def _event(step: int, stage: int, busy: float, loss: float = 0.0) -> types_pb2.ProgressEvent:
    return types_pb2.ProgressEvent(step=step, steps_total=3, loss=loss, tokens_per_s=100.0, step_time_s=0.5,
                                   stage=stage, stage_busy_s=busy)


async def test_each_stage_reports_its_busy_time_next_to_the_prediction(tmp_path: Path) -> None:
    topo = tmp_path / "two.json"
    topo.write_text(json.dumps(topology_to_dict(sample_topology(2))))
    with EtcdProcess() as etcd:
        sched = start_replica(etcd.endpoint, tmp_path, "sched", "--executor", "agents", topology=topo)
        channel = open_channel(sched.address)
        try:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
            async with AsyncClient(sched.address) as client:
                await client.submit(JOB, request_id="r1")
                job = await client.get("two-stage")
                for _ in range(600):  # the first cycle of a fresh checkout compiles the kernels
                    if job.plan is not None:
                        break
                    await asyncio.sleep(0.1)
                    job = await client.get("two-stage")
                assert job.plan is not None and len(job.plan.stages) == 2, job.reason
                first, last = (st.cluster for st in job.plan.stages)

                async def report(cluster: str, *events: types_pb2.ProgressEvent) -> None:
                    await stub.ReportProgress(scheduler_pb2.ReportProgressRequest(
                        cluster=cluster, job_id="two-stage", attempt=job.attempt, progress=events), timeout=5)

                # stage 0 reports first: the job does not move (only the last stage's events carry the loss)
                await report(first, *(_event(s, 0, 0.010 * s) for s in (1, 2, 3)))
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
        finally:
            await channel.close()
            sched.stop()
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
