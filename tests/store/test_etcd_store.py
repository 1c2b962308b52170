"""EtcdStore against a real etcd process: restarts, SIGSTOP outages, lease loss, connection errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio
import pytest

from spiderflow.core.errors import NotFoundError, UnavailableError, ValidationError
from spiderflow.store import CompactedError, EtcdStore, NotLeaderError, WatchEvent
from spiderflow.store.base import Watch
from spiderflow.store.etcd import map_rpc_error
from spiderflow.store.process import EtcdProcess, free_port

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


async def next_event(w: Watch, timeout: float = 10.0) -> WatchEvent:
    return await asyncio.wait_for(w.__anext__(), timeout)


async def eventually(fn: Callable[[], Awaitable[T]], timeout: float = 10.0) -> T:
    """Retry ``fn`` while it raises UnavailableError (the channel reconnecting after an outage)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await fn()
        except UnavailableError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_watch_resumes_from_its_revision_after_restart(etcd: EtcdProcess) -> None:
    watcher = EtcdStore(etcd.endpoint, request_timeout=2.0, stream_retry_s=15.0)
    writer = EtcdStore(etcd.endpoint, request_timeout=2.0)
    try:
        r1 = await writer.put("/w/a", b"1")
        w = await watcher.watch_prefix("/w/", start_revision=r1).start()
        assert (await next_event(w)).mod_revision == r1
        etcd.restart()  # same data dir and ports
        # Written while the watcher's stream is dead and before it is read again: a resume "from now"
        # would miss these; resuming from the last delivered revision + 1 must not.
        r2 = await eventually(lambda: writer.put("/w/b", b"2"))
        r3 = await writer.put("/w/a", b"3")
        got = [await next_event(w, 15.0), await next_event(w, 15.0)]
        assert [(e.key, e.mod_revision) for e in got] == [("/w/b", r2), ("/w/a", r3)]
        assert got[1].prev_value == b"1"
        assert (await writer.get("/w/a")).create_revision == r1  # type: ignore[union-attr]
        etcd.restart()
        r4 = await eventually(lambda: writer.put("/w/c", b"4"))
        ev = await next_event(w, 15.0)
        assert (ev.key, ev.mod_revision) == ("/w/c", r4)
        await w.aclose()
    finally:
        await watcher.close()
        await writer.close()


async def test_lease_keepalive_survives_restart(etcd: EtcdProcess) -> None:
    store = EtcdStore(etcd.endpoint, request_timeout=1.0)
    try:
        lease = await store.grant(2)
        await store.put("/clusters/a", b"reg", lease=lease)
        etcd.restart()
        await asyncio.sleep(3.0)  # > TTL: only the keep-alive (reconnected) can have kept it
        kv = await eventually(lambda: store.get("/clusters/a"))
        assert kv is not None and lease.alive
        await lease.revoke()
    finally:
        await store.close()


async def test_sigstop_makes_calls_unavailable_within_deadline_and_sigcont_recovers(etcd: EtcdProcess) -> None:
    store = EtcdStore(etcd.endpoint, request_timeout=1.0)
    loop = asyncio.get_running_loop()
    try:
        r1 = await store.put("/k", b"1")
        async with store.watch_prefix("/k", start_revision=r1 + 1) as w:
            etcd.suspend()
            try:
                for call in (lambda: store.get("/k"), lambda: store.put("/k", b"2"), store.revision):
                    t0 = loop.time()
                    with pytest.raises(UnavailableError):
                        await call()
                    assert loop.time() - t0 < 2.5
            finally:
                etcd.resume()
            kv = await eventually(lambda: store.get("/k"), 5.0)
            # A write that timed out has an unknown outcome: etcd may apply the buffered request
            # once it runs again. Reads and writes work again either way.
            assert kv is not None and kv.value in (b"1", b"2")
            r2 = await store.put("/k", b"3")
            ev = await next_event(w)
            if ev.value == b"2":  # the timed-out put, applied after SIGCONT
                ev = await next_event(w)
            assert (ev.value, ev.mod_revision) == (b"3", r2)
    finally:
        await store.close()


