"""The plain Python formulation of level 2's exact solver and memory tests (:mod:`spiderflow.core.tpa.level2`), kept
as the reference the compiled kernels (:mod:`spiderflow.core.kernels.level2`) are compared against, bitwise.

Every search below is the scalar formulation of its namesake in :mod:`spiderflow.core.tpa.level2`, with its own
memo tables; the problem types come from the production modules. The cost formulas (a candidate's
constants) are written once: the reference runs the
kernels' own formula functions as plain Python (``py_func``), so what it checks is the search.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any, cast

import numpy as np

from spiderflow.core.costmodel import (
    GIB,
    LOGIT_ONCE_BYTES,
    LOGIT_SAVED_BYTES,
    PARAM_GATHER_BYTES,
    RESERVED_GIB,
    fsdp_unsharded_bytes_per_param,
    grad_bytes_per_value,
    layer_fwd_flops,
    state_bytes_per_param,
)
from spiderflow.core.domain import Sharding
from spiderflow.core.kernels import level2 as kernels
from spiderflow.core.tpa.level2 import BlockConfig, BlockProblem, Degrees, FArray, IArray, _Coeffs, plain


def _vectors(p: BlockProblem) -> tuple[FArray, IArray]:
    """``p`` as the kernels' problem vectors, every field read from ``p`` (what
    :func:`spiderflow.core.tpa.level2._vectors` builds from its per-cluster parts)."""
    sh, model = p.shape, p.model
    fl = np.array(
        (sh.effective_tflops, sh.memory_gib, sh.intra_node_gbps, sh.inter_node_gbps, sh.layer_overhead_s,
         sh.optimizer_s, p.floor_s, GIB, RESERVED_GIB * GIB, float(model.params_per_layer),
         layer_fwd_flops(model, p.micro_batch, p.seq_len), float(model.embedding_params), float(model.head_params),
         LOGIT_SAVED_BYTES, LOGIT_ONCE_BYTES, sh.embedding_us_per_token, sh.head_us_per_token,
         sh.embedding_optimizer_ms, sh.head_optimizer_ms, sh.data_ms_per_sample),
        dtype=np.float64,
    )
    it = np.array(
        (p.gpus, p.layers, sh.gpus_per_node, sh.wire_bytes, model.hidden, model.heads, model.vocab, p.micro_batch,
         p.seq_len, p.m, p.downstream or 0, p.downstream is not None, p.depth_factor, p.max_in_flight or 0,
         p.max_in_flight is not None, p.has_embed, p.has_head, p.memory_bound, state_bytes_per_param(p.precision),
         p.precision.value_bytes, state_bytes_per_param(p.precision, Sharding.FSDP), p.allow_recompute,
         p.allow_fsdp, model.kv_heads or model.heads, grad_bytes_per_value(p.precision), PARAM_GATHER_BYTES,
         fsdp_unsharded_bytes_per_param(p.precision)),
        dtype=np.int64,
    )
    return fl, it


def _py(fn: Any) -> Callable[..., Any]:
    """A compiled kernel's plain Python function (numba's ``py_func``)."""
    return cast(Callable[..., Any], fn.py_func)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def block_candidates(p: BlockProblem) -> list[Degrees]:
    """Every admissible ``(t, p, d)`` (module docstring), ordered by ``(t, p)``."""
    g = p.shape.gpus_per_node
    out: list[Degrees] = []
    for tp in _divisors(p.gpus):
        if not (g % tp == 0 or tp % g == 0):
            continue
        if p.model.heads % tp or (p.model.kv_heads or p.model.heads) % tp or p.model.hidden % tp:
            continue
        for pp in _divisors(p.gpus // tp):
            dp = p.gpus // (tp * pp)
            if pp > p.layers or dp > p.m:
                continue
            for rc in (False, True) if p.allow_recompute else (False,):
                out.append(Degrees(tp=tp, pp=pp, dp=dp, recompute=rc))
                if p.allow_fsdp and dp > 1:
                    out.append(Degrees(tp=tp, pp=pp, dp=dp, recompute=rc, fsdp=True))
    return out


_COEFFS: dict[tuple[object, ...], _Coeffs] = {}
_COEFFS_MAX = 65536


def _coeffs(p: BlockProblem, k: Degrees) -> _Coeffs:
    """Per-candidate constants, memoised on the fields they read (not the block's layers, GPUs, floor or
    memory flag, so the blocks level 1 tries on one cluster share them)."""
    key = (p.shape, p.model, p.micro_batch, p.seq_len, p.m, p.downstream, p.depth_factor, p.max_in_flight,
           p.has_embed, p.has_head, p.precision, k)
    hit = _COEFFS.get(key)
    if hit is None:
        if len(_COEFFS) >= _COEFFS_MAX:
            _COEFFS.clear()
        hit = _COEFFS[key] = _compute_coeffs(p, k)
    return hit


def _compute_coeffs(p: BlockProblem, k: Degrees) -> _Coeffs:
    """The kernels' formula (:func:`spiderflow.core.kernels.level2.coefficients`), run as plain Python."""
    fl, it = _vectors(p)
    mu = np.empty(k.pp, np.float64)
    nu = np.empty(k.pp, np.float64)
    beta = np.empty(k.pp, np.float64)
    tau, eta_head, eta_embed, alpha, p_in = _py(kernels.coefficients)(
        fl, it, k.tp, k.pp, k.dp, k.recompute, k.fsdp, mu, nu, beta)
    return _Coeffs(float(tau), float(eta_head), tuple(mu.tolist()), tuple(nu.tolist()), float(alpha),
                   tuple(beta.tolist()), float(p_in), float(eta_embed))


