"""Helpers shared by the security tests."""

from __future__ import annotations

from google.protobuf import json_format

from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel


async def submit_tiny_job_to_success(scheduler: str, job_id: str) -> None:
    """Submit a 2-step gpt-tiny job to the plaintext scheduler at ``scheduler`` and watch it to SUCCEEDED
    (the scheduler's simulated executor runs it)."""
    req = json_format.ParseDict({"request_id": f"r-{job_id}", "job": {
        "id": job_id, "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 2,
        "gpus": {"min": 1, "max": 1}}}, scheduler_pb2.SubmitJobRequest())
    async with open_channel(scheduler) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        await stub.SubmitJob(req, timeout=10)
        events = [m async for m in stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job_id), timeout=60)]
    assert events[-1].state_change.to_state == types_pb2.JOB_STATE_SUCCEEDED
