"""Shared pytest fixtures (keep each one small and generic)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from spiderflow.store.process import EtcdProcess

# Property tests are derandomised (the same examples every run) so the suite is deterministic; the long
# randomised runs are benchmarks (bench/fuzz.py).
settings.register_profile("spiderflow", derandomize=True, deadline=None, database=None)
settings.load_profile("spiderflow")


@pytest.fixture
def etcd() -> Iterator[EtcdProcess]:
    """A real single-member etcd on 127.0.0.1 free ports with a temp data dir (fast election flags).

    Always killed and its data dir removed afterwards, even if the test suspended or stopped it."""
    proc = EtcdProcess()
    try:
        proc.start()
        yield proc
    finally:
        proc.close()
