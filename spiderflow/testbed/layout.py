"""The testbed's address plan and shaping figures, computed from a :class:`Topology` (pure, no I/O).

Layout for prefix ``P`` and subnet octet ``N`` (every name carries the prefix; every address lies in
``10.N.0.0/16`` and exists only inside the testbed's namespaces, except the host address)::

    host namespace            router namespace ``P-router``          cluster namespace ``P-<short>-<i>``
    P-host 10.N.0.1/24  <->   host   10.N.0.2/24
                              r<i>   10.N.<i+1>.1/24     <->          eth0 10.N.<i+1>.2/24 (default route)

Shaping of the directed pair ``i → j``: an htb class ``1:<i+1>`` on the router's egress veth ``r<j>``
with the pair's bandwidth; relayed traffic is put into it by the relay's ``SO_PRIORITY`` (= class id),
forwarded traffic by a ``u32`` match on the source address. The pair's one-way latency is added by the
relay. Pair figures are the topology's widest-path figures (:meth:`Topology.bandwidth_gbps`,
:meth:`Topology.latency_ms`), so pairs without a direct link get the figures of their relay path.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from spiderflow.core.domain import Link, Topology
from spiderflow.core.errors import ValidationError

__all__ = [
    "CLUSTER_IFACE",
    "DEFAULT_CLASS_MINOR",
    "HOST_IFACE_SUFFIX",
    "MAX_CLUSTERS",
    "ClusterSlot",
    "Layout",
    "PairShaping",
    "class_id",
    "pair_figures",
    "plan_layout",
    "update_link",
    "validate_prefix",
]

#: Interface name of every cluster namespace's veth (set ``GLOO_SOCKET_IFNAME`` to it).
CLUSTER_IFACE = "eth0"
#: Suffix of the host-side veth: ``<prefix>-host``.
HOST_IFACE_SUFFIX = "-host"
#: htb minor id of the default (unshaped, 10 Gbit/s) class on every router egress veth.
DEFAULT_CLASS_MINOR = 0xFFFE
#: Third octet 1..253 numbers the clusters.
MAX_CLUSTERS = 253

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is 1–8 lowercase letters/digits starting with a letter, else raise.

    No dashes: ``<prefix>-`` then identifies the testbed's names unambiguously, and ``<prefix>-host``
    stays within the kernel's 15-character interface-name limit.
    """
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValidationError("prefix", "must be 1-8 lowercase letters or digits, starting with a letter", prefix)
    return prefix


