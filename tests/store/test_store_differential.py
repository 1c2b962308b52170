"""Differential test: random operation sequences give identical results on MemoryStore and real etcd.

Revisions are compared relative to the revision at the start of each sequence; every outcome
(returned revisions, values, conflicts with the keys they name, final listing, the watch history
replayed from the start) must match exactly."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from spiderflow.core.errors import AlreadyExistsError, SpiderFlowError
from spiderflow.store import CompareFailedError, EtcdStore, MemoryStore, Put, Store
from spiderflow.store.base import Compare
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(60)

KEYS = [f"/d/{c}" for c in "abcde"]


def _ops(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    ops: list[tuple[Any, ...]] = []
    for i in range(n):
        kind = str(rng.choice(["put", "pia", "cas", "del", "delif", "commit", "get"]))
        key = str(rng.choice(KEYS))
        value = f"v{i}".encode()
        guess = int(rng.integers(0, 8))  # a relative revision, often stale, sometimes right, 0 = absent
        if kind == "commit":
            picked = [str(k) for k in rng.choice(KEYS, size=int(rng.integers(1, 4)), replace=False)]
            n_cmp = int(rng.integers(0, len(picked) + 1))
            compares = [(k, int(rng.integers(0, 8))) for k in picked[:n_cmp]]
            writes = picked[int(rng.integers(0, len(picked))):]
            puts = [k for k in writes if rng.random() < 0.7]
            deletes = [k for k in writes if k not in puts]
            ops.append((kind, compares, puts, deletes, value))
        else:
            ops.append((kind, key, value, guess))
    return ops


async def _run(store: Store, ops: list[tuple[Any, ...]]) -> list[Any]:
    base = await store.revision()
    current: dict[str, int] = {}  # relative mod revisions seen so far, to make some compares true

    def rel(rev: int) -> int:
        return rev - base if rev else 0

    def absolute(key: str, guess: int) -> int:
        if guess == 0:
            return 0
        if guess % 2 == 0 and key in current:  # about half the time, the right revision
            return current[key] + base
        return guess + base

    out: list[Any] = []
    for op in ops:
        try:
            if op[0] == "commit":
                _, compares, puts, deletes, value = op
                r = await store.commit(
                    [Compare(key=k, mod_revision=absolute(k, g)) for k, g in compares],
                    [Put(key=k, value=value) for k in puts],
                    deletes,
                )
                res: Any = ("ok", rel(r))
            else:
                kind, key, value, guess = op
                if kind == "put":
                    res = ("ok", rel(await store.put(key, value)))
                elif kind == "pia":
                    res = ("ok", rel(await store.put_if_absent(key, value)))
                elif kind == "cas":
                    res = ("ok", rel(await store.compare_and_swap(key, value, absolute(key, guess))))
                elif kind == "del":
                    res = ("ok", await store.delete(key))
                elif kind == "delif":
                    res = ("ok", rel(await store.delete_if(key, absolute(key, guess) or base + 1)))
                else:
                    kv = await store.get(key)
                    res = ("ok", None if kv is None else (kv.value, rel(kv.create_revision), rel(kv.mod_revision),
                                                          kv.version))
        except CompareFailedError as exc:
            res = ("conflict", sorted((k, rel(v)) for k, v in exc.current.items()))
        except AlreadyExistsError:
            res = ("exists",)
        except SpiderFlowError as exc:
            res = ("error", type(exc).__name__)
        out.append(res)
        for kv in (await store.get_prefix("/d/"))[0]:
            current[kv.key] = rel(kv.mod_revision)
        for k in [k for k in current if await store.get(k) is None]:
            del current[k]
    items, rev = await store.get_prefix("/d/")
    out.append(("final", rel(rev), [(kv.key, kv.value, rel(kv.create_revision), rel(kv.mod_revision), kv.version)
                                   for kv in items]))
    history = []
    async with store.watch_prefix("/d/", start_revision=base + 1) as w:
        while w.revision < rev:
            ev = await asyncio.wait_for(w.__anext__(), 5)
            history.append((ev.type.value, ev.key, ev.value, rel(ev.mod_revision), ev.prev_value))
    out.append(("history", history))
    await store.delete_prefix("/d/")
    return out


async def test_random_sequences_match_etcd(etcd: EtcdProcess) -> None:
    real = EtcdStore(etcd.endpoint, request_timeout=2.0)
    try:
        for seed in range(6):
            ops = _ops(np.random.default_rng(seed), 40)
            fake = MemoryStore()
            expected = await _run(real, ops)
            got = await _run(fake, ops)
            await fake.close()
            assert got == expected, f"seed {seed}"
            outcomes = {r[0] for r in expected[:-2]}
            assert {"ok", "conflict"} <= outcomes  # the sequences exercise both paths
    finally:
        await real.close()
