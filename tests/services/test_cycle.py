"""The scheduling cycle's decisions on an in-memory store (pure logic; the etcd path is tested elsewhere)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import pytest

from services.scheduler.cycle import DecisionKind, SchedulingCycle
from services.scheduler.repo import JobRepository
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.cycle import WaitState
from spiderflow.core.domain import Cluster, JobSpec, Link, Plan, PlanOptions, Topology, Wait
from spiderflow.core.errors import CorruptRecordError
from spiderflow.core.placement import REGISTRY, Budget, PlacementResult, register_policy
from spiderflow.core.placement.base import Release
from spiderflow.core.placement.spinsearch import SpinSearch
from spiderflow.core.tpa import plan_chain as tpa_plan_chain
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobState
from spiderflow.store import MemoryStore, keys, records
from spiderflow.store.base import Compare, NotLeaderError


def _topo(bw_ab: float = 10.0, with_c: bool = True) -> Topology:
    clusters = [Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=8),
                Cluster(name="b", gpu="A100-80G", nodes=1, gpus_per_node=8)]
    links = [Link(a="a", b="b", bandwidth_gbps=bw_ab, latency_ms=5)]
    if with_c:
        clusters.append(Cluster(name="c", gpu="A100-80G", nodes=1, gpus_per_node=8))
        links += [Link(a="b", b="c", bandwidth_gbps=10, latency_ms=5), Link(a="a", b="c", bandwidth_gbps=10,
                                                                            latency_ms=5)]
    return Topology(clusters=tuple(clusters), links=tuple(links))


JOB = job_from_dict({"id": "big", "model": "gpt3-6.7b", "global_batch": 64, "seq_len": 2048, "steps": 100,
                     "gpus": {"min": 16, "max": 16}})


async def _placed(source: StaticTopologySource) -> tuple[JobRepository, SchedulingCycle]:
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, source, default_policy="spinsearch")
    await repo.submit(JOB, "r1")
    report = await cycle.run()
    assert report.placed == ["big"]
    return repo, cycle


async def test_cluster_loss_reschedules_and_replaces() -> None:
    source = StaticTopologySource(_topo())
    repo, cycle = await _placed(source)
    first = (await repo.get("big")).record
    assert first.state is JobState.PLACED and sum(first.allocation.values()) == 16
    lost = first.plan.chain[0] if first.plan else "a"
    source._topology = Topology(clusters=tuple(c for c in _topo().clusters if c.name != lost),
                                links=tuple(k for k in _topo().links if lost not in (k.a, k.b)))
    report = await cycle.run()
    assert report.rescheduled == ["big"]
    again = (await repo.get("big")).record
    assert again.state is JobState.PLACED and again.attempt == 2 and lost not in again.allocation
    assert any(t.to_state is JobState.RESCHEDULING and lost in t.reason for t in again.history)
    allocs, _, _ = await repo.allocations()
    assert lost not in allocs or "big" not in allocs[lost]  # GPUs on the lost cluster released


async def test_link_degradation_beyond_threshold_reschedules() -> None:
    source = StaticTopologySource(_topo(with_c=False))
    repo, cycle = await _placed(source)
    rec = (await repo.get("big")).record
    assert rec.plan is not None and set(rec.plan.chain) == {"a", "b"}
    source._topology = _topo(bw_ab=9.0, with_c=False)  # a 10 % drop: no re-placement
    assert (await cycle.run()).rescheduled == []
    source._topology = _topo(bw_ab=0.05, with_c=False)  # collapse: re-placed
    report = await cycle.run()
    assert report.rescheduled == ["big"]
    rec = (await repo.get("big")).record
    assert rec.attempt == 2 and "predicted step time grew" in next(
        t.reason for t in rec.history if t.to_state is JobState.RESCHEDULING)


async def test_unplaceable_job_stays_pending_with_reason() -> None:
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, StaticTopologySource(_topo()), default_policy="spinsearch")
    await repo.submit(replace(JOB, id="huge", gpus=replace(JOB.gpus, min=100, max=100)), "r2")
    report = await cycle.run()
    assert report.placed == []
    rec = (await repo.get("huge")).record
    assert rec.state is JobState.PENDING and "100" in rec.reason


async def test_losing_every_cluster_reschedules_and_waits() -> None:
    source = StaticTopologySource(_topo())
    repo, cycle = await _placed(source)
    source._topology = Topology(clusters=(), links=(), revision=7)
    report = await cycle.run()
    assert report.rescheduled == ["big"]
    rec = (await repo.get("big")).record
    assert rec.state is JobState.RESCHEDULING and rec.allocation == {}
    allocs, _, _ = await repo.allocations()
    assert all("big" not in a for a in allocs.values())
    source._topology = _topo()  # clusters come back: placed again
    assert (await cycle.run()).placed == ["big"]
    assert (await repo.get("big")).record.attempt == 2


def _fast_and_slow() -> Topology:
    return Topology(
        clusters=(Cluster(name="fast", gpu="H100-80G", nodes=4, gpus_per_node=8),
                  Cluster(name="slow", gpu="A100-40G", nodes=1, gpus_per_node=8)),
        links=(Link(a="fast", b="slow", bandwidth_gbps=1.0, latency_ms=50.0),),
    )


SHORT = job_from_dict({"id": "short", "model": "gpt3-1.3b", "global_batch": 64, "steps": 20,
                       "gpus": {"min": 32, "max": 32}})
LONG = job_from_dict({"id": "long", "model": "gpt3-1.3b", "global_batch": 64, "steps": 2000,
                      "gpus": {"min": 8, "max": 32}})


async def test_with_releases_a_job_waits_for_the_fast_cluster_and_then_starts_on_it() -> None:
    """``short`` holds all 32 fast GPUs for a few minutes. ``long`` could start now on the 8 slow GPUs, but
    finishes much sooner on the fast ones: it waits (PENDING, the policy's reason), is not decided again
    before its time, and starts on the fast cluster once ``short`` has given it back. Without
    ``wait_for_releases`` it starts on the slow cluster at once."""
    clock = [1000.0]
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, StaticTopologySource(_fast_and_slow()), wait_for_releases=True,
                            clock=lambda: clock[0])
    await repo.submit(SHORT, "r-short")
    assert (await cycle.run()).placed == ["short"]
    short = (await repo.get("short")).record
    assert short.allocation == {"fast": 32} and short.plan is not None
    await repo.submit(LONG, "r-long")
    first = (await cycle.run()).decisions
    assert [(d.job_id, d.kind) for d in first] == [("long", DecisionKind.DEFERRED)]
    rec = (await repo.get("long")).record
    assert rec.state is JobState.PENDING and rec.reason.startswith("waiting") and rec.allocation == {}
    again = (await cycle.run()).decisions  # before its time: no new decision, the same reason
    assert again[0].kind is DecisionKind.DEFERRED and again[0].reason == first[0].reason
    assert again[0].seconds == 0.0
    # ``short`` ends; ``long``'s time comes: it starts on the fast cluster.
    stored = await repo.get("short")
    await repo.release(stored, short.to(JobState.SUCCEEDED, "done", now=clock[0]))
    clock[0] += 1e6
    assert (await cycle.run()).placed == ["long"]
    rec = (await repo.get("long")).record
    assert rec.state is JobState.PLACED and set(rec.allocation) == {"fast"}

    plain_repo = JobRepository(MemoryStore())
    plain = SchedulingCycle(plain_repo, StaticTopologySource(_fast_and_slow()), clock=lambda: 1000.0)
    await plain_repo.submit(SHORT, "r-short")
    await plain.run()
    await plain_repo.submit(LONG, "r-long")
    assert (await plain.run()).placed == ["long"]
    assert (await plain_repo.get("long")).record.allocation == {"slow": 8}


async def test_a_wait_ends_early_when_the_claimed_gpus_are_free_and_the_leader_knows_when_it_is_due() -> None:
    """``short`` ends long before its estimate: the GPUs ``long`` waits for are free, so the next cycle
    decides ``long`` again at once (the clock has not moved) and starts it on the fast cluster.
    ``next_wait_end`` is the wait's end while it lasts (the leader runs a cycle then) and ``None`` after."""
    clock = [1000.0]
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, StaticTopologySource(_fast_and_slow()), wait_for_releases=True,
                            clock=lambda: clock[0])
    assert cycle.next_wait_end() is None
    await repo.submit(SHORT, "r-short")
    await cycle.run()
    short = (await repo.get("short")).record
    assert short.plan is not None
    await repo.submit(LONG, "r-long")
    assert [d.kind for d in (await cycle.run()).decisions] == [DecisionKind.DEFERRED]
    due = cycle.next_wait_end()
    assert due is not None and due == pytest.approx(clock[0] + SHORT.steps * short.plan.step_time_s, rel=1e-6)
    await repo.release(await repo.get("short"), short.to(JobState.SUCCEEDED, "done", now=clock[0]))
    assert (await cycle.run()).placed == ["long"]
    assert set((await repo.get("long")).record.allocation) == {"fast"}
    assert cycle.next_wait_end() is None


