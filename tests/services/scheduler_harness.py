"""Helpers for scheduler tests: replicas as real processes, clients, and etcd-history checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path

import grpc.aio

from spiderflow.formats import load_topology
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.store import keys
from spiderflow.store.base import EventType
from spiderflow.store.etcd import EtcdStore

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "examples/topology-3.yaml"
TERMINAL = {types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_CANCELLED}


def start_replica(etcd: str, tmp: Path, name: str, *extra: str, topology: Path = TOPOLOGY,
                  wait: bool = True) -> ManagedProcess:
    """A scheduler replica on ``topology`` (a file); ``extra`` flags come last and override the defaults.
    With ``wait=False`` it is only spawned (``wait_ready`` before using it)."""
    argv = spiderflow_argv(
        "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd, "--topology", str(topology),
        "--executor", "sim", "--sim-min-s", "0.2", "--sim-max-s", "0.4", "--lease-ttl", "2",
        "--cycle-interval", "1", "--log-format", "json", *extra,
    )
    proc = ManagedProcess(name, argv, log_dir=tmp)
    return proc.start(timeout=60) if wait else proc.spawn()


def start_replicas(etcd: str, tmp: Path, *names: str) -> list[ManagedProcess]:
    """Replicas started side by side (their interpreter starts overlap); all stopped if one fails to start."""
    procs = [start_replica(etcd, tmp, name, wait=False) for name in names]
    try:
        for proc in procs:
            proc.wait_ready(timeout=60)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs


def job_json(i: int, *, tenant: str = "t") -> dict[str, object]:
    return {"id": f"job-{i:04d}", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1, "seq_len": 64,
            "steps": 5, "gpus": {"min": 1, "max": 4}, "tenant": tenant}


def submit_request(i: int) -> scheduler_pb2.SubmitJobRequest:
    from google.protobuf import json_format

    return json_format.ParseDict({"request_id": f"req-{i:04d}", "job": job_json(i)},
                                 scheduler_pb2.SubmitJobRequest())


async def wait_all_terminal(address: str | list[str], n: int, timeout: float) -> list[scheduler_pb2.Job]:
    """Poll ListJobs (over any live replica) until ``n`` jobs are terminal."""
    addresses = [address] if isinstance(address, str) else address
    deadline = asyncio.get_running_loop().time() + timeout
    last: list[scheduler_pb2.Job] = []
    while asyncio.get_running_loop().time() < deadline:
        for addr in addresses:
            channel = open_channel(addr)
            try:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                jobs: list[scheduler_pb2.Job] = []
                token = ""
                while True:
                    resp = await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000, page_token=token),
                                               timeout=5)
                    jobs.extend(resp.jobs)
                    token = resp.next_page_token
                    if not token:
                        break
                last = jobs
                if len(jobs) >= n and all(j.state in TERMINAL for j in jobs):
                    return jobs
            except grpc.aio.AioRpcError:
                pass
            finally:
                await channel.close()
        await asyncio.sleep(0.3)
    states = sorted({types_pb2.JobState.Name(j.state) for j in last})
    raise AssertionError(f"not all {n} jobs terminal within {timeout}s: {len(last)} jobs, states {states}")


async def allocation_history_ok(etcd: str) -> int:
    """Replay every allocation write since revision 1 and check no cluster is ever over-committed, and
    that no job holds GPUs in two allocation versions of different attempts at once. Returns #events."""
    topo = load_topology(TOPOLOGY)
    cap = {c.name: c.free for c in topo.clusters}
    store = EtcdStore(etcd)
    try:
        rev = await store.revision()
        watch = store.watch_prefix(keys.ROOT, start_revision=1)
        n = 0
        async with watch:
            async for ev in watch:
                if ev.mod_revision >= rev:
                    break
                if not ev.key.startswith(keys.ALLOCATIONS):
                    continue
                n += 1
                cluster = keys.name_of(ev.key, keys.ALLOCATIONS)
                if ev.type is EventType.PUT:
                    used = sum(json.loads(ev.value).values())
                    assert used <= cap[cluster], f"{cluster} over-committed at revision {ev.mod_revision}: {used}"
        return n
    finally:
        await store.close()


def placements(job: scheduler_pb2.Job) -> int:
    return sum(1 for t in job.history if t.to_state == types_pb2.JOB_STATE_PLACED)


def ids(jobs: Iterable[scheduler_pb2.Job]) -> list[str]:
    return sorted(j.spec.id for j in jobs)
