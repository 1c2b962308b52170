r"""Pipeline schedules as per-stage operation orders, and a dependency replay that times and checks them.

A *schedule* tells each pipeline stage in which order to run the forward (``"F"``) and backward (``"B"``)
passes of the step's ``m`` micro-batches. An operation is a triple ``(kind, micro_batch, chunk)``; ``chunk``
is the model chunk a stage runs it on (always 0 except for interleaved 1F1B, where stage ``i`` holds
``chunks`` model chunks and chunk ``c`` is *virtual stage* ``v = c·S + i`` of ``V = chunks·S``).

Orders (``S`` stages, stage index ``i``, warm-up ``w`` = forwards run before the first backward):

- **GPipe**: ``F0 … F(m−1)`` then ``B0 … B(m−1)``. All ``m`` activations are in flight at once.
- **1F1B**: ``w = min(m, S − i − 1)`` forwards, then alternately one forward and one backward
  (``F(w) B0 F(w+1) B1 …``), then the remaining backwards. At most ``S − i`` activations in flight.
- **Interleaved 1F1B** (``chunks = v > 1``, Megatron-LM's order): forwards walk micro-batches in groups of
  ``S``: group ``g``, chunk ``c`` runs micro-batches ``g·S … g·S+S−1`` on chunk ``c``, chunks ascending;
  backwards in the same group order with chunks descending. Warm-up ``min(m·v, 2(S − i − 1) + (v − 1)·S)``
  operations, then 1F1B. As in Megatron-LM, ``m`` must be a multiple of ``S`` (a shorter last group can
  deadlock); with ``chunks = 1`` it is plain 1F1B.
- **Latency-aware** (in the spirit of CrossPipe): the 1F1B order with a deeper warm-up, by default
  ``w = min(m, 2(S − i) − 1)``: twice the 1F1B in-flight depth, so while the gradient of micro-batch ``j``
  is crossing a high-latency link back to stage ``i``, the stage keeps computing forwards instead of
  idling. A caller may pass any per-stage ``warmup``; the orders of all stages stay deadlock-free as long
  as warm-ups do not increase along the pipeline (``w_{i+1} ≤ w_i``), which the default satisfies.

Memory cap (``max_in_flight = K``): a stage of the 1F1B family (1F1B, latency-aware, interleaved with one
chunk) holds ``w + 1`` micro-batches in flight at peak, so under a cap of ``K`` micro-batches per stage
replica its warm-up is ``min(w, K − 1)``. The same rule applies to every schedule of the family; it keeps
warm-ups non-increasing along the pipeline (so deadlock-free). Two schedules compared *at equal memory*
run under the same ``K`` on every stage: e.g. ``K = S`` (1F1B's own peak, on its first stage) leaves 1F1B
unchanged and caps the latency-aware warm-up at ``min(2(S − i) − 1, S − 1)``: no stage holds more than
1F1B's first stage does. GPipe and multi-chunk interleaving have fixed orders and ignore the cap (their
in-flight count is ``m`` resp. Megatron's; a planner checks it against memory instead). A plan carries the
cap in ``plan.extras["max_in_flight"]`` (:data:`MAX_IN_FLIGHT_KEY`, :func:`plan_max_in_flight`).

Every order satisfies, per stage: each ``(micro_batch, chunk)`` is run forward exactly once and backward
exactly once, the forward first; forwards run in ascending micro-batch order per chunk, and so do
backwards. Combined across stages (see :func:`replay`), the orders of one schedule never deadlock when
sends are asynchronous and a receive blocks until its matching send was issued.

Dependencies used by :func:`replay` (virtual stage ``v``, micro-batch ``j``):

1. ``F(j)`` at ``v > 0`` needs ``F(j)`` at ``v − 1`` finished plus the boundary transfer time;
2. ``B(j)`` at ``v < V − 1`` needs ``B(j)`` at ``v + 1`` finished plus the boundary transfer time;
3. ``B(j)`` at ``v`` needs ``F(j)`` at ``v`` (its activations);
4. a worker runs its operations one at a time in its order.

With data parallelism, micro-batch ``j`` of stage ``s`` goes to replica ``j mod dp_s``; each replica runs
the schedule over its own micro-batches (:func:`replica_ops`).

Everything here is pure Python (no torch, no I/O). ``stage_ops`` is ``O(m·chunks)``; :func:`replay` is
``O(W · N)`` for ``W`` workers and ``N`` operations in total.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from spiderflow.core.domain import Plan, Schedule
from spiderflow.core.errors import ValidationError

__all__ = [
    "MAX_IN_FLIGHT_KEY",
    "Op",
    "ReplayResult",
    "ScheduleDeadlockError",
    "cache_clear",
    "default_warmup",
    "peak_in_flight",
    "plan_max_in_flight",
    "replay",
    "replica_microbatches",
    "replica_ops",
    "stage_ops",
    "stage_warmup",
]

Op = tuple[str, int, int]
"""``(kind, micro_batch, chunk)`` with ``kind`` ``"F"`` or ``"B"``."""


class ScheduleDeadlockError(ValueError):
    """:func:`replay` found operations that can never run (their dependencies wait on each other)."""


def _check(n_stages: int, m: int, stage: int, chunks: int) -> None:
    for name, value, minimum in (("n_stages", n_stages, 1), ("m", m, 1), ("chunks", chunks, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValidationError(name, f"must be an integer ≥ {minimum}", value)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n_stages:
        raise ValidationError("stage", f"must be an integer in [0, {n_stages})", stage)


MAX_IN_FLIGHT_KEY = "max_in_flight"
"""``plan.extras`` key of the memory cap ``K`` (micro-batches in flight per stage replica; module docstring)."""


def plan_max_in_flight(plan: Plan) -> int | None:
    """The plan's in-flight cap ``K`` (``None``: uncapped)."""
    v = plan.extras.get(MAX_IN_FLIGHT_KEY)
    if v is None:
        return None
    if not math.isfinite(v) or v < 1 or v != int(v):
        raise ValidationError(f"plan.extras.{MAX_IN_FLIGHT_KEY}", "must be an integer ≥ 1", v)
    return int(v)