async def test_a_running_job_without_progress_reports_is_expected_back_at_a_fixed_time() -> None:
    """Before its first progress report a job's GPUs are expected back at its placement time plus all its
    steps: a later decision sees the same release, sooner by the time that passed."""
    if "test-recording" not in REGISTRY:
        register_policy("test-recording", _Recording)
    clock = [1000.0]
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, StaticTopologySource(_fast_and_slow()), wait_for_releases=True,
                            clock=lambda: clock[0], default_policy="test-recording")
    await repo.submit(SHORT, "r-short")
    await cycle.run()
    short = (await repo.get("short")).record
    assert short.plan is not None
    end = 1000.0 + SHORT.steps * short.plan.step_time_s
    clock[0] += 1.0
    await repo.submit(replace(LONG, id="l1"), "r-l1")
    await cycle.run()
    clock[0] += 1.0
    await repo.submit(replace(LONG, id="l2"), "r-l2")
    await cycle.run()
    assert _Recording.seen["l1"][0].after_s == pytest.approx(end - 1001.0)
    assert _Recording.seen["l2"][0].after_s == pytest.approx(end - 1002.0)


class _Recording:
    """SpinSearch that records the releases each job was told about."""

    name = "spinsearch"
    seen: ClassVar[dict[str, tuple[Release, ...]]] = {}

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget or Budget()
        self.seen[job.id] = budget.releases
        return SpinSearch().place(topo, job, budget)

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        return SpinSearch().price_wait(topo, job, now, budget)


