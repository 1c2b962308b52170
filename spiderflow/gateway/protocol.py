"""The gateway's wire format, configuration and address policy (pure: no sockets, no asyncio).

One gateway per cluster carries that cluster's cross-cluster TCP (pipeline activations, data-parallel
gradients, the rendezvous store, agents' probes) over **one** mutual-TLS port, so only that port has to be
open between regions. Workers are unmodified: a node-level NAT rule redirects their TCP towards other
clusters' address ranges to the local gateway (:mod:`spiderflow.gateway.server`), which reads the original
destination, opens mTLS to the gateway of the cluster owning that address, and splices.

Wire format, inside the TLS connection from the *outbound* gateway (client) to the *inbound* one (server)
------------------------------------------------------------------------------------------------------------

* Request header (client → server), once: ``MAGIC`` (4 bytes ``SFGW``), version (1 byte, ``1``), address
  family (1 byte: 4 or 6), the destination address (4 or 16 bytes), the destination port (2 bytes, big
  endian). :func:`encode_header` / :func:`decode_header`.
* Reply (server → client), once, after the server's connect to the destination: one status byte
  (:class:`Status`). Anything but ``OK`` ends the connection; the outbound gateway then resets the
  worker's connection (as a refused connect would).
* Then frames in both directions: type (1 byte, :class:`Frame`), length (4 bytes, big endian), payload.
  ``DATA`` carries bytes; ``EOF`` (empty) is the sender's half-close (TCP FIN); ``RESET`` (empty) is a
  reset (TCP RST). TLS cannot half-close, so the frames carry what TCP would. :func:`encode_frame`,
  :func:`frame_header`.

Policy
------
An inbound gateway connects only to destinations inside its **own** cluster's ranges
(:meth:`GatewayConfig.allows_inbound`; never an open proxy) and only for a peer whose certificate names an
``agent`` of a configured peer cluster. An outbound gateway sends a destination to the peer whose ranges
contain it (:meth:`GatewayConfig.peer_for`); an address of no peer is refused.
"""

from __future__ import annotations

import ipaddress
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from enum import IntEnum
from typing import Any

from spiderflow.core.errors import ValidationError

__all__ = [
    "FRAME_HEADER",
    "HEADER_MAX",
    "MAGIC",
    "MAX_FRAME",
    "VERSION",
    "Frame",
    "GatewayConfig",
    "GatewayPeer",
    "HeaderError",
    "Status",
    "config_to_dict",
    "decode_header",
    "encode_frame",
    "encode_header",
    "frame_header",
    "gateway_config",
    "header_length",
    "parse_frame_header",
]

MAGIC = b"SFGW"
VERSION = 1
FRAME_HEADER = 5
"""Bytes of a frame header: type (1) + length (4)."""
MAX_FRAME = 1 << 20
"""Largest frame payload accepted (1 MiB); a larger length is a protocol error."""
HEADER_MAX = 4 + 1 + 1 + 16 + 2


class HeaderError(ValueError):
    """A request header or frame that does not decode; the message names what is wrong."""


class Status(IntEnum):
    """The inbound gateway's one-byte reply to a request header."""

    OK = 0
    FORBIDDEN = 1
    """The destination is outside the inbound gateway's own ranges (or the caller is not a peer)."""
    UNREACHABLE = 2
    """The destination refused or did not answer within the retry window."""
    BAD_REQUEST = 3
    """The header did not decode."""


class Frame(IntEnum):
    """Frame types after the header exchange."""

    DATA = 0
    EOF = 1
    RESET = 2


