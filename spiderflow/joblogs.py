"""Where workers' output is kept on an agent, how it is read back, and how long it is kept.

Layout under an agent's work directory (one tree per agent; the cluster is part of the path so that agents
sharing a directory, as on one machine, never mix their files)::

    <work_dir>/logs/<job>/attempt-<n>/<cluster>/rank-<r>.out   # the worker's stdout (JSON events)
    <work_dir>/logs/<job>/attempt-<n>/<cluster>/rank-<r>.log   # the worker's stderr (log events, tracebacks)

The files outlive the job and the mesh: an agent deletes a job's directory only by its retention policy
(:func:`prune`: jobs whose newest file is older than ``retention_days``), when it starts and then hourly.
Every id that becomes a path component is checked against :data:`NAME_RE` and the resulting path must stay
inside the logs root (a job id such as ``../x`` is a :class:`~spiderflow.core.errors.ValidationError`).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from spiderflow.core.errors import ValidationError
from spiderflow.security import ids

__all__ = [
    "LOGS_DIR",
    "NAME_RE",
    "LogFile",
    "LogStream",
    "attempt_dir",
    "find_logs",
    "logs_root",
    "prune",
    "rank_log_paths",
    "read_chunk",
]

LOGS_DIR = "logs"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""Job ids and cluster names that may name a directory."""

_ATTEMPT_RE = re.compile(r"^attempt-(\d+)$")
_RANK_RE = re.compile(r"^rank-(\d+)\.(out|log)$")


class LogStream(StrEnum):
    """Which of a worker's outputs a file holds."""

    STDOUT = "stdout"
    STDERR = "stderr"


_SUFFIX = {LogStream.STDOUT: "out", LogStream.STDERR: "log"}


@dataclass(frozen=True, slots=True, kw_only=True)
class LogFile:
    """One rank's output file of one attempt on one cluster."""

    job: str
    attempt: int
    cluster: str
    rank: int
    stream: LogStream
    path: Path


def _name(fieldname: str, value: str) -> str:
    if not NAME_RE.match(value):
        raise ValidationError(fieldname, "must be 1-128 of A-Z a-z 0-9 . _ - (starting with a letter or digit)",
                              value)
    return value


def logs_root(work_dir: Path) -> Path:
    """The directory that holds every job's logs on this agent."""
    return work_dir / LOGS_DIR


def attempt_dir(work_dir: Path, *, job: str, attempt: int, cluster: str) -> Path:
    """The directory (created) of ``attempt`` of ``job`` on ``cluster``: its worker spec and every rank's
    ``rank-<r>.out`` / ``rank-<r>.log``. Raises ``ValidationError`` naming the field for an id that cannot
    be a path component."""
    d = ids.inside(logs_root(work_dir), ids.check_job_id("job", job), f"attempt-{int(attempt)}",
                   _name("cluster", cluster))
    d.mkdir(parents=True, exist_ok=True)
    return d


def rank_log_paths(work_dir: Path, *, job: str, attempt: int, cluster: str, rank: int) -> tuple[Path, Path]:
    """``(stdout, stderr)`` files of ``rank`` in ``attempt`` of ``job`` run on ``cluster`` (directories
    created). Raises ``ValidationError`` naming the field for an id that cannot be a path component."""
    d = attempt_dir(work_dir, job=job, attempt=attempt, cluster=cluster)
    return d / f"rank-{int(rank)}.out", d / f"rank-{int(rank)}.log"


def find_logs(work_dir: Path, *, job: str, attempt: int | None = None, cluster: str | None = None,
              rank: int | None = None, streams: frozenset[LogStream] = frozenset(LogStream)) -> list[LogFile]:
    """The log files of ``job`` kept here, filtered, ordered by (attempt, cluster, rank, stdout first)."""
    root = ids.inside(logs_root(work_dir), ids.check_job_id("job", job))
    out: list[LogFile] = []
    if not root.is_dir():
        return out
    for adir in root.iterdir():
        am = _ATTEMPT_RE.match(adir.name)
        if am is None or (attempt is not None and int(am.group(1)) != attempt) or not adir.is_dir():
            continue
        for cdir in adir.iterdir():
            if not cdir.is_dir() or not NAME_RE.match(cdir.name) or (cluster is not None and cdir.name != cluster):
                continue
            for f in cdir.iterdir():
                rm = _RANK_RE.match(f.name)
                if rm is None or (rank is not None and int(rm.group(1)) != rank):
                    continue
                stream = LogStream.STDOUT if rm.group(2) == "out" else LogStream.STDERR
                if stream in streams:
                    out.append(LogFile(job=job, attempt=int(am.group(1)), cluster=cdir.name, rank=int(rm.group(1)),
                                       stream=stream, path=f))
    out.sort(key=lambda x: (x.attempt, x.cluster, x.rank, x.stream != LogStream.STDOUT))
    return out


def read_chunk(path: Path, offset: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path`` from ``offset``, ending at a line end when one is in the chunk
    (so a follower never splits a line it will read whole later)."""
    with path.open("rb") as f:
        if offset >= os.fstat(f.fileno()).st_size:
            return b""  # nothing new (a seek past a file system's largest file size would fail)
        f.seek(offset)
        data = f.read(limit)
    if len(data) == limit and b"\n" in data:
        data = data[: data.rindex(b"\n") + 1]
    return data


def prune(work_dir: Path, *, retention_days: float, now: float | None = None) -> list[str]:
    """Delete the logs of jobs whose newest file is older than ``retention_days`` (0 keeps everything);
    returns the job ids deleted."""
    root = logs_root(work_dir)
    if retention_days <= 0 or not root.is_dir():
        return []
    cutoff = (time.time() if now is None else now) - retention_days * 86400.0
    gone: list[str] = []
    for jdir in root.iterdir():
        if not jdir.is_dir() or not ids.ID_PATTERN.fullmatch(jdir.name.replace(ids.SEP, "-", 1)):
            continue
        newest = max((p.stat().st_mtime for p in jdir.rglob("*") if p.is_file()), default=jdir.stat().st_mtime)
        if newest < cutoff:
            shutil.rmtree(jdir, ignore_errors=True)
            gone.append(jdir.name)
    return sorted(gone)
