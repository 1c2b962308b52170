"""MemoryStore specifics: injected unavailability (for callers' unit tests)."""

from __future__ import annotations

import asyncio

import pytest

from spiderflow.core.errors import UnavailableError, ValidationError
from spiderflow.store import MemoryStore

pytestmark = pytest.mark.timeout(30)


async def test_injected_outage_fails_requests_and_loses_leases() -> None:
    store = MemoryStore(request_timeout=0.2)
    lost: list[str] = []
    lease = await store.grant(1, on_lost=lambda ls: lost.append(ls.lost_reason))
    await store.put("/clusters/a", b"reg", lease=lease)
    store.set_available(False)
    with pytest.raises(UnavailableError):
        await store.get("/clusters/a")
    with pytest.raises(UnavailableError):
        await store.put("/x", b"1")
    await asyncio.wait_for(lease.lost.wait(), 3.0)
    assert lost and "TTL" in lost[0]
    store.set_available(True)
    assert await store.get("/clusters/a") is None  # the "server" expired it meanwhile
    await store.close()
    with pytest.raises(UnavailableError):
        await store.get("/x")


async def test_argument_validation() -> None:
    store = MemoryStore()
    with pytest.raises(ValidationError):
        await store.grant(0)
    with pytest.raises(ValidationError):
        store.watch_prefix("/a", start_revision=0)
    with pytest.raises(ValidationError):
        await store.put("", b"x")
    await store.close()
