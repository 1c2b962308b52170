"""Fixtures of the launcher tests: one real single-node Slurm cluster per session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster, missing_binaries


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """A real Slurm cluster (munged, slurmctld, slurmd; 4 CPU slots) for the whole session, stopped by PID
    afterwards. Skipped, with the reason, where the packages are missing or the tests do not run as root."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed (missing {', '.join(missing)}; scripts/bootstrap.sh installs "
                    "slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        pytest.skip("a test Slurm cluster runs its daemons as root")
    cluster = SlurmCluster().start()
    try:
        yield cluster
    finally:
        cluster.close()
