"""The scheduler's per-submission costs, kept low without dropping a guarantee: a cycle's notes share
transactions (each record still compared on its own revision), a submit transaction leaves one audit line
naming every job it created, and while submissions arrive cycles are paced by their own duration."""

from __future__ import annotations

import asyncio
import base64
import math
from typing import Any

import grpc
import grpc.aio
import pytest

from services.scheduler import batching
from services.scheduler.batching import SubmitBatcher
from services.scheduler.cycle import SchedulingCycle
from services.scheduler.main import BURST_SUBMISSIONS, BUSY_PAUSE_MAX_S, SchedulerReplica
from services.scheduler.repo import MAX_TXN_RECORDS, JobRepository
from services.scheduler.service import SchedulerService
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.domain import Cluster, JobSpec, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement import Budget
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.rpc.server import open_channel, serve
from spiderflow.store import MemoryStore, keys


def _spec(i: int, tenant: str = "t") -> JobSpec:
    return job_from_dict({"id": f"{tenant}~job-{i:03d}", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1,
                          "seq_len": 64, "steps": 5, "gpus": {"min": 1, "max": 1}, "tenant": tenant})


class CountingStore(MemoryStore):
    """Counts transactions that write job records (and how many each writes); ``gate`` holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.job_commits: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def commit(self, compares: Any, puts: Any = (), deletes: Any = (), **kw: Any) -> int:
        await self.gate.wait()
        n = sum(1 for p in puts if p.key.startswith(keys.JOBS))
        if n:
            self.job_commits.append(n)
        return await super().commit(compares, puts, deletes, **kw)


async def test_update_many_writes_in_few_transactions_and_leaves_out_a_record_that_changed() -> None:
    store = CountingStore()
    repo = JobRepository(store)
    stored = [(await repo.submit(_spec(i), f"r{i}"))[0] for i in range(150)]
    changed = await repo.update(stored[70], stored[70].record.with_reason("cancelled meanwhile", now=2.0))
    store.job_commits.clear()
    written = await repo.update_many([(sj, sj.record.with_reason(f"note {i}", now=3.0))
                                      for i, sj in enumerate(stored)])
    assert len(store.job_commits) == math.ceil(150 / MAX_TXN_RECORDS) + 1  # one retry without the changed one
    assert sorted(sj.record.id for sj in written) == sorted(sj.record.id for sj in stored if sj is not stored[70])
    for i, sj in enumerate(stored):
        now = await repo.get(sj.record.id)
        assert now.record.reason == ("cancelled meanwhile" if i == 70 else f"note {i}")
    assert (await repo.get(changed.record.id)).mod_revision == changed.mod_revision  # left alone


async def test_a_cycle_writes_its_notes_in_one_transaction_per_64_records() -> None:
    store = CountingStore()
    repo = JobRepository(store)
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    cycle = SchedulingCycle(repo, StaticTopologySource(topo), budget=Budget(time_limit_s=5.0))
    for i in range(80):
        await repo.submit(_spec(i), f"r{i}")
    store.job_commits.clear()
    report = await cycle.run()
    assert len(report.placed) == 1
    jobs, _ = await repo.list()
    noted = [sj for sj in jobs if sj.record.state is JobState.PENDING and sj.record.reason != "waiting for a placement"]
    assert len(noted) == 79  # every queued job says why it waits
    assert sorted(store.job_commits) == sorted([1, MAX_TXN_RECORDS, 79 - MAX_TXN_RECORDS])  # the bind, 2 note txns


class _Lines:
    """Records what a module logs (independent of the process's structlog configuration)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append({"event": event, **kw})

    debug = warning = info


async def test_a_submit_transaction_leaves_one_audit_line_naming_every_job_it_created(
        monkeypatch: pytest.MonkeyPatch) -> None:
    logs = _Lines()
    monkeypatch.setattr(batching, "log", logs)
    store = CountingStore()
    batcher = SubmitBatcher(JobRepository(store))
    store.gate.clear()  # the first submission's transaction waits: the next five queue behind it
    first = asyncio.ensure_future(batcher.submit(_spec(0, "a"), "req-0"))
    await asyncio.sleep(0.01)
    rest = [asyncio.ensure_future(batcher.submit(_spec(i, "b" if i % 2 else "a"), f"req-{i}")) for i in range(1, 6)]
    await asyncio.sleep(0.01)
    store.gate.set()
    outcomes = await asyncio.gather(first, *rest)
    assert all(created for _, created in outcomes)
    lines = [e for e in logs.events if e["event"] == "scheduler.submitted"]
    assert [len(e["jobs"]) for e in lines] == [1, 5]  # one line per transaction
    assert lines[1]["jobs"] == [f"{'b' if i % 2 else 'a'}~job-{i:03d}" for i in range(1, 6)]
    assert lines[1]["tenants"] == ["b" if i % 2 else "a" for i in range(1, 6)]
    assert lines[1]["request_ids"] == [f"req-{i}" for i in range(1, 6)]
    jobs, _ = await store.get_prefix(keys.JOBS)
    assert lines[1]["revision"] == max(kv.mod_revision for kv in jobs)


def _replica(share: float) -> SchedulerReplica:
    store = MemoryStore()
    repo = JobRepository(store)
    topo = Topology(clusters=(Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=1),), links=())
    return SchedulerReplica(store, repo, StaticTopologySource(topo), address="127.0.0.1:1", default_policy="spinsearch",
                            planner=None, executor=None, wake=asyncio.Event(), cycle_interval=5.0, lease_ttl=3,
                            budget=Budget(), min_cycle_interval=0.2, warm=None, busy_cycle_share=share,
                            submissions=lambda: 0)


