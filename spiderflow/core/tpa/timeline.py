r"""Pipeline schedules and an exact event-level simulator of one training step.

Op orders come from :mod:`spiderflow.core.schedules` (the module execution runs): a list of
``(kind, micro_batch, chunk)`` with kind ``"F"`` or ``"B"`` (``S`` stages, ``m`` micro-batches, stage ``i``):

* GPipe: ``F_0 … F_{m−1}, B_0 … B_{m−1}``; every micro-batch in flight.
* 1F1B: ``w = min(m, S−i−1)`` warm-up forwards, then ``F, B`` pairs, then the remaining backwards;
  ``w + 1`` micro-batches in flight.
* Interleaved 1F1B with ``v`` chunks (stage ``i`` holds chunks ``i, i+S, …``; needs ``m mod S = 0``):
  Megatron's order: forward number ``k`` is micro-batch ``⌊k/(S·v)⌋·S + k mod S`` of chunk
  ``⌊k/S⌋ mod v`` (backwards the same with chunks reversed), ``w = min(m·v, 2(S−i−1) + (v−1)·S)``.
* Latency-aware (CrossPipe-style): 1F1B with a warm-up twice as deep, ``w = min(m, 2(S−i) − 1)``, so
  ``2(S−i)`` micro-batches are in flight — exactly the in-flight count the cost model charges for it.
  Under an in-flight cap ``K`` (``plan.extras["max_in_flight"]``, the same for every schedule of the 1F1B
  family) every warm-up is ``min(w, K − 1)`` (:mod:`spiderflow.core.schedules`).
  A stage keeps injecting forwards while the gradients of earlier micro-batches are still crossing the
  slow links, so a round trip of ``2·Σ l`` is hidden behind ``S−i`` extra forwards instead of stalling.

Data parallelism (:func:`plan_orders`, exactly what execution runs): replica ``r`` of a stage with ``d``
replicas runs micro-batches ``j ≡ r (mod d)``, in the sub-sequence of the stage-wide order whose warm-up
is ``D·w`` (``D`` the largest dp of the pipeline; see :func:`spiderflow.core.schedules.replica_ops`).

Simulator (:func:`simulate`): op ends are the events, in time order. Each (stage, replica) is a sequential
executor running its static op order; an op starts when its executor is free and its input has arrived:
``F(j, u)`` needs ``F(j, u−1)``'s activation, ``B(j, u)`` needs ``B(j, u+1)``'s gradient (the last
virtual stage: its own ``F(j, u)``), where ``u = chunk·S + stage`` is the virtual stage. A transfer
between different stages
takes the directed link ``(src, dst)`` for ``bytes / bandwidth`` seconds (FIFO: one transfer at a time per
direction; the two directions are independent — full duplex) and arrives ``latency`` later.
Compute per op: forward ``T/3``, backward ``2T/3`` (``T`` the cost model's fwd+bwd stage time), divided
by ``v`` for interleaved chunks. The step ends when every stage has finished its last backward, its
gradient all-reduce and its optimizer step: ``step = max_s (end_s + AR_s + |ℓ_s|·u_s)`` (``u`` the
cluster's calibrated optimizer seconds per layer, :func:`spiderflow.core.costmodel.breakdown`'s ``optimizer_s``).
With equal stages, zero latency and instant links the makespan is the cost model's ``T_pipe`` and the
step its ``T_pipe + T_dp``.

A transfer's arrival is computed when its sender's op ends (the link's queue is known then), so arrivals
need no events: the receiving op is started, and its end queued, as soon as both its input's arrival
and its executor are known. Equal end times are taken in executor order (stage, then replica), which is
the order equal-time transfers queue on a shared link.

When no records are asked for, executors are simply advanced until they wait for an input (woken when it
arrives): a link whose sending stage has one replica has a single sender whose transfers queue in its
program order. Only the sends of stages with several replicas, which share their links, are taken in time
order from a queue, once every executor has run as far as it can (this needs every op to last a positive
time, else the event loop runs). The times are the same as the event loop's. This pass runs as a compiled
kernel (:mod:`spiderflow.core.kernels.timeline`) on the orders packed into integer arrays once per shape.

Complexity: ``O(N log E)`` for ``N = 2·m·v·S`` ops and ``E`` executors (one pending event each); without
records ``O(N + X log X)`` for ``X`` sends on shared links. Without records, :func:`simulate_plan` of a long
1F1B-family pipeline simulates about ``m/4`` micro-batches when its steady state repeats early enough and
extrapolates the rest exactly (:func:`_steady_extrapolation`).
Raises :class:`ScheduleDeadlockError` when an op order cannot complete (a malformed order);
``stage_ops`` raises ``ValidationError`` on bad arguments (both are ``ValueError``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from spiderflow.core.costmodel import (
    Breakdown,
    activation_bytes,
    breakdown,
    evaluate,
    evaluate_with_breakdown,
    wire_bytes,
)
from spiderflow.core.domain import JobSpec, PlacementResult, Plan, Schedule, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.core.kernels.timeline import simulate_eager as _eager_kernel
from spiderflow.core.schedules import (
    Op,
    ScheduleDeadlockError,
    default_warmup,
    plan_max_in_flight,
    stage_ops,
)
from spiderflow.core.schedules import stage_warmup as stage_warmup_of

__all__ = [
    "Op",
    "OpRecord",
    "ScheduleDeadlockError",
    "StageTiming",
    "Timeline",
    "TransferRecord",
    "cache_clear",
    "carries_timeline",
    "default_warmup",
    "evaluate_on_timeline",
    "plan_orders",
    "plan_stage_timing",
    "result_on_timeline",
    "simulate",
    "simulate_plan",
    "stage_ops",
    "stage_warmup",
    "step_lower_bound",
    "window_estimate",
]

def plan_orders(
    schedule: Schedule, m: int, replicas: Sequence[int], *, chunks: int = 1, max_in_flight: int | None = None
) -> list[list[list[Op]]]:
    """``orders[i][r]``: the op order replica ``r`` of stage ``i`` runs — exactly what execution runs
    (:func:`spiderflow.core.schedules.replica_ops`: the stage-wide order with the global warm-up
    ``min(m·v, D·w_i)``, ``D`` the largest dp of the pipeline, restricted to micro-batches ``j ≡ r mod d_i``;
    ``w_i`` capped at ``K − 1`` under an in-flight cap ``K``).
    """
    frozen = _frozen_orders(Schedule(schedule), m, tuple(replicas), chunks, max_in_flight)
    return [[list(r) for r in stage] for stage in frozen]


@lru_cache(maxsize=1024)
def _frozen_orders(
    schedule: Schedule, m: int, replicas: tuple[int, ...], chunks: int, max_in_flight: int | None
) -> tuple[tuple[tuple[Op, ...], ...], ...]:
    """:func:`plan_orders` as tuples, memoised (pipelines of the same shape under other timings share them)."""
    n = len(replicas)
    out: list[tuple[tuple[Op, ...], ...]] = []
    for i, d in enumerate(replicas):
        # A replica's order is the sub-sequence ``j ≡ r (mod d)`` of its stage's order, whose warm-up does not
        # depend on ``d``: the stage order is built once (and shared by stages with the same warm-up), then
        # dealt out to the replicas in one pass.
        w = stage_warmup(schedule, m, replicas, i, chunks=chunks, max_in_flight=max_in_flight)
        whole = _stage_order(schedule, n, m, chunks, w)
        if d == 1:
            out.append((whole,))
            continue
        dealt: list[list[Op]] = [[] for _ in range(d)]
        for op in whole:
            dealt[op[1] % d].append(op)
        out.append(tuple(tuple(r) for r in dealt))
    return tuple(out)


@lru_cache(maxsize=256)
def _stage_order(schedule: Schedule, n: int, m: int, chunks: int, warmup: int) -> tuple[Op, ...]:
    """:func:`spiderflow.core.schedules.stage_ops` of a stage with this warm-up (the order depends on the stage
    only through it)."""
    return tuple(stage_ops(schedule, n, m, 0, chunks=chunks, warmup=warmup))


def stage_warmup(
    schedule: Schedule, m: int, replicas: Sequence[int], stage: int, *, chunks: int = 1,
    max_in_flight: int | None = None,
) -> int:
    """The global (stage-wide) warm-up :func:`plan_orders` uses for ``stage`` (in chunk ops):
    :func:`spiderflow.core.schedules.stage_warmup` with the pipeline's largest and smallest dp."""
    n = len(replicas)
    if schedule is Schedule.GPIPE:
        return m * chunks
    return stage_warmup_of(schedule, n, m, stage, max_dp=max(replicas), chunks=chunks,
                           max_in_flight=max_in_flight, min_dp=min(replicas))


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
    orders: Sequence[Sequence[Sequence[Op]]],
    serialise_s: Sequence[Sequence[float]],
    latency_s: Sequence[Sequence[float]],
    *,
    chunks: int = 1,
    record: bool = True,
) -> Timeline:
    """Run the event simulation of the module docstring.

    ``orders[i][r]`` is replica ``r`` of stage ``i``'s op order (``len(orders[i]) == stages[i].replicas``);
    ``serialise_s[a][b]`` and ``latency_s[a][b]`` the seconds one activation (or gradient) occupies link
    ``a → b`` and its one-way latency. ``record=False`` skips the per-op and per-transfer records
    (``ops``/``transfers`` empty) when only the times are needed.
    """
    n = len(stages)
    v = chunks
    n_virtual = n * v
    last_virtual = n_virtual - 1
    execs = [(i, r) for i in range(n) for r in range(len(orders[i]))]
    flat = [orders[i][r] for i, r in execs]
    stage_of = [i for i, _ in execs]
    ptr = [0] * len(execs)
    dur_f, dur_b = _durations(stages, v)
    if not record and _eager_applies(n, len(execs), dur_f, dur_b):
        return _simulate_eager(stages, _pack_orders(flat, execs, v), dur_f, dur_b, serialise_s, latency_s)
    # The (kind, micro-batch, virtual stage) an op produces is the integer key ``2·(j·n_virtual + u) + [B]``.
    # Each op is compiled once: (key it waits for or −1, duration, kind, j, chunk, what its end does:
    # 0 nothing / 1 release its key here / 2 send it to stage ``dst``, its key, dst). What an op's end does
    # depends only on its kind and virtual stage, so it is worked out once per (kind, chunk) of a stage.
    max_j = 0
    compiled: list[list[tuple[int, float, str, int, int, int, int, int]]] = []
    for e, order in enumerate(flat):
        i = stage_of[e]
        ops_e: list[tuple[int, float, str, int, int, int, int, int]] = []
        append = ops_e.append
        shapes: dict[tuple[str, int], tuple[int, int, int, int, float]] = {}
        for op in order:
            kind, j, c = op
            shape = shapes.get((kind, c))
            if shape is None:
                shape = shapes[(kind, c)] = _op_shape(kind, c, i, n, last_virtual,
                                                      dur_f[i] if kind == "F" else dur_b[i])
            dep_off, own_off, mode, dst, dur = shape
            base = 2 * j * n_virtual
            append((-1 if dep_off < 0 else base + dep_off, dur, kind, j, c, mode, base + own_off, dst))
            if j > max_j:
                max_j = j
        compiled.append(ops_e)
    n_keys = 2 * (max_j + 1) * n_virtual
    # Arrivals are not events: a transfer's arrival time is known when its sender's op ends, so the op that
    # needs it is started (its end pushed) right then, or as soon as its executor reaches it. Only op ends
    # are events, in time order (ties: executor index), which is the order transfers queue on a link.
    inf = math.inf
    arrival = [inf] * n_keys
    waiter = [-1] * n_keys            # the executor parked on a key (each key has one consumer)
    free_at = [0.0] * len(execs)          # when a parked executor became free
    link_free = [0.0] * (n * n)
    heap: list[tuple[float, int, int, float]] = []  # (end, executor, op index, start)
    raw_ops: list[tuple[int, int, str, int, int, float, float]] = []
    xfers: list[TransferRecord] = []
    stage_end = [0.0] * n
    makespan = 0.0
    push = heapq.heappush
    pop = heapq.heappop

    for e, ops_e in enumerate(compiled):
        if ops_e:
            dep = ops_e[0][0]
            if dep < 0:
                push(heap, (ops_e[0][1], e, 0, 0.0))
                ptr[e] = 1
            else:
                waiter[dep] = e
    while heap:
        t, e, p, start = pop(heap)
        _, _, okind, j, c, mode, own, dst = compiled[e][p]
        i = stage_of[e]
        if record:
            raw_ops.append((i, execs[e][1], okind, j, c, start, t))
        if t > stage_end[i]:
            stage_end[i] = t
        if t > makespan:
            makespan = t
        # A forward feeds the next virtual stage (the last one feeds its own backward); a backward the previous.
        if mode:
            if mode == 1:
                at = t
            else:
                lf = link_free[i * n + dst]
                start_tx = t if t >= lf else lf
                ser = serialise_s[i][dst]
                link_free[i * n + dst] = start_tx + ser
                at = start_tx + ser + latency_s[i][dst]
                if record:
                    xfers.append(TransferRecord(src=i, dst=dst, kind=okind, micro_batch=j, chunk=c,
                                                start_s=start_tx, end_s=at))
            arrival[own] = at
            w = waiter[own]
            if w >= 0:
                waiter[own] = -1
                q = ptr[w]
                f = free_at[w]
                s0 = at if at > f else f
                push(heap, (s0 + compiled[w][q][1], w, q, s0))
                ptr[w] = q + 1
        # The executor's next op: started now if its input is here, else parked on it.
        ops_e = compiled[e]
        p += 1
        if p < len(ops_e):
            dep = ops_e[p][0]
            if dep < 0:
                push(heap, (t + ops_e[p][1], e, p, t))
                ptr[e] = p + 1
            else:
                at = arrival[dep]
                if at == inf:
                    waiter[dep] = e
                    free_at[e] = t
                else:
                    s0 = at if at > t else t
                    push(heap, (s0 + ops_e[p][1], e, p, s0))
                    ptr[e] = p + 1
    stuck = [e for e in range(len(execs)) if ptr[e] < len(flat[e])]
    if stuck:
        i, r = execs[stuck[0]]
        raise ScheduleDeadlockError(
            f"op order deadlocks: stage {i} replica {r} waits at {flat[stuck[0]][ptr[stuck[0]]]}"
        )
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


