"""Plain-TCP measurement helpers for checking the testbed's shaping (stdlib only, bounded in time).

``python -m spiderflow.testbed.probe serve --port P [--lifetime S]`` accepts connections until
``--lifetime`` seconds pass. Each connection starts with one JSON line naming its mode:

* ``{"mode": "bulk"}``: the server reads until EOF, then answers one JSON line with the *receiver-side*
  rate: bytes received after a warm-up of ``warmup_s`` past the first byte, divided by the time from
  there to the last byte (sender-side timing would count the bytes buffered on the path);
* ``{"mode": "echo"}``: the server echoes every byte until EOF.

``... probe bulk HOST PORT --seconds S`` and ``... probe rtt HOST PORT --count N`` are the clients; each
prints one JSON document on stdout: ``{"rate_mbps": ..., "bytes": ...}`` and ``{"rtt_ms": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["bulk", "main", "rtt", "serve", "wait_listening"]

_CHUNK = 64 * 1024


def _read_line(sock: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        b = sock.recv(1)
        if not b:
            break
        buf += b
    return buf


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(30.0)
        try:
            header: dict[str, Any] = json.loads(_read_line(conn) or b"{}")
            if header.get("mode") == "echo":
                while data := conn.recv(_CHUNK):
                    conn.sendall(data)
                return
            warmup = float(header.get("warmup_s", 0.3))
            first = last = 0.0
            total = counted = 0
            start_count = -1.0
            while data := conn.recv(_CHUNK):
                now = time.monotonic()
                if total == 0:
                    first = now
                    start_count = first + warmup
                total += len(data)
                if now >= start_count:
                    if counted == 0:
                        start_count = now
                    counted += len(data)
                last = now
            span = last - start_count
            rate = counted * 8 / span / 1e6 if span > 0 and counted else 0.0
            result = {"bytes": total, "counted_bytes": counted, "seconds": round(span, 4),
                      "rate_mbps": rate, "first_to_last_s": round(last - first, 4)}
            conn.sendall((json.dumps(result) + "\n").encode())
        except (OSError, ValueError):
            return


def serve(port: int, *, host: str = "0.0.0.0", lifetime_s: float = 600.0) -> None:
    """Serve bulk/echo connections on ``host:port`` for ``lifetime_s`` seconds."""
    srv = socket.create_server((host, port), reuse_port=False)
    srv.settimeout(0.5)
    deadline = time.monotonic() + lifetime_s
    with srv:
        while time.monotonic() < deadline:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def wait_listening(host: str, port: int, *, timeout: float = 30.0) -> None:
    """Return once a TCP connect to ``host:port`` succeeds (the connection is closed at once), else raise
    ``TimeoutError``. From the host, cluster addresses are reached directly (not through the relay)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s") from None
            time.sleep(0.05)


def bulk(host: str, port: int, *, seconds: float = 1.5, warmup_s: float = 0.3) -> dict[str, Any]:
    """Send for ``seconds``, half-close, return the server's receiver-side measurement."""
    with _connect(host, port, 10.0) as s:
        s.settimeout(30.0)
        s.sendall((json.dumps({"mode": "bulk", "warmup_s": warmup_s}) + "\n").encode())
        payload = b"\x00" * _CHUNK
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        result: dict[str, Any] = json.loads(_read_line(s))
        return result


def rtt(host: str, port: int, *, count: int = 10, size: int = 64, gap_s: float = 0.02) -> dict[str, Any]:
    """``count`` request/echo round trips of ``size`` bytes on one connection; RTTs in ms."""
    with _connect(host, port, 10.0) as s:
        s.settimeout(10.0)
        s.sendall((json.dumps({"mode": "echo"}) + "\n").encode())
        msg = b"x" * size
        out: list[float] = []
        for _ in range(count):
            t0 = time.monotonic()
            s.sendall(msg)
            got = 0
            while got < size:
                b = s.recv(size - got)
                if not b:
                    raise ConnectionError("echo server closed the connection")
                got += len(b)
            out.append((time.monotonic() - t0) * 1000)
            time.sleep(gap_s)
        s.shutdown(socket.SHUT_WR)
        return {"rtt_ms": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spiderflow.testbed.probe")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--lifetime", type=float, default=600.0)
    b = sub.add_parser("bulk")
    b.add_argument("host")
    b.add_argument("port", type=int)
    b.add_argument("--seconds", type=float, default=1.5)
    b.add_argument("--warmup", type=float, default=0.3)
    r = sub.add_parser("rtt")
    r.add_argument("host")
    r.add_argument("port", type=int)
    r.add_argument("--count", type=int, default=10)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        serve(args.port, lifetime_s=args.lifetime)
        return 0
    if args.cmd == "bulk":
        res = bulk(args.host, args.port, seconds=args.seconds, warmup_s=args.warmup)
    else:
        res = rtt(args.host, args.port, count=args.count)
    sys.stdout.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
