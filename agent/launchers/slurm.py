"""``slurm``: one ``sbatch`` job per stage group, ``srun`` starting one worker per GPU (or CPU slot).

The batch job (:func:`sbatch_argv`, :func:`batch_script`; both pure) asks for ``ceil(n / gpus_per_node)``
nodes and ``n`` tasks, ``gpus_per_node`` per node, one GPU per task (``--gpus-per-task=1``; with
``gpus: false`` ``--cpus-per-task`` instead), plus the configured partition, account, QoS, time limit and
constraint. Its script runs one ``srun`` step; each task computes its rank as the group's first rank plus
``SLURM_PROCID`` and execs ``python -m spiderflow.exec.worker --spec FILE --rank R`` with stdout in
``<run_dir>/rank-R.out`` and stderr in ``rank-R.log``, then writes its exit status to ``rank-R.exit``
(a task Slurm kills leaves no status). ``--kill-on-bad-exit`` ends the step when a rank fails. All ranks
of the attempt (this group's, other groups', other clusters') form one process group through the
TCPStore the rank-0 agent serves, so the agent's address must be reachable from the compute nodes, and
``work_dir`` and ``checkpoint_dir`` must be on a file system the agent and the compute nodes share.

Following a job (:class:`SlurmHandle`): the rank files are read as they grow (each new line goes to the
executor: progress, checkpoints, errors); the state comes from ``squeue`` (``-t all``, so a finished job
is still seen for ``MinJobAge``) and, once ``squeue`` forgets it, from ``sacct``; while the controller does
not answer, the job is assumed to run (for up to ``unreachable_s``; then it is cancelled and fails). A job
that ends CANCELLED (not by this agent), PREEMPTED, NODE_FAIL, TIMEOUT, BOOT_FAIL or DEADLINE was stopped by the
workload manager: the group's result is ``preempted`` and the job is re-placed from its checkpoint. A job
pending for a reason that waiting cannot fix (an invalid account or QoS, a partition's limits) is cancelled
and fails with that reason; ``sbatch`` refusing the job raises :class:`LaunchError` with its message.
:meth:`SlurmHandle.stop` runs ``scancel`` (Slurm sends SIGTERM, then SIGKILL after its ``KillWait``) and
waits for the job to end (``scancel --signal=KILL`` after the grace).

Workers run under ``slurmstepd``, not under the agent: an agent that dies leaves its batch jobs running
until their workers fail on the lost peers or the time limit; the job itself is re-placed as for any lost
cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
from pathlib import Path

import structlog

from agent.config import SlurmConfig
from agent.launchers.base import GroupResult, LauncherKind, LaunchError, LineSink, StageGroup, tail, worker_env

__all__ = [
    "PREEMPTED_STATES",
    "SlurmHandle",
    "SlurmLauncher",
    "batch_script",
    "sbatch_argv",
    "slurm_environment",
]

log = structlog.get_logger(__name__)

#: Terminal job states in which the workload manager, not the workers, ended the job.
PREEMPTED_STATES = frozenset({"CANCELLED", "PREEMPTED", "NODE_FAIL", "TIMEOUT", "BOOT_FAIL", "DEADLINE"})
_TERMINAL = PREEMPTED_STATES | {"COMPLETED", "FAILED", "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}
#: Pending reasons that waiting cannot fix: the job is cancelled and its stages fail with the reason.
HOPELESS_REASONS = frozenset({
    "BadConstraints", "InvalidAccount", "InvalidQOS", "PartitionConfig", "PartitionNodeLimit",
    "PartitionTimeLimit", "QOSJobLimit", "AccountNotAllowed", "QOSNotAllowed", "JobHeldAdmin",
    "DependencyNeverSatisfied", "InactiveLimit",
})


def sbatch_argv(group: StageGroup, config: SlurmConfig, script: Path) -> list[str]:
    """The ``sbatch`` command line submitting ``script`` for ``group``."""
    argv = [config.command("sbatch"), "--parsable", f"--job-name={group.name}", f"--nodes={group.nodes}",
            f"--ntasks={group.size}", f"--ntasks-per-node={group.ranks_per_node}", f"--chdir={group.run_dir}",
            f"--output={group.run_dir / 'slurm-%j.out'}", "--export=ALL"]
    argv.append("--gpus-per-task=1" if config.gpus else f"--cpus-per-task={config.cpus_per_task}")
    for flag, value in (("partition", config.partition), ("account", config.account), ("qos", config.qos),
                        ("time", config.time_limit), ("constraint", config.constraint)):
        if value:
            argv.append(f"--{flag}={value}")
    return [*argv, *config.sbatch_args, str(script)]


def batch_script(group: StageGroup, config: SlurmConfig) -> str:
    """The batch script of ``group``: one ``srun`` step, one task per rank (see the module docstring)."""
    python = config.python or group.python
    task = ('R=$((SPIDERFLOW_RANK_OFFSET + SLURM_PROCID)); '
            '"$0" -m spiderflow.exec.worker --spec "$1" --rank "$R" >>"$2/rank-$R.out" 2>>"$2/rank-$R.log"; '
            'c=$?; echo "$c" >"$2/rank-$R.exit"; exit "$c"')
    per_task = "--gpus-per-task=1" if config.gpus else f"--cpus-per-task={config.cpus_per_task}"
    ranks = group.ranks
    return "\n".join([
        "#!/bin/bash",
        f"# SpiderFlow job {group.job}, attempt {group.attempt}: ranks {ranks[0].rank}..{ranks[-1].rank} "
        f"(stages {sorted({r.stage for r in ranks})})",
        f"export SPIDERFLOW_RANK_OFFSET={group.first_rank}",
        f"exec {shlex.quote(config.command('srun'))} --kill-on-bad-exit=1 --ntasks={group.size} "
        f"--ntasks-per-node={group.ranks_per_node} {per_task} bash -c {shlex.quote(task)} "
        f"{shlex.quote(python)} {shlex.quote(str(group.spec_path))} {shlex.quote(str(group.run_dir))}",
        "",
    ])


def slurm_environment(config: SlurmConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the Slurm commands: ``base`` (default this process's) without the ``SLURM_*``
    variables of an allocation the agent may run in, with ``SLURM_CONF`` from the config when set."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    if config.slurm_conf:
        env["SLURM_CONF"] = config.slurm_conf
    return env


async def _command(argv: list[str], env: dict[str, str], timeout_s: float = 30.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
                                                env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return 124, "", f"{argv[0]} did not answer within {timeout_s:.0f} s"
    return proc.returncode or 0, out.decode(errors="replace").strip(), err.decode(errors="replace").strip()


class _Follower:
    """Reads a rank's output file as it grows, line by line."""

    def __init__(self, rank: int, path: Path) -> None:
        self.rank = rank
        self.path = path
        self.offset = 0
        self.partial = b""

    async def pump(self, on_line: LineSink, *, final: bool = False) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        for line in lines:
            await on_line(self.rank, line.decode(errors="replace") + "\n")
        if final and self.partial:
            await on_line(self.rank, self.partial.decode(errors="replace"))
            self.partial = b""


