"""The Store contract (spiderflow.store.base), run against MemoryStore, a real etcd process, and a real etcd
with client TLS and users (the store connecting with the etcd-client bundle and a password)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from spiderflow.core.errors import AlreadyExistsError, ConflictError, NotFoundError, ValidationError
from spiderflow.store import (
    CompactedError,
    Compare,
    CompareFailedError,
    EventType,
    MemoryStore,
    NotLeaderError,
    Put,
    Store,
    WatchEvent,
    absent,
    unchanged,
)
from spiderflow.store.base import Watch, election_key
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess
from spiderflow.store.tls import EtcdTLS

pytestmark = pytest.mark.timeout(60)

PASSWORD = "contract-pw-0123"


@pytest.fixture(scope="module")
def etcd_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spiderflow.security.certs import init_certs

    d = tmp_path_factory.mktemp("etcd-certs")
    init_certs(d, admin=False)
    return d


@pytest.fixture
def secure_etcd(etcd_certs: Path) -> Iterator[EtcdProcess]:
    """etcd serving TLS with client certificates required, authentication enabled (user root)."""
    proc = EtcdProcess(tls=EtcdTLS.from_dir(etcd_certs / "etcd-server", require_cert=True))
    client = etcd_certs / "etcd-client"
    try:
        proc.start()
        for args in (["user", "add", f"root:{PASSWORD}"], ["auth", "enable"]):
            r = subprocess.run(["etcdctl", "--endpoints", proc.url, "--cacert", str(client / "ca.crt"), "--cert",
                                str(client / "tls.crt"), "--key", str(client / "tls.key"), *args],
                               capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
            assert r.returncode == 0, r.stderr
        yield proc
    finally:
        proc.close()


@pytest.fixture(params=["memory", "etcd", "etcd-tls-auth"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    s: Store
    if request.param == "memory":
        s = MemoryStore(request_timeout=1.0)
    elif request.param == "etcd":
        proc = request.getfixturevalue("etcd")
        s = EtcdStore(proc.endpoint, request_timeout=2.0, stream_retry_s=10.0)
    else:
        proc = request.getfixturevalue("secure_etcd")
        tls = EtcdTLS.from_dir(request.getfixturevalue("etcd_certs") / "etcd-client")
        s = EtcdStore(proc.endpoint, request_timeout=2.0, stream_retry_s=10.0, tls=tls, username="root",
                      password=PASSWORD)
    try:
        yield s
    finally:
        await s.close()


async def next_event(w: Watch, timeout: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(w.__anext__(), timeout)


async def wait_until_absent(store: Store, key: str, timeout: float) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while await store.get(key) is not None:
        if loop.time() - t0 > timeout:
            raise AssertionError(f"{key} still present after {timeout}s")
        await asyncio.sleep(0.05)
    return loop.time() - t0


async def test_put_get_revisions(store: Store) -> None:
    r0 = await store.revision()
    r1 = await store.put("/t/a", b"1")
    assert r1 == r0 + 1
    r2 = await store.put("/t/a", b"2")
    assert r2 == r1 + 1
    kv = await store.get("/t/a")
    assert kv is not None
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (b"2", r1, r2, 2, 0)
    assert await store.get("/t/missing") is None
    await store.put("/t/c", b"3")
    await store.put("/t/b", b"4")
    await store.put("/u/x", b"5")
    items, rev = await store.get_prefix("/t/")
    assert [kv.key for kv in items] == ["/t/a", "/t/b", "/t/c"]
    assert rev == await store.revision()
    both, rev2 = await store.get_prefixes(["/t/", "/u/", "/none/"])
    assert rev2 == rev
    assert [kv.key for kv in both["/t/"]] == ["/t/a", "/t/b", "/t/c"]
    assert [kv.value for kv in both["/u/"]] == [b"5"] and both["/none/"] == []
    assert await store.delete("/t/b") is True
    assert await store.delete("/t/b") is False
    assert await store.delete_prefix("/t/") == 2
    assert (await store.get_prefix("/t/"))[0] == []
    assert await store.get("/u/x") is not None


async def test_put_if_absent(store: Store) -> None:
    rev = await store.put_if_absent("/reg/a", b"first")
    with pytest.raises(AlreadyExistsError):
        await store.put_if_absent("/reg/a", b"second")
    kv = await store.get("/reg/a")
    assert kv is not None and kv.value == b"first" and kv.mod_revision == rev


async def test_compare_and_swap(store: Store) -> None:
    r1 = await store.compare_and_swap("/cas/k", b"v1", 0)  # 0 = must be absent
    with pytest.raises(CompareFailedError) as info:
        await store.compare_and_swap("/cas/k", b"again", 0)
    assert info.value.current == {"/cas/k": r1}
    r2 = await store.compare_and_swap("/cas/k", b"v2", r1)
    with pytest.raises(ConflictError):  # stale read loses
        await store.compare_and_swap("/cas/k", b"stale", r1)
    kv = await store.get("/cas/k")
    assert kv is not None and kv.value == b"v2" and kv.mod_revision == r2
    with pytest.raises(CompareFailedError):
        await store.delete_if("/cas/k", r1)
    await store.delete_if("/cas/k", r2)
    assert await store.get("/cas/k") is None
    with pytest.raises(CompareFailedError) as gone:
        await store.delete_if("/cas/k", r2)
    assert gone.value.current == {"/cas/k": 0}


async def test_commit_is_atomic_over_several_keys(store: Store) -> None:
    ra = await store.put("/alloc/a", b"{}")
    rb = await store.put("/alloc/b", b"{}")
    job = await store.put("/jobs/j1", b"queued")
    a = await store.get("/alloc/a")
    assert a is not None
    # One compare fails (b moved on): nothing is written, the failed key is named.
    rb2 = await store.put("/alloc/b", b'{"other": 4}')
    with pytest.raises(CompareFailedError) as info:
        await store.commit(
            [unchanged(a), Compare(key="/alloc/b", mod_revision=rb), Compare(key="/jobs/j1", mod_revision=job),
             absent("/plans/j1")],
            [Put(key="/alloc/a", value=b'{"j1": 8}'), Put(key="/alloc/b", value=b'{"j1": 8}'),
             Put(key="/jobs/j1", value=b"bound"), Put(key="/plans/j1", value=b"plan")],
            ["/queue/j1"],
        )
    assert info.value.keys == ("/alloc/b",) and info.value.current == {"/alloc/b": rb2}
    assert (await store.get("/alloc/a")).value == b"{}"  # type: ignore[union-attr]
    assert (await store.get("/jobs/j1")).value == b"queued"  # type: ignore[union-attr]
    assert await store.get("/plans/j1") is None
    # With fresh revisions it applies everything at one revision.
    await store.put("/queue/j1", b"j1")
    rev = await store.commit(
        [Compare(key="/alloc/a", mod_revision=ra), Compare(key="/alloc/b", mod_revision=rb2),
         Compare(key="/jobs/j1", mod_revision=job), absent("/plans/j1")],
        [Put(key="/alloc/a", value=b'{"j1": 8}'), Put(key="/alloc/b", value=b'{"j1": 8}'),
         Put(key="/jobs/j1", value=b"bound"), Put(key="/plans/j1", value=b"plan")],
        ["/queue/j1"],
    )
    assert rev == rb2 + 2
    for key in ("/alloc/a", "/alloc/b", "/jobs/j1", "/plans/j1"):
        kv = await store.get(key)
        assert kv is not None and kv.mod_revision == rev
    assert await store.get("/queue/j1") is None
    assert await store.commit([unchanged(kv)]) == rev  # read-only check: no new revision
    with pytest.raises(ValidationError):
        await store.commit([], [Put(key="/x", value=b"1")], ["/x"])


async def test_commit_deletes_prefixes_in_the_same_transaction(store: Store) -> None:
    job = await store.put("/jobs/old", b"done")
    for i in range(300):  # more keys than one transaction may name: a prefix is one operation
        await store.put(f"/metrics/old/{i:04d}", b"[]")
    await store.put("/metrics/older", b"keep")  # shares the text but not the prefix "/metrics/old/"
    moved = await store.put("/jobs/old", b"changed")
    with pytest.raises(CompareFailedError):
        await store.commit([Compare(key="/jobs/old", mod_revision=job)], deletes=["/jobs/old"],
                           delete_prefixes=["/metrics/old/"])
    assert len((await store.get_prefix("/metrics/old/"))[0]) == 300
    rev = await store.commit([Compare(key="/jobs/old", mod_revision=moved)], deletes=["/jobs/old"],
                             delete_prefixes=["/metrics/old/", "/reports/none/"])
    assert rev == moved + 1
    assert await store.get("/jobs/old") is None
    assert (await store.get_prefix("/metrics/old/"))[0] == []
    assert await store.get("/metrics/older") is not None
    with pytest.raises(ValidationError, match="delete_prefixes"):
        await store.commit([], delete_prefixes=[""])
    with pytest.raises(ValidationError):
        await store.commit([], [Put(key="/metrics/new/1", value=b"1")], delete_prefixes=["/metrics/new/"])


async def test_commit_size_limit(store: Store) -> None:
    # 1024 writes in one transaction work (a long chain's allocations + assignments); more are refused.
    many = [Put(key=f"/alloc/{i:04d}", value=b"1") for i in range(1024)]
    rev = await store.commit([absent("/jobs/big")], many)
    items, _ = await store.get_prefix("/alloc/")
    assert len(items) == 1024 and {kv.mod_revision for kv in items} == {rev}
    with pytest.raises(ValidationError):
        await store.commit([], [*many, Put(key="/alloc/extra", value=b"1")])
    assert await store.get("/alloc/extra") is None


async def test_concurrent_binders_exactly_one_wins(store: Store) -> None:
    await store.put("/alloc/a", b"0")
    await store.put("/alloc/b", b"0")
    await store.put("/alloc/c", b"0")

    # Both read before either commits (without the barrier, a slow store can let one binder read after the
    # other's commit, and then both rightly win).
    both_read = asyncio.Barrier(2)

    async def bind(job: str, clusters: list[str]) -> bool:
        snapshot = [await store.get(f"/alloc/{c}") for c in clusters]
        await both_read.wait()
        try:
            await store.commit([unchanged(kv) for kv in snapshot if kv is not None],
                               [Put(key=f"/alloc/{c}", value=job.encode()) for c in clusters])
        except ConflictError:
            return False
        return True

    won = await asyncio.gather(bind("j1", ["a", "b"]), bind("j2", ["b", "c"]))
    assert sorted(won) == [False, True]
    winner = "j1" if won[0] else "j2"
    values = {kv.key: kv.value for kv in (await store.get_prefix("/alloc/"))[0]}
    assert values["/alloc/b"] == winner.encode()
    assert values["/alloc/a"] == (b"j1" if winner == "j1" else b"0")
    assert values["/alloc/c"] == (b"j2" if winner == "j2" else b"0")


async def test_lease_expiry_removes_keys(store: Store) -> None:
    lost: list[int] = []
    lease = await store.grant(1, keepalive=False, on_lost=lambda ls: lost.append(ls.id))
    assert lease.ttl >= 1 and lease.alive
    rev = await store.put("/clusters/a", b"reg", lease=lease)
    await store.put("/clusters/b", b"reg", lease=lease.id)
    kv = await store.get("/clusters/a")
    assert kv is not None and kv.lease == lease.id
    async with store.watch_prefix("/clusters/", start_revision=rev + 2) as w:
        deletes = {(await next_event(w, 5.0)).key, (await next_event(w, 5.0)).key}
    assert deletes == {"/clusters/a", "/clusters/b"}
    assert (await store.get_prefix("/clusters/"))[0] == []
    await asyncio.wait_for(lease.lost.wait(), 2.0)
    assert lost == [lease.id] and not lease.alive
    with pytest.raises(NotFoundError):
        await store.put("/clusters/c", b"late", lease=lease)


async def test_keepalive_keeps_keys_and_revoke_removes_them(store: Store) -> None:
    lost: list[int] = []
    lease = await store.grant(1, on_lost=lambda ls: lost.append(ls.id))
    await store.put("/clusters/a", b"reg", lease=lease)
    await asyncio.sleep(2.6)  # > 2 TTLs (+ etcd's 0.5 s expiry tick)
    assert await store.get("/clusters/a") is not None
    assert lease.alive and not lost
    assert await lease.refresh() >= 1
    await lease.revoke()
    assert await store.get("/clusters/a") is None
    assert not lease.alive and not lease.lost.is_set() and not lost
    await lease.revoke()  # idempotent


async def test_watch_replays_from_a_past_revision_then_follows(store: Store) -> None:
    r1 = await store.put("/w/a", b"1")
    r2 = await store.put("/w/a", b"2")
    await store.put("/other", b"x")
    r3 = await store.put("/w/b", b"3")
    r4 = (await store.commit([], [Put(key="/w/c", value=b"4")], ["/w/b"]))
    w = store.watch_prefix("/w/", start_revision=r2)
    assert w.revision == r2 - 1
    seen = [await next_event(w) for _ in range(4)]
    assert [(e.type, e.key, e.value, e.mod_revision) for e in seen] == [
        (EventType.PUT, "/w/a", b"2", r2),
        (EventType.PUT, "/w/b", b"3", r3),
        (EventType.PUT, "/w/c", b"4", r4),
        (EventType.DELETE, "/w/b", b"", r4),  # a commit's puts, then its deletes, at one revision
    ]
    assert seen[0].prev_value == b"1" and seen[0].create_revision == r1
    assert w.revision == r4
    r5 = await store.put("/w/a", b"5")
    ev = await next_event(w)
    assert (ev.key, ev.value, ev.mod_revision, ev.prev_value) == ("/w/a", b"5", r5, b"2")
    await w.aclose()
    with pytest.raises(StopAsyncIteration):
        await w.__anext__()


async def test_list_then_watch_has_no_gap(store: Store) -> None:
    await store.put("/lw/a", b"1")
    _, rev = await store.get_prefix("/lw/")
    r2 = await store.put("/lw/b", b"2")  # after the list, before the watch starts
    async with store.watch_prefix("/lw/", start_revision=rev + 1) as w:
        ev = await next_event(w)
        assert (ev.key, ev.mod_revision) == ("/lw/b", r2)
    async with store.watch_prefix("/lw/") as now:  # None = changes after establishment only
        r3 = await store.put("/lw/c", b"3")
        ev = await next_event(now)
        assert (ev.key, ev.mod_revision) == ("/lw/c", r3)


async def test_watch_from_compacted_revision_raises(store: Store) -> None:
    r1 = await store.put("/cmp/a", b"1")
    await store.put("/cmp/a", b"2")
    r3 = await store.put("/cmp/a", b"3")
    await store.compact(r3)
    stale = store.watch_prefix("/cmp/", start_revision=r1)
    with pytest.raises(CompactedError) as info:  # on start or on the first read
        await next_event(stale)
    assert info.value.compact_revision == r3
    await stale.aclose()
    async with store.watch_prefix("/cmp/", start_revision=r3) as w:
        ev = await next_event(w)
        assert (ev.value, ev.mod_revision) == (b"3", r3)


async def test_leader_election_and_failover_on_lease_revoke(store: Store) -> None:
    name = "/spiderflow/v1/elections/scheduler"
    assert await store.leader(name) is None
    lease_a = await store.grant(5)
    lease_b = await store.grant(5)
    a = await store.campaign(name, b"replica-a", lease_a)
    assert a.is_leader and a.key == election_key(name, lease_a.id)
    observed = store.observe(name)
    first = await asyncio.wait_for(observed.__anext__(), 5)
    assert (first.key, first.value) == (a.key, b"replica-a")

    b_task = asyncio.create_task(store.campaign(name, b"replica-b", lease_b))
    await asyncio.sleep(0.3)
    assert not b_task.done()  # blocks while a leads
    leader = await store.leader(name)
    assert leader is not None and leader.value == b"replica-a" and leader.lease == lease_a.id

    await a.proclaim(b"replica-a:v2")
    ev = await asyncio.wait_for(observed.__anext__(), 5)
    assert (ev.key, ev.value) == (a.key, b"replica-a:v2")

    await lease_a.revoke()  # the leader dies: its key goes, b takes over
    b = await asyncio.wait_for(b_task, 5)
    assert b.is_leader and b.key == election_key(name, lease_b.id)
    await asyncio.wait_for(a.wait_lost(), 5)
    assert not a.is_leader
    with pytest.raises(NotLeaderError):
        await a.proclaim(b"ghost")
    ev = await asyncio.wait_for(observed.__anext__(), 5)
    assert (ev.key, ev.value) == (b.key, b"replica-b")
    leader = await store.leader(name)
    assert leader is not None and leader.lease == lease_b.id

    lease_c = await store.grant(5)
    c_task = asyncio.create_task(store.campaign(name, b"replica-c", lease_c))
    await asyncio.sleep(0.2)
    assert not c_task.done()
    await b.resign()
    c = await asyncio.wait_for(c_task, 5)
    assert c.is_leader and not b.is_leader
    ev = await asyncio.wait_for(observed.__anext__(), 5)
    assert ev.value == b"replica-c"
    await observed.aclose()
    await c.resign()
    assert await store.leader(name) is None
    await lease_b.revoke()
    await lease_c.revoke()


async def test_cancelled_campaign_withdraws(store: Store) -> None:
    name = "/el/svc"
    lease_a = await store.grant(5)
    lease_b = await store.grant(5)
    a = await store.campaign(name, b"a", lease_a)
    b_task = asyncio.create_task(store.campaign(name, b"b", lease_b))
    await asyncio.sleep(0.3)
    b_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b_task
    await asyncio.sleep(0.2)
    items, _ = await store.get_prefix(name + "/")
    assert [kv.key for kv in items] == [a.key]
    await a.resign()
    await lease_a.revoke()
    await lease_b.revoke()


async def test_leadership_lost_when_lease_expires(store: Store) -> None:
    lease = await store.grant(1, keepalive=False)
    led = await store.campaign("/el/short", b"x", lease)
    await asyncio.wait_for(led.wait_lost(), 4)
    await wait_until_absent(store, led.key, 3)
    assert await store.leader("/el/short") is None