async def test_a_waiting_jobs_claim_is_in_the_next_jobs_releases_and_a_lost_cluster_ends_the_wait() -> None:
    if "test-recording" not in REGISTRY:
        register_policy("test-recording", _Recording)
    clock = [1000.0]
    source = StaticTopologySource(_fast_and_slow())
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, source, wait_for_releases=True, clock=lambda: clock[0],
                            default_policy="test-recording")
    await repo.submit(SHORT, "r-short")
    await cycle.run()
    short = (await repo.get("short")).record
    assert short.plan is not None
    end = SHORT.steps * short.plan.step_time_s
    await repo.submit(LONG, "r-long")
    await cycle.run()
    seen = _Recording.seen["long"]
    assert len(seen) == 1 and seen[0].gpus == (("fast", 32),) and seen[0].after_s == pytest.approx(end)
    await repo.submit(replace(LONG, id="long2"), "r-long2")
    await cycle.run()
    told = _Recording.seen["long2"]
    # short's GPUs come back at its end, long takes them then and gives them back at its own end.
    assert [r.gpus for r in told] == [(("fast", 32),), (("fast", -32),), (("fast", 32),)]
    assert told[0].after_s == pytest.approx(end) and told[1].after_s == pytest.approx(end)
    assert told[2].after_s > told[1].after_s
    # The fast cluster leaves the graph: the wait ends and ``long`` is decided again (on what is left).
    source._topology = Topology(clusters=(_fast_and_slow().clusters[1],), links=())
    report = await cycle.run()
    assert "long" in report.placed or "long2" in report.placed
    assert any(d.job_id == "long" and d.seconds > 0 for d in report.decisions)


