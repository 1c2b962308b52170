"""Level 1's and level 2's shortcuts change no result: the block memo keyed by the block's problem, the memo of
evaluated splits, the layer and memory caps from the kernels, and the exact level-2 cache on problem vectors
(which skips the memory-free solve where no plain configuration fits) are compared with the plain
formulations they replace, on generated chains (memory-bound ones included) and generated problems."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Cluster, Link, Schedule, Topology
from spiderflow.core.tpa import level1 as l1
from spiderflow.core.tpa import level2 as l2
from spiderflow.core.tpa.level1 import ChainContext, SplitEval, evaluate_split, water_filled_split
from spiderflow.core.tpa.level2 import BlockConfig, BlockProblem, block_candidates, min_peak_fits
from spiderflow.core.tpa.planner import micro_batch_candidates

from .test_level2_kernel import problems

_TYPES = ["T4", "V100-16G", "V100-32G", "A100-40G", "RTX4090", "A10G", "H100-80G", "L4"]
_MODELS = ["gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "llama3-70b"]


def _contexts(seed: int) -> Iterator[ChainContext]:
    """A chain of 1–4 catalogue clusters (1–64 free GPUs each, small-memory GPUs included, so that many
    chains are memory-bound) and a catalogue model, at each micro-batch count the planner tries."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    clusters = tuple(Cluster(name=f"c{i}", gpu=str(rng.choice(_TYPES)), nodes=8, gpus_per_node=8,
                             free_gpus=int(rng.integers(1, 65))) for i in range(n))
    links = tuple(Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=float(rng.uniform(1, 100)),
                       latency_ms=float(rng.uniform(1, 80))) for i in range(n - 1))
    topo = Topology(clusters=clusters, links=links)
    model = model_preset(str(rng.choice(_MODELS)))
    gb = int(rng.choice([64, 256]))
    for m in micro_batch_candidates(gb, n):
        yield ChainContext.build(topo, clusters, [c.free for c in clusters], model, micro_batch=gb // m,
                                 seq_len=2048, m=m, schedule=Schedule.ONE_F_ONE_B)


# --- the plain formulations ------------------------------------------------------------------------------

def _reference_layer_caps(ctx: ChainContext) -> list[int]:
    """``layer_caps`` as level 2's caps of each candidate, one degree at a time."""
    n, big_l = len(ctx.clusters), ctx.model.layers
    hi = big_l - (n - 1)
    caps = []
    for c in range(n):
        first = 0 if c == 0 else (big_l - hi if c == n - 1 else 1)
        p = ctx.problem(c, first, hi, n - 1 - c)
        best = 0
        for k in block_candidates(p):
            u = l2.memory_caps(p, k)
            if min(u) >= 1:
                best = max(best, sum(u))
        caps.append(min(best, hi))
    return caps


def _reference_memory_caps(ctx: ChainContext) -> list[int]:
    """``memory_caps`` as a bisection over problems built one probe at a time (plain degrees first)."""
    if ctx.recompute or ctx.fsdp:
        caps = _bisect_caps(replace(ctx, recompute=False, fsdp=False))
        if min(caps) >= 1 and sum(caps) >= ctx.model.layers:
            return caps
    return _bisect_caps(ctx)


def _bisect_caps(ctx: ChainContext) -> list[int]:
    n, big_l = len(ctx.clusters), ctx.model.layers
    if n == 1:
        return [big_l]
    out = []
    for c in range(n):
        lo, hi = 1, big_l - (n - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first = 0 if c == 0 else (big_l - mid if c == n - 1 else 1)
            if min_peak_fits(ctx.problem(c, first, mid, n - 1 - c)):
                lo = mid
            else:
                hi = mid - 1
        out.append(lo)
    return out


def _reference_level1(ctx: ChainContext) -> SplitEval:
    """Level 1's search with every trial split evaluated afresh and no block memo (each block asks level 2)."""
    n, big_l = len(ctx.clusters), ctx.model.layers
    weights = [g * c.effective_tflops for g, c in zip(ctx.gpus, ctx.clusters, strict=True)]
    ev = evaluate_split(ctx, water_filled_split(big_l, weights, _reference_memory_caps(ctx)))
    for _ in range(big_l * n):
        best: SplitEval | None = None
        for moves in l1._move_phases(ev):
            for src, dst in moves:
                if ev.split[src] <= 1 or src == dst:
                    continue
                split = list(ev.split)
                split[src] -= 1
                split[dst] += 1
                cand = evaluate_split(ctx, split)
                if best is None or cand.score < best.score:
                    best = cand
            if best is not None and l1._improves(best, ev):
                break
        if best is None or not l1._improves(best, ev):
            break
        ev = best
    return ev


# --- the tests ----------------------------------------------------------------------------------------------

def test_level1_finds_what_the_plain_search_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    """On 40 generated chains at every micro-batch count (fresh level-2 caches each time, so both searches
    start from the same state): the same caps, the same split, configurations and score, and the same polished
    result. The exact cache's shortcut (no memory-free solve where no plain configuration fits) fires on
    these chains, and its answers equal the plain cache's on every problem level 1 asked."""
    asked: list[BlockProblem] = []
    solver = l1.block_bound_cached

    def recording(p: BlockProblem) -> BlockConfig | None:
        asked.append(p)
        return solver(p)

    monkeypatch.setattr(l1, "block_bound_cached", recording)
    contexts = 0
    for seed in range(40):
        for ctx in _contexts(seed):
            contexts += 1
            assert l1.layer_caps(ctx) == _reference_layer_caps(ctx), seed
            assert l1.memory_caps(ctx) == _reference_memory_caps(ctx), seed
            if l1.no_split_fits(ctx):
                continue
            l2.cache_clear()
            ours = l1.level1(ctx)
            l2.cache_clear()
            theirs = _reference_level1(ctx)
            assert ours == theirs, (seed, ctx.m)
            assert l1.polish(ctx, ours) == l1.polish(ctx, theirs), (seed, ctx.m)
    assert contexts >= 100
    plain_cache = l2._Cached(l2.solve_block_exact)
    l2.cache_clear()
    skipped = 0
    for p in dict.fromkeys(asked):  # first-asked order, as level 1 asked them
        q = l2.plain(p)
        if l2.solve_block_exact(q) is None and block_candidates(q):
            skipped += 1
        assert l2.block_bound_cached(p) == plain_cache(p)
    assert skipped >= 20


@settings(max_examples=60, deadline=None)
@given(p=problems(), data=st.data())
def test_the_exact_cache_answers_as_the_plain_cache(p: BlockProblem, data: st.DataObject) -> None:
    """A problem and its other in-flight profiles and memory sizes, asked in a drawn order of a fresh exact
    cache (problem vectors, the memory-free solve skipped where no plain configuration fits) and of the
    plain memoised solver: the same answer to every question."""
    variants = [p, replace(p, downstream=None), replace(p, downstream=(p.downstream or 0) + 3, max_in_flight=None),
                replace(p, depth_factor=3 - p.depth_factor)]
    for gib in (4.0, 16.0, 40.0, 80.0):
        variants.append(replace(p, shape=replace(p.shape, memory_gib=gib), memory_bound=True))
    order = data.draw(st.permutations(variants))
    ours = l2._ExactCached()
    theirs = l2._Cached(l2.solve_block_exact)
    for q in order + order:
        assert ours(q) == theirs(q)
