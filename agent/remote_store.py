"""The agent's :class:`~spiderflow.store.base.Store`: the control plane's ``Control`` API, not etcd.

Agents hold no etcd credentials. Everything an agent keeps in the control plane's state — its
registration under a lease and the lease's keep-alive, its peers' addresses, its assignments, the
rendezvous of the attempts it runs, the checkpoint manifests of its jobs — goes through the scheduler
replicas' ``Control`` service (``services/scheduler/control.py``), which authorises every key against the
agent's cluster identity (:mod:`spiderflow.security.keypolicy`). :class:`RemoteStore` implements the part
of the Store contract the agent uses (get, get_prefix, revision, put, put_if_absent, compare_and_swap, a
single-key commit, delete, grant with keep-alive, watch_prefix) so the agent's code is the same over
either store; the rest raises :class:`~spiderflow.core.errors.PermissionDeniedError` without a call.

Replicas: ``addresses`` are every scheduler replica (the agent's ``scheduler`` setting). A call goes to the
replica that answered last; when it is unreachable (UNAVAILABLE or no answer within ``request_timeout``)
the next one is tried, once round the list, then :class:`~spiderflow.core.errors.UnavailableError` (the
store's contract: callers retry). A watch whose stream breaks resumes on the next replica from the last
delivered revision + 1 (no gap, no duplicate), retrying with backoff for ``stream_retry_s``. Leases are
kept alive by the shared keep-alive of :class:`~spiderflow.store.base.Lease` through ``KeepAlive`` calls,
so a replica's death costs a lease nothing as long as another replica answers within its TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import structlog

from spiderflow.core.errors import NotFoundError, PermissionDeniedError, UnavailableError, ValidationError
from spiderflow.proto.control.v1 import control_pb2, control_pb2_grpc
from spiderflow.rpc.errors import domain_errors
from spiderflow.rpc.server import open_channel
from spiderflow.security.auth import bearer_metadata
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
    Observation,
    Put,
    Store,
    Watch,
    WatchEvent,
    lease_id,
    validate_commit,
)
from spiderflow.store.watch import ResumableWatch, StreamBroken

__all__ = ["RemoteStore"]

log = structlog.get_logger(__name__)

T = TypeVar("T")


def _kv(m: control_pb2.KeyValue) -> KeyValue:
    return KeyValue(key=m.key, value=bytes(m.value), create_revision=int(m.create_revision),
                    mod_revision=int(m.mod_revision), version=int(m.version), lease=int(m.lease))


class _RemoteLease(Lease):
    def __init__(self, store: RemoteStore, *, lease_id: int, ttl: int) -> None:
        super().__init__(lease_id=lease_id, ttl=ttl, request_timeout=store.request_timeout)
        self._store = store

    async def _refresh_once(self) -> int:
        resp = await self._store._call(lambda s, md, t: s.KeepAlive(
            control_pb2.KeepAliveRequest(cluster=self._store.cluster, lease=self.id), timeout=t, metadata=md))
        return int(resp.ttl)

    async def _revoke_once(self) -> None:
        resp = await self._store._call(lambda s, md, t: s.RevokeLease(
            control_pb2.RevokeLeaseRequest(cluster=self._store.cluster, lease=self.id), timeout=t, metadata=md))
        if not resp.revoked:
            raise NotFoundError(f"lease {self.id:x} not found")


class _RemoteWatch(ResumableWatch):
    """The control plane's ``Watch`` stream behind the shared resumable iteration (:mod:`spiderflow.store.watch`):
    a broken stream resumes on the next replica."""

    def __init__(self, store: RemoteStore, prefix: str, start_revision: int | None) -> None:
        super().__init__(start_revision)
        self._store = store
        self._prefix = prefix

    def _cancel(self, call: Any) -> None:
        call.cancel()

    async def _establish(self) -> None:
        store = self._store
        if self._next is None:  # "from now": the revision current when the watch is established
            self._next = await store.revision() + 1
            self._last = self._next - 1
        errors: list[str] = []
        for _ in range(len(store._stubs)):
            i = store._current
            call = store._stubs[i].Watch(control_pb2.WatchRequest(cluster=store.cluster, prefix=self._prefix,
                                                                  start_revision=self._next),
                                         metadata=store._metadata)
            try:
                first = await asyncio.wait_for(call.read(), store.request_timeout)
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                call.cancel()
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in _FAILOVER:
                    with domain_errors():
                        raise exc
                errors.append(f"{store.addresses[i]}: {_why(exc)}")
                store._next_replica(i)
                continue
            if first is grpc.aio.EOF:
                call.cancel()
                errors.append(f"{store.addresses[i]}: stream closed")
                store._next_replica(i)
                continue
            if first.compact_revision:
                call.cancel()
                raise CompactedError(int(first.compact_revision), self._next)
            self._call = call
            return
        raise UnavailableError(f"no control-plane replica accepted the watch of {self._prefix}: "
                               + "; ".join(errors))

    async def _connect(self) -> None:
        deadline = time.monotonic() + self._store.stream_retry_s
        delay = 0.1
        while True:
            try:
                await self._establish()
                return
            except UnavailableError:
                if time.monotonic() + delay >= deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _read(self) -> list[WatchEvent]:
        try:
            resp = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _FAILOVER:
                with domain_errors():
                    raise exc
            log.info("agent.control_watch_reconnect", prefix=self._prefix, next=self._next, error=exc.code().name)
            raise StreamBroken(exc.code().name) from exc
        if resp is grpc.aio.EOF:
            raise StreamBroken("stream closed")
        if resp.compact_revision:
            raise CompactedError(int(resp.compact_revision), self._next)
        return [WatchEvent(type=EventType.DELETE if e.type == control_pb2.EVENT_TYPE_DELETE else EventType.PUT,
                           key=e.key, value=bytes(e.value), mod_revision=int(e.mod_revision),
                           create_revision=int(e.create_revision), lease=int(e.lease)) for e in resp.events]

    async def _on_break(self, error: StreamBroken) -> None:
        self._store._next_replica(self._store._current)


_FAILOVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {(exc.details() or '')[:200]}"
    return type(exc).__name__


class RemoteStore(Store):
    """A :class:`Store` over the control plane's ``Control`` API (module docstring). ``cluster`` is the
    agent's cluster (sent with every call; the server binds it to the caller's certificate or token)."""

    def __init__(self, addresses: str | Sequence[str], *, cluster: str, tls_dir: str | None = None,
                 token: str | None = None, request_timeout: float = 5.0, stream_retry_s: float = 60.0) -> None:
        from agent.control import parse_replicas

        self.addresses = parse_replicas(addresses) if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValidationError("scheduler", "needs at least one control-plane address")
        self.cluster = cluster
        self.request_timeout = request_timeout
        self.stream_retry_s = stream_retry_s
        credentials = None
        if tls_dir:
            from spiderflow.security.tls import channel_credentials

            credentials = channel_credentials(Path(tls_dir))
        self._channels = [open_channel(a, credentials=credentials) for a in self.addresses]
        self._stubs = [control_pb2_grpc.ControlStub(c) for c in self._channels]
        self._metadata = bearer_metadata(token)
        self._current = 0
        self._closed = False
        self._leases: list[_RemoteLease] = []

    @property
    def current(self) -> str:
        """The replica the next call goes to first."""
        return self.addresses[self._current]

    def _next_replica(self, failed: int) -> None:
        if self._current == failed:
            self._current = (failed + 1) % len(self._stubs)

    async def _call(self, fn: Callable[[control_pb2_grpc.ControlStub, Any, float], Awaitable[T]]) -> T:
        """``fn(stub, metadata, timeout)`` on the current replica, then on the others once round the list."""
        if self._closed:
            raise UnavailableError("the control-plane client is closed")
        errors: list[str] = []
        for _ in range(len(self._stubs)):
            i = self._current
            try:
                with domain_errors():
                    return await fn(self._stubs[i], self._metadata, self.request_timeout)
            except UnavailableError as e:
                errors.append(f"{self.addresses[i]}: {str(e)[:200]}")
                self._next_replica(i)
        raise UnavailableError("no control-plane replica answered: " + "; ".join(errors))

    # -- reads ----------------------------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        resp = await self._call(lambda s, md, t: s.Get(control_pb2.GetRequest(cluster=self.cluster, key=key),
                                                       timeout=t, metadata=md))
        return _kv(resp.kv) if resp.HasField("kv") else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        resp = await self._call(lambda s, md, t: s.List(control_pb2.ListRequest(cluster=self.cluster, prefix=prefix),
                                                        timeout=t, metadata=md))
        return [_kv(m) for m in resp.kvs], int(resp.revision)

    async def get_prefixes(self, prefixes: Sequence[str]) -> tuple[dict[str, list[KeyValue]], int]:
        raise PermissionDeniedError("agents read one prefix at a time through the control plane")

    async def revision(self) -> int:
        resp = await self._call(lambda s, md, t: s.Revision(control_pb2.RevisionRequest(cluster=self.cluster),
                                                            timeout=t, metadata=md))
        return int(resp.revision)

    def watch_prefix(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        if start_revision is not None and start_revision < 1:
            raise ValidationError("start_revision", "must be ≥ 1", start_revision)
        return _RemoteWatch(self, prefix, start_revision)

    # -- writes ---------------------------------------------------------------------------------------

    async def _put(self, key: str, value: bytes, lease: LeaseLike, expected: int | None) -> int:
        req = control_pb2.PutRequest(cluster=self.cluster, key=key, value=bytes(value), lease=lease_id(lease),
                                     compare=expected is not None, expected_mod_revision=expected or 0)
        resp = await self._call(lambda s, md, t: s.Put(req, timeout=t, metadata=md))
        if not resp.succeeded:
            raise CompareFailedError({key: int(resp.current_mod_revision)})
        return int(resp.revision)

    async def put(self, key: str, value: bytes, *, lease: LeaseLike = None) -> int:
        return await self._put(key, value, lease, None)

    async def commit(self, compares: Sequence[Compare], puts: Sequence[Put] = (), deletes: Sequence[str] = (), *,
                     delete_prefixes: Sequence[str] = ()) -> int:
        """Only one shape goes through the control plane: a compare on one key and a put of that key."""
        validate_commit(compares, puts, deletes, delete_prefixes=delete_prefixes)
        if len(compares) == 1 and len(puts) == 1 and not deletes and not delete_prefixes \
                and compares[0].key == puts[0].key:
            p = puts[0]
            return await self._put(p.key, p.value, p.lease, compares[0].mod_revision)
        raise PermissionDeniedError("agents commit one compare-and-swap of one key through the control plane")

    async def delete(self, key: str) -> bool:
        resp = await self._call(lambda s, md, t: s.Delete(control_pb2.DeleteRequest(cluster=self.cluster, key=key),
                                                          timeout=t, metadata=md))
        return bool(resp.deleted)

    async def delete_prefix(self, prefix: str) -> int:
        raise PermissionDeniedError(f"agents may not delete the prefix {prefix}")

    async def compact(self, revision: int) -> None:
        raise PermissionDeniedError("agents may not compact the store")

    # -- leases ---------------------------------------------------------------------------------------

    async def grant(self, ttl: int, *, keepalive: bool = True, on_lost: LostCallback | None = None) -> Lease:
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValidationError("ttl", "must be an integer number of seconds ≥ 1", ttl)
        resp = await self._call(lambda s, md, t: s.GrantLease(
            control_pb2.GrantLeaseRequest(cluster=self.cluster, ttl=ttl), timeout=t, metadata=md))
        lease = _RemoteLease(self, lease_id=int(resp.lease), ttl=int(resp.ttl))
        if on_lost is not None:
            lease.add_lost_callback(on_lost)
        lease._start(keepalive=keepalive)
        self._leases = [x for x in self._leases if x.alive] + [lease]
        return lease

    async def refresh_lease(self, lease: int) -> int:
        resp = await self._call(lambda s, md, t: s.KeepAlive(
            control_pb2.KeepAliveRequest(cluster=self.cluster, lease=lease), timeout=t, metadata=md))
        return int(resp.ttl)

    async def revoke_lease(self, lease: int) -> bool:
        resp = await self._call(lambda s, md, t: s.RevokeLease(
            control_pb2.RevokeLeaseRequest(cluster=self.cluster, lease=lease), timeout=t, metadata=md))
        return bool(resp.revoked)

    # -- elections: not for agents --------------------------------------------------------------------

    async def campaign(self, name: str, value: bytes, lease: Lease) -> Leadership:
        raise PermissionDeniedError("agents take part in no election")

    async def leader(self, name: str) -> LeaderInfo | None:
        raise PermissionDeniedError("agents take part in no election")

    def observe(self, name: str) -> Observation:
        raise PermissionDeniedError("agents take part in no election")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lease in self._leases:
            lease._stop()
        for c in self._channels:
            await c.close()
