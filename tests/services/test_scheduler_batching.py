"""Group commit of submissions (:mod:`services.scheduler.batching`): per-request outcomes equal the
one-transaction-per-submission path, and every revision of the store holds whole submissions only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from services.scheduler.batching import SubmitBatcher
from services.scheduler.repo import REQUESTS, JobRepository, StoredJob
from services.scheduler.service import SchedulerService
from spiderflow.core.domain import JobSpec
from spiderflow.core.errors import AlreadyExistsError, UnavailableError, ValidationError
from spiderflow.formats import job_from_dict
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.rpc import convert
from spiderflow.rpc.server import RpcServer, open_channel, serve
from spiderflow.store import MemoryStore, keys
from spiderflow.store.base import EventType


def _spec(i: int, *, steps: int = 5) -> JobSpec:
    return job_from_dict({"id": f"job-{i:03d}", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1,
                          "seq_len": 64, "steps": steps, "gpus": {"min": 1, "max": 1}, "tenant": "t"})


class CountingStore(MemoryStore):
    """A memory store that counts transactions and lets the test hold them (to build up a queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.commits: list[int] = []  # puts per transaction
        self.held = 0  # puts of transactions waiting at the gate
        self.gate = asyncio.Event()
        self.gate.set()

    async def commit(self, compares, puts=(), deletes=()):  # type: ignore[no-untyped-def,override]
        self.held += len(puts)
        await self.gate.wait()
        self.held -= len(puts)
        self.commits.append(len(puts))
        return await super().commit(compares, puts, deletes)


async def _check_whole(store: MemoryStore) -> None:
    """Every job key has its request key and vice versa, and each submission's two keys appeared at the
    same revision (no half-written submission at any revision)."""
    jobs, _ = await store.get_prefix(keys.JOBS)
    reqs, _ = await store.get_prefix(REQUESTS)
    by_job = {kv.value.decode(): kv for kv in reqs}
    assert sorted(by_job) == sorted(keys.name_of(kv.key, keys.JOBS) for kv in jobs)
    for kv in jobs:
        assert by_job[keys.name_of(kv.key, keys.JOBS)].create_revision == kv.create_revision


async def test_concurrent_submissions_share_one_transaction() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    out = await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in range(40)))
    assert all(created for _, created in out)
    assert len(store.commits) == 1 and store.commits[0] == 80
    assert len({sj.mod_revision for sj, _ in out}) == 1  # one revision holds all 40
    assert [sj.record.id for sj, _ in out] == [f"job-{i:03d}" for i in range(40)]
    await _check_whole(store)


async def test_batches_respect_the_size_bound() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store), max_batch=16)
    out = await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in range(40)))
    assert all(created for _, created in out)
    assert store.commits == [32, 32, 16]
    await _check_whole(store)


async def test_duplicate_request_ids_in_one_burst_create_one_job() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    out = await asyncio.gather(*(batcher.submit(_spec(7), "same") for _ in range(5)),
                               *(batcher.submit(_spec(i), f"r{i}") for i in range(3)))
    dup = out[:5]
    assert sum(created for _, created in dup) == 1
    assert {sj.record.id for sj, _ in dup} == {"job-007"}
    assert len({sj.mod_revision for sj, _ in dup}) == 1  # every caller sees the one record
    assert all(created for _, created in out[5:])
    jobs, _ = await store.get_prefix(keys.JOBS)
    assert sorted(keys.name_of(kv.key, keys.JOBS) for kv in jobs) == ["job-000", "job-001", "job-002", "job-007"]
    await _check_whole(store)


async def test_same_request_id_with_another_spec_in_one_burst_is_refused() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    out = await asyncio.gather(batcher.submit(_spec(1), "r"), batcher.submit(_spec(1, steps=9), "r"),
                               batcher.submit(_spec(2), "r2"), return_exceptions=True)
    first, second, third = out
    assert not isinstance(first, BaseException) and first[1] and first[0].record.spec.steps == 5
    assert isinstance(second, AlreadyExistsError) and "different spec" in str(second)
    assert not isinstance(third, BaseException) and third[1]
    await _check_whole(store)


