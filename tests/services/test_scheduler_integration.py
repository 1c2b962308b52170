"""The scheduler service against a real etcd, as real processes on real ports (issue: scheduler)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from scheduler_harness import (
    allocation_history_ok,
    ids,
    placements,
    start_replica,
    start_replicas,
    submit_request,
    wait_all_terminal,
)

from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc.server import open_channel
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess


async def _submit_all(addresses: list[str], n: int, clients: int, retries: int = 2) -> None:
    """``clients`` concurrent clients submit jobs 0..n-1 (round robin over replicas); each request is
    sent ``retries`` times with the same request id (a retry after a lost answer)."""

    async def client(c: int) -> None:
        channel = open_channel(addresses[c % len(addresses)])
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            for i in range(c, n, clients):
                created = []
                for _ in range(retries):
                    resp = await stub.SubmitJob(submit_request(i), timeout=10)
                    created.append(resp.created)
                    assert resp.job.spec.id == f"job-{i:04d}"
                assert created.count(True) <= 1
        finally:
            await channel.close()

    await asyncio.gather(*(client(c) for c in range(clients)))


async def test_200_jobs_8_clients_two_replicas(etcd: EtcdProcess, tmp_path: Path) -> None:
    a, b = start_replicas(etcd.endpoint, tmp_path, "sched-a", "sched-b")
    try:
        await _submit_all([a.address, b.address], 200, clients=8)
        jobs = await wait_all_terminal([a.address, b.address], 200, timeout=240)
        assert ids(jobs) == [f"job-{i:04d}" for i in range(200)]  # none lost, none duplicated
        assert all(j.state == types_pb2.JOB_STATE_SUCCEEDED for j in jobs)
        assert all(placements(j) == 1 and j.attempt == 1 for j in jobs)  # exactly one placement each
        assert await allocation_history_ok(etcd.endpoint) > 0  # no GPU double-booked at any revision
        store = EtcdStore(etcd.endpoint)
        try:
            requests, _ = await store.get_prefix(keys.ROOT + "requests/")
            assert len(requests) == 200  # retries created nothing
        finally:
            await store.close()
    finally:
        a.stop()
        b.stop()


async def _leader_address(etcd: str) -> str | None:
    store = EtcdStore(etcd)
    try:
        info = await store.leader(keys.election_name(keys.SCHEDULER))
        return info.value.decode() if info else None
    finally:
        await store.close()


async def test_leader_sigkill_failover(etcd: EtcdProcess, tmp_path: Path) -> None:
    a, b = start_replicas(etcd.endpoint, tmp_path, "sched-a", "sched-b")
    procs = {a.address: a, b.address: b}
    try:
        for _ in range(100):
            leader = await _leader_address(etcd.endpoint)
            if leader:
                break
            await asyncio.sleep(0.1)
        assert leader in procs
        other = b if leader == a.address else a
        await _submit_all([other.address], 40, clients=4, retries=1)
        procs[leader].kill()
        t0 = time.monotonic()
        new_leader = None
        while time.monotonic() - t0 < 10:
            new_leader = await _leader_address(etcd.endpoint)
            if new_leader == other.address:
                break
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        assert new_leader == other.address, new_leader
        assert took < 5.0, f"failover took {took:.2f}s"
        await _submit_all([other.address], 60, clients=4, retries=1)  # ids 0..59 again: 40 are retries
        jobs = await wait_all_terminal(other.address, 60, timeout=120)
        assert ids(jobs) == [f"job-{i:04d}" for i in range(60)]
        assert all(j.state == types_pb2.JOB_STATE_SUCCEEDED for j in jobs)
        assert all(placements(j) >= 1 for j in jobs)
        assert await allocation_history_ok(etcd.endpoint) > 0
    finally:
        a.stop()
        b.stop()


async def test_restart_with_etcd_intact_keeps_everything(etcd: EtcdProcess, tmp_path: Path) -> None:
    a = start_replica(etcd.endpoint, tmp_path, "sched-a")
    try:
        await _submit_all([a.address], 10, clients=2, retries=1)
        before = await wait_all_terminal(a.address, 10, timeout=60)
        channel = open_channel(a.address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        cancel_me = await stub.SubmitJob(submit_request(999), timeout=5)
        await channel.close()
    finally:
        a.stop()
    a2 = start_replica(etcd.endpoint, tmp_path, "sched-a2")
    try:
        channel = open_channel(a2.address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for j in before:
            got = (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=j.spec.id), timeout=5)).job
            assert got.state == j.state and got.plan == j.plan and list(got.history) == list(j.history)
        assert (await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=cancel_me.job.spec.id))).job.spec.id
        await channel.close()
    finally:
        a2.stop()


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """One etcd and one replica for the malformed-job cases: (etcd endpoint, scheduler address). Each case
    checks that it wrote nothing, so they share them."""
    etcd = EtcdProcess()
    try:
        etcd.start()
        a = start_replica(etcd.endpoint, tmp_path_factory.mktemp("malformed"), "sched")
        try:
            yield etcd.endpoint, a.address
        finally:
            a.stop()
    finally:
        etcd.close()


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda j: j.update(model="no-such-model"), "job.model"),
        (lambda j: j.update(steps=0), "job.steps"),
        (lambda j: j.update(gpus={"min": 8, "max": 2}), "job.gpus.min"),
        (lambda j: j.update(arrival_s=-5), "job.arrival_s"),
        (lambda j: j.update(global_batch="many"), "job.global_batch"),
    ],
)
async def test_malformed_jobs_invalid_argument_and_nothing_written(
    one_replica: tuple[str, str], mutate: object, field: str
) -> None:
    from google.protobuf import json_format
    from scheduler_harness import job_json

    endpoint, address = one_replica
    store = EtcdStore(endpoint)
    try:
        before = await store.revision()
        job = job_json(1)
        mutate(job)  # type: ignore[operator]
        channel = open_channel(address)
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            try:
                req = json_format.ParseDict({"request_id": "bad-1", "job": job}, scheduler_pb2.SubmitJobRequest())
            except json_format.ParseError as e:  # a wrong JSON type never reaches the server
                assert field.split(".")[-1] in str(e)
                return
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitJob(req, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in (err.value.details() or "")
        finally:
            await channel.close()
        jobs, _ = await store.get_prefix(keys.JOBS)
        reqs, _ = await store.get_prefix(keys.ROOT + "requests/")
        assert jobs == [] and reqs == []
        after = await store.revision()
        # Only the replica's own leader-election keys may have been written meanwhile.
        changed, _ = await store.get_prefix(keys.ROOT)
        assert all(kv.key.startswith(keys.ELECTIONS) for kv in changed if kv.mod_revision > before), after
    finally:
        await store.close()
