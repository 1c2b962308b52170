"""The gateway beside its agent: a child process the agent starts, restarts and stops.

:class:`GatewayProcess` writes the gateway's configuration (``<work_dir>/gateway/config.json``: the cluster,
the bundle directory and the ``gateway:`` section), starts ``python -m spiderflow.gateway`` with the agent's
environment minus its secrets (:func:`spiderflow.security.secrets.worker_environment`: the gateway needs
only its certificate files), waits until both listeners are bound (its ready file), restarts it with
backoff (1 s doubling to 30 s) whenever it exits while the agent runs, and stops it (SIGTERM, then SIGKILL
after 5 s) with the agent; where util-linux ``setpriv`` exists it also dies with an agent that is killed.
Its output goes to ``<work_dir>/gateway/gateway.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import structlog

from spiderflow.core.errors import UnavailableError
from spiderflow.gateway.protocol import GatewayConfig, config_to_dict
from spiderflow.security.secrets import worker_environment

__all__ = ["GatewayProcess"]

log = structlog.get_logger("spiderflow.gateway")


def _pdeathsig() -> list[str]:
    """``setpriv --pdeathsig TERM`` where available: a gateway whose agent is killed (SIGKILL) goes with it
    rather than keep the port a restarted agent's gateway needs."""
    import shutil

    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv and sys.platform.startswith("linux") else []


class GatewayProcess:
    """One cluster's gateway as a supervised child process (see the module docstring)."""

    def __init__(self, *, cluster: str, config: GatewayConfig, tls_dir: str | Path, work_dir: Path,
                 python: str = sys.executable) -> None:
        self.cluster = cluster
        self.config = config
        self.tls_dir = str(tls_dir)
        self.dir = work_dir / "gateway"
        self.python = python
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False

    @property
    def ready_file(self) -> Path:
        return self.dir / "ready.json"

    async def start(self, timeout: float = 30.0) -> dict[str, object]:
        """Start the gateway and wait for its ready file; :class:`UnavailableError` with the log's tail when it
        exits first or is not ready within ``timeout``. Returns the ready document."""
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = self.dir / "config.json"
        cfg.write_text(json.dumps({"cluster": self.cluster, "tls_dir": self.tls_dir,
                                   "gateway": config_to_dict(self.config)}))
        self.ready_file.unlink(missing_ok=True)
        logfile = self.dir / "gateway.log"
        offset = logfile.stat().st_size if logfile.exists() else 0  # this start's lines only in errors
        with open(logfile, "ab") as out:
            self.proc = await asyncio.create_subprocess_exec(
                *_pdeathsig(), self.python, "-m", "spiderflow.gateway", "--config", str(cfg),
                "--ready-file", str(self.ready_file), "--log-format", "json", stdout=out, stderr=out,
                stdin=asyncio.subprocess.DEVNULL, env=worker_environment(os.environ), start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.returncode is not None or time.monotonic() > deadline:
                with open(logfile, "rb") as f:
                    f.seek(offset)
                    tail = f.read().decode(errors="replace")[-1000:]
                await self._terminate()
                raise UnavailableError(f"the gateway of {self.cluster} did not start: {tail.strip()}")
            await asyncio.sleep(0.05)
        ready: dict[str, object] = json.loads(self.ready_file.read_text())
        log.info("gateway.process_started", cluster=self.cluster, pid=self.proc.pid, port=ready.get("port"),
                 redirect=ready.get("redirect_port"))
        return ready

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart the gateway whenever it exits until ``stop`` is set; then stop it."""
        try:
            while not stop.is_set():
                proc = self.proc
                assert proc is not None
                waiter = asyncio.ensure_future(proc.wait())
                stopper = asyncio.ensure_future(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if stop.is_set():
                    waiter.cancel()
                    break
                backoff = min(2.0 ** self.restarts, 30.0)
                log.warning("gateway.process_exited", cluster=self.cluster, code=proc.returncode,
                            restart_in_s=backoff)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=backoff)
                if stop.is_set():
                    break
                self.restarts += 1
                with contextlib.suppress(UnavailableError):
                    await self.start()
        finally:
            await self.stop()

    async def stop(self) -> None:
        self._stopping = True
        await self._terminate()

    async def _terminate(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout=5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
