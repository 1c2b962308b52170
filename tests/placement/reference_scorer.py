"""The chain scorer and the greedy GPU allocation of :mod:`spiderflow.core.placement.common` as vectorised numpy:
the reference the compiled kernels (:mod:`spiderflow.core.kernels.scorer`) must match bit for bit.

Same symbols and formulas as the scorer's documentation; every row sum is a left-to-right cumulative sum,
so a row's figures do not depend on the other rows or on the padding width.
"""

from __future__ import annotations

import numpy as np

from spiderflow.core.costmodel import GIB, RESERVED_GIB
from spiderflow.core.kernels.formulas import allreduce_times
from spiderflow.core.placement.common import (
    _TP_CHOICES,
    ChainScores,
    FArr,
    IArr,
    JobConsts,
    ScoreTables,
    TopoArrays,
    score_tables,
)

__all__ = ["allocate_greedy_reference", "score_chains_reference"]


def _row_sum(a: FArr) -> FArr:
    """Row sums added left to right (a cumulative sum): a row's sum does not depend on the other rows or on
    the padding width (``ndarray.sum`` switches to pairwise partial sums on rows of 8 or more)."""
    return np.asarray(a.cumsum(axis=1)[:, -1], dtype=np.float64)


_POW2_UPTO_8 = np.array([1, 1, 2, 2, 4, 4, 4, 4, 8], dtype=np.int64)
"""The largest power of two ≤ g, for g = 1..8 (index 0 unused)."""



