"""Pure parts of the testbed: names, addresses, pair figures, link updates (no root needed)."""

from __future__ import annotations

import pytest

from spiderflow.core.domain import Cluster, Link, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.testbed.layout import class_id, pair_figures, plan_layout, update_link, validate_prefix


def _topo() -> Topology:
    cl = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1) for n in
               ("us-east-1-very-long-name", "eu-west", "ap-south", "sa-east"))
    a, b, c, d = (x.name for x in cl)
    return Topology(
        clusters=cl,
        links=(
            Link(a=a, b=b, bandwidth_gbps=0.4, latency_ms=5),
            Link(a=a, b=d, bandwidth_gbps=0.05, latency_ms=70),
            Link(a=b, b=c, bandwidth_gbps=0.2, latency_ms=20, directed=True),
            Link(a=c, b=b, bandwidth_gbps=0.1, latency_ms=30, directed=True),
        ),
    )


def test_layout_names_fit_kernel_limits_and_are_prefixed() -> None:
    lay = plan_layout(_topo(), prefix="abcdefgh", octet=201)
    assert len(lay.host_iface) <= 15
    assert lay.host_iface == "abcdefgh-host"
    assert all(ns.startswith("abcdefgh-") for ns in lay.namespaces)
    assert len(set(lay.namespaces)) == len(lay.namespaces) == 5
    assert all(len(s.router_iface) <= 15 for s in lay.clusters)
    addrs = [s.address for s in lay.clusters] + [lay.host_address, lay.router_host_address]
    assert len(set(addrs)) == len(addrs)
    assert all(a.startswith("10.201.") for a in addrs)
    assert lay.slot("eu-west").address == "10.201.2.2" and lay.slot("eu-west").gateway == "10.201.2.1"


@pytest.mark.parametrize("bad", ["", "Sf", "sf-a", "1sf", "abcdefghi", "s_f"])
def test_prefix_validation_rejects_ambiguous_prefixes(bad: str) -> None:
    with pytest.raises(ValidationError):
        validate_prefix(bad)


def test_class_id_is_htb_handle_1_minor_index_plus_one() -> None:
    assert class_id(0) == 0x10001
    assert class_id(9) == 0x1000A


def test_pair_figures_use_widest_path_and_are_directed() -> None:
    topo = _topo()
    a, b, c, d = topo.names
    p = pair_figures(topo)
    assert len(p) == 12
    assert (p[(a, b)].bandwidth_gbps, p[(a, b)].latency_ms) == (0.4, 5)
    assert (p[(b, c)].bandwidth_gbps, p[(b, c)].latency_ms) == (0.2, 20)
    assert (p[(c, b)].bandwidth_gbps, p[(c, b)].latency_ms) == (0.1, 30)
    # no link b-d: relayed through a (bottleneck 50 Mbit/s, latencies add)
    assert (p[(b, d)].bandwidth_gbps, p[(b, d)].latency_ms) == (0.05, 75)
    # no link a-c: via b, bottleneck b→c
    assert (p[(a, c)].bandwidth_gbps, p[(a, c)].latency_ms) == (0.2, 25)


def test_unreachable_pairs_get_zero_bandwidth() -> None:
    cl = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1) for n in ("x", "y", "z"))
    topo = Topology(clusters=cl, links=(Link(a="x", b="y", bandwidth_gbps=1, latency_ms=1),))
    p = pair_figures(topo)
    assert p[("x", "z")].bandwidth_gbps == 0 and p[("z", "y")].bandwidth_gbps == 0
    assert p[("x", "y")].bandwidth_gbps == 1


def test_update_link_changes_both_directions_and_keeps_unset_figures() -> None:
    topo = _topo()
    a, b, _, d = topo.names
    new = update_link(topo, a, b, latency_ms=30)
    p = pair_figures(new)
    assert (p[(a, b)].bandwidth_gbps, p[(a, b)].latency_ms) == (0.4, 30)
    assert (p[(b, a)].bandwidth_gbps, p[(b, a)].latency_ms) == (0.4, 30)
    assert p[(b, d)].latency_ms == 100  # the relay path follows
    assert pair_figures(topo)[(a, b)].latency_ms == 5  # the original is untouched


def test_update_link_one_direction_splits_a_symmetric_link() -> None:
    topo = _topo()
    a, b, _, _ = topo.names
    new = update_link(topo, a, b, bandwidth_gbps=0.1, directed=True)
    p = pair_figures(new)
    assert p[(a, b)].bandwidth_gbps == 0.1 and p[(b, a)].bandwidth_gbps == 0.4
    assert all(link.directed for link in new.links if {link.a, link.b} == {a, b})


def test_update_link_creates_a_missing_link_only_with_both_figures() -> None:
    topo = _topo()
    _, b, _, d = topo.names
    with pytest.raises(ValidationError):
        update_link(topo, b, d, bandwidth_gbps=1.0)
    p = pair_figures(update_link(topo, b, d, bandwidth_gbps=1.0, latency_ms=2))
    assert (p[(b, d)].bandwidth_gbps, p[(d, b)].latency_ms) == (1.0, 2)


def test_gso_packets_of_a_router_veth_stay_within_1_ms_of_its_slowest_pair() -> None:
    from spiderflow.testbed.netns import _burst, _gso_segs

    assert _gso_segs(0.02) == 1 and _gso_segs(0.0) == 1  # 2.5 KB per ms: one segment
    assert _gso_segs(0.05) == 4 and _gso_segs(0.4) == 33
    assert _gso_segs(10.0) == 44  # a 64 KiB GSO packet at most
    for gbps in (0.01, 0.05, 0.1, 0.4, 1.0, 10.0):
        assert _gso_segs(gbps) * 1514 <= max(_burst(gbps), 1514)
