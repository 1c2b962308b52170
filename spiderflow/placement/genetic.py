r"""``genetic``: the hybrid genetic algorithm of Yuan et al., NeurIPS 2022 (DT-FM), as a placement baseline.

The published scheduler (DS3Lab/DT-FM, ``scheduler/heuristic_evolutionary_solver``) partitions ``N =
D_DP × D_PP`` devices into ``D_PP`` groups of ``D_DP`` devices. Group ``g`` is one pipeline stage; its
``D_DP`` devices are the stage's data-parallel replicas. Reimplemented here (not copied), same semantics:

Cost of a partition ``G_1 … G_{D_PP}`` (devices ``i, j``; delay ``δ_ij`` [ms], bandwidth ``β_ij``
[Gbit/s]; ``a`` activation bytes a device sends per step, ``w`` gradient bytes a device all-reduces):

- data-parallel cost ``DP = max_g max_{i∈G_g} Σ_{j∈G_g, j≠i} 2·(δ_ij/10³ + 8w / (β_ij·10⁹·D_DP))``;
- edge cost ``e_ij = δ_ij/10³ + 8a / (β_ij·10⁹)``; between groups ``g, h`` the *bottleneck matching*
  ``X_gh = min over perfect matchings π: G_g → G_h of max_i e_{i,π(i)}``;
- pipeline cost ``PP = min over stage orders σ of Σ_k X_{σ_k σ_{k+1}}`` (open-loop TSP over ``X``;
  exact Held–Karp for ``D_PP ≤`` :data:`EXACT_TSP_MAX`, nearest-neighbour from every start + 2-opt above);
- ``cost = DP + 2·PP``.

Search (GCMA, steady state): a population of ``population`` random permutations (group ``g`` = positions
``g·D_DP … (g+1)·D_DP − 1``); each trial draws two parents uniformly, applies a **five-point crossover**
(five random devices take parent 1's group in parent 2's assignment; oversized groups give devices, in
device order, to the first undersized group), then one round of **cyclic partitioning** local search
(per cycle: from the group whose best single move has the highest gain, move devices group to group
until the cycle returns, keep the best prefix closed back to the start group; at most ``D_PP`` cycles
with vertex locking; keep the best prefix of cycles; the gain of moving ``v`` to ``h`` is its mean
``e`` to ``h`` minus its least ``e`` to its own group, i.e. it spreads mutually close devices over
different groups so the bottleneck matching can pair them). The offspring is scored; if it is worse than
*both* parents it is discarded to the archive, otherwise it replaces the worse parent (which goes to the
archive). The best individual ever scored wins. Budget: population 100 and 4,900 trials as published;
``Budget.time_limit_s`` caps the wall time (checked before every evaluation; at least one individual is
scored).

Two bugs of the published code are fixed, not reproduced: ``random.seed = i`` / ``np.random.seed = i``
assign instead of seeding (every random draw here comes from one ``numpy.random.Generator`` seeded with
``Budget.seed``), and the malformed acceptance test ``score > max(s1, score > s2)`` is the intended
``score > max(s1, s2)``.

Adaptation to SpiderFlow (documented choices, not in the paper)
----------------------------------------------------------------
- **Devices.** One device = one tensor-parallel group of ``t`` GPUs inside one node (``t = 1`` as in the
  paper; the smallest ``t`` that fits memory only when ``t = 1`` cannot hold the model). Free GPUs are
  packed onto a cluster's nodes in order. Between two devices: same node → intra-node bandwidth, same
  cluster → inter-node bandwidth (latency 0 inside a cluster); different clusters → the widest-path
  bandwidth and latency of the :class:`~spiderflow.domain.Topology`.
- **Sizes.** ``a = ⌈m / D_DP⌉·2bsh`` (the micro-batches one replica pipes per step), ``w = 2·P/(D_PP·t)``
  (bf16 gradients of a ``1/D_PP`` share of the ``P`` parameters), as in :mod:`spiderflow.costmodel`.
- **Shape and pool.** The paper takes ``D_DP × D_PP`` and the device set as inputs and has no compute
  term, so both are chosen before the GA: candidate *slots* are ``D_DP`` devices of one cluster whose GPUs
  hold the worst-case stage (embedding + head + logits + 1F1B in-flight of stage 0) of a uniform split;
  slots are ranked by per-GPU effective compute (ties: more free GPUs, then name) within the connected
  component of the best cluster; for every ``(D_PP, D_DP)`` with ``gpus.min ≤ t·D_DP·D_PP ≤ gpus.max``
  and enough slots, the first ``D_PP`` slots in that order are scored by the cost model as a chain in
  slot order, and the best shape's slots form the pool the GA partitions (``N = D_DP·D_PP`` devices).
- **Plan.** A SpiderFlow stage runs on one cluster, so each GA group is mapped to one pool slot by a
  maximum-overlap assignment (Hungarian; ``stats["repair_moved"]`` counts devices that changed cluster),
  the stage order is re-derived with the GA's own pipeline cost (bottleneck matching + TSP) on the mapped
  groups, layers are split uniformly as in their system, ``tp = t``, ``dp = D_DP``, 1F1B with the job's
  micro-batches, and the plan is scored by :func:`spiderflow.costmodel.evaluate`.

Complexity per evaluation: ``O(D_PP²·D_DP³·log D_DP + D_PP²·2^{D_PP})`` (exact TSP); per trial the local
search adds ``O(D_PP·N·N²)`` vectorised work (at most ``D_PP`` cycles of at most ``N`` moves). Measured: the
published budget on the 64-device worldwide case of DT-FM (8 regions × 8, ``D_DP = D_PP = 8``) takes ~60 s
here (2 shared cores), against 342 s for the published code.

``stats`` keys: ``ga_cost_s``, ``ga_dp_cost_s``, ``ga_pp_cost_s`` (of the best individual), ``trials``
(completed), ``evaluations``, ``population``, ``d_dp``, ``d_pp``, ``tp``, ``repair_moved``, ``shapes``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np
import numpy.typing as npt
import structlog

from spiderflow.costmodel import (
    GIB,
    activation_bytes,
    evaluate,
    stage_memory_bytes,
)
from spiderflow.domain import Cluster, JobSpec, Plan, Schedule, Stage, Topology
from spiderflow.placement.base import Budget, PlacementResult, PlacementStatus, register_policy
from spiderflow.placement.common import check_plan, diagnose

__all__ = [
    "EXACT_TSP_MAX",
    "POPULATION",
    "TRIALS",
    "GaInstance",
    "GaOutcome",
    "GeneticPolicy",
    "bottleneck_matching",
    "data_parallel_cost",
    "five_point_crossover",
    "gcma",
    "open_loop_tsp",
    "pipeline_cost",
    "total_cost",
]

POPULATION = 100
TRIALS = 4900
EXACT_TSP_MAX = 12

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]

_log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class GaInstance:
    """The GA's input: ``N × N`` device delays [ms] and bandwidths [Gbit/s] (``N = d_dp·d_pp``; diagonal
    ignored), the shape, and the bytes one device sends per step (``activation``) and all-reduces
    (``gradient``). Bandwidth 0 means unreachable (infinite cost)."""

    delay_ms: FArr
    bandwidth_gbps: FArr
    d_dp: int
    d_pp: int
    activation: float
    gradient: float
    edge: FArr = field(init=False, repr=False)
    dp_edge: FArr = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.d_dp * self.d_pp
        if self.delay_ms.shape != (n, n) or self.bandwidth_gbps.shape != (n, n):
            raise ValueError(f"delay and bandwidth must be {n}×{n} for d_dp={self.d_dp}, d_pp={self.d_pp}")
        with np.errstate(divide="ignore"):
            inv = np.where(self.bandwidth_gbps > 0, 1.0 / (self.bandwidth_gbps * 1e9), np.inf)
        edge = self.delay_ms / 1e3 + 8.0 * self.activation * inv
        dp_edge = 2.0 * (self.delay_ms / 1e3 + 8.0 * self.gradient * inv / self.d_dp)
        np.fill_diagonal(edge, 0.0)
        np.fill_diagonal(dp_edge, 0.0)
        object.__setattr__(self, "edge", edge)
        object.__setattr__(self, "dp_edge", dp_edge)

    @property
    def devices(self) -> int:
        return self.d_dp * self.d_pp


def data_parallel_cost(inst: GaInstance, groups: IArr) -> float:
    """``DP`` of the module docstring for ``groups`` (a ``d_pp × d_dp`` array of device indices)."""
    sub = inst.dp_edge[groups[:, :, None], groups[:, None, :]]
    return float(sub.sum(axis=2).max())


def _perfect(adj: Sequence[int], k: int) -> bool:
    """Whether the bipartite graph with row bitmasks ``adj`` (k × k) has a perfect matching (Kuhn)."""
    match = [-1] * k

    def augment(u: int, seen: list[int]) -> bool:
        free = adj[u] & ~seen[0]
        while free:
            low = free & -free
            v = low.bit_length() - 1
            free ^= low
            seen[0] |= low
            if match[v] < 0 or augment(match[v], seen):
                match[v] = u
                return True
        return False

    return all(augment(u, [0]) for u in range(k))


@lru_cache(maxsize=8)
def _permutations(k: int) -> IArr:
    return np.array(list(itertools.permutations(range(k))), dtype=np.int64)


def _adjacency(ok: npt.NDArray[np.bool_]) -> list[int]:
    weights = np.left_shift(np.int64(1), np.arange(ok.shape[1], dtype=np.int64))
    return [int(x) for x in (ok * weights).sum(axis=1)]


def bottleneck_matching(cost: FArr) -> float:
    """``min_π max_i cost[i, π(i)]`` over perfect matchings of a square matrix. ``k ≤ 4``: every
    permutation at once; otherwise test the lower bound (largest row/column minimum) and, if it fails,
    binary-search the sorted entries with a perfect-matching test. O(k³ log k)."""
    k = cost.shape[0]
    if k == 1:
        return float(cost[0, 0])
    if k <= 4:
        perms = _permutations(k)
        return float(cost[np.arange(k), perms].max(axis=1).min())
    lower = max(float(cost.min(axis=1).max()), float(cost.min(axis=0).max()))
    if _perfect(_adjacency(cost <= lower), k):
        return lower
    values = np.unique(cost[cost > lower])
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _perfect(_adjacency(cost <= values[mid]), k):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


@lru_cache(maxsize=32)
def _held_karp_tables(k: int) -> list[tuple[IArr, IArr, IArr]]:
    """For each subset size p ≥ 2: arrays (mask, last, prev_mask) of every (subset, last node) pair."""
    layers: list[tuple[IArr, IArr, IArr]] = []
    for p in range(2, k + 1):
        masks, lasts = [], []
        for combo in itertools.combinations(range(k), p):
            mask = sum(1 << c for c in combo)
            for j in combo:
                masks.append(mask)
                lasts.append(j)
        ma, la = np.array(masks, dtype=np.int64), np.array(lasts, dtype=np.int64)
        layers.append((ma, la, ma ^ (np.int64(1) << la)))
    return layers


def open_loop_tsp(dist: FArr) -> tuple[float, list[int]]:
    """Least-cost Hamiltonian path (any start, any end) over ``dist``; ``(cost, order)``.

    Exact Held–Karp, O(k²·2^k), for ``k ≤ EXACT_TSP_MAX`` (the published code solves it exactly from every
    start node, which is the same optimum); above that nearest-neighbour from every start followed by
    2-opt on the open path."""
    k = dist.shape[0]
    if k == 1:
        return 0.0, [0]
    if k > EXACT_TSP_MAX:
        return _tsp_heuristic(dist)
    full = (1 << k) - 1
    dp = np.full((1 << k, k), np.inf)
    arg = np.full((1 << k, k), -1, dtype=np.int64)
    for j in range(k):
        dp[1 << j, j] = 0.0
    for masks, lasts, prevs in _held_karp_tables(k):
        cand = dp[prevs] + dist[:, lasts].T
        best = cand.argmin(axis=1)
        dp[masks, lasts] = cand[np.arange(len(masks)), best]
        arg[masks, lasts] = best
    end = int(dp[full].argmin())
    cost = float(dp[full, end])
    order = [end]
    mask = full
    while True:
        prev = int(arg[mask, order[-1]])
        if prev < 0:
            break
        mask ^= 1 << order[-1]
        order.append(prev)
    order.reverse()
    return cost, order


def _path_cost(dist: FArr, order: Sequence[int]) -> float:
    return float(sum(dist[a, b] for a, b in itertools.pairwise(order)))


def _tsp_heuristic(dist: FArr) -> tuple[float, list[int]]:
    k = dist.shape[0]
    best: tuple[float, list[int]] = (math.inf, list(range(k)))
    for start in range(k):
        order = [start]
        left = set(range(k)) - {start}
        while left:
            nxt = min(left, key=lambda j: (dist[order[-1], j], j))
            order.append(nxt)
            left.remove(nxt)
        improved = True
        while improved:
            improved = False
            for i in range(k - 1):
                for j in range(i + 1, k):
                    cand = order[: i] + order[i: j + 1][::-1] + order[j + 1:]
                    if _path_cost(dist, cand) < _path_cost(dist, order) - 1e-15:
                        order, improved = cand, True
        cost = _path_cost(dist, order)
        if cost < best[0]:
            best = (cost, order)
    return best


def _cross_costs(inst: GaInstance, groups: IArr) -> FArr:
    g = inst.d_pp
    out = np.zeros((g, g))
    for a in range(g):
        for b in range(a + 1, g):
            out[a, b] = out[b, a] = bottleneck_matching(inst.edge[groups[a][:, None], groups[b][None, :]])
    return out


def pipeline_cost(inst: GaInstance, groups: IArr) -> tuple[float, list[int]]:
    """``PP`` of the module docstring and the stage order (group indices) that attains it."""
    return open_loop_tsp(_cross_costs(inst, groups))


def total_cost(inst: GaInstance, groups: IArr) -> float:
    """``DP + 2·PP``: the GA's fitness (lower is better)."""
    return data_parallel_cost(inst, groups) + 2.0 * pipeline_cost(inst, groups)[0]


