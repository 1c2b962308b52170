"""The timeline simulator's eager pass (:func:`spiderflow.core.tpa.timeline._simulate_eager`) as a numba kernel.

Executors run their static op orders as far as their inputs allow; a transfer between stages takes the
FIFO directed link ``(src, dst)``: it starts at ``max(op end, link free)``, frees the link ``ser`` later
and arrives ``(start + ser) + lat``. Sends of stages with several replicas share their links and are taken
in time order (ties: executor index, then key) from a heap once every executor has run as far as it can.
The model, its keys and its guarantees are :mod:`spiderflow.core.tpa.timeline`'s; this kernel evaluates the same
expressions on the same operands in the same order, so its times are bitwise those of the plain Python
formulation (kept in the tests as the reference).

Encoding of the inputs (built by the wrapper in :mod:`spiderflow.core.tpa.timeline`):

* ``code[p]``: op ``p``'s shape index ``2·chunk + [B]`` (chunk ``0`` when the pipeline has one chunk);
  ``micro_batch[p]`` its micro-batch. Executor ``e``'s ops are ``p ∈ [start[e], start[e + 1])``, in order;
  ``exec_stage[e]`` its stage. Executors are numbered stage by stage, replica by replica.
* An op of micro-batch ``j`` files its output under key ``2·n·chunks·j + own`` and waits for the key
  ``2·n·chunks·j + dep`` (``dep < 0``: no input); ``arrival`` is indexed by key (``inf``: not produced).
"""

from __future__ import annotations

import heapq

import numpy as np
import numpy.typing as npt

from spiderflow.core.kernels import kernel, register_warmup

__all__ = ["simulate_eager"]

_NOTHING = 0
"""Op-end mode: the output goes nowhere (the first virtual stage's backward)."""
_RELEASE = 1
"""Op-end mode: the output is available on this stage at the op's end."""
_SEND = 2
"""Op-end mode: the output crosses the link to another stage."""


@kernel
def _shapes(
    n: int, chunks: int, dur_f: npt.NDArray[np.float64], dur_b: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64],
           npt.NDArray[np.float64]]:
    """Per ``[stage, 2·chunk + [B]]``: ``(dep offset or −1, own offset, mode, dst stage or −1, duration)``.

    A forward of virtual stage ``u = chunk·n + stage`` waits for ``F(u − 1)`` (nothing when ``u = 0``) and
    feeds ``u + 1`` (the last virtual stage its own backward); a backward waits for ``B(u + 1)`` (the last
    virtual stage: its own forward) and feeds ``u − 1`` (nothing when ``u = 0``). Mode: nothing / released
    on this stage (same stage or same virtual stage) / sent to ``dst``."""
    nc = 2 * chunks
    last_virtual = n * chunks - 1
    dep_off = np.empty((n, nc), np.int64)
    own_off = np.empty((n, nc), np.int64)
    mode = np.empty((n, nc), np.int64)
    dst = np.empty((n, nc), np.int64)
    dur = np.empty((n, nc), np.float64)
    for i in range(n):
        for c in range(chunks):
            u = c * n + i
            for b in range(2):
                s = 2 * c + b
                if b == 0:
                    dep_off[i, s] = -1 if u == 0 else 2 * (u - 1)
                    dst_u = u + 1 if u < last_virtual else u
                    own_off[i, s] = 2 * u
                    dur[i, s] = dur_f[i]
                else:
                    dep_off[i, s] = 2 * u if u == last_virtual else 2 * (u + 1) + 1
                    dst_u = u - 1
                    own_off[i, s] = 2 * u + 1
                    dur[i, s] = dur_b[i]
                if dst_u < 0:
                    mode[i, s] = _NOTHING
                    dst[i, s] = -1
                else:
                    d = dst_u % n
                    dst[i, s] = d
                    mode[i, s] = _RELEASE if (dst_u == u or d == i) else _SEND
    return dep_off, own_off, mode, dst, dur


