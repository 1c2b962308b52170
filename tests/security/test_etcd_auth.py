"""The scheduler against an etcd with authentication enabled (``--etcd-user`` and the password from
``$SPIDERFLOW_ETCD_PASSWORD``), as real processes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from security_harness import submit_tiny_job_to_success

from spiderflow.core.errors import SpiderFlowError
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.store import keys
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "etcd-secret-pw"


@pytest.fixture
def auth_etcd() -> Iterator[EtcdProcess]:
    proc = EtcdProcess()
    try:
        proc.start()
        for args in (["user", "add", f"root:{PASSWORD}"], ["auth", "enable"]):
            r = subprocess.run(["etcdctl", "--endpoints", proc.endpoint, *args], capture_output=True, text=True,
                               env={**os.environ, "ETCDCTL_API": "3"}, timeout=30)
            assert r.returncode == 0, r.stderr
        yield proc
    finally:
        proc.close()


def _argv(etcd: str, *extra: str) -> list[str]:
    return spiderflow_argv("serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd, "--topology",
                           str(ROOT / "examples/topology-3.yaml"), "--executor", "sim", "--sim-min-s", "0.1",
                           "--sim-max-s", "0.2", "--cycle-interval", "1", "--log-format", "json", *extra)


async def test_scheduler_with_etcd_authentication(auth_etcd: EtcdProcess, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPIDERFLOW_ETCD_PASSWORD"}
    r = subprocess.run(_argv(auth_etcd.endpoint, "--etcd-user", "root"), capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2 and "SPIDERFLOW_ETCD_PASSWORD" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    sched = ManagedProcess("sched", _argv(auth_etcd.endpoint, "--etcd-user", "root"), log_dir=tmp_path,
                           env={"SPIDERFLOW_ETCD_PASSWORD": PASSWORD}).start(timeout=60)
    try:
        await submit_tiny_job_to_success(sched.address, "e1")
    finally:
        sched.stop()
    # Without credentials etcd refuses to read the jobs; with them they are there.
    anonymous = EtcdStore(auth_etcd.endpoint, request_timeout=2.0)
    try:
        with pytest.raises(SpiderFlowError):
            await anonymous.get_prefix(keys.JOBS)
    finally:
        await anonymous.close()
    root = EtcdStore(auth_etcd.endpoint, username="root", password=PASSWORD)
    try:
        jobs, _ = await root.get_prefix(keys.JOBS)
        assert len(jobs) == 1
    finally:
        await root.close()