def config_cost(p: BlockProblem, k: Degrees, layers: tuple[int, ...], coeffs: _Coeffs | None = None) -> BlockConfig:
    """The cost-model figures of candidate ``k`` with the given layers per sub-stage (no feasibility check);
    ``coeffs``: ``k``'s constants for ``p`` when the caller has them already."""
    c = coeffs if coeffs is not None else _coeffs(p, k)
    compute = tuple(
        c.stage_time(p, k, j, n) for j, n in enumerate(layers)
    )
    mem = tuple((c.mu[j] * n + c.nu[j]) / GIB for j, n in enumerate(layers))
    ar = tuple(c.alpha * n + c.beta[j] for j, n in enumerate(layers))
    p_in = c.p_in if k.pp > 1 else 0.0
    obj = (p.m - 1) * max(max(compute) / k.dp, p_in, p.floor_s) + sum(compute) + 2 * (k.pp - 1) * p_in + max(ar)
    return BlockConfig(
        tp=k.tp, pp=k.pp, dp=k.dp, layers=layers, compute_s=compute, memory_gib=mem, allreduce_s=ar,
        intra_boundary_s=p_in, objective_s=obj, recompute=k.recompute, fsdp=k.fsdp,
    )


def _balanced(n_layers: int, parts: int) -> tuple[int, ...]:
    q, r = divmod(n_layers, parts)
    return tuple(q + (1 if j < r else 0) for j in range(parts))


def _min_peak_layers(c: _Coeffs, pp: int, layers: int) -> tuple[int, ...]:
    """The split of ``layers`` over ``pp`` sub-stages (each ≥ 1) minimising the peak ``μ_j·ℓ_j + ν_j``:
    greedy, one layer at a time to the sub-stage whose memory grows least — exact for a bottleneck of
    increasing linear functions. ``O(L log p)``."""
    alloc = [1] * pp
    heap = [(c.mu[j] * 2 + c.nu[j], j) for j in range(pp)]
    heapq.heapify(heap)
    for _ in range(layers - pp):
        _, j = heapq.heappop(heap)
        alloc[j] += 1
        heapq.heappush(heap, (c.mu[j] * (alloc[j] + 1) + c.nu[j], j))
    return tuple(alloc)


@lru_cache(maxsize=65536)
def min_memory_config(p: BlockProblem) -> BlockConfig | None:
    """The configuration with the smallest peak memory per GPU (every candidate with its min-peak split) —
    used to explain infeasibility and to steer level 1 off memory overflows. Memoised on the problem."""
    best: tuple[float, Degrees, tuple[int, ...]] | None = None
    for k in block_candidates(p):
        c = _coeffs(p, k)
        layers = _min_peak_layers(c, k.pp, p.layers)
        # config_cost's memory figures, computed the same way, for the candidates that do not win
        peak = max((c.mu[j] * n + c.nu[j]) / GIB for j, n in enumerate(layers))
        if best is None or peak < best[0]:
            best = (peak, k, layers)
    return None if best is None else config_cost(p, best[1], best[2])