def _groups_of(assign: IArr, d_pp: int) -> IArr:
    """``d_pp × d_dp`` device indices from a device → group assignment (devices ascending)."""
    return np.stack([np.flatnonzero(assign == g) for g in range(d_pp)]).astype(np.int64)


def five_point_crossover(parent1: IArr, parent2: IArr, d_dp: int, d_pp: int, rng: np.random.Generator) -> IArr:
    """Offspring assignment (device → group) from two permutations, as in the module docstring."""
    n = d_dp * d_pp
    a1 = np.empty(n, dtype=np.int64)
    a2 = np.empty(n, dtype=np.int64)
    a1[parent1] = np.arange(n) // d_dp
    a2[parent2] = np.arange(n) // d_dp
    points = rng.permutation(n)[:5]
    a2[points] = a1[points]
    sizes = np.bincount(a2, minlength=d_pp)
    for i in range(n):
        if sizes[a2[i]] > d_dp:
            j = int(np.flatnonzero(sizes < d_dp)[0])
            sizes[j] += 1
            sizes[a2[i]] -= 1
            a2[i] = j
    return a2


def _gains(inst: GaInstance, assign: IArr, locked: npt.NDArray[np.bool_]) -> tuple[FArr, FArr, list[tuple[int, int]]]:
    """``(G_ij, G_i, trace)`` of one cyclic-partitioning step (see the module docstring)."""
    k = inst.d_pp
    e = inst.edge
    onehot = np.zeros((len(assign), k))
    onehot[np.arange(len(assign)), assign] = 1.0
    sizes = onehot.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        gain = np.where(sizes > 0, (e @ onehot) / np.where(sizes > 0, sizes, 1.0), 0.0)
    same = (assign[:, None] == assign[None, :]) & ~np.eye(len(assign), dtype=bool)
    own = np.where(same, e, np.inf).min(axis=1)
    gain[np.arange(len(assign)), assign] = own
    g_ij = np.full((k, k), -np.inf)
    g_i = np.full(k, -np.inf)
    trace: list[tuple[int, int]] = [(-1, -1)] * k
    # per group, the unlocked member with the least cost to its own group (first in device order)
    vals = np.where(locked, np.inf, own)
    order = np.lexsort((np.arange(len(assign)), vals, assign))
    starts = np.flatnonzero(np.r_[True, assign[order][1:] != assign[order][:-1]])
    chosen = order[starts]
    chosen = chosen[np.isfinite(vals[chosen])]
    if chosen.size == 0:
        return g_ij, g_i, trace
    groups = assign[chosen]
    tg = gain[chosen] - gain[chosen, groups][:, None]
    tg[np.arange(len(chosen)), groups] = -np.inf
    g_ij[groups] = tg
    if k > 1:
        best = tg.argmax(axis=1)
        g_i[groups] = tg[np.arange(len(chosen)), best]
        for v, p, q in zip(chosen.tolist(), groups.tolist(), best.tolist(), strict=True):
            trace[p] = (v, q)
    return g_ij, g_i, trace


