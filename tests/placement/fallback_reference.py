"""The level-1 fallback planner in plain Python: the per-block search, the chain aggregate, the boundary
local search and the memory-first dynamic programme as :mod:`spiderflow.core.placement.common` documents them,
kept as the reference its compiled form (:mod:`spiderflow.core.kernels.fallback`) is compared against, bit for
bit. The helpers both share (the proportional split, validation, plan assembly and evaluation, the scorer)
and the block and shape records are the production module's."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from spiderflow.core.costmodel import (
    GIB,
    RESERVED_GIB,
    allreduce_time,
    compute_rate_tflops,
    evaluate,
    fits_memory,
    transfer_time,
)
from spiderflow.core.domain import Cluster, JobSpec, Plan, Schedule, Stage, Topology
from spiderflow.core.errors import UnschedulableError, ValidationError
from spiderflow.core.placement.base import Objective
from spiderflow.core.placement.common import (
    _MAX_TP,
    _PP_CHOICES,
    _Block,
    _blocks_to_plan,
    _finish,
    _proportional_split,
    _Shape,
    _validate_allocation,
    job_consts,
    score_chains,
    topo_arrays,
    transfer_matrix,
)

__all__ = ["_ChainEval", "fallback_plan_chain", "memory_first_split", "plan_with_split"]


_BLOCK_CACHE: dict[tuple[Any, ...], _Block] = {}
_BLOCK_CACHE_MAX = 200_000
_PREFIX_IDS: dict[tuple[Any, ...], int] = {}
_DEGREE_CONSTS: dict[int, list[tuple[int, float, float, float, float]]] = {}
_PREFIX_COUNTER = itertools.count()


def _prefix_id(prefix: tuple[Any, ...]) -> int:
    """A process-unique int for a block-key prefix. Ids are never reused (a counter), so clearing the map
    can never make two prefixes share an id."""
    pid = _PREFIX_IDS.get(prefix)
    if pid is None:
        if len(_PREFIX_IDS) >= _BLOCK_CACHE_MAX:
            _PREFIX_IDS.clear()
        pid = _PREFIX_IDS[prefix] = next(_PREFIX_COUNTER)
    return pid


class _ChainEval:
    """Evaluates layer splits of one ordered allocation with the exact cost-model formulas."""

    def __init__(self, topo: Topology, job: JobSpec, alloc: Sequence[tuple[str, int]], *, exact_gpus: bool,
                 cache: dict[tuple[Any, ...], _Block] | None = None, slack: int = 0, every_shape: bool = False):
        self.jc = job_consts(job)
        self.clusters = [topo.cluster(c) for c, _ in alloc]
        self.gpus = [g for _, g in alloc]
        self.exact = exact_gpus
        self.every = every_shape and not exact_gpus  # every shape competes alike (finalise's extra allocation)
        self.slack = slack if exact_gpus else 0  # GPUs each cluster may leave unused in exact mode
        self.hops = []
        for (a, _), (b, _) in itertools.pairwise(alloc):
            sent = self.jc.wire_act(topo.cluster(a).gpu_type.wire_bytes)
            self.hops.append(transfer_time(sent, topo.bandwidth_gbps(a, b), topo.latency_ms(a, b)))
        # A block depends only on the job's constants, the cluster's shape and these figures: shared
        # process-wide (bounded), across chains, jobs and topology snapshots; ``cache`` is accepted for
        # interface parity.
        del cache
        self._cache = _BLOCK_CACHE
        self._shapes = [
            (compute_rate_tflops(c, self.jc.precision), c.gpu_memory_gib, c.gpus_per_node, c.intra_node_gbps,
             c.inter_node_gbps, c.gpu_type.wire_bytes, c.head_us_per_token, c.embedding_us_per_token,
             c.embedding_optimizer_ms, c.data_ms_per_sample, c.head_optimizer_ms, c.layer_overhead_ms,
             c.optimizer_ms_per_layer)
            for c in self.clusters
        ]
        # Everything a block key shares per position, interned to one int (hashing the job's constants on
        # every lookup dominated the local search).
        self._pid = [_prefix_id((self.jc, shape, g, self.exact, self.slack, self.every))
                     for shape, g in zip(self._shapes, self.gpus, strict=True)]
        self.memory_first: tuple[int, tuple[list[int], list[_Shape]] | None] | None = None  # memory_first_split

    def block(self, i: int, first: int, last: int, offset: int, total_stages_other: int) -> _Block:
        # The block depends on its position only through whether it holds the embedding (first == 0) or the
        # head (last == L − 1), its layer count and the stages downstream of its start (the in-flight depth).
        key = (self._pid[i], first == 0, last == self.jc.layers - 1, last - first, total_stages_other - offset)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        jc, c, g = self.jc, self.clusters[i], self.gpus[i]
        fl = compute_rate_tflops(c, jc.precision) * 1e12
        mem = c.gpu_memory_gib * GIB - RESERVED_GIB * GIB
        nl = last - first + 1
        best: _Block | None = None
        # Pass 1: configurations using all g GPUs (and pp = 1); pass 2, only if nothing fits memory: the others
        # (with exact GPUs pass 1 already took every configuration there is).
        for exhaustive in (False, True):
            if exhaustive and (self.exact or self.every or (best is not None and best.excess <= 0)):
                break
            best = self._configs(self._pid[i], best, exhaustive, g, c, fl, mem, nl, first, last, offset,
                                 total_stages_other)
        if best is None:  # exact_gpus with no divisor shape: fall back to tp=1, pp=1
            best = _Block(math.inf, math.inf, 1, 1, g, (nl,), math.inf, math.inf, 0.0,
                          transfer_time(jc.wire_act(c.gpu_type.wire_bytes), c.inter_node_gbps, 0.0))
        if len(self._cache) >= _BLOCK_CACHE_MAX:
            self._cache.clear()
        self._cache[key] = best
        return best

    def _degree_consts(self, pid: int, c: Cluster, g: int, fl: float) -> list[tuple[int, float, float, float, float]]:
        """Per tensor-parallel degree of a position: ``(tp, T per layer, activation bytes per layer, head
        activation bytes, head T)``, the same expressions for every block of that position (memoised on the
        position's key prefix ``pid``: the job's constants, the cluster's figures and its GPUs). ``T`` per layer
        includes the cluster's calibrated fixed time per layer (``layer_overhead_ms``)."""
        hit = _DEGREE_CONSTS.get(pid)
        if hit is not None:
            return hit
        jc = self.jc
        out: list[tuple[int, float, float, float, float]] = []
        tp = 1
        while tp <= min(_MAX_TP, c.gpus_per_node, g):
            ar_tp = allreduce_time(jc.act, tp, c.intra_node_gbps if tp <= c.gpus_per_node else c.inter_node_gbps)
            # A measured head (costmodel.measured_outer_time) runs replicated: the same time at every degree.
            head_time = (c.head_us_per_token * jc.b * jc.s / 1e6 if c.head_us_per_token
                         else 3.0 * jc.head_f / (tp * fl))
            out.append((tp, 3.0 * jc.f / (tp * fl) + 4.0 * ar_tp + c.layer_overhead_ms / 1e3, jc.act_layer(tp),
                        jc.act_head(tp), head_time))
            tp *= 2
        if len(_DEGREE_CONSTS) >= _BLOCK_CACHE_MAX:
            _DEGREE_CONSTS.clear()
        _DEGREE_CONSTS[pid] = out
        return out

    def _configs(self, pid: int, best: _Block | None, exhaustive: bool, g: int, c: Cluster, fl: float, mem: float,
                 nl: int, first: int, last: int, offset: int, total_stages_other: int) -> _Block | None:
        jc = self.jc
        m = jc.m
        p_int = transfer_time(jc.wire_act(c.gpu_type.wire_bytes), c.inter_node_gbps, 0.0)
        p_layer, p_embed = jc.p_layer, jc.p_embed
        gpn, intra, inter = c.gpus_per_node, c.intra_node_gbps, c.inter_node_gbps
        exact, slack = self.exact, self.slack
        head = last == jc.layers - 1
        has_embed = first == 0
        # The work outside the blocks a profile measured (costmodel.measured_outer_time, measured_step_extra):
        # the embedding's time per micro-batch on sub-stage 0 of the embedding block, its optimizer step and
        # the input pipeline (b samples per micro-batch of a replica) and the head's optimizer step per step
        # with the sub-stage's gradient sync.
        emb_us = c.embedding_us_per_token
        emb_t = (emb_us * jc.b * jc.s / 1e6 if emb_us else 0.0) if has_embed else 0.0
        emb_opt = c.embedding_optimizer_ms / 1e3
        data_mb = c.data_ms_per_sample * jc.b / 1e3
        head_opt = c.head_optimizer_ms / 1e3
        opt_l = c.optimizer_ms_per_layer / 1e3  # the calibrated optimizer step per layer, with the gradient sync
        for tp, per_t, act_l, act_h, head_time in self._degree_consts(pid, c, g, fl):
            head_t = head_time if head else 0.0
            for pp in _PP_CHOICES:
                if pp > nl or tp * pp > g:
                    break
                dp = g // (tp * pp)
                if exact:
                    if dp * tp * pp < g - slack:
                        continue
                elif not self.every and (dp * tp * pp == g or pp == 1) == exhaustive:
                    continue  # pass 1 takes these, pass 2 the rest (re-taking pass 1's could not change its best)
                base, rem = divmod(nl, pp)
                s_total = total_stages_other + pp
                bdp = intra if tp * dp <= gpn else inter
                per_replica = math.ceil(m / dp)
                p_stage = p_int if pp > 1 else 0.0
                bounds = 2 * (pp - 1) * p_int
                # Sub-stages: pp − rem of ``base`` layers and rem of ``base + 1``, small ones first (less memory:
                # early sub-stages hold more micro-batches) or, when the block ends with the head, big ones
                # first. Only the first of each size group, the first (embedding) and the last (head)
                # sub-stage can be the worst for memory and Y.
                tsum = nl * per_t + head_t + emb_t
                top = base + 1 if rem else base
                for big_first in (False, True) if rem and head_t > 0 else (False,):
                    # sizes[j]: ``base + 1`` for j < rem (big first) or j ≥ pp − rem (small first), else ``base``.
                    n_small = pp - rem
                    last_size = base if big_first else top
                    if pp == 1:  # one sub-stage: the embedding's and the head's
                        tmax = max(last_size * per_t + head_t + emb_t, top * per_t)
                    else:
                        first_size = top if big_first else base
                        tmax = max(last_size * per_t + head_t, top * per_t, first_size * per_t + emb_t)
                    local = (m - 1) * max(tmax / dp, p_stage) + tsum
                    if best is not None and best.excess <= 0.0 and local + bounds >= best.local:
                        # Its objective without the gradient all-reduce (≥ 0) already ties or loses to a
                        # configuration that fits: it cannot win, whatever its memory.
                        continue
                    ymax = 0.0
                    excess = -math.inf
                    mid = rem if big_first else n_small
                    for j in (0,) if pp == 1 else ((0, mid, pp - 1) if 0 < mid < pp - 1 else (0, pp - 1)):
                        sz = (base + 1 if j < rem else base) if big_first else (base if j < n_small else base + 1)
                        is_last = j == pp - 1 and head
                        params = sz * p_layer + (p_embed if j == 0 and has_embed else 0.0) + (
                            jc.head_params if is_last else 0.0)
                        y = allreduce_time(jc.grad_bytes * params / tp, dp, bdp) if dp > 1 else 0.0
                        if opt_l != 0.0:
                            y += sz * opt_l
                        if j == 0 and has_embed:
                            y += emb_opt + data_mb * per_replica
                        if is_last:
                            y += head_opt
                        if y > ymax:
                            ymax = y
                        inflight = min(per_replica, s_total - (offset + j))
                        act = sz * act_l + (act_h if is_last else 0.0)
                        x = jc.state_bytes * params / tp + inflight * act - mem
                        if x > excess:
                            excess = x
                    local += bounds + ymax
                    if best is None or (max(excess, 0.0), local) < (best.excess, best.local):
                        sizes = (
                            tuple([base + 1] * rem + [base] * n_small) if big_first
                            else tuple([base] * n_small + [base + 1] * rem)
                        )
                        best = _Block(max(excess, 0.0), local, pp, tp, dp, sizes, tmax, tsum, ymax, p_int)
        return best

    def evaluate_split(self, sizes: Sequence[int], pps: Sequence[int]) -> tuple[float, float, list[_Block]]:
        """``(memory excess, step time, blocks)`` of a layer split given assumed sub-stage counts."""
        blocks: list[_Block] = []
        total = sum(pps)
        offset = 0
        first = 0
        for i, sz in enumerate(sizes):
            blk = self.block(i, first, first + sz - 1, offset, total - pps[i])
            blocks.append(blk)
            offset += pps[i]
            first += sz
        excess, step = self.aggregate(blocks)
        return excess, step, blocks

    def aggregate(self, blocks: Sequence[_Block]) -> tuple[float, float]:
        """``(memory excess, step time)`` of a chain of chosen blocks (the cost model's step formula:
        ``(m − 1)·max(beat, boundaries) + Σ T + 2·Σ boundaries + max Y``, summed in chain order)."""
        bott = -math.inf
        tsum = 0.0
        excess = 0.0
        y = -math.inf
        bound_max = -math.inf
        bound_sum = 0.0
        for b in blocks:
            r = b.tmax / b.dp
            if r > bott:
                bott = r
            tsum += b.tsum
            excess += b.excess
            if b.y > y:
                y = b.y
            if b.pp > 1:
                p = b.p_int
                if p > bound_max:
                    bound_max = p
                for _ in range(b.pp - 1):
                    bound_sum += p
        for p in self.hops:
            if p > bound_max:
                bound_max = p
            bound_sum += p
        if bound_max == -math.inf:
            bound_max = 0.0
        step = (self.jc.m - 1) * (bott if bott >= bound_max else bound_max) + tsum
        step += 2.0 * bound_sum + y
        return excess, step


def _evaluate_exact(ev: _ChainEval, sizes: Sequence[int]) -> tuple[float, float, list[_Block]]:
    """``(memory excess, step time, blocks)`` of a split with each block chosen under the sub-stages of the
    blocks after it (from the last block to the first)."""
    k = len(sizes)
    blocks: list[_Block] = []
    first = sum(sizes)
    ds = 0
    for i in range(k - 1, -1, -1):
        first -= sizes[i]
        blk = ev.block(i, first, first + sizes[i] - 1, 0, ds)
        blocks.insert(0, blk)
        ds += blk.pp
    excess, step = ev.aggregate(blocks)
    return excess, step, blocks


def _optimise_split(ev: _ChainEval, sizes: list[int], *, local_search: bool) -> tuple[list[int], list[_Block]]:
    k = len(sizes)
    cur = _evaluate_exact(ev, sizes)
    improved = local_search
    while improved:
        improved = False
        best = cur
        best_sizes = sizes
        for j in range(k - 1):
            for delta in (-4, -1, 1, 4):
                new = list(sizes)
                new[j] += delta
                new[j + 1] -= delta
                if new[j] < 1 or new[j + 1] < 1:
                    continue
                res = _evaluate_exact(ev, new)
                if (res[0], res[1]) < (best[0], best[1] * (1 - 1e-12)):
                    best, best_sizes = res, new
        if best is not cur:
            cur, sizes, improved = best, best_sizes, True
    return sizes, cur[2]


def _split_key(ev: _ChainEval, sizes: Sequence[int], blocks: Sequence[_Block]) -> tuple[float, float]:
    excess, step, _ = ev.evaluate_split(sizes, [b.pp for b in blocks])
    return excess, step



def _balanced_capacity(ev: _ChainEval, i: int, tp: int, pp: int, downstream: int) -> tuple[int, bool]:
    """The most layers block ``i`` holds at degrees ``(tp, pp, ⌊g/(tp·pp)⌋)`` with balanced sub-stage sizes
    (as the level-1 planner forms them) and ``downstream`` stages after it, under the cost model's 1F1B
    memory (exact in-flight counts, embedding on the chain's first sub-stage, head on its last); ``(0, _)``
    when a sub-stage cannot hold one layer. Second: whether the bigger sub-stages go first (head block)."""
    jc, c, g = ev.jc, ev.clusters[i], ev.gpus[i]
    k = len(ev.clusters)
    room = c.gpu_memory_gib * GIB - RESERVED_GIB * GIB
    w = jc.state_bytes * jc.p_layer / tp
    act = float(jc.act_layer(tp))
    per_replica = math.ceil(jc.m / (g // (tp * pp)))
    held: list[int] = []
    for j in range(pp):
        inflight = min(per_replica, pp - j + downstream)
        extra = jc.state_bytes * jc.p_embed / tp if i == 0 and j == 0 else 0.0
        if i == k - 1 and j == pp - 1:
            extra += jc.state_bytes * jc.head_params / tp + inflight * float(jc.act_head(tp))
        # 1e-9 relative slack: never below the cost model's count (it sums the terms in another order).
        n = math.floor((room - extra) / (w + inflight * act) * (1.0 + 1e-9))
        if n < 1:
            return 0, False
        held.append(n)
    # Balanced sizes: base layers everywhere, one more on ``rem`` sub-stages at the end (or, for the head
    # block, at the start); each sub-stage within what it holds.
    low = min(held)
    tail = 0
    while tail < pp - 1 and held[pp - 1 - tail] > low:
        tail += 1
    head = 0
    if i == k - 1:
        while head < pp - 1 and held[head] > low:
            head += 1
    return pp * low + max(tail, head), head > tail


def memory_first_split(ev: _ChainEval) -> tuple[int, tuple[list[int], list[_Shape]] | None]:
    """A layer split and per-block degrees that fit memory, when the level-1 search found none: the
    shallowest pipeline whose blocks hold every layer.

    Dynamic programme from the last block to the first over the number of stages downstream ``d`` (the
    in-flight depth of every earlier block): per ``d`` the most layers the blocks from here on hold
    (:func:`_balanced_capacity`, over the planner's degrees), keeping only states that hold more with more
    stages (fewer stages downstream never hurt an earlier block). The first structure, by stage count, that
    holds ``L`` layers gets a split in proportion to ``g·F`` within each block's ``[pp, cap]``.

    Returns the most layers any structure holds and the split (``None`` when no structure holds ``L``).
    The structures are every plan the level-1 planner can form (degrees, balanced sub-stages), so
    ``None`` proves that it cannot fit the chain. ``O(C·S·36·16)`` for ``S`` the stage counts kept; memoised
    on ``ev`` (it reads only the job, the clusters and their GPUs)."""
    if ev.memory_first is None:
        ev.memory_first = _memory_first_split(ev)
    return ev.memory_first


def _memory_first_split(ev: _ChainEval) -> tuple[int, tuple[list[int], list[_Shape]] | None]:
    k = len(ev.clusters)
    L = ev.jc.layers
    frontier: list[tuple[int, int, tuple[_Shape, ...]]] = [(0, 0, ())]  # (stages, layers held, shapes)
    for i in range(k - 1, -1, -1):
        c, g = ev.clusters[i], ev.gpus[i]
        options: dict[int, tuple[int, tuple[_Shape, ...]]] = {}
        for d, total, shapes in frontier:
            tp = 1
            while tp <= min(_MAX_TP, c.gpus_per_node, g):
                for pp in _PP_CHOICES:
                    if tp * pp > g:
                        break
                    cap, big_first = _balanced_capacity(ev, i, tp, pp, d)
                    if cap < pp:
                        continue
                    got = options.get(d + pp)
                    if got is None or total + cap > got[0]:
                        shape = _Shape(tp=tp, pp=pp, dp=g // (tp * pp), cap=cap, big_first=big_first)
                        options[d + pp] = (total + cap, (shape, *shapes))
                tp *= 2
        frontier = []
        for d in sorted(options):
            total, shapes = options[d]
            if not frontier or total > frontier[-1][1]:
                frontier.append((d, total, shapes))
        if not frontier:
            return 0, None
    most = frontier[-1][1]
    fit = next(((d, total, shapes) for d, total, shapes in frontier if total >= L and d <= L), None)
    if fit is None:
        return most, None
    chosen = list(fit[2])
    low = [sh.pp for sh in chosen]
    high = [sh.cap for sh in chosen]
    weights = [g * compute_rate_tflops(c, ev.jc.precision) for g, c in zip(ev.gpus, ev.clusters, strict=True)]
    sizes = list(low)
    # Water-fill the remaining layers: each block in proportion to its weight, never above its cap.
    while sum(sizes) < L:
        room = [i for i in range(k) if sizes[i] < high[i]]
        left = L - sum(sizes)
        total_w = sum(weights[i] for i in room) or 1.0
        step = [min(high[i] - sizes[i], math.floor(left * weights[i] / total_w)) for i in room]
        if not any(step):
            best = max(room, key=lambda i: (weights[i] / (sizes[i] + 1), -i))
            sizes[best] += 1
            continue
        for i, add in zip(room, step, strict=True):
            sizes[i] += add
    return most, (sizes, chosen)


def _memory_first_plan(ev: _ChainEval, allocation: Sequence[tuple[str, int]]) -> Plan | None:
    """The plan of :func:`memory_first_split` (stages in chain order, each block's balanced sub-stages),
    unevaluated; ``None`` when there is none."""
    split = memory_first_split(ev)[1]
    if split is None:
        return None
    stages: list[Stage] = []
    first = 0
    for (name, _), nl, sh in zip(allocation, *split, strict=True):
        base, rem = divmod(nl, sh.pp)
        sizes = [base + 1] * rem + [base] * (sh.pp - rem) if sh.big_first else [base] * (sh.pp - rem) + [base + 1] * rem
        for sz in sizes:
            stages.append(Stage(cluster=name, first_layer=first, last_layer=first + sz - 1, tp=sh.tp, dp=sh.dp))
            first += sz
    return Plan(stages=tuple(stages), micro_batches=ev.jc.m, schedule=Schedule.ONE_F_ONE_B)


def fallback_plan_chain(
    topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], *, objective: Objective = Objective.JCT,
    _cache: dict[tuple[Any, ...], _Block] | None = None, every_shape: bool = False,
) -> Plan:
    """The level-1 planner of the module docstring for an ordered ``allocation`` of ``(cluster, gpus)``.

    Returns an evaluated plan using at most ``gpus`` GPUs per cluster (exactly ``gpus`` when that is needed
    to keep the job's GPU minimum). Raises :class:`UnschedulableError` (``constraint`` = ``memory``,
    ``layers`` or ``free_gpus``) when no split fits. ``objective`` is accepted for interface parity; the
    split minimises step time (for fixed GPUs, dollars per step are proportional to it).
    """
    del objective
    _validate_allocation(topo, job, allocation)
    ev = _ChainEval(topo, job, allocation, exact_gpus=False, cache=_cache, every_shape=every_shape)
    weights = [g * compute_rate_tflops(c, ev.jc.precision) for (_, g), c in zip(allocation, ev.clusters, strict=True)]
    start = _proportional_split(weights, job.model.layers)
    first_ev = ev
    if ev.evaluate_split(start, [1] * len(start))[0] > 0:
        # Over memory from the start: the memory-first structures tell at once whether anything can fit.
        most = memory_first_split(ev)[0]
        if most < job.model.layers:
            raise UnschedulableError(
                f"no split of {job.model.name}'s {job.model.layers} layers fits the memory of this chain: with "
                f"the micro-batches in flight its clusters hold at most {most} at any degrees", constraint="memory")
    sizes, blocks = _optimise_split(ev, start, local_search=True)
    if len(allocation) > 1:
        # Second start: the scorer's memory-aware water-filled split (escapes memory-bound local optima).
        ta = topo_arrays(topo)
        chain = np.array([[topo.index[c] for c, _ in allocation]], dtype=np.int64)
        gpus = np.array([[g for _, g in allocation]], dtype=np.int64)
        filled = score_chains(ta, ev.jc, transfer_matrix(ta, ev.jc), chain, gpus).layers[0]
        start = _proportional_split([float(x) for x in filled], job.model.layers)
        if start != sizes:
            sizes2, blocks2 = _optimise_split(ev, start, local_search=True)
            if _split_key(ev, sizes2, blocks2) < _split_key(ev, sizes, blocks):
                sizes, blocks = sizes2, blocks2
    if _split_key(ev, sizes, blocks)[0] > 0:
        split = memory_first_split(ev)[1]
        if split is not None and split[0] != sizes:
            sizes3, blocks3 = _optimise_split(ev, list(split[0]), local_search=True)
            if _split_key(ev, sizes3, blocks3) < _split_key(ev, sizes, blocks):
                sizes, blocks = sizes3, blocks3
    if sum(b.pp * b.tp * b.dp for b in blocks) < job.gpus.min <= sum(g for _, g in allocation):
        # Keep the GPU minimum: first let each cluster leave at most the range's slack unused, then none.
        slack = sum(g for _, g in allocation) - job.gpus.min
        for sl in ((slack, 0) if slack > 0 else (0,)):
            ev = _ChainEval(topo, job, allocation, exact_gpus=True, cache=_cache, slack=sl)
            sizes_x, blocks_x = _optimise_split(ev, sizes, local_search=True)
            if sum(b.pp * b.tp * b.dp for b in blocks_x) >= job.gpus.min:
                break
        sizes, blocks = sizes_x, blocks_x
    try:
        return _finish(topo, job, _blocks_to_plan(ev, allocation, sizes, blocks))
    except UnschedulableError:
        # The search ends over memory; a structure built for memory first may still fit (computed once: the
        # first evaluator keeps the structures it found when the chain started over memory).
        fallback = _memory_first_plan(first_ev, allocation)
        if fallback is None:
            raise
        plan = evaluate(fallback, topo, job)
        if not fits_memory(plan, topo)[0]:
            raise
        return plan


def plan_with_split(topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]],
                    sizes: Sequence[int]) -> Plan:
    """An evaluated plan with a *given* layer split (per-cluster degrees chosen as in the fallback)."""
    _validate_allocation(topo, job, allocation)
    if len(sizes) != len(allocation) or sum(sizes) != job.model.layers or min(sizes) < 1:
        raise ValidationError("sizes", f"must be {len(allocation)} positive counts summing to "
                              f"{job.model.layers}", list(sizes))
    ev = _ChainEval(topo, job, allocation, exact_gpus=False)
    sizes, blocks = _optimise_split(ev, list(sizes), local_search=False)
    return _finish(topo, job, _blocks_to_plan(ev, allocation, sizes, blocks))
