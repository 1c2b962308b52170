"""The compiled level-1 fallback planner returns exactly what its plain Python formulation
(``fallback_reference``) returns: the same plans (every field; floats bitwise), the same errors with the same
messages, the same memory-first structures and the same split evaluations and blocks, on random topologies,
jobs and allocations, memory-tight ones included (70B models on few GPUs, clusters with little memory), with
and without the work outside the blocks a profile measures and the clusters' calibrated terms."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import fallback_reference as ref
import numpy as np
import pytest
from chains import memory_bound_chain
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import MODEL_PRESETS, ModelSpec, model_preset
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Precision, Topology
from spiderflow.core.errors import UnschedulableError, ValidationError
from spiderflow.core.kernels import _WARMUPS, fallback
from spiderflow.core.placement import common
from spiderflow.core.placement.common import JobConsts
from spiderflow.core.topogen import generate_topology

Case = tuple[Topology, JobSpec, list[tuple[str, int]]]

MODELS = sorted(MODEL_PRESETS)


@st.composite
def measured(draw: st.DrawFn, c: Cluster) -> Cluster:
    """``c`` with some of the work outside the blocks a profile measures (the embedding's and the head's µs
    per token, their optimizer steps, the input pipeline per sample) and some calibrated terms (fixed time per
    layer and micro-batch, optimizer step per layer); 0: not measured."""
    def term(hi: float) -> st.SearchStrategy[float]:
        return st.one_of(st.just(0.0), st.floats(hi / 1000, hi))

    return replace(c, embedding_us_per_token=draw(term(50.0)), head_us_per_token=draw(term(50.0)),
                   embedding_optimizer_ms=draw(term(200.0)), head_optimizer_ms=draw(term(200.0)),
                   data_ms_per_sample=draw(term(20.0)), layer_overhead_ms=draw(term(20.0)),
                   optimizer_ms_per_layer=draw(term(100.0)))


@st.composite
def generated(draw: st.DrawFn, *, big: bool = False) -> Case:
    """A chain of 1-5 distinct clusters of a generated topology (some clusters busy), any GPUs up to the free
    ones (``big``: llama3-70b on at most 4, 16 or 64 GPUs per cluster), and a job in any precision whose GPU
    minimum is often above what the search would use (the exact-GPU passes)."""
    n = draw(st.integers(1, 10))
    topo = generate_topology(n, draw(st.integers(0, 500)), draw(st.sampled_from(["geo", "hub", "mesh"])))
    if draw(st.booleans()):
        topo = topo.with_free({c.name: draw(st.integers(0, c.total_gpus)) for c in topo.clusters})
    if draw(st.booleans()):
        topo = replace(topo, clusters=tuple(draw(measured(c)) for c in topo.clusters))
    usable = [c for c in topo.clusters if c.free >= 1]
    assume(usable)
    k = draw(st.integers(1, min(len(usable), 5)))
    cap = draw(st.sampled_from([4, 16, 64])) if big else 1 << 20
    alloc = [(c.name, draw(st.integers(1, min(c.free, cap)))) for c in draw(st.permutations(usable))[:k]]
    batch = draw(st.sampled_from([8, 32, 128, 512]))
    micro = draw(st.sampled_from([d for d in (1, 2, 4, 8) if batch % d == 0]))
    lo = draw(st.integers(1, sum(g for _, g in alloc) + 8))
    job = JobSpec(id="j", model=MODEL_PRESETS["llama3-70b" if big else draw(st.sampled_from(MODELS))],
                  global_batch=batch, micro_batch=micro, seq_len=draw(st.sampled_from([512, 2048, 4096])),
                  gpus=GpuRange(min=lo, max=lo + draw(st.integers(0, 512))), precision=draw(st.sampled_from(Precision)))
    return topo, job, alloc


@st.composite
def tight(draw: st.DrawFn) -> Case:
    """1-3 small clusters with 1.5-8 GiB GPUs and small models: memory binds often, at every degree."""
    n = draw(st.integers(1, 3))
    model = ModelSpec(name="t", layers=draw(st.integers(n, 12)), hidden=draw(st.sampled_from([512, 1024, 2048])),
                      heads=8, vocab=8192)
    clusters = tuple(
        Cluster(name=f"c{i}", gpu=draw(st.sampled_from(["A100-80G", "V100-16G", "T4"])), nodes=draw(st.integers(1, 2)),
                gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])), memory_gib=draw(st.sampled_from([1.5, 3.0, 8.0])))
        for i in range(n)
    )
    if draw(st.booleans()):
        clusters = tuple(draw(measured(c)) for c in clusters)
    links = tuple(Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=10.0, latency_ms=5.0) for i in range(n - 1))
    alloc = [(c.name, draw(st.integers(1, c.total_gpus))) for c in clusters]
    m = draw(st.sampled_from([2, 4, 8, 16]))
    job = JobSpec(id="t", model=model, global_batch=m, micro_batch=1, seq_len=draw(st.sampled_from([256, 1024])),
                  gpus=GpuRange(min=draw(st.integers(1, sum(g for _, g in alloc) + 1)), max=64))
    return Topology(clusters=clusters, links=links), job, alloc


def _outcome(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except (UnschedulableError, ValidationError) as e:
        return type(e), str(e), getattr(e, "constraint", None)


def _same(got: Any, want: Any) -> None:
    """Equal, and bitwise so (``repr`` spells every float exactly, NaN and the sign of zero included)."""
    assert repr(got) == repr(want)
    if "nan" not in repr(want):
        assert got == want


def _check_plans(case: Case) -> None:
    topo, job, alloc = case
    _same(_outcome(common.fallback_plan_chain, topo, job, alloc), _outcome(ref.fallback_plan_chain, topo, job, alloc))
    # Every shape competing alike (finalise's extra allocation for TPA).
    _same(_outcome(lambda *a: common.fallback_plan_chain(*a, every_shape=True), topo, job, alloc),
          _outcome(lambda *a: ref.fallback_plan_chain(*a, every_shape=True), topo, job, alloc))


@settings(max_examples=150, deadline=None)
@given(generated())
@example(memory_bound_chain())
def test_plans_and_errors_equal_the_reference(case: Case) -> None:
    _check_plans(case)


@settings(max_examples=60, deadline=None)
@given(generated(big=True))
def test_plans_and_errors_of_70b_models_on_few_gpus_equal_the_reference(case: Case) -> None:
    _check_plans(case)


@settings(max_examples=150, deadline=None)
@given(tight())
def test_plans_and_errors_under_tight_memory_equal_the_reference(case: Case) -> None:
    _check_plans(case)


def _split(draw: st.DrawFn, layers: int, k: int) -> list[int]:
    if k == 1:
        return [layers]
    cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=k - 1, max_size=k - 1, unique=True)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True)]


@settings(max_examples=120, deadline=None)
@given(st.one_of(generated(), generated(big=True), tight()), st.booleans(), st.integers(0, 8), st.booleans(),
       st.data())
def test_split_evaluations_and_memory_first_structures_equal_the_reference(
        case: Case, exact: bool, slack: int, every: bool, data: st.DataObject) -> None:
    """Blocks and ``(excess, step)`` of random splits under random sub-stage counts (many distinct counts
    downstream of each position, some beyond the micro-batch count, where the block memo shares entries), in
    exact-GPU mode with slack too, and with every shape competing alike; the memory-first structures."""
    topo, job, alloc = case
    k, layers = len(alloc), job.model.layers
    assume(k <= layers)
    ev = common._ChainEval(topo, job, alloc, exact_gpus=exact, slack=slack, every_shape=every)
    want = ref._ChainEval(topo, job, alloc, exact_gpus=exact, slack=slack, every_shape=every)
    _same(common.memory_first_split(ev), ref.memory_first_split(want))
    for _ in range(10):
        sizes = _split(data.draw, layers, k)
        pps = data.draw(st.lists(st.sampled_from(common._PP_CHOICES), min_size=k, max_size=k))
        _same(ev.evaluate_split(sizes, pps), want.evaluate_split(sizes, pps))


@settings(max_examples=80, deadline=None)
@given(st.one_of(generated(), tight()), st.data())
def test_plans_with_a_given_split_equal_the_reference(case: Case, data: st.DataObject) -> None:
    topo, job, alloc = case
    assume(len(alloc) <= job.model.layers)
    sizes = _split(data.draw, job.model.layers, len(alloc))
    _same(_outcome(common.plan_with_split, topo, job, alloc, sizes),
          _outcome(ref.plan_with_split, topo, job, alloc, sizes))


def _zero_or(x: float) -> st.SearchStrategy[float]:
    return st.sampled_from([0.0, 0.0, x])


@st.composite
def degenerate(draw: st.DrawFn) -> JobConsts:
    """Job constants with zero compute, activations, parameters per layer, embedding or gradient traffic and
    one micro-batch: many configurations, blocks and moves then tie exactly, so the tie rules decide."""
    jc = JobConsts(
        layers=draw(st.integers(5, 40)), m=draw(st.sampled_from([1, 1, 2, 8])), b=draw(st.sampled_from([0, 1, 4])),
        s=draw(st.sampled_from([0, 512])), h=1024, heads=8, vocab=draw(st.sampled_from([0, 32000])),
        f=draw(_zero_or(1e12)), head_f=draw(_zero_or(1e13)), act=draw(_zero_or(1e6)),
        p_layer=draw(st.sampled_from([0.0, 2.0**20, 1e8, 2e9])), p_embed=draw(_zero_or(1e8)), gpus_min=1,
        gpus_max=1 << 20, tokens=1,
    )
    assume(jc.p_layer > 0 or jc.act_layer(1) > 0)  # a layer takes memory
    return jc


@settings(max_examples=150, deadline=None)
@given(st.one_of(generated(), tight()), degenerate(), st.booleans(), st.data())
def test_ties_are_broken_as_the_reference_breaks_them(case: Case, jc: JobConsts, exact: bool,
                                                     data: st.DataObject) -> None:
    topo, job, alloc = case
    k = len(alloc)
    assume(k <= jc.layers)
    job = replace(job, model=replace(job.model, layers=jc.layers))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "job_consts", lambda _job: jc)
        mp.setattr(ref, "job_consts", lambda _job: jc)
        ev = common._ChainEval(topo, job, alloc, exact_gpus=exact, slack=1)
        want = ref._ChainEval(topo, job, alloc, exact_gpus=exact, slack=1)
        _same(common.memory_first_split(ev), ref.memory_first_split(want))
        for _ in range(3):
            sizes = _split(data.draw, jc.layers, k)
            pps = data.draw(st.lists(st.sampled_from(common._PP_CHOICES), min_size=k, max_size=k))
            _same(ev.evaluate_split(sizes, pps), want.evaluate_split(sizes, pps))
            _same(ev.optimise(sizes, local_search=True)[:2],
                  ref._optimise_split(want, sizes, local_search=True))
        with np.errstate(all="ignore"):
            _same(_outcome(common.fallback_plan_chain, topo, job, alloc),
                  _outcome(ref.fallback_plan_chain, topo, job, alloc))


@pytest.mark.parametrize("layers", [40, 60, 80, 100])
@pytest.mark.parametrize("gpus", [(16, 16), (16, 16, 16), (8, 16, 16), (16, 8, 4)])
def test_memory_first_ties_are_broken_as_the_reference_breaks_them(layers: int, gpus: tuple[int, ...]) -> None:
    """Identical clusters and no activations: many structures hold the same layers with the same stages."""
    jc = JobConsts(layers=layers, m=1, b=1, s=0, h=1024, heads=8, vocab=0, f=0.0, head_f=0.0, act=0.0, p_layer=2e9,
                   p_embed=0.0, gpus_min=1, gpus_max=1 << 20, tokens=1)
    clusters = tuple(Cluster(name=f"c{i}", gpu="A100-80G", nodes=2, gpus_per_node=8) for i in range(len(gpus)))
    links = tuple(Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=10.0, latency_ms=5.0) for i in range(len(gpus) - 1))
    topo = Topology(clusters=clusters, links=links)
    job = JobSpec(id="j", model=replace(model_preset("gpt3-1.3b"), layers=layers), global_batch=8,
                  gpus=GpuRange(min=1, max=100))
    alloc = [(f"c{i}", g) for i, g in enumerate(gpus)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "job_consts", lambda _job: jc)
        mp.setattr(ref, "job_consts", lambda _job: jc)
        _same(common.memory_first_split(common._ChainEval(topo, job, alloc, exact_gpus=False)),
              ref.memory_first_split(ref._ChainEval(topo, job, alloc, exact_gpus=False)))
        _same(_outcome(common.fallback_plan_chain, topo, job, alloc),
              _outcome(ref.fallback_plan_chain, topo, job, alloc))


def test_the_memory_paths_run_and_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory-first plan after a search that ends over memory; the search's own memory error when there
    is no such plan; the bound named before any search when nothing fits."""
    topo, job, alloc = memory_bound_chain()
    plan = common.fallback_plan_chain(topo, job, alloc)
    assert [(st.cluster, st.layers) for st in plan.stages] == [("montreal", 1), ("tokyo", 31)]
    _same(plan, ref.fallback_plan_chain(topo, job, alloc))
    monkeypatch.setattr(common, "_memory_first_plan", lambda ev, allocation: None)
    monkeypatch.setattr(ref, "_memory_first_plan", lambda ev, allocation: None)
    got = _outcome(common.fallback_plan_chain, topo, job, alloc)
    assert got[0] is UnschedulableError and "GiB" in got[1]
    _same(got, _outcome(ref.fallback_plan_chain, topo, job, alloc))
    small = Topology(clusters=(Cluster(name="a", gpu="T4", nodes=1, gpus_per_node=8, free_gpus=2),), links=())
    big = JobSpec(id="j", model=model_preset("llama3-70b"), global_batch=64, gpus=GpuRange(min=1, max=8))
    got = _outcome(common.fallback_plan_chain, small, big, [("a", 2)])
    assert got[0] is UnschedulableError and "hold at most" in got[1] and got[2] == "memory"
    _same(got, _outcome(ref.fallback_plan_chain, small, big, [("a", 2)]))


def test_an_invalid_split_is_refused() -> None:
    topo, job, alloc = memory_bound_chain()
    ev = common._ChainEval(topo, job, alloc, exact_gpus=False)
    with pytest.raises(ValueError, match="at least one layer"):
        ev.evaluate_split([0, 32], [1, 1])
    with pytest.raises(ValueError, match="every layer"):
        ev.evaluate_split([1, 30], [1, 1])
    with pytest.raises(ValueError, match="per position"):
        ev.evaluate_split([1, 30, 1], [1, 1, 1])


def test_the_kernels_share_the_planners_choices_and_load_with_the_others() -> None:
    assert fallback.PP_CHOICES == common._PP_CHOICES
    assert fallback._warm in _WARMUPS
