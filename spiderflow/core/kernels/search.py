"""Kernels of SpinSearch's beam (:func:`spiderflow.core.placement.spinsearch.search_chains`): the hops each
cluster may extend a chain by, and one level's extensions of the beam; and of the layer-split search that
plans a chain (:mod:`spiderflow.core.tpa.level1`): a block's layer cap, and its bisected memory cap.

Chains are rows of cluster indices, left-aligned; every row of a beam has the same length.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from spiderflow.core.kernels import kernel, register_warmup
from spiderflow.core.kernels.level2 import I_HAS_EMBED, I_HAS_HEAD, I_LAYERS, memory_caps_all, min_peak_fits

__all__ = ["bisect_memory_cap", "block_layer_cap", "extend_beam", "neighbour_table"]

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]
BArr = npt.NDArray[np.bool_]


@kernel
def neighbour_table(order: IArr, p: FArr, usable: BArr, theta: float, neighbours: int) -> IArr:
    """``out[u]``: the usable clusters ``v`` a chain may take as its next hop from ``u``, nearest first (``order[u]``
    lists the other clusters by ascending ``p[u, v]``): at most ``neighbours`` of them, only while
    ``p[u, v] ≤ theta``; ``-1`` pads."""
    n = order.shape[0]
    out = np.full((n, max(neighbours, 1)), -1, dtype=np.int64)
    for u in range(n):
        k = 0
        for i in range(order.shape[1]):
            v = order[u, i]
            if p[u, v] > theta:
                break
            if usable[v]:
                out[u, k] = v
                k += 1
                if k >= neighbours:
                    break
    return out


@kernel
def extend_beam(beam: IArr, table: IArr) -> IArr:
    """Every chain one hop longer than a beam chain, once each, in the order: beam chain by beam chain, its
    tail's neighbours appended (``table`` order), then its head's neighbours prepended; a neighbour already
    on the chain is skipped, and so is a chain generated earlier in this order."""
    n_beam, depth = beam.shape
    width = table.shape[1]
    out = np.empty((2 * n_beam * width, depth + 1), dtype=np.int64)
    count = 0
    for b in range(n_beam):
        for side in range(2):
            end = beam[b, depth - 1] if side == 0 else beam[b, 0]
            for i in range(width):
                v = table[end, i]
                if v < 0:
                    break
                member = False
                for q in range(depth):
                    if beam[b, q] == v:
                        member = True
                        break
                if member:
                    continue
                if side == 0:
                    out[count, :depth] = beam[b]
                    out[count, depth] = v
                else:
                    out[count, 0] = v
                    out[count, 1:] = beam[b]
                seen = False
                for c in range(count):
                    same = True
                    for q in range(depth + 1):
                        if out[c, q] != out[count, q]:
                            same = False
                            break
                    if same:
                        seen = True
                        break
                if not seen:
                    count += 1
    return out[:count].copy()


@kernel
def block_layer_cap(fl: FArr, it: IArr) -> int:
    """The most layers a level-2 block problem (:mod:`spiderflow.core.kernels.level2`'s ``fl``/``it``) holds
    under some degrees: ``max_k Σ_j u_{k,j}`` over its candidates ``k`` whose sub-stage caps ``u_{k,j}``
    (:func:`~spiderflow.core.kernels.level2.memory_caps_all`) are all ``≥ 1``; 0 when none is."""
    cands, start, caps = memory_caps_all(fl, it)
    best = 0
    for i in range(cands.shape[0]):
        low = caps[start[i]]
        total = 0
        for q in range(start[i], start[i + 1]):
            low = min(low, caps[q])
            total += caps[q]
        if low >= 1 and total > best:
            best = total
    return best


@kernel
def bisect_memory_cap(fl: FArr, it: IArr, c: int, n: int, total: int) -> int:
    """Level 1's memory cap of block ``c`` of an ``n``-block chain (``n ≥ 2``) of a ``total``-layer model
    (:func:`spiderflow.core.tpa.level1.memory_caps`): the most layers ``ℓ ∈ [1, total − (n − 1)]`` for which
    :func:`~spiderflow.core.kernels.level2.min_peak_fits` holds, by bisection (``lo, hi = 1, total − (n − 1)``;
    ``mid = ⌈(lo + hi)/2⌉``; ``lo = mid`` where it fits, else ``hi = mid − 1``). Each probe sets the block's
    layers and its embedding/head flags in ``it`` (block 0 starts at layer 0, the last block ends at the
    last layer, a middle one starts at layer 1); ``it`` is left at the last probe."""
    lo = 1
    hi = total - (n - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = 0 if c == 0 else (total - mid if c == n - 1 else 1)
        it[I_LAYERS] = mid
        it[I_HAS_EMBED] = 1 if first == 0 else 0
        it[I_HAS_HEAD] = 1 if first + mid == total else 0
        if min_peak_fits(fl, it):
            lo = mid
        else:
            hi = mid - 1
    return lo


@register_warmup
def _warm() -> None:
    order = np.array([[1, 0], [0, 1]], dtype=np.int64)
    p = np.zeros((2, 2))
    table = neighbour_table(order, p, np.ones(2, dtype=np.bool_), 1.0, 10)
    extend_beam(np.array([[0], [1]], dtype=np.int64), table)
    fl = np.array([100.0, 16.0, 600.0, 100.0, 0.0, 0.0, 0.0, float(1 << 30), 0.5 * float(1 << 30),
                   12.0 * 256 * 256, 24.0 * 128 * 256 * 256 + 4.0 * 128 * 128 * 256, 512.0 * 256, 512.0 * 256,
                   4.0, 14.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    it = np.array([4, 4, 2, 2, 256, 4, 512, 1, 128, 4, 1, 1, 1, 0, 0, 1, 1, 1, 16, 2, 16, 1, 1, 4, 4, 4], np.int64)
    block_layer_cap(fl, it)
    bisect_memory_cap(fl, it.copy(), 0, 2, 8)