class SlurmHandle:
    """One submitted batch job (see the module docstring)."""

    def __init__(self, group: StageGroup, config: SlurmConfig, job_id: str, env: dict[str, str]) -> None:
        self.group = group
        self.config = config
        self.job_id = job_id
        self._env = env
        self._stopping = False
        self._ended = False
        self.state = "PENDING"
        self.reason = ""

    @property
    def ident(self) -> str:
        return f"slurm job {self.job_id}"

    @property
    def pids(self) -> dict[int, int]:
        return {}  # the workers run on the workload manager's nodes

    async def poll(self) -> tuple[str, str]:
        """``(state, reason)`` now: from ``squeue``, else ``sacct``; ``("UNKNOWN", why)`` when the controller
        answers that it no longer knows the job and ``sacct`` does not either; ``("", error)`` when the
        controller did not answer (a transient failure: ask again)."""
        code, out, err = await _command([self.config.command("squeue"), "-h", "-t", "all", "-j", self.job_id,
                                         "-o", "%T|%r"], self._env)
        if code == 0 and out:
            state, _, reason = out.splitlines()[0].partition("|")
            return state.strip(), reason.strip()
        forgotten = code == 0 or "invalid job id" in err.lower()
        code2, out2, err2 = await _command([self.config.command("sacct"), "-n", "-P", "-X", "-j", self.job_id,
                                            "-o", "State"], self._env)
        if code2 == 0 and out2:
            return out2.splitlines()[0].split()[0].strip(), ""
        if forgotten:
            return "UNKNOWN", err or err2 or "the job is no longer known to squeue or sacct"
        return "", err or f"squeue exited with {code}"

    async def run(self, on_line: LineSink) -> GroupResult:
        g = self.group
        followers = [_Follower(r.rank, g.run_dir / f"rank-{r.rank}.out") for r in g.ranks]
        next_poll = 0.0
        failures = 0
        hopeless = ""
        while True:
            for f in followers:
                await f.pump(on_line)
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + self.config.poll_s
                state, reason = await self.poll()
                if not state:
                    failures += 1
                    if failures * self.config.poll_s >= self.config.unreachable_s:
                        self.state, self.reason = "UNKNOWN", f"the Slurm controller did not answer: {reason}"
                        hopeless = f"Slurm job {self.job_id}: {self.reason}"
                        await self._scancel()
                        break
                    log.info("slurm.poll_failed", job_id=self.job_id, error=reason, failures=failures)
                else:
                    failures = 0
                    self.state, self.reason = state, reason
                    if self.state in _TERMINAL or self.state == "UNKNOWN":
                        break
                    if self.state == "PENDING" and self.reason in HOPELESS_REASONS and not self._stopping \
                            and not hopeless:
                        hopeless = f"Slurm job {self.job_id} cannot start: pending ({self.reason})"
                        await self._scancel()
            await asyncio.sleep(0.1)
        self._ended = True
        for f in followers:
            await f.pump(on_line, final=True)
        exit_codes: dict[int, int | None] = {}
        errors: dict[int, str] = {}
        batch_log = tail(g.run_dir / f"slurm-{self.job_id}.out", lines=6, limit=600)
        for r in g.ranks:
            try:
                exit_codes[r.rank] = int((g.run_dir / f"rank-{r.rank}.exit").read_text().strip())
            except (OSError, ValueError):
                exit_codes[r.rank] = None
            errors[r.rank] = hopeless or tail(g.run_dir / f"rank-{r.rank}.log") or batch_log
        preempted = ""
        if self.state in PREEMPTED_STATES and not self._stopping and not hopeless:
            preempted = f"Slurm job {self.job_id} {self.state}" + (f" ({self.reason})" if self.reason
                                                                  and self.reason != "None" else "")
            if batch_log:
                preempted += f": {batch_log.splitlines()[-1]}"
        log.info("slurm.job_ended", job_id=self.job_id, state=self.state, reason=self.reason,
                 exit_codes=exit_codes, preempted=bool(preempted))
        return GroupResult(exit_codes=exit_codes, errors=errors, preempted=preempted)

    async def _scancel(self, *extra: str) -> None:
        code, _, err = await _command([self.config.command("scancel"), *extra, self.job_id], self._env)
        if code:
            log.warning("slurm.scancel_failed", job_id=self.job_id, error=err)

    async def stop(self, grace_s: float) -> None:
        self._stopping = True
        if self._ended:
            return
        await self._scancel()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            state, _ = await self.poll()
            if not state:
                await asyncio.sleep(0.2)
                continue
            if state in _TERMINAL or state == "UNKNOWN":
                return
            await asyncio.sleep(0.2)
        await self._scancel("--signal=KILL", "--full")

    async def cleanup(self) -> None:
        if not self._ended:
            await self.stop(self.config.kill_wait_s)


class SlurmLauncher:
    """Submits stage groups with ``sbatch`` (see the module docstring). ``host``: the rendezvous host
    (the agent's advertised host), for the workers' environment."""

    kind = LauncherKind.SLURM

    def __init__(self, config: SlurmConfig, *, host: str) -> None:
        self.config = config
        self.host = host

    async def launch(self, group: StageGroup) -> SlurmHandle:
        script = group.run_dir / f"{group.name}.sbatch"
        script.write_text(batch_script(group, self.config))
        env = slurm_environment(self.config, worker_env(self.host, group.env))
        code, out, err = await _command(sbatch_argv(group, self.config, script), env)
        if code != 0:
            raise LaunchError(err or out or f"sbatch exited with {code}")
        job_id = out.splitlines()[-1].split(";")[0].strip()
        if not job_id.isdigit():
            raise LaunchError(f"sbatch answered no job id: {out!r}")
        log.info("slurm.submitted", job_id=job_id, name=group.name, nodes=group.nodes, tasks=group.size,
                 first_rank=group.first_rank)
        return SlurmHandle(group, self.config, job_id, env)
