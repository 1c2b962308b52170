"""``local``: every rank is a subprocess of the agent on the agent's machine.

Each worker's stdout is read through a pipe (each line passed on and appended to ``rank-<r>.out``), its
stderr goes to ``rank-<r>.log``. Workers die with their agent (``setpriv --pdeathsig KILL``): an agent
killed by SIGKILL takes its ranks with it, as a lost cluster does. :meth:`LocalHandle.stop` sends SIGTERM,
then SIGKILL after the grace. ``gpus_per_node`` is ignored (one machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from agent.launchers.base import GroupResult, LauncherKind, LaunchError, LineSink, StageGroup, tail, worker_env
from spiderflow.exec.spec import RankInfo

__all__ = ["LocalHandle", "LocalLauncher", "pdeathsig_prefix"]


def pdeathsig_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL --`` where available: the child dies with the thread that started it."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv and sys.platform.startswith("linux") else []


@dataclass
class _Proc:
    info: RankInfo
    proc: asyncio.subprocess.Process
    out_path: Path
    err_path: Path


class LocalHandle:
    """The processes of one local stage group."""

    def __init__(self, procs: list[_Proc]) -> None:
        self._procs = procs

    @property
    def ident(self) -> str:
        return "pids " + ",".join(str(p.proc.pid) for p in self._procs)

    @property
    def pids(self) -> dict[int, int]:
        return {p.info.rank: p.proc.pid for p in self._procs}

    async def run(self, on_line: LineSink) -> GroupResult:
        async def read(p: _Proc) -> None:
            assert p.proc.stdout is not None
            with p.out_path.open("a") as out:
                while True:
                    line = await p.proc.stdout.readline()
                    if not line:
                        break
                    text = line.decode(errors="replace")
                    out.write(text)
                    out.flush()
                    await on_line(p.info.rank, text)
            await p.proc.wait()

        await asyncio.gather(*(read(p) for p in self._procs))
        return GroupResult(exit_codes={p.info.rank: p.proc.returncode for p in self._procs},
                           errors={p.info.rank: tail(p.err_path) for p in self._procs})

    async def stop(self, grace_s: float) -> None:
        alive = [p for p in self._procs if p.proc.returncode is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGTERM)
        for p in alive:
            try:
                await asyncio.wait_for(p.proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.kill()
                await p.proc.wait()

    async def cleanup(self) -> None:
        await self.stop(0.5)


class LocalLauncher:
    """Starts each rank as a subprocess (see the module docstring)."""

    kind = LauncherKind.LOCAL

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self.host = host

    async def launch(self, group: StageGroup) -> LocalHandle:
        env = worker_env(self.host, group.env)
        procs: list[_Proc] = []
        try:
            for info in group.ranks:
                err_path = group.run_dir / f"rank-{info.rank}.log"
                argv = [*pdeathsig_prefix(), group.python, "-m", "spiderflow.exec.worker", "--spec",
                        str(group.spec_path), "--rank", str(info.rank)]
                with err_path.open("ab") as err:
                    proc = await asyncio.create_subprocess_exec(
                        *argv, stdout=asyncio.subprocess.PIPE, stderr=err, stdin=asyncio.subprocess.DEVNULL,
                        env=env, cwd=str(group.run_dir), limit=16 * 1024 * 1024,
                    )
                procs.append(_Proc(info=info, proc=proc, out_path=group.run_dir / f"rank-{info.rank}.out",
                                   err_path=err_path))
        except OSError as e:
            await LocalHandle(procs).stop(0.5)
            raise LaunchError(f"cannot start a worker process: {e}") from None
        return LocalHandle(procs)