def _op_shape(kind: str, c: int, i: int, n: int, last_virtual: int, dur: float) -> tuple[int, int, int, int, float]:
    """What an op of ``kind`` on chunk ``c`` of stage ``i`` waits for and does at its end, as offsets of the
    keys ``2·j·n_virtual + offset``: ``(dep offset or −1 for "no input", own offset, mode, dst, duration)``
    with mode 0 nothing / 1 release its key here / 2 send it to stage ``dst``."""
    u = c * n + i
    if kind == "F":
        dep_off = -1 if u == 0 else 2 * (u - 1)
        dst_u = u + 1 if u < last_virtual else u
        own_off = 2 * u
    else:
        dep_off = 2 * u if u == last_virtual else 2 * (u + 1) + 1
        dst_u = u - 1
        own_off = 2 * u + 1
    if dst_u < 0:
        return dep_off, own_off, 0, -1, dur
    dst = dst_u % n
    return dep_off, own_off, 1 if (dst_u == u or dst == i) else 2, dst, dur


@dataclass(frozen=True, slots=True, eq=False)
class _PackedOrders:
    """Executors' op orders as the eager kernel reads them (:mod:`spiderflow.core.kernels.timeline`); the arrays
    are read-only.

    Executor ``e`` is ``execs[e]`` = (stage, replica) and runs ops ``p ∈ [start[e], start[e + 1])``: ``code[p]``
    is ``2·chunk + [B]`` (chunk ``0`` when ``chunks`` is 1, where the simulator ignores it) and
    ``micro_batch[p]`` the micro-batch; ``stage[e]`` the executor's stage, ``max_micro_batch`` the largest
    micro-batch (0 without ops), ``flat[e]`` its order as given (for error messages)."""

    code: npt.NDArray[np.int16]
    micro_batch: npt.NDArray[np.int32]
    start: npt.NDArray[np.int64]
    stage: npt.NDArray[np.int64]
    execs: tuple[tuple[int, int], ...]
    flat: tuple[Sequence[Op], ...]
    chunks: int
    max_micro_batch: int