def min_peak_fits(p: BlockProblem) -> bool:
    """Whether :func:`min_memory_config` of ``p`` fits its memory (``max(memory_gib) ≤ memory_gib``), without
    building the splits: the min-peak split of candidate ``k`` takes the ``L_b − p`` smallest increments
    ``μ_j·n + ν_j`` (every sub-stage starts at one layer), so its peak is within the capacity iff every
    sub-stage holds one layer and the most layers each holds within it, ``u_j``, add up to ``L_b``. Each
    ``u_j`` is tested with the same expression as the configuration's memory (``(μ_j·n + ν_j)/GiB``).
    ``O(p)`` per candidate instead of ``O(L_b log p)``."""
    cap = p.shape.memory_gib
    top = p.layers
    for k in block_candidates(p):
        c = _coeffs(p, k)
        total = 0
        for mu, nu in zip(c.mu, c.nu, strict=True):
            if (mu + nu) / GIB > cap:  # one layer
                total = -1
                break
            n = max(1, min(top, math.floor((cap * GIB - nu) / mu)))
            while n < top and (mu * (n + 1) + nu) / GIB <= cap:
                n += 1
            while n > 1 and (mu * n + nu) / GIB > cap:
                n -= 1
            total += n
        if total >= top:
            return True
    return False


def _prune(p: BlockProblem, cands: list[Degrees], *, upper: float = math.inf) -> tuple[list[Degrees], list[_Coeffs]]:
    """Drop candidates that cannot be optimal, before the model is built (exact: keeps the optimum).

    A candidate is infeasible when a one-layer sub-stage already exceeds memory (every sub-stage has
    ``≥ 1`` layer; only when constraint (4) is on). Its objective is at least
    ``(m−1)·max((τ·L_b + η)/(p·d), P_in, Z_floor) + F + (α·L_b + Σβ)/p`` (a maximum is at least the mean);
    the balanced split of any candidate that fits is an upper bound on the optimum (as is ``upper``, the
    objective of a known solution, e.g. the exact optimum), and candidates whose lower bound exceeds it go.
    """
    cap = p.shape.memory_gib * GIB
    kept: list[tuple[Degrees, _Coeffs, float]] = []
    for k in cands:
        c = _coeffs(p, k)
        if p.memory_bound and any(c.mu[j] + c.nu[j] > cap for j in range(k.pp)):
            continue
        p_in = c.p_in if k.pp > 1 else 0.0
        eta = c.eta_total(p)
        fill = c.tau * p.layers + eta + 2 * (k.pp - 1) * p_in
        lower = (
            (p.m - 1) * max((c.tau * p.layers + eta) / (k.pp * k.dp), p_in, p.floor_s)
            + fill
            + (c.alpha * p.layers + sum(c.beta)) / k.pp
        )
        kept.append((k, c, lower))
        if k.pp <= p.layers:
            balanced = config_cost(p, k, _balanced(p.layers, k.pp), c)
            if not p.memory_bound or max(balanced.memory_gib) <= p.shape.memory_gib:
                upper = min(upper, balanced.objective_s)
    survivors = [(k, c) for k, c, lower in kept if lower <= upper * (1.0 + 1e-9)]
    return [k for k, _ in survivors], [c for _, c in survivors]


def memory_caps(p: BlockProblem, k: Degrees) -> tuple[int, ...]:
    """``u_{k,j}``: the most layers sub-stage ``j`` of candidate ``k`` holds within GPU memory (the exact
    test :func:`config_cost` and the plan checks apply; ``L_b`` for every sub-stage when constraint (4) is
    off)."""
    if not p.memory_bound:
        return (p.layers,) * k.pp
    return _memory_caps(p, k)


@lru_cache(maxsize=65536)
def _memory_caps(p: BlockProblem, k: Degrees) -> tuple[int, ...]:
    c = _coeffs(p, k)
    cap = p.shape.memory_gib
    caps = []
    for j in range(k.pp):
        u = _count(c.mu[j] / GIB, c.nu[j] / GIB, cap, p.layers)
        while u > 0 and (c.mu[j] * u + c.nu[j]) / GIB > cap:
            u -= 1
        caps.append(u)
    return tuple(caps)


def _count(slope: float, const: float, level: float, top: int) -> int:
    """The largest ``ℓ ≤ top`` with ``slope·ℓ + const ≤ level`` (0 if none; ``top`` if ``slope`` is 0)."""
    if slope <= 0.0:
        return top if const <= level * (1.0 + 1e-12) + 1e-300 else 0
    n = min(top, max(0, math.floor((level - const) / slope)))
    while n < top and slope * (n + 1) + const <= level * (1.0 + 1e-12):
        n += 1
    while n > 0 and slope * n + const > level * (1.0 + 1e-12):
        n -= 1
    return n


