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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile (or load) the numba kernels once, in this process, before any test starts a service: after
    a change to a kernel's module, the first processes to need it would otherwise each compile every kernel
    at once (a minute of CPU apiece on this machine), racing their own start-up deadlines."""
    from spiderflow.core.kernels import warm
    from spiderflow.kernel_cache import drop_stale

    drop_stale()  # a kernel whose callee in another module changed must not load from the cache
    warm()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``heavy`` (multi-minute training across many processes) run only when asked for:
    ``SPIDERFLOW_HEAVY_TESTS=1`` or a ``-m`` expression naming ``heavy``; the default run stays within the
    suite's time budget on a 2-core machine."""
    import os

    if os.environ.get("SPIDERFLOW_HEAVY_TESTS") == "1" or "heavy" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="heavy: run with SPIDERFLOW_HEAVY_TESTS=1 (or -m heavy)")
    for item in items:
        if item.get_closest_marker("heavy") is not None:
            item.add_marker(skip)
