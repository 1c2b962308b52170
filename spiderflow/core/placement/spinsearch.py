r"""SpinSearch: cross-cluster placement as a pruned beam search over chains of clusters.

Problem. Given a topology snapshot (free GPUs ``n_c``, per-GPU achieved rate ``F_c``, memory ``M_c``,
widest-path transfer time ``P_uv`` of one activation between every pair) and a job (``L`` layers,
``m`` micro-batches, GPU range ``[G_min, G_max]``), choose an ordered chain ``c_1 … c_k`` of distinct
clusters and GPUs ``g_i`` per cluster.

Objective: minimise ``J = step`` (``Budget.objective = jct``, i.e. maximise throughput), ``usd`` per step
(``cost``) or ``step·√usd`` (``balanced``), where ``step`` and ``usd`` come from the closed-form scorer
:func:`~spiderflow.core.placement.common.score_chains` during the search and from the exact cost model
(:func:`spiderflow.core.costmodel.evaluate`, via :func:`~spiderflow.core.placement.common.plan_chain`) for the
final plan.

Constraints:
  (1) ``1 ≤ g_i ≤ n_{c_i}`` (free GPUs);
  (2) ``G_min ≤ Σ_i g_i ≤ G_max`` (GPU range); GPUs beyond ``G_min`` are kept only when they improve the
      objective by more than :data:`TRIM_TOLERANCE` (relative);
  (3) memory: every stage fits its GPUs (capacity water-filling in the scorer, exact check at the end);
  (4) ``k ≤ L`` (each cluster gets ≥ 1 contiguous layer block);
  (5) consecutive clusters are reachable both ways (``P_{c_i c_{i+1}} < ∞``; :func:`transfer_matrix` makes a
      pair unreachable when either direction is: activations go forward, gradients back).

Pruning rules (links of the complete widest-path graph that a chain may use as a hop):
  (a) *activation-stream rule* (BACE-Pipe's bandwidth-aware pathfinder): a hop ``u → v`` is kept only if
      ``P_uv ≤ θ = max(κ·τ_lb, 2·θ_conn)`` where ``τ_lb = 3·(L·f + f_head) / Σ_top R`` is the compute
      bottleneck with the job's ``G_max`` fastest GPUs (no hop slower than a few pipeline beats) and
      ``θ_conn`` the smallest threshold at which some connected group of clusters has ``G_min`` free GPUs
      and enough memory for the model states (Kruskal over each cluster's nearest hops);
  (b) *incumbent bound* (``jct`` only, sound): ``step ≥ (m + 1)·P`` for any hop on the chain, so hops with
      ``(m + 1)·P_uv ≥ step*`` of the best single-cluster plan cannot help;
  (c) clusters without free GPUs are never used; if rule (a) leaves no feasible chain the search is
      repeated with (a) disabled.

Search:
  1. score every single-cluster chain (incumbent);
  2. seeds: the ``S`` clusters with most free effective compute ``min(n_c, G_max)·F_c``;
  3. beam: each partial chain is extended at its head or tail by one of the ``N`` nearest kept hops of
     that end (one hop at a time); all extensions are scored at once, feasible ones enter a pool, and the
     ``B`` best by estimated objective (capacity and GPU shortfalls as multiplicative penalties) survive;
     stop at depth ``min(L, #usable)``, or when two levels in a row improve nothing and a feasible chain
     is known (or the whole beam is feasible);
  4. refine the pool's best chains by hill climbing over reverse / swap-adjacent / remove / insert /
     replace moves (``R = 3`` starts for ``jct``, 6 otherwise); then tune the GPUs of the best candidates
     (shift 1, 2, 4 or a node's worth between positions while the estimate improves; for ``jct`` drop
     GPUs worth less than :data:`TRIM_TOLERANCE` of the estimate — constraint 2);
  5. plan the ``T`` best distinct chains (tuned and untuned GPU vectors; the untuned wins only by more
     than :data:`TRIM_TOLERANCE`), and the best single-cluster candidate when no finalist is one, with the
     level-1 planner on the exact cost model; re-plan the :data:`REPLAN` best of them by their level-1
     plans with TPA when it is importable (each also on the GPUs its level-1 plan uses, where that plan
     leaves some idle; the best also on the GPUs of its level-1 plan with every shape competing alike) and
     keep the best plan on the exact timeline
     (:func:`~spiderflow.core.placement.common.finalise` with ``replan``). The scorer and the level-1
     planner price a cluster as one stage, so the chain they rank first is not always the one TPA,
     pipelining inside clusters, plans fastest. If no finalist fits memory exactly, the remaining
     candidates are tried.
  5b. *priced choice* (optional, ``gpu_price`` λ > 0, ``jct`` only, and only on a busy pool): the
     finalists and fewer-GPU variants of them (:func:`fewer_gpus`) are planned by the level-1 planner and
     the one with the least priced finish time ``S·step·(1 + λ·ρ·g/F)`` is kept (:func:`priced_choice`),
     where ``g`` is the GPUs the plan holds, ``F`` the GPUs free now and ``ρ`` the pressure on the pool
     (:func:`queue_pressure`: ``D/F`` with ``D`` = :attr:`Budget.demand_gpus`, the GPUs held by other
     jobs plus the other queued jobs' minimum GPUs, capped at :data:`PRESSURE_CAP`). With nothing queued,
     ``ρ = u/(1 − u)`` for the pool's utilisation ``u``: the congestion factor of a queue, which grows
     without bound as the pool fills. ``λ·ρ·g/F`` is a shadow price of the GPUs: the share of the free
     pool the plan holds, weighted by how scarce GPUs are. On an idle pool with an empty queue (``ρ = 0``)
     or with ``λ = 0`` the choice is exactly the fastest plan. Rationale: a job given its fastest plan often
     takes a whole region for a few per cent, and the next job finds only slow GPUs left; per-job greed is
     optimal for the job, not for the jobs arriving after it. Measured on the benchmark grid
     (BENCHMARKS.md): no gain in plan throughput or JCT beyond noise, hence off by default.
  5c. *region matching* (optional, ``lookahead``, ``jct`` only, when the scheduler passes an
     :class:`~spiderflow.core.domain.Outlook` of the arrivals in :attr:`Budget.outlook`): the finalists and
     one whole-cluster allocation per distinct cluster are valued by the job's log run time plus the log
     slowdown it causes the typical arrival, times the arrivals expected to want those GPUs while it runs
     (:mod:`spiderflow.core.placement.lookahead`); a non-finalist with a lower value replaces the finalists.
     When a finalist wins, nothing changes. Measured on the benchmark grid (BENCHMARKS.md, "Region matching
     by look-ahead"): no gain in plan throughput, lower mean-JCT ratios, hence off by default.
  5d. *challengers*: up to :data:`CHALLENGERS` candidates below the finalists whose estimate is within
     :data:`NEAR_TIE` of the best are planned by TPA too, and replace the finalists' plan when faster on the
     exact timeline by more than :data:`NEAR_TIE` (the scorer's closed form cannot tell chains that close
     apart) — with more GPUs than that plan only when no other job holds or waits for GPUs
     (:attr:`Budget.demand_gpus` = 0).
  6. start now or wait (:func:`wait_or_start`, when the scheduler passes expected GPU releases in
     :attr:`Budget.releases`): if starting on the GPUs released by some ``a_i`` scores the whole job
     (finish time for ``jct``, dollars for ``cost``) better than starting now by more than
     :data:`DEFER_MARGIN`, the answer is
     ``WAIT`` with a :class:`~spiderflow.core.domain.Wait` (``after_s = a_i`` and the plan it waits for; the
     scheduling cycle asks again then, and shows the plan's GPUs to other jobs as claimed). SpinSearch is a
     :class:`~spiderflow.core.placement.base.WaitPricer`: the cycle hands it the releases.
     Release points are searched best-first by a lower bound on the finish time there. Greedy "start now
     on whatever is free" strands a job for hours on a few slow GPUs spread over several clusters when a
     fast cluster frees up minutes later.

Complexity: building ``P`` and the hop order is O(n² log n) once per topology (cached while the topology
object lives); seeding and pruning are O(n·N log n); the search scores O(D·B·N) chains of length ≤ D with
O(D) numpy work each, D ≤ min(L, n), so O(D²·B·N) arithmetic, independent of n beyond the cached
preprocessing; refinement adds O(R·I·D²·N) for I ≤ 6 rounds. The level-1 planning is O(T·L·D·C) block
evaluations (C ≤ 36 configurations each, O(1) per configuration). Polynomial; no ILP in the loop.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import structlog

from spiderflow.core.costmodel import GIB, RESERVED_GIB
from spiderflow.core.domain import JobSpec, Plan, Topology, Wait
from spiderflow.core.errors import UnschedulableError, ValidationError
from spiderflow.core.kernels import warm
from spiderflow.core.kernels.scorer import estimate_rows, trim_rows
from spiderflow.core.kernels.search import extend_beam, neighbour_table
from spiderflow.core.placement.base import (
    Budget,
    Objective,
    PlacementResult,
    PlacementStatus,
    Planner,
    Release,
    register_policy,
)
from spiderflow.core.placement.common import (
    LOCAL_PLANNER,
    FArr,
    IArr,
    JobConsts,
    TopoArrays,
    allocate_greedy,
    cached_plan,
    check_plan,
    diagnose,
    fallback_plan_chain,
    finalise,
    job_consts,
    score_chains,
    score_tables,
    topo_arrays,
    transfer_matrix,
    unschedulable,
)
from spiderflow.core.placement.lookahead import cluster_class, lookahead_choice

__all__ = [
    "DEFER_MARGIN", "MAX_LOOKAHEAD", "PRESSURE_CAP", "TRIM_TOLERANCE", "ChainCandidate", "SpinSearch", "fewer_gpus",
    "priced_choice", "priced_value", "queue_pressure", "search_chains", "wait_or_start",
]

log = structlog.get_logger(__name__)

TRIM_TOLERANCE = 1e-3
REPLAN = 2
"""How many allocations of the final step TPA re-plans, best level-1 plan first (each also on the GPUs its
level-1 plan uses, where that plan leaves some idle). Each costs a TPA plan (about 5–60 ms cold); on the
planning-time instances (BENCHMARKS.md) 2 keeps every decision at 64 clusters under 25 ms, where 3 reached
50 ms and every finalist 77 ms for plans at most 9 % faster."""
NEAR_TIE = 0.02
CHALLENGERS = 2
"""Step 5d: up to ``CHALLENGERS`` candidates below the finalists whose estimate is within ``NEAR_TIE``
(relative) of the best candidate's are challengers of the finalists' plan
(:func:`~spiderflow.core.placement.common.finalise`): each costs a TPA plan, kept when faster on the exact
timeline by more than ``NEAR_TIE`` too. The scorer prices a chain as one stage per cluster with the closed
form, so chains it ranks within a few percent can be 10 % apart on the exact timeline: on the emulated
testbed's ring (four clusters, 0.4 of a core each) it ranked a 3-cluster chain 1.3 % behind the best
2-cluster chain, the level-1 planner gave that chain 1F1B at m = 4 (0.567 s on the timeline), and TPA GPipe
at m = 16, 8 % ahead of the best finalist (0.411 against 0.447 s). The margin keeps the finalists' plan
where a challenger is barely faster: on the simulated traces, a challenger kept for 0.6 % took a cluster
the next small jobs needed, and the trace's mean JCT rose by up to 21 %."""
DEFER_MARGIN = 0.25
"""Waiting must promise a finish at least this much (relative) earlier than starting now: the released
GPUs may go to another job first and the release times are estimates."""
MAX_LOOKAHEAD = 6
"""At most this many future release points are searched per decision."""
PRESSURE_CAP = 2.0
"""The pool pressure of the priced choice (:func:`queue_pressure`) is capped here: beyond a demand of twice
the free GPUs, more demand does not make the GPUs dearer."""

