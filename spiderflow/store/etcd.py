"""The real :class:`~spiderflow.store.base.Store`: etcd v3 over gRPC.

The etcdserverpb/mvccpb messages and stubs come from ``aetcd`` 1.0 (``aetcd.rpc``); the store opens the
channel itself (``aetcd.Client`` only knows plaintext) and calls the stubs directly, so every call carries
the store's ``request_timeout`` and every failure maps to the contract's errors. Leader election uses
etcd's ``v3electionpb.Election`` service through :mod:`spiderflow.proto.etcd.v3election_pb2_grpc`.

Security: ``tls`` (:class:`~spiderflow.store.tls.EtcdTLS`) connects with TLS, verifying etcd against the
bundle's CA and presenting its client certificate (etcd ``--client-cert-auth``); ``username``/``password``
authenticate against etcd's auth (the token etcd answers is sent with every request). Both combine. When
etcd forgets a token (restart, ``--auth-token-ttl`` of inactivity) the next request fails with "invalid auth
token": the store authenticates again and retries a unary call once; streams re-establish with the new
token. Refused credentials (a wrong password, a client certificate etcd does not trust, a user without
permission) are :class:`~spiderflow.core.errors.UnavailableError` like any unreachable etcd (etcd is unavailable
*to this process*; its callers' requests are not at fault), with etcd's reason in the message.

Connection handling: the gRPC channel reconnects by itself (backoff 0.1–1 s) and sends HTTP/2
keep-alive pings every ``keepalive_s`` (etcd refuses pings more often than its
``--grpc-keepalive-min-time``, 5 s by default), so a silent server (SIGSTOP, partition) breaks open
streams within ``keepalive_s + 5`` s. Unary calls fail after ``request_timeout`` with
:class:`~spiderflow.core.errors.UnavailableError`. Watches, observations and a campaign in progress
re-establish themselves across restarts for up to ``stream_retry_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aetcd.rpc as rpc
import grpc
import grpc.aio
import structlog

from spiderflow.core.errors import (
    ConflictError,
    NotFoundError,
    PreconditionError,
    SpiderFlowError,
    UnavailableError,
    ValidationError,
)
from spiderflow.proto.etcd import v3election_pb2 as epb
from spiderflow.proto.etcd import v3election_pb2_grpc as epb_grpc
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
    lease_id,
    prefix_range_end,
    validate_commit,
)
from spiderflow.store.tls import EtcdTLS
from spiderflow.store.watch import ResumableWatch, StreamBroken

__all__ = ["EtcdStore", "map_rpc_error"]

_log = structlog.get_logger(__name__)

_UNAVAILABLE_CODES = frozenset(  # documentation of the transient codes; map_rpc_error's fallback
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)


def map_rpc_error(exc: grpc.aio.AioRpcError, *, what: str = "etcd") -> SpiderFlowError:
    """The contract error for an etcd gRPC failure (see :mod:`spiderflow.store.base`, "Errors")."""
    code = exc.code()
    details = exc.details() or code.name
    if "election: not leader" in details:
        return NotLeaderError(details)
    if "election: no leader" in details:
        return NotFoundError(f"{what}: {details}")
    if code is grpc.StatusCode.NOT_FOUND:
        return NotFoundError(f"{what}: {details}")
    if code is grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return CompactedError(0)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return ValidationError(what, details)
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return PreconditionError(f"{what}: {details}")
    if code is grpc.StatusCode.ALREADY_EXISTS:
        return ConflictError(f"{what}: {details}")
    # _UNAVAILABLE_CODES and anything unexpected: treated as transient (retrying may succeed).
    return UnavailableError(f"{what}: {code.name.lower()}: {details}")


def _invalid_token(exc: grpc.aio.AioRpcError) -> bool:
    """etcd refused the auth token it issued (restarted, or the token idled past ``--auth-token-ttl``)."""
    return "invalid auth token" in (exc.details() or "")


def _kv(m: Any) -> KeyValue:
    return KeyValue(
        key=bytes(m.key).decode(),
        value=bytes(m.value),
        create_revision=int(m.create_revision),
        mod_revision=int(m.mod_revision),
        version=int(m.version),
        lease=int(m.lease),
    )


def _event(e: Any) -> WatchEvent:
    kv = e.kv
    deleted = e.type == rpc.Event.DELETE
    prev = bytes(e.prev_kv.value) if e.HasField("prev_kv") else None
    return WatchEvent(
        type=EventType.DELETE if deleted else EventType.PUT,
        key=bytes(kv.key).decode(),
        value=b"" if deleted else bytes(kv.value),
        mod_revision=int(kv.mod_revision),
        create_revision=0 if deleted else int(kv.create_revision),
        lease=0 if deleted else int(kv.lease),
        prev_value=prev,
    )


def _leader_info(name: str, kv: Any) -> LeaderInfo:
    return LeaderInfo(
        name=name,
        key=bytes(kv.key).decode(),
        value=bytes(kv.value),
        lease=int(kv.lease),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
    )


class _Backoff:
    """Retry pacing for streams: 0.05 s doubling to 1 s, giving up ``budget`` s after the first failure."""

    def __init__(self, budget: float) -> None:
        self._budget = budget
        self._delay = 0.05
        self._since: float | None = None

    def reset(self) -> None:
        self._delay = 0.05
        self._since = None

    async def wait(self, error: Exception) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._since is None:
            self._since = now
        if now - self._since >= self._budget:
            raise UnavailableError(f"gave up reconnecting after {self._budget:.0f}s: {error}") from error
        await asyncio.sleep(self._delay)
        self._delay = min(1.0, self._delay * 2)


class _EtcdLease(Lease):
    def __init__(self, store: EtcdStore, *, lease_id: int, ttl: int) -> None:
        super().__init__(lease_id=lease_id, ttl=ttl, request_timeout=store.request_timeout)
        self._store = store

    async def _refresh_once(self) -> int:
        resp = await self._store._keepalive_once(self.id)
        return int(resp.TTL)

    async def _revoke_once(self) -> None:
        await self._store._unary("LeaseRevoke", rpc.LeaseRevokeRequest(ID=self.id))


class _EtcdWatch(ResumableWatch):
    """etcd's ``Watch`` stream behind the shared resumable iteration (:mod:`spiderflow.store.watch`)."""

    def __init__(self, store: EtcdStore, key: bytes, range_end: bytes | None, start_revision: int | None) -> None:
        super().__init__(start_revision)
        self._store = store
        self._key = key
        self._range_end = range_end
        self._backoff = _Backoff(store.stream_retry_s)

    async def _connect(self) -> None:
        while True:
            try:
                await self._establish()
                return
            except UnavailableError as exc:
                await self._backoff.wait(exc)

    def _on_start(self) -> None:
        self._store._watches.add(self)

    def _on_close(self) -> None:
        self._store._watches.discard(self)

    def _cancel(self, call: Any) -> None:
        call.cancel()

    async def _establish(self) -> None:
        store = self._store
        stub = await store._stub("watch")
        call = stub.Watch(metadata=store._metadata())
        try:
            create = rpc.WatchCreateRequest(key=self._key, start_revision=self._next or 0, prev_kv=True)
            if self._range_end is not None:
                create.range_end = self._range_end
            await asyncio.wait_for(call.write(rpc.WatchRequest(create_request=create)), store.request_timeout)
            resp = await asyncio.wait_for(call.read(), store.request_timeout)
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            raise store._error(exc, "etcd watch") from exc
        except TimeoutError:
            call.cancel()
            raise UnavailableError("etcd watch: no answer to watch create") from None
        except asyncio.CancelledError:
            call.cancel()
            raise
        if resp is grpc.aio.EOF:
            call.cancel()
            raise UnavailableError("etcd watch: stream closed during create")
        if resp.compact_revision:
            call.cancel()
            raise CompactedError(int(resp.compact_revision), self._next)
        if resp.canceled:
            call.cancel()
            raise UnavailableError(f"etcd watch: canceled at create: {resp.cancel_reason}")
        if self._next is None:
            self._next = int(resp.header.revision) + 1
            self._last = self._next - 1
        self._call = call
        self._take(_event(e) for e in resp.events)
        self._backoff.reset()

    async def _read(self) -> list[WatchEvent]:
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            self._store._error(exc, "etcd watch")  # notes an expired auth token for the reconnect
            _log.info("store.watch_reconnect", key=self._key.decode(errors="replace"), next=self._next,
                      error=exc.code().name)
            raise StreamBroken(exc.code().name) from exc
        if resp is grpc.aio.EOF or (resp.canceled and not resp.compact_revision):
            raise StreamBroken("etcd watch: stream ended or canceled", pause=True)
        if resp.compact_revision:
            raise CompactedError(int(resp.compact_revision), self._next)
        return [_event(e) for e in resp.events]

    async def _on_break(self, error: StreamBroken) -> None:
        if error.pause:
            await self._backoff.wait(UnavailableError(str(error)))


