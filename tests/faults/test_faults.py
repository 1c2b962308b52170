"""Fault injection with real processes: etcd frozen (SIGSTOP) for 10 s, the scheduler leader and the
planner SIGKILLed while jobs run (simulator-backed executor). After each fault the system recovers by
itself and every job completes exactly once: none lost, none duplicated, no GPU double-booked.

A partitioned testbed namespace (agents in network namespaces, the scheduler re-planning off the cut
cluster) is in ``test_partition.py`` (root only). Not covered here (they need the real execution path
through agents): SIGKILL of an agent mid-training (``tests/e2e/test_e2e_training.py``) and of the topology
service while a job trains (``tests/e2e/test_e2e_topology_kill.py``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import grpc.aio
from fault_harness import (
    etcd_consistent,
    leader_address,
    list_jobs,
    start_planner,
    start_scheduler,
    submit_until_accepted,
    succeeded_once,
    wait_all_terminal,
)

from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.store.process import EtcdProcess


def _ids(jobs: list[scheduler_pb2.Job]) -> list[str]:
    return sorted(j.spec.id for j in jobs)


def _expected(n: int) -> list[str]:
    return [f"job-{i:04d}" for i in range(n)]


async def test_etcd_frozen_for_10s_unavailable_then_recovers(etcd: EtcdProcess, tmp_path: Path) -> None:
    sched = start_scheduler(etcd.endpoint, tmp_path, "sched", min_s=1.0, max_s=2.0)
    try:
        await submit_until_accepted(sched.address, range(0, 20))
        assert await _wait_in_flight(sched.address)  # some jobs are running when etcd stops
        etcd.suspend()
        t0 = time.monotonic()
        codes: list[grpc.StatusCode] = []
        try:
            async with open_channel(sched.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                for req in [scheduler_pb2.GetJobRequest(job_id="job-0000"), scheduler_pb2.ListJobsRequest()]:
                    try:
                        method = stub.GetJob if isinstance(req, scheduler_pb2.GetJobRequest) else stub.ListJobs
                        await method(req, timeout=8)
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
            # A submission meanwhile is answered UNAVAILABLE; the client retries it later (same request id).
            try:
                await submit_until_accepted(sched.address, [20], deadline_s=0)
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                codes.append(e.code())
            await asyncio.sleep(max(0.0, 10.0 - (time.monotonic() - t0)))
        finally:
            etcd.resume()
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 3, codes
        # Recovery by itself: the same scheduler process, no restart.
        await submit_until_accepted(sched.address, range(20, 30), deadline_s=60)
        jobs = await wait_all_terminal(sched.address, 30, timeout=150)
        assert _ids(jobs) == _expected(30)
        assert all(succeeded_once(j) for j in jobs), [(j.spec.id, j.state) for j in jobs if not succeeded_once(j)]
        await etcd_consistent(etcd.endpoint, 30)
        assert sched.alive()
    finally:
        sched.stop()


async def _wait_in_flight(address: str, timeout: float = 30.0) -> list[scheduler_pb2.Job]:
    """Jobs PLACED or RUNNING, as soon as there are some."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        jobs = [j for j in await list_jobs(address)
                if j.state in (types_pb2.JOB_STATE_PLACED, types_pb2.JOB_STATE_RUNNING)]
        if jobs:
            return jobs
        await asyncio.sleep(0.1)
    return []


async def _wait_leader(etcd: str, among: set[str], timeout: float = 10.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        leader = await leader_address(etcd)
        if leader in among:
            return leader
        await asyncio.sleep(0.05)
    raise AssertionError(f"no leader among {among} within {timeout}s")


async def test_scheduler_leader_sigkill_while_jobs_run(etcd: EtcdProcess, tmp_path: Path) -> None:
    a = start_scheduler(etcd.endpoint, tmp_path, "sched-a", wait=False)
    b = start_scheduler(etcd.endpoint, tmp_path, "sched-b", wait=False)  # side by side
    try:
        a.wait_ready(timeout=60)
        b.wait_ready(timeout=60)
        procs = {a.address: a, b.address: b}
        leader = await _wait_leader(etcd.endpoint, set(procs))
        other = procs[b.address if leader == a.address else a.address]
        await submit_until_accepted(other.address, range(0, 25))
        running = await _wait_in_flight(other.address)  # placed and running on the leader's executor
        procs[leader].kill()
        assert await _wait_leader(etcd.endpoint, {other.address}) == other.address
        # The killed replica comes back (as a supervisor would restart it) while more jobs arrive.
        restarted = start_scheduler(etcd.endpoint, tmp_path, "sched-restarted")
        try:
            await submit_until_accepted(restarted.address, range(25, 40))
            jobs = await wait_all_terminal(other.address, 40, timeout=150)
            assert _ids(jobs) == _expected(40)
            assert all(succeeded_once(j) for j in jobs)
            assert running, "the fault should hit jobs in flight"
            await etcd_consistent(etcd.endpoint, 40)
        finally:
            restarted.stop()
    finally:
        a.stop()
        b.stop()


async def test_planner_sigkill_while_jobs_run(etcd: EtcdProcess, tmp_path: Path) -> None:
    planner = start_planner(tmp_path, "planner")
    listen = planner.address
    sched = start_scheduler(etcd.endpoint, tmp_path, "sched", "--planner", listen)
    try:
        await submit_until_accepted(sched.address, range(0, 15))
        assert await _wait_in_flight(sched.address)
        planner.kill()
        # Jobs keep arriving while no planner answers: they wait, none is lost.
        await submit_until_accepted(sched.address, range(15, 30))
        await asyncio.sleep(2.0)
        planner = start_planner(tmp_path, "planner-restarted", listen=listen)
        jobs = await wait_all_terminal(sched.address, 30, timeout=150)
        assert _ids(jobs) == _expected(30)
        assert all(succeeded_once(j) for j in jobs)
        await etcd_consistent(etcd.endpoint, 30)
    finally:
        sched.stop()
        planner.stop()
