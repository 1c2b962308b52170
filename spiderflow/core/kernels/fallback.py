"""Kernels of the level-1 fallback planner (:func:`spiderflow.core.placement.common.fallback_plan_chain`): the
per-block search over ``tp × pp × sub-stage`` layouts, the chain aggregate, the boundary local search and
the memory-first dynamic programme.

The formulas, the iteration orders (tensor degrees doubling, ``pp`` in :data:`PP_CHOICES`, small sub-stages
first before big ones first) and the tie rules (strict improvements, lexicographic ``(memory excess,
objective)`` comparisons) are those documented in :mod:`spiderflow.core.placement.common`; every floating-point
expression is evaluated on the same operands in the same order, so every result is bitwise the plain Python
formulation's (kept in the tests as the reference).

Encoding of one evaluator (an ordered allocation of ``k`` clusters, built by
:class:`spiderflow.core.placement.common._ChainEval`):

* ``pos[i, :4]``: position ``i``'s ``(memory bytes per GPU left after the reserve, intra-node Gbit/s,
  inter-node Gbit/s, P_int)``, then ``pos[i, 4 + 4t : 8 + 4t]`` per tensor degree ``2^t`` tried: ``(T per
  layer, activation bytes per layer, head activation bytes, head T)`` (``T`` per layer with the cluster's
  calibrated fixed time per layer ``o_c``, as :func:`spiderflow.core.costmodel.stage_compute_time` adds it; head
  bytes: the loss with one micro-batch in flight, as the last sub-stage of a 1F1B chain holds,
  :meth:`~spiderflow.core.placement.common.JobConsts.act_head`);
  then ``pos[i, 20:24]``: the work outside the blocks a profile measured on the position's cluster (0 where
  not): the embedding's seconds per micro-batch (on sub-stage 0 of a block holding layer 0, in its ``T``),
  the embedding's optimizer step and the input pipeline's seconds per micro-batch of ``b`` samples (per step,
  times ``⌈m/dp⌉``, on that sub-stage), the head's optimizer step (per step, on the head sub-stage): the
  per-step terms join the sub-stage's gradient sync in ``Y``, as :func:`spiderflow.core.costmodel.breakdown`
  adds them to its optimizer step (:func:`~spiderflow.core.costmodel.measured_outer_time`,
  :func:`~spiderflow.core.costmodel.measured_step_extra`); ``pos[i, 24]`` (:data:`OPTIMIZER`): the cluster's
  calibrated optimizer seconds per layer and step ``u_c`` (0 unless calibrated; a sub-stage of ``ℓ`` layers adds
  ``ℓ·u_c`` to its ``Y``, as :func:`~spiderflow.core.costmodel.breakdown` adds it to its gradient sync);
  ``pos_i[i]``: ``(GPUs, GPUs per node, tensor degrees tried)``; ``hops[i]``: the activation transfer seconds
  between positions ``i`` and ``i + 1``.
* ``job_f``: ``(parameters per layer, embedding parameters, head parameters, state bytes per parameter,
  gradient bytes per value)`` (the last two in the job's precision: 16 and 2 in bf16); ``job_i``:
  ``(micro-batches, layers, GPU mode, slack)``; GPU mode 0: prefer shapes that use every GPU, 1: exact GPUs
  (at most ``slack`` idle), 2: every shape ``⌊g/(tp·pp)⌋`` alike (see :func:`_search_block`).
* Block memo (a block depends only on its position, its layer count and the stages downstream of its
  start, given that every block holds at least one layer; at ``m`` or more stages downstream every sub-stage
  holds all its micro-batches, so counts are capped at ``D = min(m, 16·k)``, ``slots.shape[1] − 1``): entry
  ``e = (i·(D + 1) + min(d, D))·(L + 1) + n`` of a block of ``n`` layers with ``d`` stages downstream is
  valid when ``filled[e]``, with the block's
  ``(excess, local, tmax, tsum, y, tmax / dp)`` in ``memo_f[e]`` and ``(pp, tp, dp, bigger sub-stages
  first)`` in ``memo_i[e]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
from numba import njit

from spiderflow.core.kernels import kernel, register_warmup
from spiderflow.core.kernels.formulas import allreduce_time as _allreduce_time

__all__ = ["OPTIMIZER", "OUTER", "POS_WIDTH", "PP_CHOICES", "evaluate_split", "memory_first", "new_memo",
           "optimise_split"]

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]
BArr = npt.NDArray[np.bool_]
F = TypeVar("F", bound=Callable[..., Any])

PP_CHOICES = (1, 2, 3, 4, 5, 6, 8, 12, 16)
"""Pipeline sub-stages a block may use, in the order they are tried."""
_SHRINK = 1 - 1e-12
"""At equal memory excess, a boundary move wins only with a step time below this fraction of the best one."""
_CAP_SLACK = 1.0 + 1e-9
"""Relative slack on the layers a sub-stage holds: never below the cost model's count (it sums the terms in
another order)."""
POS_WIDTH = 25
"""Columns of ``pos``: four per position, four per tensor degree ``1, 2, 4, 8``, then from :data:`OUTER` four
columns of measured work outside the blocks, then the calibrated optimizer time per layer (:data:`OPTIMIZER`)."""
OUTER = 20
"""First column of ``pos`` holding the measured work outside the blocks: embedding seconds per micro-batch,
embedding optimizer seconds per step, input-pipeline seconds per micro-batch, head optimizer seconds per
step."""
OPTIMIZER = 24
"""Column of ``pos`` holding the cluster's calibrated optimizer seconds per layer and training step (0 unless
calibrated)."""


def _inline(fn: F) -> F:
    """``fn`` compiled as :func:`~spiderflow.core.kernels.kernel` compiles it, and inlined (numba IR) into every
    kernel calling it: the search's innermost helpers run once per candidate move, where a call and the
    reference counting of its array arguments would cost more than their work. The arithmetic is the same."""
    return cast(F, njit(inline="always", cache=True)(fn))


@kernel
def _search_block(i: int, nl: int, ds: int, has_embed: bool, head: bool, pos: FArr, pos_i: IArr,
                  job_f: FArr, job_i: IArr, out_f: FArr, out_i: IArr, e: int) -> None:
    """Choose block ``i``'s configuration (``nl`` layers, ``ds`` stages downstream of its start) into
    ``out_f[e]``/``out_i[e]``: pass 1 over the configurations using every GPU (and ``pp = 1``), pass 2 over the
    others only when nothing of pass 1 fits memory (exact GPUs, mode 1: one pass over the configurations leaving
    at most ``slack`` GPUs idle; every shape, mode 2: one pass over all of them, so ``pp 3 × tp 2 × dp 5`` on 30
    of 31 GPUs competes with ``tp 4 × dp 7`` on 28). Nothing valid: ``tp = pp = 1``, ``dp = g``, infinite excess
    and times."""
    mem = pos[i, 0]
    intra = pos[i, 1]
    inter = pos[i, 2]
    p_int = pos[i, 3]
    g = pos_i[i, 0]
    gpn = pos_i[i, 1]
    ntp = pos_i[i, 2]
    p_layer = job_f[0]
    p_embed = job_f[1]
    p_head = job_f[2]
    w_state = job_f[3]
    w_grad = job_f[4]
    m = job_i[0]
    exact = job_i[2] == 1
    every = job_i[2] == 2
    slack = job_i[3]
    emb_t = pos[i, OUTER] if has_embed else 0.0
    emb_opt = pos[i, OUTER + 1]
    data_mb = pos[i, OUTER + 2]
    head_opt = pos[i, OUTER + 3]
    opt_l = pos[i, OPTIMIZER]
    inf = math.inf
    found = False
    b_excess = inf
    b_local = inf
    b_pp = 1
    b_tp = 1
    b_dp = g
    b_big = 0
    b_tmax = inf
    b_tsum = inf
    b_y = 0.0
    for pass_no in range(2):
        exhaustive = pass_no == 1
        if exhaustive and (exact or every or (found and b_excess <= 0)):
            break
        for t in range(ntp):
            tp = 1 << t
            per_t = pos[i, 4 + 4 * t]
            act_l = pos[i, 5 + 4 * t]
            act_h = pos[i, 6 + 4 * t]
            head_t = pos[i, 7 + 4 * t] if head else 0.0
            for pp in PP_CHOICES:
                if pp > nl or tp * pp > g:
                    break
                dp = g // (tp * pp)
                if exact:
                    if dp * tp * pp < g - slack:
                        continue
                elif not every and (dp * tp * pp == g or pp == 1) == exhaustive:
                    continue
                base = nl // pp
                rem = nl % pp
                bdp = intra if tp * dp <= gpn else inter
                per_replica = math.ceil(m / dp)
                p_stage = p_int if pp > 1 else 0.0
                bounds = 2 * (pp - 1) * p_int
                tsum = nl * per_t + head_t + emb_t
                top = base + 1 if rem else base
                n_small = pp - rem
                orders = 2 if rem and head_t > 0 else 1
                for order in range(orders):
                    big_first = order == 1
                    last_size = base if big_first else top
                    a = last_size * per_t + head_t
                    if pp == 1:
                        a += emb_t
                    b = top * per_t
                    tmax = b if b > a else a
                    if pp > 1:
                        c = (top if big_first else base) * per_t + emb_t  # sub-stage 0 (the embedding)
                        if c > tmax:
                            tmax = c
                    r = tmax / dp
                    local = (m - 1) * (p_stage if p_stage > r else r) + tsum
                    if found and b_excess <= 0.0 and local + bounds >= b_local:
                        continue
                    ymax = 0.0
                    excess = -inf
                    mid = rem if big_first else n_small
                    nj = 1 if pp == 1 else (3 if 0 < mid < pp - 1 else 2)
                    for q in range(nj):
                        if q == 0:
                            j = 0
                        elif nj == 3 and q == 1:
                            j = mid
                        else:
                            j = pp - 1
                        sz = (base + 1 if j < rem else base) if big_first else (base if j < n_small else base + 1)
                        is_last = j == pp - 1 and head
                        params = sz * p_layer + (p_embed if j == 0 and has_embed else 0.0) + (
                            p_head if is_last else 0.0)
                        y = _allreduce_time(w_grad * params / tp, dp, bdp, 0.0) if dp > 1 else 0.0
                        if opt_l != 0.0:
                            y += sz * opt_l
                        if j == 0 and has_embed:
                            y += emb_opt + data_mb * per_replica
                        if is_last:
                            y += head_opt
                        if y > ymax:
                            ymax = y
                        ahead = ds + pp - j
                        inflight = per_replica if per_replica <= ahead else ahead
                        act = sz * act_l + (act_h if is_last else 0.0)
                        x = w_state * params / tp + inflight * act - mem
                        if x > excess:
                            excess = x
                    local += bounds + ymax
                    ex0 = 0.0 if excess < 0.0 else excess  # max(excess, 0.0)
                    if not found or (local < b_local if ex0 == b_excess else ex0 < b_excess):
                        found = True
                        b_excess = ex0
                        b_local = local
                        b_pp = pp
                        b_tp = tp
                        b_dp = dp
                        b_big = 1 if big_first else 0
                        b_tmax = tmax
                        b_tsum = tsum
                        b_y = ymax
    out_f[e, 0] = b_excess
    out_f[e, 1] = b_local
    out_f[e, 2] = b_tmax
    out_f[e, 3] = b_tsum
    out_f[e, 4] = b_y
    out_f[e, 5] = b_tmax / b_dp
    out_i[e, 0] = b_pp
    out_i[e, 1] = b_tp
    out_i[e, 2] = b_dp
    out_i[e, 3] = b_big


@_inline
def _block(i: int, first: int, nl: int, ds: int, pos: FArr, pos_i: IArr, job_f: FArr, job_i: IArr,
           slots: IArr, filled: BArr, memo_f: FArr, memo_i: IArr) -> int:
    """The memo entry of block ``i`` starting at layer ``first`` with ``nl`` layers and ``ds`` stages
    downstream of its start (searched on a miss). The blocks of a split hold at least one layer each and every
    layer in all (so a position's first and last layers say whether it holds the embedding and the head);
    ``ValueError`` otherwise."""
    layers = job_i[1]
    width = layers + 1
    if nl < 1 or nl > layers or (first == 0) != (i == 0) or (first + nl == layers) != (i == pos.shape[0] - 1):
        raise ValueError("the blocks of a split hold at least one layer each and every layer in all")
    cap = slots.shape[1] - 1
    d = ds if ds < cap else cap  # at m or more stages downstream every sub-stage holds all its micro-batches
    e: int = (i * (cap + 1) + d) * width + nl
    if not filled[e]:
        _search_block(i, nl, ds, first == 0, first + nl - 1 == layers - 1, pos, pos_i, job_f, job_i,
                      memo_f, memo_i, e)
        filled[e] = True
    return e


@_inline
def _aggregate(refs: IArr, j: int, ea: int, eb: int, memo_f: FArr, memo_i: IArr, pos: FArr, hops: FArr,
               m: int) -> tuple[float, float]:
    """``(memory excess, step time)`` of the chain of memo entries ``refs`` with entries ``j`` and ``j + 1``
    replaced by ``ea`` and ``eb`` (``j = -2``: none): ``(m − 1)·max(beat, boundaries) + Σ T + 2·Σ boundaries +
    max Y``, summed in chain order, internal boundaries before the hops."""
    inf = math.inf
    bott = -inf
    tsum = 0.0
    excess = 0.0
    y = -inf
    bound_max = -inf
    bound_sum = 0.0
    for q in range(refs.shape[0]):
        e = ea if q == j else (eb if q == j + 1 else refs[q])
        r = memo_f[e, 5]
        if r > bott:
            bott = r
        tsum += memo_f[e, 3]
        excess += memo_f[e, 0]
        if memo_f[e, 4] > y:
            y = memo_f[e, 4]
        pp = memo_i[e, 0]
        if pp > 1:
            p = pos[q, 3]
            if p > bound_max:
                bound_max = p
            for _ in range(pp - 1):
                bound_sum += p
    for h in range(hops.shape[0]):
        p = hops[h]
        if p > bound_max:
            bound_max = p
        bound_sum += p
    if bound_max == -inf:
        bound_max = 0.0
    step = (m - 1) * (bott if bott >= bound_max else bound_max) + tsum
    step += 2.0 * bound_sum + y
    return excess, step


@kernel
def _evaluate(sizes: IArr, pps: IArr, pos: FArr, pos_i: IArr, hops: FArr, job_f: FArr, job_i: IArr,
              slots: IArr, filled: BArr, memo_f: FArr, memo_i: IArr, refs: IArr) -> tuple[float, float]:
    """``(memory excess, step time)`` of a split given assumed sub-stage counts ``pps``; the blocks' memo
    entries into ``refs``. ``ValueError`` unless there is one size and one count per position."""
    if sizes.shape[0] != pos.shape[0] or pps.shape[0] != pos.shape[0]:
        raise ValueError("one layer count and one sub-stage count per position")
    total = 0
    for q in range(pps.shape[0]):
        total += pps[q]
    offset = 0
    first = 0
    for q in range(sizes.shape[0]):
        refs[q] = _block(q, first, sizes[q], total - pps[q] - offset, pos, pos_i, job_f, job_i, slots,
                         filled, memo_f, memo_i)
        offset += pps[q]
        first += sizes[q]
    return _aggregate(refs, -2, 0, 0, memo_f, memo_i, pos, hops, job_i[0])


@kernel
def _copy_blocks(refs: IArr, memo_f: FArr, memo_i: IArr, out_f: FArr, out_i: IArr) -> None:
    for q in range(refs.shape[0]):
        for c in range(5):
            out_f[q, c] = memo_f[refs[q], c]
        for c in range(4):
            out_i[q, c] = memo_i[refs[q], c]


@kernel
def evaluate_split(sizes: IArr, pps: IArr, pos: FArr, pos_i: IArr, hops: FArr, job_f: FArr,
                   job_i: IArr, slots: IArr, filled: BArr, memo_f: FArr, memo_i: IArr, out_f: FArr,
                   out_i: IArr) -> tuple[float, float]:
    """``(memory excess, step time)`` of the split ``sizes`` (every entry ≥ 1) given assumed sub-stage counts
    ``pps``; the blocks into ``out_f``/``out_i`` (``k × 5``, ``k × 4``, memo columns)."""
    refs = np.empty(sizes.shape[0], dtype=np.int64)
    key = _evaluate(sizes, pps, pos, pos_i, hops, job_f, job_i, slots, filled, memo_f, memo_i, refs)
    _copy_blocks(refs, memo_f, memo_i, out_f, out_i)
    return key


@kernel
def _evaluate_exact(sizes: IArr, pos: FArr, pos_i: IArr, hops: FArr, job_f: FArr, job_i: IArr, slots: IArr,
                    filled: BArr, memo_f: FArr, memo_i: IArr, refs: IArr) -> tuple[float, float]:
    """``(memory excess, step time)`` of a split with every block priced under the stages its own downstream
    blocks form: blocks chosen from the last to the first, each with the sum of the sub-stage counts chosen
    after it as its stages downstream (the in-flight depth the final structure has); the blocks' memo entries
    into ``refs``."""
    k = sizes.shape[0]
    first = 0
    for q in range(k):
        first += sizes[q]
    ds = 0
    for q in range(k - 1, -1, -1):
        first -= sizes[q]
        refs[q] = _block(q, first, sizes[q], ds, pos, pos_i, job_f, job_i, slots, filled, memo_f, memo_i)
        ds += memo_i[refs[q], 0]
    return _aggregate(refs, -2, 0, 0, memo_f, memo_i, pos, hops, job_i[0])


@kernel
def optimise_split(sizes: IArr, local_search: bool, pos: FArr, pos_i: IArr, hops: FArr, job_f: FArr,
                   job_i: IArr, slots: IArr, filled: BArr, memo_f: FArr, memo_i: IArr, out_f: FArr,
                   out_i: IArr) -> tuple[float, float]:
    """The level-1 split search from ``sizes`` (updated in place; every entry ≥ 1).

    Every split is evaluated exactly (:func:`_evaluate_exact`: each block under the sub-stages its downstream
    blocks choose). With ``local_search``, move one boundary by ``-4, -1, 1, 4`` layers (boundaries left to
    right) to the best strict improvement of ``(excess, step)`` (the step must drop by more than a relative
    1e-12 at equal excess) until none improves; a move re-chooses blocks ``j + 1`` and ``j`` and, when their
    sub-stage counts change, every block before them. The final blocks go into ``out_f``/``out_i``; returns
    ``(excess, step)`` of the final split."""
    k = sizes.shape[0]
    m = job_i[0]
    cur = np.empty(k, dtype=np.int64)
    trial = np.empty(k, dtype=np.int64)
    after = np.empty(k + 1, dtype=np.int64)  # after[q]: sub-stages of the blocks after q (current split)
    starts = np.empty(k, dtype=np.int64)
    cur_ex, cur_step = _evaluate_exact(sizes, pos, pos_i, hops, job_f, job_i, slots, filled, memo_f, memo_i, cur)
    improved = local_search
    while improved:
        improved = False
        after[k - 1] = 0
        for q in range(k - 2, -1, -1):
            after[q] = after[q + 1] + memo_i[cur[q + 1], 0]
        first = 0
        for q in range(k):
            starts[q] = first
            first += sizes[q]
        best_ex = cur_ex
        best_step = cur_step
        best_j = -1
        best_delta = 0
        for j in range(k - 1):
            for delta in (-4, -1, 1, 4):
                a = sizes[j] + delta
                b = sizes[j + 1] - delta
                if a < 1 or b < 1:
                    continue
                eb = _block(j + 1, starts[j] + a, b, after[j + 1], pos, pos_i, job_f, job_i, slots, filled,
                            memo_f, memo_i)
                ea = _block(j, starts[j], a, after[j + 1] + memo_i[eb, 0], pos, pos_i, job_f, job_i, slots,
                            filled, memo_f, memo_i)
                if memo_i[ea, 0] + memo_i[eb, 0] == memo_i[cur[j], 0] + memo_i[cur[j + 1], 0]:
                    ex, step = _aggregate(cur, j, ea, eb, memo_f, memo_i, pos, hops, m)
                else:
                    for q in range(k):
                        trial[q] = cur[q]
                    trial[j] = ea
                    trial[j + 1] = eb
                    ds = after[j + 1] + memo_i[eb, 0] + memo_i[ea, 0]
                    for q in range(j - 1, -1, -1):
                        trial[q] = _block(q, starts[q], sizes[q], ds, pos, pos_i, job_f, job_i, slots, filled,
                                          memo_f, memo_i)
                        ds += memo_i[trial[q], 0]
                    ex, step = _aggregate(trial, -2, 0, 0, memo_f, memo_i, pos, hops, m)
                if (step < best_step * _SHRINK) if ex == best_ex else (ex < best_ex):
                    best_ex = ex
                    best_step = step
                    best_j = j
                    best_delta = delta
        if best_j >= 0:
            sizes[best_j] += best_delta
            sizes[best_j + 1] -= best_delta
            cur_ex, cur_step = _evaluate_exact(sizes, pos, pos_i, hops, job_f, job_i, slots, filled, memo_f,
                                               memo_i, cur)
            improved = True
    _copy_blocks(cur, memo_f, memo_i, out_f, out_i)
    return cur_ex, cur_step


@kernel
def _balanced_capacity(i: int, k: int, tp: int, t: int, pp: int, downstream: int, pos: FArr, pos_i: IArr,
                       job_f: FArr, m: int, held: IArr) -> tuple[int, bool]:
    """The most layers block ``i`` of ``k`` holds at degrees ``(tp = 2^t, pp, ⌊g/(tp·pp)⌋)`` with balanced
    sub-stages and ``downstream`` stages after it (``(0, False)`` when a sub-stage cannot hold one layer), and
    whether its bigger sub-stages go first. ``held``: scratch of ≥ ``pp`` entries."""
    room = pos[i, 0]
    g = pos_i[i, 0]
    w = job_f[3] * job_f[0] / tp
    act = pos[i, 5 + 4 * t]
    per_replica = math.ceil(m / (g // (tp * pp)))
    for j in range(pp):
        ahead = pp - j + downstream
        inflight = per_replica if per_replica <= ahead else ahead
        extra = job_f[3] * job_f[1] / tp if i == 0 and j == 0 else 0.0
        if i == k - 1 and j == pp - 1:
            extra += job_f[3] * job_f[2] / tp + inflight * pos[i, 6 + 4 * t]
        n = math.floor((room - extra) / (w + inflight * act) * _CAP_SLACK)
        if n < 1:
            return 0, False
        held[j] = n
    low = held[0]
    for j in range(1, pp):
        if held[j] < low:
            low = held[j]
    tail = 0
    while tail < pp - 1 and held[pp - 1 - tail] > low:
        tail += 1
    head = 0
    if i == k - 1:
        while head < pp - 1 and held[head] > low:
            head += 1
    return pp * low + (head if head > tail else tail), head > tail


@kernel
def memory_first(pos: FArr, pos_i: IArr, job_f: FArr, job_i: IArr, shapes: IArr) -> tuple[int, bool]:
    """The memory-first dynamic programme: from the last block to the first, per count ``d`` of stages
    downstream the most layers the blocks from there on hold (options taken in the order frontier state,
    tensor degree, ``pp``; a later option replaces an earlier one only when it holds strictly more), keeping
    the states that hold strictly more with more stages. Returns the most layers any structure holds and
    whether one with at most ``L`` stages holds ``L``; then the first such (fewest stages) into ``shapes``
    (``k × 5``: ``tp, pp, dp, layers held, bigger sub-stages first``)."""
    k = pos_i.shape[0]
    m = job_i[0]
    layers = job_i[1]
    width = PP_CHOICES[-1] * k + 1
    has = np.zeros((k, width), dtype=np.bool_)
    total_at = np.zeros((k, width), dtype=np.int64)
    pick = np.zeros((k, width, 5), dtype=np.int64)
    parent = np.zeros((k, width), dtype=np.int64)
    front_d = np.zeros(width, dtype=np.int64)
    front_t = np.zeros(width, dtype=np.int64)
    held = np.empty(PP_CHOICES[-1], dtype=np.int64)
    n_front = 1
    for i in range(k - 1, -1, -1):
        g = pos_i[i, 0]
        ntp = pos_i[i, 2]
        for f in range(n_front):
            d = front_d[f]
            total = front_t[f]
            for t in range(ntp):
                tp = 1 << t
                for pp in PP_CHOICES:
                    if tp * pp > g:
                        break
                    cap, big_first = _balanced_capacity(i, k, tp, t, pp, d, pos, pos_i, job_f, m, held)
                    if cap < pp:
                        continue
                    at = d + pp
                    if not has[i, at] or total + cap > total_at[i, at]:
                        has[i, at] = True
                        total_at[i, at] = total + cap
                        pick[i, at, 0] = tp
                        pick[i, at, 1] = pp
                        pick[i, at, 2] = g // (tp * pp)
                        pick[i, at, 3] = cap
                        pick[i, at, 4] = 1 if big_first else 0
                        parent[i, at] = d
        n_front = 0
        for at in range(width):
            if has[i, at] and (n_front == 0 or total_at[i, at] > front_t[n_front - 1]):
                front_d[n_front] = at
                front_t[n_front] = total_at[i, at]
                n_front += 1
        if n_front == 0:
            return 0, False
    most = front_t[n_front - 1]
    for f in range(n_front):
        if front_t[f] >= layers and front_d[f] <= layers:
            d = front_d[f]
            for i in range(k):
                for c in range(5):
                    shapes[i, c] = pick[i, d, c]
                d = parent[i, d]
            return most, True
    return most, False


def new_memo(k: int, layers: int, m: int) -> tuple[IArr, BArr, FArr, IArr]:
    """An empty block memo ``(slots, filled, memo_f, memo_i)`` for ``k`` positions, ``layers`` layers and ``m``
    micro-batches: an entry per position, count of stages downstream up to ``D = min(m, 16·k)`` and layer
    count (``slots`` only carries ``D`` in its shape)."""
    cap = min(m, PP_CHOICES[-1] * k)
    slots = np.zeros((k, cap + 1), dtype=np.int64)
    n = k * (cap + 1) * (layers + 1)
    return slots, np.zeros(n, dtype=np.bool_), np.empty((n, 6)), np.empty((n, 4), dtype=np.int64)


@register_warmup
def _warm() -> None:
    k, layers = 2, 4
    pos = np.ones((k, POS_WIDTH))
    pos[:, :4] = [[8e10, 600.0, 100.0, 1e-3], [4e10, 300.0, 50.0, 2e-3]]
    pos_i = np.array([[8, 8, 4], [2, 2, 2]], dtype=np.int64)
    hops = np.array([1e-2])
    job_f = np.array([1e8, 1e8, 1e8, 16.0, 2.0])
    job_i = np.array([4, layers, 0, 0], dtype=np.int64)
    out_f = np.empty((k, 5))
    out_i = np.empty((k, 4), dtype=np.int64)
    memo = new_memo(k, layers, 4)
    evaluate_split(np.array([2, 2], dtype=np.int64), np.ones(k, dtype=np.int64), pos, pos_i, hops, job_f,
                   job_i, *memo, out_f, out_i)
    optimise_split(np.array([3, 1], dtype=np.int64), True, pos, pos_i, hops, job_f, job_i, *memo, out_f, out_i)
    memory_first(pos, pos_i, job_f, job_i, np.empty((k, 5), dtype=np.int64))
