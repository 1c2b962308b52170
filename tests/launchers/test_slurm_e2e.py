"""End to end through a real Slurm cluster: embedded etcd, the topology, planner and scheduler services and two
agents as separate processes; ``virginia``'s agent starts its workers as local processes, ``frankfurt``'s
through Slurm (``launcher: slurm``: an ``sbatch`` job, the worker a task of its ``srun`` step). The job needs
both clusters' GPUs, so its pipeline spans a local worker and a Slurm worker.

- the job trains to SUCCEEDED; ``scancel`` of its Slurm job mid-run (by an operator, as a preemption would)
  makes it RESCHEDULING, it is placed again, resumes from its last complete checkpoint and completes; the
  loss of every step, before and after the resume, equals the loss of an all-local single-process run of
  the same batches (the ground truth of the execution tests);
- ``spiderflow cancel`` of a running job leaves no Slurm job behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exec"))

from e2e_harness import (
    MARK,
    ROOT,
    attempt_events,
    losses_by_step,
    wait_for_job,
    wait_no_marked_processes,
)
from exec_harness import reference_losses

from spiderflow.core.catalog import MODEL_PRESETS
from spiderflow.mesh import LocalMesh, sample_topology
from spiderflow.sdk import Client

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]

EVERY = 2
# fp32: the workers train in the job's precision, and the losses are checked against the fp32 ground truth
JOB = {"model": "gpt-tiny", "global_batch": 4, "micro_batch": 2, "seq_len": 32, "gpus": {"min": 2, "max": 2},
       "precision": "fp32"}


def test_a_job_across_a_local_and_a_slurm_cluster(slurm: SlurmCluster, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    token = uuid.uuid4().hex
    monkeypatch.setenv(MARK, token)
    topo = sample_topology(2)
    local, hpc = (c.name for c in topo.clusters)
    config = tmp_path / "hpc-agent.yaml"
    config.write_text(f"launcher: slurm\nslurm:\n  gpus: false\n  slurm_conf: {slurm.conf}\n  poll_s: 0.3\n"
                      "  kill_wait_s: 10\n  time_limit: '30'\n")
    mesh_dir = tmp_path / "mesh"
    mesh = LocalMesh(topo, workdir=mesh_dir, lease_ttl=3, profile_seconds=0.5,
                     agent_args=["--checkpoint-every", str(EVERY)], cluster_args={hpc: ["--config", str(config)]})
    steps = 24
    try:
        with mesh, Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
            # 1. preempted by Slurm mid-run: re-placed, resumed from the checkpoint, completed
            sf.submit({"id": "across", **JOB, "steps": steps}, request_id="across")
            running = wait_for_job(sf, "across", lambda j: j.state == "RUNNING"
                                   and j.progress.get("step", 0) >= 2 * EVERY + 1, 200, "first attempt running")
            assert running.plan is not None and {st.cluster for st in running.plan.stages} == {local, hpc}
            [job_id] = slurm.jobs()
            slurm.scancel(job_id)
            final = wait_for_job(sf, "across", lambda j: j.done, 250, "re-placed job finishing")
            assert final.state == "SUCCEEDED", final.reason
            rescheduled = [t for t in final.history if t.to_state == "RESCHEDULING"]
            assert rescheduled and f"Slurm job {job_id} CANCELLED" in rescheduled[0].reason, final.history
            assert final.attempt >= 2 and final.progress["step"] == steps
            assert final.plan is not None
            m = final.plan.micro_batches

            # 2. `spiderflow cancel` leaves no Slurm job
            sf.submit({"id": "stopped", **JOB, "steps": 10_000}, request_id="stopped")
            wait_for_job(sf, "stopped", lambda j: j.state == "RUNNING" and j.progress.get("step", 0) >= 1, 200,
                         "second job running")
            assert len(slurm.jobs()) == 1
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            out = subprocess.run([sys.executable, "-m", "spiderflow.cli.main", "cancel", "stopped", "--address",
                                  mesh.address("scheduler")], env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            deadline = time.monotonic() + 60
            while slurm.jobs() and time.monotonic() < deadline:
                time.sleep(0.3)
            assert slurm.jobs() == []
            assert sf.get("stopped").state == "CANCELLED"

        first = losses_by_step(attempt_events(mesh_dir, "across", 1))
        second = losses_by_step(attempt_events(mesh_dir, "across", final.attempt))
        resumed_at = min(second) - 1
        assert resumed_at >= EVERY and resumed_at % EVERY == 0, sorted(second)
        assert max(second) == steps
        truth = reference_losses(MODEL_PRESETS["gpt-tiny"], seq_len=32, global_batch=4, m=m, steps=steps, seed=0,
                                 lr=1e-3)
        for losses in (first, second):
            for step, loss in losses.items():
                assert loss == pytest.approx(truth[step - 1], rel=1e-4, abs=1e-5), (step, loss, truth[step - 1])
        # the Slurm side really ran under Slurm: its rank's output is in the agent's work dir with the exit
        # status the srun task wrote, and the batch job's own log is beside it
        run_dir = mesh_dir / "agents" / hpc / "logs" / "across" / f"attempt-{final.attempt}" / hpc
        assert [p.read_text().strip() for p in run_dir.glob("rank-*.exit")] == ["0"]
        assert list(run_dir.glob("slurm-*.out"))
    finally:
        mesh.stop()
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
