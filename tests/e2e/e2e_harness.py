"""Helpers of the end-to-end tests: find every process a run started, read the workers' event files."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spiderflow.sdk import Client, Job

ROOT = Path(__file__).resolve().parents[2]
MARK = "SPIDERFLOW_E2E_RUN"
"""Environment variable every process of a run inherits (etcd, services, agents, workers): the tag by which
the tests find what a run left behind."""


def marked_processes(token: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of live processes whose environment carries ``MARK=token`` (zombies excluded)."""
    needle = f"{MARK}={token}".encode()
    found: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append((int(entry.name), cmd))
    return found


def wait_no_marked_processes(token: str, timeout: float = 15.0) -> list[tuple[int, str]]:
    """Wait until no process of the run is alive; returns the survivors at the deadline (empty: none)."""
    deadline = time.monotonic() + timeout
    left = marked_processes(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = marked_processes(token)
    return left


def worker_events(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """The stdout events of every rank of one attempt (``<work-dir>/logs/<job>/attempt-<n>/<cluster>/rank-<r>.out``)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for f in sorted(run_dir.glob("rank-*.out")):
        rank = int(f.stem.split("-")[1])
        events = []
        for line in f.read_text().splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except ValueError:  # a line cut short by a killed worker
                    continue
        out[rank] = events
    return out


def attempt_events(mesh_dir: Path, job: str, attempt: int) -> dict[int, list[dict[str, Any]]]:
    """Events of every rank of ``job``'s attempt, over all agents' work dirs of a mesh."""
    merged: dict[int, list[dict[str, Any]]] = {}
    for run_dir in sorted((mesh_dir / "agents").glob(f"*/logs/{job}/attempt-{attempt}/*")):
        merged.update(worker_events(run_dir))
    return merged


def losses_by_step(events: dict[int, list[dict[str, Any]]]) -> dict[int, float]:
    """Step → loss from the ranks that know it (last stage)."""
    out: dict[int, float] = {}
    for evs in events.values():
        for e in evs:
            if e.get("event") == "step" and e.get("loss") is not None:
                out[int(e["step"])] = float(e["loss"])
    return out


def wait_for_job(sf: Client, job_id: str, pred: Callable[[Job], bool], timeout: float, what: str) -> Job:
    """Poll ``job_id`` until ``pred`` holds; fail naming ``what`` and the job's state if it ends or times out."""
    deadline = time.monotonic() + timeout
    job = sf.get(job_id)
    while time.monotonic() < deadline:
        job = sf.get(job_id)
        if pred(job):
            return job
        if job.done:
            break
        time.sleep(0.3)
    raise AssertionError(f"{what}: job is {job.state} ({job.reason}), progress {job.progress}, attempt {job.attempt}")


def walk_keyspace(etcd_data: Path) -> dict[str, int]:
    """Replay every write ever made to the etcd whose data directory is ``etcd_data`` (its whole history, from
    revision 1), then read the keys left: every key must parse through :mod:`spiderflow.store.keys` and every
    value decode through :mod:`spiderflow.store.records` — the first that does not raises the
    :class:`~spiderflow.core.errors.CorruptRecordError` naming its key (an unknown key: field ``key``). Returns how
    many writes of each key kind there were."""
    import asyncio

    from spiderflow.store import keys, records
    from spiderflow.store.base import EventType
    from spiderflow.store.etcd import EtcdStore
    from spiderflow.store.process import EtcdProcess

    async def walk(endpoint: str) -> dict[str, int]:
        store = EtcdStore(endpoint)
        kinds: dict[str, int] = {}
        try:
            items, current = await store.get_prefix("")
            for kv in items:
                records.decode(kv.key, kv.value)
            async with store.watch_prefix("", start_revision=1) as watch:
                async for ev in watch:
                    if ev.type is EventType.PUT:
                        records.decode(ev.key, ev.value)
                    kind = keys.parse(ev.key).kind.value
                    kinds[kind] = kinds.get(kind, 0) + (ev.type is EventType.PUT)
                    if ev.mod_revision >= current:
                        break
        finally:
            await store.close()
        return kinds

    proc = EtcdProcess(data_dir=etcd_data)
    proc.start()
    try:
        return asyncio.run(walk(proc.endpoint))
    finally:
        proc.close()

