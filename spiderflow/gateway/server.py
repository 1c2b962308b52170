"""The gateway process: one mTLS port towards peer gateways, one local port for redirected outbound TCP.

Contract
--------
* :class:`Gateway` ``(config, cluster=..., tls_dir=...)``; :meth:`Gateway.start` binds both listeners
  (``config.port`` on ``config.listen_host`` with TLS, ``config.redirect`` plain) and returns;
  :meth:`Gateway.close` stops accepting and resets every open connection.
* **Outbound** (a connection accepted on the redirect port): the destination is the connection's original
  destination (``SO_ORIGINAL_DST``, set by the node's NAT ``REDIRECT``). The gateway opens TLS to the
  peer owning that address (:meth:`GatewayConfig.peer_for`), presenting the bundle's client certificate
  ``tls.crt`` and verifying that the server's certificate is signed by the bundle's CA, names
  ``agent-<peer>`` and carries the principal ``agent:<peer>``; sends the request header, waits for the
  status byte and splices. A destination of no peer, a failed TLS connect or a non-``OK`` status resets the
  accepted connection (what a refused connect looks like to the worker).
* **Inbound** (a TLS connection on the public port): the client must present a certificate of the CA whose
  principal is ``agent:<c>`` for a configured peer ``c`` (else ``FORBIDDEN``); the destination must lie in
  this cluster's ranges (:meth:`GatewayConfig.allows_inbound`, else ``FORBIDDEN``); a refused connect is
  retried for ``connect_retry_s`` (else ``UNREACHABLE``).
* **Splice**: both directions at once, each with backpressure (a writer's ``drain`` before the next read,
  so at most one chunk plus the transports' buffers is in flight per direction). A half-close (FIN) on one
  side becomes an ``EOF`` frame and a ``write_eof`` on the other; a reset (RST) becomes a ``RESET`` frame
  and a reset (``SO_LINGER`` 0) on the other; a TLS connection that breaks resets the plain side.

Events (structlog): ``gateway.started``, ``gateway.refused`` (why, peer, destination),
``gateway.closed`` (per connection: direction, peer, destination, bytes each way, how it ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from spiderflow.gateway.protocol import (
    FRAME_HEADER,
    Frame,
    GatewayConfig,
    HeaderError,
    Status,
    decode_header,
    encode_header,
    frame_header,
    header_length,
    parse_frame_header,
)
from spiderflow.security.certs import CA_CERT, CERT, KEY, SERVER_CERT, SERVER_KEY, principal_of_pem
from spiderflow.security.identity import Principal, Role

__all__ = ["Gateway", "GatewayStats", "client_context", "original_destination", "server_context"]

log = structlog.get_logger("spiderflow.gateway")

SO_ORIGINAL_DST = 80
_HEADER_TIMEOUT_S = 10.0


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """The pre-NAT destination ``(ip, port)`` of an accepted IPv4 socket (``SO_ORIGINAL_DST``)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), struct.unpack_from("!H", raw, 2)[0]


def _read(tls_dir: Path, name: str) -> Path:
    path = tls_dir / name
    if not path.is_file():
        from spiderflow.core.errors import ValidationError

        raise ValidationError("gateway.tls_dir", f"has no {name} (spiderflow certs init --cluster NAME)",
                              str(tls_dir))
    return path


def server_context(tls_dir: Path) -> ssl.SSLContext:
    """The inbound side: presents ``server.crt`` (the agent's serving certificate), requires a client
    certificate signed by ``ca.crt``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(_read(tls_dir, CA_CERT)))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(_read(tls_dir, SERVER_CERT)), str(_read(tls_dir, SERVER_KEY)))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls_dir: Path) -> ssl.SSLContext:
    """The outbound side: presents ``tls.crt`` (client authentication), verifies the server against
    ``ca.crt`` and its host name (``agent-<peer>``)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(_read(tls_dir, CA_CERT)))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(_read(tls_dir, CERT)), str(_read(tls_dir, KEY)))
    return ctx


