"""SpinSearch's search memo: a search that ends before its deadline is reused, by calls with or without a
deadline; a search cut short is not; entries go with their topology."""

from __future__ import annotations

import gc
import math
import time

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec, Plan
from spiderflow.core.placement import spinsearch
from spiderflow.core.placement.spinsearch import search_chains
from spiderflow.core.topogen import generate_topology


def _job() -> JobSpec:
    return JobSpec(id="j", model=model_preset("gpt3-6.7b"), global_batch=64, seq_len=2048, steps=10,
                   gpus=GpuRange(min=16, max=48))


def _keys_on(bw: object) -> int:
    return sum(1 for k in spinsearch._SEARCH_CACHE if k[0] == id(bw))


def test_a_completed_search_is_reused_with_a_deadline_and_a_cut_short_one_is_not() -> None:
    topo = generate_topology(12, 7, "geo")
    job = _job()
    _, cut_stats = search_chains(topo, job, deadline=time.perf_counter() - 1.0)  # expired: cut short
    assert cut_stats.get("deadline_hit") == 1.0
    assert _keys_on(topo.bandwidth_matrix) == 0
    full, stats = search_chains(topo, job, deadline=time.perf_counter() + 600.0)
    assert "deadline_hit" not in stats and full
    assert _keys_on(topo.bandwidth_matrix) == 1
    # Reused: even an expired deadline now returns the completed search, equal to a search without one.
    again, again_stats = search_chains(topo, job, deadline=time.perf_counter() - 1.0)
    assert again == full and again_stats == stats
    spinsearch._SEARCH_CACHE.clear()
    fresh, _ = search_chains(topo, job)
    assert fresh == full
    assert [c.score for c in fresh] == [c.score for c in full] and all(math.isfinite(c.score) for c in full)


def test_the_memo_forgets_a_topology_that_is_gone() -> None:
    topo = generate_topology(10, 3, "geo")
    mid = id(topo.bandwidth_matrix)  # computed now: the snapshot below shares it
    search_chains(topo.with_free({c.name: c.free // 2 for c in topo.clusters}), _job())
    search_chains(topo, _job())
    assert sum(1 for k in spinsearch._SEARCH_CACHE if k[0] == mid) == 2
    del topo
    gc.collect()
    assert not any(k[0] == mid for k in spinsearch._SEARCH_CACHE)
    assert mid not in spinsearch._SEARCH_MATRICES


def test_clear_memos_forgets_searches_plans_and_solves_and_the_decision_is_recomputed_the_same() -> None:
    from spiderflow.core.placement import clear_memos
    from spiderflow.core.placement.common import plan_cache_stats
    from spiderflow.core.placement.spinsearch import SpinSearch
    from spiderflow.core.tpa import level2, timeline

    topo = generate_topology(12, 7, "geo")
    policy = SpinSearch()
    first = policy.place(topo, _job())
    assert first.plan is not None
    assert spinsearch._SEARCH_CACHE and plan_cache_stats()["size"] > 0 and level2._EXACT._answers
    assert timeline._simulate_memo.cache_info().currsize > 0
    clear_memos()
    assert not spinsearch._SEARCH_CACHE and plan_cache_stats()["size"] == 0 and not level2._EXACT._answers
    assert timeline._simulate_memo.cache_info().currsize == 0
    again = policy.place(topo, _job())
    assert again.plan is not None and again.reason == first.reason

    def timeless(plan: object) -> object:  # the plan without its measured planning time
        from dataclasses import replace

        assert isinstance(plan, Plan)
        return replace(plan, extras={k: v for k, v in plan.extras.items() if k != "plan_seconds"})

    assert timeless(again.plan) == timeless(first.plan)
    assert spinsearch._SEARCH_CACHE  # computed afresh and remembered again
