"""The compiled chain scorer and greedy allocation equal their numpy reference bit for bit, row by row, on
random topologies, jobs, chains and GPU vectors (padding, idle positions, unreachable hops included);
SpinSearch's search returns the same candidates with either; the compiled GPU tuning ends where the Python
one ends; the beam's next hops and extensions equal the Python ones."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_beam import extend_reference, neighbours_reference
from reference_scorer import allocate_greedy_reference, score_chains_reference
from reference_trim import trim_reference

from spiderflow.core.catalog import MODEL_PRESETS
from spiderflow.core.domain import GpuRange, JobSpec, Precision, Topology
from spiderflow.core.placement import spinsearch
from spiderflow.core.placement.base import Objective
from spiderflow.core.placement.common import (
    allocate_greedy,
    job_consts,
    score_chains,
    score_tables,
    topo_arrays,
    transfer_matrix,
)
from spiderflow.core.topogen import generate_topology

MODELS = sorted(m for m in MODEL_PRESETS if m != "gpt-tiny")


@st.composite
def instances(draw: st.DrawFn) -> tuple[object, ...]:
    n = draw(st.integers(2, 12))
    topo = generate_topology(n, draw(st.integers(0, 50)), draw(st.sampled_from(["geo", "hub", "mesh"])))
    if draw(st.booleans()):  # some clusters busy or empty
        topo = topo.with_free({c.name: draw(st.integers(0, c.total_gpus)) for c in topo.clusters})
    if draw(st.booleans()):  # a profile measured the work outside the blocks on some clusters
        topo = measured_outer(topo, draw(st.integers(0, 2**31)))
    if draw(st.booleans()):  # agents calibrated some clusters
        topo = calibrated(topo, draw(st.integers(0, 2**31)))
    batch = draw(st.sampled_from([8, 32, 128, 512]))
    micro = draw(st.sampled_from([d for d in (1, 2, 4, 8) if batch % d == 0]))
    lo = draw(st.integers(1, 64))
    job = JobSpec(id="j", model=MODEL_PRESETS[draw(st.sampled_from(MODELS))], global_batch=batch, micro_batch=micro,
                  seq_len=draw(st.sampled_from([512, 2048])), steps=10,
                  gpus=GpuRange(min=lo, max=lo + draw(st.integers(0, 256))), precision=draw(st.sampled_from(Precision)))
    rows = draw(st.integers(1, 12))
    width = draw(st.integers(1, min(n, 6)))
    chains = np.full((rows, width + draw(st.integers(0, 2))), -1, dtype=np.int64)
    for r in range(rows):
        k = draw(st.integers(1, width))
        chains[r, :k] = draw(st.permutations(range(n)))[:k]
    return topo, job, chains, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31))


def measured_outer(topo: Topology, seed: int) -> Topology:
    """``topo`` with measured embedding/head times, optimizer steps and input pipeline on some of its clusters
    (:func:`spiderflow.profile.apply_profile` sets these fields; 0 elsewhere: not measured)."""
    rng = random.Random(seed)
    out = []
    for c in topo.clusters:
        if rng.random() < 0.6:
            c = replace(c, embedding_us_per_token=rng.choice([0.0, rng.uniform(0.01, 0.5)]),
                        head_us_per_token=rng.choice([0.0, rng.uniform(0.05, 2.0)]),
                        embedding_optimizer_ms=rng.choice([0.0, rng.uniform(0.1, 20.0)]),
                        head_optimizer_ms=rng.choice([0.0, rng.uniform(0.1, 20.0)]),
                        data_ms_per_sample=rng.choice([0.0, rng.uniform(0.01, 2.0)]))
        out.append(c)
    return replace(topo, clusters=tuple(out))


CALIBRATED = {  # a cluster's calibrated field: a range of sizes that matters next to llama-tiny's steps
    "layer_overhead_ms": (0.05, 2.0), "optimizer_ms_per_layer": (0.1, 20.0),
}


def calibrated(topo: Topology, seed: int, terms: tuple[str, ...] = tuple(CALIBRATED)) -> Topology:
    """``topo`` with the calibrated ``terms`` (fixed time per layer and micro-batch, optimizer step per layer)
    on some of its clusters (agents set these fields; 0 elsewhere: not calibrated)."""
    rng = random.Random(seed)
    out = []
    for c in topo.clusters:
        if rng.random() < 0.6:
            c = replace(c, **{t: rng.choice([0.0, rng.uniform(*CALIBRATED[t])]) for t in terms})  # type: ignore[arg-type]
        out.append(c)
    return replace(topo, clusters=tuple(out))


@settings(max_examples=300, deadline=None)
@given(instances())
def test_kernel_scores_equal_the_numpy_reference(case: tuple[object, ...]) -> None:
    topo, job, chains, greedy, cut_links, seed = case
    ta = topo_arrays(topo)  # type: ignore[arg-type]
    jc = job_consts(job)  # type: ignore[arg-type]
    assert isinstance(chains, np.ndarray)
    rng = np.random.default_rng(int(seed))  # type: ignore[call-overload]
    p = spinsearch.transfer_matrix(ta, jc)
    if cut_links:  # unreachable hops
        p = np.where(rng.random(p.shape) < 0.3, np.inf, p)
        np.fill_diagonal(p, 0.0)
    if greedy:
        rate = ta.rate(jc.precision)
        gpus = allocate_greedy(ta, chains, jc.gpus_max, rate)
        assert np.array_equal(gpus, allocate_greedy_reference(ta, chains, jc.gpus_max, rate))
    else:  # any GPU count up to the free ones, zero included
        gpus = np.where(chains >= 0, rng.integers(0, np.maximum(ta.free[np.maximum(chains, 0)], 0) + 1), 0)
    tables = score_tables(ta, jc)
    got = score_chains(ta, jc, p, chains, gpus, tables)
    with np.errstate(all="ignore"):
        want = score_chains_reference(ta, jc, p, chains, gpus, tables)
    for name in ("step", "usd", "gpus", "feasible", "capacity_ratio", "layers"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(a, b, equal_nan=True), (name, a, b)


def test_greedy_allocation_fills_fastest_first_and_ties_in_chain_order() -> None:
    topo = generate_topology(6, 4, "geo")
    ta = topo_arrays(topo)
    chain = np.array([list(np.argsort(ta.flops, kind="stable"))], dtype=np.int64)  # slowest first
    rates = ta.flops[chain[0]]
    first = int(np.flatnonzero(rates == rates.max())[0])  # the fastest position, first among equals
    want = int(ta.free[chain[0, first]]) + 1
    out = allocate_greedy(ta, chain, want)
    assert out[0, first] == ta.free[chain[0, first]]  # takes all it has
    assert out.sum() == want
    assert np.array_equal(out, allocate_greedy_reference(ta, chain, want))


@pytest.mark.parametrize("objective", list(Objective))
@pytest.mark.parametrize(("clusters", "seed", "model", "lo", "hi"),
                         [(8, 1, "gpt3-6.7b", 16, 64), (16, 2, "llama3-70b", 64, 256), (12, 3, "gpt3-1.3b", 8, 32)])
def test_search_returns_the_same_candidates_with_the_reference_scorer(
    monkeypatch: pytest.MonkeyPatch, objective: Objective, clusters: int, seed: int, model: str, lo: int, hi: int,
) -> None:
    topo = generate_topology(clusters, seed, "geo")
    job = JobSpec(id="j", model=MODEL_PRESETS[model], global_batch=256, seq_len=2048, steps=10,
                  gpus=GpuRange(min=lo, max=hi))

    def search() -> tuple[list[spinsearch.ChainCandidate], dict[str, float]]:
        topo.memo.clear()
        return spinsearch.search_chains(topo, job, objective=objective)

    fast = search()
    monkeypatch.setattr(spinsearch, "score_chains", score_chains_reference)
    monkeypatch.setattr(spinsearch, "allocate_greedy", allocate_greedy_reference)
    assert search() == fast
    assert fast[0], "the instance has candidates"


@settings(max_examples=120, deadline=None)
@given(st.integers(2, 16), st.integers(0, 40), st.sampled_from(list(Objective)), st.sampled_from(MODELS),
       st.integers(1, 64), st.integers(0, 192), st.booleans(), st.randoms(use_true_random=False))
def test_kernel_trim_equals_the_python_reference(
    n: int, seed: int, objective: Objective, model: str, lo: int, extra: int, busy: bool, rnd: random.Random,
) -> None:
    topo = generate_topology(n, seed, "geo")
    if busy:
        topo = topo.with_free({c.name: rnd.randint(0, c.total_gpus) for c in topo.clusters})
    job = JobSpec(id="j", model=MODEL_PRESETS[model], global_batch=256, seq_len=2048, steps=10,
                  gpus=GpuRange(min=lo, max=lo + extra))
    ta, jc = topo_arrays(topo), job_consts(job)
    usable = [i for i in range(n) if ta.free[i] > 0]
    if not usable:
        return
    chains = [tuple(rnd.sample(usable, rnd.randint(1, min(len(usable), 5)))) for _ in range(rnd.randint(1, 6))]
    hops = spinsearch._hops(topo, ta, jc)

    def scorer() -> spinsearch._Scorer:
        return spinsearch._Scorer(ta, jc, hops.p, objective)

    fast, ref = scorer(), scorer()
    assert spinsearch._trim(fast, chains, objective) == trim_reference(ref, chains, objective)
    assert (fast.max_capacity, fast.max_gpus) == (ref.max_capacity, ref.max_gpus)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 40), st.integers(0, 40), st.sampled_from(["geo", "hub", "mesh"]), st.integers(1, 12),
       st.floats(0.0, 1.0), st.integers(1, 6), st.randoms(use_true_random=False))
def test_beam_kernels_equal_the_python_reference(
    n: int, seed: int, kind: str, neighbours: int, quantile: float, depth: int, rnd: random.Random,
) -> None:
    topo = generate_topology(n, seed, kind)  # type: ignore[arg-type]
    topo = topo.with_free({c.name: rnd.choice([0, c.total_gpus]) for c in topo.clusters})
    job = JobSpec(id="j", model=MODEL_PRESETS["gpt3-6.7b"], global_batch=256, seq_len=2048, steps=10,
                  gpus=GpuRange(min=8, max=64))
    ta, jc = topo_arrays(topo), job_consts(job)
    hops = spinsearch._hops(topo, ta, jc)
    usable = ta.free > 0
    finite = hops.p[np.isfinite(hops.p)]
    theta = float(np.quantile(finite, quantile)) if rnd.random() < 0.8 else float("inf")
    table = spinsearch.neighbour_table(hops.order, hops.p, usable, theta, neighbours)
    nbrs = {u: neighbours_reference(hops.order, hops.p, usable, theta, neighbours, u) for u in range(n)}
    for u in range(n):
        assert [int(v) for v in table[u] if v >= 0] == nbrs[u]
    pool = [u for u in range(n) if usable[u]]
    if len(pool) < depth:
        return
    beam = list(dict.fromkeys(tuple(rnd.sample(pool, depth)) for _ in range(rnd.randint(1, 8))))
    got = spinsearch.extend_beam(np.array(beam, dtype=np.int64), table)
    want = extend_reference(beam, nbrs)
    assert [tuple(int(x) for x in row) for row in got] == want
    assert got.shape == (len(want), depth + 1)


def test_scorer_prices_measured_outer_work_as_the_closed_form() -> None:
    """Where a profile measured the embedding, the head, their optimizer steps and the input pipeline, and where
    agents calibrated a cluster's fixed time and optimizer step per layer, the scorer's stage time ``T`` and
    per-step ``Y`` of every position (first, middle, last; every TP degree) equal the closed form's
    (:func:`~spiderflow.core.costmodel.stage_compute_time`, :func:`~spiderflow.core.costmodel.measured_step_extra`
    plus ``ℓ·optimizer_ms_per_layer``), and a one-GPU chain scores the closed form's step."""
    from spiderflow.core import costmodel
    from spiderflow.core.domain import Plan, Schedule, Stage

    topo = calibrated(measured_outer(generate_topology(8, 3, "geo"), 7), 4)
    assert sum(c.layer_overhead_ms != 0.0 for c in topo.clusters) >= 2
    assert sum(c.optimizer_ms_per_layer != 0.0 for c in topo.clusters) >= 2
    spec = MODEL_PRESETS["llama-tiny"]
    for precision in (Precision.BF16, Precision.FP32):
        job = JobSpec(id="j", model=spec, global_batch=64, micro_batch=4, seq_len=512, steps=1,
                      gpus=GpuRange(min=1, max=64), precision=precision)
        ta, jc = topo_arrays(topo), job_consts(job)
        tables = score_tables(ta, jc)
        b, s, m, n = jc.b, jc.s, jc.m, 3
        measured = 0
        for ci, c in enumerate(topo.clusters):
            measured += c.head_us_per_token != 0.0 or c.embedding_us_per_token != 0.0
            for ti, tp in enumerate((1, 2, 4, 8)):
                if tp > ta.tp_cap[ci] or spec.heads % tp:
                    continue
                for first_layer in (0, 1, spec.layers - n):
                    last_layer = first_layer + n - 1
                    is_first, is_last = first_layer == 0, last_layer == spec.layers - 1
                    t = n * tables.per_layer_t[ti, ci] + (tables.head_t[ti, ci] if is_last else 0.0)
                    if is_first and tables.fig[6, ci] != 0.0:
                        t += tables.fig[6, ci]
                    want = costmodel.stage_compute_time(spec, c, first_layer, last_layer, tp, b, s,
                                                        precision=precision)
                    assert t == pytest.approx(want, rel=1e-9), (c.name, tp, first_layer)
                    for d in (1, 3, 16):
                        y = (tables.fig[7, ci] + tables.fig[8, ci] * -(-m // d)) if is_first else 0.0
                        y += tables.fig[9, ci] if is_last else 0.0
                        y += n * tables.fig[10, ci]
                        extra = costmodel.measured_step_extra(spec, c, first_layer, last_layer, b * -(-m // d))
                        extra += n * c.optimizer_ms_per_layer / 1e3
                        assert y == pytest.approx(extra, rel=1e-9, abs=1e-15), (c.name, d)
            one = score_chains(ta, jc, spinsearch.transfer_matrix(ta, jc), np.array([[ci]]), np.array([[1]]), tables)
            plan = Plan(stages=(Stage(cluster=c.name, first_layer=0, last_layer=spec.layers - 1),), micro_batches=m,
                        schedule=Schedule.ONE_F_ONE_B)
            assert one.step[0] == pytest.approx(costmodel.evaluate(plan, topo, job).step_time_s, rel=1e-9), c.name
        assert measured >= 2


@pytest.mark.parametrize("term", sorted(CALIBRATED))
def test_scorer_prices_each_calibrated_term_as_the_closed_form(term: str) -> None:
    """Each calibrated term alone (on some clusters): a one-GPU chain of each cluster scores the closed form's
    step of the plan it stands for (one stage of every layer; ``T`` with ``L·layer_overhead_ms``, ``Y`` the
    optimizer's ``L·optimizer_ms_per_layer``), and the term moves it."""
    from spiderflow.core import costmodel
    from spiderflow.core.domain import Plan, Schedule, Stage

    bare = generate_topology(8, 3, "geo")
    topo = calibrated(bare, 10, (term,))
    spec = MODEL_PRESETS["llama-tiny"]
    job = JobSpec(id="j", model=spec, global_batch=64, micro_batch=4, seq_len=512, steps=1,
                  gpus=GpuRange(min=1, max=64))
    ta, jc = topo_arrays(topo), job_consts(job)
    p = transfer_matrix(ta, jc)
    counted = 0
    for ci, c in enumerate(topo.clusters):
        one = score_chains(ta, jc, p, np.array([[ci]]), np.array([[1]]))
        plan = Plan(stages=(Stage(cluster=c.name, first_layer=0, last_layer=spec.layers - 1),), micro_batches=jc.m,
                    schedule=Schedule.ONE_F_ONE_B)
        want = costmodel.evaluate(plan, topo, job).step_time_s
        assert one.step[0] == pytest.approx(want, rel=1e-9), c.name
        if getattr(c, term):
            counted += 1
            assert want > costmodel.evaluate(plan, bare, job).step_time_s * (1 + 1e-3), c.name  # the term counts
    assert counted >= 2
