"""The gateway hop as link figures (pure): for topologies whose links were *not* measured through the gateways.

Live topologies need nothing from here: the agents' probes are cross-cluster TCP like the workers' traffic,
so with gateways on they cross the same NAT, gateways and TLS, and the links the topology service serves
already carry the gateway path's latency and bandwidth. Declared topologies (a ``--topology`` file, the
simulator's, a what-if on measured direct links) get the hop with :func:`with_gateways`:

* latency: ``l' = l + hop.latency_ms`` (the one-way latency the two gateways of a link add; half the
  round-trip increase measured by ``bench/gateway.py``);
* bandwidth: ``b' = min(b, hop.gbps)``: the gateways forward chunk by chunk (pipelined), so a transfer moves
  at the slower of the link and the gateways' throughput ceiling; their per-chunk store-and-forward delay
  is part of ``hop.latency_ms``.

Only links whose two ends both run a gateway change (traffic between a cluster with and one without a
gateway goes direct). A pair without a direct link is priced along its widest path, so it pays the hop once
per gateway link on that path.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

from spiderflow.core.domain import Link, Topology
from spiderflow.core.errors import ValidationError

__all__ = ["GatewayHop", "gateway_link", "with_gateways"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayHop:
    """Measured cost of crossing a link through two gateways: added one-way latency and throughput ceiling."""

    latency_ms: float
    gbps: float

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_ms, int | float) and math.isfinite(self.latency_ms) and self.latency_ms >= 0):
            raise ValidationError("gateway_hop.latency_ms", "must be a finite number ≥ 0", self.latency_ms)
        if not (isinstance(self.gbps, int | float) and math.isfinite(self.gbps) and self.gbps > 0):
            raise ValidationError("gateway_hop.gbps", "must be a finite number > 0", self.gbps)


def gateway_link(link: Link, hop: GatewayHop) -> Link:
    """``link`` as seen through the two gateways at its ends (see the module docstring)."""
    return replace(link, latency_ms=link.latency_ms + hop.latency_ms, bandwidth_gbps=min(link.bandwidth_gbps, hop.gbps))


def with_gateways(topology: Topology, clusters: Collection[str], hop: GatewayHop) -> Topology:
    """A copy of ``topology`` whose links between two clusters of ``clusters`` (those running a gateway)
    carry the hop; every other link, and the clusters, unchanged. Unknown names are ``ValidationError``."""
    known = set(topology.names)
    for name in clusters:
        if name not in known:
            raise ValidationError("gateway_clusters", "is not a cluster of the topology", name)
    on = set(clusters)
    links = tuple(gateway_link(lk, hop) if lk.a in on and lk.b in on else lk for lk in topology.links)
    return Topology(clusters=topology.clusters, links=links, revision=topology.revision)
