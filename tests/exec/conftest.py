"""Fixtures of the execution tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from exec_harness import Launcher, stop_fork_server


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    lc = Launcher(tmp_path)
    try:
        yield lc
    finally:
        lc.close()
        assert all(p.poll() is not None for p in lc.procs), "a worker process outlived its test"
        assert all(not p.is_alive() for p in lc.forked), "a forked rank outlived its test"


@pytest.fixture(scope="session", autouse=True)
def _fork_server() -> Iterator[None]:
    """The fork server used by forked ranks lives for the session and is stopped at its end."""
    yield
    stop_fork_server()