def _three_regions() -> Topology:
    return Topology(
        clusters=(Cluster(name="ohio", gpu="A100-80G", nodes=2, gpus_per_node=8),
                  Cluster(name="tokyo", gpu="H100-80G", nodes=1, gpus_per_node=8),
                  Cluster(name="paris", gpu="V100-32G", nodes=2, gpus_per_node=4)),
        links=(Link(a="ohio", b="tokyo", bandwidth_gbps=10, latency_ms=60),
               Link(a="tokyo", b="paris", bandwidth_gbps=5, latency_ms=80)),
    )


BIG = job_from_dict({"id": "big", "model": "gpt3-6.7b", "global_batch": 64, "steps": 100,
                     "gpus": {"min": 8, "max": 32}})


class _Planner:
    """Stands in for the Planner service (a :class:`~spiderflow.core.placement.base.Planner`): TPA in process on
    the allocation it is given (the service runs the same function), optionally made worse; records what
    it was asked."""

    name = "test"

    def __init__(self, *, worse: bool = False) -> None:
        self.worse = worse
        self.asked: list[list[tuple[str, int]]] = []

    def plan(self, topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], options: PlanOptions) -> Plan:
        self.asked.append(list(allocation))
        final = tpa_plan_chain(topo, job, allocation, objective=options.objective)
        return replace(final, step_time_s=final.step_time_s * 10, extras={"worse": 1.0}) if self.worse else final


@pytest.mark.parametrize("policy", ["spinsearch", "bace"])
async def test_with_a_planner_service_the_policy_chooses_the_chain_and_the_better_plan_is_kept(policy: str) -> None:
    """SpinSearch and ``bace`` choose with their level-1 plans and ask their planner (the Planner service)
    for plans of exactly the allocations they chose: ``bace`` for its one chain, SpinSearch for its best
    allocations by their level-1 plans, the favourite first. The planner's plan is kept when it is no
    worse, else the level-1 plan is (a worse answer never replaces it)."""
    for worse in (False, True):
        repo = JobRepository(MemoryStore())
        planner = _Planner(worse=worse)
        cycle = SchedulingCycle(repo, StaticTopologySource(_three_regions()), planner=planner, default_policy=policy)
        await repo.submit(BIG, "r-big")
        assert (await cycle.run()).placed == ["big"]
        assert len(planner.asked) == 1 if policy == "bace" else len(planner.asked) >= 1
        plan = (await repo.get("big")).record.plan
        assert plan is not None
        if worse:  # the level-1 plan of the allocation asked first
            assert plan.gpus_by_cluster() == dict(planner.asked[0])
        else:
            assert plan.gpus_by_cluster() in [dict(a) for a in planner.asked]
        # Every plan is re-scored on the exact timeline (timeline_step_s); only TPA's says its micro-batch size.
        assert plan.extras["timeline_step_s"] == plan.step_time_s
        if worse:
            assert "worse" not in plan.extras and "micro_batch_size" not in plan.extras  # the level-1 plan
        else:
            assert "micro_batch_size" in plan.extras


async def test_with_a_planner_service_the_other_baselines_keep_their_own_plans() -> None:
    """``firstfit`` (like ``ilp`` and ``genetic``) plans as its paper does; the Planner service is not asked."""
    repo = JobRepository(MemoryStore())
    planner = _Planner()
    cycle = SchedulingCycle(repo, StaticTopologySource(_three_regions()), planner=planner, default_policy="firstfit")
    await repo.submit(BIG, "r-big")
    assert (await cycle.run()).placed == ["big"]
    assert planner.asked == []