class _EtcdObservation(Observation):
    def __init__(self, store: EtcdStore, name: str) -> None:
        self._store = store
        self._name = name
        self._call: Any = None
        self._last: tuple[str, int] | None = None
        self._closed = False
        self._backoff = _Backoff(store.stream_retry_s)

    async def __anext__(self) -> LeaderInfo:
        while not self._closed:
            if self._call is None:
                stub = await self._store._stub("election")
                self._call = stub.Observe(epb.LeaderRequest(name=self._name.encode()),
                                          metadata=self._store._metadata())
            try:
                resp = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                self._call = None
                if self._closed:
                    break
                await self._backoff.wait(self._store._error(exc, "etcd observe"))
                continue
            except asyncio.CancelledError:
                call, self._call = self._call, None
                if call is not None:
                    call.cancel()
                if self._closed:
                    break
                raise
            if resp is grpc.aio.EOF:
                self._call = None
                await self._backoff.wait(UnavailableError("etcd observe: stream ended"))
                continue
            self._backoff.reset()
            info = _leader_info(self._name, resp.kv)
            if (info.key, info.mod_revision) == self._last:
                continue
            self._last = (info.key, info.mod_revision)
            return info
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._closed = True
        call, self._call = self._call, None
        if call is not None:
            call.cancel()


