"""The delay-line relay: adds per-pair one-way latency to cluster-to-cluster TCP (netem is unavailable).

Runs as a child process in the router namespace (``python -m spiderflow.testbed.relay --config FILE``).
The router's ``nat PREROUTING`` REDIRECTs cluster-to-cluster TCP to ``--port``; for every accepted
connection the relay

* reads the original destination with ``getsockopt(SOL_IP, SO_ORIGINAL_DST)`` and identifies the pair
  ``src → dst`` by the client's and the destination's addresses (unknown or unreachable: reset);
* connects onward with ``SO_PRIORITY`` = the pair's htb class id, so the kernel shapes the bandwidth
  (see :mod:`spiderflow.testbed.layout`); a refused onward connect is retried for ``connect_retry_s``
  (the client's connect has already succeeded, so a service that starts a moment later, such as a
  rendezvous store, is still reached);
* forwards each direction through a pipelined delay line: every chunk is released at
  ``max(arrival + one-way latency of its direction, release time of the previous chunk)``; past a queue
  bound of ``bandwidth × latency + slack`` bytes it stops reading (backpressure), and half-closes,
  resets and closes travel with the same delay as the data before them.

Control: a Unix socket (``control`` in the config) takes one JSON request per line and answers one JSON
line: ``{"op": "ping"}``, ``{"op": "set", "pairs": [[src, dst, bandwidth_gbps, latency_ms], ...]}``
(indices as in the config; takes effect for chunks arriving afterwards) and ``{"op": "stats"}``.

Config file (JSON): ``{"port": int, "control": path, "connect_retry_s": float, "addresses":
{ip: cluster_index}, "pairs": [[src, dst, bandwidth_gbps, latency_ms], ...]}``.

Limits: each leg is a near-zero-RTT TCP, so loss and window effects of a long path are not emulated;
release times are within about ±0.5 ms of due (see ``TIMER_LEAD_S``). The process raises its own
scheduling priority (``--nice``, default -10) so that a loaded machine delays it less.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from spiderflow.runtime import stderr_logger_factory

__all__ = ["DelayLine", "PairTable", "RelayConfig", "main", "original_destination", "serve"]

log = structlog.get_logger("spiderflow.testbed.relay")

SO_ORIGINAL_DST = 80
_SLACK_BYTES = 256 * 1024
_SOCKBUF = 256 * 1024
_EOF = b""
#: The event loop's timers wake up to 1 ms late (epoll rounds its timeout up to whole ms); chunks are
#: therefore scheduled this much before their due time, centring the release error around zero.
TIMER_LEAD_S = 0.0004


@dataclass(slots=True, kw_only=True)
class PairTable:
    """Mutable per-pair figures: ``(src, dst) → (bandwidth_gbps, latency_ms)``."""

    figures: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)

    def set(self, rows: list[list[float]]) -> None:
        for row in rows:
            src, dst, bw, lat = int(row[0]), int(row[1]), float(row[2]), float(row[3])
            if bw < 0 or lat < 0:
                raise ValueError(f"negative figure for pair {src}->{dst}")
            self.figures[(src, dst)] = (bw, lat)

    def latency_s(self, src: int, dst: int) -> float:
        return self.figures.get((src, dst), (0.0, 0.0))[1] / 1000.0

    def bandwidth_gbps(self, src: int, dst: int) -> float:
        return self.figures.get((src, dst), (0.0, 0.0))[0]

    def bound(self, src: int, dst: int) -> int:
        """Delay-line capacity in bytes: bandwidth-delay product × 1.25 + slack."""
        bw, lat = self.figures.get((src, dst), (0.0, 0.0))
        return int(bw * 1e9 / 8 * lat / 1000.0 * 1.25) + _SLACK_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayConfig:
    port: int
    control: str
    connect_retry_s: float
    addresses: dict[str, int]
    pairs: list[list[float]]

    @staticmethod
    def load(path: str | Path) -> RelayConfig:
        raw = json.loads(Path(path).read_text())
        return RelayConfig(
            port=int(raw["port"]),
            control=str(raw["control"]),
            connect_retry_s=float(raw.get("connect_retry_s", 10.0)),
            addresses={str(k): int(v) for k, v in raw["addresses"].items()},
            pairs=[list(map(float, p)) for p in raw["pairs"]],
        )


def original_destination(sock: Any) -> tuple[str, int]:
    """The pre-REDIRECT destination ``(ip, port)`` of an accepted IPv4 socket (``SO_ORIGINAL_DST``)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack_from("!H", raw, 2)[0]
    ip = socket.inet_ntoa(raw[4:8])
    return ip, port


