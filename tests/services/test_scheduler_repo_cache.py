"""The repository's decoded-record cache: records this process wrote are reused only at the revision it
wrote them; a newer write by another replica is always read from the store."""

from __future__ import annotations

from services.scheduler.repo import JobRepository
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobRecord, JobState
from spiderflow.store import MemoryStore, keys


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
        assert JobRecord.from_json(kv.value) == s.record
