"""``--wait-for-releases`` end to end: a real etcd, the scheduler as a real process, jobs over gRPC.

The topology and jobs are those of ``test_cycle.py``: ``short`` holds all 32 GPUs of the fast cluster for
an estimated 30 s (200 steps); ``long`` could start at once on the 8 GPUs of the slow cluster but finishes
much sooner on the fast one. The test plays the agents (``--executor agents``): ``short`` runs until it
reports its last stage done through ``ReportProgress``, a few seconds into the wait."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from scheduler_harness import start_replica

from spiderflow.jobs import JobState
from spiderflow.procs import ManagedProcess
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.sdk import AsyncClient, Job
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(90)

FAST_AND_SLOW: dict[str, Any] = {
    "clusters": [{"name": "fast", "gpu": "H100-80G", "nodes": 4, "gpus_per_node": 8},
                 {"name": "slow", "gpu": "A100-40G", "nodes": 1, "gpus_per_node": 8}],
    "links": [{"a": "fast", "b": "slow", "bandwidth_gbps": 1.0, "latency_ms": 50.0}],
}
SHORT: dict[str, Any] = {"id": "short", "model": "gpt3-1.3b", "global_batch": 64, "steps": 200,
                         "gpus": {"min": 32, "max": 32}}
LONG: dict[str, Any] = {"id": "long", "model": "gpt3-1.3b", "global_batch": 64, "steps": 2000,
                        "gpus": {"min": 8, "max": 32}}
TIMEOUT_S = 15.0
"""Deadline of each wait for a state: cycles run at least every second."""


def _replica(etcd: EtcdProcess, tmp_path: Path, *flags: str, name: str = "sched") -> ManagedProcess:
    topology = tmp_path / "fast-and-slow.yaml"
    topology.write_text(yaml.safe_dump(FAST_AND_SLOW))
    return start_replica(etcd.endpoint, tmp_path, name, "--executor", "agents", *flags, topology=topology)


async def _until(client: AsyncClient, job_id: str, ok: Callable[[Job], bool], what: str) -> Job:
    """Poll GetJob until ``ok`` holds (AssertionError with the last record after ``TIMEOUT_S``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    job = await client.get(job_id)
    while not ok(job):
        if loop.time() > deadline:
            raise AssertionError(f"{job_id} not {what} within {TIMEOUT_S}s: {job.state} {job.reason!r}")
        await asyncio.sleep(0.1)
        job = await client.get(job_id)
    return job


async def _report(address: str, job: Job, *, done: bool) -> None:
    """Report ``job`` as its agent on the fast cluster: its first step (RUNNING), or its last stage done."""
    assert job.plan is not None
    req = scheduler_pb2.ReportProgressRequest(cluster="fast", job_id=job.id, attempt=job.attempt)
    if done:  # the last step, then the last stage's success (a job succeeds only once its last step is in)
        req.progress.append(types_pb2.ProgressEvent(job_id=job.id, attempt=job.attempt, step=job.spec.steps,
                                                    steps_total=job.spec.steps))
        req.outcomes.append(scheduler_pb2.WorkerOutcome(stage=len(job.plan.stages) - 1, succeeded=True))
    else:
        req.progress.append(types_pb2.ProgressEvent(job_id=job.id, attempt=job.attempt, step=0,
                                                    steps_total=job.spec.steps))
    channel = open_channel(address)
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
        resp = await stub.ReportProgress(req, timeout=5)
        assert resp.accepted
    finally:
        await channel.close()


async def _allocations(etcd: EtcdProcess) -> dict[str, dict[str, int]]:
    """GPUs per cluster and job, as stored in etcd."""
    return await _stored(etcd, keys.ALLOCATIONS)


async def _stored(etcd: EtcdProcess, prefix: str) -> dict[str, Any]:
    """The JSON values under ``prefix`` in etcd, by name."""
    store = EtcdStore(etcd.endpoint)
    try:
        kvs, _ = await store.get_prefix(prefix)
        return {keys.name_of(kv.key, prefix): json.loads(kv.value) for kv in kvs}
    finally:
        await store.close()


def _events(proc: ManagedProcess, event: str) -> list[dict[str, Any]]:
    """The replica's structured log events named ``event``, oldest first."""
    out: list[dict[str, Any]] = []
    for line in proc.log_path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == event:
            out.append(doc)
    return out


def _at(event: dict[str, Any]) -> float:
    """The wall time of a log event."""
    return datetime.fromisoformat(str(event["timestamp"])).timestamp()


async def _short_running(client: AsyncClient, address: str) -> Job:
    """Submit ``short``; once placed, report its first step so that it runs on the fast cluster."""
    await client.submit(SHORT, request_id="r-short")
    short = await _until(client, "short", lambda j: j.state == JobState.PLACED, "placed")
    assert short.plan is not None and short.plan.gpus_by_cluster() == {"fast": 32}
    await _report(address, short, done=False)
    return await _until(client, "short", lambda j: j.state == JobState.RUNNING, "running")


async def test_a_job_waits_for_the_fast_cluster_and_then_starts_on_it(etcd: EtcdProcess, tmp_path: Path) -> None:
    """With ``--wait-for-releases``, ``long`` stays PENDING with SpinSearch's "waiting" reason while ``short``
    runs, is neither re-decided before its time nor started on the slow cluster, and is placed on the fast
    cluster as soon as ``short`` has released it, long before the estimated end it was waiting for."""
    proc = _replica(etcd, tmp_path, "--wait-for-releases")
    try:
        async with AsyncClient(proc.address, timeout_s=10) as client:
            short = await _short_running(client, proc.address)
            submitted = await client.submit(LONG, request_id="r-long")
            long = await _until(client, "long", lambda j: j.reason != submitted.reason, "decided")
            assert long.state == JobState.PENDING and long.plan is None and long.attempt == 0
            assert long.reason.startswith("waiting") and "GPUs being released" in long.reason
            reason = long.reason
            waits = [e for e in _events(proc, "scheduler.waiting") if e.get("job") == "long"]
            assert len(waits) == 1, waits
            decided, until = _at(waits[0]), float(waits[0]["until"])
            during: list[dict[str, Any]] = []
            while len(during) < 2:  # the deciding cycle and one more before the wait ends
                assert time.time() < until, "no second cycle ran during the wait"
                long = await client.get("long")
                assert long.state == JobState.PENDING and long.reason == reason and long.plan is None
                assert (await client.get("short")).state == JobState.RUNNING
                during = [e for e in _events(proc, "scheduler.cycle") if decided <= _at(e) < until]
                await asyncio.sleep(0.1)
            assert all(e["queued"] == 1 and e["placed"] == 0 for e in during)
            waits = [e for e in _events(proc, "scheduler.waiting") if e.get("job") == "long"]
            assert [_at(e) < until for e in waits] == [True], waits
            allocs = await _allocations(etcd)
            assert allocs.get("fast") == {"short": 32} and "long" not in allocs.get("slow", {})

            await _report(proc.address, short, done=True)
            released = time.time()
            assert (await client.get("short")).state == JobState.SUCCEEDED
            long = await _until(client, "long", lambda j: j.state == JobState.PLACED, "placed")
            assert long.plan is not None and long.plan.gpus_by_cluster().keys() == {"fast"}
            assert long.attempt == 1
            assert [t.to_state for t in long.history] == [JobState.PENDING, JobState.PLACED]
            assert long.history[-1].reason.startswith("placed on fast")
            allocs = await _allocations(etcd)
            assert set(allocs.get("fast", {})) == {"long"} and not allocs.get("slow")
            assert released + 10.0 < until and long.history[-1].time < released + 5.0
    finally:
        proc.stop()


async def test_without_the_flag_the_job_starts_on_the_slow_cluster_at_once(etcd: EtcdProcess,
                                                                            tmp_path: Path) -> None:
    """Without ``--wait-for-releases``, ``long`` is placed on the slow cluster while ``short`` still runs."""
    proc = _replica(etcd, tmp_path)
    try:
        async with AsyncClient(proc.address, timeout_s=10) as client:
            await _short_running(client, proc.address)
            await client.submit(LONG, request_id="r-long")
            long = await _until(client, "long", lambda j: j.state == JobState.PLACED, "placed")
            assert long.plan is not None and long.plan.gpus_by_cluster() == {"slow": 8}
            assert [t.to_state for t in long.history] == [JobState.PENDING, JobState.PLACED]
            assert long.reason.startswith("placed on slow")
            assert (await client.get("short")).state == JobState.RUNNING
            allocs = await _allocations(etcd)
            assert allocs.get("fast") == {"short": 32} and allocs.get("slow") == {"long": 8}
            assert _events(proc, "scheduler.waiting") == []
    finally:
        proc.stop()


async def test_a_new_leader_honours_the_wait_and_places_the_job_after_the_release(etcd: EtcdProcess,
                                                                                   tmp_path: Path) -> None:
    """The leader that decided ``long``'s wait stops during the wait. The next leader adopts the wait
    recorded in etcd: ``long`` is not decided again (no "waiting" event of its own, the same reason, still
    PENDING) and not started on the slow cluster; once ``short`` has released the fast cluster, ``long`` is
    placed there and the wait record is gone."""
    first = _replica(etcd, tmp_path, "--wait-for-releases", name="sched-a")
    try:
        async with AsyncClient(first.address, timeout_s=10) as client:
            short = await _short_running(client, first.address)
            submitted = await client.submit(LONG, request_id="r-long")
            long = await _until(client, "long", lambda j: j.reason != submitted.reason, "decided")
            assert long.reason.startswith("waiting")
            reason = long.reason
            recorded = await _stored(etcd, keys.WAITS)
            assert set(recorded) == {"long"} and recorded["long"]["claim"] == [["fast", 32]]
            until = float(recorded["long"]["until"])
    finally:
        first.stop()
    second = _replica(etcd, tmp_path, "--wait-for-releases", name="sched-b")
    try:
        async with AsyncClient(second.address, timeout_s=10) as client:
            cycles: list[dict[str, Any]] = []
            while len(cycles) < 2:  # two cycles of the new leader during the wait
                assert time.time() < until, "the new leader ran no second cycle during the wait"
                long = await client.get("long")
                assert long.state == JobState.PENDING and long.reason == reason and long.plan is None
                cycles = _events(second, "scheduler.cycle")
                await asyncio.sleep(0.1)
            assert [e["jobs"] for e in _events(second, "scheduler.waits_adopted")] == [["long"]]
            assert _events(second, "scheduler.waiting") == []
            assert all(e["placed"] == 0 for e in cycles)
            assert "long" not in (await _allocations(etcd)).get("slow", {})

            await _report(second.address, short, done=True)
            long = await _until(client, "long", lambda j: j.state == JobState.PLACED, "placed")
            assert long.plan is not None and long.plan.gpus_by_cluster().keys() == {"fast"}
            assert await _stored(etcd, keys.WAITS) == {}
    finally:
        second.stop()
