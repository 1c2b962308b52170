"""Group commit of job submissions: concurrent SubmitJob calls share one etcd transaction.

Each submission is validated and turned into its record by its own call (so a malformed job never
reaches a batch); :meth:`SubmitBatcher.submit` then queues it and waits for its outcome. One flush runs
at a time: it takes what is queued (at most ``max_batch`` submissions and ``max_bytes`` of values) and
writes it as **one** :meth:`~spiderflow.store.base.Store.commit` comparing every request key and job key
on "absent" and putting them all. Submissions that arrive while a flush is in flight wait for the next
one, so under load a transaction (and etcd's fsync) carries many submissions, and alone a submission
is written at once (no timer adds latency). Under load (the previous transaction carried more than one
submission) a flush first lingers ``linger_s`` (default :data:`LINGER_S`) unless a full batch is queued
already: the submissions that the server is parsing meanwhile join it, so a burst takes fewer, fuller
transactions (each one costs the scheduler an etcd call and an audit line, and etcd a raft entry and an
fsync). Once the load is gone a submission is written at once again (the first one alone after a burst
waits one linger).

Per submission the outcome is exactly that of :meth:`~services.scheduler.repo.JobRepository.submit`:

- created exactly once, the request key and the job record in the same transaction (repo invariant 1:
  no half-written state, at every revision);
- when a compare fails, etcd names the keys that exist (``CompareFailedError.current``): only the
  submissions owning those keys leave the batch and are resolved one by one as a retry (same job →
  ``created=False``; another job or spec under the request id, or a job id taken by another request →
  :class:`~spiderflow.core.errors.AlreadyExistsError`); the rest of the batch is committed again;
- two queued submissions naming the same request key or job key never share a transaction: the later
  one waits for the next flush and then sees the first one's write (duplicate request ids in one burst
  give one job, every caller gets it, one of them ``created=True``);
- a store failure (etcd unavailable, a refused transaction) fails every submission of that transaction
  with the same error; a retry with the same request id is safe as always;
- a caller that gave up (its call was cancelled) before its flush started is not written.

Every transaction that created jobs leaves one audit line (``scheduler.submitted``) naming each job it created
with its tenant and request id, and the revision that holds them: one line per transaction, not per job.

Transactions stay within etcd's default ``--max-txn-ops`` (128) with ``max_batch`` = 64 (two compares
and two puts per submission) and well under its request size limit (1.5 MiB) with ``max_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import structlog

from services.scheduler.repo import JobRepository, StoredJob
from spiderflow.core.domain import JobSpec
from spiderflow.core.errors import UnavailableError
from spiderflow.jobs import JobRecord
from spiderflow.store import keys
from spiderflow.store.base import Compare, CompareFailedError, Put

__all__ = ["LINGER_S", "MAX_BATCH", "MAX_BYTES", "SubmitBatcher"]

log = structlog.get_logger(__name__)

MAX_BATCH = 64
"""Submissions per transaction at most: 2 compares and 2 puts each stay within etcd's default 128 ops."""
MAX_BYTES = 512 * 1024
"""Value bytes per transaction at most (etcd refuses requests over 1.5 MiB by default)."""

LINGER_S = 0.002
"""How long a flush under load waits for more submissions to join its transaction (seconds)."""

Outcome = tuple[StoredJob, bool]


@dataclass(slots=True, eq=False)
class _Item:
    record: JobRecord
    rkey: str
    jkey: str
    compares: list[Compare]
    puts: list[Put]
    size: int
    fut: asyncio.Future[Outcome] = field(repr=False)


def _log_created(created: list[JobRecord], revision: int) -> None:
    """The audit line of one transaction: every job it created, with its tenant and request id (in the same
    order), and the etcd revision that holds them. One line per transaction, not one per job."""
    log.info("scheduler.submitted", jobs=[r.id for r in created], tenants=[r.spec.tenant for r in created],
             request_ids=[r.request_id for r in created], revision=revision)


def _settle(fut: asyncio.Future[Outcome], outcome: Outcome | BaseException) -> None:
    if fut.done():  # the caller gave up meanwhile
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