_KIND = itemgetter(0)
_MICRO_BATCH = itemgetter(1)
_CHUNK = itemgetter(2)


def _pack_orders(flat: Sequence[Sequence[Op]], execs: Sequence[tuple[int, int]], chunks: int) -> _PackedOrders:
    """``flat[e]``, the op order of executor ``execs[e]``, packed for the eager kernel. Raises
    ``ValidationError`` on an op the simulator cannot file: a kind other than ``"F"``/``"B"``, a micro-batch
    outside ``[0, 2³¹)``, a chunk outside ``[0, chunks)`` (with several chunks)."""
    ops = list(itertools.chain.from_iterable(flat))
    total = len(ops)
    kinds = "".join(map(_KIND, ops))
    if len(kinds) != total or kinds.count("F") + kinds.count("B") != total:
        raise ValidationError("orders", "op kinds must be 'F' or 'B'")
    code = (np.frombuffer(kinds.encode("ascii"), np.uint8) == ord("B")).astype(np.int16)
    mb = np.fromiter(map(_MICRO_BATCH, ops), np.int64, total)
    max_j = int(mb.max()) if total else 0
    if total and (int(mb.min()) < 0 or max_j > np.iinfo(np.int32).max):
        raise ValidationError("orders", "micro-batches must be integers in [0, 2³¹)")
    if chunks > 1:
        c = np.fromiter(map(_CHUNK, ops), np.int64, total)
        if total and (int(c.min()) < 0 or int(c.max()) >= chunks):
            raise ValidationError("orders", f"chunks must be in [0, {chunks})")
        code += (2 * c).astype(np.int16)
    start = np.zeros(len(flat) + 1, np.int64)
    np.cumsum([len(order) for order in flat], out=start[1:])
    arrays = (code, mb.astype(np.int32), start, np.array([i for i, _ in execs], np.int64))
    for a in arrays:
        a.flags.writeable = False
    return _PackedOrders(code=arrays[0], micro_batch=arrays[1], start=arrays[2], stage=arrays[3],
                         execs=tuple(execs), flat=tuple(flat), chunks=chunks, max_micro_batch=max_j)


