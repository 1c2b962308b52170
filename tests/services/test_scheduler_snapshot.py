"""The scheduling cycle decides on ONE snapshot read at ONE etcd revision: jobs, allocations and waits together.

A replica binding a job between two reads of another replica is what the single read protects against: read
separately, the jobs and the allocations can straddle the bind (a PENDING job already holding GPUs); read
together they never do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from services.scheduler.cycle import SchedulingCycle
from services.scheduler.repo import JobRepository, StoredJob
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.domain import Cluster, Plan, Stage, Topology
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.store import MemoryStore, keys
from spiderflow.store.base import KeyValue

SPEC = job_from_dict({"id": "j1", "model": "gpt-tiny", "global_batch": 8, "steps": 2, "gpus": {"min": 1, "max": 1}})
TOPO = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=4, free_gpus=4),))


class _Interleaving(MemoryStore):
    """A store where another replica writes once right after the next read returns (``after_read``), and
    which logs every read."""

    def __init__(self) -> None:
        super().__init__()
        self.after_read: Callable[[], Awaitable[None]] | None = None
        self.reads: list[tuple[str, ...]] = []

    async def _interleave(self) -> None:
        hook, self.after_read = self.after_read, None
        if hook is not None:
            await hook()

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        out = await super().get_prefix(prefix)
        self.reads.append((prefix,))
        await self._interleave()
        return out

    async def get_prefixes(self, prefixes: Sequence[str]) -> tuple[dict[str, list[KeyValue]], int]:
        out = await super().get_prefixes(prefixes)
        self.reads.append(tuple(prefixes))
        await self._interleave()
        return out


def _consistent(jobs: list[StoredJob], allocations: dict[str, dict[str, int]]) -> bool:
    """Invariant 2 of the repository: a job holds GPUs in the allocation keys iff its record says so."""
    held: dict[str, dict[str, int]] = {}
    for cluster, by_job in allocations.items():
        for job, gpus in by_job.items():
            held.setdefault(job, {})[cluster] = gpus
    return all(held.get(sj.record.id, {}) == sj.record.allocation for sj in jobs)


async def _bind_by_another_replica(store: MemoryStore) -> None:
    other = JobRepository(store)
    sj = await other.get("j1")
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=SPEC.model.layers - 1),), micro_batches=1)
    placed = sj.record.to(JobState.PLACED, "placed", now=1.0, plan=plan, allocation={"a": 1}, attempt=1)
    allocs, revs, _ = await other.allocations()
    await other.bind(sj, placed, revs, allocs)


async def test_two_reads_can_straddle_a_bind_one_snapshot_cannot() -> None:
    store = _Interleaving()
    repo = JobRepository(store)
    await repo.submit(SPEC, "r1")

    store.after_read = lambda: _bind_by_another_replica(store)  # what the cycle used to do: two reads
    jobs, _ = await repo.list()
    allocations, _, _ = await repo.allocations()
    assert [sj.record.state for sj in jobs] == [JobState.PENDING] and allocations == {"a": {"j1": 1}}
    assert not _consistent(jobs, allocations)  # the straddled view: a PENDING job holding a GPU

    store2 = _Interleaving()
    repo2 = JobRepository(store2)
    await repo2.submit(SPEC, "r1")
    store2.after_read = lambda: _bind_by_another_replica(store2)
    state = await repo2.snapshot()
    assert [sj.record.state for sj in state.jobs] == [JobState.PENDING] and state.allocations == {}
    assert _consistent(state.jobs, state.allocations)
    after = await repo2.snapshot()  # the bind is there, whole
    assert [sj.record.state for sj in after.jobs] == [JobState.PLACED] and after.allocations == {"a": {"j1": 1}}
    assert _consistent(after.jobs, after.allocations) and after.revision > state.revision
    assert after.allocation_revisions == {"a": after.revision}


async def test_the_cycle_reads_jobs_allocations_and_waits_in_one_read() -> None:
    store = _Interleaving()
    repo = JobRepository(store)
    await repo.submit(SPEC, "r1")
    cycle = SchedulingCycle(repo, StaticTopologySource(TOPO), wait_for_releases=True)
    store.reads.clear()
    report = await cycle.run()
    assert report.placed == ["j1"]
    state_reads = [r for r in store.reads if set(r) & {keys.JOBS, keys.ALLOCATIONS, keys.WAITS}]
    assert state_reads == [(keys.JOBS, keys.ALLOCATIONS, keys.WAITS)], store.reads
