"""``get_prefixes_changed``: one read at one revision with the values of only the keys modified since a given
revision (and every key's revision); the scheduler's snapshot built from it equals a full read."""

from __future__ import annotations

from typing import Any

from services.scheduler.repo import JobRepository
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.store import MemoryStore, keys
from spiderflow.store.base import Store
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess


async def _changed_reads_agree(store: Store) -> None:
    await store.put("/t/a/1", b"one")
    await store.put("/t/a/2", b"two")
    await store.put("/t/b/1", b"bee")
    since = await store.revision()
    await store.put("/t/a/2", b"two again")
    await store.put("/t/a/3", b"three")
    await store.delete("/t/a/1")
    changed, present, rev = await store.get_prefixes_changed(["/t/a/", "/t/b/"], {"/t/a/": since})
    full, full_rev = await store.get_prefixes(["/t/a/", "/t/b/"])
    assert rev == full_rev
    assert [(kv.key, kv.value) for kv in changed["/t/a/"]] == [("/t/a/2", b"two again"), ("/t/a/3", b"three")]
    assert changed["/t/b/"] == full["/t/b/"]  # a prefix not named: read whole
    assert present == {"/t/a/": {kv.key: kv.mod_revision for kv in full["/t/a/"]}}
    assert changed["/t/a/"] == [kv for kv in full["/t/a/"] if kv.mod_revision > since]


async def test_etcd_and_memory_stores_read_only_what_changed_alike(etcd: EtcdProcess) -> None:
    store = EtcdStore(etcd.endpoint)
    try:
        await _changed_reads_agree(store)
    finally:
        await store.close()
    await _changed_reads_agree(MemoryStore())


class _Counting(EtcdStore):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.values_read: list[int] = []  # job values each snapshot read

    async def get_prefixes(self, prefixes: Any) -> Any:
        items, rev = await super().get_prefixes(prefixes)
        self.values_read.append(len(items.get(keys.JOBS, [])))
        return items, rev

    async def get_prefixes_changed(self, prefixes: Any, changed_after: Any) -> Any:
        items, present, rev = await super().get_prefixes_changed(prefixes, changed_after)
        self.values_read.append(len(items.get(keys.JOBS, [])))
        return items, present, rev


def _spec(i: int) -> Any:
    return job_from_dict({"id": f"j{i:02d}", "model": "gpt-tiny", "global_batch": 8, "steps": 2,
                          "gpus": {"min": 1, "max": 1}})


async def test_a_snapshot_reads_only_the_job_records_changed_since_the_last_and_equals_a_full_read(
        etcd: EtcdProcess) -> None:
    store = _Counting(etcd.endpoint)
    other_store = EtcdStore(etcd.endpoint)
    try:
        repo, other = JobRepository(store), JobRepository(other_store)  # this replica, and another writer
        for i in range(20):
            await repo.submit(_spec(i), f"r{i}")
        first = await repo.snapshot()
        assert len(first.jobs) == 20 and store.values_read == [20]
        j3 = await other.get("j03")
        await other.update(j3, j3.record.with_reason("changed elsewhere", now=2.0))
        await other.submit(_spec(20), "r20")
        j5 = await other.get("j05")
        await other.transition(j5, j5.record.to(JobState.CANCELLED, "cancelled", now=3.0))
        await other_store.delete(keys.job_key("j07"))
        second = await repo.snapshot()
        fresh = await JobRepository(other_store).snapshot()  # a first snapshot: a full read, decoded afresh
        assert store.values_read == [20, 3]  # j03, j05 and j20 only
        assert [(sj.record, sj.mod_revision) for sj in second.jobs] == \
            [(sj.record, sj.mod_revision) for sj in fresh.jobs]
        assert second.revision == fresh.revision
        assert "j07" not in {sj.record.id for sj in second.jobs}
        repo._decoded.pop(keys.job_key("j10"))  # a record not at hand: everything is read again
        third = await repo.snapshot()
        assert store.values_read[-2:] == [0, 20]
        assert [(sj.record, sj.mod_revision) for sj in third.jobs] == \
            [(sj.record, sj.mod_revision) for sj in fresh.jobs]
    finally:
        await store.close()
        await other_store.close()