def _cyclic_partitioning(inst: GaInstance, assign: IArr) -> IArr:
    """One round of move cycles (the local search of the module docstring)."""
    k, n = inst.d_pp, inst.devices
    locked = np.zeros(n, dtype=bool)
    locked_groups = np.zeros(k, dtype=bool)
    states = [assign]
    sums = [0.0]
    for _ in range(k):
        cur = states[-1].copy()
        moves: list[tuple[int, int, int]] = []
        eps: list[float] = []
        tau: list[float] = []
        g_ij, g_i, trace = _gains(inst, cur, locked)
        s0 = si = int(np.argmax(g_i))
        for _ in range(n):
            v, pv = trace[si]
            if v < 0 or pv < 0:
                if not moves:
                    break
                v, pv = moves[-1][0], s0
            cur[v] = pv
            locked[v] = True
            locked_groups[pv] = True
            moves.append((v, si, pv))
            eps.append(float(g_i[si]))
            tau.append(float(g_ij[si, s0]))
            si = pv
            if si == s0:
                break
            g_ij, g_i, trace = _gains(inst, cur, locked)
        if not moves:
            break
        best_sum, best_l = 0.0, 0
        for i in range(1, len(eps)):
            val = sum(eps[:i]) + tau[i]
            if val > best_sum:
                best_sum, best_l = val, i
        for i in range(len(eps) - 1, best_l, -1):
            cur[moves[i][0]] = moves[i][1]
        cur[moves[best_l][0]] = s0
        states.append(cur)
        sums.append(best_sum)
        if locked_groups.all():
            break
    best_total, pick = 0.0, 0
    for i in range(1, len(sums)):
        total = sum(sums[:i])
        if total > best_total:
            best_total, pick = total, i - 1
    return states[pick]


