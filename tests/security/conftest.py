"""Fixtures of the security tests: one certificate directory and one real etcd per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spiderflow.security.certs import init_certs
from spiderflow.store.process import EtcdProcess

CLUSTERS = ("virginia", "ohio", "oregon")
TENANTS = ("alice", "bob")


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with bundles for the three services, the clusters of examples/topology-3.yaml, two tenants
    and the admin."""
    d = tmp_path_factory.mktemp("certs")
    init_certs(d, clusters=CLUSTERS, tenants=TENANTS)
    return d


@pytest.fixture(scope="session")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, unrelated CA (its certificates must be refused)."""
    d = tmp_path_factory.mktemp("other-certs")
    init_certs(d, tenants=("alice",))
    return d


@pytest.fixture(scope="module")
def module_etcd() -> Iterator[EtcdProcess]:
    proc = EtcdProcess()
    try:
        proc.start()
        yield proc
    finally:
        proc.close()
