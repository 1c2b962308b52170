"""SpinSearch's search memo: a search that ends before its deadline is reused, by calls with or without a
deadline; a search cut short is not; the table belongs to the topology snapshot (shared by its
``with_free`` copies) and goes with it."""

from __future__ import annotations

import gc
import math
import time
import weakref

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec, Plan
from spiderflow.core.placement.spinsearch import search_chains
from spiderflow.core.topogen import generate_topology


def _job() -> JobSpec:
    return JobSpec(id="j", model=model_preset("gpt3-6.7b"), global_batch=64, seq_len=2048, steps=10,
                   gpus=GpuRange(min=16, max=48))


def test_a_completed_search_is_reused_with_a_deadline_and_a_cut_short_one_is_not() -> None:
    topo = generate_topology(12, 7, "geo")
    job = _job()
    _, cut_stats = search_chains(topo, job, deadline=time.perf_counter() - 1.0)  # expired: cut short
    assert cut_stats.get("deadline_hit") == 1.0
    assert len(topo.memo.searches) == 0
    full, stats = search_chains(topo, job, deadline=time.perf_counter() + 600.0)
    assert "deadline_hit" not in stats and full
    assert len(topo.memo.searches) == 1
    # Reused: even an expired deadline now returns the completed search, equal to a search without one.
    again, again_stats = search_chains(topo, job, deadline=time.perf_counter() - 1.0)
    assert again == full and again_stats == stats
    topo.memo.clear()
    fresh, _ = search_chains(topo, job)
    assert fresh == full
    assert [c.score for c in fresh] == [c.score for c in full] and all(math.isfinite(c.score) for c in full)


def test_the_memo_is_shared_by_with_free_copies_and_goes_with_the_snapshot() -> None:
    topo = generate_topology(10, 3, "geo")
    half = topo.with_free({c.name: c.free // 2 for c in topo.clusters})
    assert half.memo.searches is topo.memo.searches and half.memo.hops is topo.memo.hops
    search_chains(half, _job())
    search_chains(topo, _job())
    assert len(topo.memo.searches) == 2
    assert not len(generate_topology(10, 3, "geo").memo.searches)  # another snapshot starts empty
    gone = weakref.ref(topo.memo), weakref.ref(half.memo)
    del topo, half
    gc.collect()
    assert gone[0]() is None and gone[1]() is None


def test_clear_memos_forgets_searches_plans_and_solves_and_the_decision_is_recomputed_the_same() -> None:
    from spiderflow.core.placement import clear_memos
    from spiderflow.core.placement.common import plan_cache_stats
    from spiderflow.core.placement.spinsearch import SpinSearch

    topo = generate_topology(12, 7, "geo")
    policy = SpinSearch()
    first = policy.place(topo, _job())
    assert first.plan is not None
    assert len(topo.memo.searches) and plan_cache_stats()["size"] > 0
    clear_memos(topo)
    assert not len(topo.memo.searches) and not len(topo.memo.hops) and plan_cache_stats()["size"] == 0
    again = policy.place(topo, _job())
    assert again.plan is not None and again.reason == first.reason

    def timeless(plan: object) -> object:  # the plan without its measured planning time
        from dataclasses import replace

        assert isinstance(plan, Plan)
        return replace(plan, extras={k: v for k, v in plan.extras.items() if k != "plan_seconds"})

    assert timeless(again.plan) == timeless(first.plan)
    assert len(topo.memo.searches)  # computed afresh and remembered again
