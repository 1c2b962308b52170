"""Synthetic cluster topologies for the simulator, the benchmarks and the tests.

:func:`generate_topology` builds a :class:`~spiderflow.core.domain.Topology` of ``clusters`` clusters that
looks like a pool of GPU clusters rented or owned in real cloud regions:

- **Placement.** Each cluster sits in a real cloud region (:data:`REGIONS`, coordinates of the region's
  metro area). The first ``len(REGIONS)`` clusters take distinct regions in a seeded random order; further
  clusters reuse regions with a jitter of up to ±:data:`JITTER_DEG` degrees.
- **GPUs.** A datacenter-heavy mix of catalog types (:data:`GPU_MIX`); 1–8 nodes of 8 GPUs (consumer
  cards: 4 or 8 per node); between a quarter and all of the GPUs free. Intra/inter-node bandwidths
  follow the GPU generation (NVLink vs PCIe, InfiniBand vs Ethernet).
- **Electricity.** The region's typical industrial price (:data:`REGIONS`) × U(0.85, 1.15), clipped to
  [0.03, 0.25] $/kWh.
- **Links.** Great-circle distance ``d`` (km) gives one-way latency
  ``d / 200 km/ms × 1.5 (route factor) + U(1, 4) ms`` and bandwidth
  ``0.3 + 9.7 · exp(−d / 3000) · U(0.6, 1.0)`` Gbit/s, clipped to [0.3, 10]. Links are sparse:

  - ``geo``: each cluster to its :data:`GEO_NEIGHBOURS` nearest, plus a minimum spanning tree;
  - ``hub``: ``max(2, ⌈n/8⌉)`` hubs (spread by farthest-point sampling) joined by a backbone (a
    spanning tree plus each hub's two nearest hubs, at 2× bandwidth), every other cluster a spoke to its
    nearest hub (and, with probability 0.3, to its second nearest);
  - ``mesh``: each cluster to its ``min(n − 1, max(6, n // 4), 16)`` nearest, plus a spanning tree.

  Every kind is connected (it contains a spanning tree).

Deterministic: the same ``(clusters, seed, kind)`` always gives the same topology (one
``numpy.random.Generator`` seeded with ``seed``; no global RNG). Cost: O(n²) for the distance matrix
and the spanning tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from spiderflow.core.domain import Cluster, Link, Topology
from spiderflow.core.errors import ValidationError

__all__ = [
    "GEO_NEIGHBOURS",
    "GPU_MIX",
    "JITTER_DEG",
    "REGIONS",
    "Region",
    "TopologyKind",
    "generate_topology",
    "great_circle_km",
    "link_figures",
]

TopologyKind = Literal["geo", "hub", "mesh"]

JITTER_DEG = 2.0
GEO_NEIGHBOURS = 3
_FIBRE_KM_PER_MS = 200.0
_ROUTE_FACTOR = 1.5
_EARTH_RADIUS_KM = 6371.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """A cloud region: short name, metro coordinates (degrees) and a typical industrial $/kWh."""

    name: str
    lat: float
    lon: float
    usd_per_kwh: float


REGIONS: tuple[Region, ...] = (
    Region(name="us-east-1", lat=38.9, lon=-77.4, usd_per_kwh=0.08),  # N. Virginia
    Region(name="us-east-2", lat=40.0, lon=-83.0, usd_per_kwh=0.07),  # Ohio
    Region(name="us-west-1", lat=37.4, lon=-122.0, usd_per_kwh=0.20),  # N. California
    Region(name="us-west-2", lat=45.6, lon=-121.2, usd_per_kwh=0.05),  # Oregon
    Region(name="us-central1", lat=41.3, lon=-95.9, usd_per_kwh=0.06),  # Iowa
    Region(name="us-south1", lat=32.8, lon=-96.8, usd_per_kwh=0.07),  # Dallas
    Region(name="us-west3", lat=40.8, lon=-111.9, usd_per_kwh=0.07),  # Salt Lake City
    Region(name="ca-central-1", lat=45.5, lon=-73.6, usd_per_kwh=0.04),  # Montreal
    Region(name="mx-central-1", lat=20.6, lon=-100.4, usd_per_kwh=0.09),  # Querétaro
    Region(name="sa-east-1", lat=-23.5, lon=-46.6, usd_per_kwh=0.12),  # São Paulo
    Region(name="eu-west-1", lat=53.3, lon=-6.3, usd_per_kwh=0.20),  # Dublin
    Region(name="eu-west-2", lat=51.5, lon=-0.1, usd_per_kwh=0.22),  # London
    Region(name="eu-west-3", lat=48.9, lon=2.35, usd_per_kwh=0.16),  # Paris
    Region(name="eu-central-1", lat=50.1, lon=8.7, usd_per_kwh=0.25),  # Frankfurt
    Region(name="europe-west4", lat=53.4, lon=6.8, usd_per_kwh=0.21),  # Eemshaven
    Region(name="eu-south-1", lat=45.5, lon=9.2, usd_per_kwh=0.23),  # Milan
    Region(name="eu-north-1", lat=59.3, lon=18.1, usd_per_kwh=0.06),  # Stockholm
    Region(name="europe-north1", lat=60.6, lon=27.2, usd_per_kwh=0.07),  # Hamina
    Region(name="il-central-1", lat=32.1, lon=34.8, usd_per_kwh=0.14),  # Tel Aviv
    Region(name="me-central-1", lat=25.2, lon=55.3, usd_per_kwh=0.05),  # Dubai
    Region(name="af-south-1", lat=-33.9, lon=18.4, usd_per_kwh=0.10),  # Cape Town
    Region(name="ap-south-1", lat=19.1, lon=72.9, usd_per_kwh=0.09),  # Mumbai
    Region(name="ap-southeast-1", lat=1.35, lon=103.8, usd_per_kwh=0.17),  # Singapore
    Region(name="ap-southeast-3", lat=-6.2, lon=106.8, usd_per_kwh=0.09),  # Jakarta
    Region(name="ap-east-1", lat=22.3, lon=114.2, usd_per_kwh=0.15),  # Hong Kong
    Region(name="asia-east1", lat=24.0, lon=120.5, usd_per_kwh=0.10),  # Changhua, Taiwan
    Region(name="cn-north-1", lat=39.9, lon=116.4, usd_per_kwh=0.08),  # Beijing
    Region(name="ap-northeast-2", lat=37.6, lon=127.0, usd_per_kwh=0.11),  # Seoul
    Region(name="ap-northeast-1", lat=35.7, lon=139.7, usd_per_kwh=0.19),  # Tokyo
    Region(name="ap-southeast-2", lat=-33.9, lon=151.2, usd_per_kwh=0.18),  # Sydney
)

# (catalog name, weight, GPUs per node choices, intra-node Gbit/s, inter-node Gbit/s)
GPU_MIX: tuple[tuple[str, float, tuple[int, ...], float, float], ...] = (
    ("H100-80G", 0.20, (8,), 3600.0, 400.0),
    ("A100-80G", 0.22, (8,), 2400.0, 200.0),
    ("A100-40G", 0.14, (8,), 2400.0, 200.0),
    ("V100-32G", 0.10, (8,), 1200.0, 100.0),
    ("V100-16G", 0.05, (8,), 1200.0, 100.0),
    ("L4", 0.06, (8,), 256.0, 100.0),
    ("A10G", 0.06, (4, 8), 256.0, 50.0),
    ("T4", 0.04, (4, 8), 128.0, 50.0),
    ("RTX4090", 0.06, (4, 8), 256.0, 25.0),
    ("RTX3090", 0.07, (4, 8), 128.0, 25.0),
)


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance in km between two points given in degrees."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * _EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


def _distance_matrix(lat: npt.NDArray[np.float64], lon: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    p, lam = np.radians(lat), np.radians(lon)
    dp = p[:, None] - p[None, :]
    dl = lam[:, None] - lam[None, :]
    a = np.sin(dp / 2) ** 2 + np.cos(p)[:, None] * np.cos(p)[None, :] * np.sin(dl / 2) ** 2
    d: npt.NDArray[np.float64] = 2 * _EARTH_RADIUS_KM * np.arcsin(np.minimum(1.0, np.sqrt(a)))
    return d


def link_figures(distance_km: float, rng: np.random.Generator) -> tuple[float, float]:
    """``(bandwidth_gbps, latency_ms)`` of a link spanning ``distance_km`` (formulas in the module doc)."""
    latency = distance_km / _FIBRE_KM_PER_MS * _ROUTE_FACTOR + float(rng.uniform(1.0, 4.0))
    bw = 0.3 + 9.7 * math.exp(-distance_km / 3000.0) * float(rng.uniform(0.6, 1.0))
    return round(min(10.0, max(0.3, bw)), 3), round(latency, 2)


def _mst_edges(dist: npt.NDArray[np.float64], members: list[int]) -> list[tuple[int, int]]:
    """Prim's minimum spanning tree over ``members`` (O(k²))."""
    if len(members) < 2:
        return []
    idx = np.array(members)
    sub = dist[np.ix_(idx, idx)]
    k = len(members)
    in_tree = np.zeros(k, dtype=bool)
    in_tree[0] = True
    best = sub[0].copy()
    parent = np.zeros(k, dtype=int)
    edges: list[tuple[int, int]] = []
    for _ in range(k - 1):
        cand = np.where(in_tree, np.inf, best)
        j = int(np.argmin(cand))
        edges.append((members[int(parent[j])], members[j]))
        in_tree[j] = True
        closer = sub[j] < best
        best = np.where(closer, sub[j], best)
        parent = np.where(closer, j, parent)
    return edges


