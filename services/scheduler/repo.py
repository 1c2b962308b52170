"""Jobs, allocations and assignments in etcd: every write of the scheduler goes through here.

Invariants (each write is one :meth:`~spiderflow.store.base.Store.commit`, so they hold at every
etcd revision, whichever replica wrote and whenever a process died):

1. A job record exists iff its request key exists (submission writes both, or neither).
2. A job holds GPUs (``allocations/<cluster>`` lists it) iff its record is PLACED or RUNNING, and then
   the record's ``allocation`` equals what the allocation keys list for it.
3. For every cluster, the GPUs listed in ``allocations/<cluster>`` never exceed what the topology offered
   when the bind was decided: binds compare every allocation key they change on the ``mod_revision``
   they read, so two concurrent binds can never both spend the same free GPU.
4. Every state change is a compare-and-swap on the job record's ``mod_revision`` (a lost race raises
   :class:`~spiderflow.store.base.CompareFailedError` and writes nothing).

5. A job's ``waits/<job>`` key (its wait for GPUs being released, written by the scheduler leader) is
   deleted in the transaction that binds the job; a wait of a job that is no longer queued is advisory
   and removed by the next leader cycle. The leader writes and deletes wait keys in transactions that
   compare its election key, so a deposed leader cannot change them after its successor adopted them.

Every value is a record of :mod:`spiderflow.store.records` (job records, request records, allocations
``{"<job>": gpus}``, assignments, waits) and every key is built by :mod:`spiderflow.store.keys`; a value that
does not decode raises :class:`~spiderflow.core.errors.CorruptRecordError` naming its key.

The scheduling cycle reads its state with :meth:`JobRepository.snapshot`: the jobs, the allocations and the
waits in one read at one etcd revision (:meth:`~spiderflow.store.base.Store.get_prefixes`), so it never sees
a bind's job record without the allocation keys the same transaction wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import structlog

from spiderflow.core.cycle import WaitState
from spiderflow.core.domain import JobSpec
from spiderflow.core.errors import AlreadyExistsError, CorruptRecordError, NotFoundError
from spiderflow.jobs import TERMINAL, JobRecord, JobState
from spiderflow.store import keys, records
from spiderflow.store.base import Compare, CompareFailedError, KeyValue, Put, Store, WatchEvent
from spiderflow.store.keys import REQUESTS, request_key

__all__ = ["REQUESTS", "JobRepository", "SchedulerState", "StoredJob", "request_key"]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredJob:
    """A job record with the etcd revision it was read at (the CAS token for its next write)."""

    record: JobRecord
    mod_revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerState:
    """What a scheduling cycle decides on, read at one etcd revision: every job (sorted by id), each cluster's
    allocation ``{job: gpus}`` with its ``mod_revision`` (the compare of a bind), and the recorded waits
    (``None`` for a wait record that does not decode: the leader deletes it)."""

    jobs: list[StoredJob]
    allocations: dict[str, dict[str, int]]
    allocation_revisions: dict[str, int]
    waits: dict[str, WaitState | None] = field(default_factory=dict)
    revision: int = 0


MAX_REMEMBERED = 200_000
"""Decoded records kept between two :meth:`JobRepository.list` calls at most (each list keeps only live keys)."""

MAX_TXN_RECORDS = 64
"""Job records written by one :meth:`JobRepository.update_many` transaction at most (a compare and a put each:
within etcd's default ``--max-txn-ops`` of 128)."""

SubmitOps = tuple[list[Compare], list[Put]]
"""The compares and puts of one submission's transaction."""


def _decode_alloc(kv: KeyValue | None) -> dict[str, int]:
    if kv is None:
        return {}
    return dict(records.decode_as(kv.key, kv.value, records.AllocationRecord).gpus)


def _encode_alloc(gpus: Mapping[str, int]) -> bytes:
    return records.encode(records.AllocationRecord(gpus=gpus))


def _decode_wait(kv: KeyValue) -> WaitState | None:
    try:
        return records.decode_as(kv.key, kv.value, WaitState)
    except CorruptRecordError as e:
        log.warning("scheduler.bad_wait_record", key=kv.key, field=e.field, error=e.reason)
        return None


def _merge_since(changed: Iterable[KeyValue], present: Mapping[str, int], known: Mapping[str, tuple[int, _T]],
                 read: Callable[[KeyValue], _T]) -> dict[str, tuple[int, _T]] | None:
    """Every key of ``present`` (key → ``mod_revision`` now) with its ``(mod_revision, value)``: ``read`` of
    the record when it is among ``changed`` (the records modified since an earlier read) at that revision,
    else ``known``'s entry at the same revision (a key at a ``mod_revision`` always holds the same record).
    ``None`` when a key is in neither (the caller reads everything)."""
    fresh = {kv.key: kv for kv in changed}
    out: dict[str, tuple[int, _T]] = {}
    for key, mod in present.items():
        kv = fresh.get(key)
        if kv is not None and kv.mod_revision == mod:
            out[key] = (mod, read(kv))
            continue
        old = known.get(key)
        if old is None or old[0] != mod:
            return None
        out[key] = old
    return out


class JobRepository:
    """Typed access to the scheduler's keys over a :class:`Store`. ``clock`` gives wall time (seconds)."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock
        self._decoded: dict[str, tuple[int, JobRecord]] = {}  # key -> (mod_revision, record): decode once
        # cluster -> (its allocation, mod_revision) as this process last wrote or read it (0: absent). Only
        # ever the expected value of a compare: a stale entry fails the compare and is read again.
        self._alloc_cache: dict[str, tuple[dict[str, int], int]] = {}
        self._alloc_locks: dict[str, asyncio.Lock] = {}
        self._snapshot_revision = 0  # the revision of the last snapshot (0: none yet)
        # key -> (mod_revision, state, tenant) of every job at the last count_by_tenant, and its revision
        self._counted: dict[str, tuple[int, tuple[JobState, str]]] = {}
        self._counted_revision = 0

    def remember(self, stored: StoredJob) -> StoredJob:
        """Note a record this process wrote at its revision, so :meth:`list` and :meth:`count_in` need not
        decode it (a key at a mod_revision always holds the same record). Returns ``stored``."""
        if len(self._decoded) < MAX_REMEMBERED:
            self._decoded[keys.job_key(stored.record.id)] = (stored.mod_revision, stored.record)
        return stored

    # -- reads ----------------------------------------------------------------------------------------

    async def get(self, job_id: str) -> StoredJob:
        kv = await self.store.get(keys.job_key(job_id))
        if kv is None:
            raise NotFoundError(f"job {job_id!r} not found")
        return StoredJob(record=self._record(kv), mod_revision=kv.mod_revision)

    def _record(self, kv: KeyValue) -> JobRecord:
        hit = self._decoded.get(kv.key)
        if hit is not None and hit[0] == kv.mod_revision:
            return hit[1]
        return records.decode_as(kv.key, kv.value, JobRecord)

    def _jobs(self, items: Iterable[KeyValue]) -> list[StoredJob]:
        out: list[StoredJob] = []
        decoded: dict[str, tuple[int, JobRecord]] = {}
        for kv in items:
            record = self._record(kv)
            decoded[kv.key] = (kv.mod_revision, record)
            out.append(StoredJob(record=record, mod_revision=kv.mod_revision))
        self._decoded = decoded  # records are immutable: a (key, mod_revision) always decodes the same
        return out

    def _jobs_since(self, changed: Iterable[KeyValue], present: Mapping[str, int]) -> list[StoredJob] | None:
        """Every job of a read that brought only the records modified since the previous snapshot
        (``changed``) and every key's ``mod_revision`` (``present``): the others are the records decoded
        before at the same revision. ``None`` when one of those is not at hand (the caller reads all)."""
        # a changed record is decoded (and validated) once, as every record read
        decoded = _merge_since(changed, present, self._decoded, self._record)
        if decoded is None:
            return None
        self._decoded = decoded
        return [StoredJob(record=record, mod_revision=mod) for mod, record in decoded.values()]

    async def list(self) -> tuple[list[StoredJob], int]:
        """Every job (sorted by id) and the revision of the read."""
        items, rev = await self.store.get_prefix(keys.JOBS)
        return self._jobs(items), rev

    async def snapshot(self) -> SchedulerState:
        """The jobs, the allocations and the waits in ONE read at ONE revision (:class:`SchedulerState`).

        After the first, a snapshot reads the values of the job records modified since the previous one only
        (and every job key's revision): the rest are the records this process decoded then, unchanged since
        (a key at a ``mod_revision`` always holds the same record). When one is not at hand, everything is
        read again. A cycle therefore costs etcd and this process little per job that did not change."""
        prefixes = (keys.JOBS, keys.ALLOCATIONS, keys.WAITS)
        jobs: list[StoredJob] | None = None
        if self._snapshot_revision:
            items, present, rev = await self.store.get_prefixes_changed(prefixes,
                                                                         {keys.JOBS: self._snapshot_revision})
            jobs = self._jobs_since(items.get(keys.JOBS, []), present[keys.JOBS])
        if jobs is None:
            items, rev = await self.store.get_prefixes(prefixes)
            jobs = self._jobs(items.get(keys.JOBS, []))
        self._snapshot_revision = rev
        allocs, revs = self._allocations(items.get(keys.ALLOCATIONS, []))
        waits = {keys.parse(kv.key).job: _decode_wait(kv) for kv in items.get(keys.WAITS, [])}
        return SchedulerState(jobs=jobs, allocations=allocs, allocation_revisions=revs, waits=waits, revision=rev)

    async def count_in(self, states: Iterable[JobState]) -> int:
        """How many jobs are in one of ``states`` (reads only each record's state: cheap at 10^4 jobs)."""
        wanted = {s.value for s in states}
        items, _ = await self.store.get_prefix(keys.JOBS)
        n = 0
        for kv in items:
            hit = self._decoded.get(kv.key)  # records decoded by list() at the same revision: no JSON parse
            state = hit[1].state.value if hit is not None and hit[0] == kv.mod_revision else \
                records.job_state_and_tenant(kv.key, kv.value)[0].value
            n += state in wanted
        return n

    async def count_by_tenant(self, states: Iterable[JobState]) -> dict[str, int]:
        """How many jobs of each tenant are in one of ``states`` (tenants with none are absent).

        After the first, a count reads the values of the job records modified since the previous count only
        (and every job key's revision); every other job keeps the state and tenant read then (a key at a
        ``mod_revision`` always holds the same record). A count therefore costs etcd and this process little
        per job that did not change, however many jobs are kept."""
        wanted = set(states)
        counted: dict[str, tuple[int, tuple[JobState, str]]] | None = None
        if self._counted_revision:
            items, present, rev = await self.store.get_prefixes_changed((keys.JOBS,),
                                                                        {keys.JOBS: self._counted_revision})
            counted = _merge_since(items.get(keys.JOBS, []), present[keys.JOBS], self._counted,
                                   self._state_and_tenant)
        if counted is None:
            everything, rev = await self.store.get_prefix(keys.JOBS)
            counted = {kv.key: (kv.mod_revision, self._state_and_tenant(kv)) for kv in everything}
        self._counted, self._counted_revision = counted, rev
        out: dict[str, int] = {}
        for _, (state, tenant) in counted.values():
            if state in wanted:
                out[tenant] = out.get(tenant, 0) + 1
        return out

    def _state_and_tenant(self, kv: KeyValue) -> tuple[JobState, str]:
        hit = self._decoded.get(kv.key)
        if hit is not None and hit[0] == kv.mod_revision:
            return hit[1].state, hit[1].spec.tenant
        return records.job_state_and_tenant(kv.key, kv.value)

    async def allocations(self) -> tuple[dict[str, dict[str, int]], dict[str, int], int]:
        """``(cluster → {job → gpus}, cluster → mod_revision, revision)``."""
        items, rev = await self.store.get_prefix(keys.ALLOCATIONS)
        allocs, revs = self._allocations(items)
        return allocs, revs, rev

    def _allocations(self, items: Iterable[KeyValue]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        allocs: dict[str, dict[str, int]] = {}
        revs: dict[str, int] = {}
        for kv in items:
            name = keys.parse(kv.key).cluster
            allocs[name] = _decode_alloc(kv)
            revs[name] = kv.mod_revision
        self._alloc_cache = {c: (dict(a), revs[c]) for c, a in allocs.items()}
        return allocs, revs

    async def allocation(self, cluster: str) -> tuple[dict[str, int], int]:
        """``({job: gpus}, mod_revision)`` of one cluster's allocation key (``({}, 0)`` when absent)."""
        current, mod = await self._read_allocation(cluster)
        return dict(current), mod

    def watch(self, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        return self.store.watch_prefix(keys.JOBS, start_revision=start_revision)

    # -- writes ---------------------------------------------------------------------------------------

    def new_record(self, spec: JobSpec, request_id: str, *, policy: str = "") -> JobRecord:
        """The PENDING record a submission writes (validates ``request_id`` first)."""
        request_key(request_id, spec.tenant)
        record = JobRecord.new(spec, request_id=request_id, now=self.clock())
        return replace(record, policy=policy) if policy else record  # the default policy: no second record

    @staticmethod
    def submit_ops(record: JobRecord) -> SubmitOps:
        """The compares and puts of creating ``record``: its request key and job key must both be absent,
        and both are written (invariant 1)."""
        rkey = request_key(record.request_id, record.spec.tenant)
        jkey = keys.job_key(record.id)
        return ([Compare(key=rkey, mod_revision=0), Compare(key=jkey, mod_revision=0)],
                [Put(key=rkey, value=records.encode(records.RequestRecord(job=record.id))),
                 Put(key=jkey, value=records.encode(record))])

    async def submit(self, spec: JobSpec, request_id: str, *, policy: str = "") -> tuple[StoredJob, bool]:
        """Create the job, or return the one this ``request_id`` created before (``created`` False).

        A job id already taken by a *different* request raises :class:`AlreadyExistsError`.
        """
        return await self.submit_record(self.new_record(spec, request_id, policy=policy))

    async def submit_record(self, record: JobRecord) -> tuple[StoredJob, bool]:
        """:meth:`submit` of a record made by :meth:`new_record`."""
        compares, puts = self.submit_ops(record)
        for _ in range(3):
            try:
                rev = await self.store.commit(compares, puts, [])
                return self.remember(StoredJob(record=record, mod_revision=rev)), True
            except CompareFailedError:
                pass
            found = await self.existing_submission(record)
            if found is not None:
                return found, False
        raise AlreadyExistsError(f"job id {record.id!r} could not be created (concurrent submissions)")

    async def existing_submission(self, record: JobRecord) -> StoredJob | None:
        """After creating ``record`` lost a compare: the job its request id created before (same spec), or
        :class:`AlreadyExistsError` when the request id was used for another job or spec, or the job id is
        taken by another request. ``None`` when neither key exists (any more): the caller may retry."""
        existing = await self.store.get(request_key(record.request_id, record.spec.tenant))
        if existing is not None:
            job_id = records.decode_as(existing.key, existing.value, records.RequestRecord).job
            stored = await self.get(job_id)
            if job_id != record.id or stored.record.spec != record.spec:
                raise AlreadyExistsError(f"request_id {record.request_id!r} was already used for job {job_id!r} "
                                         "with a different spec")
            return stored
        if await self.store.get(keys.job_key(record.id)) is not None:
            raise AlreadyExistsError(f"job id {record.id!r} is already taken by another request")
        return None

    async def update(self, stored: StoredJob, new: JobRecord) -> StoredJob:
        """CAS-write a record that holds no GPUs before and after (reason or progress updates)."""
        rev = await self.store.compare_and_swap(keys.job_key(new.id), records.encode(new), stored.mod_revision)
        return self.remember(StoredJob(record=new, mod_revision=rev))

    async def update_many(self, updates: Sequence[tuple[StoredJob, JobRecord]]) -> tuple[StoredJob, ...]:
        """:meth:`update` of several records in as few transactions as etcd takes (:data:`MAX_TXN_RECORDS`
        records each, every record compared on its own ``mod_revision``: invariant 4). Best effort per
        record: one that changed since it was read is left out (its compare failed) and the others are
        written in a retry of the transaction. Returns the records written."""
        written: list[StoredJob] = []
        for i in range(0, len(updates), MAX_TXN_RECORDS):
            chunk = updates[i:i + MAX_TXN_RECORDS]
            live = [(keys.job_key(new.id), old, new, records.encode(new)) for old, new in chunk]
            while live:
                try:
                    rev = await self.store.commit([Compare(key=k, mod_revision=o.mod_revision) for k, o, _, _ in live],
                                                  [Put(key=k, value=v) for k, _, _, v in live])
                except CompareFailedError as e:
                    kept = [item for item in live if item[0] not in e.current]
                    if len(kept) == len(live):  # the store did not say which record changed: give up these
                        break
                    live = kept
                    continue
                written.extend(self.remember(StoredJob(record=new, mod_revision=rev)) for _, _, new, _ in live)
                break
        return tuple(written)

    async def bind(
        self,
        stored: StoredJob,
        placed: JobRecord,
        allocation_revisions: Mapping[str, int],
        current_allocations: Mapping[str, Mapping[str, int]],
    ) -> StoredJob:
        """Bind a placement atomically: job record (→ PLACED), the allocation keys of its clusters, and one
        assignment per cluster for its agent. Every key changed is compared on the revision read."""
        assert placed.plan is not None
        compares = [Compare(key=keys.job_key(placed.id), mod_revision=stored.mod_revision)]
        puts = [Put(key=keys.job_key(placed.id), value=records.encode(placed))]
        for cluster, gpus in placed.allocation.items():
            akey = keys.allocation_key(cluster)
            compares.append(Compare(key=akey, mod_revision=allocation_revisions.get(cluster, 0)))
            updated = {**current_allocations.get(cluster, {}), placed.id: gpus}
            puts.append(Put(key=akey, value=_encode_alloc(updated)))
            puts.append(Put(key=keys.assignment_key(cluster, placed.id),
                            value=records.encode(records.Assignment.of(placed, cluster))))
        try:
            rev = await self.store.commit(compares, puts, [keys.wait_key(placed.id)])
        except CompareFailedError:
            for cluster in placed.allocation:
                self._alloc_cache.pop(cluster, None)
            raise
        for cluster, gpus in placed.allocation.items():
            self._alloc_cache[cluster] = ({**current_allocations.get(cluster, {}), placed.id: gpus}, rev)
        return self.remember(StoredJob(record=placed, mod_revision=rev))

    async def release(self, stored: StoredJob, new: JobRecord) -> StoredJob:
        """Write ``new`` (a state that holds no GPUs) and return the GPUs ``stored`` held, atomically.

        Compares the allocation keys of the job's clusters on the revision this process last wrote or read
        them at (read from etcd when unknown), retrying on a concurrent change of an allocation key with a
        fresh read (never on a change of the job record itself: that conflict is the caller's). Releases in
        this process on the same cluster take turns (one lock per cluster, taken in name order), so jobs
        ending together on a cluster do not race each other for its key."""
        held = sorted(stored.record.allocation)
        async with contextlib.AsyncExitStack() as stack:
            for cluster in held:
                await stack.enter_async_context(self._alloc_lock(cluster))
            for _ in range(20):
                compares = [Compare(key=keys.job_key(new.id), mod_revision=stored.mod_revision)]
                puts = [Put(key=keys.job_key(new.id), value=records.encode(new))]
                # the attempt's rendezvous goes with it (its agents may no longer touch it once unassigned)
                deletes: list[str] = [keys.rendezvous_key(new.id, stored.record.attempt)]
                after: dict[str, tuple[dict[str, int], int]] = {}
                for cluster in held:
                    akey = keys.allocation_key(cluster)
                    known = self._alloc_cache.get(cluster)
                    current, mod = known if known is not None else await self._read_allocation(cluster)
                    compares.append(Compare(key=akey, mod_revision=mod))
                    alloc = {j: g for j, g in current.items() if j != new.id}
                    if alloc:
                        puts.append(Put(key=akey, value=_encode_alloc(alloc)))
                    elif mod:
                        deletes.append(akey)
                    after[cluster] = (alloc, mod)
                    deletes.append(keys.assignment_key(cluster, new.id))
                try:
                    rev = await self.store.commit(compares, puts, deletes)
                except CompareFailedError as e:
                    for cluster in held:
                        self._alloc_cache.pop(cluster, None)  # read again
                    if keys.job_key(new.id) in e.current:
                        raise
                    continue
                for cluster, (alloc, _) in after.items():
                    self._alloc_cache[cluster] = (alloc, rev if alloc else 0)  # deleted or still absent
                return self.remember(StoredJob(record=new, mod_revision=rev))
        raise CompareFailedError({keys.ALLOCATIONS: 0})

    async def waits(self) -> dict[str, WaitState | None]:
        """Every recorded wait, by job id (``None`` for a record that does not decode, logged with its key,
        so the caller can drop it)."""
        kvs, _ = await self.store.get_prefix(keys.WAITS)
        return {keys.parse(kv.key).job: _decode_wait(kv) for kv in kvs}

    async def put_wait(self, job_id: str, wait: WaitState, *, guard: Compare | None = None) -> None:
        """Record queued job ``job_id``'s wait for GPUs being released (one transaction). With ``guard``
        (the leader key's compare) nothing is written unless it holds: :class:`CompareFailedError`."""
        await self.store.commit([guard] if guard else [],
                                [Put(key=keys.wait_key(job_id), value=records.encode(wait))], [])

    async def delete_wait(self, job_id: str, *, guard: Compare | None = None) -> None:
        """Forget ``job_id``'s wait (absent already is fine); ``guard`` as in :meth:`put_wait`."""
        await self.store.commit([guard] if guard else [], [], [keys.wait_key(job_id)])

    def known_allocation(self, cluster: str) -> tuple[dict[str, int], int] | None:
        """``({job: gpus}, mod_revision)`` of a cluster's allocation key as this process last wrote or read it
        (no round trip; may be stale when another replica wrote since: use it only as a compare's expected
        value). ``None`` when unknown."""
        known = self._alloc_cache.get(cluster)
        return (dict(known[0]), known[1]) if known is not None else None

    def _alloc_lock(self, cluster: str) -> asyncio.Lock:
        lock = self._alloc_locks.get(cluster)
        if lock is None:
            lock = self._alloc_locks[cluster] = asyncio.Lock()
        return lock

    async def _read_allocation(self, cluster: str) -> tuple[dict[str, int], int]:
        kv = await self.store.get(keys.allocation_key(cluster))
        out = _decode_alloc(kv), kv.mod_revision if kv is not None else 0
        self._alloc_cache[cluster] = out
        return out

    async def transition(self, stored: StoredJob, new: JobRecord) -> StoredJob:
        """Apply a state change, releasing GPUs when ``new`` no longer holds them."""
        if stored.record.allocation and not new.allocation:
            return await self.release(stored, new)
        return await self.update(stored, new)


def holding(records: Iterable[JobRecord]) -> dict[str, int]:
    """GPUs held per cluster by ``records`` (PLACED/RUNNING)."""
    out: dict[str, int] = {}
    for r in records:
        if r.state in (JobState.PLACED, JobState.RUNNING) and r.state not in TERMINAL:
            for c, g in r.allocation.items():
                out[c] = out.get(c, 0) + g
    return out