_LEVELS: dict[tuple[float, tuple[float, ...], int], list[float]] = {}


def _levels(slope: float, consts: tuple[float, ...], top: int) -> list[float]:
    """The sorted distinct values ``slope·n + b`` (``b`` in ``consts``, ``1 ≤ n ≤ top``), memoised (bounded):
    the candidate levels of a bottleneck of increasing linear functions. Callers must not modify them."""
    key = (slope, consts, top)
    hit = _LEVELS.get(key)
    if hit is None:
        if len(_LEVELS) >= _COEFFS_MAX:
            _LEVELS.clear()
        hit = _LEVELS[key] = sorted({slope * n + b for b in consts for n in range(1, top + 1)})
    return hit


def _first_level(levels: list[float], slope: float, const: float, top: int) -> float:
    """The least of the sorted ``levels`` at which :func:`_count` reaches ``top`` (it is monotone in the level;
    the last level, ``slope·top + const`` or more, always does)."""
    lo, hi = 0, len(levels) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _count(slope, const, levels[mid], top) >= top:
            hi = mid
        else:
            lo = mid + 1
    return levels[lo]


def _best_single(p: BlockProblem, k: Degrees, c: _Coeffs, bound: float, eta: float) -> BlockConfig | None:
    """:func:`_best_split` of a one-sub-stage candidate that holds every layer in memory: the only split is
    ``(L_b,)``; the scan of ``Z`` there first reaches it at the least level holding ``L_b`` layers, with ``A``
    at ``A_∞``, and returns it unless its estimate exceeds ``bound`` (the estimate grows with ``Z``, so the
    scan breaks before that level exactly when it exceeds ``bound`` there). Same answer, two binary
    searches instead of the scan."""
    lb = p.layers
    a_inf = _first_level(_levels(c.alpha, (c.beta[0],), lb), c.alpha, c.beta[0], lb)
    z = _first_level(_levels(c.tau, (eta,), lb), c.tau, eta, lb)
    const = c.tau * lb + eta  # the scan's ``τ·L_b + Ση + 2(p − 1)·P_in`` at p = 1
    if (p.m - 1) * max(z / k.dp, max(0.0, p.floor_s)) + a_inf + const > bound * (1.0 + 1e-9):
        return None
    return config_cost(p, k, (lb,), c)


