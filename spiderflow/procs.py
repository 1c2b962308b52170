"""Child processes of SpiderFlow services and agents: start, wait until ready, signal, stop.

Used by ``spiderflow up`` and by the integration tests, so both run the services exactly as an operator
does (``spiderflow serve ...`` / ``spiderflow agent ...`` as separate processes on real ports).
A child writes a readiness document (``--ready-file``, see :mod:`spiderflow.runtime`) once it serves;
:meth:`ManagedProcess.start` waits for it (or for the child to die, raising with its last log lines).
Children die with their parent (``setpriv --pdeathsig KILL`` where available), so an interrupted run
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spiderflow.core.errors import UnavailableError
from spiderflow.store.process import _pdeathsig_prefix

__all__ = ["ManagedProcess", "spiderflow_argv"]


def spiderflow_argv(*args: str) -> list[str]:
    """``python -m spiderflow.cli.main ARGS`` with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "spiderflow.cli.main", *args]


class ManagedProcess:
    """One child process with a readiness file and a log file.

    ``argv`` must accept ``--ready-file PATH`` (appended here) unless ``ready=False``.
    """

    def __init__(self, name: str, argv: Sequence[str], *, log_dir: Path | None = None,
                 env: Mapping[str, str] | None = None, ready: bool = True, die_with_parent: bool = True,
                 prefix: Sequence[str] = ()) -> None:
        self.name = name
        self._dir = log_dir or Path(tempfile.mkdtemp(prefix=f"spiderflow-{name}-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._dir / f"{name}.log"
        self.ready_path = self._dir / f"{name}.ready.json"
        self._argv = [*argv, "--ready-file", str(self.ready_path)] if ready else list(argv)
        self._prefix = [*prefix, *(_pdeathsig_prefix() if die_with_parent else [])]
        self._env = {**os.environ, **(env or {})}
        self._wait_ready = ready
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_doc: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return str(self.ready_doc.get("address", ""))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 60.0) -> ManagedProcess:
        """:meth:`spawn`, then :meth:`wait_ready`."""
        return self.spawn().wait_ready(timeout)

    def spawn(self) -> ManagedProcess:
        """Start the child without waiting for it (several children then start side by side)."""
        self.ready_path.unlink(missing_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen([*self._prefix, *self._argv], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self._env, start_new_session=True)
        finally:
            log.close()
        return self

    def wait_ready(self, timeout: float = 60.0) -> ManagedProcess:
        """Wait for the readiness document (stopping the child and raising if it dies or times out)."""
        assert self.proc is not None, "spawn() first"
        if not self._wait_ready:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_path.exists():
                try:
                    self.ready_doc = json.loads(self.ready_path.read_text())
                    return self
                except ValueError:
                    pass
            if self.proc.poll() is not None:
                raise UnavailableError(f"{self.name} exited with {self.proc.returncode} before it was ready: "
                                       f"{self.tail()}")
            time.sleep(0.05)
        self.stop()
        raise UnavailableError(f"{self.name} was not ready within {timeout:.0f} s: {self.tail()}")

    def tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, no grace (for fault-injection)."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        # The child's own children (its process group) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode
