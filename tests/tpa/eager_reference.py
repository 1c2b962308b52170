"""The eager timeline pass as plain Python: the reference the compiled kernel
(:mod:`spiderflow.core.kernels.timeline`, through :func:`spiderflow.core.tpa.timeline._simulate_eager`) is compared
against, bitwise. Same arguments as the simulator's event loop hands it: the executors' orders ``flat``
(executor ``execs[e]`` = (stage, replica)), chunks, per-stage op durations and the link matrices."""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Sequence

from spiderflow.core.tpa.timeline import Op, ScheduleDeadlockError, StageTiming, Timeline, _op_shape

_MICRO_BATCH = operator.itemgetter(1)


def _simulate_eager(
    stages: Sequence[StageTiming],
    flat: Sequence[Sequence[Op]],
    execs: Sequence[tuple[int, int]],
    chunks: int,
    dur_f: Sequence[float],
    dur_b: Sequence[float],
    serialise_s: Sequence[Sequence[float]],
    latency_s: Sequence[Sequence[float]],
    ends: list[float] | None = None,
    arrivals: list[float] | None = None,
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
    operands as in the event loop, so the times are identical. Ops are read straight from the orders
    (their keys worked out once per kind and chunk of a stage).

    ``ends`` and ``arrivals`` (lists of ``2·(max micro-batch + 1)·n·chunks`` infinities, filled in place) take
    each op's end time and its output's arrival time, indexed by the op's key (:func:`_op_key`).
    """
    n = len(stages)
    inf = math.inf
    n_exec = len(execs)
    last_virtual = n * chunks - 1
    jm = 2 * n * chunks
    max_j = max((max(map(_MICRO_BATCH, order)) for order in flat if order), default=0)
    n_keys = jm * (max_j + 1)
    arrival = [inf] * n_keys if arrivals is None else arrivals
    rec = ends is not None
    end_at: list[float] = ends if ends is not None else []
    waiter = [-1] * n_keys
    link_free = [0.0] * (n * n)
    shared = [st.replicas > 1 for st in stages]
    clock = [0.0] * n_exec  # when each executor is free
    ptr = [0] * n_exec
    stage_end = [0.0] * n
    # Per executor: (kind, chunk) → shape, all of them worked out up front (keyed by kind alone without
    # interleaving).
    shapes: list[dict[object, tuple[int, int, int, int, float]]] = []
    for i, _ in execs:
        shapes.append({(k if chunks == 1 else (k, c)): _op_shape(k, c, i, n, last_virtual,
                                                                 dur_f[i] if k == "F" else dur_b[i])
                       for k in ("F", "B") for c in range(chunks)})
    one = chunks == 1
    pending: list[tuple[float, int, int, int]] = []  # sends on shared links: (end, executor, key, dst)
    push = heapq.heappush
    pop = heapq.heappop
    todo = list(range(n_exec - 1, -1, -1))
    while True:
        while todo:
            e = todo.pop()
            i = execs[e][0]
            order = flat[e]
            p = ptr[e]
            t = clock[e]
            end = len(order)
            ser_i = serialise_s[i]
            lat_i = latency_s[i]
            many = shared[i]
            shp = shapes[e]
            while p < end:
                kind, j, c = order[p]
                dep_off, own_off, mode, dst, dur = shp[kind] if one else shp[(kind, c)]
                base = jm * j
                if dep_off >= 0:
                    at = arrival[base + dep_off]
                    if at == inf:
                        waiter[base + dep_off] = e
                        break
                    if at > t:
                        t = at
                t = t + dur
                p += 1
                if rec:
                    end_at[base + own_off] = t
                if mode:
                    own = base + own_off
                    if mode == 1:
                        at = t
                    elif many:
                        push(pending, (t, e, own, dst))
                        continue
                    else:
                        li = i * n + dst
                        lf = link_free[li]
                        start_tx = t if t >= lf else lf
                        ser = ser_i[dst]
                        link_free[li] = start_tx + ser
                        at = start_tx + ser + lat_i[dst]
                    arrival[own] = at
                    w = waiter[own]
                    if w >= 0:
                        waiter[own] = -1
                        todo.append(w)
            ptr[e] = p
            clock[e] = t
            if t > stage_end[i]:
                stage_end[i] = t
        if not pending:
            break
        t, e, own, dst = pop(pending)
        i = execs[e][0]
        li = i * n + dst
        lf = link_free[li]
        start_tx = t if t >= lf else lf
        ser = serialise_s[i][dst]
        link_free[li] = start_tx + ser
        arrival[own] = start_tx + ser + latency_s[i][dst]
        w = waiter[own]
        if w >= 0:
            waiter[own] = -1
            todo.append(w)
    stuck = [e for e in range(n_exec) if ptr[e] < len(flat[e])]
    if stuck:
        i, r = execs[stuck[0]]
        raise ScheduleDeadlockError(
            f"op order deadlocks: stage {i} replica {r} waits at {flat[stuck[0]][ptr[stuck[0]]]}"
        )
    step = max((stage_end[i] + stages[i].allreduce_s for i in range(n)), default=0.0)
    return Timeline(
        n_stages=n, replicas=tuple(st.replicas for st in stages), ops=(), transfers=(),
        makespan_s=max(stage_end, default=0.0), step_s=step,
    )