def _best_split(p: BlockProblem, k: Degrees, c: _Coeffs, bound: float) -> BlockConfig | None:
    """The optimal layers per sub-stage for the fixed candidate ``k`` (exact; ``None`` when nothing fits
    memory or nothing beats ``bound``).

    For a fixed ``k`` the objective is ``(m−1)·max(Z/d, P_in, Z_floor) + A + const`` with
    ``Z = max_j (τ·ℓ_j + η_j)`` and ``A = max_j (α·ℓ_j + β_j)``, both maxima of increasing functions of the
    ``ℓ_j``. For a threshold ``Z`` each sub-stage may hold at most ``v_j(Z) = min(u_j, max{ℓ : τℓ + η_j ≤ Z})``
    layers (``u_j`` its memory cap, constraint (4)); the least ``A`` is then the smallest level with
    ``Σ_j min(v_j, max{ℓ : αℓ + β_j ≤ A}) ≥ L_b`` (water-filling, exact for a bottleneck of increasing
    linear functions). ``Z`` runs over the values ``τℓ + η_j`` in increasing order, starting at the least
    one that holds every layer; it stops once ``(m−1)·max(Z/d, …) + A_∞ + const`` (``A_∞`` the least ``A``
    under the memory caps only) cannot beat the best found. ``O(L_b·p·log L_b)`` in the worst case.
    """
    lb, pp = p.layers, k.pp
    if pp > lb:
        return None
    etas = [c.eta(p, k, j) for j in range(pp)]
    caps = list(memory_caps(p, k))
    if min(caps) < 1 or sum(caps) < lb:
        return None
    if pp == 1:
        return _best_single(p, k, c, bound, etas[0])
    p_in = c.p_in if pp > 1 else 0.0
    flat = max(p_in, p.floor_s)
    const = c.tau * lb + sum(etas) + 2 * (pp - 1) * p_in

    # The candidate levels of A and, per level, each sub-stage's layer count under it: the same for every
    # ``limits`` the search below tries, so computed once (lazily, per level probed). Sub-stages share
    # their constants (only the embedding and head sub-stages differ): each count is taken once per value.
    betas = tuple(dict.fromkeys(c.beta))
    levels = _levels(c.alpha, betas, lb)
    level_counts: dict[int, list[int]] = {}

    def counts_at(i: int) -> list[int]:
        hit = level_counts.get(i)
        if hit is None:
            lvl = levels[i]
            by = {b: _count(c.alpha, b, lvl, lb) for b in betas}
            hit = level_counts[i] = [by[b] for b in c.beta]
        return hit

    def least_a(limits: list[int]) -> float | None:
        lo, hi = 0, len(levels) - 1
        if sum(min(v, n) for v, n in zip(limits, counts_at(hi), strict=True)) < lb:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            cnt = counts_at(mid)
            ok = min(cnt) >= 1 and sum(min(v, n) for v, n in zip(limits, cnt, strict=True)) >= lb
            if ok:
                hi = mid
            else:
                lo = mid + 1
        return levels[lo]

    a_inf = least_a(caps)
    if a_inf is None:
        return None
    distinct = tuple(dict.fromkeys(etas))
    zs = _levels(c.tau, distinct, lb)
    best: tuple[float, float, float] | None = None  # (objective estimate, Z, A)
    for z in zs:
        if (p.m - 1) * max(z / k.dp, flat) + a_inf + const > min(bound, best[0] if best else math.inf) * (
            1.0 + 1e-9
        ):
            break
        under = {e: _count(c.tau, e, z, lb) for e in distinct}
        limits = [min(u, under[e]) for u, e in zip(caps, etas, strict=True)]
        if min(limits) < 1 or sum(limits) < lb:
            continue
        a = least_a(limits)
        if a is None:
            continue
        val = (p.m - 1) * max(z / k.dp, flat) + a + const
        if best is None or val < best[0]:
            best = (val, z, a)
        if a <= a_inf:
            break  # larger Z cannot lower A any more
    if best is None:
        return None
    _, z, a = best
    layers = [
        min(u, _count(c.tau, e, z, lb), _count(c.alpha, c.beta[j], a, lb))
        for j, (u, e) in enumerate(zip(caps, etas, strict=True))
    ]
    # Give back the surplus from the sub-stages with the highest memory (every term only shrinks).
    heap = [(-(c.mu[j] * n + c.nu[j]), j) for j, n in enumerate(layers) if n > 1]
    heapq.heapify(heap)
    surplus = sum(layers) - lb
    while surplus > 0:
        _, j = heapq.heappop(heap)
        layers[j] -= 1
        surplus -= 1
        if layers[j] > 1:
            heapq.heappush(heap, (-(c.mu[j] * layers[j] + c.nu[j]), j))
    return config_cost(p, k, tuple(layers), c)


def _solve_tier(p: BlockProblem) -> BlockConfig | None:
    """The optimum of the module docstring's model without a solver: :func:`_prune`, then each surviving
    candidate's best split (:func:`_best_split`) in order of its lower bound, skipping candidates whose
    lower bound cannot beat the best so far. Same optimum as :func:`solve_block` (which rounds times to
    integer units) and :func:`brute_force_block`; ``None`` when no candidate fits in memory. Ties keep the
    first candidate in ``(t, p)`` order."""
    cands, coeffs = _prune(p, block_candidates(p))
    if not cands or p.layers < 1:
        return None
    best: BlockConfig | None = None
    for k, c in zip(cands, coeffs, strict=True):
        cfg = _best_split(p, k, c, best.objective_s if best is not None else math.inf)
        if cfg is None:
            continue
        if p.memory_bound and max(cfg.memory_gib) > p.shape.memory_gib:
            continue
        if best is None or cfg.objective_s < best.objective_s * (1.0 - 1e-12):
            best = cfg
    return best


def solve_block_exact(p: BlockProblem) -> BlockConfig | None:
    """The plain candidates first; where none fits memory and ``p`` allows them, every candidate
    (recomputation and FSDP: a second tier, :func:`spiderflow.core.tpa.level2.plain`)."""
    for q in (plain(p), p) if plain(p) is not p else (p,):
        out = _solve_tier(q)
        if out is not None:
            return out
    return None

