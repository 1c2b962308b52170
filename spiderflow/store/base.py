"""The Store: SpiderFlow's one door to etcd. This docstring is the contract.

Every service keeps its state in a :class:`Store` and nowhere else. Two implementations pass the same
contract tests (``tests/store/test_store_contract.py``): :class:`~spiderflow.store.etcd.EtcdStore` over a real
etcd, and :class:`~spiderflow.store.memory.MemoryStore` for unit tests. Key names come from
:mod:`spiderflow.store.keys`.

Data model
----------
Keys are ``str`` (stored as UTF-8), values are ``bytes``. The store has one global **revision**, a
counter that every successful write (put, delete, commit, lease expiry) increments by exactly one,
however many keys it touched. Each :class:`KeyValue` carries ``create_revision`` (the revision that
created it since it was last absent), ``mod_revision`` (the revision of its last change), ``version``
(number of changes since creation) and ``lease`` (0 when none). A key that does not exist has
``mod_revision`` 0 for the purpose of every comparison below.

Operations (all ``async``; all may raise :class:`~spiderflow.core.errors.UnavailableError`)
----------------------------------------------------------------------------------------
- ``get(key)`` → :class:`KeyValue` or ``None``.
- ``get_prefix(prefix)`` → ``(items sorted by key, revision of the read)``. The revision is the
  point in history the list reflects: ``watch_prefix(prefix, start_revision=rev + 1)`` continues it
  with no gap and no duplicate (list-then-watch).
- ``get_prefixes(prefixes)`` → ``({prefix: items sorted by key}, revision)``: several prefixes read
  atomically at one revision (one consistent snapshot, e.g. clusters + profiles + links).
- ``get_prefixes_changed(prefixes, changed_after)``: the same read, with values only of the keys modified
  after a given revision under the prefixes named (and every key's ``mod_revision``).
- ``revision()`` → the current revision.
- ``put(key, value, lease=None)`` → revision of the write.
- ``put_if_absent(key, value, lease=None)`` → revision; raises
  :class:`~spiderflow.core.errors.AlreadyExistsError` if the key exists.
- ``compare_and_swap(key, value, expected_mod_revision, lease=None)`` → new revision; writes only if
  the key's ``mod_revision`` equals ``expected_mod_revision`` (``0`` = the key must be absent), else
  raises :class:`CompareFailedError` (a :class:`~spiderflow.core.errors.ConflictError`).
- ``delete(key)`` → ``True`` if it existed. ``delete_if(key, mod_revision)`` → revision of the delete;
  raises :class:`CompareFailedError` unless the key exists with exactly that ``mod_revision``.
  ``delete_prefix(prefix)`` → number of keys deleted.
- ``commit(compares, puts, deletes)``: one atomic transaction. If every :class:`Compare` holds
  (``mod_revision`` equality, ``0`` = absent), all puts and deletes are applied at one new revision
  and that revision is returned; otherwise nothing is written and :class:`CompareFailedError` names
  the failed keys and their current ``mod_revision``. A key may appear at most once among puts and
  deletes (:class:`~spiderflow.core.errors.ValidationError` otherwise). ``delete_prefixes`` deletes every key
  under each (non-empty) prefix in the same transaction, whatever their number (one operation each). With
  no puts and no deletes the
  current revision is returned (a consistent multi-key check). Size limits are the server's: etcd
  refuses more than ``--max-txn-ops`` compares, or puts + deletes (128 by default, 1024 in
  :class:`~spiderflow.store.process.EtcdProcess` and :class:`~spiderflow.store.memory.MemoryStore`),
  and requests over ``--max-request-bytes`` (1.5 MiB); both raise
  :class:`~spiderflow.core.errors.ValidationError`.
- ``compact(revision)``: discard history before ``revision``; later watches from an earlier revision
  raise :class:`CompactedError`.

Leases
------
``grant(ttl, keepalive=True, on_lost=None)`` → :class:`Lease`. ``refresh_lease(id)`` (→ the TTL granted, 0
when expired) and ``revoke_lease(id)`` (→ False when expired) act on a lease by id, for a lease kept alive
by someone else through the control plane. ``ttl`` is in whole seconds (≥ 1);
the server may round it up (etcd's floor is ``ceil(1.5 × election timeout)``, 1 s with
``--election-timeout 100``, 2 s with the default 1000) and ``Lease.ttl`` holds the granted value.
Keys put with a lease are deleted, at one new revision, when the lease expires or is revoked
(etcd checks expiry every 0.5 s, so removal happens within ``ttl + 0.5`` s after the last refresh).
With ``keepalive`` a managed task refreshes the lease every ``ttl / 3`` s. The lease is **lost** when
a refresh is not acknowledged before ``ttl`` has passed since the last acknowledged one, or the server
reports it expired; without ``keepalive`` it is lost ``ttl`` after the grant (or after the last
manual :meth:`Lease.refresh`). On loss, once: the keep-alive stops, :attr:`Lease.lost` is set and
every ``on_lost`` callback runs (synchronously, in the event loop; exceptions are logged). A lost
lease is never revived: grant a new one and re-register. :meth:`Lease.revoke` ends the lease on the
server (its keys go at once); it does not fire the callbacks, and revoking an expired lease is a no-op.

Watches
-------
``watch_prefix(prefix, start_revision=None)`` → :class:`Watch`, an async iterator of
:class:`WatchEvent` (PUT or DELETE, key, value, ``mod_revision`` = revision of the change,
``prev_value`` when the server had it). Events come in revision order, every event with revision ≥
``start_revision`` exactly once; events of one transaction share a revision and arrive together.
``start_revision=None`` means "changes after the revision current when the watch is established"
(at ``async with``, :meth:`Watch.start` or the first ``__anext__``). A start revision that has been
compacted raises :class:`CompactedError` (on start or iteration). The watch survives server
restarts and connection loss: it re-establishes itself from the last delivered revision + 1 and
only raises :class:`~spiderflow.core.errors.UnavailableError` after failing to reconnect for the store's
``stream_retry_s``. :meth:`Watch.aclose` (or leaving ``async with``) releases it.

Leader election
---------------
Through etcd's Election API (``v3electionpb.Election``); the in-memory store implements the same
semantics. A campaigner for election ``name`` owns the key ``name + "/" + hex(lease id)``, attached to
its lease; the leader is the owner of the key with the lowest ``create_revision``.

- ``campaign(name, value, lease)`` blocks until this campaigner is leader and returns a
  :class:`Leadership`. If the lease is lost while waiting it raises
  :class:`~spiderflow.core.errors.ConflictError`; cancelling the call withdraws the candidacy.
- ``leader(name)`` → :class:`LeaderInfo` of the current leader, or ``None``.
- ``observe(name)`` → async iterator of :class:`LeaderInfo`: the current leader (once there is one),
  then each new proclamation and each new leader; no duplicates. Closed with ``aclose()``.
- :class:`Leadership`: ``lost`` is set when the leader key disappears (lease revoked or expired,
  key deleted) or the lease is lost; ``proclaim(value)`` updates the leader value (raises
  :class:`NotLeaderError` once leadership is gone); ``resign()`` gives it up so the next campaigner
  takes over at once. Leadership ends with the lease: revoking the leader's lease makes the next
  campaigner leader.

Errors
------
- Connection failures and deadlines (each request is bounded by the store's ``request_timeout``) →
  :class:`~spiderflow.core.errors.UnavailableError`. A write that raised it has an **unknown outcome**:
  the server may still apply it (e.g. a request buffered by a suspended etcd); re-read, or guard the
  write with a compare, before retrying.
- Lost compare → :class:`CompareFailedError`; ``put_if_absent`` on a present key →
  :class:`~spiderflow.core.errors.AlreadyExistsError`.
- Putting with an unknown or expired lease → :class:`~spiderflow.core.errors.NotFoundError`.
- Compacted history → :class:`CompactedError`.
- After :meth:`Store.close` every call raises :class:`~spiderflow.core.errors.UnavailableError`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import Self

import structlog

from spiderflow.core.errors import (
    AlreadyExistsError,
    ConflictError,
    NotFoundError,
    PreconditionError,
    UnavailableError,
    ValidationError,
)

__all__ = [
    "CompactedError",
    "Compare",
    "CompareFailedError",
    "EventType",
    "KeyValue",
    "LeaderInfo",
    "Leadership",
    "Lease",
    "LeaseLike",
    "NotLeaderError",
    "Observation",
    "Put",
    "Store",
    "Watch",
    "WatchEvent",
    "absent",
    "election_key",
    "election_prefix",
    "lease_id",
    "prefix_range_end",
    "unchanged",
    "validate_commit",
]

_log = structlog.get_logger(__name__)


# -- errors ---------------------------------------------------------------------------------------


class CompactedError(PreconditionError):
    """The requested revision is older than the store's compaction point ``compact_revision`` (0 when
    the server did not say which)."""

    def __init__(self, compact_revision: int, requested: int | None = None) -> None:
        self.compact_revision = compact_revision
        self.requested = requested
        asked = "" if requested is None else f" (requested {requested})"
        super().__init__(f"revision compacted: history starts at {compact_revision}{asked}")


class CompareFailedError(ConflictError):
    """A compare-and-swap or transaction lost. ``current`` maps each failed key to its current
    ``mod_revision`` (0 = absent)."""

    def __init__(self, current: Mapping[str, int]) -> None:
        self.current = dict(current)
        shown = ", ".join(f"{k}@{v}" for k, v in sorted(self.current.items()))
        super().__init__(f"compare failed: {shown or 'unknown keys'} changed")

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys whose compare failed, sorted."""
        return tuple(sorted(self.current))


