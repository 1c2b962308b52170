"""SpinSearch's connection threshold (rule (a)'s ``θ_conn``), vectorised, against its plain Kruskal loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec
from spiderflow.core.placement import spinsearch
from spiderflow.core.placement.common import JobConsts, TopoArrays, job_consts, topo_arrays
from spiderflow.core.topogen import TopologyKind, generate_topology


def _reference(ta: TopoArrays, jc: JobConsts, hops: spinsearch.Hops, usable: np.ndarray, nn: int) -> float:
    """Kruskal over each usable cluster's ``nn`` nearest usable hops, one edge at a time."""
    states = jc.state_bytes * (jc.layers * jc.p_layer + 2 * jc.p_embed)
    parent = {int(u): int(u) for u in usable}
    gp = {int(u): int(min(ta.free[u], jc.gpus_max)) for u in usable}
    mem = {int(u): float(ta.free[u] * ta.mem[u]) for u in usable}
    if any(gp[u] >= jc.gpus_min and mem[u] >= states for u in parent):
        return 0.0
    edges: list[tuple[float, int, int]] = []
    for u in parent:
        cnt = 0
        for v in hops.order[u]:
            v = int(v)
            if v in parent:
                pv = float(hops.p[u, v])
                if math.isfinite(pv):
                    edges.append((pv, u, v))
                cnt += 1
                if cnt >= nn:
                    break
    edges.sort()

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pv, u, v in edges:
        ru, rv = find(u), find(v)
        if ru == rv:
            continue
        parent[ru] = rv
        gp[rv] += gp[ru]
        mem[rv] += mem[ru]
        if gp[rv] >= jc.gpus_min and mem[rv] >= states:
            return pv
    return math.inf


@pytest.mark.parametrize("kind", ["geo", "hub", "mesh"])
def test_the_threshold_is_the_plain_kruskal_ones(kind: TopologyKind) -> None:
    """Generated topologies of 4–96 clusters, some clusters without free GPUs, jobs small to large (so the
    threshold is 0, a hop time, or infinite), 4 and 10 neighbours: the same threshold, bit for bit."""
    rng = np.random.default_rng(7)
    kinds = {"zero": 0, "hop": 0, "inf": 0}
    for n in (4, 8, 24, 64, 96):
        base = generate_topology(n, 500 + n, kind)
        for trial in range(4):
            free = {c.name: int(rng.integers(0, c.free + 1)) if rng.random() < 0.7 else 0 for c in base.clusters}
            topo = base.with_free(free)
            ta = topo_arrays(topo)
            usable = np.flatnonzero(ta.free > 0).astype(np.int64)
            if len(usable) == 0:
                continue
            for model, gmin in (("gpt3-1.3b", 8), ("gpt3-13b", 64), ("llama3-70b", 256), ("llama3-70b", 4096)):
                job = JobSpec(id="j", model=model_preset(model), global_batch=256, seq_len=2048,
                              gpus=GpuRange(min=gmin, max=max(gmin, 2 * gmin)))
                jc = job_consts(job)
                hops = spinsearch._hops(topo, ta, jc)
                for nn in (4, 10):
                    got = spinsearch._connect_threshold(ta, jc, hops, usable, nn)
                    want = _reference(ta, jc, hops, usable, nn)
                    assert got == want, (n, trial, model, gmin, nn)
                    kinds["zero" if want == 0.0 else ("inf" if math.isinf(want) else "hop")] += 1
    assert min(kinds.values()) >= 3, kinds
