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
    "window_estimate",
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
    record: bool = True,
) -> Timeline:
    """Run the event simulation of the module docstring.

    ``orders[i]`` is stage ``i``'s op order; ``serialise_s[a][b]`` and ``latency_s[a][b]`` the seconds one
    activation (or gradient) occupies link ``a → b`` and its one-way latency. ``record=False`` skips the
    per-op and per-transfer records (``ops``/``transfers`` empty) when only the times are needed.
    """
    n = len(stages)
    v = chunks
    last_virtual = n * v - 1
    ptr = [0] * n
    lengths = [len(o) for o in orders]
    dur_f = [st.compute_s / 3.0 / v for st in stages]
    dur_b = [st.compute_s * 2.0 / 3.0 / v for st in stages]
    caps = [st.max_in_flight for st in stages]
    free: list[list[bool]] = [[True] * st.replicas for st in stages]
    owner: list[dict[int, int]] = [{} for _ in range(n)]
    live: list[list[int]] = [[0] * st.replicas for st in stages]
    avail: set[tuple[str, int, int]] = set()
    waiting: dict[tuple[str, int, int], list[int]] = {}
    parked: list[tuple[str, int, int] | None] = [None] * n  # the input each stage waits for
    link_free: dict[tuple[int, int], float] = {}
    # (time, 0 arrival | 1 op end, sequence number, payload): the unique sequence number settles ties, so
    # payloads are never compared.
    heap: list[tuple[float, int, int, tuple[int, int, str, int, int, float]]] = []
    seq = 0
    raw_ops: list[tuple[int, int, str, int, int, float, float]] = []
    xfers: list[TransferRecord] = []
    stage_end = [0.0] * n
    makespan = 0.0

    def try_start(i: int, now: float) -> None:
        """Dispatch stage ``i``'s ops in order while inputs and replicas allow."""
        nonlocal seq
        order = orders[i]
        while ptr[i] < lengths[i]:
            kind, j, c = order[ptr[i]]
            u = c * n + i
            if kind == "F":
                dep = None if u == 0 else ("F", j, u - 1)
            else:
                dep = ("F", j, u) if u == last_virtual else ("B", j, u + 1)
            if dep is not None and dep not in avail:
                if parked[i] != dep:  # register once: the arrival wakes the stage
                    parked[i] = dep
                    waiting.setdefault(dep, []).append(i)
                return
            fr = free[i]
            r = owner[i].get(j)
            if r is None:
                cap = caps[i]
                lv = live[i]
                r = -1
                for q in range(len(fr)):
                    if fr[q] and (cap is None or lv[q] < cap) and (r < 0 or lv[q] < lv[r]):
                        r = q
                if r < 0:
                    return  # every replica busy or full: retried when one finishes
                owner[i][j] = r
                lv[r] += 1
            elif not fr[r]:
                return  # the replica holding this micro-batch is busy
            fr[r] = False
            ptr[i] += 1
            end = now + (dur_f[i] if kind == "F" else dur_b[i])
            heapq.heappush(heap, (end, 1, seq, (i, r, kind, j, c, now)))
            seq += 1

    def release(key: tuple[str, int, int], t: float) -> None:
        avail.add(key)
        for i in waiting.pop(key, ()):
            parked[i] = None
            try_start(i, t)

    for i in range(n):
        try_start(i, 0.0)
    while heap:
        t, kind_ev, _, payload = heapq.heappop(heap)
        i, r, okind, j, c, start = payload
        if kind_ev == 0:
            release((okind, j, r), t)  # arrival of (kind, micro-batch, virtual stage) at stage i
            continue
        free[i][r] = True
        if okind == "B" and c == 0:
            live[i][r] -= 1
        if record:
            raw_ops.append((i, r, okind, j, c, start, t))
        if t > stage_end[i]:
            stage_end[i] = t
        if t > makespan:
            makespan = t
        u = c * n + i
        # A forward feeds the next virtual stage (the last one feeds its own backward); a backward the previous.
        dst_u = (u + 1 if u < last_virtual else u) if okind == "F" else u - 1
        if dst_u >= 0:
            dst = dst_u % n
            if dst_u == u or dst == i:
                release((okind, j, u), t)
            else:
                start_tx = max(t, link_free.get((i, dst), 0.0))
                ser = serialise_s[i][dst]
                link_free[(i, dst)] = start_tx + ser
                arrive = start_tx + ser + latency_s[i][dst]
                if record:
                    xfers.append(TransferRecord(src=i, dst=dst, kind=okind, micro_batch=j, chunk=c,
                                                start_s=start_tx, end_s=arrive))
                heapq.heappush(heap, (arrive, 0, seq, (dst, u, okind, j, c, 0.0)))
                seq += 1
        try_start(i, t)
    stuck = [i for i in range(n) if ptr[i] < lengths[i]]
    if stuck:
        i = stuck[0]
        raise ScheduleDeadlockError(f"op order deadlocks: stage {i} waits at {orders[i][ptr[i]]}")
    step = max((stage_end[i] + stages[i].allreduce_s for i in range(n)), default=0.0)
    raw_ops.sort(key=lambda o: (o[0], o[1], o[5]))
    ops = tuple(
        OpRecord(stage=i, replica=r, kind=k, micro_batch=j, chunk=c, start_s=s0, end_s=e0)
        for i, r, k, j, c, s0, e0 in raw_ops
    )
    return Timeline(
        n_stages=n, replicas=tuple(st.replicas for st in stages), ops=ops,
        transfers=tuple(xfers), makespan_s=makespan, step_s=step,
    )