def test_during_a_burst_cycles_are_paced_by_their_duration_and_otherwise_not() -> None:
    burst = BURST_SUBMISSIONS
    assert _replica(0.25)._cycle_gap(0.4, burst) == pytest.approx(1.6)  # a 0.4 s cycle: the next 1.6 s after it
    assert _replica(0.25)._cycle_gap(0.01, burst) == pytest.approx(0.2)  # never below --min-cycle-interval
    assert _replica(0.25)._cycle_gap(3.0, burst) == pytest.approx(3.0 + BUSY_PAUSE_MAX_S)  # a bounded pause
    assert _replica(0.25)._cycle_gap(0.4, burst - 1) == pytest.approx(0.2)  # a few submissions: no delay
    assert _replica(1.0)._cycle_gap(0.4, 10 * burst) == pytest.approx(0.2)  # share 1: back to back (as before)
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValidationError, match="busy-cycle-share"):
            _replica(bad)


async def test_list_jobs_pages_with_a_cursor_in_submission_order_even_when_jobs_go_between_pages() -> None:
    store = MemoryStore()
    repo = JobRepository(store, clock=iter(float(t) for t in range(1000)).__next__)  # distinct submission times
    svc = SchedulerService(repo)
    for i in range(25):
        await repo.submit(_spec(i), f"r{i}")
    server = await serve([svc])
    try:
        async with open_channel(server.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)  # type: ignore[no-untyped-call]
            seen: list[str] = []
            token = ""
            for page in range(10):
                resp = await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=10, page_token=token), timeout=5)
                seen += [j.spec.id for j in resp.jobs]
                token = resp.next_page_token
                if page == 0:  # the first two jobs leave and a new one comes: nothing repeats, nothing is skipped
                    for gone in seen[:2]:
                        await store.delete(keys.job_key(gone))
                    await repo.submit(_spec(25), "r25")
                if not token:
                    break
            assert seen == [f"t~job-{i:03d}" for i in range(26)]
            huge = base64.urlsafe_b64encode(f'[{"9" * 400}, "x"]'.encode()).decode()  # no float that large
            for bad in ("10", "bm90IGpzb24", "WzEsIDJd", "!", huge):  # an offset, not JSON, [1, 2], not base64
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_token=bad), timeout=5)
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "page_token" in (err.value.details() or "")
    finally:
        await server.stop(grace_s=0)


def test_a_busy_cycle_share_outside_its_range_is_a_one_line_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    from spiderflow.cli.main import main

    code = main(["serve", "scheduler", "--etcd", "127.0.0.1:1", "--topology", "examples/topology-3.yaml",
                 "--listen", "127.0.0.1:0", "--busy-cycle-share", "1.5"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and [line.lower() for line in err.splitlines()] == \
        ["error: --busy-cycle-share: must be in (0, 1] (got 1.5)"]