async def test_a_new_leader_adopts_the_recorded_waits_and_a_bind_removes_them() -> None:
    """A wait is recorded at ``waits/<job>``. Another scheduler on the same store (a new leader) adopts it:
    ``long`` is not decided again before its time (same reason, no decision time) and the wait's end is
    known; once ``long`` is bound the record is gone. A malformed record and the wait of a job that is no
    longer queued are deleted by the new leader's first cycle."""
    clock = [1000.0]
    store = MemoryStore()
    repo = JobRepository(store)
    old = SchedulingCycle(repo, StaticTopologySource(_fast_and_slow()), wait_for_releases=True,
                          clock=lambda: clock[0])
    await repo.submit(SHORT, "r-short")
    await old.run()
    await repo.submit(LONG, "r-long")
    first = (await old.run()).decisions
    assert [d.kind for d in first] == [DecisionKind.DEFERRED]
    recorded = await repo.waits()
    long_wait = recorded["long"]
    assert set(recorded) == {"long"} and long_wait is not None and long_wait.until == old.next_wait_end()
    assert long_wait.claim == (("fast", 32),) and long_wait.reason == first[0].reason
    await store.put(keys.wait_key("ghost"), b'{"until": 1}')  # malformed: no claim
    await store.put(keys.wait_key("gone"), records.encode(replace(long_wait, reason="x")))

    new_repo = JobRepository(store)
    new = SchedulingCycle(new_repo, StaticTopologySource(_fast_and_slow()), wait_for_releases=True,
                          clock=lambda: clock[0])
    again = (await new.run()).decisions
    assert [(d.job_id, d.kind, d.reason, d.seconds) for d in again] == [
        ("long", DecisionKind.DEFERRED, first[0].reason, 0.0)]
    assert new.next_wait_end() == old.next_wait_end()
    assert set(await new_repo.waits()) == {"long"}
    short = (await new_repo.get("short")).record
    await new_repo.release(await new_repo.get("short"), short.to(JobState.SUCCEEDED, "done", now=clock[0]))
    clock[0] += 1e6
    assert (await new.run()).placed == ["long"]
    assert await new_repo.waits() == {}
    assert new.next_wait_end() is None


def test_a_wait_record_round_trips_and_mistyped_fields_are_rejected() -> None:
    w = WaitState(until=12.5, gpus=32, claim=(("fast", 32),), run_s=600.0, reason="waiting")
    key = keys.wait_key("j")
    assert records.decode(key, records.encode(w)) == w
    doc = json.loads(records.encode(w))
    for bad, field in (({"until": "soon"}, "until"), ({"until": math.inf}, "until"), ({"gpus": True}, "gpus"),
                       ({"gpus": 1.5}, "gpus"), ({"claim": [["fast"]]}, "claim[0]"), ({"claim": 3}, "claim"),
                       ({"reason": None}, "reason"), ({"run_s": math.nan}, "run_s")):
        with pytest.raises(CorruptRecordError) as e:
            records.decode(key, json.dumps({**doc, **bad}).encode())
        assert (e.value.key, e.value.field) == (key, field), bad
    with pytest.raises(CorruptRecordError, match="run_s: is required"):
        records.decode(key, json.dumps({k: v for k, v in doc.items() if k != "run_s"}).encode())


async def test_a_bind_deletes_a_wait_record_and_a_scheduler_that_does_not_wait_drops_them() -> None:
    """A wait record the leader does not know of (written after it adopted the records) is deleted by the
    transaction that binds the job; a scheduler without ``wait_for_releases`` deletes the records it finds."""
    store = MemoryStore()
    repo = JobRepository(store)
    cycle = SchedulingCycle(repo, StaticTopologySource(_topo()), wait_for_releases=True)
    await cycle.run()  # adopts (no records yet)
    await repo.submit(JOB, "r1")
    stale = WaitState(until=1.0, gpus=16, claim=(("a", 8), ("b", 8)), run_s=1.0, reason="waiting")
    await repo.put_wait("big", stale)
    assert (await cycle.run()).placed == ["big"]
    assert await repo.waits() == {}

    await repo.put_wait("big", stale)
    plain = SchedulingCycle(JobRepository(store), StaticTopologySource(_topo()))
    await plain.run()
    assert await repo.waits() == {} and plain.next_wait_end() is None


