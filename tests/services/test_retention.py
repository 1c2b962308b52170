"""Retention of finished jobs: the pure decision, the sweep on the in-memory store (a job that changed is
spared), and the leader of a real scheduler process on a real etcd deleting the oldest finished jobs with
their metrics, reports and request ids while a job that has not finished stays."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest
from scheduler_harness import start_replica

from services.scheduler.observe import JobObserver
from services.scheduler.repo import JobRepository, request_key
from services.scheduler.retention import (
    RetentionPolicy,
    add_retention_arguments,
    expired,
    parse_duration,
    policy_from_args,
    sweep,
)
from spiderflow.errors import ValidationError
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.sdk import AsyncClient
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.memory import MemoryStore
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(90)

DAY = 86400.0


def test_expired_keeps_the_newest_n_and_drops_what_is_too_old() -> None:
    finished = [("a", 100.0), ("b", 300.0), ("c", 200.0), ("d", 400.0)]
    assert expired(finished, now=500.0, policy=RetentionPolicy(max_jobs=2, max_age_s=None)) == ["a", "c"]
    assert expired(finished, now=500.0, policy=RetentionPolicy(max_jobs=None, max_age_s=250.0)) == ["a", "c"]
    assert expired(finished, now=500.0, policy=RetentionPolicy(max_jobs=3, max_age_s=150.0)) == ["a", "c", "b"]
    assert expired(finished, now=500.0, policy=RetentionPolicy(max_jobs=0, max_age_s=None)) == ["a", "c", "b", "d"]
    assert expired(finished, now=500.0, policy=RetentionPolicy(max_jobs=None, max_age_s=None)) == []
    assert expired([], now=0.0, policy=RetentionPolicy()) == []


def test_durations_counts_and_bad_options_name_the_option() -> None:
    assert parse_duration("90s") == 90.0
    assert parse_duration("30m") == 1800.0
    assert parse_duration("12h") == 12 * 3600.0
    assert parse_duration("7d") == 7 * DAY
    assert parse_duration("2w") == 14 * DAY
    assert parse_duration("3600") == 3600.0
    assert parse_duration("forever") is None
    p = argparse.ArgumentParser()
    add_retention_arguments(p)
    default = policy_from_args(p.parse_args([]))
    assert default == RetentionPolicy(max_jobs=1000, max_age_s=7 * DAY)
    assert policy_from_args(p.parse_args(["--retain-finished-jobs", "unlimited",
                                          "--retain-finished-for", "forever"])) == RetentionPolicy(
        max_jobs=None, max_age_s=None)
    for argv, option in ((["--retain-finished-for", "7 days"], "--retain-finished-for"),
                         (["--retain-finished-jobs", "-1"], "--retain-finished-jobs"),
                         (["--retain-finished-jobs", "many"], "--retain-finished-jobs"),
                         (["--retention-interval", "0"], "--retention-interval")):
        with pytest.raises(ValidationError, match=option):
            policy_from_args(p.parse_args(argv))


def _spec(i: int) -> dict[str, object]:
    return {"id": f"job-{i}", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 5,
            "gpus": {"min": 1, "max": 3}}


async def test_sweep_deletes_through_the_delete_path_and_spares_unfinished_and_changed_jobs() -> None:
    now = [1000.0]
    store = MemoryStore()
    repo = JobRepository(store, clock=lambda: now[0])
    observer = JobObserver(repo)
    for i in range(4):
        await repo.submit(job_from_dict(_spec(i)), f"req-{i}")
        await store.put(keys.metrics_key(f"job-{i}", attempt=1, step=1), b"[]")
        now[0] += 10
    for i in range(3):  # job-0, job-1, job-2 finish, in that order; job-3 stays PENDING
        sj = await repo.get(f"job-{i}")
        await repo.transition(sj, sj.record.to(JobState.CANCELLED, "test", now=now[0]))
        now[0] += 10
    policy = RetentionPolicy(max_jobs=1, max_age_s=None)
    stale = await repo.get("job-1")
    # job-0 is deleted; job-1 is read by the sweep below as it is now, so a stale copy cannot be deleted
    assert await sweep(repo, observer, RetentionPolicy(max_jobs=2, max_age_s=None), now=now[0]) == ["job-0"]
    assert await sweep(repo, observer, policy, now=now[0]) == ["job-1"]
    assert await store.get(keys.job_key("job-1")) is None
    assert await store.get(request_key("req-1")) is None
    assert (await store.get_prefix(keys.metrics_prefix("job-1")))[0] == []
    # a record that changed since it was read is not deleted by its stale copy (compare on the revision)
    await repo.submit(job_from_dict(_spec(1)), "req-1b")
    sj = await repo.get("job-1")
    await repo.transition(sj, sj.record.to(JobState.CANCELLED, "again", now=now[0]))
    with pytest.raises(Exception, match="job"):
        await observer.delete(stale)
    assert await store.get(keys.job_key("job-1")) is not None
    left, _ = await repo.list()
    assert {s.record.id for s in left} == {"job-1", "job-2", "job-3"}
    # by age: everything finished more than a day ago goes, the unfinished job stays whatever its age
    gone = await sweep(repo, observer, RetentionPolicy(max_jobs=None, max_age_s=DAY), now=now[0] + 2 * DAY)
    assert gone == ["job-2", "job-1"]
    left, _ = await repo.list()
    assert [s.record.id for s in left] == ["job-3"]
    assert (await store.get_prefix(keys.metrics_prefix("job-3")))[0] != []


async def _wait_for(what: str, check: object, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.1)


async def test_the_leader_deletes_the_oldest_finished_jobs_with_their_keys_on_real_etcd(tmp_path: Path) -> None:
    with EtcdProcess() as etcd:
        sched = start_replica(etcd.endpoint, tmp_path, "sched", "--executor", "agents",
                              "--retain-finished-jobs", "1", "--retain-finished-for", "forever",
                              "--retention-interval", "0.2")
        store = EtcdStore(etcd.endpoint)
        try:
            async with AsyncClient(sched.address) as client:
                for i in range(4):
                    await client.submit(_spec(i), request_id=f"req-{i}")
                    await store.put(keys.metrics_key(f"job-{i}", attempt=1, step=1), b"[]")
                    await store.put(keys.reports_prefix(f"job-{i}") + "agent", b"{}")

                async def ids() -> set[str]:
                    return {j.id for j in await client.list()}

                await client.cancel("job-0")
                await asyncio.sleep(0.6)  # a few sweeps: one finished job is within the policy
                assert await ids() == {"job-0", "job-1", "job-2", "job-3"}
                await client.cancel("job-1")

                async def job0_gone() -> bool:
                    return await ids() == {"job-1", "job-2", "job-3"}
                await _wait_for("job-0 deleted", job0_gone)
                await client.cancel("job-2")

                async def job1_gone() -> bool:
                    return await ids() == {"job-2", "job-3"}
                await _wait_for("job-1 deleted", job1_gone)
                assert (await client.get("job-3")).state not in ("SUCCEEDED", "FAILED", "CANCELLED")
                for gone in ("job-0", "job-1"):
                    assert (await store.get_prefix(keys.metrics_prefix(gone)))[0] == []
                    assert (await store.get_prefix(keys.reports_prefix(gone)))[0] == []
                    assert await store.get(request_key(gone.replace("job", "req"))) is None
                for kept in ("job-2", "job-3"):
                    assert (await store.get_prefix(keys.metrics_prefix(kept)))[0] != []
                    assert (await store.get_prefix(keys.reports_prefix(kept)))[0] != []
                # the id of a deleted job is free again
                again = await client.submit(_spec(0), request_id="req-0-again")
                assert again.id == "job-0"
        finally:
            await store.close()
            sched.stop()
        assert "scheduler.retention_deleted" in sched.log_path.read_text()
