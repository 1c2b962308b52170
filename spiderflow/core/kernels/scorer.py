"""Kernels of the closed-form chain scorer (:func:`spiderflow.core.placement.common.score_chains`) and of the
greedy GPU allocation (:func:`spiderflow.core.placement.common.allocate_greedy`).

Both take ``N × K`` chains of cluster indices, left-aligned and ``-1`` padded, and treat every row on its
own. The formulas, symbols and the order of every floating-point operation are those of the scorer's
documentation in :mod:`spiderflow.core.placement.common`: in particular every row sum is added left to right
over all ``K`` positions (padding adds ``0.0``), and every ``max`` propagates NaN as numpy's does.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from spiderflow.core.kernels import kernel, register_warmup
from spiderflow.core.kernels.formulas import allreduce_time as _allreduce_time

__all__ = ["greedy_rows", "score_rows"]

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]
BArr = npt.NDArray[np.bool_]

_TP = (1, 2, 4, 8)
_POW2_UPTO_8 = (1, 1, 2, 2, 4, 4, 4, 4, 8)


@kernel
def _nanmax(a: float, b: float) -> float:
    """``max`` with numpy's NaN propagation."""
    if a != a or b != b:
        return math.nan
    return a if a >= b else b


@kernel
def _div(a: float, b: float) -> float:
    """``a / b`` with numpy's semantics for a zero divisor (±inf, or NaN for 0/0)."""
    if b != 0.0:
        return a / b
    if a != a or a == 0.0:
        return math.nan
    return math.copysign(math.inf, a) * math.copysign(1.0, b)


