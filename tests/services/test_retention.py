"""Retention of finished jobs: the pure decision and the sweep on the in-memory store (a job that changed is
spared). The leader of a real scheduler process applying it on a real etcd: ``test_observe_etcd.py``."""

from __future__ import annotations

import argparse

import pytest

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
from spiderflow.core.errors import ValidationError
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.store import keys
from spiderflow.store.memory import MemoryStore

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