async def test_lease_and_leadership_lost_while_etcd_is_stopped(etcd: EtcdProcess) -> None:
    store = EtcdStore(etcd.endpoint, request_timeout=0.5)
    lost: list[str] = []
    try:
        lease = await store.grant(1, on_lost=lambda ls: lost.append(ls.lost_reason))
        await store.put("/clusters/a", b"reg", lease=lease)
        led = await store.campaign("/el/sched", b"me", lease)
        etcd.suspend()
        try:
            await asyncio.wait_for(lease.lost.wait(), 3.0)
            assert lost and "TTL" in lost[0]
            assert not led.is_leader
        finally:
            etcd.resume()
        # The server expires the unrefreshed lease once it runs again.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while await eventually(lambda: store.get("/clusters/a")) is not None:
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
        assert await store.leader("/el/sched") is None
    finally:
        await store.close()


async def test_stopped_or_missing_etcd_is_unavailable(etcd: EtcdProcess) -> None:
    store = EtcdStore(etcd.endpoint, request_timeout=1.0)
    nobody = EtcdStore(f"127.0.0.1:{free_port()}", request_timeout=1.0)
    try:
        await store.put("/k", b"1")
        etcd.stop()
        with pytest.raises(UnavailableError):
            await store.get("/k")
        with pytest.raises(UnavailableError):
            await nobody.put("/k", b"1")
        etcd.start()
        kv = await eventually(lambda: store.get("/k"))
        assert kv is not None and kv.value == b"1"
    finally:
        await store.close()
        await nobody.close()
    with pytest.raises(UnavailableError):
        await store.get("/k")  # closed


@pytest.mark.parametrize(
    ("code", "details", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "connection refused", UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", UnavailableError),
        (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found", NotFoundError),
        (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted", CompactedError),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: too many operations in txn request", ValidationError),
        (grpc.StatusCode.UNKNOWN, "election: not leader", NotLeaderError),
        (grpc.StatusCode.UNKNOWN, "election: no leader", NotFoundError),
    ],
)
def test_rpc_errors_map_to_domain_errors(code: grpc.StatusCode, details: str, expected: type) -> None:
    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    assert type(map_rpc_error(exc)) is expected


def test_endpoint_is_validated() -> None:
    with pytest.raises(ValidationError):
        EtcdStore("localhost")


async def test_leadership_and_observation_survive_restart(etcd: EtcdProcess) -> None:
    store = EtcdStore(etcd.endpoint, request_timeout=1.0, stream_retry_s=15.0)
    try:
        lease_a = await store.grant(3)
        lease_b = await store.grant(3)
        a = await store.campaign("/el/svc", b"a", lease_a)
        observed = store.observe("/el/svc")
        assert (await asyncio.wait_for(observed.__anext__(), 5)).value == b"a"
        b_task = asyncio.create_task(store.campaign("/el/svc", b"b", lease_b))
        await asyncio.sleep(0.3)
        etcd.restart()
        await asyncio.sleep(1.0)
        assert a.is_leader and not b_task.done()  # leases kept alive across the restart
        leader = await eventually(lambda: store.leader("/el/svc"))
        assert leader is not None and leader.key == a.key
        await eventually(lambda: a.proclaim(b"a2"))
        assert (await asyncio.wait_for(observed.__anext__(), 10)).value == b"a2"
        await lease_a.revoke()
        b = await asyncio.wait_for(b_task, 10)
        assert b.is_leader
        await asyncio.wait_for(a.wait_lost(), 5)
        assert (await asyncio.wait_for(observed.__anext__(), 10)).value == b"b"
        await observed.aclose()
        await b.resign()
        await lease_b.revoke()
    finally:
        await store.close()
