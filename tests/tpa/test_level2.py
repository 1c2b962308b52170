"""Level 2 (CP-SAT per cluster) against exhaustive enumeration and the exact solver, memory feasibility,
symmetry breaking, caching, mapping."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.tpa.level2 import (
    STATS,
    BlockConfig,
    BlockProblem,
    ClusterShape,
    block_bound_cached,
    block_candidates,
    brute_force_block,
    cache_clear,
    config_cost,
    gpu_mapping,
    memory_caps,
    solve_block,
    solve_block_cached,
    solve_block_exact,
    symmetric_pairs,
)

from .bruteforce import compositions


def _problem(rng: np.random.Generator) -> BlockProblem:
    layers = int(rng.integers(1, 9))
    model = ModelSpec(name="t", layers=layers + int(rng.integers(0, 3)), hidden=int(rng.choice([512, 1024, 2048])),
                      heads=8, vocab=8192)
    has_embed = bool(rng.integers(2))
    return BlockProblem(
        shape=ClusterShape(
            effective_tflops=float(rng.choice([20.0, 120.0, 400.0])),
            memory_gib=float(rng.choice([1.0, 2.0, 4.0, 16.0])),
            gpus_per_node=int(rng.choice([2, 4, 8])),
            intra_node_gbps=600.0,
            inter_node_gbps=float(rng.choice([25.0, 100.0])),
        ),
        gpus=int(rng.integers(1, 9)),
        layers=layers,
        has_embed=has_embed,
        has_head=(not has_embed and model.layers == layers) or bool(rng.integers(2)),
        model=model,
        micro_batch=int(rng.choice([1, 2, 4])),
        seq_len=int(rng.choice([512, 1024, 2048])),
        m=int(rng.choice([1, 2, 4, 8])),
        downstream=None if rng.integers(4) == 0 else int(rng.integers(0, 4)),
        depth_factor=int(rng.choice([1, 2])),
    )


def _medium(rng: np.random.Generator) -> BlockProblem:
    """Blocks too large for exhaustive enumeration (up to 32 layers, 16 GPUs), memory often binding."""
    layers = int(rng.integers(4, 33))
    model = ModelSpec(name="t", layers=layers + int(rng.integers(0, 8)), hidden=int(rng.choice([1024, 2048, 4096])),
                      heads=16, vocab=32000)
    has_embed = bool(rng.integers(2))
    return BlockProblem(
        shape=ClusterShape(
            effective_tflops=float(rng.choice([20.0, 120.0, 400.0])),
            memory_gib=float(rng.choice([4.0, 8.0, 16.0, 24.0, 40.0, 80.0])),
            gpus_per_node=int(rng.choice([2, 4, 8])),
            intra_node_gbps=600.0,
            inter_node_gbps=float(rng.choice([25.0, 100.0])),
        ),
        gpus=int(rng.choice([1, 2, 4, 6, 8, 12, 16])),
        layers=layers,
        has_embed=has_embed,
        has_head=(not has_embed and model.layers == layers) or bool(rng.integers(2)),
        model=model,
        micro_batch=int(rng.choice([1, 2, 4])),
        seq_len=int(rng.choice([1024, 2048])),
        m=int(rng.choice([4, 8, 16, 32, 64])),
        downstream=None if rng.integers(6) == 0 else int(rng.integers(0, 12)),
        depth_factor=int(rng.choice([1, 2])),
        floor_s=0.0 if rng.integers(3) else float(rng.uniform(0.0, 0.5)),
    )


def _same_optimum(got: BlockConfig | None, ref: BlockConfig | None, p: BlockProblem) -> None:
    assert (got is None) == (ref is None)
    if got is not None and ref is not None:
        assert got.objective_s == pytest.approx(ref.objective_s, rel=1e-9, abs=1e-12)
        assert sum(got.layers) == p.layers and got.tp * got.pp * got.dp == p.gpus
        assert min(got.layers) >= 1
        assert max(got.memory_gib) <= p.shape.memory_gib


@pytest.mark.parametrize("seed", range(200))
def test_cpsat_matches_exhaustive_enumeration(seed: int) -> None:
    """The CP-SAT model (no hint) reaches the enumerated optimum, and infeasibility agrees."""
    p = _problem(np.random.default_rng(seed))
    _same_optimum(solve_block(p), brute_force_block(p), p)


@pytest.mark.parametrize("seed", range(120))
def test_cpsat_matches_the_exact_solver_on_larger_blocks(seed: int) -> None:
    p = _medium(np.random.default_rng(5000 + seed))
    exact = solve_block_exact(p)
    _same_optimum(solve_block(p), exact, p)
    _same_optimum(solve_block(p, hint=exact), exact, p)


def test_middle_sub_stages_are_not_interchangeable() -> None:
    """Regression: the former symmetry constraint ``ℓ_1 ≥ … ≥ ℓ_{p−2}`` cut off the only optimum here (the
    later middle sub-stages hold fewer micro-batches in flight, so only they can take the extra layers)."""
    p = _problem(np.random.default_rng(504))
    ref = brute_force_block(p)
    assert ref is not None and ref.pp >= 4
    middle = ref.layers[1:-1]
    assert list(middle) != sorted(middle, reverse=True)  # the optimum violates the old ordering
    _same_optimum(solve_block(p), ref, p)


@pytest.mark.parametrize("seed", range(80))
def test_symmetry_breaking_keeps_an_optimum(seed: int) -> None:
    """Constraint (7) is valid: the best composition that satisfies it is as good as the best overall."""
    p = _problem(np.random.default_rng(3000 + seed))
    best_all = best_ordered = math.inf
    for k in block_candidates(p):
        pairs = symmetric_pairs(p, k)
        caps = memory_caps(p, k)
        for layers in compositions(p.layers, k.pp):
            if any(n > u for n, u in zip(layers, caps, strict=True)):
                continue
            cfg = config_cost(p, k, layers)
            assert max(cfg.memory_gib) <= p.shape.memory_gib  # (4) via u is exact
            best_all = min(best_all, cfg.objective_s)
            if all(layers[j] <= layers[j + 1] for j in pairs):
                best_ordered = min(best_ordered, cfg.objective_s)
    assert best_ordered == pytest.approx(best_all, rel=1e-12)  # equal up to summation order
    ref = brute_force_block(p)
    assert (ref is None) == math.isinf(best_all)


@pytest.mark.parametrize("seed", range(200))
def test_exact_block_solver_matches_exhaustive_enumeration(seed: int) -> None:
    """The solver the planner runs (bottleneck enumeration) finds the enumerated optimum, never worse."""
    p = _problem(np.random.default_rng(1000 + seed))
    got = solve_block_exact(p)
    ref = brute_force_block(p)
    assert (got is None) == (ref is None)
    if got is not None and ref is not None:
        assert got.objective_s == pytest.approx(ref.objective_s, rel=1e-9, abs=1e-12)
        assert sum(got.layers) == p.layers and got.tp * got.pp * got.dp == p.gpus
        assert max(got.memory_gib) <= p.shape.memory_gib


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_solved_sub_stage_fits_memory(seed: int) -> None:
    p = _problem(np.random.default_rng(seed))
    cfg = solve_block_cached(p)
    if cfg is None:
        # Then nothing fits: the reference agrees.
        assert brute_force_block(p) is None
        return
    assert max(cfg.memory_gib) <= p.shape.memory_gib
    assert all(n >= 1 for n in cfg.layers)
    assert cfg.tp * cfg.pp * cfg.dp == p.gpus


def test_cache_answers_repeated_problems_without_solving(monkeypatch: pytest.MonkeyPatch) -> None:
    cache_clear()
    p = _problem(np.random.default_rng(7))
    first = solve_block_cached(p)
    assert STATS.cpsat_solves >= 1  # the planner's path runs CP-SAT
    import spiderflow.core.tpa.level2 as l2

    def boom(*_: object, **__: object) -> None:
        raise AssertionError("solved again")

    monkeypatch.setattr(l2, "solve_block", boom)
    monkeypatch.setattr(l2, "solve_block_exact", boom)
    assert solve_block_cached(p) == first


def test_cached_path_is_cpsat_and_agrees_with_the_exact_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    import spiderflow.core.tpa.level2 as l2

    cache_clear()
    calls: list[BlockProblem] = []
    real = l2.solve_block

    def spy(p: BlockProblem, **kw: object) -> BlockConfig | None:
        calls.append(p)
        return real(p, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(l2, "solve_block", spy)
    for seed in range(40):
        p = _medium(np.random.default_rng(9000 + seed))
        _same_optimum(solve_block_cached(p), solve_block_exact(p), p)
        assert block_bound_cached(p) is None or solve_block_cached(p) is not None
    assert calls, "CP-SAT was never run"
    assert STATS.cpsat_improved_hint == 0
    # A memory-free twin with another in-flight profile reuses the solved optimum: no new solve.
    n = len(calls)
    p = _medium(np.random.default_rng(9000))
    solve_block_cached(replace(p, depth_factor=3 - p.depth_factor))
    assert len(calls) <= n + 1


def test_tensor_groups_stay_inside_a_node() -> None:
    shape = ClusterShape(effective_tflops=100.0, memory_gib=80.0, gpus_per_node=4, intra_node_gbps=600.0,
                         inter_node_gbps=100.0)
    model = ModelSpec(name="t", layers=8, hidden=4096, heads=32, vocab=32000)
    p = BlockProblem(shape=shape, gpus=16, layers=8, has_embed=True, has_head=True, model=model, micro_batch=4,
                     seq_len=2048, m=8, downstream=0)
    cfg = solve_block(p)
    assert cfg is not None
    mapping = gpu_mapping(cfg, shape.gpus_per_node)
    gpus = [g for stage in mapping for rep in stage for g in rep]
    assert len(set(gpus)) == 16  # every GPU used once
    if cfg.tp <= shape.gpus_per_node:
        for stage in mapping:
            for rep in stage:
                assert len({node for node, _ in rep}) == 1