@dataclass(frozen=True, slots=True, kw_only=True)
class GaOutcome:
    """The best individual (``d_pp × d_dp`` groups), its cost, and the search's counters."""

    groups: IArr
    cost: float
    trials: int
    evaluations: int
    history: tuple[float, ...]


def gcma(inst: GaInstance, rng: np.random.Generator, *, population: int = POPULATION, trials: int = TRIALS,
         deadline: float | None = None) -> GaOutcome:
    """The steady-state hybrid GA of the module docstring. ``deadline`` is a ``time.perf_counter()``
    value after which no further individual is evaluated (at least one always is). ``history`` is the
    best cost after each evaluation."""
    n, d_dp, d_pp = inst.devices, inst.d_dp, inst.d_pp
    pop: list[IArr] = []
    scores: list[float] = []
    best_groups: IArr | None = None
    best = math.inf
    history: list[float] = []

    def expired() -> bool:
        return deadline is not None and time.perf_counter() > deadline and best_groups is not None

    def score(groups: IArr) -> float:
        nonlocal best, best_groups
        c = total_cost(inst, groups)
        if c < best or best_groups is None:
            best, best_groups = c, groups
        history.append(best)
        return c

    trivial = d_dp == 1 or d_pp == 1  # a single partition up to group order: nothing to search
    for _ in range(1 if trivial else population):
        if expired():
            break
        perm = rng.permutation(n).astype(np.int64)
        pop.append(perm)
        scores.append(score(perm.reshape(d_pp, d_dp)))
    done = 0
    if not trivial:
        size = len(pop)
        for _ in range(trials):
            if expired():
                break
            p1, p2 = (int(x) for x in rng.integers(size, size=2))
            child = five_point_crossover(pop[p1], pop[p2], d_dp, d_pp, rng)
            child = _cyclic_partitioning(inst, child)
            groups = _groups_of(child, d_pp)
            c = score(groups)
            done += 1
            if c > max(scores[p1], scores[p2]):
                continue  # worse than both parents: archived, population unchanged
            worse = p1 if scores[p1] > scores[p2] else p2
            pop[worse] = groups.reshape(-1)
            scores[worse] = c
    assert best_groups is not None
    return GaOutcome(groups=best_groups, cost=best, trials=done, evaluations=len(history), history=tuple(history))