Chain = tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainCandidate:
    """A scored chain: cluster indices, GPUs per position, estimated objective and step."""

    chain: Chain
    gpus: tuple[int, ...]
    score: float
    step: float
    untrimmed: tuple[int, ...] = ()  # the GPUs before tuning (the greedy allocation), when different


@dataclass(frozen=True, slots=True)
class Hops:
    """The transfer matrix ``P`` of one activation size and, per cluster, the other clusters by ascending
    ``P`` (memoised per snapshot in ``topology.memo.hops``)."""

    p: FArr
    order: IArr  # per cluster: other clusters by ascending P


def _hops(topo: Topology, ta: TopoArrays, jc: JobConsts) -> Hops:
    hit = topo.memo.hops.get(jc.wire_act(0))
    if hit is not None:
        return hit
    p = transfer_matrix(ta, jc)
    pm = p.copy()
    np.fill_diagonal(pm, np.inf)
    order = np.argsort(pm, axis=1, kind="stable").astype(np.int64)
    hops = Hops(p=p, order=order)
    topo.memo.hops.put(jc.wire_act(0), hops)
    return hops


class _Scorer:
    """Scores lists of chains with the greedy GPU allocation (or given GPUs)."""

    def __init__(self, ta: TopoArrays, jc: JobConsts, p: FArr, objective: Objective) -> None:
        self.ta, self.jc, self.p, self.objective = ta, jc, p, objective
        self.tables = score_tables(ta, jc)
        self.rate = ta.rate(jc.precision)  # FLOP/s per GPU in the job's precision
        self.scored = 0
        self.max_capacity = 0.0  # best Σcap/L seen on reachable chains
        self.max_gpus = 0
        self._objective_code = _OBJECTIVE_CODES[objective]
        # Results of earlier calls keyed on the exact (chains, GPU arrays) they scored: a repeated call
        # (refinement and trimming re-score chains the search already scored) returns the same arrays.
        self._memo: dict[tuple[tuple[Chain, ...], bytes], tuple[FArr, FArr, FArr, IArr]] = {}

    @staticmethod
    def _pack(rows: list[tuple[int, ...]], pad: int) -> IArr:
        """``rows`` as an ``N × max len`` array, left-aligned, padded with ``pad``."""
        n = len(rows)
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64)
        width = max(map(len, rows))
        if flat.size == n * width:  # rows of one length (a beam level, single chains)
            return flat.reshape(n, width)
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=n)
        out = np.full((n, width), pad, dtype=np.int64)
        out[np.arange(width)[None, :] < lens[:, None]] = flat
        return out

    def score(
        self, chains: list[Chain], gpus: list[tuple[int, ...]] | None = None
    ) -> tuple[FArr, FArr, FArr, IArr]:
        """``(score, beam_key, step, gpus array)``; ``score`` is ``inf`` for infeasible chains. The arrays are
        read-only (a repeated call returns the same ones)."""
        arr = self._pack(chains, -1)
        g = allocate_greedy(self.ta, arr, self.jc.gpus_max, self.rate) if gpus is None else self._pack(gpus, 0)
        if g.shape != arr.shape:  # GPU vectors shorter than their chains: pad to the chains' width
            g = np.pad(g, ((0, 0), (0, arr.shape[1] - g.shape[1])))
        key = (tuple(chains), g.tobytes())
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        out = self._evaluate(arr, g)
        for a in out:
            a.setflags(write=False)
        self._memo[key] = out
        return out

    def score_array(self, chains: IArr) -> tuple[FArr, FArr, FArr, IArr]:
        """:meth:`score` of the rows of ``chains`` (``N × K``, ``-1`` padded) with the greedy allocation, not
        memoised (a beam level's extensions are new chains)."""
        return self._evaluate(chains, allocate_greedy(self.ta, chains, self.jc.gpus_max, self.rate))

    def _evaluate(self, arr: IArr, g: IArr) -> tuple[FArr, FArr, FArr, IArr]:
        sc = score_chains(self.ta, self.jc, self.p, arr, g, self.tables)
        n = arr.shape[0]
        self.scored += n
        finite = np.isfinite(sc.step)
        if finite.any():
            self.max_capacity = max(self.max_capacity, float(sc.capacity_ratio[finite].max()))
            self.max_gpus = max(self.max_gpus, int(sc.gpus[finite].max()))
        raw = np.empty(n)
        est = np.empty(n)
        estimate_rows(sc.step, sc.usd, sc.feasible, sc.capacity_ratio, sc.gpus, self._objective_code,
                      int(self.jc.gpus_min), raw, est)
        return raw, est, sc.step, g


