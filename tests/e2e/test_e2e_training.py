"""End to end with every part real: embedded etcd, the topology, planner and scheduler services, one agent
per cluster and the agents' torch.distributed workers (gloo on loopback), all separate processes.

- ``spiderflow up --etcd-tls`` (the README's main-job command, with etcd serving TLS only and requiring
  client certificates) trains the sample job (gpt-tiny pipelined over three CPU clusters) to SUCCEEDED, the
  loss falls, the agents never see etcd, and no process of the run survives it; then every write of the
  run's whole etcd history is walked: each key parses through ``spiderflow.store.keys`` and each value decodes
  through ``spiderflow.store.records`` (an unknown key fails naming it);
- an agent killed with SIGKILL mid-training: the job goes RESCHEDULING, is re-placed on the remaining
  clusters (another layer split), resumes from its last complete checkpoint and completes; the loss after
  the resume continues from the checkpoint (it equals the first run's loss at the same step), not from the
  initial loss.

Every process a test starts carries an environment tag; the tests fail if any tagged process is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from e2e_harness import (
    MARK,
    ROOT,
    attempt_events,
    losses_by_step,
    marked_processes,
    wait_for_job,
    wait_no_marked_processes,
    walk_keyspace,
)

from spiderflow.mesh import LocalMesh, sample_topology
from spiderflow.sdk import Client

pytestmark = pytest.mark.timeout(300)

PROFILE_SECONDS = 0.3
"""The agents' timed CPU calibration: what these tests check does not depend on its precision (the
default, 1.5 s, costs each agent about 2 s more CPU on every start)."""


def _summary(stdout: str) -> dict[str, object]:
    """The JSON summary ``spiderflow up --json`` prints (an indented object between progress lines)."""
    start = stdout.find("\n{\n")
    assert start >= 0, stdout[-3000:]
    doc, _ = json.JSONDecoder().raw_decode(stdout[start + 1:])
    assert isinstance(doc, dict)
    return doc


def _run_up(mesh_dir: Path, token: str, *args: str) -> tuple[int, str, str]:
    """``spiderflow up ARGS --json --data-dir MESH_DIR`` as a tagged subprocess: (exit code, stdout, stderr)."""
    env = {**os.environ, MARK: token, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "spiderflow.cli.main", "up", *args, "--json", "--data-dir", str(mesh_dir),
         "--timeout", "200", "--profile-seconds", str(PROFILE_SECONDS)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def test_up_trains_the_sample_job_over_tls_etcd_and_leaves_nothing_running(tmp_path: Path) -> None:
    """``spiderflow up --etcd-tls``: one run of the main-job command serves both checks of a full mesh. etcd
    serves TLS only with client certificates required, and the services connect with the generated
    etcd-client bundle; the agents get no etcd address or credentials (they register, report and run stages
    through the scheduler's Control API). The sample job trains to SUCCEEDED with a falling loss on three
    clusters, no process of the run survives it, and every write of its etcd history decodes. (``up``
    without TLS trains jobs in tests/obs/test_operator_mesh.py and tests/e2e/test_e2e_testbed.py.)"""
    token = uuid.uuid4().hex
    mesh_dir = tmp_path / "mesh"
    try:
        code, out, err = _run_up(mesh_dir, token, "--etcd-tls", "--steps", "20")
        assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
        s = _summary(out)
        assert s["state"] == "SUCCEEDED", s
        assert s["steps"] == 20
        first, last = float(s["first_loss"]), float(s["last_loss"])  # type: ignore[arg-type]
        assert last < first - 1.0, s  # gpt-tiny on the seeded Markov data: ≈ 6.3 → ≈ 3.3 in 20 steps
        assert float(s["measured_step_time_s"]) > 0 and float(s["predicted_step_time_s"]) > 0  # type: ignore[arg-type]
        chain = s["chain"]
        assert isinstance(chain, list) and len(chain) == 3
        assert (mesh_dir / "certs" / "etcd-server" / "tls.crt").is_file()
        started = []
        for log in sorted((mesh_dir / "logs").glob("agent-*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"agent.started"' in line:
                    started.append(json.loads(line))
        assert len(started) == 3 and all(doc["etcd"] is None and doc["etcd_tls"] is False and doc["control_plane"]
                                         for doc in started), started
        # every stage ran as a real worker process on its cluster's agent, and finished all steps
        events = attempt_events(mesh_dir, str(s["job"]), 1)
        assert sorted(events) == [0, 1, 2]
        for rank, evs in events.items():
            done = [e for e in evs if e["event"] == "done"]
            assert done and done[0]["last_step"] == 20, (rank, evs[-3:])
        assert losses_by_step(events)[20] == pytest.approx(last)
    finally:
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
    # every key the run ever wrote is one of keys.py's and its value decodes through the records module
    kinds = walk_keyspace(mesh_dir / "etcd")
    assert {"registration", "lease-owner", "profile", "link", "job", "request", "allocation", "assignment",
            "rendezvous", "checkpoint", "metrics", "leader"} <= set(kinds), kinds


def test_killed_agent_job_resumes_from_its_last_checkpoint_elsewhere(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    token = uuid.uuid4().hex
    monkeypatch.setenv(MARK, token)
    # A step of gpt-tiny takes about 50 ms and progress reaches the test 0.25–0.6 s late: the job must have
    # seconds of training left when its agent is killed, or it may finish first.
    every, steps = 2, 60
    mesh_dir = tmp_path / "mesh"
    mesh = LocalMesh(sample_topology(3), workdir=mesh_dir, lease_ttl=3, profile_seconds=PROFILE_SECONDS,
                     agent_args=["--checkpoint-every", str(every)])
    job_id = "resume-e2e"
    try:
        with mesh, Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
            sf.submit({"id": job_id, "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1, "seq_len": 64,
                       "steps": steps, "gpus": {"min": 2, "max": 3}}, request_id=job_id)
            running = wait_for_job(sf, job_id,
                                lambda j: j.state == "RUNNING" and j.progress.get("step", 0) >= 2 * every + 1,
                                150, "first attempt running past two checkpoints")
            assert running.plan is not None and running.attempt == 1
            first_chain = running.plan.chain
            victim = first_chain[0]  # hosts rank 0 and the rendezvous store: the hardest loss
            mesh.agents[victim].kill()

            final = wait_for_job(sf, job_id, lambda j: j.done, 200, "re-placed job finishing")
            assert final.state == "SUCCEEDED", final.reason
            states = [t.to_state for t in final.history]
            assert "RESCHEDULING" in states, states
            assert final.attempt >= 2
            assert final.plan is not None and victim not in final.plan.chain
            assert final.progress["step"] == steps

        first = losses_by_step(attempt_events(mesh_dir, job_id, 1))
        events2 = attempt_events(mesh_dir, job_id, final.attempt)
        second = losses_by_step(events2)
        assert second, events2
        resumed_at = min(second) - 1  # the first step the new attempt trained is the checkpoint's step + 1
        assert resumed_at >= every and resumed_at % every == 0, sorted(second)
        assert max(second) == steps
        for evs in events2.values():
            done = [e for e in evs if e["event"] == "done"]
            assert done and done[0]["first_step"] == resumed_at and done[0]["last_step"] == steps, evs[-2:]
        # the curve continues from the checkpoint: same weights, optimizer state and data as the first run
        assert second[resumed_at + 1] < first[1] - 0.5, (first, second)
        if resumed_at + 1 in first:
            assert second[resumed_at + 1] == pytest.approx(first[resumed_at + 1], rel=1e-3)
        else:
            assert abs(second[resumed_at + 1] - first[resumed_at]) < 0.3
        assert second[steps] < second[resumed_at + 1]
    finally:
        mesh.stop()
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
        assert not marked_processes(token)
