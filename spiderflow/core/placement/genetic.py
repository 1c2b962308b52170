r"""``genetic``: the hybrid genetic algorithm of Yuan et al., NeurIPS 2022 (DT-FM), as a placement baseline.

What the original does
----------------------
DT-FM's scheduler (DS3Lab/DT-FM, ``scheduler/heuristic_evolutionary_solver``) takes ``N = D_DP × D_PP``
devices and partitions them into ``D_PP`` groups of ``D_DP``: group ``g`` is one pipeline stage, its
members the stage's data-parallel replicas. Fitness: data-parallel all-reduce cost + 2 × pipeline cost,
the pipeline cost being an open-loop TSP over the bottleneck matching between groups (the stage order).
Search (GCMA, steady state): a population of random permutations (100 published); each trial (4,900
published) draws two parents, applies a five-point crossover (five random devices take parent 1's group in
parent 2's assignment, then oversized groups give members to the first undersized one) and a local search
(cyclic partitioning: move members between groups while the communication gain is positive); the offspring
replaces the worse parent unless it is worse than both. The best individual ever scored wins.

What we do
----------
A SpiderFlow stage runs on one cluster, so the only partitions a plan can express are *cluster-pure*
ones: each group is ``D_DP`` devices of one cluster (one device = ``t`` tensor-parallel GPUs of one node).
The GA searches exactly that space and everything it decides reaches the plan:

- **Genome** ``x ∈ {clusters}^{D_PP}``: the cluster of each group, with ``#{g: x_g = c} ≤ cap_c =
  ⌊devices_c / D_DP⌋`` (a cluster may host several groups). A random individual is DT-FM's random
  permutation of *all* free devices of *all* clusters with the groups made pure: it draws ``D_PP`` of the
  ``Σ_c cap_c`` group slots uniformly without replacement (so a cluster is drawn in proportion to its free
  devices). Which clusters run the job, how many GPUs each gives (``t·D_DP`` per group), and — through the
  order below — the chain are all outputs of the search; no device pool is chosen beforehand.
- **Decoding** (the published pipeline cost, at cluster granularity): the edge cost between two groups on
  clusters ``u, v`` is ``e_uv = l_uv/10³ + 8a/(b_uv·10⁹)`` (``a = ⌈m/D_DP⌉·2bsh`` bytes a replica pipes
  per step; same cluster: inter-node bandwidth, no latency); since every member of a pure group has the
  same edges, the bottleneck matching between two groups *is* ``e_uv``, and the stage order is the
  open-loop TSP over ``e`` (exact Held–Karp up to :data:`EXACT_TSP_MAX` groups, nearest neighbour + 2-opt
  above). Layers are split in proportion to each group's compute (``t·D_DP·F_c``; DT-FM splits uniformly
  over identical devices, which on heterogeneous clusters would only handicap the baseline); the uniform
  split is also tried and the better one kept.
- **Fitness** is the shared cost model (:func:`spiderflow.core.costmodel.evaluate`: compute, boundary
  transfers, the gradient all-reduce, the pipeline schedule) on the decoded 1F1B plan, with the cost
  model's exact memory per GPU: a plan whose stage exceeds its GPUs' memory scores ``10⁹ + excess GiB``
  (infeasible individuals stay in the population and are ranked by how far off they are). DT-FM's
  communication-only cost is the special case of identical devices; on heterogeneous clusters compute is
  what the plan's step time is made of, and every policy is scored by this same model.
- **Operators**, transposed to the genome: five-point crossover (``min(5, D_PP)`` random group positions
  take parent 1's cluster; a cluster over its capacity gives its last groups to the first cluster, in
  the topology's order, with room, as the published repair does); local search in the spirit of cyclic
  partitioning: for each group in random order, move it to the cluster with room whose mean edge cost to
  the other groups' clusters is least (the published gain), keeping the move only if the fitness improves;
  steady-state replacement with the published acceptance rule.
- **Shapes.** DT-FM takes ``(D_DP, D_PP)`` as input; here every tensor-parallel degree ``t`` (dividing
  the heads, at most a node) and every shape with ``gpus.min ≤ t·D_DP·D_PP ≤ gpus.max``,
  ``t·D_DP·D_PP ≥ gpus.max/2`` (or ``gpus.min`` if larger), ``D_PP ≤ L`` and enough free group slots is a
  candidate; all ``t`` are compared, not the first that fits. The budget is shared: each shape gets
  ``max(1, ⌊P/S⌋)`` random individuals; the :data:`FINALISTS` shapes with the best initial individual get
  their population topped up to ``max(2, ⌊P/F⌋)`` and ``⌊T/F⌋`` trials each (the first finalists take the
  remainder).

Two bugs of the published code are fixed, not reproduced: ``random.seed = i`` / ``np.random.seed = i``
assign instead of seeding (every draw here comes from one ``numpy.random.Generator`` seeded with
``Budget.seed``), and the malformed acceptance test ``score > max(s1, score > s2)`` is the intended
``score > max(s1, s2)``.

Why it is a fair, competent baseline
------------------------------------
It keeps DT-FM's search (population, five-point crossover, local search, steady-state replacement,
TSP stage order) and its budget, searches the whole space a SpiderFlow plan can express (clusters, order,
GPUs per cluster, tp, shape), and is scored by the same cost model and memory as SpinSearch. Its
population and trials decide the plan: with ``trials = 0`` it is a random search over the initial
population (the ablation in the tests shows the trials change the plan and lower its step time).

Budget: population :data:`POPULATION` and :data:`TRIALS` as published (constructor options, the CLI's
``--population``/``--trials``); ``Budget.time_limit_s`` caps the wall time (checked before every
evaluation; at least one feasible-or-not individual is scored per shape). Each evaluation is memoised by
the multiset of clusters (the order follows from it). Complexity per evaluation: ``O(D_PP²·2^{D_PP})``
(exact TSP) plus one cost-model evaluation ``O(D_PP)``; per trial the local search adds at most ``D_PP``
evaluations.

``stats`` keys: ``trials`` (completed), ``evaluations`` (cost-model evaluations, memo misses),
``population``, ``shapes``, ``finalists``, ``tp``, ``d_dp``, ``d_pp`` (of the winner), ``initial_step_s``
(best step of the initial populations: what ``trials = 0`` would return), ``ga_step_s`` (the winner's).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import numpy.typing as npt
import structlog

from spiderflow.core.costmodel import activation_bytes, compute_rate_tflops, evaluate, fits_memory, wire_bytes
from spiderflow.core.domain import JobSpec, Plan, Schedule, Stage, Topology
from spiderflow.core.kernels.formulas import transfer_times
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus, register_policy
from spiderflow.core.placement.common import check_plan, diagnose

__all__ = [
    "EXACT_TSP_MAX",
    "FINALISTS",
    "INFEASIBLE",
    "POPULATION",
    "TRIALS",
    "GeneticPolicy",
    "Shape",
    "open_loop_tsp",
]

POPULATION = 100
TRIALS = 4900
EXACT_TSP_MAX = 12
FINALISTS = 4
INFEASIBLE = 1e9

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]

_log = structlog.get_logger(__name__)


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
    """Nearest neighbour from every start, then 2-opt on the open path (moves chosen on the symmetrised
    matrix, first improvement); the best path by its true cost."""
    k = dist.shape[0]
    sym = (dist + dist.T) / 2.0
    big = np.where(np.isfinite(sym), sym, 1e30)
    best: tuple[float, list[int]] = (math.inf, list(range(k)))
    for start in range(k):
        order = [start]
        left = np.ones(k, dtype=bool)
        left[start] = False
        for _ in range(k - 1):
            row = np.where(left, big[order[-1]], np.inf)
            nxt = int(np.argmin(row))
            order.append(nxt)
            left[nxt] = False
        improved = True
        while improved:
            improved = False
            for i in range(k - 1):
                for j in range(i + 1, k):
                    before = (big[order[i - 1], order[i]] if i > 0 else 0.0) + (
                        big[order[j], order[j + 1]] if j + 1 < k else 0.0)
                    after = (big[order[i - 1], order[j]] if i > 0 else 0.0) + (
                        big[order[i], order[j + 1]] if j + 1 < k else 0.0)
                    if after < before - 1e-12:
                        order[i: j + 1] = order[i: j + 1][::-1]
                        improved = True
        cost = _path_cost(dist, order)
        if cost < best[0]:
            best = (cost, order)
    return best


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """One GA run's fixed inputs: tensor-parallel degree ``tp``, ``d_pp`` groups of ``d_dp`` devices,
    and the group capacity ``cap[c]`` of every cluster (index into the topology)."""

    tp: int
    d_pp: int
    d_dp: int
    cap: tuple[int, ...]

    @property
    def gpus(self) -> int:
        return self.tp * self.d_pp * self.d_dp


def _devices(free: int, nodes: int, per_node: int, tp: int) -> int:
    """Devices (tp GPUs in one node) of a cluster, free GPUs packed onto nodes in order."""
    if tp > per_node:
        return 0
    full, rest = divmod(free, per_node)
    return min(full, nodes) * (per_node // tp) + (rest // tp if full < nodes else 0)


def shapes(topo: Topology, job: JobSpec) -> list[Shape]:
    """Every candidate shape of the module docstring, tp ascending, then d_pp, then d_dp."""
    out: list[Shape] = []
    lo = max(job.gpus.min, (job.gpus.max + 1) // 2)
    for tp in (t for t in range(1, 9) if job.model.heads % t == 0):
        devs = [_devices(c.free, c.nodes, c.gpus_per_node, tp) for c in topo.clusters]
        max_dev = job.gpus.max // tp
        for d_pp in range(1, min(job.model.layers, max_dev) + 1):
            for d_dp in range(1, max_dev // d_pp + 1):
                if tp * d_pp * d_dp < lo:
                    continue
                cap = tuple(d // d_dp for d in devs)
                if sum(cap) >= d_pp:
                    out.append(Shape(tp=tp, d_pp=d_pp, d_dp=d_dp, cap=cap))
    return out


class _Fitness:
    """Decode and score genomes of one shape (memoised by the multiset of clusters)."""

    def __init__(self, topo: Topology, job: JobSpec, shape: Shape) -> None:
        self.topo, self.job, self.shape = topo, job, shape
        cs = topo.clusters
        m = job.micro_batches_total
        # one activation per micro-batch a replica runs, in the sending cluster's wire format and the job's precision
        act = math.ceil(m / shape.d_dp) * np.array(
            [activation_bytes(job.model, job.micro_batch, job.seq_len, wire_bytes(c, job.precision)) for c in cs])
        bw = topo.bandwidth_matrix.copy()
        lat = topo.latency_matrix.copy()
        for i, c in enumerate(cs):
            bw[i, i] = c.inter_node_gbps
            lat[i, i] = 0.0
        self.edge: FArr = transfer_times(act[:, None], bw, lat)
        self.memo: dict[tuple[int, ...], tuple[float, Plan]] = {}
        self.evaluations = 0

    def plan(self, genome: IArr) -> tuple[float, Plan]:
        key = tuple(sorted(int(x) for x in genome))
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        self.evaluations += 1
        sh, job, topo = self.shape, self.job, self.topo
        distinct = sorted(set(key))
        _, order = open_loop_tsp(self.edge[np.ix_(distinct, distinct)])
        # groups on one cluster are consecutive: their mutual edge is the cluster's own, the cheapest
        chain = [distinct[k] for k in order for _ in range(key.count(distinct[k]))]
        L = job.model.layers
        weights = [compute_rate_tflops(topo.clusters[c], job.precision) for c in chain]
        best: tuple[float, Plan] | None = None
        for split in {tuple(_proportional(L, weights)), tuple(_proportional(L, [1.0] * len(chain)))}:
            stages, first = [], 0
            for c, n in zip(chain, split, strict=True):
                stages.append(Stage(cluster=topo.clusters[c].name, first_layer=first, last_layer=first + n - 1,
                                    tp=sh.tp, dp=sh.d_dp))
                first += n
            plan = evaluate(Plan(stages=tuple(stages), micro_batches=job.micro_batches_total,
                                 schedule=Schedule.ONE_F_ONE_B), topo, job)
            ok, _, excess = fits_memory(plan, topo)
            step = plan.step_time_s
            score = step if ok and math.isfinite(step) else INFEASIBLE + max(excess, 0.0)
            if best is None or score < best[0]:
                best = (score, plan)
        assert best is not None
        self.memo[key] = best
        return best


def _proportional(layers: int, weights: Sequence[float]) -> list[int]:
    """Layers in proportion to ``weights`` (largest remainder, at least one each)."""
    k = len(weights)
    total = sum(weights)
    raw = [layers * w / total for w in weights]
    out = [max(1, int(r)) for r in raw]
    while sum(out) > layers:
        i = max((j for j in range(k) if out[j] > 1), key=lambda j: out[j] - raw[j])
        out[i] -= 1
    while sum(out) < layers:
        i = max(range(k), key=lambda j: raw[j] - out[j])
        out[i] += 1
    return out


def _random_genome(shape: Shape, rng: np.random.Generator) -> IArr:
    """DT-FM's random permutation of every free device, groups made pure (see the module docstring)."""
    slots = np.repeat(np.arange(len(shape.cap), dtype=np.int64), shape.cap)
    return rng.permutation(slots)[: shape.d_pp].astype(np.int64)