@kernel
def score_rows(
    chains: IArr, gpus: IArr, fig: FArr, ints: IArr, per_layer_t: FArr, head_t: FArr, by_tp: FArr, p: FArr,
    m: int, layers: int, p_layer: float, p_embed: float, gpus_min: int, gpus_max: int, reserved: float,
    step_out: FArr, usd_out: FArr, gpus_out: IArr, feasible_out: BArr, capacity_out: FArr, layers_out: FArr,
) -> None:
    """Score every row of ``chains`` (GPUs ``gpus``) into the ``*_out`` arrays.

    Per-cluster tables (columns indexed by cluster): ``fig`` rows flops, memory bytes, intra and inter
    Gbit/s, watts, $/kWh, then the work outside the blocks a profile measured (0 where not): the embedding's
    seconds per micro-batch (added to the first position's ``T``), its optimizer's seconds per step and the
    input pipeline's seconds per micro-batch (times ``⌈m/d⌉``; both added to the first position's ``Y``), the
    head's optimizer's seconds per step (added to the last position's ``Y``), then the cluster's calibrated
    optimizer seconds per layer and step (times the position's layers ``ℓ``, added to its ``Y``); ``ints`` rows
    GPUs per node and the largest TP degree; ``per_layer_t[t]`` (the calibrated fixed time per layer included)
    and ``head_t[t]`` per TP choice ``t ∈ (1, 2, 4, 8)``; ``by_tp[:, t]`` per TP degree: w·p/t, activation bytes
    per layer, w·p_embed/t, head bytes, gradient bytes per value (``w`` state bytes per parameter; rates and
    bytes in the job's precision; head bytes: the loss of a last stage holding one micro-batch, which 1F1B's
    last position does, :meth:`~spiderflow.core.placement.common.JobConsts.act_head`).
    ``p``: activation transfer seconds between clusters. ``reserved``:
    bytes of every GPU kept free. Outputs: step (``inf`` where not finite), dollars per step, GPUs used,
    feasibility, Σ capacity / L and the water-filled layer split (``N × K``).
    """
    n_rows, width = chains.shape
    inf = math.inf
    big_l = float(layers)
    cap = np.empty(width)
    rate = np.empty(width)
    ell = np.empty(width)
    sat = np.zeros(width, dtype=np.bool_)
    for row in range(n_rows):
        k = 0
        for q in range(width):
            if chains[row, q] >= 0:
                k += 1
        # Memory capacity in layers: TP groups of tp_m GPUs, one sub-stage per group.
        cap_total = 0.0
        rate_total = 0.0
        for q in range(width):
            c = chains[row, q]
            if c >= 0:
                g = gpus[row, q]
                rate[q] = g * fig[0, c]
                g1 = g if g > 1 else 1
                pw = _POW2_UPTO_8[g1 if g1 < 8 else 8]
                tp_m = ints[1, c] if ints[1, c] < pw else pw
                groups = g1 // tp_m
                ahead = k - q if k - q > 1 else 1
                inflight = m if m < ahead else ahead
                per_layer = by_tp[0, tp_m] + inflight * by_tp[1, tp_m]
                last = q == k - 1
                extra = (by_tp[2, tp_m] if (q == 0 or last) else 0.0) + (inflight * by_tp[3, tp_m] if last else 0.0)
                avail = fig[1, c] - reserved - extra
                cap[q] = groups * math.floor((avail if avail > 0.0 else 0.0) / per_layer)
            else:
                rate[q] = 0.0
                cap[q] = 0.0
            cap_total += cap[q]
            rate_total += rate[q]
        # Water-filling: ℓ_i = min(cap_i, λ·R_i) with Σ ℓ_i = L (up to six rounds of saturation).
        for q in range(width):
            sat[q] = False
        lam = _div(big_l, rate_total)
        for _ in range(6):
            over = False
            for q in range(width):
                if chains[row, q] >= 0 and not sat[q] and lam * rate[q] > cap[q]:
                    sat[q] = True
                    over = True
            if not over:
                break
            held = 0.0
            free_rate = 0.0
            for q in range(width):
                held += cap[q] if sat[q] else 0.0
                free_rate += 0.0 if sat[q] else rate[q]
            lam = _div(big_l - held, free_rate)
        if not math.isfinite(lam):
            lam = inf
        for q in range(width):
            if chains[row, q] >= 0:
                share = lam * rate[q]
                if share != share:
                    share = 0.0
                e = cap[q] if cap[q] < share else share
                ell[q] = e if e > 1.0 else 1.0  # every position runs at least one layer
            else:
                ell[q] = 0.0
            layers_out[row, q] = ell[q]
        # Per position the TP degree minimising (m−1)·T/d + T + Y (ties: the smaller degree).
        bott = 0.0
        t_sum = 0.0
        y_max = 0.0
        used_total = 0
        watts_price = 0.0
        for q in range(width):
            c = chains[row, q]
            t_stage = 0.0
            d = 1
            y = 0.0
            if c >= 0:
                g = gpus[row, q]
                g1 = g if g > 1 else 1
                last = q == k - 1
                params = ell[q] * p_layer + (p_embed if (q == 0 or last) else 0.0)
                best = inf
                pick = -1
                b_t = 0.0
                b_d = 0
                b_y = 0.0
                b_tp = 0
                for ti in range(4):
                    tt = _TP[ti]
                    d_t = g1 // tt if g1 // tt > 1 else 1
                    ts = ell[q] * per_layer_t[ti, c] + (head_t[ti, c] if last else 0.0)
                    if q == 0 and fig[6, c] != 0.0:
                        ts += fig[6, c]
                    local = inf
                    ys = 0.0
                    if tt <= ints[1, c] and g1 % tt == 0:
                        b_dp = fig[2, c] if tt * d_t <= ints[0, c] else fig[3, c]
                        if d_t > 1:
                            ys = _allreduce_time(by_tp[4, tt] * params / tt, d_t, b_dp, 0.0)
                        outer = 0.0
                        if q == 0:
                            outer = fig[7, c] + fig[8, c] * math.ceil(m / d_t)
                        if last:
                            outer += fig[9, c]
                        if outer != 0.0:
                            ys += outer
                        if fig[10, c] != 0.0:
                            ys += ell[q] * fig[10, c]
                        local = (m - 1) * ts / d_t + ts + ys
                        if local != local:
                            local = inf
                    if pick < 0 or local < best:
                        best, pick, b_t, b_d, b_y, b_tp = local, ti, ts, d_t, ys, tt
                tp = 1
                d = g1
                if best < inf:
                    t_stage, d, y, tp = b_t, b_d, b_y, b_tp
                used = tp * d
                used_total += used
                watts_price += used * fig[4, c] * fig[5, c]
            else:
                watts_price += 0.0
            bott = _nanmax(bott, t_stage / d)
            t_sum += t_stage
            y_max = _nanmax(y_max, y)
        p_max = 0.0
        p_sum = 0.0
        for q in range(width - 1):
            hop = p[chains[row, q], chains[row, q + 1]] if chains[row, q + 1] >= 0 else 0.0
            p_max = _nanmax(p_max, hop)
            p_sum += hop
        step = (m - 1) * _nanmax(bott, p_max) + t_sum + 2.0 * p_sum + y_max
        usd_out[row] = step * watts_price / 3.6e6
        gpus_out[row] = used_total
        finite = math.isfinite(step)
        step_out[row] = step if finite else inf
        feasible_out[row] = (
            cap_total >= big_l and used_total >= gpus_min and used_total <= gpus_max and finite and k >= 1
            and k <= layers
        )
        capacity_out[row] = cap_total / big_l