_OBJECTIVE_CODES = {Objective.JCT: 0, Objective.COST: 1, Objective.BALANCED: 2}
"""How :func:`spiderflow.core.kernels.scorer.estimate_rows` names the objectives."""
_RESERVED_BYTES = RESERVED_GIB * GIB


def _connect_threshold(ta: TopoArrays, jc: JobConsts, hops: Hops, usable: IArr, nn: int) -> float:
    """Smallest hop time at which a connected group has ``G_min`` free GPUs and the model's state memory
    (Kruskal over each usable cluster's ``nn`` nearest hops: the edges ``(P_uv, u, v)`` for the first ``nn``
    usable ``v`` of ``hops.order[u]`` with a finite ``P_uv``, in ascending order)."""
    states = jc.state_bytes * (jc.layers * jc.p_layer + 2 * jc.p_embed)
    members: list[int] = usable.tolist()
    parent = {u: u for u in members}
    gp = dict(zip(members, np.minimum(ta.free[usable], jc.gpus_max).tolist(), strict=True))
    mem = dict(zip(members, (ta.free[usable] * ta.mem[usable]).tolist(), strict=True))
    if any(gp[u] >= jc.gpus_min and mem[u] >= states for u in members):
        return 0.0
    mask = np.zeros(len(ta.free), dtype=np.bool_)
    mask[usable] = True
    order = hops.order[usable]
    take = mask[order]
    take &= np.cumsum(take, axis=1) <= nn  # each row's first nn usable hops
    us = np.repeat(usable, take.sum(axis=1))
    vs = order[take]
    hop = hops.p[us, vs]
    finite = np.isfinite(hop)
    us, vs, hop = us[finite], vs[finite], hop[finite]
    ranked = np.lexsort((vs, us, hop))
    times: list[float] = hop[ranked].tolist()
    edges = zip(times, us[ranked].tolist(), vs[ranked].tolist(), strict=True)

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for pv, u, v in edges:
        ru, rv = find(u), find(v)
        if ru == rv:
            continue
        parent[ru] = rv
        gp[rv] += gp[ru]
        mem[rv] += mem[ru]
        if gp[rv] >= jc.gpus_min and mem[rv] >= states:
            return pv
    return math.inf


def search_chains(
    topo: Topology,
    job: JobSpec,
    *,
    objective: Objective = Objective.JCT,
    beam_width: int = 8,
    neighbours: int = 10,
    seeds: int = 12,
    stall_factor: float = 4.0,
    refine_top: int | None = None,
    trim_top: int | None = None,
    keep: int = 4,
    deadline: float | None = None,
) -> tuple[list[ChainCandidate], dict[str, float]]:
    """The search of the module docstring (steps 1–4). Returns up to ``keep`` distinct feasible
    candidates, best first (cluster indices into ``topo.clusters``), and search statistics.

    A search that ends before ``deadline`` (or has none) is memoised in the snapshot's
    ``topology.memo.searches`` (bounded; shared by the ``Topology.with_free`` copies of the snapshot,
    whose path matrices are the same), and a later call with the same key returns it, with or without a
    deadline: the result is a function of the job's shape (model, batch, sequence length, GPU range,
    precision), the clusters with their free GPUs, the snapshot's path matrices and the search parameters,
    and the deadline only ever cuts a search short. A search cut short (``stats["deadline_hit"]``) is not
    memoised."""
    key = (tuple(topo.clusters), job.model, job.global_batch, job.micro_batch, job.seq_len, job.gpus,
           job.precision, objective, beam_width, neighbours, seeds, stall_factor, refine_top, trim_top, keep)
    hit = topo.memo.searches.get(key)
    if hit is not None:
        return list(hit[0]), dict(hit[1])
    cands, stats = _search_chains(topo, job, objective=objective, beam_width=beam_width, neighbours=neighbours,
                                  seeds=seeds, stall_factor=stall_factor, refine_top=refine_top,
                                  trim_top=trim_top, keep=keep, deadline=deadline)
    if "deadline_hit" not in stats:
        topo.memo.searches.put(key, (list(cands), dict(stats)))
    return cands, stats


