"""Two real gateways on loopback with mutual TLS (certificates of ``spiderflow certs init``): bytes, half-close
and resets cross them; a destination outside the inbound cluster's ranges, a caller that is not a peer and a
certificate of another role are refused. No NAT here: the outbound side is told the destination directly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from spiderflow.gateway.protocol import GatewayConfig, GatewayPeer
from spiderflow.gateway.server import Gateway
from spiderflow.security.certs import init_certs

pytestmark = pytest.mark.timeout(60)

EAST_RANGE = "127.0.1.0/24"
WEST_RANGE = "127.0.0.3/32"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    init_certs(d, clusters=["east", "west", "north"], tenants=["alice"], etcd=False)
    return d


@dataclass
class Pair:
    east: Gateway
    west: Gateway
    destination: list[tuple[str, int]]

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.east.redirect_port)


def _config(ranges: list[str], peers: list[GatewayPeer]) -> GatewayConfig:
    return GatewayConfig(enabled=True, port=0, listen_host="127.0.0.1", redirect="127.0.0.1:0",
                         ranges=tuple(ranges), peers=tuple(peers), connect_retry_s=0.3, connect_timeout_s=5.0)


@contextlib.asynccontextmanager
async def _pair(certs: Path, *, west_peers: tuple[str, ...] = ("east",), east_cluster: str = "east",
                east_bundle: str = "agent-east", east_peer_ranges: tuple[str, ...] = ("127.0.0.0/24",)
                ) -> AsyncIterator[Pair]:
    west = Gateway(_config([WEST_RANGE], [GatewayPeer(cluster=c, address="127.0.0.1:1", ranges=(EAST_RANGE,))
                                          for c in west_peers]),
                   cluster="west", tls_dir=certs / "agent-west")
    await west.start()
    destination: list[tuple[str, int]] = []
    east = Gateway(_config([EAST_RANGE], [GatewayPeer(cluster="west", address=f"127.0.0.1:{west.port}",
                                                       ranges=east_peer_ranges)]),
                   cluster=east_cluster, tls_dir=certs / east_bundle, destination=lambda _s: destination[0])
    await east.start()
    try:
        yield Pair(east=east, west=west, destination=destination)
    finally:
        await east.close()
        await west.close()


@contextlib.asynccontextmanager
async def _server(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object],
                  host: str = "127.0.0.3") -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, host, 0)  # type: ignore[arg-type]
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.write(b"done")
    await writer.drain()
    writer.close()


async def test_bytes_and_half_close_cross_two_gateways(certs: Path) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)
    async with _pair(certs) as pair, _server(_echo) as port:
        pair.destination.append(("127.0.0.3", port))
        reader, writer = await pair.connect()

        async def send() -> None:
            for i in range(0, len(payload), 100_000):
                writer.write(payload[i:i + 100_000])
                await writer.drain()
            writer.write_eof()  # half-close: the echo server sees EOF and still answers

        sender = asyncio.create_task(send())
        received = await reader.read(-1)  # until the server's FIN crossed back
        await sender
        writer.close()
        assert received == payload + b"done"
        assert pair.east.stats.bytes_out == len(payload) and pair.west.stats.bytes_out == len(payload) + 4
        assert pair.west.stats.inbound == 1 and pair.east.stats.refused == 0


async def test_a_reset_crosses_the_gateways(certs: Path) -> None:
    async def rst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async with _pair(certs) as pair, _server(rst) as port:
        pair.destination.append(("127.0.0.3", port))
        reader, writer = await pair.connect()
        writer.write(b"hello")
        await writer.drain()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(100), timeout=10)
        writer.close()


async def _refused(pair: Pair, host: str, port: int) -> None:
    pair.destination.append((host, port))
    reader, writer = await pair.connect()
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        data = await asyncio.wait_for(reader.read(100), timeout=10)
        if not data:
            raise asyncio.IncompleteReadError(b"", 1)
    writer.close()


async def test_the_inbound_gateway_is_no_open_proxy(certs: Path) -> None:
    async with _pair(certs) as pair, _server(_echo, host="127.0.0.4") as port:
        await _refused(pair, "127.0.0.4", port)  # east sends it (its peer range), west refuses: not its range
        assert pair.west.stats.reasons == {"FORBIDDEN": 1}


async def test_a_destination_of_no_peer_is_reset_at_once(certs: Path) -> None:
    async with _pair(certs) as pair:
        await _refused(pair, "192.0.2.1", 80)
        assert pair.west.stats.inbound == 0 and pair.east.stats.refused == 1


async def test_an_unreachable_destination_is_a_reset(certs: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.3", 0))
        free = s.getsockname()[1]
    async with _pair(certs) as pair:
        await _refused(pair, "127.0.0.3", free)
        assert pair.west.stats.reasons == {"UNREACHABLE": 1}


async def test_a_caller_that_is_not_a_configured_peer_is_refused(certs: Path) -> None:
    async with _pair(certs, east_cluster="north", east_bundle="agent-north") as pair, _server(_echo) as port:
        await _refused(pair, "127.0.0.3", port)
        assert pair.west.stats.reasons == {"FORBIDDEN": 1}


async def test_a_tenant_certificate_opens_no_gateway(certs: Path) -> None:
    ctx_dir = certs / "tenant-alice"
    import ssl

    async with _pair(certs) as pair:
        ctx = ssl.create_default_context(cafile=str(ctx_dir / "ca.crt"))
        ctx.load_cert_chain(str(ctx_dir / "tls.crt"), str(ctx_dir / "tls.key"))
        reader, writer = await asyncio.open_connection("127.0.0.1", pair.west.port, ssl=ctx,
                                                       server_hostname="agent-west")
        status = await asyncio.wait_for(reader.read(1), timeout=10)
        assert status == b"\x01"  # FORBIDDEN, before any header was read
        writer.close()


async def test_the_outbound_side_refuses_a_server_of_another_cluster(certs: Path) -> None:
    # east believes the gateway at west's port belongs to "north": the name check fails the handshake
    async with _pair(certs) as pair, _server(_echo) as port:
        east2 = Gateway(_config([EAST_RANGE], [GatewayPeer(cluster="north", address=f"127.0.0.1:{pair.west.port}",
                                                            ranges=("127.0.0.0/24",))]),
                        cluster="east", tls_dir=certs / "agent-east", destination=lambda _s: ("127.0.0.3", port))
        await east2.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", east2.redirect_port)
            with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
                data = await asyncio.wait_for(reader.read(100), timeout=10)
                if not data:
                    raise asyncio.IncompleteReadError(b"", 1)
            writer.close()
            assert east2.stats.refused == 1 and pair.west.stats.bytes_in == 0
        finally:
            await east2.close()