async def test_same_job_id_from_two_requests_in_one_burst() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    out = await asyncio.gather(batcher.submit(_spec(1), "a"), batcher.submit(_spec(1), "b"),
                               return_exceptions=True)
    assert not isinstance(out[0], BaseException) and out[0][1]
    assert isinstance(out[1], AlreadyExistsError) and "taken by another request" in str(out[1])
    reqs, _ = await store.get_prefix(REQUESTS)
    assert [kv.key for kv in reqs] == [REQUESTS + "t/a"]  # the refused request wrote nothing (scoped by tenant)
    await _check_whole(store)


async def test_conflicts_with_existing_keys_leave_the_rest_of_the_batch_intact() -> None:
    store = CountingStore()
    repo = JobRepository(store)
    retried, _ = await repo.submit(_spec(1), "r1")  # a retry of this one comes in the batch
    await repo.submit(_spec(2), "other")  # job-002's id is taken by another request
    batcher = SubmitBatcher(repo)
    store.commits.clear()
    out = await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in range(6)), return_exceptions=True)
    assert not isinstance(out[1], BaseException) and not out[1][1]
    assert (out[1][0].record.id, out[1][0].mod_revision) == ("job-001", retried.mod_revision)
    assert isinstance(out[2], AlreadyExistsError)
    for i in (0, 3, 4, 5):
        res = out[i]
        assert not isinstance(res, BaseException) and res[1], res
    assert store.commits == [12, 8]  # refused as a whole (etcd names the two), then the four again
    await _check_whole(store)


async def test_a_store_failure_fails_the_whole_batch_and_writes_nothing() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    store.set_available(False)
    out = await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in range(4)), return_exceptions=True)
    assert all(isinstance(r, UnavailableError) for r in out)
    store.set_available(True)
    assert (await store.get_prefix(keys.JOBS))[0] == []
    again = await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in range(4)))  # retries succeed
    assert all(created for _, created in again)
    await _check_whole(store)


async def test_a_caller_that_gave_up_before_its_flush_is_not_written() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    store.gate.clear()
    first = asyncio.create_task(batcher.submit(_spec(0), "r0"))
    await asyncio.sleep(0.01)  # r0's transaction is in flight (held at the gate)
    second = asyncio.create_task(batcher.submit(_spec(1), "r1"))
    third = asyncio.create_task(batcher.submit(_spec(2), "r2"))
    await asyncio.sleep(0.01)
    second.cancel()
    store.gate.set()
    assert (await first)[1] and (await third)[1]
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await store.get(keys.job_key("job-001")) is None
    assert store.commits == [2, 2]
    await _check_whole(store)


async def test_invalid_request_id_is_refused_before_queueing() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    with pytest.raises(ValidationError):
        await batcher.submit(_spec(0), "a/b")
    assert store.commits == []


async def test_every_revision_holds_whole_submissions() -> None:
    store = MemoryStore()
    batcher = SubmitBatcher(JobRepository(store), max_batch=8)
    watch = store.watch_prefix(keys.ROOT, start_revision=1)
    await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in range(30)),
                         *(batcher.submit(_spec(i), f"r{i}") for i in range(0, 30, 3)))  # retries among them
    by_rev: dict[int, set[str]] = {}
    rev = await store.revision()
    async with asyncio.timeout(5):
        async for ev in watch:
            assert ev.type is EventType.PUT
            by_rev.setdefault(ev.mod_revision, set()).add(ev.key)
            if ev.mod_revision == rev and len(by_rev[rev]) == 2 * 6:  # the last batch: 30 - 3 * 8 jobs
                break
    await watch.aclose()
    for written in by_rev.values():
        jobs = {keys.name_of(k, keys.JOBS) for k in written if k.startswith(keys.JOBS)}
        reqs = {k for k in written if k.startswith(REQUESTS)}
        assert len(jobs) == len(reqs) and 1 <= len(jobs) <= 8
    assert sum(len(w) for w in by_rev.values()) == 60


