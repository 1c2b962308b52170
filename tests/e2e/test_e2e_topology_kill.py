"""SIGKILL of the topology service while a real training job runs (every part real: etcd, the three services,
one agent per cluster and their torch.distributed workers).

The job's workers, its scheduler record and the agents' registrations do not depend on the topology service
being up, so the job keeps training. A topology service restarted on the same address serves the live graph
again (the agents report to it, the scheduler's watch reconnects), the job completes exactly once, and no
process of the run survives it.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from e2e_harness import MARK, attempt_events, wait_for_job, wait_no_marked_processes

from spiderflow.mesh import LocalMesh, sample_topology
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.sdk import Client

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]


def test_topology_service_sigkill_while_a_job_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = uuid.uuid4().hex
    monkeypatch.setenv(MARK, token)
    steps = 150  # long enough to outlast the outage (≈ 0.1 s per step on a quiet machine)
    mesh = LocalMesh(sample_topology(3), workdir=tmp_path / "mesh", lease_ttl=3)
    job_id = "topology-kill"
    try:
        with mesh, Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
            sf.submit({"id": job_id, "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1, "seq_len": 64,
                       "steps": steps, "gpus": {"min": 2, "max": 3}}, request_id=job_id)
            wait_for_job(sf, job_id, lambda j: j.state == "RUNNING" and j.progress.get("step", 0) >= 2, 150,
                  "job running")
            old = mesh.services["topology"]
            address = old.address
            old.kill()
            time.sleep(2.0)  # the job trains on while nothing answers at the topology address
            assert sf.get(job_id).state == "RUNNING"
            restarted = ManagedProcess("topology-restarted", spiderflow_argv(
                "serve", "topology", "--listen", address, "--log-format", "json", "--etcd", mesh.etcd_endpoint,
                *mesh.etcd_args), log_dir=mesh.workdir / "logs").start(timeout=60)
            mesh.services["topology"] = restarted  # mesh.stop() stops it
            assert len(mesh.wait_for_clusters(3, timeout=60).clusters) == 3

            final = wait_for_job(sf, job_id, lambda j: j.done, 200, "job finishing")
            assert final.state == "SUCCEEDED", final.reason
            assert final.progress["step"] == steps
            states = [t.to_state for t in final.history]
            assert states.count("SUCCEEDED") == 1, states
            assert final.attempt == 1, states  # the outage is not a cluster loss: nothing was re-placed
            print(f"topology-kill: attempt {final.attempt}, transitions {states}")
        events = attempt_events(mesh.workdir, job_id, final.attempt)
        assert events, "the final attempt's workers left no events"
        for evs in events.values():
            assert any(e["event"] == "done" and e["last_step"] == steps for e in evs), evs[-2:]
    finally:
        mesh.stop()
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
