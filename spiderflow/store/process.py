"""Run a real single-member etcd as a child process (tests, and ``spiderflow up`` embedding etcd).

:class:`EtcdProcess` owns one ``etcd`` child listening on ``127.0.0.1`` with client and peer ports
chosen free at the first start and kept across restarts (so clients reconnect to the same address),
and a data directory that is either given (kept) or a fresh temporary one (removed by :meth:`close`).

Contract:

- :meth:`start` returns only when ``/health`` on the client URL answers healthy, or raises
  :class:`~spiderflow.core.errors.UnavailableError` with the tail of etcd's log.
- :meth:`stop` sends SIGTERM, then SIGKILL after ``timeout``; :meth:`kill` sends SIGKILL at once. Both
  reap the child. A stopped (SIGSTOPped) child is killed as well.
- :meth:`restart` = stop + start on the same ports and data dir: committed data and unexpired leases
  survive.
- :meth:`suspend` / :meth:`resume` send SIGSTOP / SIGCONT (an outage without losing state).
- :meth:`close` kills the child and removes a temporary data dir; it is idempotent and also runs on
  ``with`` exit. With ``die_with_parent`` (default) the child gets SIGKILL when the *thread* that
  started it exits (Linux ``PR_SET_PDEATHSIG`` via ``setpriv``), so call :meth:`start` from a
  long-lived thread (the main thread), never from a short-lived worker.

With ``tls`` (:class:`~spiderflow.store.tls.EtcdTLS`, its ``cert``/``key`` being etcd's server certificate)
the client URL is ``https`` and, with ``client_cert_auth`` (default), etcd requires client certificates
signed by ``tls.ca`` (``--cert-file --key-file --trusted-ca-file --client-cert-auth``); the health check
presents the server's own certificate (valid for client authentication too). Peers stay on loopback
plaintext (a single member).

Defaults ``heartbeat_ms=10, election_ms=100`` make a fresh member ready in ~0.1 s; with them etcd's
minimum lease TTL is 1 s (``ceil(1.5 × election timeout)``). Transactions may carry up to
:data:`MAX_TXN_OPS` operations per list (``--max-txn-ops``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import structlog

from spiderflow.core.errors import PreconditionError, UnavailableError, ValidationError
from spiderflow.store.tls import EtcdTLS

__all__ = ["MAX_TXN_OPS", "EtcdProcess", "find_etcd", "free_port"]

#: ``--max-txn-ops`` of the etcd we start (etcd's default is 128): a job bound on a long chain writes
#: allocations + assignments + job + plan in one transaction.
MAX_TXN_OPS = 1024

_log = structlog.get_logger(__name__)

_DEFAULT_BINARIES = ("/usr/bin/etcd", "/usr/local/bin/etcd")


def find_etcd() -> str:
    """Path of the etcd binary: ``$SPIDERFLOW_ETCD_BIN``, ``etcd`` on PATH, or a Debian location.

    Raises :class:`PreconditionError` when none exists."""
    env = os.environ.get("SPIDERFLOW_ETCD_BIN")
    if env:
        return env
    found = shutil.which("etcd")
    if found:
        return found
    for candidate in _DEFAULT_BINARIES:
        if os.access(candidate, os.X_OK):
            return candidate
    raise PreconditionError("etcd binary not found (install etcd-server or set SPIDERFLOW_ETCD_BIN)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _pdeathsig_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL`` when available: the child dies with the thread that started it.

    Done by exec'ing through util-linux ``setpriv`` rather than a ``preexec_fn`` (unsafe in a
    multi-threaded parent such as one running gRPC)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv and sys.platform.startswith("linux") else []


class EtcdProcess:
    """One etcd member as a child process; see the module docstring for the contract."""

    def __init__(
        self,
        *,
        data_dir: str | Path | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "spiderflow",
        binary: str | None = None,
        heartbeat_ms: int = 10,
        election_ms: int = 100,
        extra_args: Sequence[str] = (),
        die_with_parent: bool = True,
        tls: EtcdTLS | None = None,
        client_cert_auth: bool = True,
    ) -> None:
        if tls is not None and tls.cert is None:
            raise ValidationError("tls", "etcd needs a server certificate and key to serve TLS", str(tls.ca))
        self._binary = binary or find_etcd()
        self._tls = tls
        self._ssl: ssl.SSLContext | None = None
        self._client_cert_auth = client_cert_auth
        self._host = host
        self._name = name
        self._heartbeat_ms = heartbeat_ms
        self._election_ms = election_ms
        self._extra_args = tuple(extra_args)
        self._die_with_parent = die_with_parent
        self._fixed_ports = client_port is not None
        self._client_port = client_port
        self._peer_port = peer_port
        self._owns_dir = data_dir is None
        self._base = Path(tempfile.mkdtemp(prefix="spiderflow-etcd-")) if data_dir is None else None
        self._data_dir = (self._base / "data") if self._base is not None else Path(data_dir)  # type: ignore[arg-type]
        self._log_path = (self._base / "etcd.log") if self._base is not None else (
            self._data_dir.parent / f"{self._data_dir.name}.etcd.log"
        )
        self._proc: subprocess.Popen[bytes] | None = None
        self._suspended = False
        self._closed = False

    # -- properties ---------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """Address etcd listens on."""
        return self._host

    @property
    def port(self) -> int:
        """Client port (assigned at the first :meth:`start`)."""
        if self._client_port is None:
            raise PreconditionError("etcd has not been started yet")
        return self._client_port

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL."""
        return f"{self._host}:{self.port}"

    @property
    def tls(self) -> EtcdTLS | None:
        """The server's TLS material (None: plaintext client URL)."""
        return self._tls

    @property
    def url(self) -> str:
        """The client URL (``http://`` or ``https://host:port``)."""
        return f"{'https' if self._tls is not None else 'http'}://{self.endpoint}"

    @property
    def data_dir(self) -> Path:
        """The member's data directory."""
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """File receiving etcd's stdout and stderr."""
        return self._log_path

    @property
    def pid(self) -> int | None:
        """PID of the running child, or None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        """True while the child exists (also when suspended)."""
        return self.pid is not None

    # -- lifecycle ----------------------------------------------------------------------------------

    def _args(self) -> list[str]:
        assert self._client_port is not None and self._peer_port is not None
        client = f"{'https' if self._tls is not None else 'http'}://{self._host}:{self._client_port}"
        peer = f"http://{self._host}:{self._peer_port}"
        tls: list[str] = []
        if self._tls is not None:
            assert self._tls.cert is not None and self._tls.key is not None
            tls = ["--cert-file", str(self._tls.cert), "--key-file", str(self._tls.key),
                   "--trusted-ca-file", str(self._tls.ca)]
            if self._client_cert_auth:
                tls.append("--client-cert-auth")
        return [
            self._binary,
            "--name", self._name,
            "--data-dir", str(self._data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self._name}={peer}",
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(self._heartbeat_ms),
            "--election-timeout", str(self._election_ms),
            "--max-txn-ops", str(MAX_TXN_OPS),
            "--logger", "zap",
            "--log-outputs", "stderr",
            *tls,
            *self._extra_args,
        ]

    def start(self, timeout: float = 10.0) -> EtcdProcess:
        """Start etcd (no-op if running) and wait until healthy; returns ``self``."""
        if self._closed:
            raise PreconditionError("EtcdProcess is closed")
        if self.running:
            return self
        attempts = 1 if (self._fixed_ports or self._client_port is not None) else 3
        last: UnavailableError | None = None
        for _ in range(attempts):
            if self._client_port is None:
                self._client_port = free_port(self._host)
            if self._peer_port is None:
                self._peer_port = free_port(self._host)
            try:
                self._spawn_and_wait(timeout)
                return self
            except UnavailableError as exc:  # a port taken between probe and bind: try fresh ports
                last = exc
                if not self._fixed_ports:
                    self._client_port = self._peer_port = None
        assert last is not None
        raise last

    def _spawn_and_wait(self, timeout: float) -> None:
        self._data_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            prefix = _pdeathsig_prefix() if self._die_with_parent else []
            self._proc = subprocess.Popen(
                [*prefix, *self._args()], stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        finally:
            log.close()
        self._suspended = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if self._healthy(0.5):
                _log.info("etcd.started", pid=self._proc.pid, url=self.url, data_dir=str(self._data_dir))
                return
            time.sleep(0.02)
        self.kill()
        raise UnavailableError(f"etcd did not become healthy in {timeout:.1f}s: {self._log_tail()}")

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self._tls is None:
            return None
        if self._ssl is None:
            ctx = ssl.create_default_context(cafile=str(self._tls.ca))
            assert self._tls.cert is not None and self._tls.key is not None
            ctx.load_cert_chain(str(self._tls.cert), str(self._tls.key))
            self._ssl = ctx
        return self._ssl

    def _healthy(self, timeout: float) -> bool:
        url = f"{self.url}/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=self._ssl_context()) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _log_tail(self, lines: int = 5) -> str:
        try:
            text = self._log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (after SIGCONT if suspended), SIGKILL after ``timeout``; reaps the child."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._proc = None
            return
        with contextlib.suppress(ProcessLookupError):
            if self._suspended:
                proc.send_signal(signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None
        self._suspended = False
        _log.info("etcd.stopped", pid=proc.pid)

    def kill(self) -> None:
        """SIGKILL the child at once and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._proc = None
        self._suspended = False

    def restart(self, timeout: float = 10.0) -> EtcdProcess:
        """Stop and start again on the same ports and data dir."""
        self.stop()
        return self.start(timeout)

    def suspend(self, timeout: float = 2.0) -> None:
        """SIGSTOP the child and wait until every thread is stopped: it keeps its sockets (the kernel
        still accepts and buffers) but answers nothing."""
        if self._proc is None or self._proc.poll() is not None:
            raise PreconditionError("etcd is not running")
        self._proc.send_signal(signal.SIGSTOP)
        self._suspended = True
        self._wait_states(self._proc.pid, stopped=True, timeout=timeout)

    def resume(self, timeout: float = 2.0) -> None:
        """SIGCONT a suspended child and wait until it runs again."""
        if self._proc is None or self._proc.poll() is not None:
            raise PreconditionError("etcd is not running")
        self._proc.send_signal(signal.SIGCONT)
        self._suspended = False
        self._wait_states(self._proc.pid, stopped=False, timeout=timeout)

    @staticmethod
    def _wait_states(pid: int, *, stopped: bool, timeout: float) -> None:
        """Signals are delivered asynchronously: poll ``/proc/<pid>/task/*/stat`` (Linux) until all
        threads are (not) in state T. Without /proc, return at once."""
        tasks = Path(f"/proc/{pid}/task")
        if not tasks.is_dir():
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for stat in tasks.glob("*/stat"):
                with contextlib.suppress(OSError):
                    states.append(stat.read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"))
            if states and all(states) == stopped and any(states) == stopped:
                return
            time.sleep(0.002)
        raise UnavailableError(f"etcd pid {pid} did not {'stop' if stopped else 'continue'} in {timeout}s")

    def close(self) -> None:
        """Kill the child and remove a temporary data dir; idempotent."""
        self.kill()
        if self._base is not None and self._owns_dir:
            shutil.rmtree(self._base, ignore_errors=True)
        self._closed = True

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        port = self._client_port if self._client_port is not None else "-"
        return f"EtcdProcess(endpoint={self._host}:{port}, pid={self.pid}, data_dir={str(self._data_dir)!r})"