def _check_cap(max_in_flight: int | None) -> None:
    if max_in_flight is not None and (
        isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1
    ):
        raise ValidationError("max_in_flight", "must be an integer ≥ 1", max_in_flight)


def default_warmup(
    schedule: Schedule, n_stages: int, m: int, stage: int, *, chunks: int = 1, max_in_flight: int | None = None
) -> int:
    """Operations a stage runs before its first backward under ``schedule`` (see the module docstring);
    ``max_in_flight`` caps it at ``K − 1`` for the 1F1B family."""
    _check(n_stages, m, stage, chunks)
    _check_cap(max_in_flight)
    schedule = Schedule(schedule)
    if schedule is Schedule.GPIPE:
        return m
    if schedule is Schedule.ONE_F_ONE_B or (schedule is Schedule.INTERLEAVED_1F1B and chunks == 1):
        w = min(m, n_stages - stage - 1)
    elif schedule is Schedule.LATENCY_AWARE:
        w = min(m, 2 * (n_stages - stage) - 1)
    else:
        return min(m * chunks, 2 * (n_stages - stage - 1) + (chunks - 1) * n_stages)
    return w if max_in_flight is None else min(w, max_in_flight - 1)


def peak_in_flight(
    schedule: Schedule, n_stages: int, m: int, stage: int, *, max_in_flight: int | None = None
) -> int:
    """Micro-batches a single-replica stage holds in flight at peak under ``schedule`` (single chunk):
    ``m`` for GPipe, else ``min(m, w + 1)`` with the (capped) warm-up ``w``."""
    w = default_warmup(schedule, n_stages, m, stage, max_in_flight=max_in_flight)
    if Schedule(schedule) is Schedule.GPIPE:
        return m
    return min(m, w + 1)


def _interleaved_order(n_stages: int, m: int, chunks: int, *, backward: bool) -> list[tuple[int, int]]:
    """``(micro_batch, chunk)`` in Megatron's group order; chunks descending for backwards."""
    out: list[tuple[int, int]] = []
    for start in range(0, m, n_stages):
        group = range(start, min(m, start + n_stages))
        order = range(chunks - 1, -1, -1) if backward else range(chunks)
        for c in order:
            out.extend((j, c) for j in group)
    return out


