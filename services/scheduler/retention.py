"""Retention of finished jobs: the leader deletes SUCCEEDED, FAILED and CANCELLED jobs by a policy.

A finished job is kept while both hold:

- it is among the ``max_jobs`` most recently finished jobs (``--retain-finished-jobs``, default
  :data:`DEFAULT_MAX_JOBS`; ``unlimited`` keeps any number), and
- it finished less than ``max_age_s`` ago (``--retain-finished-for``, default :data:`DEFAULT_MAX_AGE` =
  7 days; ``forever`` keeps any age).

A job's finish time is the time of the transition that ended it. The leader sweeps once on taking the lead
and then every ``--retention-interval`` seconds; each expired job goes through the same deletion as
``DeleteJob`` (:meth:`services.scheduler.observe.JobObserver.delete`): its record, request id, plan,
checkpoint record, reports and metrics history in one etcd transaction compared on the record's revision,
so a job that is not finished, or changed since the sweep read it, is never deleted. Workers' logs stay on
the agents (their own retention, ``--log-retention-days``).

:func:`expired` is the pure decision; :func:`sweep` applies it to the stored jobs.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from services.scheduler.observe import JobObserver
from services.scheduler.repo import JobRepository
from spiderflow.core.errors import ConflictError, NotFoundError, PreconditionError, ValidationError
from spiderflow.jobs import JobRecord

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_MAX_AGE",
    "DEFAULT_MAX_JOBS",
    "RetentionPolicy",
    "add_retention_arguments",
    "expired",
    "finished_at",
    "parse_duration",
    "policy_from_args",
    "sweep",
]

log = structlog.get_logger(__name__)

DEFAULT_MAX_JOBS = 1000
DEFAULT_MAX_AGE = "7d"
DEFAULT_INTERVAL_S = 60.0

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """How many finished jobs to keep (``max_jobs``; None: any number) and for how long after they finished
    (``max_age_s`` seconds; None: forever)."""

    max_jobs: int | None = DEFAULT_MAX_JOBS
    max_age_s: float | None = 7 * 86400.0

    def __post_init__(self) -> None:
        if self.max_jobs is not None and (isinstance(self.max_jobs, bool) or self.max_jobs < 0):
            raise ValidationError("max_jobs", "must be an integer ≥ 0 or None (any number)", self.max_jobs)
        if self.max_age_s is not None and not (math.isfinite(self.max_age_s) and self.max_age_s >= 0):
            raise ValidationError("max_age_s", "must be a finite number of seconds ≥ 0 or None (forever)",
                                  self.max_age_s)


def parse_duration(text: str, *, field: str = "--retain-finished-for") -> float | None:
    """Seconds of ``text``: a number with an optional unit ``s``, ``m``, ``h``, ``d`` or ``w`` (``90m``,
    ``7d``, ``3600``); ``forever`` → None."""
    if text.strip().lower() == "forever":
        return None
    m = _DURATION.match(text)
    if m is None:
        raise ValidationError(field, "must be a duration such as 90s, 30m, 12h, 7d, 2w, or 'forever'", text)
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _parse_count(text: str) -> int | None:
    if text.strip().lower() == "unlimited":
        return None
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValidationError("--retain-finished-jobs", "must be an integer ≥ 0 or 'unlimited'", text)
    return n


def finished_at(r: JobRecord) -> float:
    """When ``r`` (finished) ended: its last transition's time (its last update when it has no history)."""
    return r.history[-1].at if r.history else r.updated_at


def expired(finished: Sequence[tuple[str, float]], *, now: float, policy: RetentionPolicy) -> list[str]:
    """Ids to delete among ``finished`` (``(job id, finish time)`` of finished jobs only): those older than
    ``policy.max_age_s`` at ``now``, and all but the ``policy.max_jobs`` most recently finished (ties by
    id). Oldest first."""
    order = sorted(finished, key=lambda f: (f[1], f[0]))  # oldest first
    drop: set[str] = set()
    if policy.max_jobs is not None and len(order) > policy.max_jobs:
        drop.update(j for j, _ in order[: len(order) - policy.max_jobs])
    if policy.max_age_s is not None:
        drop.update(j for j, t in order if now - t > policy.max_age_s)
    return [j for j, _ in order if j in drop]


async def sweep(repo: JobRepository, observer: JobObserver, policy: RetentionPolicy, *, now: float) -> list[str]:
    """Delete the finished jobs ``policy`` no longer keeps; returns the deleted ids (oldest first). A job
    that changed or vanished since it was read is skipped (the next sweep sees it again)."""
    stored, _ = await repo.list()
    by_id = {sj.record.id: sj for sj in stored if sj.record.terminal}
    doomed = expired([(j, finished_at(sj.record)) for j, sj in by_id.items()], now=now, policy=policy)
    deleted: list[str] = []
    for job_id in doomed:
        try:
            await observer.delete(by_id[job_id])
        except (ConflictError, NotFoundError, PreconditionError) as e:
            log.info("scheduler.retention_skipped", job=job_id, error=str(e))
            continue
        deleted.append(job_id)
    if deleted:
        log.info("scheduler.retention_deleted", jobs=deleted, kept=len(by_id) - len(deleted),
                 max_jobs=policy.max_jobs, max_age_s=policy.max_age_s)
    return deleted


def add_retention_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--retain-finished-jobs", default=str(DEFAULT_MAX_JOBS), metavar="N",
                   help="keep the N most recently finished jobs (SUCCEEDED, FAILED, CANCELLED) with their "
                        "metrics; older ones are deleted ('unlimited' keeps all; default: %(default)s)")
    p.add_argument("--retain-finished-for", default=DEFAULT_MAX_AGE, metavar="DURATION",
                   help="delete a finished job this long after it finished (90s, 30m, 12h, 7d, 2w, or "
                        "'forever'; default: %(default)s)")
    p.add_argument("--retention-interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help="seconds between the leader's retention sweeps (default: %(default)s)")


def policy_from_args(args: argparse.Namespace) -> RetentionPolicy:
    """The policy of ``--retain-finished-jobs`` and ``--retain-finished-for`` (ValidationError naming the
    option on bad input)."""
    if not (math.isfinite(args.retention_interval) and args.retention_interval > 0):
        raise ValidationError("--retention-interval", "must be a number of seconds > 0", args.retention_interval)
    return RetentionPolicy(max_jobs=_parse_count(str(args.retain_finished_jobs)),
                           max_age_s=parse_duration(str(args.retain_finished_for)))