def _search_chains(
    topo: Topology,
    job: JobSpec,
    *,
    objective: Objective,
    beam_width: int,
    neighbours: int,
    seeds: int,
    stall_factor: float,
    refine_top: int | None,
    trim_top: int | None,
    keep: int,
    deadline: float | None,
) -> tuple[list[ChainCandidate], dict[str, float]]:
    # Dollar-aware objectives re-rank chains once GPUs are trimmed, so they refine and trim more of them.
    if refine_top is None:
        refine_top = 3 if objective is Objective.JCT else 6
    if trim_top is None:
        trim_top = 2 if objective is Objective.JCT else 6
    ta = topo_arrays(topo)
    jc = job_consts(job)
    hops = _hops(topo, ta, jc)
    scorer = _Scorer(ta, jc, hops.p, objective)
    usable = np.flatnonzero(ta.free > 0).astype(np.int64)
    stats: dict[str, float] = {"clusters": float(len(ta.names)), "usable": float(len(usable))}
    if len(usable) == 0:
        return [], stats

    pool = _Pool()
    add_pool = pool.add

    # 1. singles (the incumbent).
    singles: list[Chain] = [(int(u),) for u in usable]
    raw, _, step, g = scorer.score(singles)
    add_pool(singles, raw, step, g)
    incumbent_step = float(np.min(np.where(np.isfinite(raw), step, np.inf)))

    # Pruning thresholds.
    rate = scorer.rate
    r_sorted = np.sort(np.repeat(rate[usable], np.minimum(ta.free[usable], jc.gpus_max)))[::-1]
    r_top = float(r_sorted[: jc.gpus_max].sum())
    tau_lb = 3.0 * (jc.layers * jc.f + jc.head_f) / r_top
    theta_conn = _connect_threshold(ta, jc, hops, usable, max(neighbours, 8))
    theta_stall = max(stall_factor * tau_lb, 2.0 * theta_conn)
    theta_bound = incumbent_step / (jc.m + 1) if objective is Objective.JCT else math.inf
    stats.update(tau_lb=tau_lb, theta_conn=theta_conn, theta_stall=theta_stall)

    usable_mask = np.zeros(len(ta.names), dtype=bool)
    usable_mask[usable] = True
    rank = np.minimum(ta.free, jc.gpus_max) * rate
    seed_list = [int(u) for u in usable[np.argsort(-rank[usable], kind="stable")][:seeds]]
    max_depth = min(len(usable), jc.layers)

    def beam_search(theta: float) -> None:
        table = neighbour_table(hops.order, hops.p, usable_mask, theta, neighbours)
        beam: IArr = np.array(seed_list, dtype=np.int64)[:, None]
        best = pool.best()
        stale = 0
        depth = 1
        while len(beam) and depth < max_depth:
            if deadline is not None and time.perf_counter() > deadline:
                stats["deadline_hit"] = 1.0
                break
            cands = extend_beam(beam, table)
            if not len(cands):
                break
            raw, est, step, g = scorer.score_array(cands)
            add_pool(cands, raw, step, g)
            order = np.argsort(est, kind="stable")[:beam_width]
            beam = cands[order[np.isfinite(est[order])]]
            level_best = float(np.min(raw))
            all_feasible = bool(np.all(np.isfinite(raw[order])))
            if level_best < best * (1 - 1e-9):
                best, stale = level_best, 0
            else:
                stale += 1
            if stale >= 2 and (all_feasible or math.isfinite(best)):
                break
            depth += 1
        stats["depth"] = float(depth)

    theta = min(theta_stall, theta_bound)
    beam_search(theta)
    if not math.isfinite(pool.best()):
        stats["relaxed"] = 1.0
        beam_search(theta_bound)

    # 4. refinement: hill climbing on the best chains, then GPU trimming.
    starts: list[Chain] = []
    for c, _, _, _ in pool.ranked():  # before refinement
        if c not in starts:
            starts.append(c)
        if len(starts) >= refine_top:
            break
    refined: dict[Chain, tuple[float, float, tuple[int, ...]]] = {}
    near = {u: [int(v) for v in hops.order[u][: 3 * neighbours] if usable_mask[int(v)]][:neighbours]
            for c in starts for u in c}
    # The starts climb in lockstep: each round scores the moves of every start still climbing in one call
    # (a row's scores depend on that row alone, so each climb takes the steps it would take alone); what
    # they add to the pool is added afterwards in start order, as if they had climbed one after another.
    climbs = [_Climb(chain=c0, score=float(scorer.score([c0])[0][0])) for c0 in starts]
    active = list(climbs)
    climbed: dict[Chain, _Scored] = {}
    for _ in range(6):
        if not active or (deadline is not None and time.perf_counter() > deadline):
            break
        # A chain's moves are scored once, however many climbs reach it (one after another, the later climbs
        # would find them memoised).
        fresh: dict[Chain, list[Chain]] = {}
        for climb in active:
            if climb.chain not in climbed and climb.chain not in fresh:
                fresh[climb.chain] = _moves(climb.chain, near, hops, usable_mask, neighbours)
        rows = [mc for mv in fresh.values() for mc in mv]
        raw_m, _, step_m, g_m = scorer.score(rows) if rows else (_NONE_F, _NONE_F, _NONE_F, _NONE_I)
        at = 0
        for c, mv in fresh.items():
            climbed[c] = (mv, raw_m[at: at + len(mv)], step_m[at: at + len(mv)], g_m[at: at + len(mv)])
            at += len(mv)
        moving: list[_Climb] = []
        for climb in active:
            scored = climbed[climb.chain]
            mv, raw_p = scored[0], scored[1]
            if not mv:
                continue
            climb.added.append(scored)
            j = int(np.argmin(raw_p))
            if raw_p[j] < climb.score * (1 - 1e-9):
                climb.chain, climb.score = mv[j], float(raw_p[j])
                for u in mv[j]:
                    if u not in near:
                        near[u] = [int(v) for v in hops.order[u][: 3 * neighbours] if usable_mask[int(v)]]
                        near[u] = near[u][:neighbours]
                moving.append(climb)
        active = moving
    for climb in climbs:
        for mv, raw_p, step_p, g_p in climb.added:
            add_pool(mv, raw_p, step_p, g_p)
        if math.isfinite(climb.score):
            cur = climb.chain
            raw_t, _, step_t, g_t = scorer.score([cur])
            refined[cur] = (float(raw_t[0]), float(step_t[0]), tuple(int(x) for x in g_t[0, : len(cur)]))
    # Candidates: refined chains and the best other pool chains (best GPU vector per chain).
    cand_map: dict[Chain, tuple[float, float, tuple[int, ...]]] = dict(refined)
    for c, gg, sc_, st_ in pool.ranked():
        if len(cand_map) >= keep + trim_top + len(refined):
            break
        if c not in cand_map:
            cand_map[c] = (sc_, st_, gg)
    # GPU tuning of the best candidates (constraint 2).
    before: dict[Chain, tuple[int, ...]] = {}
    tune = sorted(cand_map, key=lambda c: cand_map[c][0])[:trim_top]
    for c, gg in zip(tune, _trim(scorer, tune, objective), strict=True):
        raw_t, _, step_t, _ = scorer.score([c], [gg])
        if float(raw_t[0]) <= cand_map[c][0] * (1 + TRIM_TOLERANCE) and gg != cand_map[c][2]:
            before[c] = cand_map[c][2]
            cand_map[c] = (float(raw_t[0]), float(step_t[0]), gg)
    uniq = [
        ChainCandidate(chain=c, gpus=v[2], score=v[0], step=v[1], untrimmed=before.get(c, ()))
        for c, v in sorted(cand_map.items(), key=lambda kv: kv[1][0])
        if math.isfinite(v[0])
    ]
    stats["scored"] = float(scorer.scored)
    stats["max_capacity_ratio"] = scorer.max_capacity
    stats["max_gpus"] = float(scorer.max_gpus)
    return uniq[:keep], stats


