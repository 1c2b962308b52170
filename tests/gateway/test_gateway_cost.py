"""The gateway hop as link figures, and the cost model pricing a pipeline on them."""

from __future__ import annotations

import pytest

from spiderflow.core.domain import Cluster, Link, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.gatewaycost import GatewayHop, gateway_link, with_gateways


def _topology() -> Topology:
    clusters = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1) for n in ("a", "b", "c"))
    return Topology(clusters=clusters, links=(Link(a="a", b="b", bandwidth_gbps=0.4, latency_ms=5.0),
                                              Link(a="b", b="c", bandwidth_gbps=0.1, latency_ms=20.0)))


def test_a_link_pays_the_latency_and_the_ceiling() -> None:
    hop = GatewayHop(latency_ms=3.8, gbps=0.3)
    assert gateway_link(Link(a="a", b="b", bandwidth_gbps=0.4, latency_ms=5.0), hop) == Link(
        a="a", b="b", bandwidth_gbps=0.3, latency_ms=8.8)
    slow = gateway_link(Link(a="a", b="b", bandwidth_gbps=0.1, latency_ms=5.0, directed=True), hop)
    assert slow.bandwidth_gbps == 0.1 and slow.directed  # the link stays the bottleneck


def test_only_links_with_a_gateway_at_both_ends_change() -> None:
    topo = _topology()
    hop = GatewayHop(latency_ms=2.0, gbps=0.2)
    out = with_gateways(topo, {"a", "b"}, hop)
    ab = next(lk for lk in out.links if (lk.a, lk.b) == ("a", "b"))
    bc = next(lk for lk in out.links if (lk.a, lk.b) == ("b", "c"))
    assert (ab.bandwidth_gbps, ab.latency_ms) == (0.2, 7.0) and bc == topo.links[1]
    assert out.latency_ms("a", "c") == pytest.approx(topo.latency_ms("a", "c") + 2.0)
    assert out.bandwidth_gbps("a", "b") == 0.2
    assert with_gateways(topo, set(), hop).links == topo.links


def test_the_cost_model_charges_the_hop() -> None:
    from spiderflow.core.costmodel import transfer_time

    topo = _topology()
    hop = GatewayHop(latency_ms=3.8, gbps=0.3)
    gw = with_gateways(topo, {"a", "b", "c"}, hop)
    nbytes = 4 * 256 * 768 * 2
    direct = transfer_time(nbytes, topo.bandwidth_gbps("a", "b"), topo.latency_ms("a", "b"))
    through = transfer_time(nbytes, gw.bandwidth_gbps("a", "b"), gw.latency_ms("a", "b"))
    assert through == pytest.approx(direct + 3.8e-3 + nbytes * 8 * (1 / 0.3e9 - 1 / 0.4e9), rel=1e-6)


@pytest.mark.parametrize(("kw", "field"), [({"latency_ms": -1.0, "gbps": 1.0}, "gateway_hop.latency_ms"),
                                           ({"latency_ms": 1.0, "gbps": 0.0}, "gateway_hop.gbps")])
def test_bad_hop_figures_name_the_field(kw: dict[str, float], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        GatewayHop(**kw)
    assert e.value.field == field


def test_an_unknown_cluster_is_refused() -> None:
    with pytest.raises(ValidationError, match="gateway_clusters"):
        with_gateways(_topology(), {"z"}, GatewayHop(latency_ms=1.0, gbps=1.0))