@kernel
def greedy_rows(chains: IArr, free: IArr, flops: FArr, gpus_max: int, out: IArr) -> None:
    """GPUs per chain position into ``out``: the positions of each row by descending per-GPU rate (ties: chain
    order) take all their cluster's free GPUs until ``gpus_max`` is reached."""
    n_rows, width = chains.shape
    order = np.empty(width, dtype=np.int64)
    for row in range(n_rows):
        k = 0
        for q in range(width):
            out[row, q] = 0
            if chains[row, q] >= 0:
                # Stable insertion by descending rate.
                at = k
                while at > 0 and flops[chains[row, order[at - 1]]] < flops[chains[row, q]]:
                    order[at] = order[at - 1]
                    at -= 1
                order[at] = q
                k += 1
        before = 0
        for r in range(k):
            q = order[r]
            f = free[chains[row, q]]
            left = gpus_max - before
            take = left if left > 0 else 0
            out[row, q] = take if take < f else f
            before += f


@kernel
def estimate_rows(
    step: FArr, usd: FArr, feasible: BArr, capacity: FArr, gpus: IArr, objective: int, gpus_min: int,
    raw_out: FArr, est_out: FArr,
) -> None:
    """The search's two keys per row: ``raw`` = the objective (0 step, 1 dollars, 2 step·√dollars) of a
    feasible row, else ``inf``; ``est`` = ``raw`` for a feasible row, else the objective times the capacity
    shortfall ``max(1, 1/max(Σcap/L, 1e-9))`` times the GPU shortfall ``max(1, G_min/max(gpus, 1))``
    (``inf`` where not finite)."""
    for row in range(step.shape[0]):
        if objective == 1:
            value = usd[row]
        elif objective == 2:
            value = step[row] * math.sqrt(usd[row]) if usd[row] >= 0.0 else math.nan
        else:
            value = step[row]
        if feasible[row]:
            raw_out[row] = value
            est = value
        else:
            raw_out[row] = math.inf
            c = capacity[row]
            short = 1.0 / (c if (c >= 1e-9 or c != c) else 1e-9)
            ratio = gpus_min / (gpus[row] if gpus[row] > 1 else 1)
            est = value * (short if (short > 1.0 or short != short) else 1.0) * (ratio if ratio > 1.0 else 1.0)
        est_out[row] = est if math.isfinite(est) else math.inf


