"""The scheduling cycle's decision cache: like jobs on the same snapshot share one search; any change of
the snapshot (free GPUs, topology) or of the job's shape is a new search; GPUs are never over-committed."""

from __future__ import annotations

from services.scheduler.cycle import SchedulingCycle
from services.scheduler.repo import JobRepository
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.domain import Cluster, JobSpec, Link, Topology
from spiderflow.core.placement import Budget, PlacementResult
from spiderflow.core.placement.base import PlacementPolicy
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.store import MemoryStore


def _topo() -> Topology:
    return Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=4),
                              Cluster(name="b", gpu="A100-80G", nodes=1, gpus_per_node=4)),
                    links=(Link(a="a", b="b", bandwidth_gbps=10.0, latency_ms=5),))


def _job(i: int, *, tenant: str = "t", steps: int = 5, model: str = "gpt-tiny", gpus: int = 1) -> JobSpec:
    return job_from_dict({"id": f"job-{i:03d}", "model": model, "global_batch": 8, "micro_batch": 1,
                          "seq_len": 64, "steps": steps, "gpus": {"min": gpus, "max": gpus}, "tenant": tenant})


class CountingCycle(SchedulingCycle):
    searches = 0

    def place_cached(self, name: str, inner: PlacementPolicy, snap: Topology, spec: JobSpec,
                     budget: Budget) -> PlacementResult:
        before = self.cache_hits
        result = super().place_cached(name, inner, snap, spec, budget)
        if self.cache_hits == before:
            self.searches += 1
        return result


async def _finish_all(repo: JobRepository) -> None:
    stored, _ = await repo.list()
    for sj in stored:
        if sj.record.state is JobState.PLACED:
            await repo.transition(sj, sj.record.to(JobState.SUCCEEDED, "done", now=repo.clock()))


async def test_like_jobs_on_the_same_snapshot_share_one_search() -> None:
    repo = JobRepository(MemoryStore())
    cycle = CountingCycle(repo, StaticTopologySource(_topo()))
    for i in range(8):  # exactly fills both clusters: one free-GPU state per placement
        await repo.submit(_job(i, tenant=f"t{i % 3}"), f"r{i}")
    first = await cycle.run()
    assert len(first.placed) == 8 and cycle.searches == 8 and cycle.cache_hits == 0  # the snapshot changed each time
    allocs, _, _ = await repo.allocations()
    assert sum(sum(a.values()) for a in allocs.values()) == 8
    await _finish_all(repo)
    for i in range(8, 16):  # the same shapes again, other ids and tenants, on the same free-GPU states
        await repo.submit(_job(i, tenant="other"), f"r{i}")
    second = await cycle.run()
    assert len(second.placed) == 8 and cycle.searches == 8 and cycle.cache_hits == 8
    allocs, _, _ = await repo.allocations()
    assert {c: sum(a.values()) for c, a in allocs.items()} == {"a": 4, "b": 4}  # never over-committed
    for i in range(8, 16):
        r = (await repo.get(f"job-{i:03d}")).record
        assert r.state is JobState.PLACED and r.plan is not None and sum(r.allocation.values()) == 1


async def test_another_shape_or_topology_is_a_new_search() -> None:
    repo = JobRepository(MemoryStore())
    source = StaticTopologySource(_topo())
    cycle = CountingCycle(repo, source)
    await repo.submit(_job(0), "r0")
    await cycle.run()
    await _finish_all(repo)
    await repo.submit(_job(1, steps=50), "r1")
    await cycle.run()
    assert cycle.searches == 2 and cycle.cache_hits == 0  # another shape
    await _finish_all(repo)
    source._topology = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=4),),
                                links=())
    await repo.submit(_job(2), "r2")
    await cycle.run()
    assert cycle.searches == 3 and cycle.cache_hits == 0  # the same shape on another topology
    assert (await repo.get("job-002")).record.allocation == {"a": 1}


async def test_unplaceable_like_jobs_get_the_same_reason_from_one_search() -> None:
    repo = JobRepository(MemoryStore())
    cycle = CountingCycle(repo, StaticTopologySource(_topo()))
    for i in range(3):  # far too big for one GPU of each: no placement, the same reason for each
        await repo.submit(_job(i, model="llama3-70b", tenant=f"t{i}"), f"r{i}")
    report = await cycle.run()
    assert report.placed == []
    reasons = {(await repo.get(f"job-{i:03d}")).record.reason for i in range(3)}
    assert len(reasons) == 1 and reasons != {""}
    assert cycle.searches + cycle.cache_hits >= 1 and cycle.searches == 1
