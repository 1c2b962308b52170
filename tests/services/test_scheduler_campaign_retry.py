"""A scheduler replica that cannot reach the store retries its campaign with backoff (0.5 s doubling to
2 s), warns once per 30 s rather than at every attempt, stops at once when asked, and leads as soon as the
store is back."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import structlog

from services.scheduler import main as sched_main
from services.scheduler.main import SchedulerReplica
from services.scheduler.repo import JobRepository
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.domain import Cluster, Topology
from spiderflow.core.placement import Budget
from spiderflow.store import MemoryStore


async def test_campaign_retries_back_off_warn_rarely_and_recover(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    store.set_available(False)
    grants: list[float] = []
    loop = asyncio.get_running_loop()
    real_grant = store.grant

    async def grant(ttl: int, **kw: object):  # type: ignore[no-untyped-def]
        grants.append(loop.time())
        return await real_grant(ttl, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "grant", grant)
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    replica = SchedulerReplica(store, JobRepository(store), StaticTopologySource(topo), address="127.0.0.1:1",
                               default_policy="firstfit", planner=None, executor=None, wake=asyncio.Event(),
                               cycle_interval=0.05, lease_ttl=2, budget=Budget(), warm=None)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(replica.run(stop))
        await asyncio.sleep(5.0)  # attempts at about 0, 0.5, 1.5, 3.5 s
        gaps = [b - a for a, b in itertools.pairwise(grants)]
        # at most 4 attempts in 5 s (a fixed 0.5 s pace would make 10), each gap at least its backoff step
        assert 2 <= len(grants) <= 4, gaps
        assert all(g >= want - 0.02 for g, want in zip(gaps, [0.5, 1.0, 2.0][:len(gaps)], strict=True)), gaps
        assert [e["event"] for e in logs if e["event"] == "scheduler.campaign_retry"] == ["scheduler.campaign_retry"]
        store.set_available(True)
        for _ in range(60):  # the next attempt (≤ 2 s later) wins the election
            if replica.is_leader:
                break
            await asyncio.sleep(0.05)
        assert replica.is_leader
        t0 = loop.time()
        stop.set()
        await asyncio.wait_for(task, timeout=2.0)
        assert loop.time() - t0 < 1.0
    assert sched_main.CAMPAIGN_RETRY_MAX_S == 2.0


async def test_a_replica_asked_to_stop_while_backing_off_stops_at_once() -> None:
    store = MemoryStore()
    store.set_available(False)
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    replica = SchedulerReplica(store, JobRepository(store), StaticTopologySource(topo), address="127.0.0.1:1",
                               default_policy="firstfit", planner=None, executor=None, wake=asyncio.Event(),
                               cycle_interval=0.05, lease_ttl=2, budget=Budget(), warm=None)
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    await asyncio.sleep(2.0)  # inside the 2 s wait after the third attempt (at about 1.5 s)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stop.set()
    await asyncio.wait_for(task, timeout=2.0)
    assert loop.time() - t0 < 1.0  # not the rest of the 2 s backoff


async def test_a_replica_campaigns_only_once_its_kernels_are_loaded() -> None:
    """Compiling the placement kernels (a minute on a busy machine after an install) happens before the
    campaign, in a worker thread: a leader never holds its lease, nor makes its first cycle wait, meanwhile
    (a leader that compiled inside its first cycle lost its lease and stranded a load run)."""
    import threading

    store = MemoryStore()
    grants: list[int] = []
    real_grant = store.grant

    async def grant(ttl: int, **kw: object):  # type: ignore[no-untyped-def]
        grants.append(ttl)
        return await real_grant(ttl, **kw)  # type: ignore[arg-type]

    store.grant = grant  # type: ignore[method-assign]
    release = threading.Event()
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    replica = SchedulerReplica(store, JobRepository(store), StaticTopologySource(topo), address="127.0.0.1:1",
                               default_policy="firstfit", planner=None, executor=None, wake=asyncio.Event(),
                               cycle_interval=0.05, lease_ttl=2, budget=Budget(),
                               warm=lambda: release.wait(10) and None)
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    await asyncio.sleep(0.5)  # the event loop keeps running while the kernels "compile"
    assert grants == [] and not replica.is_leader
    release.set()
    for _ in range(100):
        if replica.is_leader:
            break
        await asyncio.sleep(0.02)
    assert replica.is_leader and grants == [2]
    stop.set()
    await asyncio.wait_for(task, timeout=2.0)


async def test_a_replica_asked_to_stop_while_its_kernels_load_stops_at_once() -> None:
    import threading

    release = threading.Event()
    store = MemoryStore()
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    replica = SchedulerReplica(store, JobRepository(store), StaticTopologySource(topo), address="127.0.0.1:1",
                               default_policy="firstfit", planner=None, executor=None, wake=asyncio.Event(),
                               cycle_interval=0.05, lease_ttl=2, budget=Budget(),
                               warm=lambda: release.wait(10) and None)
    stop = asyncio.Event()
    task = asyncio.create_task(replica.run(stop))
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait_for(task, timeout=1.0)
    assert not replica.is_leader
    release.set()
