"""Level 2 (CP-SAT per cluster) against exhaustive enumeration, memory feasibility, caching, mapping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.catalog import ModelSpec
from spiderflow.tpa.level2 import (
    BlockProblem,
    ClusterShape,
    brute_force_block,
    cache_clear,
    gpu_mapping,
    solve_block,
    solve_block_cached,
    solve_block_exact,
)


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


@pytest.mark.parametrize("seed", range(60))
def test_cpsat_matches_exhaustive_enumeration(seed: int) -> None:
    p = _problem(np.random.default_rng(seed))
    ilp = solve_block(p)
    ref = brute_force_block(p)
    assert (ilp is None) == (ref is None)
    if ilp is not None and ref is not None:
        # Integer time units round coefficients up by < 1e-5 of the largest: the optima agree closely.
        assert ilp.objective_s == pytest.approx(ref.objective_s, rel=1e-4)
        assert sum(ilp.layers) == p.layers
        assert ilp.tp * ilp.pp * ilp.dp == p.gpus


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
    import spiderflow.tpa.level2 as l2

    def boom(*_: object, **__: object) -> None:
        raise AssertionError("solved again")

    monkeypatch.setattr(l2, "solve_block", boom)
    assert solve_block_cached(p) == first


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
