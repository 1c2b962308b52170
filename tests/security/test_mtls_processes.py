"""mTLS end to end with real processes: planner and scheduler started with ``--tls-dir``, the scheduler
calling the planner as ``service:scheduler``, tenants using the CLI with their bundles; and the refusal to
serve plaintext on a non-loopback address without an explicit flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.store.process import EtcdProcess

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGY = ROOT / "examples/topology-3.yaml"


@pytest.fixture(scope="module")
def mesh(module_etcd: EtcdProcess, certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("mtls-logs")
    planner = ManagedProcess("planner", spiderflow_argv(
        "serve", "planner", "--listen", "127.0.0.1:0", "--tls-dir", str(certs / "planner"), "--log-format", "json",
    ), log_dir=logs).start(timeout=60)
    sched: ManagedProcess | None = None
    try:
        sched = ManagedProcess("sched", spiderflow_argv(
            "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", module_etcd.endpoint, "--topology",
            str(TOPOLOGY), "--planner", planner.address, "--executor", "sim", "--sim-min-s", "0.2",
            "--sim-max-s", "0.3", "--cycle-interval", "1", "--tls-dir", str(certs / "scheduler"),
            "--log-format", "json",
        ), log_dir=logs).start(timeout=60)
        yield sched.address
    finally:
        if sched is not None:
            sched.stop()
        planner.stop()


def cli(*args: str, address: str, tls: Path | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPIDERFLOW_CONFIG": "/nonexistent/config.yaml", "SPIDERFLOW_SCHEDULER": address}
    env.pop("SPIDERFLOW_TLS_DIR", None)
    if tls is not None:
        env["SPIDERFLOW_TLS_DIR"] = str(tls)
    return subprocess.run([sys.executable, "-m", "spiderflow.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def test_tenants_over_mtls_with_the_planner(mesh: str, certs: Path) -> None:
    r = cli("submit", "--model", "gpt-tiny", "--id", "m-1", "--gpus", "1:2", "--seq-len", "64", "--steps", "3",
            "--watch", "--json", address=mesh, tls=certs / "tenant-alice")
    assert r.returncode == 0, r.stderr
    r = cli("status", "m-1", "--json", address=mesh, tls=certs / "tenant-alice")
    doc = json.loads(r.stdout)
    assert doc["state"] == "SUCCEEDED" and doc["spec"]["tenant"] == "alice" and doc["plan"]["stages"]
    r = cli("status", "m-1", address=mesh, tls=certs / "tenant-bob")
    assert r.returncode == 4 and "not found" in r.stderr
    r = cli("jobs", "--json", address=mesh, tls=certs / "tenant-bob")
    assert r.returncode == 0 and json.loads(r.stdout) == []
    r = cli("jobs", "--tenant", "alice", address=mesh, tls=certs / "tenant-bob")
    assert r.returncode == 5 and r.stderr.startswith("error: ")
    r = cli("jobs", "--json", address=mesh, tls=None)  # plaintext to an mTLS server: no connection
    assert r.returncode == 3


def test_refuses_plaintext_on_a_non_loopback_address(module_etcd: EtcdProcess) -> None:
    for service, extra in [("scheduler", ["--etcd", module_etcd.endpoint, "--topology", str(TOPOLOGY)]),
                           ("planner", [])]:
        r = subprocess.run(spiderflow_argv("serve", service, "--listen", "0.0.0.0:0", *extra), capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 2
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "--tls-dir" in lines[0] and "--insecure" in lines[0], r.stderr