class DelayLine:
    """One direction of a relayed connection: FIFO of ``(release_time, chunk)`` with a byte bound.

    Contract: :meth:`feed` is called with each chunk read from the source (``b""`` for a half-close);
    chunks are written to the sink transport in order, none before its release time, and only while the
    sink is not paused (:meth:`pause`/:meth:`resume` follow the sink's flow control). While more than
    ``bound()`` bytes are queued, ``pause_source`` has been called; ``resume_source`` once it drains
    below half the bound. ``on_eof`` runs when the half-close has been delivered, ``on_reset`` when a
    queued reset (:meth:`reset`) is due.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        latency_s: Callable[[], float],
        bound: Callable[[], int],
        pause_source: Callable[[], None],
        resume_source: Callable[[], None],
        on_eof: Callable[[], None],
        on_reset: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._latency_s = latency_s
        self._bound = bound
        self._pause_source = pause_source
        self._resume_source = resume_source
        self._on_eof = on_eof
        self._on_reset = on_reset
        self._queue: deque[tuple[float, bytes | None]] = deque()
        self._queued = 0
        self._last = 0.0
        self._sink: asyncio.WriteTransport | None = None
        self._sink_paused = False
        self._source_paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.delivered = 0
        self.closed = False

    @property
    def queued_bytes(self) -> int:
        return self._queued

    def attach(self, sink: asyncio.WriteTransport) -> None:
        self._sink = sink
        self._kick()

    def feed(self, data: bytes) -> None:
        if self.closed:
            return
        when = max(self._loop.time() + self._latency_s(), self._last)
        self._last = when
        self._queue.append((when, data))
        self._queued += len(data)
        if self._queued > self._bound() and not self._source_paused:
            self._source_paused = True
            self._pause_source()
        self._kick()

    def reset(self) -> None:
        """Queue a reset: delivered (``on_reset``) after the data already queued."""
        if self.closed:
            return
        when = max(self._loop.time() + self._latency_s(), self._last)
        self._last = when
        self._queue.append((when, None))
        self._kick()

    def pause(self) -> None:
        self._sink_paused = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def resume(self) -> None:
        self._sink_paused = False
        self._kick()

    def close(self) -> None:
        self.closed = True
        self._queue.clear()
        self._queued = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _kick(self) -> None:
        if self._timer is None and self._queue and self._sink is not None and not self._sink_paused:
            self._timer = self._loop.call_at(self._queue[0][0] - TIMER_LEAD_S, self._release)

    def _release(self) -> None:
        self._timer = None
        sink = self._sink
        assert sink is not None
        now = self._loop.time() + TIMER_LEAD_S
        while self._queue and self._queue[0][0] <= now and not self._sink_paused and not self.closed:
            _, data = self._queue.popleft()
            if data is None:
                self.close()
                self._on_reset()
                return
            if data == _EOF:
                if sink.can_write_eof():
                    sink.write_eof()
                self._on_eof()
                continue
            self._queued -= len(data)
            self.delivered += len(data)
            sink.write(data)  # may call pause() synchronously
        if self._source_paused and self._queued <= self._bound() // 2:
            self._source_paused = False
            self._resume_source()
        self._kick()


class _Side(asyncio.Protocol):
    """One socket of a relayed connection; feeds ``outgoing`` and is the sink of ``incoming``."""

    def __init__(self, conn: _Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.outgoing: DelayLine | None = None
        self.incoming: DelayLine | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=64 * 1024)

    def data_received(self, data: bytes) -> None:
        assert self.outgoing is not None
        self.outgoing.feed(data)

    def eof_received(self) -> bool:
        assert self.outgoing is not None
        self.outgoing.feed(_EOF)
        return True

    def pause_writing(self) -> None:
        if self.incoming is not None:
            self.incoming.pause()

    def resume_writing(self) -> None:
        if self.incoming is not None:
            self.incoming.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.side_lost(self, exc)


class _Connection:
    """A client (accepted) socket, its onward socket, and the two delay lines between them."""

    def __init__(self, relay: _Relay) -> None:
        self.relay = relay
        self.client: _Side = _Side(self, "unset")
        self.server: _Side | None = None
        self.src = -1
        self.dst = -1
        self.eofs = 0
        self.closed = False

    def side_lost(self, side: _Side, exc: Exception | None) -> None:
        if self.closed:
            return
        other = self.server if side is self.client else self.client
        if other is None or other.transport is None:
            self.close(abort=True)
            return
        if exc is not None or self.eofs < 2:
            # The peer reset or closed before both half-closes went through: pass a reset on, in order.
            assert side.outgoing is not None
            side.outgoing.reset()
            if side.incoming is not None:
                side.incoming.close()
        else:
            self.close(abort=False)

    def delivered_eof(self) -> None:
        self.eofs += 1
        if self.eofs >= 2:
            self.close(abort=False)

    def close(self, *, abort: bool) -> None:
        if self.closed:
            return
        self.closed = True
        for side in (self.client, self.server):
            if side is None:
                continue
            if side.outgoing is not None:
                self.relay.bytes += side.outgoing.delivered
            for line in (side.outgoing, side.incoming):
                if line is not None:
                    line.close()
            if side.transport is not None:
                if abort:
                    _reset(side.transport)
                else:
                    side.transport.close()
        self.relay.connections.discard(self)


class _Relay:
    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.table = PairTable()
        self.table.set(config.pairs)
        self.connections: set[_Connection] = set()
        self.accepted = 0
        self.refused = 0
        self.bytes = 0

    def stats(self) -> dict[str, Any]:
        return {
            "connections": len(self.connections),
            "accepted": self.accepted,
            "refused": self.refused,
            "bytes": self.bytes + sum(
                (c.client.outgoing.delivered if c.client.outgoing else 0)
                + (c.client.incoming.delivered if c.client.incoming else 0)
                for c in self.connections
            ),
        }

    def client_factory(self) -> _Side:
        return _ClientSide(_Connection(self), "client")

    async def connect_onward(self, conn: _Connection, ip: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.connect_retry_s
        delay = 0.02
        last: Exception | None = None
        while not conn.closed:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, _class_id(conn.src))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKBUF)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _sndbuf(self.table.bandwidth_gbps(
                    conn.src, conn.dst)))
                sock.setblocking(False)
                await asyncio.wait_for(loop.sock_connect(sock, (ip, port)), timeout=3.0)
            except (OSError, TimeoutError) as e:
                sock.close()
                last = e
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.5)
                continue
            if conn.closed:
                sock.close()
                return
            client = conn.client
            assert client.outgoing is not None and client.transport is not None
            # client → server and server → client delay lines, wired before any byte can arrive
            server = _Side(conn, "server")
            server.incoming = client.outgoing
            server.outgoing = self._line(conn, conn.dst, conn.src, server)
            client.incoming = server.outgoing
            conn.server = server
            await loop.create_connection(functools.partial(_same, server), sock=sock)
            if conn.closed or server.transport is None:
                if server.transport is not None:
                    server.transport.abort()
                return
            client.outgoing.attach(server.transport)
            server.outgoing.attach(client.transport)
            return
        self.refused += 1
        log.info("onward_connect_failed", src=conn.src, dst=conn.dst, ip=ip, port=port, error=str(last))
        conn.close(abort=True)

    def _line(self, conn: _Connection, src: int, dst: int, source: _Side) -> DelayLine:
        loop = asyncio.get_running_loop()

        def pause() -> None:
            if source.transport is not None:
                source.transport.pause_reading()

        def resume() -> None:
            if source.transport is not None and not source.transport.is_closing():
                source.transport.resume_reading()

        def reset() -> None:
            conn.close(abort=True)

        return DelayLine(
            loop,
            latency_s=lambda: self.table.latency_s(src, dst),
            bound=lambda: self.table.bound(src, dst),
            pause_source=pause,
            resume_source=resume,
            on_eof=conn.delivered_eof,
            on_reset=reset,
        )


class _ClientSide(_Side):
    def __init__(self, conn: _Connection, name: str) -> None:
        super().__init__(conn, name)
        conn.client = self

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        conn = self.conn
        relay = conn.relay
        relay.accepted += 1
        relay.connections.add(conn)
        sock = transport.get_extra_info("socket")
        peer = transport.get_extra_info("peername")
        try:
            ip, port = original_destination(sock)
        except OSError:
            conn.close(abort=True)
            return
        src = relay.config.addresses.get(peer[0], -1)
        dst = relay.config.addresses.get(ip, -1)
        if src < 0 or dst < 0 or src == dst or relay.table.bandwidth_gbps(src, dst) <= 0:
            relay.refused += 1
            log.info("connection_rejected", peer=peer[0], dst=ip, port=port)
            conn.close(abort=True)
            return
        conn.src, conn.dst = src, dst
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, _class_id(dst))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _sndbuf(relay.table.bandwidth_gbps(dst, src)))
        self.outgoing = relay._line(conn, src, dst, self)
        task = asyncio.get_running_loop().create_task(relay.connect_onward(conn, ip, port))
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)


_TASKS: set[asyncio.Task[None]] = set()


def _reset(transport: asyncio.Transport) -> None:
    """Close with a TCP reset (``SO_LINGER`` 0), so the peer sees ECONNRESET as it would without us."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _same(side: _Side) -> _Side:
    return side