class _Pool:
    """Every feasible ``(chain, GPUs)`` the search scored, with its score and step.

    Batches are kept as scored; :meth:`ranked` orders them by score only when asked (ties: first scored
    first), and a ``(chain, GPUs)`` scored again counts once, where it was first scored (its scores are the
    same: a row's scores depend on that row alone)."""

    def __init__(self) -> None:
        # chains (tuples, or an array of chains of one length), finite rows, their score, step, all GPUs
        self._batches: list[tuple[list[Chain] | IArr, IArr, FArr, FArr, IArr]] = []

    def add(self, chains: list[Chain] | IArr, raw: FArr, step: FArr, g: IArr) -> None:
        """Add the rows of one :meth:`_Scorer.score` (or :meth:`_Scorer.score_array`) call whose score is
        finite."""
        rows = np.flatnonzero(np.isfinite(raw))
        if rows.size:
            self._batches.append((chains, rows, raw[rows], step[rows], g))

    def best(self) -> float:
        """The least score (``inf`` when empty)."""
        return min((float(b[2].min()) for b in self._batches), default=math.inf)

    def ranked(self) -> Iterator[tuple[Chain, tuple[int, ...], float, float]]:
        """``(chain, GPUs, score, step)`` by ascending score, each ``(chain, GPUs)`` once; lazy."""
        if not self._batches:
            return
        scores = np.concatenate([b[2] for b in self._batches])
        sizes = [len(b[1]) for b in self._batches]
        batch_of = np.repeat(np.arange(len(sizes)), sizes).tolist()
        starts = np.cumsum([0, *sizes]).tolist()
        seen: set[tuple[Chain, tuple[int, ...]]] = set()
        for i in np.argsort(scores, kind="stable").tolist():
            b = batch_of[i]
            chains, rows, raw, step, g = self._batches[b]
            k = i - starts[b]
            row = int(rows[k])
            c = tuple(chains[row].tolist()) if isinstance(chains, np.ndarray) else chains[row]
            key = (c, tuple(g[row, : len(c)].tolist()))
            if key in seen:
                continue
            seen.add(key)
            yield c, key[1], float(raw[k]), float(step[k])


_Scored = tuple[list[Chain], FArr, FArr, IArr]
"""Chains and their ``(score, step, GPUs)`` rows from one :meth:`_Scorer.score` call."""


@dataclass(slots=True)
class _Climb:
    """One hill climb of the refinement: where it is, its score, and the moves it scored (in order)."""

    chain: Chain
    score: float
    added: list[_Scored] = field(default_factory=list)


_NONE_F: FArr = np.zeros(0, dtype=np.float64)
_NONE_I: IArr = np.zeros((0, 1), dtype=np.int64)


def _moves(c: Chain, near: dict[int, list[int]], hops: Hops, usable: np.ndarray, nn: int) -> list[Chain]:
    k = len(c)
    out: set[Chain] = set()
    if k > 1:
        out.add(c[::-1])
        for i in range(k - 1):
            out.add((*c[:i], c[i + 1], c[i], *c[i + 2 :]))
        for i in range(k):
            out.add(c[:i] + c[i + 1 :])
    members = set(c)
    pool: list[int] = []
    for u in c:
        for v in near.get(u, []):
            if v not in members and v not in pool:
                pool.append(v)
    for v in pool[: 2 * nn]:
        for i in range(k + 1):
            out.add((*c[:i], v, *c[i:]))
        for i in range(k):
            out.add((*c[:i], v, *c[i + 1 :]))
    out.discard(c)
    return sorted(out)


def _trim(scorer: _Scorer, chains: list[Chain], objective: Objective) -> list[tuple[int, ...]]:
    """Tune the GPUs of each chain, starting from the greedy allocation: moves that lower the estimated
    objective (shifting 1, 2, 4 or a node's worth of GPUs between positions, or removing some) are taken
    first; then, for ``jct``, removals that stay within ``TRIM_TOLERANCE`` of the untrimmed score (no drift),
    largest removal first (:func:`spiderflow.core.kernels.scorer.trim_rows` states the moves and the rule). Each
    chain is tuned on its own (a row's scores depend on that row only)."""
    if not chains:
        return []
    ta, jc, t = scorer.ta, scorer.jc, scorer.tables
    arr = scorer._pack(chains, -1)
    out = np.empty_like(arr)
    cap, gpus, n = trim_rows(
        arr, allocate_greedy(ta, arr, jc.gpus_max, scorer.rate), ta.free, ta.tp_cap, ta.gpn, t.fig, t.ints,
        t.per_layer_t, t.head_t, t.by_tp, scorer.p, int(jc.m), int(jc.layers), float(jc.p_layer), float(jc.p_embed),
        int(jc.gpus_min), int(jc.gpus_max), _RESERVED_BYTES, _OBJECTIVE_CODES[objective], TRIM_TOLERANCE, out)
    scorer.scored += n
    scorer.max_capacity = max(scorer.max_capacity, cap)
    scorer.max_gpus = max(scorer.max_gpus, gpus)
    return [tuple(out[i, : len(c)].tolist()) for i, c in enumerate(chains)]