def _principal(writer: asyncio.StreamWriter) -> Principal | None:
    obj = writer.get_extra_info("ssl_object")
    der = obj.getpeercert(binary_form=True) if obj is not None else None
    if not der:
        return None
    return principal_of_pem(ssl.DER_cert_to_PEM_cert(der).encode())


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (``SO_LINGER`` 0) so the other end sees ECONNRESET."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(slots=True)
class GatewayStats:
    """Counters since start (``outbound``/``inbound``: connections accepted; ``refused``: refused either
    way; ``bytes_out``/``bytes_in``: payload bytes sent to / received from peer gateways)."""

    outbound: int = 0
    inbound: int = 0
    refused: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    open: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def refuse(self, reason: str) -> None:
        self.refused += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class Gateway:
    """One cluster's gateway (see the module docstring). ``destination`` reads the original destination
    of an accepted outbound socket (tests on loopback, where no NAT runs, pass their own)."""

    def __init__(self, config: GatewayConfig, *, cluster: str, tls_dir: Path | str,
                 destination: Callable[[socket.socket], tuple[str, int]] = original_destination) -> None:
        self.config = config
        self.cluster = cluster
        self._server_ctx = server_context(Path(tls_dir))
        self._client_ctx = client_context(Path(tls_dir))
        self._destination = destination
        self._public: asyncio.Server | None = None
        self._redirect: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.stats = GatewayStats()

    @property
    def port(self) -> int:
        """The bound public (mTLS) port."""
        assert self._public is not None
        return int(self._public.sockets[0].getsockname()[1])

    @property
    def redirect_port(self) -> int:
        """The bound redirect (plain) port."""
        assert self._redirect is not None
        return int(self._redirect.sockets[0].getsockname()[1])

    async def start(self) -> None:
        limit = 2 * self.config.chunk_bytes
        self._public = await asyncio.start_server(
            self._track(self._inbound), host=self.config.listen_host, port=self.config.port,
            ssl=self._server_ctx, ssl_handshake_timeout=_HEADER_TIMEOUT_S, limit=limit, reuse_address=True,
            backlog=1024)
        self._redirect = await asyncio.start_server(
            self._track(self._outbound), host=self.config.redirect_host, port=self.config.redirect_port,
            limit=limit, reuse_address=True, backlog=1024)
        log.info("gateway.started", cluster=self.cluster, port=self.port, redirect=self.redirect_port,
                 ranges=list(self.config.ranges), peers=[p.cluster for p in self.config.peers])

    async def close(self) -> None:
        for server in (self._public, self._redirect):
            if server is not None:
                server.close()
        for w in list(self._writers):
            _reset(w)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        log.info("gateway.stopped", cluster=self.cluster, outbound=self.stats.outbound, inbound=self.stats.inbound,
                 refused=self.stats.refused, bytes_out=self.stats.bytes_out, bytes_in=self.stats.bytes_in)

    def _track(self, handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]
               ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            self._writers.add(writer)
            self.stats.open += 1
            try:
                await handler(reader, writer)
            except (ConnectionError, OSError, asyncio.IncompleteReadError, ssl.SSLError) as e:
                log.debug("gateway.connection_error", error=repr(e))
                _reset(writer)
            except asyncio.CancelledError:  # the gateway is closing: the connection ends here
                _reset(writer)
            finally:
                self.stats.open -= 1
                self._writers.discard(writer)
                self._tasks.discard(task)
        return run

    # ------------------------------------------------------------------------------------------ outbound
    async def _outbound(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.outbound += 1
        try:
            host, port = self._destination(writer.get_extra_info("socket"))
        except OSError:
            self._refuse(writer, "no original destination", direction="outbound")
            return
        peer = self.config.peer_for(host)
        if peer is None:
            self._refuse(writer, "destination of no peer", direction="outbound", destination=f"{host}:{port}")
            return
        try:
            tls_r, tls_w = await asyncio.wait_for(asyncio.open_connection(
                peer.host, peer.port, ssl=self._client_ctx, server_hostname=f"agent-{peer.cluster}",
                limit=2 * self.config.chunk_bytes), timeout=self.config.connect_timeout_s or None)
        except (OSError, TimeoutError, ssl.SSLError) as e:
            self._refuse(writer, f"peer gateway: {e!r}", direction="outbound", peer=peer.cluster,
                         destination=f"{host}:{port}")
            return
        self._writers.add(tls_w)
        try:
            principal = _principal(tls_w)
            if principal != Principal(role=Role.AGENT, name=peer.cluster):
                self._refuse(writer, f"peer gateway presented {principal}", direction="outbound",
                             peer=peer.cluster)
                return
            tls_w.write(encode_header(host, port))
            await tls_w.drain()
            status = await asyncio.wait_for(tls_r.readexactly(1), timeout=self.config.connect_retry_s
                                            + self.config.connect_timeout_s + _HEADER_TIMEOUT_S)
            if status[0] != Status.OK:
                name = Status(status[0]).name if status[0] in Status._value2member_map_ else str(status[0])
                self._refuse(writer, f"peer answered {name}", direction="outbound", peer=peer.cluster,
                             destination=f"{host}:{port}")
                return
            await self._splice(reader, writer, tls_r, tls_w, direction="outbound", peer=peer.cluster,
                               destination=f"{host}:{port}")
        finally:
            self._writers.discard(tls_w)
            if not tls_w.is_closing():
                tls_w.transport.abort()

    # ------------------------------------------------------------------------------------------- inbound
    async def _inbound(self, tls_r: asyncio.StreamReader, tls_w: asyncio.StreamWriter) -> None:
        self.stats.inbound += 1
        principal = _principal(tls_w)
        if principal is None or principal.role is not Role.AGENT or self.config.peer(principal.name) is None:
            await self._answer(tls_w, Status.FORBIDDEN, f"caller {principal} is not a peer gateway")
            return
        try:
            prefix = await asyncio.wait_for(tls_r.readexactly(6), timeout=_HEADER_TIMEOUT_S)
            rest = await asyncio.wait_for(tls_r.readexactly(header_length(prefix) - 6), timeout=_HEADER_TIMEOUT_S)
            host, port = decode_header(prefix + rest)
        except (HeaderError, TimeoutError) as e:
            await self._answer(tls_w, Status.BAD_REQUEST, f"bad header: {e}", peer=principal.name)
            return
        if not self.config.allows_inbound(host, port):
            await self._answer(tls_w, Status.FORBIDDEN, "destination outside this cluster's ranges",
                               peer=principal.name, destination=f"{host}:{port}")
            return
        local = await self._connect_local(host, port)
        if local is None:
            await self._answer(tls_w, Status.UNREACHABLE, "destination unreachable", peer=principal.name,
                               destination=f"{host}:{port}")
            return
        plain_r, plain_w = local
        self._writers.add(plain_w)
        try:
            tls_w.write(bytes([Status.OK]))
            await tls_w.drain()
            await self._splice(plain_r, plain_w, tls_r, tls_w, direction="inbound", peer=principal.name,
                               destination=f"{host}:{port}")
        finally:
            self._writers.discard(plain_w)
            if not plain_w.is_closing():
                plain_w.transport.abort()

    async def _connect_local(self, host: str, port: int
                             ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.connect_retry_s
        delay = 0.02
        while True:
            try:
                return await asyncio.wait_for(asyncio.open_connection(
                    host, port, limit=2 * self.config.chunk_bytes), timeout=3.0)
            except (OSError, TimeoutError):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.5)

    async def _answer(self, tls_w: asyncio.StreamWriter, status: Status, reason: str, **ids: Any) -> None:
        self.stats.refuse(status.name)
        log.info("gateway.refused", direction="inbound", status=status.name, reason=reason, **ids)
        with contextlib.suppress(OSError, ssl.SSLError):
            tls_w.write(bytes([status]))
            await asyncio.wait_for(tls_w.drain(), timeout=2.0)
        tls_w.close()

    def _refuse(self, writer: asyncio.StreamWriter, reason: str, **ids: Any) -> None:
        self.stats.refuse(reason.split(":")[0])
        log.info("gateway.refused", reason=reason, **ids)
        _reset(writer)

    # -------------------------------------------------------------------------------------------- splice
    async def _splice(self, plain_r: asyncio.StreamReader, plain_w: asyncio.StreamWriter,
                      tls_r: asyncio.StreamReader, tls_w: asyncio.StreamWriter, **ids: Any) -> None:
        t0 = time.monotonic()
        sent = [0, 0]
        chunk = self.config.chunk_bytes

        async def up() -> str:  # plain → frames
            while True:
                try:
                    data = await plain_r.read(chunk)
                except (ConnectionError, OSError):
                    with contextlib.suppress(OSError, ssl.SSLError, ConnectionError):
                        tls_w.write(frame_header(Frame.RESET))
                        await tls_w.drain()
                    return "reset"
                if not data:
                    tls_w.write(frame_header(Frame.EOF))
                    await tls_w.drain()
                    return "eof"
                tls_w.write(frame_header(Frame.DATA, len(data)))
                tls_w.write(data)
                sent[0] += len(data)
                await tls_w.drain()

        async def down() -> str:  # frames → plain
            while True:
                try:
                    kind, length = parse_frame_header(await tls_r.readexactly(FRAME_HEADER))
                    payload = await tls_r.readexactly(length) if length else b""
                except (asyncio.IncompleteReadError, HeaderError, ConnectionError, OSError, ssl.SSLError):
                    _reset(plain_w)
                    return "broken"
                if kind is Frame.RESET:
                    _reset(plain_w)
                    return "reset"
                if kind is Frame.EOF:
                    if plain_w.can_write_eof():
                        with contextlib.suppress(OSError):
                            plain_w.write_eof()
                    return "eof"
                plain_w.write(payload)
                sent[1] += length
                await plain_w.drain()

        up_task = asyncio.create_task(up())
        down_task = asyncio.create_task(down())
        ended: list[str] = []
        try:
            pending = {up_task, down_task}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    try:
                        ended.append(t.result())
                    except (ConnectionError, OSError, ssl.SSLError, asyncio.IncompleteReadError):
                        ended.append("reset")
                if any(e != "eof" for e in ended):
                    for t in pending:
                        t.cancel()
                    if pending:
                        await asyncio.gather(*pending, return_exceptions=True)
                    _reset(plain_w)
                    tls_w.close()  # flushes a RESET frame written by up() before closing
                    break
            else:
                plain_w.close()
                tls_w.close()
        finally:
            for t in (up_task, down_task):
                t.cancel()
            self.stats.bytes_out += sent[0]
            self.stats.bytes_in += sent[1]
            log.debug("gateway.closed", ended=ended, up_bytes=sent[0], down_bytes=sent[1],
                      seconds=round(time.monotonic() - t0, 3), **ids)