def plan_stage_timing(
    plan: Plan, topo: Topology, job: JobSpec
) -> tuple[list[StageTiming], list[list[float]], list[list[float]], int]:
    """The simulator's inputs for ``plan`` from the cost model: stage timings, link matrices (filled for
    the pairs a pipeline uses: neighbours and the interleaving wrap), chunks."""
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
    pairs = {(a, a + 1) for a in range(n - 1)} | {(a + 1, a) for a in range(n - 1)}
    if n > 1:
        pairs |= {(n - 1, 0), (0, n - 1)}  # interleaving wraps from the last stage to the first
    for a, c in sorted(pairs):
        if a != c:
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


def window_estimate(plan: Plan, topo: Topology, job: JobSpec) -> float:
    r"""A closed-form step estimate that, unlike the cost model's, sees the in-flight window (cheap ranking
    of schedules before the exact simulation).

    ``period = max(max_i T_i/d_i, max_ℓ ser_ℓ, max_i R_i/(w_i+1))`` with the round trip
    ``R_i = Σ_{j≥i} T_j + 2·Σ_{ℓ≥i} (ser_ℓ + lat_ℓ)`` and ``w_i`` the stage's warm-up (the 1F1B family; GPipe
    and interleaved orders have no window term); ``step ≈ (m−1)·period + Σ T/v + 2·v·Σ (ser + lat) + max AR``.
    """
    stages, ser, lat, chunks = plan_stage_timing(plan, topo, job)
    n = len(stages)
    m = plan.micro_batches
    links = [(ser[i][i + 1], lat[i][i + 1]) for i in range(n - 1)]
    period = max(max(st.compute_s / st.replicas for st in stages), max((x for x, _ in links), default=0.0))
    if plan.schedule in (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE):
        warm = stage_warmups(plan.schedule, m, [st.replicas for st in stages])
        tail_t = 0.0
        tail_l = 0.0
        for i in range(n - 1, -1, -1):
            tail_t += stages[i].compute_s
            if i < n - 1:
                tail_l += 2.0 * (links[i][0] + links[i][1])
            period = max(period, (tail_t + tail_l) / (warm[i] + 1))
    fill = sum(st.compute_s for st in stages) / chunks + 2.0 * chunks * sum(x + y for x, y in links)
    return (m - 1) * period + fill + max(st.allreduce_s for st in stages)


def simulate_plan(plan: Plan, topo: Topology, job: JobSpec, *, record: bool = True) -> Timeline:
    """Simulate one step of ``plan`` (its schedule, ``m``, replicas) with the cost model's figures."""
    stages, ser, lat, chunks = plan_stage_timing(plan, topo, job)
    n = len(stages)
    m = plan.micro_batches
    warm = stage_warmups(plan.schedule, m, [st.replicas for st in stages], chunks=chunks)
    own = plan.schedule in (Schedule.GPIPE, Schedule.INTERLEAVED_1F1B)  # these keep their own warm-ups
    orders = [
        stage_ops(plan.schedule, n, m, i, chunks=chunks, warmup=None if own else warm[i]) for i in range(n)
    ]
    return simulate(stages, orders, ser, lat, chunks=chunks, record=record)
