"""Ctrl-C on the commands that follow a server stream ends them at once, by design: SIGINT cancels the
streaming call (``spiderflow.cli.interrupt``) instead of waiting for ``KeyboardInterrupt`` to surface from
inside the blocked gRPC iterator.

A real gRPC server on port 0 serves ``WatchJob`` and ``GetJobLogs``: one message, then nothing until the
client goes away (a job that waits for GPUs, a rank that prints nothing). The command runs as its own
process; SIGINT is sent once its first line is out (the stream is open and blocked), and it must exit 130
within seconds, say how to resume, and the server must see its call cancelled, also when the command
started with SIGINT ignored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.proto.types.v1 import types_pb2

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@dataclass
class _Blocking(scheduler_pb2_grpc.SchedulerServicer):
    """Each stream sends one message, then blocks until its client cancels (recorded) or 60 s pass."""

    ended: dict[str, threading.Event] = field(default_factory=lambda: {"watch": threading.Event(),
                                                                        "logs": threading.Event()})
    cancelled: dict[str, bool] = field(default_factory=dict)

    def _block(self, name: str, context: grpc.ServicerContext) -> None:
        gone = threading.Event()
        context.add_callback(gone.set)
        gone.wait(60)
        self.cancelled[name] = gone.is_set()
        self.ended[name].set()

    def WatchJob(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield scheduler_pb2.WatchJobResponse(revision=7, state_change=scheduler_pb2.StateTransition(
            from_state=types_pb2.JOB_STATE_PENDING, to_state=types_pb2.JOB_STATE_PENDING,
            reason="waiting for GPUs"))
        self._block("watch", context)

    def GetJobLogs(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        yield scheduler_pb2.GetJobLogsResponse(cluster="virginia", attempt=1, rank=0, stream="stdout", offset=0,
                                               data=b"first line\n")
        self._block("logs", context)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, _Blocking]]:
    servicer = _Blocking()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        srv.stop(grace=None)


#: Starts the command with SIGINT ignored: the disposition survives ``exec``. (A ``preexec_fn`` would do the
#: same, but it makes ``subprocess`` fork while this process's gRPC server threads run, and gRPC's fork
#: handlers are then skipped: the child's gRPC poller failed with "Bad file descriptor" under load.)
_SIGINT_IGNORED = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize(("name", "args", "first", "said"), [
    ("watch", ["watch", "waits-1"], "waits-1 PENDING -> PENDING: waiting for GPUs",
     "the job keeps running (re-attach: spiderflow watch waits-1; stop it: spiderflow cancel waits-1)"),
    ("logs", ["logs", "waits-1", "--follow"], "virginia/a1/r0/out | first line",
     "the job keeps running (spiderflow logs waits-1 --follow resumes)"),
])
def test_sigint_while_the_stream_is_blocked_cancels_it_and_exits_at_once(
        server: tuple[str, _Blocking], name: str, args: list[str], first: str, said: str, inherited: str) -> None:
    """``inherited="ignored"``: the command starts with SIGINT ignored, as every child of a background job of
    a non-interactive shell does (``nohup pytest ... &``); ``kill -INT`` must still stop it."""
    address, servicer = server
    servicer.ended[name].clear()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIDERFLOW_")}
    env.update(PYTHONPATH=str(ROOT), SPIDERFLOW_CONFIG=str(ROOT / "nonexistent-config.yaml"))
    wrapper = [sys.executable, "-c", _SIGINT_IGNORED] if inherited == "ignored" else [sys.executable]
    proc = subprocess.Popen([*wrapper, "-m", "spiderflow.cli.main", *args, "--address", address], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert first in line, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        time.sleep(0.3)  # the client is now blocked waiting for the next message
        assert not servicer.ended[name].is_set()
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            masks = " ".join(x for x in status.splitlines() if x.startswith("Sig"))
            raise AssertionError(f"{name} did not exit within 15 s of SIGINT ({masks})") from None
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert said in err and "Traceback" not in err, err
    assert took < 5, f"{name} took {took:.1f} s to end after SIGINT"
    assert servicer.ended[name].wait(10) and servicer.cancelled[name], "the server never saw the call cancelled"