async def test_a_deposed_leader_records_no_wait_and_a_leader_does() -> None:
    """Wait records are written in transactions that compare the term's election key: while the key holds
    the wait is recorded; once the lease behind it is gone (a successor may have adopted the records), the
    cycle ends with NotLeaderError and writes nothing."""
    for deposed in (False, True):
        clock = [1000.0]
        store = MemoryStore()
        repo = JobRepository(store)
        lease = await store.grant(30)
        leadership = await store.campaign(keys.election_name(keys.SCHEDULER), b"old", lease)
        held = await store.get(leadership.key)
        assert held is not None
        cycle = SchedulingCycle(repo, StaticTopologySource(_fast_and_slow()), wait_for_releases=True,
                                clock=lambda c=clock: c[0])  # type: ignore[misc]
        cycle.new_term(Compare(key=leadership.key, mod_revision=held.mod_revision))
        await repo.submit(SHORT, "r-short")
        await cycle.run()
        await repo.submit(LONG, "r-long")
        if not deposed:
            assert [d.kind for d in (await cycle.run()).decisions] == [DecisionKind.DEFERRED]
            assert set(await repo.waits()) == {"long"}
            continue
        await lease.revoke()
        with pytest.raises(NotLeaderError, match="the wait of long was not recorded"):
            await cycle.run()
        assert await repo.waits() == {}


@pytest.mark.parametrize("level2", ["exact", "cpsat"])
async def test_the_cycles_level2_solver_reaches_the_policy_that_plans_in_process(level2: str) -> None:
    import spiderflow.core.tpa.level2 as l2
    from spiderflow.core.placement.common import plan_cache_clear

    plan_cache_clear()
    l2.cache_clear()
    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, StaticTopologySource(_topo()), default_policy="spinsearch",
                            level2=level2)  # type: ignore[arg-type]
    await repo.submit(JOB, "r1")
    assert (await cycle.run()).placed == ["big"]
    assert (l2.STATS.cpsat_solves > 0) is (level2 == "cpsat")


def test_search_options_reach_the_policies_the_scheduler_builds() -> None:
    from spiderflow.core.placement.options import SearchOptions

    source = StaticTopologySource(_topo())
    priced = SchedulingCycle(JobRepository(MemoryStore()), source, search_options=SearchOptions(gpu_price=2.0))
    plain = SchedulingCycle(JobRepository(MemoryStore()), source)
    built = priced.build_policy("spinsearch")
    assert isinstance(built, SpinSearch) and built.gpu_price == 2.0
    default = plain.build_policy("spinsearch")
    assert isinstance(default, SpinSearch) and default.gpu_price == 0.0


async def test_the_scheduler_passes_the_arrivals_outlook_to_a_policy_that_looks_ahead() -> None:
    from spiderflow.core.placement.options import SearchOptions

    repo = JobRepository(MemoryStore())
    cycle = SchedulingCycle(repo, StaticTopologySource(_topo()), default_policy="spinsearch",
                            search_options=SearchOptions(lookahead=True))
    budgets: list[Budget] = []
    build = cycle.build_policy

    def recording(name: str) -> SpinSearch:
        pol = build(name)
        assert isinstance(pol, SpinSearch) and pol.lookahead
        place = pol.place

        def spy(topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
            budgets.append(budget or Budget())
            return place(topo, job, budget)

        pol.place = spy  # type: ignore[method-assign]
        return pol

    cycle.build_policy = recording  # type: ignore[method-assign]
    for i, at in enumerate((100.0, 160.0)):
        spec = replace(JOB, id=f"j{i}", gpus=replace(JOB.gpus, min=4, max=4))
        await repo.submit_record(replace(repo.new_record(spec, f"r{i}"), created_at=at))
    await cycle.run()
    seen = [b.outlook for b in budgets]
    assert seen and all(o is not None for o in seen)
    assert seen[0] is not None and seen[0].rate_per_s == pytest.approx(1 / 60)
    assert [j.id for j in seen[0].mix] == ["j0", "j1"]