@lru_cache(maxsize=1024)
def _frozen_packed(
    schedule: Schedule, m: int, replicas: tuple[int, ...], chunks: int, max_in_flight: int | None
) -> _PackedOrders:
    """:func:`_frozen_orders` packed for the eager kernel, memoised like them (each shape is packed once)."""
    orders = _frozen_orders(schedule, m, replicas, chunks, max_in_flight)
    execs = [(i, r) for i, stage in enumerate(orders) for r in range(len(stage))]
    return _pack_orders([orders[i][r] for i, r in execs], execs, chunks)


def _durations(stages: Sequence[StageTiming], chunks: int) -> tuple[list[float], list[float]]:
    """Seconds of a forward and of a backward on each stage: ``T/3/v`` and ``2T/3/v``."""
    return ([st.compute_s / 3.0 / chunks for st in stages], [st.compute_s * 2.0 / 3.0 / chunks for st in stages])


def _eager_applies(n_stages: int, n_exec: int, dur_f: Sequence[float], dur_b: Sequence[float]) -> bool:
    """Whether :func:`_simulate_eager` gives the event loop's times: one executor per stage, or every op
    lasting a positive time."""
    return n_exec == n_stages or min(min(dur_f), min(dur_b)) > 0.0


_NO_ENDS = np.empty(0, np.float64)
"""The kernel's ``ends`` when op ends are not recorded (never written)."""


def _float_matrix(x: Sequence[Sequence[float]], n: int, name: str) -> npt.NDArray[np.float64]:
    a = np.array(x, dtype=np.float64, order="C")
    if a.ndim != 2 or a.shape[0] < n or a.shape[1] < n:
        raise ValidationError(name, f"must be a {n}×{n} matrix")
    return a


def _by_key(out: npt.NDArray[np.float64], n_keys: int, name: str) -> npt.NDArray[np.float64]:
    if out.dtype != np.float64 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable \
            or out.size < n_keys:
        raise ValidationError(name, f"must be a writeable contiguous float64 array of at least {n_keys} entries")
    return out


def _simulate_eager(
    stages: Sequence[StageTiming],
    packed: _PackedOrders,
    dur_f: Sequence[float],
    dur_b: Sequence[float],
    serialise_s: Sequence[Sequence[float]],
    latency_s: Sequence[Sequence[float]],
    *,
    ends: npt.NDArray[np.float64] | None = None,
    arrivals: npt.NDArray[np.float64] | None = None,
) -> Timeline:
    """:func:`simulate` without records: executors run ahead, only sends on shared links are time-ordered.

    An op's start and end depend only on its executor's previous op and its input's arrival, and a
    transfer's arrival only on the earlier transfers of its link. A link whose sending stage has one
    replica has one sender, whose transfers queue in its program order, so its ops are advanced in any
    order until they wait for an input that has not been produced yet (woken when it is). A link whose
    stage has several replicas queues their transfers in time order (ties: executor order): those sends
    wait in a queue of ``(end, executor)`` and one is taken only when every executor has run as far as it
    can. As every op lasts a positive time (the caller's condition when a stage has several replicas),
    whatever a send at ``t`` leads to ends after ``t``, so when the earliest queued send is taken every send
    at or before its time is queued. Every op start, op end and arrival is the same expression of the same
    operands as in the event loop, so the times are identical. The pass runs as a compiled kernel
    (:func:`spiderflow.core.kernels.timeline.simulate_eager`) on the packed orders (``packed.chunks`` chunks).

    ``ends`` and ``arrivals`` (float64 arrays of at least ``2·(max micro-batch + 1)·n·chunks`` infinities,
    filled in place) take each op's end time and its output's arrival time, indexed by the op's key
    (:func:`_op_key`). Raises :class:`ScheduleDeadlockError` naming the first executor (stage, then replica)
    that cannot run its whole order and the op it waits at.
    """
    n = len(stages)
    replicas = tuple(st.replicas for st in stages)
    if n == 0:
        return Timeline(n_stages=0, replicas=(), ops=(), transfers=(), makespan_s=0.0, step_s=0.0)
    n_keys = 2 * n * packed.chunks * (packed.max_micro_batch + 1)
    arrival = np.full(n_keys, math.inf) if arrivals is None else _by_key(arrivals, n_keys, "arrivals")
    stuck, at, stage_end = _eager_kernel(
        packed.code, packed.micro_batch, packed.start, packed.stage, packed.chunks,
        np.array(dur_f, dtype=np.float64), np.array(dur_b, dtype=np.float64),
        _float_matrix(serialise_s, n, "serialise_s"), _float_matrix(latency_s, n, "latency_s"),
        np.array([d > 1 for d in replicas], dtype=np.bool_), arrival,
        _NO_ENDS if ends is None else _by_key(ends, n_keys, "ends"), ends is not None,
    )
    if stuck >= 0:
        i, r = packed.execs[stuck]
        raise ScheduleDeadlockError(f"op order deadlocks: stage {i} replica {r} waits at {packed.flat[stuck][at]}")
    stage_end_s: list[float] = stage_end.tolist()
    step = max(stage_end_s[i] + stages[i].allreduce_s for i in range(n))
    return Timeline(
        n_stages=n, replicas=replicas, ops=(), transfers=(), makespan_s=max(stage_end_s), step_s=step,
    )


