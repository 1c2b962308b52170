"""Level 2's compiled exact solver and memory tests (:mod:`spiderflow.core.kernels.level2` behind
:mod:`spiderflow.core.tpa.level2`) against their plain Python formulation (:mod:`.level2_reference`) on random
blocks of every bundled model family, precision and option (recomputation, FSDP): the same configurations,
bitwise the same figures, the same memory caps and verdicts; and every candidate's figures against
:mod:`spiderflow.core.costmodel`'s own functions."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from spiderflow.core import costmodel
from spiderflow.core.catalog import MODEL_PRESETS, ModelSpec
from spiderflow.core.domain import Cluster, Precision, Sharding, Stage
from spiderflow.core.kernels import level2 as kernels
from spiderflow.core.tpa import level2 as l2
from spiderflow.core.tpa.level2 import BlockConfig, BlockProblem, ClusterShape, Degrees

from . import level2_reference as ref

_MODELS = tuple(MODEL_PRESETS.values())


def _same(got: object, want: object) -> None:
    """Equal, and bitwise so (``repr`` tells ``-0.0`` from ``0.0`` and shows every float's digits)."""
    assert got == want
    assert repr(got) == repr(want)


@st.composite
def problems(draw: st.DrawFn) -> BlockProblem:
    """A block of a preset model on 1–64 GPUs (1–8 per node), 1–80 layers, any in-flight profile, with
    calibrated or zero fixed times, and GPU memory from below the least any configuration needs to ample
    (so that infeasible, one-sub-stage and many-sub-stage optima all occur), or not binding."""
    model = draw(st.sampled_from(_MODELS))
    shape = ClusterShape(
        effective_tflops=draw(st.sampled_from([125.0, 312.0, 989.0]) | st.floats(5.0, 1000.0)),
        memory_gib=1e9,
        gpus_per_node=draw(st.integers(1, 8)),
        intra_node_gbps=draw(st.sampled_from([600.0, 900.0, math.inf]) | st.floats(10.0, 1000.0)),
        inter_node_gbps=draw(st.sampled_from([25.0, 100.0]) | st.floats(1.0, 400.0)),
        layer_overhead_s=draw(st.sampled_from([0.0]) | st.floats(0.0, 0.02)),
        optimizer_s=draw(st.sampled_from([0.0]) | st.floats(0.0, 0.05)),
        wire_bytes=draw(st.sampled_from([2, 4])),
    )
    if draw(st.booleans()):  # a profile measured the work outside the blocks
        shape = replace(shape, embedding_us_per_token=draw(st.sampled_from([0.0]) | st.floats(0.01, 1.0)),
                        head_us_per_token=draw(st.sampled_from([0.0]) | st.floats(0.01, 5.0)),
                        embedding_optimizer_ms=draw(st.sampled_from([0.0]) | st.floats(0.0, 20.0)),
                        head_optimizer_ms=draw(st.sampled_from([0.0]) | st.floats(0.0, 20.0)),
                        data_ms_per_sample=draw(st.sampled_from([0.0]) | st.floats(0.0, 2.0)))
    p = BlockProblem(
        shape=shape,
        gpus=draw(st.integers(1, 64)),
        layers=draw(st.integers(1, 80)),
        has_embed=draw(st.booleans()),
        has_head=draw(st.booleans()),
        model=model,
        micro_batch=draw(st.sampled_from([1, 2, 4, 8])),
        seq_len=draw(st.sampled_from([512, 1024, 2048, 4096])),
        m=draw(st.integers(1, 64)),
        downstream=draw(st.none() | st.integers(0, 16)),
        depth_factor=draw(st.sampled_from([1, 2])),
        memory_bound=draw(st.booleans() | st.just(True)),
        floor_s=draw(st.sampled_from([0.0]) | st.floats(0.0, 2.0)),
        max_in_flight=draw(st.none() | st.integers(1, 8)),
        precision=draw(st.sampled_from(list(Precision))),
        allow_recompute=draw(st.booleans() | st.just(True)),
        allow_fsdp=draw(st.booleans() | st.just(True)),
    )
    worst = ref.min_memory_config(p)  # with ample memory: the least peak any configuration needs
    need = max(worst.memory_gib) if worst is not None else 40.0
    factor = draw(st.sampled_from([1.0, 0.9, 1.5]) | st.floats(0.5, 4.0))
    return replace(p, shape=replace(shape, memory_gib=need * factor))


def _check(p: BlockProblem) -> None:
    """Every kernel-backed output of ``p`` equals the reference's."""
    fl, it = l2._vectors(p)
    assert (fl.size, it.size) == (kernels.F_SIZE, kernels.I_SIZE)
    _same(l2.block_candidates(p), ref.block_candidates(p))
    _same(l2.solve_block_exact(p), ref.solve_block_exact(p))
    _same(l2._solved(p, kernels.solve_exact), ref._solve_tier(p))  # every candidate at once, options included
    assert l2.min_peak_fits(p) is ref.min_peak_fits(p)
    _same(l2.min_memory_config.__wrapped__(p), ref.min_memory_config.__wrapped__(p))
    for k in ref.block_candidates(p):
        _same(l2.memory_caps(p, k), ref.memory_caps(p, k))
        _same(l2._compute_coeffs(p, k), ref._compute_coeffs(p, k))


@settings(max_examples=250, deadline=None)
@given(p=problems())
def test_kernels_match_the_reference(p: BlockProblem) -> None:
    _check(p)
    cfg = ref.solve_block_exact(p)
    event("infeasible" if cfg is None else "one sub-stage" if cfg.pp == 1 else "several sub-stages")


@settings(max_examples=60, deadline=None)
@given(p=problems(), data=st.data())
def test_costs_and_caps_of_any_degrees_match(p: BlockProblem, data: st.DataObject) -> None:
    """Memory caps of degrees outside the candidates, and the figures of arbitrary splits (costed with the
    compiled constants)."""
    k = Degrees(tp=data.draw(st.integers(1, 8)), pp=data.draw(st.integers(1, 8)), dp=data.draw(st.integers(1, 8)),
                recompute=data.draw(st.booleans()), fsdp=data.draw(st.booleans()))
    _same(l2.memory_caps(p, k), ref.memory_caps(p, k))
    layers = tuple(data.draw(st.lists(st.integers(1, 12), min_size=k.pp, max_size=k.pp)))
    _same(l2.config_cost(p, k, layers), ref.config_cost(p, k, layers))


@settings(max_examples=40, deadline=None)
@given(p=problems())
def test_memoised_solves_match(p: BlockProblem) -> None:
    """The memoised path (:class:`~spiderflow.core.tpa.level2._Cached`) over the compiled and the reference
    solver, on a problem and its other in-flight profiles."""
    ours = l2._Cached(l2.solve_block_exact)
    theirs = l2._Cached(ref.solve_block_exact)
    variants = [p, replace(p, downstream=None), replace(p, depth_factor=3 - p.depth_factor),
                replace(p, downstream=(p.downstream or 0) + 3, max_in_flight=None)]
    for q in variants:
        _same(ours(q), theirs(q))


@settings(max_examples=60, deadline=None)
@given(p=problems(), data=st.data())
def test_vectors_from_shared_parts_match_the_plain_vectors(p: BlockProblem, data: st.DataObject) -> None:
    """:func:`~spiderflow.core.tpa.level2._vectors` (the fields a chain cluster's blocks share memoised on
    the shape and model objects) builds bitwise the vectors of every field read from the problem, for a
    problem and other blocks of the same shape and model objects (other GPUs, layers, depths, floors, flags)."""
    q = replace(p, gpus=data.draw(st.integers(1, 64)), layers=data.draw(st.integers(1, 80)),
                downstream=data.draw(st.none() | st.integers(0, 16)), floor_s=data.draw(st.floats(0.0, 2.0)),
                has_embed=not p.has_embed, memory_bound=not p.memory_bound, allow_fsdp=not p.allow_fsdp)
    twin = replace(p, shape=replace(p.shape))  # an equal shape, another object
    for r in (p, q, p, twin, replace(p, precision=data.draw(st.sampled_from(list(Precision))))):
        fl, it = l2._vectors(r)
        want_fl, want_it = ref._vectors(r)
        assert (fl.dtype, it.dtype) == (want_fl.dtype, want_it.dtype)
        assert fl.tobytes() == want_fl.tobytes() and it.tobytes() == want_it.tobytes()


@settings(max_examples=80, deadline=None)
@given(p=problems(), data=st.data())
def test_fitting_cost_in_one_kernel_call_matches(p: BlockProblem, data: st.DataObject) -> None:
    """:func:`~spiderflow.core.tpa.level2._fitting_vectors` (constants, figures and the memory test in one
    kernel call) equals :func:`~spiderflow.core.tpa.level2._fitting_cost` and the reference's
    :func:`config_cost` with its memory test, bitwise, for any degrees and split (fitting or not)."""
    k = Degrees(tp=data.draw(st.integers(1, 8)), pp=data.draw(st.integers(1, 8)), dp=data.draw(st.integers(1, 8)),
                recompute=data.draw(st.booleans()), fsdp=data.draw(st.booleans()))
    layers = tuple(data.draw(st.lists(st.integers(1, 12), min_size=k.pp, max_size=k.pp)))
    whole = ref.config_cost(p, k, layers)
    want = whole if max(whole.memory_gib) <= p.shape.memory_gib else None
    fl, it = l2._vectors(p)
    got = l2._fitting_vectors(fl, it, whole)
    _same(got, want)
    _same(l2._fitting_cost(p, k, layers), want)
    cfg = l2.solve_block_exact(p)
    if cfg is not None:  # a solved configuration re-costed under its own problem is itself (where it fits)
        _same(l2._fitting_vectors(fl, it, cfg), cfg if max(cfg.memory_gib) <= p.shape.memory_gib else None)
    event("fits" if want is not None else "over memory")


@settings(max_examples=300, deadline=None)
@given(
    slope=st.sampled_from([0.0, 1.0, 0.1]) | st.floats(0.0, 1e3) | st.floats(1e-280, 1e-200),
    const=st.sampled_from([0.0, 1.0]) | st.floats(-1e3, 1e6),
    level=st.floats(-1e3, 1e20),
    top=st.integers(0, 120),
)
def test_layer_counts_match(slope: float, const: float, level: float, top: int) -> None:
    """The count ``max{ℓ ≤ top : slope·ℓ + const ≤ level}``, including quotients beyond any integer type."""
    assume(slope <= 0.0 or math.isfinite((level - const) / slope))  # else Python's floor raises
    assert kernels._count(slope, const, level, top) == ref._count(slope, const, level, top)


@settings(max_examples=300, deadline=None)
@given(
    slope=st.floats(1e-6, 1e3),
    level=st.floats(1e-3, 1e6),
    n=st.integers(0, 80),
    ulps=st.integers(-3, 3),
    top=st.integers(1, 80),
)
def test_layer_counts_at_the_slack_boundary_match(slope: float, level: float, n: int, ulps: int, top: int) -> None:
    """Counts whose next layer lands within a few ulps of the level's ``10⁻¹²`` slack."""
    const = level * (1.0 + 1e-12) - slope * (n + 1)
    for _ in range(abs(ulps)):
        const = float(np.nextafter(const, math.copysign(math.inf, ulps)))
    assert kernels._count(slope, const, level, top) == ref._count(slope, const, level, top)


@settings(max_examples=200, deadline=None)
@given(
    slope=st.sampled_from([0.0, 0.5]) | st.floats(0.0, 10.0) | st.floats(-10.0, 0.0),
    consts=st.lists(st.sampled_from([0.0, 1.0, 2.5]) | st.floats(-1e3, 1e3), min_size=1, max_size=3),
    top=st.integers(1, 80),
)
def test_levels_match(slope: float, consts: list[float], top: int) -> None:
    """The sorted distinct levels, merged (``slope ≥ 0``) or sorted."""
    c = np.array(consts, np.float64)
    want = ref._levels(slope, tuple(consts), top)
    assert kernels._levels(slope, c, top, np.empty(c.size * top, np.float64)).tolist() == want
    assert kernels._levels(slope, c, top, np.empty(0, np.float64)).tolist() == want  # a buffer too short


def _preset(name: str, **kw: object) -> BlockProblem:
    shape = ClusterShape(effective_tflops=312.0, memory_gib=80.0, gpus_per_node=8, intra_node_gbps=600.0,
                         inter_node_gbps=100.0)
    fields: dict[str, object] = dict(shape=shape, gpus=64, layers=80, has_embed=True, has_head=True,
                                     model=MODEL_PRESETS[name], micro_batch=1, seq_len=2048, m=32,
                                     downstream=3)
    fields.update(kw)
    return BlockProblem(**fields)  # type: ignore[arg-type]


_TINY = ModelSpec(name="t", layers=8, hidden=1024, heads=8, vocab=8192)

_ODD_HEADS = ModelSpec(name="odd", layers=2, hidden=384, heads=3, vocab=1000)

_CASES = {
    "70b-whole-cluster": _preset("llama3-70b"),
    "70b-tight-many-sub-stages": _preset("llama3-70b", shape=ClusterShape(
        effective_tflops=125.0, memory_gib=24.0, gpus_per_node=4, intra_node_gbps=300.0, inter_node_gbps=25.0)),
    "70b-infeasible": _preset("llama3-70b", gpus=8, shape=ClusterShape(
        effective_tflops=125.0, memory_gib=16.0, gpus_per_node=8, intra_node_gbps=300.0, inter_node_gbps=25.0)),
    "13b-gpipe-calibrated": _preset("gpt3-13b", gpus=24, layers=40, downstream=None, m=48, shape=ClusterShape(
        effective_tflops=150.0, memory_gib=40.0, gpus_per_node=8, intra_node_gbps=600.0, inter_node_gbps=50.0,
        layer_overhead_s=0.004, optimizer_s=0.002)),
    "8b-latency-aware-capped-floor": _preset("llama3-8b", gpus=16, layers=20, has_embed=False, downstream=5,
                                             depth_factor=2, max_in_flight=4, floor_s=0.3),
    "memory-free-twin": _preset("gpt3-6.7b", gpus=12, layers=32, memory_bound=False, downstream=0),
    "one-layer-many-gpus": _preset("gpt3-2.7b", gpus=64, layers=1, has_embed=False),
    "tiny-equal-sub-stages": BlockProblem(
        shape=ClusterShape(effective_tflops=20.0, memory_gib=2.0, gpus_per_node=2, intra_node_gbps=600.0,
                           inter_node_gbps=25.0),
        gpus=8, layers=8, has_embed=False, has_head=False, model=_TINY, micro_batch=1, seq_len=512, m=8,
        downstream=None),
    # (1, 1, 2) and (1, 2, 1) tie exactly (free links, no head, no optimizer): the first in (t, p) order wins.
    "tie": BlockProblem(
        shape=ClusterShape(effective_tflops=100.0, memory_gib=80.0, gpus_per_node=2, intra_node_gbps=math.inf,
                           inter_node_gbps=math.inf),
        gpus=2, layers=2, has_embed=False, has_head=False, model=_ODD_HEADS, micro_batch=1, seq_len=512, m=4,
        downstream=0),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_fixed_cases_match(name: str) -> None:
    _check(_CASES[name])


def _substage_layers(spec: ModelSpec, has_embed: bool, has_head: bool, pp: int, j: int, n: int) -> tuple[int, int]:
    """The model layers ``(first, last)`` sub-stage ``j`` of ``pp`` holding ``n`` layers stands for: layer 0
    when it holds the embedding, the last layers when it holds the head, else layers from 1."""
    embed = has_embed and j == 0
    head = has_head and j == pp - 1
    first = 0 if embed else (spec.layers - n if head else 1)
    return first, first + n - 1


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("model", ["llama3-70b", "llama3-8b", "gpt3-13b", "llama-tiny"])
def test_every_candidate_is_priced_as_the_cost_model_does(model: str, precision: Precision) -> None:
    """Each candidate's per-sub-stage time, memory and gradient sync (any model family, precision,
    recomputation, FSDP) equal :mod:`spiderflow.core.costmodel`'s for the same stage: the figures the planner
    optimises are the ones :func:`~spiderflow.core.costmodel.evaluate` reports."""
    spec = MODEL_PRESETS[model]
    c = Cluster(name="c", gpu="A100-80G", nodes=8, gpus_per_node=8, intra_node_gbps=600.0, inter_node_gbps=100.0,
                layer_overhead_ms=1.5, optimizer_ms_per_layer=0.5)
    shape = ClusterShape.of(c, precision)
    assert shape.effective_tflops == costmodel.compute_rate_tflops(c, precision)
    n_layers = min(spec.layers - 2, 6)  # a block that holds neither the embedding nor the head exists
    b, s, m = 2, 1024, 8
    for has_embed, has_head in ((True, False), (False, True), (False, False)):
        p = BlockProblem(shape=shape, gpus=16, layers=n_layers, has_embed=has_embed, has_head=has_head, model=spec,
                         micro_batch=b, seq_len=s, m=m, downstream=None, memory_bound=False, precision=precision)
        kinds = set()
        for k in l2.block_candidates(p):
            kinds.add((k.recompute, k.fsdp))
            layers = (n_layers - k.pp + 1,) + (1,) * (k.pp - 1)
            cfg = l2.config_cost(p, k, layers)
            for j, n in enumerate(layers):
                first, last = _substage_layers(spec, has_embed, has_head, k.pp, j, n)
                assert (first == 0, last == spec.layers - 1) == (has_embed and j == 0, has_head and j == k.pp - 1)
                sharding = Sharding.FSDP if k.fsdp else Sharding.REPLICATE
                t = costmodel.stage_compute_time(spec, c, first, last, k.tp, b, s, precision=precision,
                                                 recompute=k.recompute)
                assert cfg.compute_s[j] == pytest.approx(t, rel=1e-12), (k, j)
                mem = costmodel.stage_memory_bytes(spec, first, last, k.tp, b, s, math.ceil(m / k.dp),
                                                   precision=precision, sharding=sharding, dp=k.dp,
                                                   recompute=k.recompute)
                assert cfg.memory_gib[j] == pytest.approx(mem / costmodel.GIB, rel=1e-12), (k, j)
                st_ = Stage(cluster="c", first_layer=first, last_layer=last, tp=k.tp, dp=k.dp, sharding=sharding,
                            recompute=k.recompute)
                sync = costmodel._dp_sync_time(spec, st_, c, precision) + n * c.optimizer_ms_per_layer / 1e3
                assert cfg.allreduce_s[j] == pytest.approx(sync, rel=1e-12, abs=1e-15), (k, j)
        assert {(False, False), (True, False), (False, True), (True, True)} <= kinds


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP32])
@pytest.mark.parametrize("model", ["llama3-8b", "gpt3-13b"])
def test_measured_outer_work_is_priced_as_the_cost_model_does(model: str, precision: Precision) -> None:
    """With a profile's measured embedding, head, optimizer steps and input pipeline on the cluster, every
    candidate's sub-stage times and gradient syncs equal the closed form's (to 1e-9 relative): the head at its
    measured time instead of its FLOPs, the embedding on sub-stage 0 of an embedding block, the per-step work
    with the sync after the drain; and the exact solver and its plain-Python reference still agree."""
    spec = MODEL_PRESETS[model]
    c = Cluster(name="c", gpu="A100-80G", nodes=8, gpus_per_node=8, intra_node_gbps=600.0, inter_node_gbps=100.0,
                layer_overhead_ms=1.5, optimizer_ms_per_layer=0.5, embedding_us_per_token=0.21,
                head_us_per_token=1.7, embedding_optimizer_ms=3.5, head_optimizer_ms=4.25, data_ms_per_sample=0.6)
    shape = ClusterShape.of(c, precision)
    n_layers = min(spec.layers - 2, 6)
    b, s, m = 2, 1024, 8
    for has_embed, has_head in ((True, False), (False, True), (False, False)):
        p = BlockProblem(shape=shape, gpus=16, layers=n_layers, has_embed=has_embed, has_head=has_head, model=spec,
                         micro_batch=b, seq_len=s, m=m, downstream=None, memory_bound=False, precision=precision)
        for k in l2.block_candidates(p):
            layers = (n_layers - k.pp + 1,) + (1,) * (k.pp - 1)
            cfg = l2.config_cost(p, k, layers)
            for j, n in enumerate(layers):
                first, last = _substage_layers(spec, has_embed, has_head, k.pp, j, n)
                t = costmodel.stage_compute_time(spec, c, first, last, k.tp, b, s, precision=precision,
                                                 recompute=k.recompute)
                assert cfg.compute_s[j] == pytest.approx(t, rel=1e-9), (k, j)
                sharding = Sharding.FSDP if k.fsdp else Sharding.REPLICATE
                st_ = Stage(cluster="c", first_layer=first, last_layer=last, tp=k.tp, dp=k.dp, sharding=sharding,
                            recompute=k.recompute)
                sync = (costmodel._dp_sync_time(spec, st_, c, precision) + n * c.optimizer_ms_per_layer / 1e3
                        + costmodel.measured_step_extra(spec, c, first, last, b * math.ceil(m / k.dp)))
                assert cfg.allreduce_s[j] == pytest.approx(sync, rel=1e-9, abs=1e-15), (k, j)
        _check(replace(p, memory_bound=True))


def test_a_tie_keeps_the_first_candidate() -> None:
    p = _CASES["tie"]
    cfg = l2.solve_block_exact(p)
    assert cfg is not None and (cfg.tp, cfg.pp, cfg.dp) == (1, 1, 2)
    k = Degrees(tp=1, pp=2, dp=1)
    other = ref._best_split(p, k, ref._coeffs(p, k), math.inf)
    assert other is not None and other.objective_s == cfg.objective_s


def test_fixed_cases_cover_every_outcome() -> None:
    """The fixed cases hold an infeasible block, a one-sub-stage optimum and a many-sub-stage one."""
    got: list[BlockConfig | None] = [l2.solve_block_exact(p) for p in _CASES.values()]
    assert any(c is None for c in got)
    assert any(c is not None and c.pp == 1 for c in got)
    assert any(c is not None and c.pp > 2 for c in got)
