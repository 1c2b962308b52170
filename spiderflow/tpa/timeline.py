r"""Pipeline schedules and an exact event-level simulator of one training step.

Op orders (one per stage, shared by its data-parallel replicas) come from
:func:`spiderflow.schedules.stage_ops`: a list of ``(kind, micro_batch, chunk)`` with kind ``"F"`` or ``"B"``
(``S`` stages, ``m`` micro-batches, stage ``i``):

* GPipe: ``F_0 … F_{m−1}, B_0 … B_{m−1}``; every micro-batch in flight.
* 1F1B: ``w = min(m, S−i−1)`` warm-up forwards, then ``F, B`` pairs, then the remaining backwards;
  ``w + 1`` micro-batches in flight.
* Interleaved 1F1B with ``v`` chunks (stage ``i`` holds chunks ``i, i+S, …``; needs ``m mod S = 0``):
  Megatron's order: forward number ``k`` is micro-batch ``⌊k/(S·v)⌋·S + k mod S`` of chunk
  ``⌊k/S⌋ mod v`` (backwards the same with chunks reversed), ``w = min(m·v, 2(S−i−1) + (v−1)·S)``.
* Latency-aware (CrossPipe-style): 1F1B with a warm-up twice as deep, ``w = min(m, 2(S−i) − 1)``, so
  ``2(S−i)`` micro-batches are in flight — exactly the in-flight count the cost model charges for it.
  A stage keeps injecting forwards while the gradients of earlier micro-batches are still crossing the
  slow links, so a round trip of ``2·Σ l`` is hidden behind ``S−i`` extra forwards instead of stalling.

Simulator (:func:`simulate`): discrete events in time order. A stage dispatches its static op order
in order to a pool of ``d`` data-parallel replicas (sequential executors): a forward of a new
micro-batch goes to the free replica holding the fewest micro-batches (below its in-flight cap), which
then owns that micro-batch (its other chunks and its backwards run there). An op is dispatched when its
input has arrived and its replica is free:
``F(j, u)`` needs ``F(j, u−1)``'s activation, ``B(j, u)`` needs ``B(j, u+1)``'s gradient (the last
virtual stage: its own ``F(j, u)``), where ``u = chunk·S + stage`` is the virtual stage (warm-ups of
stages with replicas: :func:`stage_warmups`). A transfer between different stages
takes the directed link ``(src, dst)`` for ``bytes / bandwidth`` seconds (FIFO: one transfer at a time per
direction; the two directions are independent — full duplex) and arrives ``latency`` later.
Compute per op: forward ``T/3``, backward ``2T/3`` (``T`` the cost model's fwd+bwd stage time), divided
by ``v`` for interleaved chunks. The step ends when every stage has finished its last backward and its
gradient all-reduce: ``step = max_s (end_s + AR_s)``.

Complexity: ``O(N log N)`` for ``N = 2·m·v·S`` ops. Raises :class:`ScheduleDeadlockError` when an op order
cannot complete (a malformed order); ``stage_ops`` raises ``ValidationError`` on bad arguments (both are
``ValueError``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from spiderflow.costmodel import activation_bytes, breakdown
from spiderflow.domain import JobSpec, Plan, Schedule, Topology
from spiderflow.schedules import Op, ScheduleDeadlockError, default_warmup, stage_ops

__all__ = [
    "Op",
    "OpRecord",
    "ScheduleDeadlockError",
    "StageTiming",
    "Timeline",
    "TransferRecord",
    "default_warmup",
    "in_flight_cap",
    "plan_stage_timing",
    "simulate",
    "simulate_plan",
    "stage_ops",
    "stage_warmups",
]

def stage_warmups(schedule: Schedule, m: int, replicas: Sequence[int], *, chunks: int = 1) -> list[int]:
    """Warm-up forwards of each stage's *stage-wide* op order when stage ``i`` has ``replicas[i]``
    data-parallel replicas.

    Each replica of stage ``i`` may hold ``k_i`` micro-batches (:func:`in_flight_cap`), so the stage-wide
    order may hold ``d_i·k_i``: ``w_i = min(d_i·k_i − 1, w_{i−1} − 1)`` (≥ 0; a stage with ``w ≥ m−1`` runs
    all forwards first and does not constrain the next). Strictly decreasing
    warm-ups keep the orders deadlock-free and stop forwards and backwards convoying through stages
    with equal warm-ups.
    Interleaved and GPipe orders keep their own warm-ups.
    """
    n = len(replicas)
    if schedule in (Schedule.GPIPE, Schedule.INTERLEAVED_1F1B):
        return [default_warmup(schedule, n, m, i, chunks=chunks) for i in range(n)]
    out: list[int] = []
    previous = m + 1
    for i, d in enumerate(replicas):
        w = max(0, min(d * in_flight_cap(schedule, m, d, i, n) - 1, previous - 1))
        out.append(w)
        # A stage whose warm-up covers all m forwards (w ≥ m−1) runs every forward first: the next stage
        # may do the same.
        previous = m + 1 if w >= m - 1 else w
    return out


def in_flight_cap(schedule: Schedule, m: int, dp: int, stage: int, n_stages: int) -> int:
    """Micro-batches one replica may hold: the cost model's count (``min(⌈m/d⌉, φ·(S−i))``) for the
    1F1B family, ``⌈m/d⌉`` for GPipe and interleaved 1F1B (whose order alone sets its depth)."""
    per_replica = math.ceil(m / dp)
    if schedule in (Schedule.GPIPE, Schedule.INTERLEAVED_1F1B):
        # GPipe holds everything; interleaved orders bound their own depth (Megatron's warm-up).
        return per_replica
    factor = 2 if schedule is Schedule.LATENCY_AWARE else 1
    return min(per_replica, factor * (n_stages - stage))


@dataclass(frozen=True, slots=True, kw_only=True)
class OpRecord:
    stage: int
    replica: int
    kind: str
    micro_batch: int
    chunk: int
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferRecord:
    src: int
    dst: int
    kind: str
    micro_batch: int
    chunk: int
    start_s: float
    end_s: float  # arrival at dst (serialisation + latency)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTiming:
    """Inputs of :func:`simulate` for one stage: fwd+bwd seconds per micro-batch, replicas, all-reduce."""

    compute_s: float
    replicas: int = 1
    allreduce_s: float = 0.0
    max_in_flight: int | None = None  # micro-batches one replica may hold (None: unbounded)


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """The simulated step: every op and transfer with its times, the pipeline makespan and the step."""

    n_stages: int
    replicas: tuple[int, ...]
    ops: tuple[OpRecord, ...]
    transfers: tuple[TransferRecord, ...]
    makespan_s: float
    step_s: float

    def busy_s(self, stage: int) -> float:
        """Compute seconds of ``stage`` summed over its replicas."""
        return sum(o.end_s - o.start_s for o in self.ops if o.stage == stage)

    def bubble_fraction(self, stage: int) -> float:
        """Idle share of ``stage``'s replicas over the makespan."""
        if self.makespan_s <= 0:
            return 0.0
        return 1.0 - self.busy_s(stage) / (self.makespan_s * self.replicas[stage])