def _knn_edges(dist: npt.NDArray[np.float64], members: list[int], k: int) -> list[tuple[int, int]]:
    idx = np.array(members)
    sub = dist[np.ix_(idx, idx)].copy()
    np.fill_diagonal(sub, np.inf)
    k = min(k, len(members) - 1)
    edges: list[tuple[int, int]] = []
    if k <= 0:
        return edges
    order = np.argsort(sub, axis=1, kind="stable")[:, :k]
    for i, row in enumerate(order):
        for j in row:
            edges.append((members[i], members[int(j)]))
    return edges


def _farthest_points(dist: npt.NDArray[np.float64], count: int, first: int) -> list[int]:
    chosen = [first]
    nearest = dist[first].copy()
    while len(chosen) < count:
        j = int(np.argmax(nearest))
        chosen.append(j)
        nearest = np.minimum(nearest, dist[j])
    return chosen


def generate_topology(clusters: int, seed: int, kind: TopologyKind = "geo") -> Topology:
    """A synthetic topology of ``clusters`` clusters (see the module docstring for every distribution).

    Deterministic for ``(clusters, seed, kind)``; always connected; cluster names are
    ``c{index:03d}-{region}``. ``ValidationError`` for ``clusters < 1`` or an unknown ``kind``.
    """
    if isinstance(clusters, bool) or not isinstance(clusters, int) or clusters < 1:
        raise ValidationError("clusters", "must be a positive integer", clusters)
    if kind not in ("geo", "hub", "mesh"):
        raise ValidationError("kind", "must be one of geo, hub, mesh", kind)
    rng = np.random.default_rng(seed)
    n = clusters

    # Placement: distinct regions first, then reuse with jitter.
    order = rng.permutation(len(REGIONS))
    regions = [REGIONS[int(order[i % len(REGIONS)])] for i in range(n)]
    lat = np.empty(n)
    lon = np.empty(n)
    for i, r in enumerate(regions):
        if i < len(REGIONS):
            lat[i], lon[i] = r.lat, r.lon
        else:
            lat[i] = float(np.clip(r.lat + rng.uniform(-JITTER_DEG, JITTER_DEG), -89.0, 89.0))
            lon[i] = r.lon + float(rng.uniform(-JITTER_DEG, JITTER_DEG))
            lon[i] = (lon[i] + 180.0) % 360.0 - 180.0

    weights = np.array([g[1] for g in GPU_MIX])
    weights = weights / weights.sum()
    out_clusters: list[Cluster] = []
    for i, r in enumerate(regions):
        gname, _, per_node_choices, intra, inter = GPU_MIX[int(rng.choice(len(GPU_MIX), p=weights))]
        per_node = int(per_node_choices[int(rng.integers(len(per_node_choices)))])
        nodes = int(rng.integers(1, 9))
        total = nodes * per_node
        free = int(rng.integers(max(1, total // 4), total + 1))
        price = float(np.clip(r.usd_per_kwh * rng.uniform(0.85, 1.15), 0.03, 0.25))
        out_clusters.append(
            Cluster(
                name=f"c{i:03d}-{r.name}",
                gpu=gname,
                nodes=nodes,
                gpus_per_node=per_node,
                intra_node_gbps=intra,
                inter_node_gbps=inter,
                electricity_usd_per_kwh=round(price, 4),
                free_gpus=free,
                region=r.name,
                lat=round(float(lat[i]), 4),
                lon=round(float(lon[i]), 4),
            )
        )

    dist = _distance_matrix(lat, lon)
    everyone = list(range(n))
    edges: dict[tuple[int, int], float] = {}  # (min, max) -> bandwidth multiplier

    def add(pairs: list[tuple[int, int]], mult: float = 1.0) -> None:
        for a, b in pairs:
            if a == b:
                continue
            key = (min(a, b), max(a, b))
            edges[key] = max(edges.get(key, 0.0), mult)

    if kind == "geo":
        add(_mst_edges(dist, everyone))
        add(_knn_edges(dist, everyone, GEO_NEIGHBOURS))
    elif kind == "mesh":
        add(_mst_edges(dist, everyone))
        add(_knn_edges(dist, everyone, min(n - 1, max(6, n // 4), 16)))
    else:
        hubs_n = min(n, max(2, math.ceil(n / 8)))
        first = int(max(range(n), key=lambda i: (out_clusters[i].free, -i)))
        hubs = _farthest_points(dist, hubs_n, first)
        add(_mst_edges(dist, hubs), 2.0)
        add(_knn_edges(dist, hubs, 2), 2.0)
        hub_arr = np.array(hubs)
        for i in everyone:
            if i in hubs:
                continue
            near = hub_arr[np.argsort(dist[i, hub_arr], kind="stable")]
            add([(i, int(near[0]))])
            if len(near) > 1 and rng.random() < 0.3:
                add([(i, int(near[1]))])

    links: list[Link] = []
    for (a, b), mult in sorted(edges.items()):
        bw, latency = link_figures(float(dist[a, b]), rng)
        links.append(
            Link(
                a=out_clusters[a].name,
                b=out_clusters[b].name,
                bandwidth_gbps=round(min(10.0, bw * mult), 3),
                latency_ms=latency,
            )
        )
    return Topology(clusters=tuple(out_clusters), links=tuple(links))