def _class_id(index: int) -> int:
    return (1 << 16) | (index + 1)


def _sndbuf(bandwidth_gbps: float) -> int:
    """Kernel send buffer of a relay socket: ~20 ms of the pair's bandwidth, 64 KiB .. 4 MiB."""
    return int(min(max(bandwidth_gbps * 1e9 / 8 * 0.02, 64 * 1024), 4 * 1024 * 1024))


async def _control(relay: _Relay, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            try:
                req = json.loads(line)
                op = req.get("op")
                if op == "ping":
                    resp: dict[str, Any] = {"ok": True}
                elif op == "set":
                    relay.table.set(req["pairs"])
                    log.info("pairs_updated", pairs=req["pairs"])
                    resp = {"ok": True}
                elif op == "stats":
                    resp = {"ok": True, **relay.stats()}
                else:
                    resp = {"ok": False, "error": f"unknown op {op!r}"}
            except (ValueError, KeyError, TypeError) as e:
                resp = {"ok": False, "error": str(e)}
            writer.write((json.dumps(resp) + "\n").encode())
            await writer.drain()
    finally:
        writer.close()


async def serve(config: RelayConfig, *, stop: asyncio.Event | None = None) -> None:
    """Run the relay until ``stop`` is set (or SIGTERM/SIGINT when run as a process)."""
    loop = asyncio.get_running_loop()
    relay = _Relay(config)
    stop = stop or asyncio.Event()
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKBUF)
    lsock.bind(("0.0.0.0", config.port))
    lsock.listen(1024)
    server = await loop.create_server(relay.client_factory, sock=lsock)
    with contextlib.suppress(FileNotFoundError):
        Path(config.control).unlink()
    control = await asyncio.start_unix_server(lambda r, w: _control(relay, r, w), path=config.control)
    log.info("relay_started", port=config.port, control=config.control, pairs=len(config.pairs))
    try:
        await stop.wait()
    finally:
        server.close()
        control.close()
        for conn in list(relay.connections):
            conn.close(abort=True)
        with contextlib.suppress(FileNotFoundError):
            Path(config.control).unlink()
        log.info("relay_stopped", **relay.stats())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spiderflow.testbed.relay")
    parser.add_argument("--config", required=True)
    parser.add_argument("--nice", type=int, default=-10, help="niceness increment (negative needs root)")
    args = parser.parse_args(argv)
    if args.nice:
        with contextlib.suppress(OSError):
            os.nice(args.nice)
    structlog.configure(
        processors=[structlog.processors.TimeStamper(fmt="iso"), structlog.processors.JSONRenderer()],
        logger_factory=stderr_logger_factory(),
    )
    config = RelayConfig.load(args.config)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop=stop)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
