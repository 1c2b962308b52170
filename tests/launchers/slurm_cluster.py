"""A real single-node Slurm cluster for the tests: ``munged``, ``slurmctld`` and ``slurmd`` as children of the
test process, with a temp directory holding the munge key and socket, ``slurm.conf``, state and logs.

Debian's packages (``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``); ``proctrack/linuxproc`` and
``task/none`` (no cgroups needed), no accounting daemon (``sacct`` then answers that accounting is
disabled: the launcher reads states from ``squeue``). The node is ``localhost`` with ``cpus`` CPU slots
(``SlurmdParameters=config_overrides`` lets it declare more than the machine has). Munge starts first.
Every daemon is started with ``setpriv --pdeathsig KILL`` and stopped by its PID (SIGTERM, then SIGKILL);
jobs still queued are cancelled first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from spiderflow.store.process import free_port

__all__ = ["SLURM_BINARIES", "SlurmCluster", "missing_binaries"]

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo")
_SBIN = ("/usr/sbin", "/usr/bin", "/sbin")


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN:
        p = Path(d) / name
        if os.access(p, os.X_OK):
            return str(p)
    return None


def missing_binaries() -> list[str]:
    """The Slurm and munge programs this machine lacks (empty: a cluster can start)."""
    return [b for b in SLURM_BINARIES if _which(b) is None]


class SlurmCluster:
    """One single-node cluster (see the module docstring). :attr:`conf` is its ``slurm.conf`` (the Slurm
    commands need ``SLURM_CONF`` = that path: :attr:`env`)."""

    def __init__(self, *, cpus: int = 4, name: str = "sftest") -> None:
        self.cpus = cpus
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix="spiderflow-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def env(self) -> dict[str, str]:
        return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_CONF": str(self.conf)}

    def _spawn(self, name: str, argv: list[str]) -> None:
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        with (self.dir / f"{name}.out").open("wb") as out:
            self.procs[name] = subprocess.Popen([*prefix, *argv], stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self.env)

    def start(self, timeout_s: float = 30.0) -> SlurmCluster:
        d = self.dir
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir()
        (d / "munge").chmod(0o755)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = d / "munge" / "munge.socket"
        ctld_port, d_port = free_port(), free_port()
        self.conf.write_text("\n".join([
            f"ClusterName={self.name}", "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={d_port}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none", "SwitchType=switch/none",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerParameters=sched_interval=1", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MinJobAge=600", "SlurmctldTimeout=10", "SlurmdTimeout=10",
            "InactiveLimit=0", "KillWait=2",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        try:
            self._spawn("munged", [str(_which("munged")), "-F", "-f", f"--socket={sock}", f"--key-file={key}",
                                   f"--pid-file={d / 'munge' / 'munged.pid'}", f"--seed-file={d / 'munge' / 'seed'}",
                                   f"--log-file={d / 'munged.log'}"])
            self._wait(lambda: sock.exists(), timeout_s, "munged")
            self._spawn("slurmctld", [str(_which("slurmctld")), "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", [str(_which("slurmd")), "-D", "-N", "localhost", "-f", str(self.conf)])
            self._wait(self._node_idle, timeout_s, "the node to be idle")
        except BaseException:
            self.close()
            raise
        return self

    def _node_idle(self) -> bool:
        r = subprocess.run([str(_which("sinfo")), "-h", "-o", "%t"], env=self.env, capture_output=True, text=True,
                           timeout=10)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _wait(self, cond: object, timeout_s: float, what: str) -> None:
        assert callable(cond)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}: {self.log(name)}")
            if cond():
                return
            time.sleep(0.1)
        raise RuntimeError(f"waited {timeout_s:.0f} s for {what}: {self.log('slurmctld')} {self.log('slurmd')}")

    def log(self, name: str) -> str:
        texts = []
        for f in (self.dir / f"{name}.out", self.dir / f"{name}.log"):
            if f.exists():
                texts.append(f.read_text(errors="replace")[-1500:])
        return "\n".join(texts)

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm still runs or queues (not finished ones)."""
        r = subprocess.run([str(_which("squeue")), "-h", "-o", "%i"], env=self.env, capture_output=True,
                           text=True, timeout=10)
        return r.stdout.split()

    def scancel(self, job_id: str) -> None:
        subprocess.run([str(_which("scancel")), job_id], env=self.env, check=True, timeout=10)

    def close(self) -> None:
        """Cancel what is queued, stop every daemon by its PID, remove the directory (idempotent)."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            subprocess.run([str(_which("scancel")), "--full", "-u", str(os.getuid())], env=self.env,
                           capture_output=True, timeout=10, check=False)
            deadline = time.monotonic() + 10
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