class SubmitBatcher:
    """Group commit over ``repo`` (see the module docstring). Use from one event loop."""

    def __init__(self, repo: JobRepository, *, max_batch: int = MAX_BATCH, max_bytes: int = MAX_BYTES,
                 linger_s: float = LINGER_S) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be ≥ 1")
        if linger_s < 0:
            raise ValueError("linger_s must be ≥ 0")
        self.repo = repo
        self.max_batch = max_batch
        self.max_bytes = max_bytes
        self.linger_s = linger_s
        self._loaded = False  # the last transaction carried more than one submission
        self._queue: list[_Item] = []
        self._flusher: asyncio.Task[None] | None = None
        self.transactions = 0
        """Transactions committed or attempted (for tests and measurements)."""
        self.largest_batch = 0

    async def submit(self, spec: JobSpec, request_id: str, *, policy: str = "") -> Outcome:
        """Like :meth:`JobRepository.submit`: ``(stored job, created)``."""
        record = self.repo.new_record(spec, request_id, policy=policy)
        compares, puts = self.repo.submit_ops(record)
        loop = asyncio.get_running_loop()
        item = _Item(record=record, rkey=keys.request_key(request_id, spec.tenant), jkey=keys.job_key(record.id),
                     compares=compares, puts=puts, size=sum(len(p.key) + len(p.value) for p in puts),
                     fut=loop.create_future())
        self._queue.append(item)
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush_all())
        return await item.fut

    def _take(self) -> list[_Item]:
        """The next batch, in arrival order: no key twice, within the size bounds; the rest stays queued."""
        batch: list[_Item] = []
        rest: list[_Item] = []
        taken: set[str] = set()
        size = 0
        for it in self._queue:
            if it.fut.done():  # cancelled before its flush: never written
                continue
            fits = len(batch) < self.max_batch and (not batch or size + it.size <= self.max_bytes)
            if fits and it.rkey not in taken and it.jkey not in taken:
                batch.append(it)
                size += it.size
            else:
                rest.append(it)
            taken.update((it.rkey, it.jkey))  # a later item never overtakes an earlier one on a key
        self._queue = rest
        return batch

    async def _flush_all(self) -> None:
        try:
            while self._queue:
                if self._loaded and self.linger_s > 0 and len(self._queue) < self.max_batch:
                    await asyncio.sleep(self.linger_s)
                batch = self._take()
                self._loaded = len(batch) > 1
                if batch:
                    await self._commit(batch)
        except asyncio.CancelledError:
            err = UnavailableError("the scheduler is stopping; retry the submission")
            for it in self._queue:
                _settle(it.fut, err)
            self._queue = []
            raise

    async def _commit(self, batch: list[_Item]) -> None:
        live = batch
        self.largest_batch = max(self.largest_batch, len(batch))
        try:
            while live:
                compares = [c for it in live for c in it.compares]
                puts = [p for it in live for p in it.puts]
                self.transactions += 1
                try:
                    rev = await self.repo.store.commit(compares, puts, [])
                except CompareFailedError as e:
                    lost = [it for it in live if it.rkey in e.current or it.jkey in e.current] or live
                    live = [it for it in live if it not in lost]
                    await asyncio.gather(*(self._resolve(it) for it in lost))
                    continue
                for it in live:
                    _settle(it.fut, (self.repo.remember(StoredJob(record=it.record, mod_revision=rev)), True))
                _log_created([it.record for it in live], rev)
                return
        except asyncio.CancelledError:
            err = UnavailableError("the scheduler is stopping; retry the submission")
            for it in live:
                _settle(it.fut, err)
            raise
        except Exception as e:  # the store's error is every submission's answer
            for it in live:
                _settle(it.fut, e)

    async def _resolve(self, it: _Item) -> None:
        """A submission whose keys exist already: answered as :meth:`JobRepository.submit` answers a retry."""
        try:
            found = await self.repo.existing_submission(it.record)
            outcome: Outcome | BaseException = (found, False) if found is not None else \
                await self.repo.submit_record(it.record)  # the keys vanished meanwhile: write it now
            if not isinstance(outcome, BaseException) and outcome[1]:
                _log_created([it.record], outcome[0].mod_revision)
        except Exception as e:
            outcome = e
        _settle(it.fut, outcome)

    async def close(self) -> None:
        """Stop flushing; queued submissions fail with :class:`UnavailableError`."""
        task, self._flusher = self._flusher, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
