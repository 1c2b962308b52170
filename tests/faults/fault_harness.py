"""Helpers of the fault-injection tests: services as real processes, retrying submissions, and the
checks that nothing was lost or duplicated."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import grpc.aio

from spiderflow.formats import job_from_dict, load_topology
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.rpc.server import open_channel
from spiderflow.store import keys
from spiderflow.store.base import EventType
from spiderflow.store.etcd import EtcdStore

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "examples/topology-3.yaml"
TERMINAL = {types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_CANCELLED}


def start_scheduler(etcd: str, logs: Path, name: str, *extra: str, min_s: float = 0.5,
                    max_s: float = 1.0, wait: bool = True) -> ManagedProcess:
    """A scheduler replica in simulator-backed mode on a free loopback port; with ``wait=False`` only
    spawned (several then start side by side; ``wait_ready`` before using one)."""
    proc = ManagedProcess(name, spiderflow_argv(
        "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd, "--topology", str(TOPOLOGY),
        "--executor", "sim", "--sim-min-s", str(min_s), "--sim-max-s", str(max_s), "--lease-ttl", "2",
        "--cycle-interval", "1", "--log-format", "json", *extra,
    ), log_dir=logs)
    return proc.start(timeout=60) if wait else proc.spawn()


def start_planner(logs: Path, name: str, listen: str = "127.0.0.1:0") -> ManagedProcess:
    return ManagedProcess(name, spiderflow_argv("serve", "planner", "--listen", listen, "--log-format", "json"),
                          log_dir=logs).start(timeout=60)


def submit_request(i: int) -> scheduler_pb2.SubmitJobRequest:
    spec = job_from_dict({"id": f"job-{i:04d}", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1,
                          "seq_len": 64, "steps": 5, "gpus": {"min": 1, "max": 4}, "tenant": "t"})
    return scheduler_pb2.SubmitJobRequest(request_id=f"req-{i:04d}", job=convert.job_to_proto(spec))


async def submit_until_accepted(address: str, indices: range | list[int], *, deadline_s: float = 60.0) -> int:
    """Submit each job, retrying with the same request id on UNAVAILABLE/DEADLINE_EXCEEDED until the
    scheduler answers (a retry never duplicates: submissions are idempotent). Returns the retries made."""
    retries = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    async with open_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for i in indices:
            while True:
                try:
                    resp = await stub.SubmitJob(submit_request(i), timeout=5)
                    assert resp.job.spec.id == f"job-{i:04d}"
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                            or loop.time() > end:
                        raise
                    retries += 1
                    await asyncio.sleep(0.2)
    return retries


async def list_jobs(address: str) -> list[scheduler_pb2.Job]:
    async with open_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        jobs: list[scheduler_pb2.Job] = []
        token = ""
        while True:
            resp = await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000, page_token=token), timeout=5)
            jobs.extend(resp.jobs)
            token = resp.next_page_token
            if not token:
                return jobs


async def wait_all_terminal(address: str, n: int, timeout: float) -> list[scheduler_pb2.Job]:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    last: list[scheduler_pb2.Job] = []
    while loop.time() < end:
        try:
            last = await list_jobs(address)
            if len(last) >= n and all(j.state in TERMINAL for j in last):
                return last
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.3)
    states = sorted({types_pb2.JobState.Name(j.state) for j in last})
    raise AssertionError(f"not all {n} jobs terminal within {timeout}s: {len(last)} jobs, states {states}")


def succeeded_once(job: scheduler_pb2.Job) -> bool:
    """SUCCEEDED, reached exactly once (a job run to the end twice would show two such transitions)."""
    ends = [t for t in job.history if t.to_state == types_pb2.JOB_STATE_SUCCEEDED]
    return job.state == types_pb2.JOB_STATE_SUCCEEDED and len(ends) == 1


async def etcd_consistent(etcd: str, n: int) -> None:
    """Exactly ``n`` jobs and ``n`` request records; no cluster over-committed at any revision; no
    allocation or assignment left once every job ended."""
    cap = {c.name: c.free for c in load_topology(TOPOLOGY).clusters}
    store = EtcdStore(etcd)
    try:
        jobs, _ = await store.get_prefix(keys.JOBS)
        reqs, _ = await store.get_prefix(keys.ROOT + "requests/")
        assert len(jobs) == n and len(reqs) == n
        allocs, _ = await store.get_prefix(keys.ALLOCATIONS)
        assert all(not json.loads(kv.value) for kv in allocs), allocs
        rev = await store.revision()
        async with store.watch_prefix(keys.ROOT, start_revision=1) as watch:
            async for ev in watch:  # every write since the start, up to the current revision
                if ev.type is EventType.PUT and ev.key.startswith(keys.ALLOCATIONS):
                    cluster = keys.name_of(ev.key, keys.ALLOCATIONS)
                    assert sum(json.loads(ev.value).values()) <= cap[cluster], ev
                if ev.mod_revision >= rev:
                    break
    finally:
        await store.close()


async def leader_address(etcd: str) -> str | None:
    store = EtcdStore(etcd)
    try:
        info = await store.leader(keys.election_name(keys.SCHEDULER))
        return info.value.decode() if info else None
    finally:
        await store.close()