@dataclass(kw_only=True, eq=False)
class _EtcdLeadership(Leadership):
    store: EtcdStore
    _monitor: asyncio.Task[None] | None = field(default=None, init=False)

    def _leader_key(self) -> Any:
        return epb.LeaderKey(name=self.name.encode(), key=self.key.encode(), rev=self.revision, lease=self.lease.id)

    def _start(self, from_revision: int) -> None:
        self.lease.add_lost_callback(lambda _l: self._lose("lease lost"))
        self._monitor = asyncio.get_running_loop().create_task(self._watch_key(from_revision))
        self.store._leaderships.add(self)

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost.set()
            _log.warning("store.leadership_lost", election=self.name, key=self.key, reason=reason)
        self.store._leaderships.discard(self)
        task, self._monitor = self._monitor, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _watch_key(self, from_revision: int) -> None:
        watch = _EtcdWatch(self.store, self.key.encode(), None, from_revision)
        try:
            async for ev in watch:
                if ev.type is EventType.DELETE:
                    self._lose("leader key deleted")
                    return
        except (UnavailableError, CompactedError) as exc:
            self._lose(f"cannot confirm leadership: {exc}")
        finally:
            await watch.aclose()

    async def proclaim(self, value: bytes) -> None:
        if self.lost.is_set():
            raise NotLeaderError(f"not leader of {self.name}")
        await self.store._unary("Proclaim", epb.ProclaimRequest(leader=self._leader_key(), value=bytes(value)),
                                stub="election")
        self.value = bytes(value)

    async def resign(self) -> None:
        if self.lost.is_set():
            return
        self._lose("resigned")
        with contextlib.suppress(NotLeaderError):
            await self.store._unary("Resign", epb.ResignRequest(leader=self._leader_key()), stub="election")