@kernel
def trim_rows(
    chains: IArr, start: IArr, free: IArr, tp_cap: IArr, gpn: IArr, fig: FArr, ints: IArr, per_layer_t: FArr,
    head_t: FArr, by_tp: FArr, p: FArr, m: int, layers: int, p_layer: float, p_embed: float, gpus_min: int,
    gpus_max: int, reserved: float, objective: int, tolerance: float, out: IArr,
) -> tuple[float, int, int]:
    """Tune the GPUs of each chain (row of ``chains``, starting from ``start``) into ``out``.

    Per round, the candidates of a chain at GPUs ``g`` are, position by position: ``g_i`` lowered to each of
    ``{⌊g_i/2⌋, g_i − GPUs per node, g_i − s, g_i − 1, ⌊g_i/s⌋·s}`` in ascending order (``s`` the largest TP
    degree of the cluster; values in ``[1, g_i)``), then ``δ`` GPUs shifted from ``i`` to each other position
    ``j`` for ``δ`` in ``(8, 1, 2, 4)`` when ``s = 8`` else ``(1, 2, 4)`` (kept when ``g_i − δ ≥ 1`` and
    ``g_j + δ`` is free). The best candidate (first of equals) is taken if its score is below the current
    one by more than a relative ``1e-9``; otherwise, for ``jct`` (``objective`` 0), the candidate with the
    fewest GPUs (then the lowest score, then the first) among those with fewer GPUs than now and a score
    within ``tolerance`` (relative) of the starting score; else the chain stops. At most ``3·k`` rounds for
    a chain of ``k`` clusters. Scores are :func:`score_rows`' objective (``raw`` of :func:`estimate_rows`).

    Returns ``(max Σcap/L, max GPUs, rows scored)`` over the scored rows with a finite step (``(0, 0, n)``
    when none), for the caller's search statistics.
    """
    n_rows, width = chains.shape
    max_cap = 0.0
    max_gpus = 0
    scored = 0
    one = np.empty((1, width), dtype=np.int64)
    s1 = np.empty(1)
    u1 = np.empty(1)
    g1 = np.empty(1, dtype=np.int64)
    f1 = np.empty(1, dtype=np.bool_)
    c1 = np.empty(1)
    l1 = np.empty((1, width))
    r1 = np.empty(1)
    e1 = np.empty(1)
    for row in range(n_rows):
        k = 0
        for q in range(width):
            if chains[row, q] >= 0:
                k += 1
        cur = np.zeros(width, dtype=np.int64)
        for q in range(k):
            cur[q] = start[row, q]
        one[0, :] = cur
        score_rows(chains[row: row + 1], one, fig, ints, per_layer_t, head_t, by_tp, p, m, layers, p_layer, p_embed,
                   gpus_min, gpus_max, reserved, s1, u1, g1, f1, c1, l1)
        estimate_rows(s1, u1, f1, c1, g1, objective, gpus_min, r1, e1)
        scored += 1
        if math.isfinite(s1[0]):
            max_cap = c1[0] if c1[0] > max_cap else max_cap
            max_gpus = g1[0] if g1[0] > max_gpus else max_gpus
        cur_score = r1[0]
        base = r1[0]
        rounds = 3 * k
        while rounds > 0:
            most = k * (5 + 4 * (k - 1))
            cands = np.zeros((most, width), dtype=np.int64)
            n_c = 0
            total = 0
            for q in range(k):
                total += cur[q]
            for pos in range(k):
                u = chains[row, pos]
                gi = cur[pos]
                s = tp_cap[u]
                opts = np.array([gi // 2, gi - gpn[u], gi - s, gi - 1, (gi // s) * s])
                opts.sort()
                last = -1
                for o in opts:
                    if o == last:
                        continue
                    last = o
                    if 1 <= o < gi:
                        cands[n_c, :] = cur
                        cands[n_c, pos] = o
                        n_c += 1
                deltas = (8, 1, 2, 4) if s == 8 else (1, 2, 4, 0)
                for j in range(k):
                    if j == pos:
                        continue
                    for delta in deltas:
                        if delta == 0:
                            continue
                        if gi - delta >= 1 and cur[j] + delta <= free[chains[row, j]]:
                            cands[n_c, :] = cur
                            cands[n_c, pos] -= delta
                            cands[n_c, j] += delta
                            n_c += 1
            if n_c == 0:
                break
            rep = np.empty((n_c, width), dtype=np.int64)
            for c in range(n_c):
                rep[c, :] = chains[row]
            st = np.empty(n_c)
            us = np.empty(n_c)
            gs = np.empty(n_c, dtype=np.int64)
            fs = np.empty(n_c, dtype=np.bool_)
            cs = np.empty(n_c)
            ls = np.empty((n_c, width))
            raw = np.empty(n_c)
            est = np.empty(n_c)
            score_rows(rep, cands[:n_c], fig, ints, per_layer_t, head_t, by_tp, p, m, layers, p_layer, p_embed,
                       gpus_min, gpus_max, reserved, st, us, gs, fs, cs, ls)
            estimate_rows(st, us, fs, cs, gs, objective, gpus_min, raw, est)
            scored += n_c
            for c in range(n_c):
                if math.isfinite(st[c]):
                    max_cap = cs[c] if cs[c] > max_cap else max_cap
                    max_gpus = gs[c] if gs[c] > max_gpus else max_gpus
            rounds -= 1
            best = 0
            for c in range(1, n_c):
                if raw[c] < raw[best]:
                    best = c
            if raw[best] < cur_score * (1 - 1e-9):
                pick = best
            elif objective != 0:
                break
            else:
                pick = -1
                pick_sum = 0
                for c in range(n_c):
                    c_sum = 0
                    for q in range(k):
                        c_sum += cands[c, q]
                    if raw[c] <= base * (1 + tolerance) and c_sum < total and (
                            pick < 0 or c_sum < pick_sum or (c_sum == pick_sum and raw[c] < raw[pick])):
                        pick = c
                        pick_sum = c_sum
                if pick < 0:
                    break
            for q in range(width):
                cur[q] = cands[pick, q]
            cur_score = raw[pick]
        for q in range(width):
            out[row, q] = cur[q]
    return max_cap, max_gpus, scored


@register_warmup
def _warm() -> None:
    chains = np.array([[0, 1], [1, -1]], dtype=np.int64)
    free = np.array([4, 8], dtype=np.int64)
    flops = np.array([1e14, 2e14])
    g = np.zeros_like(chains)
    greedy_rows(chains, free, flops, 8, g)
    fig = np.ones((11, 2))
    ints = np.full((2, 2), 8, dtype=np.int64)
    pl = np.ones((4, 2))
    by_tp = np.ones((5, 9))
    p = np.zeros((2, 2))
    score_rows(chains, g, fig, ints, pl, pl, by_tp, p, 4, 8, 1.0, 1.0, 1, 8, 0.0,
               np.empty(2), np.empty(2), np.empty(2, dtype=np.int64), np.empty(2, dtype=np.bool_), np.empty(2),
               np.empty((2, 2)))
    raw = np.empty(2)
    est = np.empty(2)
    estimate_rows(np.ones(2), np.ones(2), np.ones(2, dtype=np.bool_), np.ones(2), np.ones(2, dtype=np.int64), 0, 1,
                  raw, est)
    out = np.empty_like(chains)
    trim_rows(chains, g, free, np.full(2, 8, dtype=np.int64), np.full(2, 8, dtype=np.int64), fig, ints, pl, pl, by_tp,
              p, 4, 8, 1.0, 1.0, 1, 8, 0.0, 0, 1e-3, out)