def simulate(
    stages: Sequence[StageTiming],
    orders: Sequence[Sequence[Op]],
    serialise_s: Sequence[Sequence[float]],
    latency_s: Sequence[Sequence[float]],
    *,
    chunks: int = 1,
) -> Timeline:
    """Run the event simulation of the module docstring.

    ``orders[i]`` is stage ``i``'s op order; ``serialise_s[a][b]`` and ``latency_s[a][b]`` the seconds one
    activation (or gradient) occupies link ``a → b`` and its one-way latency.
    """
    n = len(stages)
    v = chunks
    last_virtual = n * v - 1
    ptr = [0] * n
    free: list[list[bool]] = [[True] * st.replicas for st in stages]
    owner: list[dict[int, int]] = [{} for _ in range(n)]
    live: list[list[int]] = [[0] * st.replicas for st in stages]
    avail: dict[tuple[str, int, int], float] = {}
    waiting: dict[tuple[str, int, int], list[int]] = {}
    link_free: dict[tuple[int, int], float] = {}
    heap: list[tuple[float, int, int]] = []  # (time, 0 arrival | 1 op end, sequence number)
    arrivals: dict[int, tuple[str, int, int]] = {}
    ends: dict[int, tuple[int, int, Op, float]] = {}
    seq = 0
    ops_out: list[OpRecord] = []
    xfers: list[TransferRecord] = []
    stage_end = [0.0] * n

    def push_arrival(t: float, key: tuple[str, int, int]) -> None:
        nonlocal seq
        arrivals[seq] = key
        heapq.heappush(heap, (t, 0, seq))
        seq += 1

    def push_end(t: float, i: int, r: int, op: Op, start: float) -> None:
        nonlocal seq
        ends[seq] = (i, r, op, start)
        heapq.heappush(heap, (t, 1, seq))
        seq += 1

    def need(op: Op, stage: int) -> tuple[str, int, int] | None:
        kind, j, c = op
        u = c * n + stage
        if kind == "F":
            return None if u == 0 else ("F", j, u - 1)
        return ("F", j, u) if u == last_virtual else ("B", j, u + 1)

    def try_start(i: int, now: float) -> None:
        """Dispatch stage ``i``'s ops in order while inputs and replicas allow."""
        order = orders[i]
        while ptr[i] < len(order):
            op = order[ptr[i]]
            dep = need(op, i)
            if dep is not None and dep not in avail:
                waiting.setdefault(dep, []).append(i)
                return
            kind, j, _ = op
            r = owner[i].get(j)
            if r is None:
                cap = stages[i].max_in_flight
                ready = [q for q, ok in enumerate(free[i]) if ok and (cap is None or live[i][q] < cap)]
                if not ready:
                    return  # every replica busy or full: retried when one finishes
                r = min(ready, key=lambda q: (live[i][q], q))
                owner[i][j] = r
                live[i][r] += 1
            elif not free[i][r]:
                return  # the replica holding this micro-batch is busy
            dur = stages[i].compute_s * (1.0 / 3.0 if kind == "F" else 2.0 / 3.0) / v
            free[i][r] = False
            ptr[i] += 1
            push_end(now + dur, i, r, op, now)

    def release(key: tuple[str, int, int], t: float) -> None:
        avail[key] = t
        for i in waiting.pop(key, []):
            try_start(i, t)

    for i in range(n):
        try_start(i, 0.0)
    while heap:
        t, kind_ev, sq = heapq.heappop(heap)
        if kind_ev == 0:
            release(arrivals.pop(sq), t)
            continue
        i, r, op, start = ends.pop(sq)
        okind, j, c = op
        free[i][r] = True
        if okind == "B" and c == 0:
            live[i][r] -= 1
        ops_out.append(OpRecord(stage=i, replica=r, kind=okind, micro_batch=j, chunk=c, start_s=start, end_s=t))
        stage_end[i] = max(stage_end[i], t)
        u = c * n + i
        key = (okind, j, u)
        # A forward feeds the next virtual stage (the last one feeds its own backward); a backward the previous.
        dst_u = (u + 1 if u < last_virtual else u) if okind == "F" else u - 1
        if dst_u >= 0:
            dst = dst_u % n
            if dst_u == u or dst == i:
                release(key, t)
            else:
                start_tx = max(t, link_free.get((i, dst), 0.0))
                ser = serialise_s[i][dst]
                link_free[(i, dst)] = start_tx + ser
                arrive = start_tx + ser + latency_s[i][dst]
                xfers.append(TransferRecord(src=i, dst=dst, kind=okind, micro_batch=j, chunk=c,
                                            start_s=start_tx, end_s=arrive))
                push_arrival(arrive, key)
        try_start(i, t)
    stuck = [i for i in range(n) if ptr[i] < len(orders[i])]
    if stuck:
        i = stuck[0]
        raise ScheduleDeadlockError(f"op order deadlocks: stage {i} waits at {orders[i][ptr[i]]}")
    makespan = max((o.end_s for o in ops_out), default=0.0)
    step = max((stage_end[i] + stages[i].allreduce_s for i in range(n)), default=0.0)
    ops_out.sort(key=lambda o: (o.stage, o.replica, o.start_s))
    return Timeline(
        n_stages=n, replicas=tuple(st.replicas for st in stages), ops=tuple(ops_out),
        transfers=tuple(xfers), makespan_s=makespan, step_s=step,
    )