class NotLeaderError(ConflictError):
    """The operation needs leadership that has been lost or resigned."""


# -- values ---------------------------------------------------------------------------------------


class EventType(StrEnum):
    """Kind of a watch event."""

    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyValue:
    """A stored key with its revisions (see the module docstring). ``lease`` 0 = none."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchEvent:
    """One change. For ``DELETE``, ``value`` is ``b""`` and ``mod_revision`` is the deleting revision.
    ``prev_value`` is the value before the change when known (``None`` if the key was absent or the
    server no longer had it)."""

    type: EventType
    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0
    lease: int = 0
    prev_value: bytes | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Compare:
    """Transaction guard: ``key``'s ``mod_revision`` must equal ``mod_revision`` (0 = key absent)."""

    key: str
    mod_revision: int

    def __post_init__(self) -> None:
        if isinstance(self.mod_revision, bool) or not isinstance(self.mod_revision, int):
            raise ValidationError("compare.mod_revision", "must be an integer", self.mod_revision)
        if self.mod_revision < 0:
            raise ValidationError("compare.mod_revision", "must be ≥ 0", self.mod_revision)
        _check_key("compare.key", self.key)


@dataclass(frozen=True, slots=True, kw_only=True)
class Put:
    """Transaction write: set ``key`` to ``value``, attached to ``lease`` (a :class:`Lease`, an id, or
    None)."""

    key: str
    value: bytes
    lease: LeaseLike = None

    def __post_init__(self) -> None:
        _check_key("put.key", self.key)
        if not isinstance(self.value, bytes | bytearray | memoryview):
            raise ValidationError("put.value", "must be bytes", type(self.value).__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaderInfo:
    """The current leader of election ``name``: its key, proclaimed value, lease and revisions."""

    name: str
    key: str
    value: bytes
    lease: int
    create_revision: int
    mod_revision: int


def absent(key: str) -> Compare:
    """Guard: ``key`` must not exist."""
    return Compare(key=key, mod_revision=0)


def unchanged(kv: KeyValue) -> Compare:
    """Guard: ``kv.key`` still has the ``mod_revision`` it had when read."""
    return Compare(key=kv.key, mod_revision=kv.mod_revision)


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's range end for a prefix: the prefix with its last byte < 0xff incremented (``b"\\0"`` =
    all keys)."""
    buf = bytearray(prefix)
    for i in reversed(range(len(buf))):
        if buf[i] < 0xFF:
            buf[i] += 1
            return bytes(buf[: i + 1])
    return b"\0"


def election_prefix(name: str) -> str:
    """Prefix under which the campaigners of election ``name`` hold their keys."""
    return name + "/"


def election_key(name: str, lease: int) -> str:
    """The key a campaigner holding ``lease`` owns in election ``name`` (as etcd names it)."""
    return f"{election_prefix(name)}{lease:x}"


def _check_key(fieldname: str, key: object) -> None:
    if not isinstance(key, str) or not key:
        raise ValidationError(fieldname, "must be a non-empty string", key)


def validate_commit(
    compares: Sequence[Compare], puts: Sequence[Put], deletes: Sequence[str], *, max_ops: int | None = None,
    delete_prefixes: Sequence[str] = (),
) -> None:
    """Reject a transaction that names a key twice among its writes (etcd refuses it too), an empty prefix
    to delete, or, with ``max_ops``, more than that many compares or writes."""
    writes = len(puts) + len(deletes) + len(delete_prefixes)
    if max_ops is not None and (len(compares) > max_ops or writes > max_ops):
        raise ValidationError("commit", f"too many operations (limit {max_ops} per list)",
                              max(len(compares), writes))
    for prefix in delete_prefixes:
        if not prefix:
            raise ValidationError("commit.delete_prefixes", "must be non-empty (refusing to delete every key)",
                                  prefix)
        for p in puts:
            if p.key.startswith(prefix):
                raise ValidationError("commit", "a key may not be put under a prefix deleted in the same "
                                      "transaction", p.key)
    seen: set[str] = set()
    for key in [p.key for p in puts] + list(deletes):
        _check_key("commit.key", key)
        if key in seen:
            raise ValidationError("commit", "a key may be written at most once per transaction", key)
        seen.add(key)
    for c in compares:
        if not isinstance(c, Compare):
            raise ValidationError("commit.compares", "must be Compare objects", c)


# -- leases ---------------------------------------------------------------------------------------


LostCallback = Callable[["Lease"], None]


class Lease(abc.ABC):
    """A granted lease; see "Leases" in the module docstring.

    Implementations provide :meth:`_refresh_once` (one keep-alive round trip returning the server's
    TTL, ≤ 0 when the lease no longer exists) and :meth:`_revoke_once`; the keep-alive/loss logic
    here is shared so both stores behave identically."""

    def __init__(self, *, lease_id: int, ttl: int, request_timeout: float) -> None:
        self._id = lease_id
        self._ttl = ttl
        self._request_timeout = request_timeout
        self._lost = asyncio.Event()
        self._revoked = False
        self._callbacks: list[LostCallback] = []
        self._lost_reason = ""
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + ttl
        self._task: asyncio.Task[None] | None = None

    @property
    def id(self) -> int:
        """The server-assigned lease id."""
        return self._id

    @property
    def ttl(self) -> int:
        """Granted TTL in seconds (may exceed the requested one)."""
        return self._ttl

    @property
    def lost(self) -> asyncio.Event:
        """Set once the lease is lost (never on an explicit revoke)."""
        return self._lost

    @property
    def lost_reason(self) -> str:
        """Why the lease was lost ("" while alive)."""
        return self._lost_reason

    @property
    def alive(self) -> bool:
        """Neither lost nor revoked."""
        return not self._lost.is_set() and not self._revoked

    def add_lost_callback(self, callback: LostCallback) -> None:
        """Run ``callback(lease)`` when the lease is lost (at once if it already is)."""
        if self._lost.is_set():
            _run_callback(callback, self)
        else:
            self._callbacks.append(callback)

    def _start(self, *, keepalive: bool) -> None:
        self._task = self._loop.create_task(
            self._keepalive() if keepalive else self._watchdog(), name=f"lease-{self._id:x}"
        )

    def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _mark_lost(self, reason: str) -> None:
        if self._lost.is_set() or self._revoked:
            return
        self._stop()
        self._lost_reason = reason
        self._lost.set()
        _log.warning("store.lease_lost", lease=self._id, ttl=self._ttl, reason=reason)
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            _run_callback(cb, self)

    async def _keepalive(self) -> None:
        interval = self._ttl / 3.0
        next_at = self._loop.time() + interval
        while True:
            now = self._loop.time()
            if now >= self._deadline:
                self._mark_lost("keep-alive not acknowledged within the TTL")
                return
            await asyncio.sleep(max(0.0, min(next_at, self._deadline) - now))
            sent = self._loop.time()
            if sent >= self._deadline:
                self._mark_lost("keep-alive not acknowledged within the TTL")
                return
            budget = max(0.01, min(self._request_timeout, self._deadline - sent))
            try:
                granted = await asyncio.wait_for(self._refresh_once(), budget)
            except (UnavailableError, TimeoutError) as exc:
                _log.info("store.keepalive_retry", lease=self._id, error=str(exc) or type(exc).__name__)
                next_at = self._loop.time() + min(0.2, interval)
                continue
            if granted <= 0:
                self._mark_lost("expired on the server")
                return
            self._deadline = sent + granted
            next_at = sent + interval

    async def _watchdog(self) -> None:
        while True:
            delay = self._deadline - self._loop.time()
            if delay <= 0:
                self._mark_lost("TTL passed without refresh")
                return
            await asyncio.sleep(delay)

    def detach(self) -> None:
        """Stop tracking the lease here (no keep-alive, no loss detection, never lost): it lives on the
        server until its TTL passes without a refresh by id (:meth:`Store.refresh_lease`)."""
        self._stop()
        self._revoked = True

    async def refresh(self) -> int:
        """Refresh once now; returns the TTL the server granted, marks the lease lost if expired."""
        if not self.alive:
            return 0
        sent = self._loop.time()
        granted = await self._refresh_once()
        if granted <= 0:
            self._mark_lost("expired on the server")
        else:
            self._deadline = max(self._deadline, sent + granted)
        return granted

    async def revoke(self) -> None:
        """Stop the keep-alive and revoke on the server (keys go at once); a no-op when expired."""
        self._stop()
        if self._revoked:
            return
        self._revoked = True
        with contextlib.suppress(NotFoundError):
            await self._revoke_once()

    @abc.abstractmethod
    async def _refresh_once(self) -> int:
        """One keep-alive round trip; the TTL granted, ≤ 0 if the lease is unknown to the server."""

    @abc.abstractmethod
    async def _revoke_once(self) -> None:
        """Revoke on the server; NotFoundError if it is already gone."""

    def __repr__(self) -> str:
        state = "alive" if self.alive else ("revoked" if self._revoked else "lost")
        return f"{type(self).__name__}(id={self._id:x}, ttl={self._ttl}, {state})"


def _run_callback(cb: LostCallback, lease: Lease) -> None:
    try:
        cb(lease)
    except Exception:
        _log.exception("store.lease_callback_failed", lease=lease.id)


LeaseLike = Lease | int | None


def lease_id(lease: LeaseLike) -> int:
    """The numeric id of a :class:`Lease`, an id, or ``None`` (0)."""
    if lease is None:
        return 0
    if isinstance(lease, Lease):
        return lease.id
    if isinstance(lease, bool) or not isinstance(lease, int) or lease < 0:
        raise ValidationError("lease", "must be a Lease, a non-negative id or None", lease)
    return lease


# -- watches --------------------------------------------------------------------------------------


class Watch(abc.ABC):
    """An established or pending watch; see "Watches" in the module docstring."""

    def __aiter__(self) -> Self:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> WatchEvent:
        """The next event (establishing the watch first if needed)."""

    @abc.abstractmethod
    async def start(self) -> Self:
        """Establish the watch now (fixes the start point of ``start_revision=None``)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the watch; iteration then stops."""

    @property
    @abc.abstractmethod
    def revision(self) -> int:
        """Revision of the last delivered event (``start_revision - 1`` before the first)."""

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Observation(abc.ABC):
    """Async iterator of :class:`LeaderInfo` from :meth:`Store.observe`."""

    def __aiter__(self) -> Self:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> LeaderInfo:
        """The next leader or proclamation."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop observing."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


