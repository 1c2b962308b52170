"""The planner's shortcuts change no result: the re-solve pass reusing the first pass's per-schedule verdicts,
contexts that change schedule without re-deriving their cluster shapes, re-solves that do not price the memory
of splits they drop, level 2's cache testing a reused configuration's memory first and keying its families by
a field tuple, and the chosen candidate not evaluated twice. Each is compared with the plain formulation it
replaces, on generated chains (memory-bound ones included) and generated problems."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import model_preset
from spiderflow.core.costmodel import evaluate
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Plan, Schedule, Topology
from spiderflow.core.errors import SpiderFlowError
from spiderflow.core.tpa import level1 as l1
from spiderflow.core.tpa import level2 as l2
from spiderflow.core.tpa import planner
from spiderflow.core.tpa.level1 import ChainContext, evaluate_split
from spiderflow.core.tpa.level2 import BlockConfig, BlockProblem, config_cost
from spiderflow.core.tpa.timeline import evaluate_on_timeline

from .test_level2_kernel import problems

_TYPES = ["T4", "V100-16G", "V100-32G", "A100-40G", "RTX4090", "A10G", "H100-80G", "L4"]
_MODELS = ["gpt3-1.3b", "gpt3-6.7b", "gpt3-13b", "llama3-70b"]


def _chains(seeds: range) -> Iterator[tuple[Topology, JobSpec, list[tuple[str, int]]]]:
    """A chain of 1–3 catalogue clusters (1–64 free GPUs each, small-memory GPUs included, so that many chains
    are memory-bound and need re-solves) and a catalogue model."""
    for seed in seeds:
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 4))
        clusters = tuple(Cluster(name=f"c{i}", gpu=str(rng.choice(_TYPES)), nodes=8, gpus_per_node=8,
                                 free_gpus=int(rng.integers(8, 65))) for i in range(n))
        links = tuple(Link(a=f"c{i}", b=f"c{i + 1}", bandwidth_gbps=float(rng.uniform(1, 100)),
                           latency_ms=float(rng.uniform(1, 80))) for i in range(n - 1))
        topo = Topology(clusters=clusters, links=links)
        gb = int(rng.choice([64, 256]))
        job = JobSpec(id=f"j{seed}", model=model_preset(str(rng.choice(_MODELS))), global_batch=gb, micro_batch=1,
                      seq_len=2048, gpus=GpuRange(min=1, max=512))
        yield topo, job, [(c.name, c.free) for c in clusters]


def _without_timing(plan: Plan) -> Plan:
    return replace(plan, extras={k: v for k, v in plan.extras.items() if k != "plan_seconds"})


def _plain_schedule_plans(*args: Any, pending: Any = None, **kwargs: Any) -> Any:
    """The pass as it ran before: nothing carried from the first pass to the re-solve pass, every re-solve's
    infeasible blocks priced."""
    del pending
    real = l1.evaluate_split

    def priced(*a: Any, explain: bool = True, **k: Any) -> Any:
        del explain
        return real(*a, **k)

    planner.evaluate_split = priced  # type: ignore[assignment]
    try:
        return _REAL_SCHEDULE_PLANS(*args, **kwargs)
    finally:
        planner.evaluate_split = real


_REAL_SCHEDULE_PLANS = planner._schedule_plans


@pytest.mark.parametrize("cap", [None, 2])
def test_plan_chain_plans_what_the_plain_passes_plan(monkeypatch: pytest.MonkeyPatch, cap: int | None) -> None:
    """On 24 generated chains (fresh level-2 caches each time, so both start from the same state): the same
    plan, or the same error, with and without the shortcuts, also under an in-flight cap; the chains include
    counts whose schedules need a re-solve."""
    resolves = 0
    real_split = l1.evaluate_split

    def counting(*a: Any, **k: Any) -> Any:
        nonlocal resolves
        resolves += "solver" in k
        return real_split(*a, **k)

    for topo, job, alloc in _chains(range(24)):
        outcomes = []
        for plain in (False, True):
            l2.cache_clear()
            with monkeypatch.context() as mp:
                if plain:
                    mp.setattr(planner, "_schedule_plans", _plain_schedule_plans)
                else:
                    mp.setattr(planner, "evaluate_split", counting)
                try:
                    outcomes.append(_without_timing(planner.plan_chain(topo, job, alloc, max_in_flight=cap)))
                except SpiderFlowError as e:  # the same error either way
                    outcomes.append(repr(e))
        assert outcomes[0] == outcomes[1], job.id
    assert resolves >= 3  # the re-solve path is exercised (4 under the cap of two, more without)


def test_context_with_options_is_replace() -> None:
    """``with_options`` gives the context ``dataclasses.replace`` gives, shapes included."""
    for topo, job, alloc in _chains(range(8)):
        clusters = [topo.cluster(n) for n, _ in alloc]
        ctx = ChainContext.build(topo, clusters, [g for _, g in alloc], job.model, micro_batch=4, seq_len=2048,
                                 m=job.global_batch // 4, schedule=Schedule.ONE_F_ONE_B)
        for changes in ({"schedule": Schedule.GPIPE}, {"schedule": Schedule.LATENCY_AWARE},
                        {"recompute": False, "fsdp": False}, {"fsdp": False}):
            ours = ctx.with_options(**changes)  # type: ignore[arg-type]
            theirs = replace(ctx, **changes)  # type: ignore[arg-type]
            assert ours == theirs
            assert all(getattr(ours, f.name) == getattr(theirs, f.name) for f in fields(ChainContext))


def test_unexplained_splits_solve_the_same_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``evaluate_split(explain=False)`` asks level 2 the same questions in the same order and returns the same
    configurations, feasibility and step; only an infeasible block's need is left unpriced."""
    seen = 0
    for topo, job, alloc in _chains(range(30)):
        clusters = [topo.cluster(n) for n, _ in alloc]
        for m in planner.micro_batch_candidates(job.global_batch, len(clusters)):
            for sched in (Schedule.GPIPE, Schedule.LATENCY_AWARE):
                ctx = ChainContext.build(topo, clusters, [g for _, g in alloc], job.model,
                                         micro_batch=job.global_batch // m, seq_len=2048, m=m, schedule=sched)
                split = l1.proportional_split(job.model.layers, [float(g) for _, g in alloc])
                asked: list[list[BlockProblem]] = [[], []]
                for i, explain in enumerate((True, False)):
                    l2.cache_clear()

                    def recording(p: BlockProblem, into: list[BlockProblem] = asked[i]) -> BlockConfig | None:
                        into.append(p)
                        return l2._EXACT(p)

                    monkeypatch.setattr(l1, "block_bound_cached", recording)
                    ev = evaluate_split(ctx, split, explain=explain)
                    if explain:
                        full = ev
                assert asked[0] == asked[1]
                assert (ev.configs, ev.step_s, ev.feasible) == (full.configs, full.step_s, full.feasible)
                seen += not ev.feasible
    assert seen >= 5


class _ReferenceCached(l2._Cached):
    """:class:`~spiderflow.core.tpa.level2._Cached` as first written: families keyed by the problem with
    ``downstream = −1``, reused configurations fully costed, then tested for memory."""

    def _family(self, p: BlockProblem, solve: Any) -> BlockConfig | None:
        solved = self._ref.setdefault(replace(p, downstream=-1), [])
        for d, prev in solved:
            if prev is None or p.downstream is None or d is None or d > p.downstream:
                continue
            cfg = config_cost(p, prev.degrees, prev.layers)
            if max(cfg.memory_gib) <= p.shape.memory_gib:
                return cfg
        out: BlockConfig | None = solve()
        solved.append((p.downstream, out))
        return out

    def _compute(self, p: BlockProblem) -> BlockConfig | None:
        free = self._solve(replace(p, downstream=0, depth_factor=1, memory_bound=False, max_in_flight=None))
        if free is None:
            return None
        cfg = config_cost(p, free.degrees, free.layers)
        if max(cfg.memory_gib) <= p.shape.memory_gib:
            return cfg
        return self._family(p, lambda: self._solve(p))

    def __init__(self) -> None:
        super().__init__(l2.solve_block_exact)
        self._ref: dict[BlockProblem, list[tuple[int | None, BlockConfig | None]]] = {}


@settings(max_examples=40, deadline=None)
@given(p=problems(), data=st.data())
def test_the_caches_answer_as_first_written(p: BlockProblem, data: st.DataObject) -> None:
    """A problem and its other in-flight depths and memory sizes, asked in a drawn order of a fresh exact
    cache, of the memoised solver's cache and of the cache as first written: the same answer to every
    question (the family reuse fires: deeper blocks of a family fit a shallower one's optimum)."""
    variants = [p, replace(p, downstream=None)]
    variants += [replace(p, downstream=(p.downstream or 0) + k) for k in (1, 3, 7)]
    for gib in (16.0, 40.0, 80.0):
        variants += [replace(q, shape=replace(q.shape, memory_gib=gib), memory_bound=True) for q in variants[:3]]
    order = data.draw(st.permutations(variants))
    exact, plain, ref = l2._ExactCached(), l2._Cached(l2.solve_block_exact), _ReferenceCached()
    for q in order + order:
        want = ref(q)
        assert exact(q) == want
        assert plain(q) == want


def test_an_evaluated_candidate_is_not_evaluated_again() -> None:
    """``evaluate_on_timeline(evaluated=True)`` of an evaluated plan equals the plan evaluated once more."""
    for topo, job, alloc in _chains(range(6)):
        try:
            plan = planner.plan_chain(topo, job, alloc)
        except SpiderFlowError:  # an unschedulable chain has no plan to check
            continue
        ev = evaluate(plan, topo, job)
        step = plan.step_time_s
        assert evaluate_on_timeline(ev, topo, job, step_s=step, evaluated=True) == evaluate_on_timeline(
            ev, topo, job, step_s=step)