def stage_ops(
    schedule: Schedule, n_stages: int, m: int, stage: int, *, chunks: int = 1, warmup: int | None = None
) -> list[Op]:
    """The operation order of stage ``stage`` (0-based) of an ``n_stages`` pipeline with ``m`` micro-batches.

    ``chunks > 1`` is only meaningful for :attr:`Schedule.INTERLEAVED_1F1B` (``chunks = 1`` there is plain
    1F1B; other schedules reject ``chunks > 1``). ``warmup`` overrides the number of operations run before
    the first backward (clamped to ``[0, m·chunks]``); ``None`` takes :func:`default_warmup`. GPipe ignores
    ``warmup`` only when it is ``None``: an explicit warm-up turns GPipe's order into 1F1B with that depth,
    so callers should pass it only for the 1F1B family. Raises :class:`ValidationError` on bad arguments.
    """
    _check(n_stages, m, stage, chunks)
    schedule = Schedule(schedule)
    if chunks > 1 and schedule is not Schedule.INTERLEAVED_1F1B:
        raise ValidationError("chunks", f"only {Schedule.INTERLEAVED_1F1B.value} runs more than one chunk", chunks)
    if chunks > 1 and m % n_stages:
        raise ValidationError("m", f"interleaved 1F1B needs a multiple of n_stages={n_stages} micro-batches", m)
    if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
        raise ValidationError("warmup", "must be an integer ≥ 0", warmup)
    fwd, bwd = _directions(n_stages if chunks > 1 else 1, m, chunks)
    total = len(fwd)
    w = default_warmup(schedule, n_stages, m, stage, chunks=chunks) if warmup is None else warmup
    w = max(0, min(total, w))
    # w forwards, then (forward, backward) pairs, then the remaining backwards.
    pairs: list[Op] = [fwd[0]] * (2 * (total - w))
    pairs[0::2] = fwd[w:]
    pairs[1::2] = bwd[: total - w]
    return [*fwd[:w], *pairs, *bwd[total - w :]]


