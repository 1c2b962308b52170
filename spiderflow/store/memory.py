"""In-memory :class:`~spiderflow.store.base.Store` for unit tests: same contract as etcd, one process.

State lives in the instance and is shared by everything holding it, inside one event loop. Revisions,
lease expiry (a timer per lease, exact TTL, no server-side floor), watches with history replay and
compaction, and leader election follow the contract in :mod:`spiderflow.store.base`. History is kept
until :meth:`MemoryStore.compact`.

Fault injection for callers' tests: :meth:`MemoryStore.set_available` ``(False)`` makes every request
(and so every lease keep-alive) raise :class:`~spiderflow.core.errors.UnavailableError` while the "server"
side keeps running: leases expire, established watches keep delivering.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

import structlog

from spiderflow.core.errors import ConflictError, NotFoundError, UnavailableError, ValidationError
from spiderflow.store.base import (
    CompactedError,
    Compare,
    CompareFailedError,
    EventType,
    KeyValue,
    LeaderInfo,
    Leadership,
    Lease,
    LeaseLike,
    LostCallback,
    NotLeaderError,
    Observation,
    Put,
    Store,
    Watch,
    WatchEvent,
    election_key,
    election_prefix,
    lease_id,
    validate_commit,
)

__all__ = ["MemoryStore", "PrefixObservation"]

_log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _LeaseRecord:
    ttl: int
    keys: set[str] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


class _MemoryLease(Lease):
    def __init__(self, store: MemoryStore, *, lease_id: int, ttl: int) -> None:
        super().__init__(lease_id=lease_id, ttl=ttl, request_timeout=store.request_timeout)
        self._store = store

    async def _refresh_once(self) -> int:
        return self._store._refresh(self.id)

    async def _revoke_once(self) -> None:
        self._store._check()
        if not self._store._revoke(self.id):
            raise NotFoundError(f"lease {self.id:x} not found")


class _MemoryWatch(Watch):
    def __init__(self, store: MemoryStore, prefix: str, start_revision: int | None) -> None:
        self._store = store
        self._prefix = prefix
        self._start_revision = start_revision
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._started = False
        self._closed = False
        self._last = (start_revision - 1) if start_revision is not None else 0

    @property
    def revision(self) -> int:
        return self._last

    def _matches(self, key: str) -> bool:
        return key.startswith(self._prefix)

    def _push(self, event: WatchEvent) -> None:
        if not self._closed and self._matches(event.key):
            self._queue.put_nowait(event)

    async def start(self) -> Self:
        if self._started or self._closed:
            return self
        store = self._store
        store._check()
        start = store._rev + 1 if self._start_revision is None else self._start_revision
        if start < store._compact_rev:
            raise CompactedError(store._compact_rev, start)
        self._last = start - 1
        self._started = True
        for rev, events in store._history:
            if rev >= start:
                for ev in events:
                    self._push(ev)
        store._watchers.add(self)
        return self

    async def __anext__(self) -> WatchEvent:
        if not self._started:
            await self.start()
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:
            raise StopAsyncIteration
        self._last = event.mod_revision
        return event

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._store._watchers.discard(self)
            self._queue.put_nowait(None)


class PrefixObservation(Observation):
    """Leader observation built from ``get_prefix`` + ``watch_prefix`` on any store (the leader is the
    key with the lowest ``create_revision`` under the election prefix)."""

    def __init__(self, store: Store, name: str) -> None:
        self._store = store
        self._name = name
        self._prefix = election_prefix(name)
        self._keys: dict[str, KeyValue] = {}
        self._watch: Watch | None = None
        self._last: tuple[str, int] | None = None
        self._closed = False

    def _leader(self) -> LeaderInfo | None:
        if not self._keys:
            return None
        kv = min(self._keys.values(), key=lambda k: k.create_revision)
        return LeaderInfo(
            name=self._name,
            key=kv.key,
            value=kv.value,
            lease=kv.lease,
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
        )

    def _fresh(self) -> LeaderInfo | None:
        info = self._leader()
        if info is None or (info.key, info.mod_revision) == self._last:
            return None
        self._last = (info.key, info.mod_revision)
        return info

    async def __anext__(self) -> LeaderInfo:
        if self._closed:
            raise StopAsyncIteration
        if self._watch is None:
            items, rev = await self._store.get_prefix(self._prefix)
            self._keys = {kv.key: kv for kv in items}
            self._watch = await self._store.watch_prefix(self._prefix, start_revision=rev + 1).start()
            info = self._fresh()
            if info is not None:
                return info
        async for ev in self._watch:
            if ev.type is EventType.DELETE:
                self._keys.pop(ev.key, None)
            else:
                self._keys[ev.key] = KeyValue(
                    key=ev.key,
                    value=ev.value,
                    create_revision=ev.create_revision,
                    mod_revision=ev.mod_revision,
                    version=0,
                    lease=ev.lease,
                )
            info = self._fresh()
            if info is not None:
                return info
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._closed = True
        if self._watch is not None:
            await self._watch.aclose()


@dataclass(kw_only=True, eq=False)
class _MemoryLeadership(Leadership):
    store: MemoryStore

    async def proclaim(self, value: bytes) -> None:
        self.store._check()
        kv = self.store._data.get(self.key)
        if self.lost.is_set() or kv is None or kv.create_revision != self.revision:
            raise NotLeaderError(f"not leader of {self.name}")
        self.store._apply([Put(key=self.key, value=bytes(value), lease=self.lease.id)], [])
        self.value = bytes(value)

    async def resign(self) -> None:
        if self.lost.is_set():
            return
        self.store._check()
        self.lost.set()
        self.store._leaderships.discard(self)
        kv = self.store._data.get(self.key)
        if kv is not None and kv.create_revision == self.revision:
            self.store._apply([], [self.key])


class MemoryStore(Store):
    """The contract of :mod:`spiderflow.store.base`, in memory. ``request_timeout`` only bounds
    keep-alive waits (requests complete at once); ``max_txn_ops`` mirrors etcd's ``--max-txn-ops``."""

    def __init__(self, *, request_timeout: float = 5.0, max_txn_ops: int = 1024) -> None:
        self.request_timeout = request_timeout
        self.max_txn_ops = max_txn_ops
        self._data: dict[str, KeyValue] = {}
        self._rev = 1
        self._compact_rev = 0
        self._history: list[tuple[int, list[WatchEvent]]] = []
        self._watchers: set[_MemoryWatch] = set()
        self._leases: dict[int, _LeaseRecord] = {}
        self._client_leases: set[_MemoryLease] = set()
        self._leaderships: set[_MemoryLeadership] = set()
        self._lease_ids = itertools.count(0x694D0000_00000001)
        self._changed = asyncio.Event()
        self._available = True
        self._closed = False

    # -- fault injection ----------------------------------------------------------------------------

    def set_available(self, available: bool) -> None:
        """Make requests fail with UnavailableError (False) or succeed again (True)."""
        self._available = available

    def _check(self) -> None:
        if self._closed:
            raise UnavailableError("store is closed")
        if not self._available:
            raise UnavailableError("store unavailable (injected)")

    # -- the write path -----------------------------------------------------------------------------

    def _apply(self, puts: Sequence[Put], deletes: Sequence[str]) -> int:
        for p in puts:
            lid = lease_id(p.lease)
            if lid and lid not in self._leases:
                raise NotFoundError(f"lease {lid:x} not found")
        deleting = [k for k in deletes if k in self._data]
        if not puts and not deleting:
            return self._rev
        rev = self._rev + 1
        events: list[WatchEvent] = []
        for p in puts:
            prev = self._data.get(p.key)
            lid = lease_id(p.lease)
            if prev is not None and prev.lease and prev.lease in self._leases:
                self._leases[prev.lease].keys.discard(p.key)
            kv = KeyValue(
                key=p.key,
                value=bytes(p.value),
                create_revision=prev.create_revision if prev is not None else rev,
                mod_revision=rev,
                version=prev.version + 1 if prev is not None else 1,
                lease=lid,
            )
            self._data[p.key] = kv
            if lid:
                self._leases[lid].keys.add(p.key)
            events.append(
                WatchEvent(
                    type=EventType.PUT,
                    key=p.key,
                    value=kv.value,
                    mod_revision=rev,
                    create_revision=kv.create_revision,
                    lease=lid,
                    prev_value=prev.value if prev is not None else None,
                )
            )
        for key in deleting:
            prev = self._data.pop(key)
            if prev.lease and prev.lease in self._leases:
                self._leases[prev.lease].keys.discard(key)
            events.append(
                WatchEvent(type=EventType.DELETE, key=key, value=b"", mod_revision=rev, prev_value=prev.value)
            )
        self._rev = rev
        self._history.append((rev, events))
        for w in list(self._watchers):
            for ev in events:
                w._push(ev)
        deleted = set(deleting)
        for ld in list(self._leaderships):
            if ld.key in deleted:
                ld.lost.set()
                self._leaderships.discard(ld)
        self._changed.set()
        self._changed = asyncio.Event()
        return rev

    # -- leases (server side) -----------------------------------------------------------------------

    def _arm(self, lid: int) -> None:
        rec = self._leases[lid]
        if rec.timer is not None:
            rec.timer.cancel()
        rec.timer = asyncio.get_running_loop().call_later(rec.ttl, self._expire, lid)

    def _expire(self, lid: int) -> None:
        if self._revoke(lid):
            _log.info("store.lease_expired", lease=lid)

    def _revoke(self, lid: int) -> bool:
        rec = self._leases.pop(lid, None)
        if rec is None:
            return False
        if rec.timer is not None:
            rec.timer.cancel()
        self._apply([], sorted(rec.keys))
        return True

    def _refresh(self, lid: int) -> int:
        self._check()
        if lid not in self._leases:
            return 0
        self._arm(lid)
        return self._leases[lid].ttl

    # -- Store --------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        self._check()
        return self._data.get(key)

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        self._check()
        items = sorted((kv for k, kv in self._data.items() if k.startswith(prefix)), key=lambda kv: kv.key)
        return items, self._rev

    async def get_prefixes(self, prefixes: Sequence[str]) -> tuple[dict[str, list[KeyValue]], int]:
        self._check()
        out = {p: sorted((kv for k, kv in self._data.items() if k.startswith(p)), key=lambda kv: kv.key)
               for p in prefixes}
        return out, self._rev

    async def revision(self) -> int:
        self._check()
        return self._rev

    async def put(self, key: str, value: bytes, *, lease: LeaseLike = None) -> int:
        self._check()
        return self._apply([Put(key=key, value=value, lease=lease)], [])

    async def delete(self, key: str) -> bool:
        self._check()
        existed = key in self._data
        self._apply([], [key])
        return existed

    async def delete_prefix(self, prefix: str) -> int:
        self._check()
        keys = sorted(k for k in self._data if k.startswith(prefix))
        self._apply([], keys)
        return len(keys)

    async def commit(
        self, compares: Sequence[Compare], puts: Sequence[Put] = (), deletes: Sequence[str] = (), *,
        delete_prefixes: Sequence[str] = (),
    ) -> int:
        validate_commit(compares, puts, deletes, max_ops=self.max_txn_ops, delete_prefixes=delete_prefixes)
        self._check()
        failed: dict[str, int] = {}
        for c in compares:
            kv = self._data.get(c.key)
            current = kv.mod_revision if kv is not None else 0
            if current != c.mod_revision:
                failed[c.key] = current
        if failed:
            raise CompareFailedError(failed)
        if delete_prefixes:
            under = {k for k in self._data if any(k.startswith(p) for p in delete_prefixes)}
            deletes = list(deletes) + sorted(under - set(deletes))
        return self._apply(puts, deletes)

    async def compact(self, revision: int) -> None:
        self._check()
        if revision > self._rev:
            raise ValidationError("revision", f"is in the future (current {self._rev})", revision)
        if revision <= self._compact_rev:
            raise CompactedError(self._compact_rev, revision)
        self._compact_rev = revision
        self._history = [(r, evs) for r, evs in self._history if r >= revision]

    async def grant(
        self, ttl: int, *, keepalive: bool = True, on_lost: LostCallback | None = None
    ) -> Lease:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValidationError("ttl", "must be an integer number of seconds ≥ 1", ttl)
        self._check()
        lid = next(self._lease_ids)
        self._leases[lid] = _LeaseRecord(ttl=ttl)
        self._arm(lid)
        lease = _MemoryLease(self, lease_id=lid, ttl=ttl)
        if on_lost is not None:
            lease.add_lost_callback(on_lost)
        lease._start(keepalive=keepalive)
        self._client_leases.add(lease)
        return lease

    async def refresh_lease(self, lease: int) -> int:
        return self._refresh(lease)

    async def revoke_lease(self, lease: int) -> bool:
        self._check()
        return self._revoke(lease)

    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        if start_revision is not None and start_revision < 1:
            raise ValidationError("start_revision", "must be ≥ 1", start_revision)
        return _MemoryWatch(self, prefix, start_revision)

    async def campaign(self, name: str, value: bytes, lease: Lease) -> Leadership:
        self._check()
        if lease.id not in self._leases:
            raise NotFoundError(f"lease {lease.id:x} not found")
        key = election_key(name, lease.id)
        kv = self._data.get(key)
        if kv is None or kv.value != value:
            self._apply([Put(key=key, value=bytes(value), lease=lease.id)], [])
        mine = self._data[key]
        prefix = election_prefix(name)
        try:
            while True:
                kv = self._data.get(key)
                if kv is None or kv.create_revision != mine.create_revision or not lease.alive:
                    raise ConflictError(f"lease {lease.id:x} lost while campaigning for {name}")
                if not any(
                    k.startswith(prefix) and o.create_revision < mine.create_revision
                    for k, o in self._data.items()
                ):
                    break
                changed = asyncio.ensure_future(self._changed.wait())
                lost = asyncio.ensure_future(lease.lost.wait())
                try:
                    await asyncio.wait({changed, lost}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                    lost.cancel()
        except BaseException:
            cur = self._data.get(key)
            if cur is not None and cur.create_revision == mine.create_revision:
                self._apply([], [key])
            raise
        leadership = _MemoryLeadership(
            name=name, key=key, revision=mine.create_revision, lease=lease, value=kv.value, store=self
        )
        self._leaderships.add(leadership)
        lease.add_lost_callback(lambda _l: leadership.lost.set())
        _log.info("store.elected", election=name, key=key, lease=lease.id)
        return leadership

    async def leader(self, name: str) -> LeaderInfo | None:
        self._check()
        prefix = election_prefix(name)
        owners = [kv for k, kv in self._data.items() if k.startswith(prefix)]
        if not owners:
            return None
        kv = min(owners, key=lambda o: o.create_revision)
        return LeaderInfo(
            name=name,
            key=kv.key,
            value=kv.value,
            lease=kv.lease,
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
        )

    def observe(self, name: str) -> Observation:
        return PrefixObservation(self, name)

    async def close(self) -> None:
        if self._closed:
            return
        for lease in list(self._client_leases):
            lease._stop()
        for w in list(self._watchers):
            await w.aclose()
        for rec in self._leases.values():
            if rec.timer is not None:
                rec.timer.cancel()
        self._closed = True
