"""The scheduling cycle's decisions on an in-memory store (pure logic; the etcd path is tested elsewhere)."""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.cycle import SchedulingCycle
from services.scheduler.repo import JobRepository
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.domain import Cluster, Link, Topology
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.store import MemoryStore


def _topo(bw_ab: float = 10.0, with_c: bool = True) -> Topology:
    clusters = [Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8),
                Cluster(name="b", gpu="A100-80G", nodes=1, gpus_per_node=8)]
    links = [Link(a="a", b="b", bandwidth_gbps=bw_ab, latency_ms=5)]
    if with_c:
        clusters.append(Cluster(name="c", gpu="A100-80G", nodes=1, gpus_per_node=8))
        links += [Link(a="b", b="c", bandwidth_gbps=10, latency_ms=5), Link(a="a", b="c", bandwidth_gbps=10,
                                                                            latency_ms=5)]
    return Topology(clusters=tuple(clusters), links=tuple(links))


JOB = job_from_dict({"id": "big", "model": "gpt3-6.7b", "global_batch": 64, "seq_len": 2048, "steps": 100,
                     "gpus": {"min": 16, "max": 16}})


async def _placed(source: StaticTopologySource) -> tuple[JobRepository, SchedulingCycle]:
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, source, default_policy="spinsearch")
    await repo.submit(JOB, "r1")
    report = await cycle.run()
    assert report.placed == ["big"]
    return repo, cycle


async def test_cluster_loss_reschedules_and_replaces() -> None:
    source = StaticTopologySource(_topo())
    repo, cycle = await _placed(source)
    first = (await repo.get("big")).record
    assert first.state is JobState.PLACED and sum(first.allocation.values()) == 16
    lost = first.plan.chain[0] if first.plan else "a"
    source._topology = Topology(clusters=tuple(c for c in _topo().clusters if c.name != lost),
                                links=tuple(k for k in _topo().links if lost not in (k.a, k.b)))
    report = await cycle.run()
    assert report.rescheduled == ["big"]
    again = (await repo.get("big")).record
    assert again.state is JobState.PLACED and again.attempt == 2 and lost not in again.allocation
    assert any(t.to_state is JobState.RESCHEDULING and lost in t.reason for t in again.history)
    allocs, _, _ = await repo.allocations()
    assert lost not in allocs or "big" not in allocs[lost]  # GPUs on the lost cluster released


async def test_link_degradation_beyond_threshold_reschedules() -> None:
    source = StaticTopologySource(_topo(with_c=False))
    repo, cycle = await _placed(source)
    rec = (await repo.get("big")).record
    assert rec.plan is not None and set(rec.plan.chain) == {"a", "b"}
    source._topology = _topo(bw_ab=9.0, with_c=False)  # a 10 % drop: no re-placement
    assert (await cycle.run()).rescheduled == []
    source._topology = _topo(bw_ab=0.05, with_c=False)  # collapse: re-placed
    report = await cycle.run()
    assert report.rescheduled == ["big"]
    rec = (await repo.get("big")).record
    assert rec.attempt == 2 and "predicted step time grew" in next(
        t.reason for t in rec.history if t.to_state is JobState.RESCHEDULING)


async def test_unplaceable_job_stays_pending_with_reason() -> None:
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, StaticTopologySource(_topo()), default_policy="spinsearch")
    await repo.submit(replace(JOB, id="huge", gpus=replace(JOB.gpus, min=100, max=100)), "r2")
    report = await cycle.run()
    assert report.placed == []
    rec = (await repo.get("huge")).record
    assert rec.state is JobState.PENDING and "100" in rec.reason


async def test_losing_every_cluster_reschedules_and_waits() -> None:
    source = StaticTopologySource(_topo())
    repo, cycle = await _placed(source)
    source._topology = Topology(clusters=(), links=(), revision=7)
    report = await cycle.run()
    assert report.rescheduled == ["big"]
    rec = (await repo.get("big")).record
    assert rec.state is JobState.RESCHEDULING and rec.allocation == {}
    allocs, _, _ = await repo.allocations()
    assert all("big" not in a for a in allocs.values())
    source._topology = _topo()  # clusters come back: placed again
    assert (await cycle.run()).placed == ["big"]
    assert (await repo.get("big")).record.attempt == 2