def plan_stage_timing(
    plan: Plan, topo: Topology, job: JobSpec
) -> tuple[list[StageTiming], list[list[float]], list[list[float]], int]:
    """The simulator's inputs for ``plan`` from the cost model: stage timings, link matrices, chunks."""
    m = plan.micro_batches
    b = max(1, job.global_batch // m)
    bd = breakdown(plan, topo, job.model, micro_batch=b, seq_len=job.seq_len)
    n = len(plan.stages)
    stages = [
        StageTiming(compute_s=t, replicas=st.dp, allreduce_s=ar,
                    max_in_flight=in_flight_cap(plan.schedule, m, st.dp, i, n))
        for i, (t, st, ar) in enumerate(zip(bd.compute_s, plan.stages, bd.allreduce_s, strict=True))
    ]
    nbytes = activation_bytes(job.model, b, job.seq_len)
    ser = [[0.0] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    for a in range(n):
        for c in range(n):
            if a == c:
                continue
            ca, cb = plan.stages[a].cluster, plan.stages[c].cluster
            if ca == cb:
                gbps = topo.cluster(ca).inter_node_gbps
                lms = 0.0
            else:
                gbps = topo.bandwidth_gbps(ca, cb)
                lms = topo.latency_ms(ca, cb)
            ser[a][c] = math.inf if gbps <= 0 else (0.0 if math.isinf(gbps) else nbytes * 8.0 / (gbps * 1e9))
            lat[a][c] = lms / 1e3
    chunks = int(plan.extras.get("chunks", 2 if plan.schedule is Schedule.INTERLEAVED_1F1B else 1))
    if plan.schedule is not Schedule.INTERLEAVED_1F1B:
        chunks = 1
    return stages, ser, lat, chunks


def simulate_plan(plan: Plan, topo: Topology, job: JobSpec) -> Timeline:
    """Simulate one step of ``plan`` (its schedule, ``m``, replicas) with the cost model's figures."""
    stages, ser, lat, chunks = plan_stage_timing(plan, topo, job)
    n = len(stages)
    m = plan.micro_batches
    warm = stage_warmups(plan.schedule, m, [st.replicas for st in stages], chunks=chunks)
    own = plan.schedule in (Schedule.GPIPE, Schedule.INTERLEAVED_1F1B)  # these keep their own warm-ups
    orders = [
        stage_ops(plan.schedule, n, m, i, chunks=chunks, warmup=None if own else warm[i]) for i in range(n)
    ]
    return simulate(stages, orders, ser, lat, chunks=chunks)
