"""The synthetic topology generator: determinism, connectivity, realistic ranges, sparsity."""

from __future__ import annotations

import pytest

from spiderflow.core.catalog import GPU_CATALOG
from spiderflow.core.errors import ValidationError
from spiderflow.core.topogen import REGIONS, generate_topology, great_circle_km
from spiderflow.formats import topology_from_dict, topology_to_dict


@pytest.mark.parametrize("kind", ["geo", "hub", "mesh"])
def test_same_seed_same_topology(kind: str) -> None:
    a = generate_topology(40, 11, kind)  # type: ignore[arg-type]
    b = generate_topology(40, 11, kind)  # type: ignore[arg-type]
    assert topology_to_dict(a) == topology_to_dict(b)
    assert topology_to_dict(a) != topology_to_dict(generate_topology(40, 12, kind))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["geo", "hub", "mesh"])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 33, 100])
def test_connected_and_in_range(kind: str, n: int) -> None:
    topo = generate_topology(n, n * 7 + 1, kind)  # type: ignore[arg-type]
    assert len(topo.clusters) == n
    assert len(topo.components()) == 1
    for c in topo.clusters:
        assert c.gpu in GPU_CATALOG and c.gpu != "cpu"
        assert 1 <= c.nodes <= 8
        assert 1 <= c.free <= c.total_gpus
        assert 0.03 <= c.electricity_usd_per_kwh <= 0.25
        assert c.lat is not None and c.lon is not None and -90 <= c.lat <= 90 and -180 <= c.lon < 180
    for link in topo.links:
        assert 0.3 <= link.bandwidth_gbps <= 10.0
        assert link.latency_ms >= 1.0
    # Round-trips through the file format.
    assert topology_to_dict(topology_from_dict(topology_to_dict(topo))) == topology_to_dict(topo)


def test_links_are_sparse_and_follow_distance() -> None:
    topo = generate_topology(64, 3, "geo")
    assert len(topo.links) < 64 * 63 / 2 / 5
    mesh = generate_topology(64, 3, "mesh")
    assert len(mesh.links) > len(topo.links)
    by_name = {c.name: c for c in topo.clusters}
    for link in topo.links:
        a, b = by_name[link.a], by_name[link.b]
        assert a.lat is not None and a.lon is not None and b.lat is not None and b.lon is not None
        d = great_circle_km(a.lat, a.lon, b.lat, b.lon)
        # latency = d / 200 km/ms × 1.5 + U(1, 4) ms
        assert d / 200 * 1.5 + 1 - 0.01 <= link.latency_ms <= d / 200 * 1.5 + 4 + 0.01
    # Long links are slower than short ones on average.
    pairs = sorted(
        (great_circle_km(by_name[lk.a].lat or 0, by_name[lk.a].lon or 0, by_name[lk.b].lat or 0,
                         by_name[lk.b].lon or 0), lk.bandwidth_gbps)
        for lk in topo.links
    )
    half = len(pairs) // 2
    assert sum(bw for _, bw in pairs[:half]) / half > sum(bw for _, bw in pairs[half:]) / (len(pairs) - half)


def test_regions_are_distinct_first_and_heterogeneous() -> None:
    topo = generate_topology(len(REGIONS), 5)
    assert len({c.region for c in topo.clusters}) == len(REGIONS)
    assert len({c.gpu for c in topo.clusters}) >= 4
    big = generate_topology(len(REGIONS) + 10, 5)
    assert len({(c.lat, c.lon) for c in big.clusters}) == len(big.clusters)


def test_hub_kind_has_hubs() -> None:
    topo = generate_topology(32, 9, "hub")
    degree: dict[str, int] = {}
    for link in topo.links:
        degree[link.a] = degree.get(link.a, 0) + 1
        degree[link.b] = degree.get(link.b, 0) + 1
    assert max(degree.values()) >= 5
    assert sorted(degree.values())[len(degree) // 2] <= 2


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_rejects_bad_cluster_count(bad: object) -> None:
    with pytest.raises(ValidationError):
        generate_topology(bad, 0)  # type: ignore[arg-type]


def test_rejects_bad_kind() -> None:
    with pytest.raises(ValidationError, match="kind"):
        generate_topology(4, 0, "ring")  # type: ignore[arg-type]