def _job_total(objective: Objective, after: float, steps: int, step: float, usd: float) -> float:
    """The whole job's objective when it starts after ``after`` seconds: finish time ``a + S·step``
    (``jct``), dollars ``S·usd`` (``cost``) or finish time × √dollars (``balanced``)."""
    finish, dollars = after + steps * step, steps * usd
    if objective is Objective.COST:
        return dollars
    if objective is Objective.BALANCED:
        return finish * math.sqrt(max(dollars, 0.0))
    return finish


def wait_or_start(
    topo: Topology, job: JobSpec, now: Plan, releases: tuple[Release, ...], *,
    objective: Objective = Objective.JCT, beam_width: int = 8, neighbours: int = 10, seeds: int = 12,
    finalists: int = 2,
) -> tuple[float, float, float, Plan] | None:
    r"""Start now or wait for GPUs the scheduler expects back (the last step of :class:`SpinSearch`).

    The job's ``S`` remaining steps are scored as a whole: ``V(a, step, usd)`` = finish time
    ``a + S·step`` (``jct``), dollars ``S·usd`` (``cost``) or ``(a + S·step)·√(S·usd)`` (``balanced``)
    when it starts ``a`` seconds from now. Starting now scores ``V_0 = V(0, step_0, usd_0)`` with the plan
    chosen now (``now``). Waiting for the releases up to ``a_i`` (cumulative, soonest first) scores
    ``V_i = V(a_i, step_i, usd_i)`` with the exact plan (level-1 planner on the cost model,
    :func:`~spiderflow.core.placement.common.finalise` with ``planner=None``, the planner ``now`` came
    from) of the best of :func:`search_chains`' finalists on the GPUs free now plus those released by
    ``a_i`` (for ``jct`` a lighter search than a decision's: one chain refined, no GPU trimming — it only
    prices the future; the job is decided afresh when its time comes; dollars need the trimming).
    Wait iff ``min_i V_i < (1 − DEFER_MARGIN)·V_0``.

    Which points are searched: (a) ``jct``: ``step_i ≥ 3·m·(L·f + f_head) / Σ_top R`` (all work spread
    over the job's ``G_max`` fastest GPUs then free, no communication), so ``B_i = a_i + S·(that bound)``
    is a lower bound on ``V_i``; points are searched best-first by ``B_i`` (ties: sooner first) and the
    scan ends at the first whose bound cannot beat the threshold or the best point so far. Other
    objectives search the points soonest first. (b) A point is planned exactly only when the search's
    estimate beats the threshold; (c) at most :data:`MAX_LOOKAHEAD` points are searched.

    A release with a negative count is a reservation: GPUs another waiting job has claimed from then on;
    a point that only takes GPUs away is not a point (the one before it offers more, sooner).

    Returns ``(a_i, V_i, V_0, the plan at a_i)`` of the best point when waiting wins, else ``None``.
    """
    if not releases or not math.isfinite(now.step_time_s):
        return None
    jct = objective is Objective.JCT
    jc = job_consts(job)
    v_now = _job_total(objective, 0.0, job.steps, now.step_time_s, now.usd_per_step)
    threshold = (1.0 - DEFER_MARGIN) * v_now
    names = [c.name for c in topo.clusters]
    col = {n: k for k, n in enumerate(names)}
    rate = topo_arrays(topo).rate(job.precision)
    work = 3.0 * jc.m * (jc.layers * jc.f + jc.head_f)
    free = np.array([c.free for c in topo.clusters], dtype=np.int64)
    fastest = np.argsort(-rate, kind="stable")
    # The points: each release time at which some cluster gains GPUs, with the GPUs free then.
    points: list[tuple[float, float, IArr]] = []  # (bound or time, time, free GPUs)
    i = 0
    while i < len(releases):
        after = releases[i].after_s
        grew = False
        while i < len(releases) and releases[i].after_s <= after:
            for c, g in releases[i].gpus:
                k = col.get(c)
                if k is not None:
                    grew = grew or (g > 0 and free[k] + g > 0)
                    free[k] += g
            i += 1
        avail = np.maximum(free, 0)
        if not grew or int(avail.sum()) < job.gpus.min:
            continue  # only reservations here (fewer GPUs, later than the point before), or too few GPUs
        if jct:
            if after >= threshold:
                break
            room = np.minimum(np.cumsum(avail[fastest]), jc.gpus_max)  # the G_max fastest GPUs free then
            top = float(np.dot(np.diff(room, prepend=0), rate[fastest]))
            key = after + job.steps * work / max(top, 1e-9)
            if key >= threshold:
                continue
        else:
            key = after
        points.append((key, after, avail.copy()))
    points.sort(key=lambda x: (x[0], x[1]))
    best: tuple[float, float, float, Plan] | None = None
    for key, after, avail in points[:MAX_LOOKAHEAD]:
        limit = min(threshold, best[1] if best is not None else math.inf)
        if jct and key >= limit:
            break  # sorted by the bound: no later point can beat it either
        future = topo.with_free({n: int(g) for n, g in zip(names, avail, strict=True)})
        cands, _ = search_chains(future, job, objective=objective, beam_width=beam_width,
                                 neighbours=neighbours, seeds=seeds, keep=finalists,
                                 trim_top=0 if jct else None, refine_top=1 if jct else None)
        if not cands:
            continue
        if jct and after + job.steps * cands[0].step >= limit:
            continue
        fnames = future.names
        allocs = [[(fnames[u], g) for u, g in zip(c.chain, c.gpus, strict=True)] for c in cands[:finalists]]
        fin = finalise(future, job, allocs, objective=objective, planner=None)
        if fin.plan is None:
            continue
        v_i = _job_total(objective, after, job.steps, fin.plan.step_time_s, fin.plan.usd_per_step)
        if v_i < limit:
            best = (after, v_i, v_now, fin.plan)
    return best


def queue_pressure(demand_gpus: int, free_gpus: int) -> float:
    """``ρ = min(demand_gpus / free_gpus, PRESSURE_CAP)``: how scarce the GPUs free now are, given the
    other jobs' demand on the pool (GPUs held plus queued minimums); 0 when there is none or nothing is
    free."""
    if demand_gpus <= 0 or free_gpus <= 0:
        return 0.0
    return min(demand_gpus / free_gpus, PRESSURE_CAP)


def priced_value(steps: int, step_s: float, gpus: int, free_gpus: int, price: float) -> float:
    """The priced finish time of a plan started now: ``S·step·(1 + price·g/F)``; ``price = λ·ρ``."""
    share = gpus / free_gpus if free_gpus > 0 else 0.0
    return steps * step_s * (1.0 + price * share)


Allocation = tuple[tuple[str, int], ...]