def class_id(src_index: int) -> int:
    """The ``SO_PRIORITY`` value (= htb class ``1:<src_index+1>``) for traffic from cluster ``src_index``."""
    return (1 << 16) | (src_index + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSlot:
    """Where one cluster lives in the testbed."""

    name: str
    index: int
    netns: str
    address: str
    gateway: str
    router_iface: str

    @property
    def subnet(self) -> str:
        """The cluster's address range (its link's /24: its own address and the router's)."""
        return self.address.rsplit(".", 1)[0] + ".0/24"


@dataclass(frozen=True, slots=True, kw_only=True)
class PairShaping:
    """Configured figures of the directed pair ``src → dst``. ``bandwidth_gbps == 0``: unreachable."""

    src: str
    dst: str
    bandwidth_gbps: float
    latency_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Names and addresses of a testbed (see the module docstring)."""

    prefix: str
    octet: int
    router_netns: str
    host_iface: str
    host_address: str
    router_host_address: str
    clusters: tuple[ClusterSlot, ...]

    @property
    def subnet(self) -> str:
        return f"10.{self.octet}.0.0/16"

    @property
    def host_subnet(self) -> str:
        return f"10.{self.octet}.0.0/24"

    def slot(self, name: str) -> ClusterSlot:
        from spiderflow.core.errors import NotFoundError

        for s in self.clusters:
            if s.name == name:
                return s
        raise NotFoundError(f"cluster {name!r} is not in the testbed")

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.router_netns, *(s.netns for s in self.clusters))


def _short(name: str) -> str:
    s = re.sub(r"[^a-z0-9]", "", name.lower())[:8]
    return s or "c"


def plan_layout(topology: Topology, *, prefix: str, octet: int) -> Layout:
    """Name every namespace and interface and assign addresses for ``topology`` in ``10.<octet>.0.0/16``."""
    validate_prefix(prefix)
    if isinstance(octet, bool) or not isinstance(octet, int) or not 0 <= octet <= 255:
        raise ValidationError("octet", "must be an integer in 0..255", octet)
    if len(topology.clusters) > MAX_CLUSTERS:
        raise ValidationError("clusters", f"a testbed holds at most {MAX_CLUSTERS} clusters", len(topology.clusters))
    slots = tuple(
        ClusterSlot(
            name=c.name,
            index=i,
            netns=f"{prefix}-{_short(c.name)}-{i}",
            address=f"10.{octet}.{i + 1}.2",
            gateway=f"10.{octet}.{i + 1}.1",
            router_iface=f"r{i}",
        )
        for i, c in enumerate(topology.clusters)
    )
    return Layout(
        prefix=prefix,
        octet=octet,
        router_netns=f"{prefix}-router",
        host_iface=f"{prefix}{HOST_IFACE_SUFFIX}",
        host_address=f"10.{octet}.0.1",
        router_host_address=f"10.{octet}.0.2",
        clusters=slots,
    )


def pair_figures(topology: Topology) -> dict[tuple[str, str], PairShaping]:
    """Configured figures of every ordered pair of distinct clusters (widest path; 0 Gbit/s if unreachable)."""
    out: dict[tuple[str, str], PairShaping] = {}
    for a in topology.names:
        for b in topology.names:
            if a == b:
                continue
            bw = topology.bandwidth_gbps(a, b)
            lat = topology.latency_ms(a, b)
            if bw <= 0 or math.isinf(lat):
                bw, lat = 0.0, 0.0
            out[(a, b)] = PairShaping(src=a, dst=b, bandwidth_gbps=bw, latency_ms=lat)
    return out


def update_link(
    topology: Topology,
    a: str,
    b: str,
    *,
    bandwidth_gbps: float | None = None,
    latency_ms: float | None = None,
    directed: bool = False,
) -> Topology:
    """A copy of ``topology`` whose link ``a → b`` (and ``b → a`` unless ``directed``) has new figures.

    A missing link is created (then both figures are required). A symmetric link changed in one
    direction only is split into two directed links. Unchanged figures keep their values.
    """
    topology.cluster(a)
    topology.cluster(b)
    pairs: dict[tuple[str, str], tuple[float, float]] = {
        pair: (link.bandwidth_gbps, link.latency_ms) for pair, link in topology.direct.items()
    }
    targets = [(a, b)] if directed else [(a, b), (b, a)]
    for pair in targets:
        old = pairs.get(pair)
        if old is None and (bandwidth_gbps is None or latency_ms is None):
            raise ValidationError(
                f"links[{pair[0]}-{pair[1]}]", "a new link needs both bandwidth_gbps and latency_ms"
            )
        bw = bandwidth_gbps if bandwidth_gbps is not None else old[0]  # type: ignore[index]
        lat = latency_ms if latency_ms is not None else old[1]  # type: ignore[index]
        pairs[pair] = (bw, lat)
    links: list[Link] = []
    done: set[tuple[str, str]] = set()
    for (u, v), (bw, lat) in pairs.items():
        if (u, v) in done:
            continue
        back = pairs.get((v, u))
        if back == (bw, lat):
            links.append(Link(a=u, b=v, bandwidth_gbps=bw, latency_ms=lat))
            done.add((v, u))
        else:
            links.append(Link(a=u, b=v, bandwidth_gbps=bw, latency_ms=lat, directed=True))
        done.add((u, v))
    return Topology(clusters=topology.clusters, links=tuple(links), revision=topology.revision)