@kernel
def simulate_eager(
    code: npt.NDArray[np.int16],
    micro_batch: npt.NDArray[np.int32],
    start: npt.NDArray[np.int64],
    exec_stage: npt.NDArray[np.int64],
    chunks: int,
    dur_f: npt.NDArray[np.float64],
    dur_b: npt.NDArray[np.float64],
    ser: npt.NDArray[np.float64],
    lat: npt.NDArray[np.float64],
    shared: npt.NDArray[np.bool_],
    arrival: npt.NDArray[np.float64],
    ends: npt.NDArray[np.float64],
    record: bool,
) -> tuple[int, int, npt.NDArray[np.float64]]:
    """Run every executor's order to its end (or until nothing can move) and return ``(stuck executor or −1,
    its next op's position in its order, per-stage end of the last op)``.

    ``n = dur_f.size`` stages; ``ser[a, b]``/``lat[a, b]`` the link ``a → b``; ``shared[i]``: stage ``i``'s
    sends share their links (several replicas; the times are the event loop's when every op then lasts a
    positive time). ``arrival``
    (``inf`` everywhere, at least as many entries as keys) receives each output's arrival time; with
    ``record``, ``ends`` (same size) each op's end time, both by key. The stuck executor is the first, in
    executor order, that has not run its whole order (a deadlocking order)."""
    n = dur_f.size
    n_exec = exec_stage.size
    jm = 2 * n * chunks
    inf = np.inf
    dep_off, own_off, mode, dst_of, dur_of = _shapes(n, chunks, dur_f, dur_b)
    waiter = np.full(arrival.size, -1, np.int64)  # the executor parked on a key (each key has one consumer)
    link_free = np.zeros(n * n, np.float64)
    clock = np.zeros(n_exec, np.float64)  # when each executor is free
    ptr = start[:n_exec].copy()
    stage_end = np.zeros(n, np.float64)
    pending = [(0.0, 0, 0, 0)]  # sends on shared links: (end, executor, key, dst)
    pending.pop()
    # LIFO of executors to advance (each at most once: only a parked executor is woken).
    todo = np.empty(n_exec, np.int64)
    for k in range(n_exec):
        todo[k] = n_exec - 1 - k
    top = n_exec
    while True:
        while top > 0:
            top -= 1
            e = todo[top]
            i = exec_stage[e]
            p = ptr[e]
            t = clock[e]
            end = start[e + 1]
            many = shared[i]
            while p < end:
                s = code[p]
                base = jm * micro_batch[p]
                dep = dep_off[i, s]
                if dep >= 0:
                    at = arrival[base + dep]
                    if at == inf:
                        waiter[base + dep] = e
                        break
                    if at > t:
                        t = at
                t = t + dur_of[i, s]
                p += 1
                own = base + own_off[i, s]
                if record:
                    ends[own] = t
                md = mode[i, s]
                if md != _NOTHING:
                    if md == _RELEASE:
                        at = t
                    elif many:
                        heapq.heappush(pending, (t, e, own, dst_of[i, s]))
                        continue
                    else:
                        dst = dst_of[i, s]
                        li = i * n + dst
                        lf = link_free[li]
                        start_tx = t if t >= lf else lf
                        sr = ser[i, dst]
                        link_free[li] = start_tx + sr
                        at = start_tx + sr + lat[i, dst]
                    arrival[own] = at
                    w = waiter[own]
                    if w >= 0:
                        waiter[own] = -1
                        todo[top] = w
                        top += 1
            ptr[e] = p
            clock[e] = t
            if t > stage_end[i]:
                stage_end[i] = t
        if len(pending) == 0:
            break
        t, e, own, dst = heapq.heappop(pending)
        i = exec_stage[e]
        li = i * n + dst
        lf = link_free[li]
        start_tx = t if t >= lf else lf
        sr = ser[i, dst]
        link_free[li] = start_tx + sr
        arrival[own] = start_tx + sr + lat[i, dst]
        w = waiter[own]
        if w >= 0:
            waiter[own] = -1
            todo[top] = w
            top += 1
    for e in range(n_exec):
        if ptr[e] < start[e + 1]:
            return e, ptr[e] - start[e], stage_end
    return -1, 0, stage_end


@register_warmup
def _warm() -> None:
    """Both modes on two stages, the first with two replicas (a shared link): GPipe over two micro-batches."""
    code = np.array([0, 1, 0, 1, 0, 0, 1, 1], np.int16)
    micro_batch = np.array([0, 0, 1, 1, 0, 1, 0, 1], np.int32)
    start = np.array([0, 2, 4, 8], np.int64)
    exec_stage = np.array([0, 0, 1], np.int64)
    for a in (code, micro_batch, start, exec_stage):
        a.flags.writeable = False  # as the wrapper passes them (one specialisation)
    dur_f = np.array([1.0, 1.0])
    dur_b = np.array([2.0, 2.0])
    links = np.array([[0.0, 0.5], [0.5, 0.0]])
    shared = np.array([True, False])
    for record in (False, True):
        arrival = np.full(8, np.inf)
        ends = np.full(8 if record else 0, np.inf)
        simulate_eager(code, micro_batch, start, exec_stage, 1, dur_f, dur_b, links, links, shared, arrival,
                       ends, record)