def fewer_gpus(alloc: Allocation, gpus_min: int) -> list[Allocation]:
    """Variants of ``alloc`` (``(cluster, GPUs)`` in chain order) holding fewer GPUs: totals ¾, ½ and ¼ of
    its own and ``gpus_min`` (those ≥ ``gpus_min`` and below the total, largest first, each once). Every
    cluster keeps at least one GPU; the GPUs are removed in proportion to each cluster's share, the rounding
    remainder given back to the clusters with most GPUs first (ties: chain order)."""
    total = sum(g for _, g in alloc)
    k = len(alloc)
    targets = sorted({t for t in (math.ceil(total * 3 / 4), math.ceil(total / 2), math.ceil(total / 4), gpus_min)
                      if max(gpus_min, k) <= t < total}, reverse=True)
    out: list[Allocation] = []
    for t in targets:
        g = [max(1, (n * t) // total) for _, n in alloc]
        order = sorted(range(k), key=lambda i: (-alloc[i][1], i))
        j = 0
        while sum(g) < t:
            i = order[j % k]
            if g[i] < alloc[i][1]:
                g[i] += 1
            j += 1
        while sum(g) > t:  # only when the one-GPU floor overshoots
            i = max(range(k), key=lambda i: (g[i], -i))
            g[i] -= 1
        v = tuple((c, n) for (c, _), n in zip(alloc, g, strict=True))
        if v not in out:
            out.append(v)
    return out


def priced_choice(
    topo: Topology, job: JobSpec, allocs: list[Allocation], *, price: float,
) -> tuple[Allocation, Plan] | None:
    """The allocation (with its level-1 plan) of least :func:`priced_value` among ``allocs`` and their
    :func:`fewer_gpus` variants, on the GPUs free in ``topo``; earlier allocations win ties. ``None`` when
    no allocation has a valid plan."""
    free = topo.total_free_gpus
    seen: set[Allocation] = set()
    best: tuple[float, Allocation, Plan] | None = None
    for a in allocs:
        for v in (a, *fewer_gpus(a, job.gpus.min)):
            if v in seen:
                continue
            seen.add(v)
            try:
                plan = cached_plan("fallback", topo, job, v, Objective.JCT,
                                   lambda t, j, al, o: fallback_plan_chain(t, j, al, objective=o))
            except UnschedulableError:
                continue
            if check_plan(plan, topo, job) or not math.isfinite(plan.step_time_s):
                continue
            val = priced_value(job.steps, plan.step_time_s, plan.gpus, free, price)
            if best is None or val < best[0]:
                best = (val, v, plan)
    return None if best is None else (best[1], best[2])


_UNITS = {Objective.JCT: "finish time, s", Objective.COST: "dollars", Objective.BALANCED: "s·√$"}


class SpinSearch:
    """The SpinSearch policy: :func:`search_chains`, then the best of the finalists planned exactly by
    :func:`~spiderflow.core.placement.common.plan_chain` (TPA when available)."""

    name = "spinsearch"

    def __init__(
        self, *, beam_width: int = 8, neighbours: int = 10, seeds: int = 12, finalists: int = 2,
        planner: Planner | None = LOCAL_PLANNER, gpu_price: float = 0.0, lookahead: bool = False,
        replan: int = REPLAN,
    ) -> None:
        """``planner`` plans the chosen chain (in process by default, or the Planner service) and its plan
        is kept when better than the level-1 plan; ``None``: the level-1 plans only. ``gpu_price`` (λ ≥ 0)
        turns on the priced choice (module docstring, step 5b) for ``jct``; 0: the fastest plan.
        ``lookahead`` turns on the region matching of step 5c (:mod:`~spiderflow.core.placement.lookahead`),
        which needs the scheduler's :attr:`Budget.outlook`. ``replan`` (≥ 1): how many of the final
        allocations TPA re-plans (step 5, :data:`REPLAN`)."""
        if not isinstance(lookahead, bool):
            raise ValidationError("lookahead", "must be true or false", lookahead)
        self.lookahead = lookahead
        if isinstance(replan, bool) or not isinstance(replan, int) or replan < 1:
            raise ValidationError("replan", "must be an integer ≥ 1", replan)
        self.replan = replan
        if isinstance(gpu_price, bool) or not isinstance(gpu_price, int | float) or not (
                math.isfinite(gpu_price) and gpu_price >= 0):
            raise ValidationError("gpu_price", "must be a finite number ≥ 0", gpu_price)
        self.gpu_price = float(gpu_price)
        self.planner = planner
        self.beam_width = beam_width
        self.neighbours = neighbours
        self.seeds = seeds
        self.finalists = finalists
        warm()  # the compiled kernels are loaded now, not in the first decision

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget or Budget()
        t0 = time.perf_counter()
        bad = diagnose(topo, job, self.name)
        if bad is not None:
            return _with_time(bad, time.perf_counter() - t0)
        deadline = None if budget.time_limit_s is None else t0 + budget.time_limit_s
        cands, stats = search_chains(
            topo, job, objective=budget.objective, beam_width=self.beam_width, neighbours=self.neighbours,
            seeds=self.seeds, keep=max(self.finalists, 1) + 6, deadline=deadline,
        )
        search_s = time.perf_counter() - t0
        names = topo.names
        allocs = [[(names[u], g) for u, g in zip(c.chain, c.gpus, strict=True)] for c in cands[: self.finalists]]
        # The untuned GPU vectors too: the exact planner may put GPUs the scorer would drop to use
        # (pipelining inside a cluster); they win only by more than TRIM_TOLERANCE.
        allocs += [[(names[u], g) for u, g in zip(c.chain, c.untrimmed, strict=True)]
                   for c in cands[: self.finalists] if c.untrimmed]
        if not any(len(c.chain) == 1 for c in cands[: self.finalists]):
            # The best single cluster too: the scorer prices a cluster as one stage, so a cluster that
            # pipelines inside itself can beat chains the scorer ranks above it.
            single = next((c for c in cands[self.finalists :] if len(c.chain) == 1), None)
            if single is not None:
                allocs.append([(names[single.chain[0]], (single.untrimmed or single.gpus)[0])])
        price = self.gpu_price * queue_pressure(budget.demand_gpus, topo.total_free_gpus)
        if price > 0 and budget.objective is Objective.JCT:
            # Step 5b: the GPUs are priced by the demand on the pool; the pick is then planned as usual.
            pick = priced_choice(topo, job, [tuple(a) for a in allocs], price=price)
            if pick is not None:
                allocs = [list(pick[0])]
                stats["gpu_price"] = price
        if self.lookahead and budget.outlook is not None and budget.objective is Objective.JCT:
            # Step 5c: region matching against the arrivals expected while the job runs.
            choice = lookahead_choice(topo, job, [tuple((c, g) for c, g in a) for a in allocs], budget.outlook,
                                      self._without_classes(topo, job, allocs[0] if allocs else []))
            if choice is not None and not choice.finalist:
                allocs = [list(choice.allocation)]
                stats["lookahead_gain"] = choice.best_value - choice.value
        # With releases to weigh, the level-1 plans decide between starting now and waiting (the same
        # planner prices the future, so the two compare); TPA then re-plans only a chain that starts now.
        weigh = bool(budget.releases)
        first = None if weigh else self.planner
        # Step 5d: candidates below the finalists that the estimate cannot tell from the best one.
        best_score = cands[0].score if cands else math.inf
        challengers = [[(names[u], g) for u, g in zip(c.chain, c.gpus, strict=True)]
                       for c in cands[self.finalists :]
                       if c.score <= best_score * (1 + NEAR_TIE)][:CHALLENGERS]
        challengers = [a for a in challengers if a not in allocs]
        if challengers:
            stats["challengers"] = float(len(challengers))
        # A challenger may hold more GPUs than the finalists' plan only when no other job holds or waits for
        # any: a few per cent faster for this job on GPUs the next job needs is a loss for the pool.
        grow = budget.demand_gpus <= 0
        fin = finalise(topo, job, allocs, objective=budget.objective, planner=first, tolerance=TRIM_TOLERANCE,
                       replan=self.replan, challengers=challengers, challengers_may_grow=grow,
                       challenger_margin=NEAR_TIE)
        if fin.challenger >= 0:
            stats["challenger_won"] = float(fin.challenger)
        tol = TRIM_TOLERANCE
        if fin.plan is None and len(cands) > self.finalists:
            # The scorer's memory model is optimistic for these; the next candidates may fit exactly.
            allocs = [[(names[u], g) for u, g in zip(c.chain, c.untrimmed or c.gpus, strict=True)]
                      for c in cands[self.finalists :]]
            tol = 0.0
            fin = finalise(topo, job, allocs, objective=budget.objective, planner=first)
        plan_s = fin.plan_seconds
        if fin.plan is not None and weigh:
            wait = wait_or_start(topo, job, fin.plan, budget.releases, objective=budget.objective,
                                 beam_width=self.beam_width, neighbours=self.neighbours, seeds=self.seeds,
                                 finalists=self.finalists)
            if wait is not None:
                after, v_wait, v_now, later = wait
                elapsed = time.perf_counter() - t0
                log.debug("spinsearch.deferred", job=job.id, wait_s=after, objective=str(budget.objective),
                          value_wait=v_wait, value_now=v_now, revision=topo.revision, seconds=elapsed)
                stats.update(search_seconds=search_s, plan_seconds=plan_s, defer_s=after,
                             defer_gpus=float(later.gpus))
                reason = _wait_reason(after, v_wait, v_now, budget.objective)
                return PlacementResult(
                    status=PlacementStatus.WAIT, policy=self.name, plan=later, planning_seconds=elapsed,
                    stats=stats, reason=reason, wait=Wait(after_s=after, plan=later, reason=reason),
                )
            if self.planner is not None:
                fin = finalise(topo, job, allocs, objective=budget.objective, planner=self.planner, tolerance=tol,
                               replan=self.replan, challengers=challengers, challengers_may_grow=grow,
                               challenger_margin=NEAR_TIE)
                if fin.challenger >= 0:
                    stats["challenger_won"] = float(fin.challenger)
                plan_s += fin.plan_seconds
        elapsed = time.perf_counter() - t0
        stats.update(search_seconds=search_s, plan_seconds=plan_s, finalists=float(len(allocs)))
        if fin.plan is None:
            err = fin.error or _search_failure(stats, job)
            return unschedulable(self.name, err, elapsed)
        log.debug("spinsearch.placed", job=job.id, chain=list(fin.plan.chain), step_s=fin.plan.step_time_s,
                  planner=fin.planner, revision=topo.revision, seconds=elapsed)
        return PlacementResult(
            status=PlacementStatus.SUCCESS, policy=self.name, plan=fin.plan, planning_seconds=elapsed,
            optimal=None, stats={**stats, "tpa": 1.0 if fin.planner == "tpa" else 0.0},
        )

    def _without_classes(self, topo: Topology, job: JobSpec, alloc: list[tuple[str, int]]) -> list[Allocation]:
        """Step 5c's alternatives: for each cluster class (:func:`~spiderflow.core.placement.lookahead.
        cluster_class`) that ``alloc`` uses, the best chains of the search on the pool without that class."""
        out: list[Allocation] = []
        for cls in dict.fromkeys(cluster_class(topo.cluster(c)) for c, _ in alloc):
            masked = topo.with_free({c.name: 0 for c in topo.clusters if cluster_class(c) == cls})
            if masked.total_free_gpus < job.gpus.min:
                continue
            cands, _ = search_chains(masked, job, objective=Objective.JCT, beam_width=self.beam_width,
                                     neighbours=self.neighbours, seeds=self.seeds, keep=self.finalists)
            names = masked.names
            out += [tuple((names[u], int(g)) for u, g in zip(c.chain, c.gpus, strict=True))
                    for c in cands[: self.finalists]]
        return out

    def price_wait(self, topo: Topology, job: JobSpec, now: Plan, budget: Budget) -> Wait | None:
        """Start on ``now`` or wait for ``budget.releases`` (:func:`wait_or_start` with this policy's search
        settings): the wait when it scores better, else ``None``."""
        w = wait_or_start(topo, job, now, budget.releases, objective=budget.objective, beam_width=self.beam_width,
                          neighbours=self.neighbours, seeds=self.seeds, finalists=self.finalists)
        if w is None:
            return None
        after, v_wait, v_now, later = w
        return Wait(after_s=after, plan=later, reason=_wait_reason(after, v_wait, v_now, budget.objective))


def _wait_reason(after: float, v_wait: float, v_now: float, objective: Objective) -> str:
    return (f"waiting {after:.0f} s for GPUs being released scores {v_wait:.4g} instead of {v_now:.4g} when "
            f"starting now ({objective} of the whole job: {_UNITS[objective]})")


def _search_failure(stats: dict[str, float], job: JobSpec) -> UnschedulableError:
    """Name the binding constraint when no chain was feasible."""
    if stats.get("max_capacity_ratio", 0.0) < 1.0:
        return UnschedulableError(
            f"no reachable chain of clusters has the memory for {job.model.layers} layers with its activations "
            f"(best chain holds {stats.get('max_capacity_ratio', 0.0):.0%} of them)", constraint="memory")
    if stats.get("max_gpus", 0.0) < job.gpus.min:
        return UnschedulableError(
            f"no reachable chain of clusters holds {job.gpus.min} free GPUs (best: {stats.get('max_gpus', 0):.0f})",
            constraint="reachability")
    return UnschedulableError("no chain of clusters satisfies the job's GPU range and memory together",
                              constraint="memory")


def _with_time(res: PlacementResult, seconds: float) -> PlacementResult:
    from dataclasses import replace

    return replace(res, planning_seconds=seconds)


register_policy("spinsearch", SpinSearch, with_planner=True)