StageInputs = tuple[list[StageTiming], list[list[float]], list[list[float]], int]
""":func:`plan_stage_timing`'s result: stage timings, serialisation and latency matrices, chunks."""


def plan_stage_timing(plan: Plan, topo: Topology, job: JobSpec, *, bd: Breakdown | None = None) -> StageInputs:
    """The simulator's inputs for ``plan`` from the cost model: stage timings (``compute_s`` = ``T_s``
    with the calibrated per-layer overhead, ``allreduce_s`` = gradient all-reduce + optimizer step, the
    stage's share of ``T_dp``), link matrices (filled for the pairs a pipeline uses: neighbours and the
    interleaving wrap; activations in the sending cluster's wire format), chunks. ``bd``: the plan's
    :func:`~spiderflow.core.costmodel.breakdown` when the caller has it."""
    m = plan.micro_batches
    b = max(1, job.global_batch // m)
    if bd is None:
        bd = breakdown(plan, topo, job.model, micro_batch=b, seq_len=job.seq_len, precision=job.precision)
    n = len(plan.stages)
    # The stage's work after the drain: gradient all-reduce plus the optimizer step (the cost model's T_dp).
    opt = bd.optimizer_s or (0.0,) * n
    stages = [
        StageTiming(compute_s=t, replicas=st.dp, allreduce_s=ar + o)
        for t, st, ar, o in zip(bd.compute_s, plan.stages, bd.allreduce_s, opt, strict=True)
    ]
    ser = [[0.0] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    pairs = {(a, a + 1) for a in range(n - 1)} | {(a + 1, a) for a in range(n - 1)}
    if n > 1:
        pairs |= {(n - 1, 0), (0, n - 1)}  # interleaving wraps from the last stage to the first
    sent: dict[str, tuple[float, float]] = {}  # per sending cluster: (activation bytes, its inter-node Gbit/s)
    for a, c in sorted(pairs):
        if a != c:
            ca, cb = plan.stages[a].cluster, plan.stages[c].cluster
            known = sent.get(ca)
            if known is None:
                src = topo.cluster(ca)
                # activations travel in the sending cluster's wire format, as the cost model charges them
                known = sent[ca] = (activation_bytes(job.model, b, job.seq_len, wire_bytes(src, job.precision)),
                                    src.inter_node_gbps)
            nbytes = known[0]
            if ca == cb:
                gbps = known[1]
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


def window_estimate(plan: Plan, topo: Topology, job: JobSpec, *, timing: StageInputs | None = None) -> float:
    r"""A closed-form step estimate that, unlike the cost model's, sees the in-flight window (cheap ranking
    of schedules before the exact simulation; within about −30 %/+50 % of the timeline).

    ``step ≈ (m−1)·period + Σ T/v + 2·v·Σ (ser + lat) + 2·(v−1)·(ser + lat)_wrap + max AR`` with ``v`` the
    chunks per stage (interleaving; 1 otherwise) and ``period`` per micro-batch the largest of

    * ``max_i T_i/d_i`` (compute, ``d_i`` replicas) and ``v·max_ℓ ser_ℓ``, ``(v−1)·ser_wrap`` (every link
      carries ``v`` activations per micro-batch each way, the wrap link from the last stage to the first
      ``v − 1``);
    * the window (1F1B family and interleaving): ``max_i (Σ_{j≥i} T_j + v·2·Σ_{ℓ≥i} (ser_ℓ + lat_ℓ)) /
      (w_i − (v−1)·n + d_i)``: a micro-batch's last chunk goes from stage ``i`` to the end and back while
      the stage runs the ops in flight between its forward and its backward, ``w_i`` being the stage-wide
      warm-up in chunk ops that the orders use (:func:`stage_warmup`), of which ``(v−1)·n`` are earlier
      chunks, plus one op per replica;
    * with interleaving, ``v·(Σ T/(3v) + Σ (ser + lat) + (ser + lat)_wrap)/n``: a chunk's forward goes round
      every stage and back over the wrap link while the stage runs the ``n`` forwards of its group.

    GPipe has no window term (all ``m`` are in flight).
    """
    stages, ser, lat, chunks = timing if timing is not None else plan_stage_timing(plan, topo, job)
    n = len(stages)
    m = plan.micro_batches
    links = [(ser[i][i + 1], lat[i][i + 1]) for i in range(n - 1)]
    wrap = (ser[n - 1][0], lat[n - 1][0]) if chunks > 1 and n > 1 else (0.0, 0.0)
    period = max(
        max(st.compute_s / st.replicas for st in stages),
        chunks * max((x for x, _ in links), default=0.0),
        (chunks - 1) * wrap[0],
    )
    all_t = sum(st.compute_s for st in stages)
    all_l = 2.0 * sum(x + y for x, y in links)
    if plan.schedule is not Schedule.GPIPE:
        reps = [st.replicas for st in stages]
        cap = plan_max_in_flight(plan)
        tail_t = 0.0
        tail_l = 0.0
        for i in range(n - 1, -1, -1):
            tail_t += stages[i].compute_s
            if i < n - 1:
                tail_l += 2.0 * (links[i][0] + links[i][1])
            # Ops of the last chunk in flight between its forward and its backward on stage i.
            w = stage_warmup(plan.schedule, m, reps, i, chunks=chunks, max_in_flight=cap) - (chunks - 1) * n
            period = max(period, (tail_t + chunks * tail_l) / max(w + reps[i], 1))
    if chunks > 1:
        # A micro-batch's next chunk starts on a stage n of its forwards later, after the forward has gone
        # round every stage and back over the wrap link.
        cycle = all_t / (3.0 * chunks) + all_l / 2.0 + wrap[0] + wrap[1]
        period = max(period, chunks * cycle / n)
    fill = all_t / chunks + chunks * all_l + 2.0 * (chunks - 1) * (wrap[0] + wrap[1])
    return (m - 1) * period + fill + max(st.allreduce_s for st in stages)


def step_lower_bound(plan: Plan, topo: Topology, job: JobSpec, *, timing: StageInputs | None = None) -> float:
    r"""A lower bound on :func:`simulate_plan`'s ``step_s`` for any op order (cheap; used to skip
    simulations that cannot win).

    Replica 0 of stage ``i`` runs ``⌈m/d_i⌉`` micro-batches of ``T_i`` seconds each, and cannot start before
    the first activation has crossed the stages upstream: ``a_i = Σ_{q<i} (T_q/(3v) + ser_{q,q+1} +
    lat_{q,q+1})``. Without interleaving (``v = 1``) its last op is a backward whose gradient must still
    cross stages ``i−1 … 0`` (``Σ_{q<i} (2T_q/3 + ser_{q+1,q} + lat_{q+1,q})``) before stage 0 can finish. So
    ``step ≥ max_i a_i + ⌈m/d_i⌉·T_i + max(AR_i, tail_i + AR_0)`` (``tail_i`` only when ``v = 1``).
    """
    stages, ser, lat, chunks = timing if timing is not None else plan_stage_timing(plan, topo, job)
    m = plan.micro_batches
    best = 0.0
    head = 0.0
    tail = 0.0
    for i, st in enumerate(stages):
        if i > 0:
            head += stages[i - 1].compute_s / (3.0 * chunks) + ser[i - 1][i] + lat[i - 1][i]
            tail += stages[i - 1].compute_s * 2.0 / 3.0 + ser[i][i - 1] + lat[i][i - 1]
        after = st.allreduce_s
        if chunks == 1 and i > 0:
            after = max(after, tail + stages[0].allreduce_s)
        best = max(best, head + math.ceil(m / st.replicas) * st.compute_s + after)
    return best if math.isfinite(best) else 0.0


TIMELINE_STEP_KEY = "timeline_step_s"
CLOSED_FORM_STEP_KEY = "closed_form_step_s"


def evaluate_on_timeline(
    plan: Plan, topo: Topology, job: JobSpec, *, step_s: float | None = None, evaluated: bool = False,
) -> Plan:
    """``plan`` with the prediction every policy reports and is compared on: the cost model's figures
    (:func:`~spiderflow.core.costmodel.evaluate`: memory per GPU, the closed form), its step the exact
    timeline's (:func:`simulate_plan` of its schedule, ``m`` and replicas), throughput and dollars per step
    from that step. ``extras`` gains ``timeline_step_s`` (= ``step_time_s``) and ``closed_form_step_s``.
    ``step_s``: the timeline step when the caller has simulated it already; ``evaluated``: ``plan`` is
    :func:`~spiderflow.core.costmodel.evaluate`'s output already (it reads only the stages, ``m``, the schedule
    and the extras, so evaluating it again gives the same figures; they are kept). Idempotent; raises
    :class:`ScheduleDeadlockError` (a ``ValueError``) for an order the replica layout cannot run."""
    if step_s is None:
        ev, bd = evaluate_with_breakdown(plan, topo, job)
        step = simulate_plan(ev, topo, job, record=False, timing=plan_stage_timing(ev, topo, job, bd=bd)).step_s
    else:
        ev, step = (plan if evaluated else evaluate(plan, topo, job)), step_s
    closed = ev.step_time_s
    usd = ev.usd_per_step * (step / closed) if closed > 0 and math.isfinite(closed) else ev.usd_per_step
    extras = dict(ev.extras)
    extras[TIMELINE_STEP_KEY] = step
    extras[CLOSED_FORM_STEP_KEY] = closed
    return replace(
        ev, step_time_s=step, usd_per_step=usd, extras=extras,
        throughput_tokens_per_s=(job.tokens_per_step / step) if step > 0 and math.isfinite(step) else 0.0,
    )


def carries_timeline(plan: Plan) -> bool:
    """Whether ``plan``'s step is already its exact timeline step (the planner simulated it on the same
    figures, as TPA does, or :func:`evaluate_on_timeline` put it there)."""
    return plan.extras.get(TIMELINE_STEP_KEY) == plan.step_time_s and CLOSED_FORM_STEP_KEY in plan.extras


def _on_timeline(plan: Plan, topo: Topology, job: JobSpec) -> Plan:
    if carries_timeline(plan):
        return plan  # the planner's own (it simulated the plan on the same figures)
    try:
        return evaluate_on_timeline(plan, topo, job)
    except ValueError:
        return plan  # an order the timeline cannot run keeps the closed form (no planner emits one)


def result_on_timeline(result: PlacementResult, topo: Topology, job: JobSpec) -> PlacementResult:
    """A policy's answer with its plan (and the plan it waits for) re-scored by :func:`evaluate_on_timeline`,
    so that every policy is reported and compared on the same prediction; a plan that already carries its
    timeline step (TPA's) is kept as it is. The policy's own statistics (its search objective) are
    unchanged."""
    if result.plan is None:
        return result
    plan = _on_timeline(result.plan, topo, job)
    wait = result.wait
    if wait is not None:
        wait = replace(wait, plan=plan if wait.plan is result.plan else _on_timeline(wait.plan, topo, job))
    return replace(result, plan=plan, wait=wait)


def simulate_plan(
    plan: Plan, topo: Topology, job: JobSpec, *, record: bool = True, timing: StageInputs | None = None
) -> Timeline:
    """Simulate one step of ``plan`` (its schedule, ``m``, replicas) with the cost model's figures.

    With ``record=False`` the result is memoised on the simulator's inputs (schedule, ``m``, chunks, the
    in-flight cap, stage timings and the link matrices), so equal pipelines on later topology snapshots are
    not re-simulated, and a long pipeline's step may come from the exact simulation of fewer micro-batches
    and its steady state (:func:`_steady_extrapolation`; equal to the full simulation up to float rounding,
    ~1e-14 relative). The plan's in-flight cap (``plan.extras["max_in_flight"]``) caps the warm-ups.
    ``timing``: the plan's :func:`plan_stage_timing` when the caller has it (likewise for
    :func:`window_estimate` and :func:`step_lower_bound`). An infinite stage time never ends: the op order
    cannot complete, which is reported as a :class:`ValidationError` naming the stage, not as a deadlock.
    """
    stages, ser, lat, chunks = timing if timing is not None else plan_stage_timing(plan, topo, job)
    cap = plan_max_in_flight(plan)
    try:
        if not record:
            return _simulate_memo(
                plan.schedule, plan.micro_batches, chunks, tuple(stages),
                tuple(tuple(r) for r in ser), tuple(tuple(r) for r in lat), cap,
            )
        orders = plan_orders(plan.schedule, plan.micro_batches, [st.replicas for st in stages], chunks=chunks,
                             max_in_flight=cap)
        return simulate(stages, orders, ser, lat, chunks=chunks, record=record)
    except ScheduleDeadlockError:
        # Checked only here, off the hot path: an infinite stage time never ends, which reads as a deadlock.
        for i, st in enumerate(stages):
            for name in ("compute_s", "allreduce_s"):
                v = getattr(st, name)
                if not (math.isfinite(v) and v >= 0.0):
                    raise ValidationError(f"timing.stages[{i}].{name}", "must be a finite number ≥ 0", v) from None
        raise


@lru_cache(maxsize=4096)
def _simulate_memo(
    schedule: Schedule, m: int, chunks: int, stages: tuple[StageTiming, ...],
    ser: tuple[tuple[float, ...], ...], lat: tuple[tuple[float, ...], ...], max_in_flight: int | None = None,
) -> Timeline:
    steady = _steady_extrapolation(schedule, m, chunks, stages, ser, lat, max_in_flight)
    if steady is not None:
        return steady
    return _simulate_frozen(schedule, m, chunks, stages, ser, lat, max_in_flight)


def _simulate_frozen(
    schedule: Schedule, m: int, chunks: int, stages: Sequence[StageTiming], ser: Sequence[Sequence[float]],
    lat: Sequence[Sequence[float]], max_in_flight: int | None,
) -> Timeline:
    """:func:`simulate` without records of all ``m`` micro-batches on the memoised orders of this shape: the
    eager pass on the orders packed once per shape when it applies, else the event loop."""
    reps = tuple(st.replicas for st in stages)
    dur_f, dur_b = _durations(stages, chunks)
    if _eager_applies(len(stages), sum(reps), dur_f, dur_b):
        return _simulate_eager(stages, _frozen_packed(schedule, m, reps, chunks, max_in_flight), dur_f, dur_b,
                               ser, lat)
    orders = _frozen_orders(schedule, m, reps, chunks, max_in_flight)
    return simulate(stages, orders, ser, lat, chunks=chunks, record=False)


STEADY_TOLERANCE = 1e-12
"""Relative tolerance (of the times compared) within which two periods of the steady state count as equal:
float rounding of the sums, orders of magnitude above its ~1e-15, far below any real drift."""


def _op_key(op: Op, stage: int, n: int, n_virtual: int) -> int:
    """The key the simulator files ``op`` of ``stage`` under: ``2·(j·n_virtual + u) + [B]``."""
    kind, j, c = op
    return 2 * (j * n_virtual + c * n + stage) + (kind == "B")


def _steady_extrapolation(
    schedule: Schedule, m: int, chunks: int, stages: tuple[StageTiming, ...],
    ser: tuple[tuple[float, ...], ...], lat: tuple[tuple[float, ...], ...], max_in_flight: int | None,
) -> Timeline | None:
    r"""The step of ``m`` micro-batches from the exact simulation of fewer, ``m'``, or ``None``.

    Orders of the 1F1B family are a warm-up, ``(F, B)`` pairs and a cool-down. With ``c`` the period of the
    replica layout (``lcm`` of the dps, and of ``S`` with interleaving) and the same warm-ups, the orders of
    ``m' + p`` micro-batches (``c | p``) are those of ``m'`` with ``p`` more pairs. The simulator is a
    deterministic, time-invariant system of these orders, and its steady state repeats every ``p = q·c``
    micro-batches for some ``q`` (the cyclicity of a max-plus system). If every op end and arrival of the
    micro-batches that make up the state at a cut through the pairs is its counterpart ``p`` micro-batches
    later shifted back by one ``Δ``, inserting ``p`` pairs at the cut shifts everything after it by ``Δ``:
    step(``m' + K·p``) = step(``m'``) + ``K·Δ``.

    The check (:func:`_steady_period`) is made on the simulation of ``m'`` itself, on micro-batches whose ops
    all end before the earliest start of a cool-down op: until then the simulations of ``m'`` and ``m`` are
    the same event by event (every executor is still in the prefix their orders share). ``m'`` is about
    ``m/``:data:`TRY_FRACTION` (at least what the check needs), ``≡ m`` modulo ``12c``, ``6c``, ``4c``, ``2c``
    or ``c`` (the first that keeps it within ``m/``:data:`MIN_REDUCTION`); when the period found does not
    divide ``m − m'``, ``m'`` is raised to the next value that it does and simulated again. No
    period (a transient longer than the window, float ties that break differently from period to period)
    → ``None``: the caller simulates ``m``. Periods count as equal within :data:`STEADY_TOLERANCE` of the
    times compared.
    """
    n = len(stages)
    if schedule is Schedule.GPIPE or n < 2:
        return None
    reps = tuple(st.replicas for st in stages)
    dur_f, dur_b = _durations(stages, chunks)
    if not _eager_applies(n, sum(reps), dur_f, dur_b):
        return None  # the event loop's case (zero-length ops with shared links)
    base = math.lcm(*reps)
    if chunks > 1:
        base = math.lcm(base, n)
    warm = [stage_warmup(schedule, m, reps, i, chunks=chunks, max_in_flight=max_in_flight) for i in range(n)]
    deepest = -(-max(warm) // chunks)  # micro-batches
    # The check needs the warm-up, a window of W + 4c + p and the cool-down's reach (≈ W) before m'.
    need = 3 * deepest + 8 * base
    if need * MIN_REDUCTION > m:
        return None  # not worth it: the attempt would cost a large share of simulating m
    target = max(need, m // TRY_FRACTION)
    # m' ≡ m modulo the longest multiple of c the budget allows among 12c, 6c, 4c, 2c: a steady state of one
    # of those periods then needs no second simulation.
    period = next((k * base for k in (12, 6, 4, 2) if (m - k * base * ((m - target) // (k * base))) * MIN_REDUCTION
                   <= m), base)
    for _ in range(2):
        small = m - period * ((m - target) // period)
        if [stage_warmup(schedule, small, reps, i, chunks=chunks, max_in_flight=max_in_flight)
                for i in range(n)] != warm:
            return None
        run = _run_recorded(schedule, small, chunks, stages, reps, dur_f, dur_b, ser, lat, max_in_flight)
        found = _steady_period(schedule, small, chunks, reps, warm, run, deepest, base)
        if found is None:
            return None
        p, delta = found
        if (m - small) % p == 0:
            tl = run[0]
            k = (m - small) // p
            return Timeline(
                n_stages=n, replicas=reps, ops=(), transfers=(), makespan_s=tl.makespan_s + k * delta,
                step_s=tl.step_s + k * delta,
            )
        period = p  # once more with m' ≡ m (mod p)
    return None


MAX_CYCLICITY = 32
"""The longest steady-state period looked for, in multiples of the replica layout's period."""
TRY_FRACTION = 4
"""``m'`` is about ``m / TRY_FRACTION`` micro-batches, or what the check needs when that is more."""
MIN_REDUCTION = 2.5
"""Extrapolate only when ``m'`` is at most ``m / MIN_REDUCTION`` micro-batches (a failed attempt costs the
simulation of ``m'`` on top of that of ``m``)."""


_Recorded = tuple[Timeline, tuple[tuple[tuple[Op, ...], ...], ...], npt.NDArray[np.float64], npt.NDArray[np.float64]]
"""A recorded eager simulation: its timeline, orders, and every op's end and output's arrival by key."""


def _run_recorded(
    schedule: Schedule, m: int, chunks: int, stages: tuple[StageTiming, ...], reps: tuple[int, ...],
    dur_f: list[float], dur_b: list[float], ser: Sequence[Sequence[float]], lat: Sequence[Sequence[float]],
    max_in_flight: int | None,
) -> _Recorded:
    """The eager simulation of ``m`` micro-batches with every op's end and arrival recorded by key (arrays of
    ``2·n·chunks·m`` entries; ``inf`` where nothing is recorded)."""
    n = len(stages)
    orders = _frozen_orders(schedule, m, reps, chunks, max_in_flight)
    ends = np.full(2 * n * chunks * m, math.inf)
    arrivals = np.full(2 * n * chunks * m, math.inf)
    tl = _simulate_eager(stages, _frozen_packed(schedule, m, reps, chunks, max_in_flight), dur_f, dur_b, ser, lat,
                         ends=ends, arrivals=arrivals)
    return tl, orders, ends, arrivals


def _steady_period(
    schedule: Schedule, m: int, chunks: int, reps: tuple[int, ...], warm: Sequence[int],
    run: _Recorded, deepest: int, base: int,
) -> tuple[int, float] | None:
    """``(p, Δ)``: the shortest period ``p = q·base`` (``q ≤`` :data:`MAX_CYCLICITY`) over which the recorded
    simulation of ``m`` micro-batches repeats, shifted by ``Δ``, in the prefix it shares with longer ones
    (:func:`_steady_extrapolation`); ``None`` when there is none."""
    _, orders, ends, arrivals = run
    n = len(reps)
    n_virtual = n * chunks
    jm = 2 * n_virtual
    total = m * chunks
    # The earliest a cool-down op can start: the end of the op before it on its executor.
    diverge = math.inf
    for i, d in enumerate(reps):
        whole = _stage_order(schedule, n, m, chunks, warm[i])
        cut = 2 * total - min(warm[i], total)  # stage-order position of the first cool-down op
        counts = [0] * d
        for op in whole[:cut]:
            counts[op[1] % d] += 1
        for r in range(d):
            order = orders[i][r]
            if 0 < counts[r] < len(order):
                diverge = min(diverge, float(ends[_op_key(order[counts[r] - 1], i, n, n_virtual)]))
    e = ends.reshape(m, jm)
    a = arrivals.reshape(m, jm)
    sent = np.isfinite(a)  # ops whose output goes somewhere (the first virtual stage's backward: nowhere)
    # The last micro-batch before which every op end and arrival lies before the divergence.
    late = (e >= diverge).any(axis=1) | (sent & (a >= diverge)).any(axis=1)
    last = int(np.argmax(late)) - 1 if late.any() else m - 1
    tol = STEADY_TOLERANCE * max(1.0, diverge)
    for q in range(1, MAX_CYCLICITY + 1):
        p = q * base
        # The state at a cut through pair P of every stage: executor clocks and link queues of micro-batches
        # from P − dp on, arrivals and in-flight micro-batches up to P + W; with two layout periods (≥ dp) of
        # margin each side (a shared link interleaves its replicas' sends) that is [P − 2c, P + W + 2c],
        # each compared with its counterpart p later.
        hi = last - p
        lo = hi - deepest - 4 * base
        if lo < deepest + base:
            return None
        de = e[lo + p: hi + p + 1] - e[lo: hi + 1]
        delta = float(de[0, 0])
        if np.abs(de - delta).max() > tol:
            continue
        s0, s1 = sent[lo: hi + 1], sent[lo + p: hi + p + 1]
        if not np.array_equal(s0, s1):
            continue
        da = np.where(s0, a[lo + p: hi + p + 1] - np.where(s0, a[lo: hi + 1], 0.0), delta)
        if np.abs(da - delta).max() > tol:
            continue
        return p, delta
    return None


def cache_clear() -> None:
    """Forget the memoised orders, packed orders and simulations (they are functions of their arguments'
    values alone; benchmarks time cold decisions this way)."""
    for fn in (_simulate_memo, _frozen_orders, _stage_order, _frozen_packed):
        fn.cache_clear()