# -- through the gRPC service -----------------------------------------------------------------------


@pytest.fixture
async def service() -> AsyncIterator[tuple[RpcServer, SchedulerService, CountingStore]]:
    store = CountingStore()
    svc = SchedulerService(JobRepository(store))
    server = await serve([svc])
    try:
        yield server, svc, store
    finally:
        await server.stop(grace_s=0)


async def test_a_burst_with_one_invalid_job_creates_the_others(
        service: tuple[RpcServer, SchedulerService, CountingStore]) -> None:
    server, svc, store = service
    assert svc.batcher is not None
    batcher = svc.batcher
    good = [scheduler_pb2.SubmitJobRequest(request_id=f"r{i}", job=convert.job_to_proto(_spec(i)))
            for i in range(12)]
    bad_job = convert.job_to_proto(_spec(99))
    bad_job.global_batch = 0  # invalid: INVALID_ARGUMENT naming the field
    bad = scheduler_pb2.SubmitJobRequest(request_id="bad", job=bad_job)
    async with open_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        store.gate.clear()  # hold the first transaction until the rest of the burst is queued behind it
        calls = asyncio.gather(*(stub.SubmitJob(r, timeout=10) for r in [*good[:6], bad, *good[6:]]),
                               return_exceptions=True)
        for _ in range(1000):  # every valid submission is in the held transaction or queued behind it
            if store.held // 2 + len(batcher._queue) == 12:
                break
            await asyncio.sleep(0.01)
        store.gate.set()
        out = await calls
        dup = await asyncio.gather(*(stub.SubmitJob(r, timeout=10) for r in good[:3]))  # retries
    err = out[6]
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "global_batch" in (err.details() or "")
    created = [r for r in out if not isinstance(r, BaseException)]
    assert len(created) == 12 and all(r.created for r in created)
    assert [r.created for r in dup] == [False, False, False]
    assert [r.job.revision for r in dup] == [r.job.revision for r in created[:3]]
    assert await store.get(keys.job_key("job-099")) is None and await store.get(REQUESTS + "bad") is None
    assert sum(store.commits[:2]) == 24  # the burst took two transactions (retries come after)
    await _check_whole(store)


async def test_a_lone_submission_is_written_at_once_and_a_loaded_flush_lingers_for_the_next() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store), linger_s=0.2)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await batcher.submit(_spec(0), "r0")  # alone, after nothing: no linger
    await batcher.submit(_spec(1), "r1")
    assert loop.time() - t0 < 0.15 and store.commits == [2, 2]
    await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in (2, 3)))  # two at once: under load
    assert store.commits[-1] == 4

    async def later(i: int, delay: float) -> tuple[StoredJob, bool]:
        await asyncio.sleep(delay)
        return await batcher.submit(_spec(i), f"r{i}")

    # under load the next flush waits for the submissions that arrive within the linger: one transaction
    out = await asyncio.gather(batcher.submit(_spec(4), "r4"), later(5, 0.02), later(6, 0.05))
    assert all(created for _, created in out)
    assert store.commits[-1] == 6 and len(store.commits) == 4
    t0 = loop.time()
    await batcher.submit(_spec(7), "r7")  # that flush carried three: this one lingers once, then none does
    await batcher.submit(_spec(8), "r8")
    assert store.commits[-2:] == [2, 2] and 0.2 <= loop.time() - t0 < 0.35
    await _check_whole(store)


async def test_a_full_batch_does_not_linger() -> None:
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store), max_batch=4, linger_s=5.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out = await asyncio.gather(*(batcher.submit(_spec(i), f"r{i}") for i in range(12)))
    assert all(created for _, created in out)
    assert store.commits == [8, 8, 8] and loop.time() - t0 < 2.0
    await _check_whole(store)