@lru_cache(maxsize=64)
def _directions(n_stages: int, m: int, chunks: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """The forwards and the backwards of a stage in the order it meets them (the same on every stage):
    micro-batches ascending with one chunk (every schedule, interleaving's groups included), Megatron's
    group order with several. Built once per shape: an order is these two sequences interleaved."""
    if chunks > 1:
        return (tuple(("F", j, c) for j, c in _interleaved_order(n_stages, m, chunks, backward=False)),
                tuple(("B", j, c) for j, c in _interleaved_order(n_stages, m, chunks, backward=True)))
    return tuple(("F", j, 0) for j in range(m)), tuple(("B", j, 0) for j in range(m))


def replica_microbatches(m: int, dp: int, replica: int) -> list[int]:
    """Global indices of the step's micro-batches that replica ``replica`` of a ``dp``-way stage runs:
    ``j ≡ replica (mod dp)``, ascending. A replica may get none when ``dp > m``."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValidationError("dp", "must be an integer ≥ 1", dp)
    if not 0 <= replica < dp:
        raise ValidationError("replica", f"must be in [0, {dp})", replica)
    return list(range(replica, m, dp))


def stage_warmup(
    schedule: Schedule, n_stages: int, m: int, stage: int, *, max_dp: int = 1, chunks: int = 1,
    max_in_flight: int | None = None, min_dp: int | None = None,
) -> int:
    """The stage-wide warm-up :func:`replica_ops` uses by default (operations of the whole stage before its
    first backward): ``min(m, max_dp · default_warmup(...))`` for the single-chunk schedules (``m`` for
    GPipe), Megatron's unscaled ``default_warmup(...)`` for interleaved 1F1B with ``chunks > 1``.

    ``max_in_flight = K`` (1F1B family) further bounds it by ``min_dp · (K − 1)`` (``min_dp`` the smallest dp
    of the pipeline, default ``max_dp``): a replica of a ``d``-way stage runs at most ``⌈W/d⌉ ≤ K − 1``
    warm-up forwards, and the bound is the same on every stage, so warm-ups stay non-increasing along the
    pipeline (deadlock-free). With uniform dp ``D`` this is exactly ``D · min(w, K − 1)``."""
    if isinstance(max_dp, bool) or not isinstance(max_dp, int) or max_dp < 1:
        raise ValidationError("max_dp", "must be an integer ≥ 1", max_dp)
    low = max_dp if min_dp is None else min_dp
    if isinstance(low, bool) or not isinstance(low, int) or not 1 <= low <= max_dp:
        raise ValidationError("min_dp", f"must be an integer in [1, max_dp={max_dp}]", min_dp)
    _check_cap(max_in_flight)
    w = default_warmup(schedule, n_stages, m, stage, chunks=chunks)
    if Schedule(schedule) is Schedule.GPIPE or chunks > 1:
        return w
    out = min(m, max_dp * w)
    if max_in_flight is not None:
        out = min(out, low * (max_in_flight - 1))
    return out


def replica_ops(
    schedule: Schedule,
    n_stages: int,
    m: int,
    stage: int,
    *,
    dp: int = 1,
    replica: int = 0,
    max_dp: int | None = None,
    chunks: int = 1,
    warmup: int | None = None,
    max_in_flight: int | None = None,
    min_dp: int | None = None,
) -> list[Op]:
    """The order of replica ``replica`` of a ``dp``-way stage, in the step's global micro-batch numbering.

    The stage as a whole follows :func:`stage_ops` over all ``m`` micro-batches with a *global* warm-up
    ``W`` (``warmup`` if given, else ``min(m, D · default_warmup(...))`` with ``D = max_dp``, the largest
    dp of any stage of the pipeline, default ``dp``); the replica runs the sub-sequence of its own
    micro-batches (``j ≡ replica mod dp``). With uniform ``dp = D`` each replica therefore warms up exactly
    like a single-replica pipeline over its own micro-batches. Deadlock freedom carries over from the
    single-replica orders whenever ``W`` does not increase along the pipeline (the default guarantees it):
    a replica's order is a sub-sequence of a deadlock-free total order of its stage.

    Interleaved 1F1B (``chunks > 1``) keeps Megatron's *unscaled* warm-up ``W = default_warmup(...)``:
    its orders also depend on the wrap-around from the last stage back to the first, and a scaled warm-up
    can deadlock there (e.g. dp ``[1, 1, 2]``, ``m = 9``, two chunks); the sub-sequence argument holds for
    the unscaled one.

    ``max_in_flight`` (``K``) caps every replica's warm-up at ``K − 1`` (1F1B family; the cap of the
    module docstring; ``min_dp``: the smallest dp of the pipeline, see :func:`stage_warmup`, default 1 —
    safe for any dp layout, tighter than needed when every dp exceeds 1); an explicit ``warmup`` wins
    over it.
    """
    mine = replica_microbatches(m, dp, replica)
    if not mine:
        return []
    d = dp if max_dp is None else max_dp
    if isinstance(d, bool) or not isinstance(d, int) or d < dp:
        raise ValidationError("max_dp", f"must be an integer ≥ dp={dp}", max_dp)
    if warmup is None and Schedule(schedule) is not Schedule.GPIPE:
        warmup = stage_warmup(schedule, n_stages, m, stage, max_dp=d, chunks=chunks, max_in_flight=max_in_flight,
                              min_dp=1 if min_dp is None else min_dp)
    ops = stage_ops(schedule, n_stages, m, stage, chunks=chunks, warmup=warmup)
    return [op for op in ops if op[1] % dp == replica]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    """Outcome of :func:`replay`: ``finish[(stage, replica, op)]`` and ``start[...]`` in seconds (or
    abstract units), ``makespan`` the last finish time, ``peak_in_flight[stage][replica]`` the largest
    number of micro-batch chunks whose forward ran and backward has not."""

    start: dict[tuple[int, int, Op], float]
    finish: dict[tuple[int, int, Op], float]
    makespan: float
    peak_in_flight: tuple[tuple[int, ...], ...]


def _per_stage(value: float | Sequence[float], n: int, name: str) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * n
    out = [float(v) for v in value]
    if len(out) != n:
        raise ValidationError(name, f"needs {n} values", len(out))
    return out


def replay(
    orders: Sequence[Sequence[Sequence[Op]]],
    *,
    chunks: int = 1,
    forward_s: float | Sequence[float] = 1.0,
    backward_s: float | Sequence[float] = 2.0,
    link_s: float | Sequence[float] = 0.0,
) -> ReplayResult:
    """Run the per-worker orders against the dependencies 1–4 of the module docstring.

    ``orders[s][r]`` is the order of replica ``r`` of stage ``s`` (one replica: ``[[ops]]`` per stage).
    Each operation starts as soon as its worker is free and its dependencies are met (sends are
    asynchronous; a receive waits for its send); ``forward_s[s]``/``backward_s[s]`` are per-chunk durations
    of stage ``s``, ``link_s[s]`` the transfer time of boundary ``s → s+1`` (the wrap-around boundary of
    interleaving, last stage → first, uses ``link_s[-1]`` as well). Raises :class:`ScheduleDeadlockError`
    if some operation can never run, and :class:`ValidationError` if a micro-batch is owned twice.
    Complexity ``O(W·N)`` (``W`` workers, ``N`` operations).
    """
    n = len(orders)
    if n == 0:
        raise ValidationError("orders", "needs at least one stage", 0)
    fwd = _per_stage(forward_s, n, "forward_s")
    bwd = _per_stage(backward_s, n, "backward_s")
    links = _per_stage(link_s, max(n - 1, 1), "link_s") if n > 1 else [0.0]
    n_virtual = n * chunks
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) → finish time
    owner: dict[tuple[str, int, int], tuple[int, int]] = {}
    for s, replicas in enumerate(orders):
        for r, ops in enumerate(replicas):
            for kind, j, c in ops:
                key = (kind, j, c * n + s)
                if key in owner:
                    raise ValidationError(f"orders[{s}][{r}]", "operation scheduled twice", (kind, j, c))
                owner[key] = (s, r)
    pos = [[0] * len(replicas) for replicas in orders]
    free_at = [[0.0] * len(replicas) for replicas in orders]
    live = [[0] * len(replicas) for replicas in orders]
    peak = [[0] * len(replicas) for replicas in orders]
    start: dict[tuple[int, int, Op], float] = {}
    finish: dict[tuple[int, int, Op], float] = {}
    remaining = sum(len(ops) for replicas in orders for ops in replicas)

    def link(v: int) -> float:
        """Transfer time between virtual stages ``v`` and ``v + 1``."""
        return links[min(v % n, len(links) - 1)]

    def ready_time(s: int, kind: str, j: int, c: int) -> float | None:
        v = c * n + s
        if kind == "F":
            if v == 0:
                return 0.0
            prev = done.get(("F", j, v - 1))
            return None if prev is None else prev + link(v - 1)
        own = done.get(("F", j, v))
        if own is None:
            return None
        if v == n_virtual - 1:
            return own
        nxt = done.get(("B", j, v + 1))
        return None if nxt is None else max(own, nxt + link(v))

    while remaining:
        progressed = False
        for s, replicas in enumerate(orders):
            for r, ops in enumerate(replicas):
                while pos[s][r] < len(ops):
                    op = ops[pos[s][r]]
                    kind, j, c = op
                    if kind not in ("F", "B"):
                        raise ValidationError(f"orders[{s}][{r}]", "kind must be F or B", kind)
                    t = ready_time(s, kind, j, c)
                    if t is None:
                        break
                    t0 = max(t, free_at[s][r])
                    t1 = t0 + (fwd[s] if kind == "F" else bwd[s])
                    start[(s, r, op)] = t0
                    finish[(s, r, op)] = t1
                    done[(kind, j, c * n + s)] = t1
                    free_at[s][r] = t1
                    live[s][r] += 1 if kind == "F" else -1
                    peak[s][r] = max(peak[s][r], live[s][r])
                    pos[s][r] += 1
                    remaining -= 1
                    progressed = True
        if not progressed:
            stuck = [
                (s, r, orders[s][r][pos[s][r]])
                for s in range(n)
                for r in range(len(orders[s]))
                if pos[s][r] < len(orders[s][r])
            ]
            raise ScheduleDeadlockError(f"no worker can progress; waiting: {stuck[:6]}")
    return ReplayResult(
        start=start,
        finish=finish,
        makespan=max(finish.values(), default=0.0),
        peak_in_flight=tuple(tuple(p) for p in peak),
    )


def cache_clear() -> None:
    """Forget the memoised per-shape operation orders (a function of the shape alone)."""
    _directions.cache_clear()