def crossover(p1: IArr, p2: IArr, shape: Shape, rng: np.random.Generator) -> IArr:
    """Five-point crossover on group positions, then the capacity repair of the module docstring."""
    child = p2.copy()
    pts = rng.permutation(shape.d_pp)[: min(5, shape.d_pp)]
    child[pts] = p1[pts]
    used = np.bincount(child, minlength=len(shape.cap))
    cap = np.asarray(shape.cap)
    for g in range(shape.d_pp - 1, -1, -1):
        c = int(child[g])
        if used[c] > cap[c]:
            room = int(np.flatnonzero(used < cap)[0])
            used[c] -= 1
            used[room] += 1
            child[g] = room
    return child


def _local_search(fit: _Fitness, genome: IArr, score: float, rng: np.random.Generator,
                  expired: Callable[[], bool]) -> tuple[IArr, float]:
    """One pass of group moves (module docstring); returns the improved genome and its score."""
    cap = np.asarray(fit.shape.cap)
    cur, cur_s = genome.copy(), score
    for g in rng.permutation(len(cur)):
        if expired():
            break
        used = np.bincount(cur, minlength=len(cap))
        others = np.delete(cur, g)
        room = np.flatnonzero(used < cap)
        if room.size == 0 or others.size == 0:
            continue
        gain = fit.edge[np.ix_(room, others)].mean(axis=1)
        target = int(room[int(np.argmin(gain))])
        if target == cur[g]:
            continue
        cand = cur.copy()
        cand[g] = target
        s, _ = fit.plan(cand)
        if s < cur_s:
            cur, cur_s = cand, s
    return cur, cur_s


