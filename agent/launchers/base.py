"""The launcher contract: how an agent starts, watches and stops one stage group's workers.

A **stage group** is a run of consecutive ranks of one attempt that run on this agent's cluster (ranks are
numbered stage by stage, replica by replica: :func:`spiderflow.exec.spec.rank_layout`; a chain visits a
cluster once, so a cluster's ranks are one group). Every rank is one ``python -m spiderflow.exec.worker
--spec FILE --rank R`` process on one GPU (or CPU slot), all ranks of the attempt in one
``torch.distributed`` process group whose TCPStore the rank-0 agent serves (the worker file names it).

A :class:`Launcher` turns a :class:`StageGroup` into a :class:`LaunchHandle`:

- :meth:`Launcher.launch` submits the workers (local processes, one Slurm batch job, one Kubernetes Job) and
  returns once the workload manager accepted them. A refusal raises :class:`LaunchError` carrying the
  workload manager's own message (bad partition, quota exceeded, image pull failure); the executor fails
  the group's stages with it.
- :meth:`LaunchHandle.run` follows the group until every worker has ended: each line a worker prints on
  stdout is passed to ``on_line(rank, line)`` (the executor turns them into progress, checkpoints and
  errors: the job's events), and the end is a :class:`GroupResult` (exit code and stderr tail per rank, and
  ``preempted`` when the workload manager stopped workers: node failure, time limit, eviction, an
  operator's ``scancel``).
- :meth:`LaunchHandle.stop` stops the workers (gracefully, then by force after ``grace_s``); ``run`` then
  returns. :meth:`LaunchHandle.cleanup` removes what the launch created (idempotent; after ``stop`` or the
  end of ``run``). Neither raises for workers that already ended.

A rank's stdout is also kept in ``<run_dir>/rank-<r>.out`` and its stderr in ``<run_dir>/rank-<r>.log``
(the Kubernetes launcher keeps the pod logs there).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from spiderflow.core.errors import PreconditionError, ValidationError
from spiderflow.exec.spec import RankInfo
from spiderflow.security.secrets import worker_environment

__all__ = [
    "GroupResult",
    "LaunchError",
    "LaunchHandle",
    "Launcher",
    "LauncherKind",
    "LineSink",
    "StageGroup",
    "stage_groups",
    "tail",
    "worker_env",
]


class LauncherKind(StrEnum):
    """Which workload manager starts a cluster's workers."""

    LOCAL = "local"
    SLURM = "slurm"
    KUBERNETES = "kubernetes"


class LaunchError(PreconditionError):
    """The workload manager refused to start a stage group; the message is the workload manager's own."""


LineSink = Callable[[int, str], Awaitable[None]]
"""``on_line(rank, line)``: one line a worker printed on stdout (with its newline)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageGroup:
    """Consecutive ranks of one attempt that one launch starts.

    ``spec_path``: the worker file (:func:`spiderflow.exec.worker.worker_document`) every rank reads;
    ``run_dir``: where logs go; ``env``: extra environment of every worker; ``gpus_per_node``: ranks per
    node (a group of ``n`` ranks spans ``ceil(n / gpus_per_node)`` nodes); ``python``: the interpreter
    that runs the workers (on the compute nodes)."""

    job: str
    attempt: int
    ranks: tuple[RankInfo, ...]
    spec_path: Path
    run_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    gpus_per_node: int = 1
    python: str = "python3"

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValidationError("ranks", "a stage group has at least one rank")
        first = self.ranks[0].rank
        if [r.rank for r in self.ranks] != list(range(first, first + len(self.ranks))):
            raise ValidationError("ranks", "must be consecutive", [r.rank for r in self.ranks])
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValidationError("gpus_per_node", "must be an integer ≥ 1", self.gpus_per_node)

    @property
    def first_rank(self) -> int:
        """The rank offset: rank = ``first_rank`` + the worker's index in the group (``SLURM_PROCID``)."""
        return self.ranks[0].rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> int:
        """Nodes the group spans."""
        return -(-self.size // self.gpus_per_node)

    @property
    def ranks_per_node(self) -> int:
        return min(self.size, self.gpus_per_node)

    @property
    def name(self) -> str:
        """A name for the workload manager's object: ``sf-<job>-a<attempt>-r<first rank>``, lower case,
        at most 63 characters (a Kubernetes DNS label)."""
        job = "".join(c if c.isalnum() or c == "-" else "-" for c in self.job.lower()).strip("-")
        suffix = f"-a{self.attempt}-r{self.first_rank}"
        return f"sf-{job[: 63 - 3 - len(suffix)]}".rstrip("-") + suffix


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupResult:
    """How a stage group ended. ``exit_codes[rank]`` is ``None`` for a worker that was killed or never ran
    (no exit status reached the agent); ``errors[rank]`` the last lines of its stderr (or what the workload
    manager said about it); ``preempted`` is non-empty when the workload manager stopped the workers
    (the reason, in its words)."""

    exit_codes: Mapping[int, int | None]
    errors: Mapping[int, str] = field(default_factory=dict)
    preempted: str = ""


class LaunchHandle(Protocol):
    """One launched stage group (see the module docstring)."""

    @property
    def ident(self) -> str:
        """What the workload manager calls it (process ids, a Slurm job id, a Kubernetes Job name)."""
        ...

    @property
    def pids(self) -> Mapping[int, int]:
        """Rank -> operating-system process id of the workers this agent's host runs itself (local
        processes); empty where the workload manager runs them on other nodes."""
        ...

    async def run(self, on_line: LineSink) -> GroupResult: ...

    async def stop(self, grace_s: float) -> None: ...

    async def cleanup(self) -> None: ...


class Launcher(Protocol):
    """Starts stage groups on one cluster's workload manager (see the module docstring)."""

    kind: LauncherKind

    async def launch(self, group: StageGroup) -> LaunchHandle: ...


def stage_groups(ranks: tuple[RankInfo, ...]) -> tuple[tuple[RankInfo, ...], ...]:
    """``ranks`` (in rank order) split into runs of consecutive ranks: one launch each."""
    out: list[list[RankInfo]] = []
    for r in ranks:
        if out and out[-1][-1].rank + 1 == r.rank:
            out[-1].append(r)
        else:
            out.append([r])
    return tuple(tuple(g) for g in out)


def worker_env(host: str, extra: Mapping[str, str] | None = None, *, inherit: bool = True) -> dict[str, str]:
    """The environment of a worker: one thread for the math libraries, unbuffered stdout, and
    ``GLOO_SOCKET_IFNAME=lo`` when the rendezvous host is loopback and nothing names an interface.
    ``inherit``: start from this process's environment (local and Slurm workers) or from nothing
    (Kubernetes pods)."""
    # none of the agent's own secrets (spiderflow.security.secrets)
    env = worker_environment(os.environ) if inherit else {}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if "GLOO_SOCKET_IFNAME" not in env and host.startswith("127."):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(extra or {})
    return env


def tail(path: Path, lines: int = 12, limit: int = 1500) -> str:
    """The last ``lines`` lines of a text file (at most ``limit`` characters; empty when unreadable)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])[-limit:]