# ----------------------------------------------------------------------------------------------------
# Adaptation to topologies and plans
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Slot:
    cluster: int
    devices: tuple[int, ...]  # node index of each device (a device = tp GPUs in one node)


def _devices_per_node(c: Cluster, tp: int) -> list[int]:
    """Devices (tp-GPU groups) on each node, free GPUs packed onto nodes in order."""
    out = []
    left = c.free
    for _ in range(c.nodes):
        g = min(left, c.gpus_per_node)
        left -= g
        out.append(g // tp)
    return out


def _worst_stage_bytes(job: JobSpec, d_pp: int, d_dp: int, tp: int) -> float:
    """Memory per GPU of the worst stage any position of a uniform split could have (see docstring)."""
    mdl = job.model
    m = job.micro_batches_total
    per = math.ceil(mdl.layers / d_pp)
    in_flight = min(math.ceil(m / d_dp), d_pp)
    first = 0
    last = min(mdl.layers - 1, per - 1) if d_pp == 1 else per - 1
    body = stage_memory_bytes(mdl, first, last, tp, job.micro_batch, job.seq_len, in_flight)
    if d_pp > 1:  # what the last stage carries that stage 0 does not: head parameters and fp32 logits
        body += (16.0 * mdl.embedding_params + 4.0 * job.micro_batch * job.seq_len * mdl.vocab) / tp
    return body


def _uniform_split(layers: int, parts: int) -> list[int]:
    q, r = divmod(layers, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def _hungarian_max(weight: FArr) -> list[int]:
    """Assignment rows → columns maximising total ``weight`` (square), O(k³) (Kuhn–Munkres)."""
    k = weight.shape[0]
    cost = weight.max() - weight
    u = np.zeros(k + 1)
    v = np.zeros(k + 1)
    p = np.zeros(k + 1, dtype=np.int64)
    way = np.zeros(k + 1, dtype=np.int64)
    for i in range(1, k + 1):
        p[0] = i
        j0 = 0
        minv = np.full(k + 1, np.inf)
        used = np.zeros(k + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = p[j0]
            delta, j1 = np.inf, 0
            for j in range(1, k + 1):
                if not used[j]:
                    cur = cost[i0 - 1, j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(k + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while True:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
            if j0 == 0:
                break
    out = [0] * k
    for j in range(1, k + 1):
        out[p[j] - 1] = j - 1
    return out


class GeneticPolicy:
    """The DT-FM hybrid GA baseline (see the module docstring). ``population``/``trials`` default to the
    published budget; ``Budget.time_limit_s`` caps the wall time; ``Budget.seed`` seeds the generator."""

    name = "genetic"

    def __init__(self, *, population: int = POPULATION, trials: int = TRIALS) -> None:
        self.population = population
        self.trials = trials

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget if budget is not None else Budget()
        t0 = time.perf_counter()
        res = self._place(topo, job, budget, t0)
        res = replace(res, planning_seconds=time.perf_counter() - t0)
        _log.info("placement.genetic", job=job.id, revision=topo.revision, status=str(res.status),
                  seconds=round(res.planning_seconds, 4), step_s=res.plan.step_time_s if res.plan else None,
                  trials=res.stats.get("trials"), reason=res.reason or None)
        return res

    def _place(self, topo: Topology, job: JobSpec, budget: Budget, t0: float) -> PlacementResult:
        early = diagnose(topo, job, self.name)
        if early is not None:
            return early
        tps = [t for t in (1, 2, 4, 8) if job.model.heads % t == 0]
        chosen: tuple[int, int, int, list[_Slot]] | None = None
        shapes = 0
        for tp in tps:
            pick, tried = self._choose_shape(topo, job, tp)
            shapes += tried
            if pick is not None:
                chosen = (tp, *pick)
                break
        if chosen is None:
            everything = topo.with_free({c.name: c.total_gpus for c in topo.clusters})
            could = any(self._choose_shape(everything, job, tp)[0] is not None for tp in tps)
            return PlacementResult(
                status=PlacementStatus.UNSCHEDULABLE if could else PlacementStatus.UNRESOLVABLE,
                policy=self.name, constraint="memory",
                reason=(f"no uniform pipeline of D_DP-GPU groups (tp ≤ 8) within {job.gpus.min}..{job.gpus.max} "
                        f"GPUs holds {job.model.name} in the memory of "
                        + ("the free GPUs" if could else "any GPUs of this topology")),
            )
        tp, d_pp, d_dp, slots = chosen
        inst, owner = self._instance(topo, job, tp, d_pp, d_dp, slots)
        rng = np.random.default_rng(budget.seed)
        deadline = None if budget.time_limit_s is None else t0 + budget.time_limit_s
        out = gcma(inst, rng, population=self.population, trials=self.trials, deadline=deadline)
        plan, moved = self._to_plan(topo, job, inst, owner, slots, out.groups, tp)
        plan = evaluate(plan, topo, job)
        stats = {
            "ga_cost_s": out.cost,
            "ga_dp_cost_s": data_parallel_cost(inst, out.groups),
            "ga_pp_cost_s": 2.0 * pipeline_cost(inst, out.groups)[0],
            "trials": float(out.trials),
            "evaluations": float(out.evaluations),
            "population": float(self.population),
            "d_dp": float(d_dp),
            "d_pp": float(d_pp),
            "tp": float(tp),
            "repair_moved": float(moved),
            "shapes": float(shapes),
        }
        broken = check_plan(plan, topo, job)
        if broken:  # cannot happen with the worst-case slot filter; never hand out an invalid plan
            return PlacementResult(status=PlacementStatus.ERROR, policy=self.name, stats=stats, constraint="plan",
                                   reason="; ".join(broken))
        return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=plan, optimal=None, stats=stats)

    # -- shape and pool ------------------------------------------------------------------------------

    @staticmethod
    def _choose_shape(topo: Topology, job: JobSpec, tp: int) -> tuple[tuple[int, int, list[_Slot]] | None, int]:
        """``((d_pp, d_dp, slots), shapes_tried)``: the cost-model-best shape and its pool (docstring)."""
        L = job.model.layers
        m = job.micro_batches_total
        bw = topo.bandwidth_matrix
        cs = topo.clusters
        order = sorted(range(len(cs)), key=lambda i: (-cs[i].effective_tflops, -cs[i].free, cs[i].name))
        order = [i for i in order if topo.clusters[i].free >= tp and topo.clusters[i].gpus_per_node >= tp]
        if not order:
            return None, 0
        root = order[0]
        order = [i for i in order if i == root or (bw[root, i] > 0 and bw[i, root] > 0)]
        node_devs = {i: _devices_per_node(topo.clusters[i], tp) for i in order}
        n_dev = {i: sum(v) for i, v in node_devs.items()}
        best: tuple[float, tuple[int, int, list[_Slot]]] | None = None
        tried = 0
        max_dev = job.gpus.max // tp
        for d_pp in range(1, min(L, max_dev) + 1):
            for d_dp in range(1, max_dev // d_pp + 1):
                if tp * d_dp * d_pp < job.gpus.min:
                    continue
                cap = _worst_stage_bytes(job, d_pp, d_dp, tp)
                slots: list[_Slot] = []
                for i in order:
                    if topo.clusters[i].gpu_memory_gib * GIB < cap:
                        continue
                    nodes = [node for node, cnt in enumerate(node_devs[i]) for _ in range(cnt)]
                    for s in range(n_dev[i] // d_dp):
                        if len(slots) < d_pp:
                            slots.append(_Slot(cluster=i, devices=tuple(nodes[s * d_dp:(s + 1) * d_dp])))
                if len(slots) < d_pp:
                    continue
                tried += 1
                split = _uniform_split(L, d_pp)
                stages, first = [], 0
                for sl, nl in zip(slots, split, strict=True):
                    stages.append(Stage(cluster=topo.clusters[sl.cluster].name, first_layer=first,
                                        last_layer=first + nl - 1, tp=tp, dp=d_dp))
                    first += nl
                plan = evaluate(Plan(stages=tuple(stages), micro_batches=m, schedule=Schedule.ONE_F_ONE_B), topo, job)
                if best is None or plan.step_time_s < best[0]:
                    best = (plan.step_time_s, (d_pp, d_dp, slots))
        return (best[1] if best is not None else None), tried

    @staticmethod
    def _instance(topo: Topology, job: JobSpec, tp: int, d_pp: int, d_dp: int,
                  slots: Sequence[_Slot]) -> tuple[GaInstance, IArr]:
        """The device matrices of the pool; ``owner[v]`` is the slot index device ``v`` came from."""
        cl = np.array([sl.cluster for sl in slots for _ in sl.devices], dtype=np.int64)
        node = np.array([nd for sl in slots for nd in sl.devices], dtype=np.int64)
        owner = np.array([k for k, sl in enumerate(slots) for _ in sl.devices], dtype=np.int64)
        bwm, latm = topo.bandwidth_matrix, topo.latency_matrix
        bw = bwm[cl[:, None], cl[None, :]].copy()
        lat = latm[cl[:, None], cl[None, :]].copy()
        same_cluster = cl[:, None] == cl[None, :]
        same_node = same_cluster & (node[:, None] == node[None, :])
        intra = np.array([topo.clusters[i].intra_node_gbps for i in cl])
        inter = np.array([topo.clusters[i].inter_node_gbps for i in cl])
        bw = np.where(same_node, intra[:, None], np.where(same_cluster, inter[:, None], bw))
        lat = np.where(same_cluster, 0.0, lat)
        m = job.micro_batches_total
        act = math.ceil(m / d_dp) * activation_bytes(job.model, job.micro_batch, job.seq_len)
        grad = 2.0 * job.model.total_params / (d_pp * tp)
        inst = GaInstance(delay_ms=lat, bandwidth_gbps=bw, d_dp=d_dp, d_pp=d_pp, activation=act, gradient=grad)
        return inst, owner

    @staticmethod
    def _to_plan(topo: Topology, job: JobSpec, inst: GaInstance, owner: IArr, slots: Sequence[_Slot],
                 groups: IArr, tp: int) -> tuple[Plan, int]:
        """Map GA groups to slots (max overlap), order stages by the GA's pipeline cost, uniform split."""
        k = inst.d_pp
        slot_cluster = np.array([sl.cluster for sl in slots])
        dev_cluster = slot_cluster[owner]
        overlap = np.array([[float(np.sum(dev_cluster[groups[g]] == slot_cluster[s])) for s in range(k)]
                            for g in range(k)])
        assign = _hungarian_max(overlap)
        moved = int(inst.devices - sum(overlap[g, assign[g]] for g in range(k)))
        mapped = np.stack([np.flatnonzero(owner == assign[g]) for g in range(k)]).astype(np.int64)
        _, order = pipeline_cost(inst, mapped)
        split = _uniform_split(job.model.layers, k)
        stages, first = [], 0
        for g, nl in zip(order, split, strict=True):
            stages.append(Stage(cluster=topo.clusters[slots[assign[g]].cluster].name, first_layer=first,
                                last_layer=first + nl - 1, tp=tp, dp=inst.d_dp))
            first += nl
        plan = Plan(stages=tuple(stages), micro_batches=job.micro_batches_total, schedule=Schedule.ONE_F_ONE_B)
        return plan, moved


register_policy("genetic", GeneticPolicy)