def encode_header(host: str, port: int) -> bytes:
    """The request header naming destination ``host:port`` (an IPv4 or IPv6 literal)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise HeaderError(f"destination {host!r} is not an IP address") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise HeaderError(f"destination port {port!r} is not in 1..65535")
    return MAGIC + bytes([VERSION, addr.version]) + addr.packed + struct.pack("!H", port)


def header_length(prefix: bytes) -> int:
    """Total length of the header whose first 6 bytes are ``prefix`` (magic, version, family)."""
    if len(prefix) < 6:
        raise HeaderError("header shorter than 6 bytes")
    if prefix[:4] != MAGIC:
        raise HeaderError("bad magic (not a SpiderFlow gateway)")
    if prefix[4] != VERSION:
        raise HeaderError(f"unsupported version {prefix[4]}")
    if prefix[5] == 4:
        return 6 + 4 + 2
    if prefix[5] == 6:
        return 6 + 16 + 2
    raise HeaderError(f"unknown address family {prefix[5]}")


def decode_header(data: bytes) -> tuple[str, int]:
    """``(host, port)`` of a complete request header; :class:`HeaderError` when malformed."""
    n = header_length(data[:6])
    if len(data) != n:
        raise HeaderError(f"header is {len(data)} bytes, expected {n}")
    host = str(ipaddress.ip_address(data[6:n - 2]))
    port = struct.unpack("!H", data[n - 2:n])[0]
    if port == 0:
        raise HeaderError("destination port 0")
    return host, port


def frame_header(kind: Frame, length: int = 0) -> bytes:
    """The 5-byte header of a frame of ``kind`` with ``length`` payload bytes."""
    if not 0 <= length <= MAX_FRAME:
        raise HeaderError(f"frame length {length} outside 0..{MAX_FRAME}")
    if kind is not Frame.DATA and length:
        raise HeaderError(f"{kind.name} frames carry no payload")
    return struct.pack("!BI", int(kind), length)


def encode_frame(kind: Frame, payload: bytes = b"") -> bytes:
    """A whole frame (header and payload)."""
    return frame_header(kind, len(payload)) + payload


def parse_frame_header(data: bytes) -> tuple[Frame, int]:
    """``(kind, length)`` of a 5-byte frame header; :class:`HeaderError` when malformed."""
    if len(data) != FRAME_HEADER:
        raise HeaderError(f"frame header is {len(data)} bytes, expected {FRAME_HEADER}")
    raw_kind, length = struct.unpack("!BI", data)
    try:
        kind = Frame(raw_kind)
    except ValueError:
        raise HeaderError(f"unknown frame type {raw_kind}") from None
    if length > MAX_FRAME or (kind is not Frame.DATA and length):
        raise HeaderError(f"bad {kind.name} frame length {length}")
    return kind, length


# ---------------------------------------------------------------------------------------------- config

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _networks(where: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ValidationError(where, "must be a non-empty list of address ranges (CIDR, e.g. 10.1.0.0/16)", value)
    out = []
    for i, v in enumerate(value):
        try:
            out.append(str(ipaddress.ip_network(str(v), strict=False)))
        except ValueError:
            raise ValidationError(f"{where}[{i}]", "is not an address range (CIDR)", v) from None
    return tuple(out)


def _port(where: str, value: object, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not (0 if zero else 1) <= value <= 65535:
        raise ValidationError(where, f"must be a port in {0 if zero else 1}..65535", value)


def _hostport(where: str, value: object, *, zero: bool = False) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise ValidationError(where, "must be host:port", value)
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValidationError(where, "must be host:port", value)
    _port(where, int(port), zero=zero)
    return host, int(port)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayPeer:
    """Another cluster's gateway: its cluster name (the ``agent`` name its certificate must carry), the
    ``host:port`` of its public mTLS port, and the address ranges of that cluster's nodes."""

    cluster: str
    address: str
    ranges: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, str) or not self.cluster or "/" in self.cluster or len(self.cluster) > 63:
            raise ValidationError("gateway.peers[].cluster", "must be a cluster name of 1..63 characters", self.cluster)
        _hostport(f"gateway.peers[{self.cluster}].address", self.address)
        object.__setattr__(self, "ranges", _networks(f"gateway.peers[{self.cluster}].ranges", self.ranges))

    @property
    def host(self) -> str:
        return _hostport("address", self.address)[0]

    @property
    def port(self) -> int:
        return _hostport("address", self.address)[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """The ``gateway:`` section of an agent's configuration (see docs/operations.md).

    ``enabled``: the agent starts the gateway beside itself. ``port``: the public mTLS port peers dial
    (the only port that must be open between regions), bound on ``listen_host``. ``redirect``: ``host:port``
    where the node-level NAT sends outbound traffic (plain TCP; ``127.0.0.1`` for an ``OUTPUT`` REDIRECT on
    the gateway's own host, a routable address when other nodes' traffic is redirected to it).
    ``ranges``: this cluster's address ranges (the only destinations inbound connections may reach).
    ``peers``: the other clusters' gateways. ``tls_dir``: the bundle (``spiderflow certs init --cluster
    NAME``'s ``agent-NAME``: ``server.crt`` is presented to peers' outbound side, ``tls.crt`` to their
    inbound side; default: the agent's ``tls_dir``). ``connect_timeout_s``: the outbound TLS connect and
    handshake; ``connect_retry_s``: how long the inbound side retries a refused local connect (a listener
    that starts a moment later is still reached); ``chunk_bytes``: largest read per splice step.
    """

    enabled: bool = False
    port: int = 15443
    listen_host: str = "0.0.0.0"
    redirect: str = "127.0.0.1:15080"
    ranges: tuple[str, ...] = ()
    peers: tuple[GatewayPeer, ...] = ()
    tls_dir: str | None = None
    connect_timeout_s: float = 10.0
    connect_retry_s: float = 5.0
    chunk_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValidationError("gateway.enabled", "must be true or false", self.enabled)
        _port("gateway.port", self.port, zero=True)
        if not isinstance(self.listen_host, str) or not self.listen_host:
            raise ValidationError("gateway.listen_host", "must be a host or address", self.listen_host)
        _hostport("gateway.redirect", self.redirect, zero=True)
        if self.enabled or self.ranges:
            object.__setattr__(self, "ranges", _networks("gateway.ranges", self.ranges))
        peers = tuple(self.peers)
        names = [p.cluster for p in peers]
        if len(set(names)) != len(names):
            raise ValidationError("gateway.peers", "names a cluster twice", names)
        own = [ipaddress.ip_network(r) for r in self.ranges]
        for p in peers:
            for r in p.ranges:
                net = ipaddress.ip_network(r)
                if any(net.version == o.version and net.overlaps(o) for o in own):
                    raise ValidationError(f"gateway.peers[{p.cluster}].ranges",
                                          "overlaps this cluster's own ranges", r)
        object.__setattr__(self, "peers", peers)
        if self.tls_dir is not None and (not isinstance(self.tls_dir, str) or not self.tls_dir):
            raise ValidationError("gateway.tls_dir", "must be a directory", self.tls_dir)
        for f in ("connect_timeout_s", "connect_retry_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValidationError(f"gateway.{f}", "must be a number ≥ 0", v)
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) \
                or not 4096 <= self.chunk_bytes <= MAX_FRAME:
            raise ValidationError("gateway.chunk_bytes", f"must be an integer in 4096..{MAX_FRAME}", self.chunk_bytes)

    @property
    def redirect_host(self) -> str:
        return _hostport("gateway.redirect", self.redirect, zero=True)[0]

    @property
    def redirect_port(self) -> int:
        return _hostport("gateway.redirect", self.redirect, zero=True)[1]

    def allows_inbound(self, host: str, port: int) -> bool:
        """True iff ``host`` lies inside this cluster's own ranges and ``port`` is not one of the gateway's
        own ports (an inbound connection never loops back into a gateway)."""
        if port in (self.port, self.redirect_port):
            return False
        return _inside(host, self.ranges)

    def peer_for(self, host: str) -> GatewayPeer | None:
        """The peer whose ranges contain ``host`` (the most specific range wins), or None."""
        best: tuple[int, GatewayPeer] | None = None
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return None
        for p in self.peers:
            for r in p.ranges:
                net = ipaddress.ip_network(r)
                if addr.version == net.version and addr in net and (best is None or net.prefixlen > best[0]):
                    best = (net.prefixlen, p)
        return best[1] if best is not None else None

    def peer(self, cluster: str) -> GatewayPeer | None:
        """The configured peer of ``cluster``, or None."""
        return next((p for p in self.peers if p.cluster == cluster), None)


def _inside(host: str, ranges: Sequence[str]) -> bool:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(addr.version == (net := ipaddress.ip_network(r)).version and addr in net for r in ranges)


def gateway_config(raw: Mapping[str, Any] | None, where: str = "gateway") -> GatewayConfig:
    """A :class:`GatewayConfig` from the ``gateway:`` mapping of a config file (unknown keys are
    ``ValidationError`` naming them)."""
    if raw is None:
        return GatewayConfig()
    if not isinstance(raw, Mapping):
        raise ValidationError(where, "must be a mapping", raw)
    known = {f.name for f in fields(GatewayConfig)}
    for k in raw:
        if k not in known:
            raise ValidationError(f"{where}.{k}", "unknown key")
    values = dict(raw)
    peers_raw = values.pop("peers", ()) or ()
    if not isinstance(peers_raw, list | tuple):
        raise ValidationError(f"{where}.peers", "must be a list of {cluster, address, ranges}", peers_raw)
    peers = []
    peer_keys = {f.name for f in fields(GatewayPeer)}
    for i, p in enumerate(peers_raw):
        if isinstance(p, GatewayPeer):
            peers.append(p)
            continue
        if not isinstance(p, Mapping):
            raise ValidationError(f"{where}.peers[{i}]", "must be a mapping {cluster, address, ranges}", p)
        for k in p:
            if k not in peer_keys:
                raise ValidationError(f"{where}.peers[{i}].{k}", "unknown key")
        for f in fields(GatewayPeer):
            if f.default is MISSING and f.name not in p:
                raise ValidationError(f"{where}.peers[{i}].{f.name}", "is required")
        peers.append(GatewayPeer(cluster=p["cluster"], address=p["address"], ranges=p["ranges"]))
    if "ranges" in values and isinstance(values["ranges"], list):
        values["ranges"] = tuple(values["ranges"])
    return GatewayConfig(**values, peers=tuple(peers))


def config_to_dict(config: GatewayConfig) -> dict[str, Any]:
    """The mapping :func:`gateway_config` reads back (for the file the agent hands its gateway)."""
    return {
        "enabled": config.enabled, "port": config.port, "listen_host": config.listen_host,
        "redirect": config.redirect, "ranges": list(config.ranges),
        "peers": [{"cluster": p.cluster, "address": p.address, "ranges": list(p.ranges)} for p in config.peers],
        "tls_dir": config.tls_dir, "connect_timeout_s": config.connect_timeout_s,
        "connect_retry_s": config.connect_retry_s, "chunk_bytes": config.chunk_bytes,
    }
