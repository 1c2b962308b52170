"""The Slurm launcher against a real single-node Slurm cluster, driven by the executor (in-memory store,
recording reporter): the worker runs as a task of an ``sbatch`` job.

- a one-rank gpt-tiny assignment trains to the end through ``sbatch``/``srun``: progress and the
  checkpoint come back from the rank's output file, the stage succeeds, and no Slurm job is left;
- ``sbatch`` refusing the job (a partition that does not exist) fails the stage with Slurm's own message;
(a job ``scancel``-ed mid-run and ``spiderflow cancel`` are covered end to end in ``test_slurm_e2e.py``);
- the batch script and command line (pure): ranks from ``SLURM_PROCID`` plus the group's offset, nodes
  and tasks per node from the group, the configured partition/account/QoS/time/constraint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

from agent.config import SlurmConfig
from agent.executor import Executor, ExecutorSettings
from agent.launchers.base import StageGroup
from agent.launchers.slurm import SlurmLauncher, batch_script, sbatch_argv
from spiderflow.core.catalog import MODEL_PRESETS
from spiderflow.core.domain import Plan, Schedule, Stage
from spiderflow.exec.spec import RankInfo
from spiderflow.formats import job_from_dict, job_to_dict, plan_to_dict
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.store import keys
from spiderflow.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(180)

CLUSTER = "hpc"


class Recorder:
    def __init__(self) -> None:
        self.requests: list[scheduler_pb2.ReportProgressRequest] = []
        self.outcome = asyncio.Event()
        self.progress = asyncio.Event()

    async def report(self, request: scheduler_pb2.ReportProgressRequest) -> tuple[bool, bool]:
        self.requests.append(request)
        if request.progress:
            self.progress.set()
        if request.outcomes:
            self.outcome.set()
        return True, False

    async def close(self) -> None:
        return None


def _assignment(job: str, steps: int) -> bytes:
    spec = job_from_dict({"id": job, "model": "gpt-tiny", "global_batch": 4, "micro_batch": 2, "seq_len": 32,
                          "steps": steps, "gpus": {"min": 1, "max": 1}})
    plan = Plan(stages=(Stage(cluster=CLUSTER, first_layer=0, last_layer=MODEL_PRESETS["gpt-tiny"].layers - 1),),
                micro_batches=2, schedule=Schedule.ONE_F_ONE_B)
    return json.dumps({"job": job, "attempt": 1, "stages": [0], "plan": plan_to_dict(plan),
                       "spec": job_to_dict(spec)}).encode()


@contextlib.asynccontextmanager
async def _executor(tmp_path: Path, config: SlurmConfig) -> AsyncIterator[tuple[Executor, MemoryStore, Recorder]]:
    store = MemoryStore()
    rec = Recorder()
    settings = ExecutorSettings(cluster=CLUSTER, host="127.0.0.1", work_dir=tmp_path / "work",
                                checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, failure_grace_s=1.0)
    ex = Executor(settings, store, rec, launcher=SlurmLauncher(config, host="127.0.0.1"))
    stop = asyncio.Event()
    task = asyncio.create_task(ex.run(stop))
    try:
        yield ex, store, rec
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await store.close()


def _config(slurm: SlurmCluster, **kw: object) -> SlurmConfig:
    return SlurmConfig(gpus=False, slurm_conf=str(slurm.conf), poll_s=0.3, kill_wait_s=10.0, **kw)  # type: ignore[arg-type]


async def test_a_stage_group_trains_as_a_slurm_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    async with _executor(tmp_path, _config(slurm, time_limit="10")) as (_, store, rec):
        await store.put(keys.assignment_key(CLUSTER, "s1"), _assignment("s1", steps=4))
        await asyncio.wait_for(rec.outcome.wait(), 150)
        final = rec.requests[-1]
        assert [(o.stage, o.succeeded, o.error, o.preempted) for o in final.outcomes] == [(0, True, "", False)]
        steps = sorted({p.step for r in rec.requests for p in r.progress})
        assert steps[-1] == 4
        kv = await store.get(keys.checkpoint_key("s1"))
        assert kv is not None and json.loads(kv.value)["step"] == 4
        run_dir = tmp_path / "work" / "logs" / "s1" / "attempt-1" / CLUSTER
        assert (run_dir / "rank-0.exit").read_text().strip() == "0"
        assert list(run_dir.glob("slurm-*.out"))  # the batch job's own output
    assert slurm.jobs() == []


async def test_sbatch_refusing_the_job_fails_the_stage_with_slurms_message(slurm: SlurmCluster,
                                                                          tmp_path: Path) -> None:
    async with _executor(tmp_path, _config(slurm, partition="no-such-partition")) as (_, store, rec):
        await store.put(keys.assignment_key(CLUSTER, "s2"), _assignment("s2", steps=2))
        await asyncio.wait_for(rec.outcome.wait(), 30)
        [outcome] = rec.requests[-1].outcomes
        assert not outcome.succeeded and not outcome.preempted
        assert "slurm launcher" in outcome.error and "Invalid partition name specified" in outcome.error


def test_batch_job_for_a_multi_node_group() -> None:
    ranks = tuple(RankInfo(rank=r, stage=1 + (r - 3) // 4, replica=(r - 3) % 4, cluster=CLUSTER) for r in range(3, 11))
    group = StageGroup(job="j/7", attempt=2, ranks=ranks, spec_path=Path("/shared/w/spec.json"),
                       run_dir=Path("/shared/w"), gpus_per_node=4, python=sys.executable)
    cfg = SlurmConfig(partition="gpu", account="ml", qos="high", time_limit="04:00:00", constraint="h100",
                      sbatch_args=("--exclusive",), python="/opt/sf/bin/python", bin_dir="/opt/slurm/bin")
    argv = sbatch_argv(group, cfg, Path("/shared/w/job.sbatch"))
    assert argv == ["/opt/slurm/bin/sbatch", "--parsable", "--job-name=sf-j-7-a2-r3", "--nodes=2", "--ntasks=8",
                    "--ntasks-per-node=4", "--chdir=/shared/w", "--output=/shared/w/slurm-%j.out", "--export=ALL",
                    "--gpus-per-task=1", "--partition=gpu", "--account=ml", "--qos=high", "--time=04:00:00",
                    "--constraint=h100", "--exclusive", "/shared/w/job.sbatch"]
    script = batch_script(group, cfg)
    assert "export SPIDERFLOW_RANK_OFFSET=3\n" in script
    assert "exec /opt/slurm/bin/srun --kill-on-bad-exit=1 --ntasks=8 --ntasks-per-node=4 --gpus-per-task=1 " in script
    assert "R=$((SPIDERFLOW_RANK_OFFSET + SLURM_PROCID))" in script
    assert script.rstrip().endswith("/opt/sf/bin/python /shared/w/spec.json /shared/w")
    cpu = batch_script(group, SlurmConfig(gpus=False, cpus_per_task=2))
    assert "--cpus-per-task=2" in cpu and "--gpus-per-task" not in cpu


async def test_state_polls_tell_a_forgotten_job_from_an_unreachable_controller(tmp_path: Path) -> None:
    """``squeue``/``sacct`` stand-ins (real processes): a controller that does not answer is asked again, a
    job it no longer knows (and accounting does not either) has ended."""
    from agent.launchers.slurm import SlurmHandle

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mode = tmp_path / "mode"

    def tool(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)

    tool("squeue", f'case "$(cat {mode})" in\n  running) echo "RUNNING|None";;\n'
                   '  down) echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1;;\n'
                   '  gone) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;\nesac')
    tool("sacct", 'echo "Slurm accounting storage is disabled" >&2; exit 1')
    group = StageGroup(job="j", attempt=1, ranks=(RankInfo(rank=0, stage=0, replica=0, cluster=CLUSTER),),
                       spec_path=tmp_path / "spec.json", run_dir=tmp_path)
    handle = SlurmHandle(group, SlurmConfig(bin_dir=str(bin_dir)), "42", {})
    expected = {"running": ("RUNNING", "None"), "down": ("", "slurm_load_jobs error: Unable to contact slurm "
                                                              "controller")}
    for m, want in expected.items():
        mode.write_text(m)
        assert await handle.poll() == want
    mode.write_text("gone")
    state, why = await handle.poll()
    assert state == "UNKNOWN" and "Invalid job id" in why