@dataclass(slots=True)
class _Run:
    shape: Shape
    fit: _Fitness
    pop: list[IArr]
    scores: list[float]
    trials: int = 0

    @property
    def best(self) -> float:
        return min(self.scores)


class GeneticPolicy:
    """The DT-FM hybrid GA baseline (see the module docstring). ``population``/``trials`` default to the
    published budget; ``Budget.time_limit_s`` caps the wall time; ``Budget.seed`` seeds the generator."""

    name = "genetic"

    def __init__(self, *, population: int = POPULATION, trials: int = TRIALS) -> None:
        if population < 1:
            raise ValueError(f"population must be ≥ 1 (got {population})")
        if trials < 0:
            raise ValueError(f"trials must be ≥ 0 (got {trials})")
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
        cands = shapes(topo, job)
        if not cands:
            return PlacementResult(
                status=PlacementStatus.UNSCHEDULABLE, policy=self.name, constraint="free_gpus",
                reason=f"no D_DP × D_PP shape of tensor-parallel devices within {job.gpus.min}..{job.gpus.max} "
                       "GPUs fits the free GPUs of the topology's nodes")
        rng = np.random.default_rng(budget.seed)
        deadline = None if budget.time_limit_s is None else t0 + budget.time_limit_s
        runs: list[_Run] = []

        def expired() -> bool:
            return deadline is not None and time.perf_counter() > deadline

        def seed_individuals(run: _Run, count: int) -> None:
            for _ in range(count):
                if run.pop and expired():
                    return
                genome = _random_genome(run.shape, rng)
                run.pop.append(genome)
                run.scores.append(run.fit.plan(genome)[0])

        per_shape = max(1, self.population // len(cands))
        for sh in cands:
            if runs and expired():
                break
            run = _Run(shape=sh, fit=_Fitness(topo, job, sh), pop=[], scores=[])
            seed_individuals(run, per_shape)
            runs.append(run)
        finalists = sorted(runs, key=lambda r: r.best)[:FINALISTS]
        for run in finalists:
            seed_individuals(run, max(2, self.population // len(finalists)) - len(run.pop))
        initial = min(r.best for r in runs)
        share, extra = divmod(self.trials, len(finalists))
        for k, run in enumerate(finalists):
            if expired():
                break
            self._evolve(run, share + (1 if k < extra else 0), rng, expired)
        winner = min(runs, key=lambda r: r.best)
        score, plan = winner.fit.plan(winner.pop[int(np.argmin(winner.scores))])
        stats = {
            "trials": float(sum(r.trials for r in runs)),
            "evaluations": float(sum(r.fit.evaluations for r in runs)),
            "population": float(self.population),
            "shapes": float(len(runs)),
            "finalists": float(len(finalists)),
            "tp": float(winner.shape.tp),
            "d_dp": float(winner.shape.d_dp),
            "d_pp": float(winner.shape.d_pp),
            "initial_step_s": initial if initial < INFEASIBLE else math.inf,
            "ga_step_s": score if score < INFEASIBLE else math.inf,
        }
        if score >= INFEASIBLE:
            everything = topo.with_free({c.name: c.total_gpus for c in topo.clusters})
            could = bool(shapes(everything, job)) and diagnose(everything, job, self.name) is None
            return PlacementResult(
                status=PlacementStatus.UNSCHEDULABLE if could else PlacementStatus.UNRESOLVABLE,
                policy=self.name, constraint="memory", stats=stats,
                reason=f"no plan the search found holds {job.model.name} in the memory of the free GPUs "
                       f"(best exceeds it by {score - INFEASIBLE:.1f} GiB per GPU)")
        broken = check_plan(plan, topo, job)
        if broken:  # cannot happen: shapes respect the range and free devices, memory is scored exactly
            return PlacementResult(status=PlacementStatus.ERROR, policy=self.name, stats=stats, constraint="plan",
                                   reason="; ".join(broken))
        return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=plan, optimal=None, stats=stats)

    @staticmethod
    def _evolve(run: _Run, trials: int, rng: np.random.Generator, expired: Callable[[], bool]) -> None:
        """The steady-state GCMA loop on one shape's population."""
        size = len(run.pop)
        if size < 2 or (run.shape.d_pp == 1 and sum(1 for c in run.shape.cap if c) == 1):
            return
        for _ in range(trials):
            if expired():
                return
            p1, p2 = (int(x) for x in rng.integers(size, size=2))
            child = crossover(run.pop[p1], run.pop[p2], run.shape, rng)
            s, _ = run.fit.plan(child)
            child, s = _local_search(run.fit, child, s, rng, expired)
            run.trials += 1
            if s > max(run.scores[p1], run.scores[p2]):
                continue  # worse than both parents: archived, population unchanged
            worse = p1 if run.scores[p1] > run.scores[p2] else p2
            run.pop[worse] = child
            run.scores[worse] = s


register_policy("genetic", GeneticPolicy)
