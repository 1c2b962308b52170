"""One node's workers in a Kubernetes pod: ``python -m agent.launchers.node --spec FILE --first-rank F
--ranks N --per-node G [--python PY]``.

The pod of index ``i`` (``JOB_COMPLETION_INDEX`` of an indexed Job) starts ranks ``F + i·G … F + i·G + G − 1``
(those below ``F + N``), one ``python -m spiderflow.exec.worker --spec FILE --rank R`` each, and multiplexes
their output onto its own stdout (the pod log) as lines :func:`encode_line` writes:
``sf:<rank>:out:<line>`` and ``sf:<rank>:err:<line>``, then ``sf:<rank>:exit:<code>`` once the worker
ended. When one worker fails the others are stopped (SIGTERM); SIGTERM to the pod is passed on to the
workers. Exit status: the first non-zero worker status, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from typing import IO, Any

__all__ = ["decode_line", "encode_line", "main", "node_ranks"]

_PREFIX = "sf:"


def encode_line(rank: int, stream: str, text: str) -> str:
    """One pod-log line: ``stream`` is ``out``, ``err`` or ``exit``; ``text`` without its newline."""
    return f"{_PREFIX}{rank}:{stream}:{text}\n"


def decode_line(line: str) -> tuple[int, str, str] | None:
    """``(rank, stream, text)`` of a line :func:`encode_line` wrote (``text`` keeps no newline), else None."""
    if not line.startswith(_PREFIX):
        return None
    parts = line[len(_PREFIX):].rstrip("\n").split(":", 2)
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in ("out", "err", "exit"):
        return None
    return int(parts[0]), parts[1], parts[2]


def node_ranks(index: int, *, first_rank: int, ranks: int, per_node: int) -> list[int]:
    """The ranks the pod of ``index`` runs."""
    start = index * per_node
    return [first_rank + k for k in range(start, min(start + per_node, ranks))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.launchers.node", description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True)
    p.add_argument("--first-rank", type=int, required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True)
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    index = int(os.environ.get("JOB_COMPLETION_INDEX", "0"))
    mine = node_ranks(index, first_rank=args.first_rank, ranks=args.ranks, per_node=args.per_node)
    lock = threading.Lock()
    out = sys.stdout

    def emit(text: str) -> None:
        with lock:
            out.write(text)
            out.flush()

    procs: dict[int, subprocess.Popen[bytes]] = {}
    for rank in mine:
        procs[rank] = subprocess.Popen(
            [args.python, "-m", "spiderflow.exec.worker", "--spec", args.spec, "--rank", str(rank)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )

    def stop_all(*_: Any) -> None:
        for pr in procs.values():
            if pr.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    pr.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_all)

    def pump(rank: int, stream: str, pipe: IO[bytes]) -> None:
        for raw in iter(pipe.readline, b""):
            emit(encode_line(rank, stream, raw.decode(errors="replace").rstrip("\n")))

    threads = []
    for rank, pr in procs.items():
        assert pr.stdout is not None and pr.stderr is not None
        for stream, pipe in (("out", pr.stdout), ("err", pr.stderr)):
            t = threading.Thread(target=pump, args=(rank, stream, pipe), daemon=True)
            t.start()
            threads.append((rank, t))
    status = 0
    remaining = dict(procs)
    while remaining:
        for rank, pr in list(remaining.items()):
            try:
                code = pr.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            del remaining[rank]
            for r, t in threads:
                if r == rank:
                    t.join(timeout=5)
            emit(encode_line(rank, "exit", str(code)))
            if code and not status:
                status = code if code > 0 else 128 - code
                stop_all()
    return status


if __name__ == "__main__":
    sys.exit(main())