def score_chains_reference(ta: TopoArrays, jc: JobConsts, p: FArr, chains: IArr, gpus: IArr,
                 tables: ScoreTables | None = None) -> ChainScores:
    """The scorer of :func:`spiderflow.core.placement.common.score_chains` as vectorised numpy (every row at once).

    Positions are left-aligned (valid positions first). O(N·K) numpy work. Each row's scores depend on that
    row alone (not on the other chains or the padding width). ``tables``: :func:`score_tables` of ``ta`` and
    ``jc`` when the caller scores many batches (else computed here).
    """
    if tables is None or tables.ta is not ta or tables.jc is not jc:
        tables = score_tables(ta, jc)
    valid = chains >= 0
    idx = np.where(valid, chains, 0)
    g = np.where(valid, gpus, 0).astype(np.int64)
    k = valid.sum(axis=1)
    pos = np.arange(chains.shape[1])[None, :]
    last = valid & (pos == (k - 1)[:, None])
    first = valid & (pos == 0)
    fl, mem, intra, inter, watts, price, emb_t, emb_step, data_t, head_step, opt_l = tables.fig[:, idx]
    gpn, tp_cap = tables.ints[:, idx]
    r = np.where(valid, g * fl, 0.0)
    g1 = np.maximum(g, 1)

    # Memory capacity in layers (TP groups of tp_m GPUs, one sub-stage per group).
    tp_m = np.minimum(tp_cap, _POW2_UPTO_8[np.minimum(g1, 8)])
    groups = g1 // tp_m
    inflight = np.minimum(jc.m, np.maximum(1, k[:, None] - pos))
    w16, act_l, e16, act_h = tables.by_tp[:4, tp_m]
    per_layer = w16 + inflight * act_l
    extra = (first | last) * e16 + last * inflight * act_h
    avail = mem - RESERVED_GIB * GIB - extra
    per_group = np.floor(np.maximum(avail, 0.0) / per_layer)
    cap = np.where(valid, groups * per_group, 0.0)
    cap_total = _row_sum(cap)

    # Water-filling: ℓ_i = min(cap_i, λ·R_i) with Σ ℓ_i = L.
    L = float(jc.layers)
    sat = np.zeros_like(valid)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam = L / _row_sum(r)
        for _ in range(6):
            over = valid & ~sat & (lam[:, None] * r > cap)
            if not over.any():
                break
            sat |= over
            rest = L - _row_sum(np.where(sat, cap, 0.0))
            lam = rest / _row_sum(np.where(sat, 0.0, r))
        lam = np.where(np.isfinite(lam), lam, np.inf)
        share = lam[:, None] * r
        # 0 where the product is undefined (∞·0); an infinite share is capped by the (finite) capacity.
        ell = np.where(valid, np.minimum(cap, np.where(np.isnan(share), 0.0, share)), 0.0)

    ell = np.where(valid, np.maximum(ell, 1.0), 0.0)  # every position runs at least one layer
    params = ell * jc.p_layer + (first + last) * jc.p_embed
    # Per position the TP degree t | g (power of two ≤ tp_cap) minimising (m−1)·T/d + T + Y: every t at once
    # along a leading axis, then the first t with the least finite value (ties: the smaller t); positions
    # where none qualifies keep t = 1, d = g, T = Y = 0.
    tt = _TP_CHOICES
    ok = (tt <= tp_cap) & (g1 % tt == 0)
    d_t = np.maximum(g1 // tt, 1)
    ts = np.where(valid, ell * tables.per_layer_t[:, idx] + last * tables.head_t[:, idx], 0.0)
    ts = np.where(first & (emb_t != 0.0), ts + emb_t, ts)  # a measured embedding (first position)
    b_dp = np.where(tt * d_t <= gpn, intra, inter)
    ys = np.where(valid, allreduce_times(jc.grad_bytes * params / tt, d_t, b_dp), 0.0)
    # measured per-step work outside the blocks: first position's embedding optimizer and input pipeline, the
    # last's head optimizer
    outer = np.where(first, emb_step + data_t * np.ceil(jc.m / d_t), 0.0)
    outer = np.where(last, outer + head_step, outer)
    ys = np.where(valid & (outer != 0.0), ys + outer, ys)
    ys = np.where(valid & (opt_l != 0.0), ys + ell * opt_l, ys)  # the calibrated optimizer step per layer
    local = np.where(ok, (jc.m - 1) * ts / d_t + ts + ys, np.inf)
    local = np.where(np.isnan(local), np.inf, local)
    pick = local.argmin(axis=0)
    chosen = pick.choose(local) < np.inf
    tp = np.where(chosen, _TP_CHOICES.ravel()[pick], 1)
    d = np.where(chosen, pick.choose(d_t), g1)
    t_stage = np.where(chosen, pick.choose(ts), 0.0)
    y = np.where(chosen, pick.choose(ys), 0.0)
    bott = (t_stage / d).max(axis=1)

    if chains.shape[1] > 1:
        hop_valid = valid[:, 1:]
        hops = np.where(hop_valid, p[idx[:, :-1], idx[:, 1:]], 0.0)
        pmax = hops.max(axis=1)
        psum = _row_sum(hops)
    else:
        pmax = np.zeros(chains.shape[0])
        psum = np.zeros(chains.shape[0])
    step = (jc.m - 1) * np.maximum(bott, pmax) + _row_sum(t_stage) + 2.0 * psum + y.max(axis=1)
    used = np.where(valid, tp * d, 0)
    watts_price = _row_sum(np.where(valid, used * watts * price, 0.0))
    usd = step * watts_price / 3.6e6
    gpus_used = used.sum(axis=1)
    feasible = (
        (cap_total >= L)
        & (gpus_used >= jc.gpus_min)
        & (gpus_used <= jc.gpus_max)
        & np.isfinite(step)
        & (k >= 1)
        & (k <= jc.layers)
    )
    return ChainScores(
        step=np.where(np.isfinite(step), step, np.inf), usd=usd, gpus=gpus_used.astype(np.int64),
        feasible=feasible, capacity_ratio=cap_total / L, layers=ell,
    )


def allocate_greedy_reference(ta: TopoArrays, chains: IArr, gpus_max: int, rate: FArr | None = None) -> IArr:
    """GPUs per chain position: the fastest clusters of each chain (by ``rate``, else ``ta.flops``) take all
    their free GPUs first, until ``gpus_max`` is reached (vectorised; ``N × K`` in, ``N × K`` out)."""
    valid = chains >= 0
    idx = np.where(valid, chains, 0)
    free = np.where(valid, ta.free[idx], 0)
    flops = ta.flops if rate is None else rate
    order = np.argsort(np.where(valid, -flops[idx], np.inf), axis=1, kind="stable")
    rows = np.arange(chains.shape[0])[:, None]
    fs = free[rows, order]
    before = fs.cumsum(axis=1) - fs
    alloc_sorted = np.minimum(np.maximum(gpus_max - before, 0), fs)
    out = np.zeros_like(free)
    out[rows, order] = alloc_sorted
    return out.astype(np.int64)
