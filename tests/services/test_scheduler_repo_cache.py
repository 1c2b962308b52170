"""The repository's decoded-record cache: records this process wrote are reused only at the revision it
wrote them; a newer write by another replica is always read from the store."""

from __future__ import annotations

import asyncio

from services.scheduler.cycle import SchedulingCycle
from services.scheduler.repo import JobRepository
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.domain import Cluster, Topology
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.store import MemoryStore, keys, records
from spiderflow.store.base import CompareFailedError


def _spec(i: int):  # type: ignore[no-untyped-def]
    return job_from_dict({"id": f"job-{i}", "model": "gpt-tiny", "global_batch": 8, "steps": 2,
                          "gpus": {"min": 1, "max": 1}})


async def test_another_replicas_write_is_never_served_from_the_cache() -> None:
    store = MemoryStore()
    a, b = JobRepository(store), JobRepository(store)
    for i in range(3):
        await a.submit(_spec(i), f"r{i}")
    assert await a.count_in([JobState.PENDING]) == 3
    theirs = await b.get("job-1")
    await b.update(theirs, theirs.record.to(JobState.CANCELLED, "by b", now=1.0))
    got = await a.get("job-1")
    assert got.record.state is JobState.CANCELLED and got.record.reason == "by b"
    assert await a.count_in([JobState.PENDING]) == 2 and await a.count_in([JobState.CANCELLED]) == 1
    listed, _ = await a.list()
    assert [s.record.state for s in listed] == [JobState.PENDING, JobState.CANCELLED, JobState.PENDING]
    for s in listed:  # what the cache serves equals what decoding the stored value gives
        kv = await store.get(keys.job_key(s.record.id))
        assert kv is not None and kv.mod_revision == s.mod_revision
        assert records.decode(kv.key, kv.value) == s.record


class _FailCountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.failed = 0

    async def commit(self, compares, puts=(), deletes=()):  # type: ignore[no-untyped-def,override]
        await asyncio.sleep(0)  # a round trip: concurrent writers interleave as they do on etcd
        try:
            return await super().commit(compares, puts, deletes)
        except CompareFailedError:
            self.failed += 1
            raise


async def _allocations_match_records(repo: JobRepository) -> dict[str, dict[str, int]]:
    allocs, _, _ = await repo.allocations()
    stored, _ = await repo.list()
    expected: dict[str, dict[str, int]] = {}
    for s in stored:
        if s.record.state in (JobState.PLACED, JobState.RUNNING):
            for c, g in s.record.allocation.items():
                expected.setdefault(c, {})[s.record.id] = g
    assert allocs == expected  # invariant 2 of the repository
    return allocs


async def test_releases_use_known_allocations_and_recover_from_another_replicas_write() -> None:
    store = _FailCountingStore()
    a, b = JobRepository(store), JobRepository(store)
    topo = Topology(clusters=(Cluster(name="c", gpu="A100-80G", nodes=1, gpus_per_node=8),), links=())
    cycle = SchedulingCycle(a, StaticTopologySource(topo))
    for i in range(6):
        await a.submit(_spec(i), f"r{i}")
    assert len((await cycle.run()).placed) == 6
    await _allocations_match_records(a)
    # another replica cancels one: a's known revision of allocations/c is now stale
    theirs = await b.get("job-0")
    await b.transition(theirs, theirs.record.to(JobState.CANCELLED, "by b", now=1.0))
    failed = store.failed
    mine = await a.get("job-1")
    await a.transition(mine, mine.record.to(JobState.SUCCEEDED, "done", now=2.0))
    assert store.failed == failed + 1  # the stale compare failed once, then a fresh read succeeded
    assert set((await _allocations_match_records(a))["c"]) == {"job-2", "job-3", "job-4", "job-5"}
    # jobs of one cluster ending together in one process take turns: no compare fails
    failed = store.failed
    done = [await a.get(f"job-{i}") for i in range(2, 6)]
    await asyncio.gather(*(a.transition(s, s.record.to(JobState.SUCCEEDED, "done", now=3.0)) for s in done))
    assert store.failed == failed
    assert await _allocations_match_records(a) == {}
    assert await store.get(keys.allocation_key("c")) is None


async def test_a_queued_jobs_queue_view_is_computed_once_across_cycles(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every cycle orders the whole queue; the queue's view of a job (its work and network estimates) is kept
    between cycles, so a long queue costs its estimates once, not once per cycle (a 5,000-job queue on a
    40-GPU pool took ~0.7 s a cycle on them alone)."""
    from services.scheduler import cycle as cycle_mod
    from spiderflow.core.queueing import queued_job

    calls: list[str] = []

    def counting(job, enqueued_s, **kw):  # type: ignore[no-untyped-def]
        calls.append(job.id)
        return queued_job(job, enqueued_s, **kw)

    monkeypatch.setattr(cycle_mod, "queued_job", counting)
    store = MemoryStore()
    repo = JobRepository(store)
    topo = Topology(clusters=(Cluster(name="c", gpu="A100-80G", nodes=1, gpus_per_node=2),), links=())
    cycle = SchedulingCycle(repo, StaticTopologySource(topo))
    for i in range(5):
        await repo.submit(_spec(i), f"r{i}")
    first = await cycle.run()
    assert len(first.placed) == 2 and sorted(calls) == [f"job-{i}" for i in range(5)]
    calls.clear()
    await repo.submit(_spec(5), "r5")
    second = await cycle.run()  # no GPU free: the three still queued are ordered again from their kept views
    assert second.placed == [] and calls == ["job-5"]


async def test_tenant_counts_follow_every_change_and_read_only_what_changed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = MemoryStore()
    a, b = JobRepository(store), JobRepository(store)  # b writes, a counts: a never decoded b's records

    def spec(i: int):  # type: ignore[no-untyped-def]
        return job_from_dict({"id": f"job-{i}", "model": "gpt-tiny", "global_batch": 8, "steps": 2,
                              "gpus": {"min": 1, "max": 1}, "tenant": f"t{i % 2 if i < 6 else 2}"})

    for i in range(6):
        await b.submit(spec(i), f"r{i}")
    decoded: list[str] = []
    real = records.job_state_and_tenant

    def counting(key: str, value: bytes):  # type: ignore[no-untyped-def]
        decoded.append(key)
        return real(key, value)

    monkeypatch.setattr(records, "job_state_and_tenant", counting)
    queued = (JobState.PENDING, JobState.RESCHEDULING)
    assert await a.count_by_tenant(queued) == {"t0": 3, "t1": 3} and len(decoded) == 6
    decoded.clear()
    assert await a.count_by_tenant(queued) == {"t0": 3, "t1": 3} and decoded == []  # nothing changed
    job = await b.get("job-1")
    await b.update(job, job.record.to(JobState.CANCELLED, "by b", now=1.0))
    await store.delete(keys.job_key("job-2"))
    await b.submit(spec(6), "r6")
    assert await a.count_by_tenant(queued) == {"t0": 2, "t1": 2, "t2": 1}
    assert sorted(decoded) == [keys.job_key("job-1"), keys.job_key("job-6")]  # only the changed records
    fresh = JobRepository(store)  # a first count reads everything and agrees
    assert await fresh.count_by_tenant(queued) == {"t0": 2, "t1": 2, "t2": 1}
    assert await a.count_by_tenant((JobState.CANCELLED,)) == {"t1": 1}