# -- leader election ------------------------------------------------------------------------------


@dataclass(kw_only=True, eq=False)
class Leadership(abc.ABC):
    """Held leadership of election ``name`` (see "Leader election" in the module docstring).

    ``key`` / ``revision`` identify the leader key (its ``create_revision``); guard writes that must
    only happen while leader with ``Compare(key=leadership.key, mod_revision=...)`` or check
    :attr:`is_leader` before acting."""

    name: str
    key: str
    revision: int
    lease: Lease
    value: bytes
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_leader(self) -> bool:
        """Leadership not (yet known to be) lost or resigned."""
        return not self.lost.is_set()

    @abc.abstractmethod
    async def proclaim(self, value: bytes) -> None:
        """Publish a new leader value; :class:`NotLeaderError` if leadership is gone."""

    @abc.abstractmethod
    async def resign(self) -> None:
        """Give up leadership (idempotent); the next campaigner becomes leader."""

    async def wait_lost(self) -> None:
        """Return when leadership is lost or resigned."""
        await self.lost.wait()


# -- the store ------------------------------------------------------------------------------------


class Store(abc.ABC):
    """The store interface; the module docstring is its contract."""

    @abc.abstractmethod
    async def get(self, key: str) -> KeyValue | None:
        """The key's current value and revisions, or None."""

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys starting with ``prefix`` sorted by key, and the revision of the read."""

    @abc.abstractmethod
    async def get_prefixes(self, prefixes: Sequence[str]) -> tuple[dict[str, list[KeyValue]], int]:
        """Several prefixes read atomically at one revision: ``({prefix: items by key}, revision)``."""

    async def get_prefixes_changed(
        self, prefixes: Sequence[str], changed_after: Mapping[str, int],
    ) -> tuple[dict[str, list[KeyValue]], dict[str, dict[str, int]], int]:
        """:meth:`get_prefixes`, where for each prefix ``p`` of ``changed_after`` only the keys modified after
        revision ``changed_after[p]`` come with their values; ``({prefix: items by key}, {p: {key:
        mod_revision} of every key under p}, revision)``, all at one revision. A reader that holds the
        values of an earlier read at revision ``changed_after[p]`` has the whole prefix again without
        reading what did not change. (This default reads everything; etcd reads only what changed.)"""
        items, rev = await self.get_prefixes(prefixes)
        present = {p: {kv.key: kv.mod_revision for kv in items[p]} for p in changed_after}
        changed = {p: [kv for kv in kvs if kv.mod_revision > changed_after.get(p, 0)] for p, kvs in items.items()}
        return changed, present, rev

    @abc.abstractmethod
    async def revision(self) -> int:
        """The current store revision."""

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, *, lease: LeaseLike = None) -> int:
        """Unconditional write; returns its revision."""

    async def put_if_absent(self, key: str, value: bytes, *, lease: LeaseLike = None) -> int:
        """Create ``key``; :class:`~spiderflow.core.errors.AlreadyExistsError` if present."""
        try:
            return await self.commit([absent(key)], [Put(key=key, value=value, lease=lease)])
        except CompareFailedError as exc:
            raise AlreadyExistsError(f"{key} already exists (mod_revision {exc.current.get(key)})") from exc

    async def compare_and_swap(
        self, key: str, value: bytes, expected_mod_revision: int, *, lease: LeaseLike = None
    ) -> int:
        """Write if ``mod_revision == expected_mod_revision`` (0 = absent); else
        :class:`CompareFailedError`."""
        return await self.commit(
            [Compare(key=key, mod_revision=expected_mod_revision)], [Put(key=key, value=value, lease=lease)]
        )

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    async def delete_if(self, key: str, mod_revision: int) -> int:
        """Delete if the key exists with ``mod_revision``; else :class:`CompareFailedError`."""
        if mod_revision <= 0:
            raise ValidationError("mod_revision", "must be > 0 (the key must exist)", mod_revision)
        return await self.commit([Compare(key=key, mod_revision=mod_revision)], deletes=[key])

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many were deleted."""

    @abc.abstractmethod
    async def commit(
        self, compares: Sequence[Compare], puts: Sequence[Put] = (), deletes: Sequence[str] = (), *,
        delete_prefixes: Sequence[str] = (),
    ) -> int:
        """Atomic transaction (see the module docstring); returns its revision."""

    @abc.abstractmethod
    async def compact(self, revision: int) -> None:
        """Discard history before ``revision``."""

    @abc.abstractmethod
    async def grant(
        self, ttl: int, *, keepalive: bool = True, on_lost: LostCallback | None = None
    ) -> Lease:
        """Grant a lease of ``ttl`` whole seconds (≥ 1), kept alive unless ``keepalive=False``."""

    async def refresh_lease(self, lease: int) -> int:
        """Refresh the lease with id ``lease`` once (one granted by another process, e.g. to an agent
        that keeps it alive through the control plane); returns the TTL granted, 0 when it expired."""
        raise NotImplementedError(f"{type(self).__name__} does not refresh leases by id")

    async def revoke_lease(self, lease: int) -> bool:
        """Revoke the lease with id ``lease`` (its keys go at once); False when it had already expired."""
        raise NotImplementedError(f"{type(self).__name__} does not revoke leases by id")

    @abc.abstractmethod
    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        """Watch every key under ``prefix`` from ``start_revision`` (None = from now)."""

    @abc.abstractmethod
    async def campaign(self, name: str, value: bytes, lease: Lease) -> Leadership:
        """Block until leader of election ``name``; see the module docstring."""

    @abc.abstractmethod
    async def leader(self, name: str) -> LeaderInfo | None:
        """Current leader of election ``name``, or None."""

    @abc.abstractmethod
    def observe(self, name: str) -> Observation:
        """Leaders and proclamations of election ``name`` as they happen."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop keep-alives, watches and leadership monitors; release connections (no revokes)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
