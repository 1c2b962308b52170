"""One trace through the scheduler service's path (real etcd) and the simulator's: the same decisions in the
same order, cycle by cycle.

The simulator runs the trace (SpinSearch, waiting on, no decision overhead) and reports each cycle's result.
The service replays it on a real etcd: every job is submitted at the trace's arrival time, and before each of
the simulator's cycles the jobs the simulator completed by then are released in etcd; then one service cycle
runs at that time (its clock is the simulated one) and binds its placements with compare-and-swap. Both call
:func:`spiderflow.core.cycle.run_cycle`; the test checks that their inputs agree (the service reads them from
etcd, the simulator from its event heap): every decision's job, outcome, binding constraint, plan, estimated
end and (for the decisions that asked the policy) reason are equal.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from services.scheduler.cycle import SchedulingCycle
from services.scheduler.repo import JobRepository
from services.scheduler.topology_source import StaticTopologySource
from spiderflow.core.cycle import CycleDecision, CycleResult
from spiderflow.core.sim.engine import OverheadMode, SimConfig, simulate
from spiderflow.core.sim.tracegen import generate_trace
from spiderflow.core.topogen import generate_topology
from spiderflow.jobs import JobState
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess


def _key(d: CycleDecision) -> tuple[Any, ...]:
    plan = None if d.plan is None else (tuple((s.cluster, s.first_layer, s.last_layer, s.tp, s.dp)
                                              for s in d.plan.stages), d.plan.micro_batches, str(d.plan.schedule),
                                        d.plan.step_time_s)
    return (d.job_id, str(d.outcome), d.tried, d.constraint, plan, d.est_end_s, d.reason if d.tried else "")


async def test_the_service_and_the_simulator_make_the_same_decisions(etcd: EtcdProcess) -> None:
    topo = generate_topology(4, 3, "geo")
    trace = [replace(j, arrival_s=0.0) for j in generate_trace(10, 3, 3.0, topo)]
    cycles: list[CycleResult] = []
    sim = simulate(topo, trace, "spinsearch", SimConfig(overhead=OverheadMode.FIXED, fixed_overhead_s=0.0),
                   on_cycle=cycles.append)
    ends = {r.id: r.end_s for r in sim.records}
    assert all(r.status == "completed" for r in sim.records)
    assert len(cycles) >= 3 and any(d.outcome == "wait" for c in cycles for d in c.decisions)

    clock = [0.0]
    store = EtcdStore(etcd.endpoint)
    try:
        repo = JobRepository(store, clock=lambda: clock[0])
        # fair share between tenants is the service's default and an option of the simulator: off in both here
        service = SchedulingCycle(repo, StaticTopologySource(topo), wait_for_releases=True, fair_share=False,
                                  stale_s=math.inf,  # no agents report here: liveness is not under test
                                  clock=lambda: clock[0])
        for job in trace:
            await repo.submit(job, f"r-{job.id}")
        running: set[str] = set()
        for k, sim_cycle in enumerate(cycles):
            clock[0] = sim_cycle.clock
            for jid in sorted(running):
                end = ends[jid]
                if end is not None and end <= clock[0]:
                    sj = await repo.get(jid)
                    await repo.release(sj, sj.record.to(JobState.SUCCEEDED, "done", now=end))
                    running.discard(jid)
            report = await service.run()
            assert report.cycle is not None and not report.conflict, k
            assert [_key(d) for d in report.cycle.decisions] == [_key(d) for d in sim_cycle.decisions], k
            assert report.placed == sim_cycle.placed
            running.update(report.placed)
    finally:
        await store.close()