class EtcdStore(Store):
    """The contract of :mod:`spiderflow.store.base` on etcd at ``endpoint`` (``host:port``)."""

    def __init__(
        self,
        endpoint: str = "127.0.0.1:2379",
        *,
        request_timeout: float = 5.0,
        stream_retry_s: float = 30.0,
        keepalive_s: float = 10.0,
        username: str | None = None,
        password: str | None = None,
        tls: EtcdTLS | None = None,
    ) -> None:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValidationError("endpoint", "must be host:port", endpoint)
        if (username is None) != (password is None):
            raise ValidationError("username", "etcd authentication needs both a user and a password", username)
        self.endpoint = endpoint
        self.request_timeout = request_timeout
        self.stream_retry_s = stream_retry_s
        self.tls = tls
        self._username = username
        self._password = password
        self._credentials: grpc.ChannelCredentials | None = None
        if tls is not None:
            ca, cert, key = tls.read()
            self._credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                                             certificate_chain=cert)
        self._options: list[tuple[str, Any]] = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        self._channel: grpc.aio.Channel | None = None
        self._auth_metadata: tuple[tuple[str, str], ...] | None = None
        self._auth_stale = False
        self._connecting: asyncio.Lock | None = None
        self._stubs: dict[str, Any] = {}
        self._watches: weakref.WeakSet[_EtcdWatch] = weakref.WeakSet()
        self._leases: weakref.WeakSet[_EtcdLease] = weakref.WeakSet()
        self._leaderships: set[_EtcdLeadership] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    # -- plumbing -----------------------------------------------------------------------------------

    def _background(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a best-effort request without awaiting it (errors are logged)."""

        async def run() -> None:
            try:
                await coro
            except Exception as exc:
                _log.info("store.background_failed", error=str(exc))

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _metadata(self) -> Any:
        return self._auth_metadata

    def _error(self, exc: grpc.aio.AioRpcError, what: str) -> SpiderFlowError:
        """:func:`map_rpc_error`, noting a token etcd no longer knows (the next request authenticates
        again)."""
        if self._username is not None and _invalid_token(exc):
            self._auth_stale = True
            return UnavailableError(f"{what}: etcd auth token expired (authenticating again)")
        return map_rpc_error(exc, what=what)

    async def _authenticate(self, channel: grpc.aio.Channel) -> None:
        assert self._username is not None and self._password is not None
        stub = rpc.AuthStub(channel)
        try:
            resp = await stub.Authenticate(rpc.AuthenticateRequest(name=self._username, password=self._password),
                                           timeout=self.request_timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                              grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                # The service's own configuration is wrong: to its callers etcd is unavailable (never
                # UNAUTHENTICATED/INVALID_ARGUMENT, which would blame their request); the message says why.
                raise UnavailableError(f"etcd {self.endpoint} refused user {self._username!r}: "
                                       f"{exc.details() or exc.code().name}") from exc
            raise map_rpc_error(exc, what="etcd Authenticate") from exc
        self._auth_metadata = (("token", str(resp.token)),)
        self._auth_stale = False
        _log.debug("store.authenticated", endpoint=self.endpoint, user=self._username)

    async def _stub(self, kind: str) -> Any:
        if self._closed:
            raise UnavailableError("store is closed")
        if self._stubs and not self._auth_stale:
            return self._stubs[kind]
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._closed:
                raise UnavailableError("store is closed")
            if self._channel is None:
                target = self.endpoint
                if self._credentials is not None:
                    channel = grpc.aio.secure_channel(target, self._credentials, options=self._options)
                else:
                    channel = grpc.aio.insecure_channel(target, options=self._options)
                try:
                    if self._username is not None:
                        await self._authenticate(channel)
                except BaseException:
                    await channel.close()
                    raise
                self._channel = channel
                self._stubs = {
                    "kv": rpc.KVStub(channel),
                    "lease": rpc.LeaseStub(channel),
                    "watch": rpc.WatchStub(channel),
                    "election": epb_grpc.ElectionStub(channel),  # type: ignore[no-untyped-call]
                }
            elif self._auth_stale:
                await self._authenticate(self._channel)
        return self._stubs[kind]

    async def _unary(self, method: str, request: Any, *, stub: str | None = None,
                     timeout: float | None = None) -> Any:
        if stub is None:
            stub = "lease" if method.startswith("Lease") else "kv"
        for attempt in (0, 1):
            fn = getattr(await self._stub(stub), method)
            try:
                return await fn(request, timeout=self.request_timeout if timeout is None else timeout,
                                metadata=self._metadata())
            except grpc.aio.AioRpcError as exc:
                err = self._error(exc, f"etcd {method}")
                if attempt == 0 and self._auth_stale:
                    continue  # authenticated again by _stub: retry once
                raise err from exc
        raise AssertionError("unreachable")

    async def _keepalive_once(self, lid: int) -> Any:
        stub = await self._stub("lease")
        call = stub.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lid)]), timeout=self.request_timeout,
                                   metadata=self._metadata())
        try:
            resp = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, "etcd LeaseKeepAlive") from exc
        finally:
            call.cancel()
        if resp is grpc.aio.EOF:
            raise UnavailableError("etcd LeaseKeepAlive: stream ended")
        return resp

    @staticmethod
    def _put_request(p: Put) -> Any:
        return rpc.PutRequest(key=p.key.encode(), value=bytes(p.value), lease=lease_id(p.lease))

    # -- Store --------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        resp = await self._unary("Range", rpc.RangeRequest(key=key.encode()))
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        resp = await self._unary("Range", self._prefix_range(prefix))
        return [_kv(m) for m in resp.kvs], int(resp.header.revision)

    @staticmethod
    def _prefix_range(prefix: str) -> Any:
        raw = prefix.encode()
        return rpc.RangeRequest(key=raw or b"\0", range_end=prefix_range_end(raw),
                                sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.KEY)

    async def get_prefixes(self, prefixes: Sequence[str]) -> tuple[dict[str, list[KeyValue]], int]:
        unique = list(dict.fromkeys(prefixes))
        ops = [rpc.RequestOp(request_range=self._prefix_range(p)) for p in unique]
        resp = await self._unary("Txn", rpc.TxnRequest(success=ops))
        out = {p: [_kv(m) for m in r.response_range.kvs] for p, r in zip(unique, resp.responses, strict=True)}
        return out, int(resp.header.revision)

    async def get_prefixes_changed(
        self, prefixes: Sequence[str], changed_after: Mapping[str, int],
    ) -> tuple[dict[str, list[KeyValue]], dict[str, dict[str, int]], int]:
        unique = list(dict.fromkeys(prefixes))
        ops = []
        for p in unique:
            rng = self._prefix_range(p)
            if p in changed_after:  # every key without its value, then the values of those modified since
                keys_only = rpc.RangeRequest()
                keys_only.CopyFrom(rng)
                keys_only.keys_only = True
                ops.append(rpc.RequestOp(request_range=keys_only))
                rng.min_mod_revision = changed_after[p] + 1
            ops.append(rpc.RequestOp(request_range=rng))
        resp = await self._unary("Txn", rpc.TxnRequest(success=ops))
        results = iter(resp.responses)
        changed: dict[str, list[KeyValue]] = {}
        present: dict[str, dict[str, int]] = {}
        for p in unique:
            if p in changed_after:
                present[p] = {bytes(m.key).decode(): int(m.mod_revision) for m in next(results).response_range.kvs}
            changed[p] = [_kv(m) for m in next(results).response_range.kvs]
        return changed, present, int(resp.header.revision)

    async def revision(self) -> int:
        resp = await self._unary("Range", rpc.RangeRequest(key=b"\0", limit=1, count_only=True))
        return int(resp.header.revision)

    async def put(self, key: str, value: bytes, *, lease: LeaseLike = None) -> int:
        resp = await self._unary("Put", self._put_request(Put(key=key, value=value, lease=lease)))
        return int(resp.header.revision)

    async def delete(self, key: str) -> bool:
        resp = await self._unary("DeleteRange", rpc.DeleteRangeRequest(key=key.encode()))
        return int(resp.deleted) > 0

    async def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise ValidationError("prefix", "must be non-empty (refusing to delete every key)", prefix)
        req = rpc.DeleteRangeRequest(key=prefix.encode(), range_end=prefix_range_end(prefix.encode()))
        resp = await self._unary("DeleteRange", req)
        return int(resp.deleted)

    async def commit(
        self, compares: Sequence[Compare], puts: Sequence[Put] = (), deletes: Sequence[str] = (), *,
        delete_prefixes: Sequence[str] = (),
    ) -> int:
        validate_commit(compares, puts, deletes, delete_prefixes=delete_prefixes)
        cmp = [
            rpc.Compare(key=c.key.encode(), target=rpc.Compare.MOD, result=rpc.Compare.EQUAL,
                        mod_revision=c.mod_revision)
            for c in compares
        ]
        success = [rpc.RequestOp(request_put=self._put_request(p)) for p in puts]
        success += [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=k.encode())) for k in deletes]
        success += [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
            key=p.encode(), range_end=prefix_range_end(p.encode()))) for p in delete_prefixes]
        failure = [rpc.RequestOp(request_range=rpc.RangeRequest(key=c.key.encode())) for c in compares]
        resp = await self._unary("Txn", rpc.TxnRequest(compare=cmp, success=success, failure=failure))
        if resp.succeeded:
            return int(resp.header.revision)
        failed: dict[str, int] = {}
        for c, r in zip(compares, resp.responses, strict=True):
            kvs = r.response_range.kvs
            current = int(kvs[0].mod_revision) if kvs else 0
            if current != c.mod_revision:
                failed[c.key] = current
        raise CompareFailedError(failed)

    async def compact(self, revision: int) -> None:
        try:
            await self._unary("Compact", rpc.CompactionRequest(revision=revision, physical=True))
        except CompactedError as exc:
            raise CompactedError(0, revision) from exc

    async def grant(
        self, ttl: int, *, keepalive: bool = True, on_lost: LostCallback | None = None
    ) -> Lease:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValidationError("ttl", "must be an integer number of seconds ≥ 1", ttl)
        resp = await self._unary("LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl))
        if resp.error:
            raise PreconditionError(f"etcd LeaseGrant: {resp.error}")
        lease = _EtcdLease(self, lease_id=int(resp.ID), ttl=int(resp.TTL))
        if on_lost is not None:
            lease.add_lost_callback(on_lost)
        lease._start(keepalive=keepalive)
        self._leases.add(lease)
        _log.debug("store.lease_granted", lease=lease.id, ttl=lease.ttl)
        return lease

    async def refresh_lease(self, lease: int) -> int:
        resp = await self._keepalive_once(lease)
        return max(0, int(resp.TTL))

    async def revoke_lease(self, lease: int) -> bool:
        try:
            await self._unary("LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease))
        except NotFoundError:
            return False
        return True

    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        if start_revision is not None and start_revision < 1:
            raise ValidationError("start_revision", "must be ≥ 1", start_revision)
        raw = prefix.encode()
        return _EtcdWatch(self, raw or b"\0", prefix_range_end(raw), start_revision)

    async def campaign(self, name: str, value: bytes, lease: Lease) -> Leadership:
        req = epb.CampaignRequest(name=name.encode(), lease=lease.id, value=bytes(value))
        backoff = _Backoff(self.stream_retry_s)
        while True:
            if not lease.alive:
                raise ConflictError(f"lease {lease.id:x} lost while campaigning for {name}")
            stub = await self._stub("election")
            call = stub.Campaign(req, metadata=self._metadata())
            won = asyncio.ensure_future(call)
            lost = asyncio.ensure_future(lease.lost.wait())
            try:
                await asyncio.wait({won, lost}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                call.cancel()
                if self._username is not None:
                    # etcd's election service withdraws a cancelled candidacy with its own credentials,
                    # which an etcd with authentication refuses: withdraw it here (our lease's key).
                    self._background(self._unary("DeleteRange", rpc.DeleteRangeRequest(
                        key=election_key(name, lease.id).encode())))
                raise
            finally:
                lost.cancel()
            if not won.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await won
                raise ConflictError(f"lease {lease.id:x} lost while campaigning for {name}")
            try:
                resp = won.result()
            except grpc.aio.AioRpcError as exc:
                err = self._error(exc, "etcd Campaign")
                if isinstance(err, UnavailableError):
                    await backoff.wait(err)
                    continue
                raise err from exc
            break
        key = bytes(resp.leader.key).decode()
        rev = int(resp.leader.rev)
        try:
            kv = await self.get(key)
        except BaseException:  # won but cannot hand it over: withdraw, so no one leads unseen
            self._background(self._unary("Resign", epb.ResignRequest(leader=resp.leader), stub="election"))
            raise
        if kv is None or kv.create_revision != rev:
            raise ConflictError(f"leader key {key} vanished while campaigning for {name} (lease lost)")
        leadership = _EtcdLeadership(name=name, key=key, revision=rev, lease=lease, value=kv.value, store=self)
        leadership._start(kv.mod_revision + 1)
        _log.info("store.elected", election=name, key=key, lease=lease.id, revision=rev)
        return leadership

    async def leader(self, name: str) -> LeaderInfo | None:
        try:
            resp = await self._unary("Leader", epb.LeaderRequest(name=name.encode()), stub="election")
        except NotFoundError:
            return None
        return _leader_info(name, resp.kv)

    def observe(self, name: str) -> Observation:
        return _EtcdObservation(self, name)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ld in list(self._leaderships):
            ld._lose("store closed")
        for lease in list(self._leases):
            lease._stop()
        for w in list(self._watches):
            await w.aclose()
        channel, self._channel = self._channel, None
        self._stubs = {}
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close()
