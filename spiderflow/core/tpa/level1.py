r"""TPA level 1: the layer split across the clusters of a chain (heuristic), and the cross-cluster DP rule.

Input: the chain ``c_0 … c_{C−1}`` with ``n_c`` GPUs each, the model's ``L`` layers, the micro-batch size
``b``, sequence ``s``, micro-batch count ``m`` and the schedule's in-flight profile.
Output: ``ℓ_0 … ℓ_{C−1}`` (``ℓ_c ≥ 1``, ``Σ ℓ_c = L``) contiguous blocks, each solved by level 2.

Algorithm
    1. Proportional split: ``ℓ_c ∝ n_c · F_c`` (effective compute), largest remainder, every block ≥ 1,
       water-filled against memory: a block never starts with more layers than it can hold
       (:func:`memory_caps`); its excess goes to the blocks with room.
    2. Evaluate: solve every block with level 2 from the last cluster to the first (a block's in-flight
       depth depends on how many stages follow it), then the step estimate of the costmodel closed form
       ``(m−1)·max(max_s T_s/d_s, max P) + Σ T_s + 2 Σ P + max_s (AR_s + |ℓ_s|·u_s)`` over all sub-stages
       and boundaries — the same terms as :func:`spiderflow.core.costmodel.evaluate`, calibrated ones included
       (``T_s`` holds the per-layer overhead, the sync term the optimizer step; level 2 computes both).
       A block no level-2 configuration fits scores its memory excess instead.
    3. Refine: take the bottleneck block (the one over memory by the most, else the one with the largest
       ``T/d``) and move one layer across either of its boundaries (into it instead when it has too few
       layers for any tensor/pipeline/data degrees of its GPUs); keep the better move if the score
       ``(excess, step)`` improves and repeat. When neither neighbour improves, the layer may travel
       further (all boundaries in between shift by one): to the 3 nearest blocks on each side or the 3
       blocks with the most slack (to any block while some block is over memory). If that fails too
       (chains of ≤ 16 clusters), the 3 blocks with the longest per-micro-batch time (the fill term) each
       try giving a layer to any block.
       Stop when no move improves.
    4. Polish (:func:`polish`): re-solve each block with the bottleneck of the rest of the chain as a
       floor, since below the pipeline's bottleneck a faster block gains nothing but its fill and sync do.
    5. Certify (:func:`certify`, only when the planner runs with ``level2="cpsat"``): solve the blocks of
       the returned split with level 2's CP-SAT model (:func:`~spiderflow.core.tpa.level2.solve_block_cached`,
       hinted and cached); these are then the plan's configurations.

Steps 2–4 score trial splits with level 2's exact optimum (:func:`~spiderflow.core.tpa.level2.block_bound_cached`:
the same optimum as the CP-SAT model, microseconds instead of milliseconds), so CP-SAT runs at most on the
``C`` blocks of the chosen split (fewer on repeated block shapes: cache hits).

Complexity: each evaluation is ``O(C)`` memoised level-2 lookups (an exact solve on a miss); at most
``L·C`` moves, each 2 evaluations (≤ 11 in the second phase, ≤ 3·C ≤ 48 in the third); ``C`` CP-SAT
lookups to certify. A split is evaluated once per call (the phases and the rounds revisit splits; the
first evaluation is reused), and a block's level-2 answer is memoised on what its problem depends on
(cluster, layers, embedding, head, stages downstream), so blocks at other offsets of a middle cluster share
it. Neither changes a result: the same level-2 questions are asked in the same order, less often.

Cross-cluster data parallelism (:func:`dp_crossing`)
    A layer block may be replicated on two adjacent clusters of the chain (instead of pipelining through
    them) only if (a) both clusters have the same GPU type and the same GPU count (replicas run in
    lock-step), (b) each cluster fits the whole block in memory, and (c) the hierarchical all-reduce —
    reduce-scatter inside each cluster, all-reduce of the ``1/n`` shards across the WAN link, all-gather
    inside — costs less than what the replication saves on the pipeline. The cross term is
    ``2·(2−1)/2 · (2·params/t) / b_uv + 2·l_uv`` per step; the saving is the pipeline bottleneck and fill of
    one fewer stage boundary. Plans express stages on a single cluster each, so the planner reports the
    rule's verdict and margin (``Plan.extras['dp_cross_gain_s']``) but always pipelines.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import (
    activation_bytes,
    allreduce_time,
    grad_bytes_per_value,
    stage_params,
    transfer_time,
    wire_bytes,
)
from spiderflow.core.domain import Cluster, Precision, Schedule, Topology
from spiderflow.core.kernels.search import bisect_memory_cap, block_layer_cap
from spiderflow.core.tpa.level2 import (
    BlockConfig,
    BlockProblem,
    ClusterShape,
    block_bound_cached,
    min_memory_config,
    solve_block_cached,
)
from spiderflow.core.tpa.level2 import _vectors as problem_vectors

__all__ = [
    "BlockInfeasibility",
    "ChainContext",
    "DpCrossing",
    "SplitEval",
    "block_bound_cached",  # the level-2 solver level 1 scores with; looked up at call time (replaceable)
    "certify",
    "dp_crossing",
    "evaluate_split",
    "layer_caps",
    "level1",
    "memory_caps",
    "no_split_fits",
    "polish",
    "proportional_split",
    "water_filled_split",
]


def _profile(schedule: Schedule) -> tuple[bool, int]:
    """``(gpipe, depth_factor)`` of the in-flight profile a schedule imposes (see the cost model)."""
    if schedule is Schedule.GPIPE:
        return True, 1
    if schedule is Schedule.LATENCY_AWARE:
        return False, 2
    return False, 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainContext:
    """Everything level 1 needs about one chain and one (m, schedule) choice."""

    clusters: tuple[Cluster, ...]
    gpus: tuple[int, ...]
    model: ModelSpec
    micro_batch: int
    seq_len: int
    m: int
    schedule: Schedule
    boundaries_s: tuple[float, ...]  # P between chain[c] and chain[c+1]
    max_in_flight: int | None = None  # the schedule's in-flight cap K (1F1B family; spiderflow.core.schedules)
    precision: Precision = Precision.BF16  # the job's: compute rates, value and state bytes
    recompute: bool = True  # level 2 may choose activation recomputation
    fsdp: bool = True  # level 2 may choose FSDP-sharded replicas
    shapes: tuple[ClusterShape, ...] = field(init=False, repr=False, compare=False)
    """Each cluster's level-2 shape in the job's precision (derived from ``clusters`` and ``precision``, made
    once per context instead of once per block problem)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(ClusterShape.of(c, self.precision) for c in self.clusters))

    def with_options(
        self, *, schedule: Schedule | None = None, recompute: bool | None = None, fsdp: bool | None = None,
    ) -> ChainContext:
        """This context with another schedule or level-2 options: ``dataclasses.replace`` of those fields,
        keeping the cluster shapes already derived (they depend on neither)."""
        out = object.__new__(ChainContext)
        for name in _CONTEXT_FIELDS:
            object.__setattr__(out, name, getattr(self, name))
        if schedule is not None:
            object.__setattr__(out, "schedule", schedule)
        if recompute is not None:
            object.__setattr__(out, "recompute", recompute)
        if fsdp is not None:
            object.__setattr__(out, "fsdp", fsdp)
        return out

    @classmethod
    def build(
        cls, topo: Topology, clusters: Sequence[Cluster], gpus: Sequence[int], model: ModelSpec, *,
        micro_batch: int, seq_len: int, m: int, schedule: Schedule, max_in_flight: int | None = None,
        precision: Precision = Precision.BF16, recompute: bool = True, fsdp: bool = True,
    ) -> ChainContext:
        bounds = []
        for u, v in itertools.pairwise(clusters):
            # The sender's wire format in the job's precision.
            nbytes = activation_bytes(model, micro_batch, seq_len, wire_bytes(u, precision))
            if u.name == v.name:
                bounds.append(transfer_time(nbytes, u.inter_node_gbps, 0.0))
            else:
                bounds.append(
                    transfer_time(nbytes, topo.bandwidth_gbps(u.name, v.name), topo.latency_ms(u.name, v.name))
                )
        return cls(
            clusters=tuple(clusters), gpus=tuple(gpus), model=model, micro_batch=micro_batch,
            seq_len=seq_len, m=m, schedule=schedule, boundaries_s=tuple(bounds), max_in_flight=max_in_flight,
            precision=precision, recompute=recompute, fsdp=fsdp,
        )

    def problem(self, c: int, first: int, layers: int, downstream: int, *, floor_s: float = 0.0) -> BlockProblem:
        gpipe, factor = _profile(self.schedule)
        per_replica_max = self.m  # in-flight never exceeds m: clamp so equivalent problems share a key
        return BlockProblem(
            shape=self.shapes[c],
            gpus=self.gpus[c],
            layers=layers,
            has_embed=first == 0,
            has_head=first + layers == self.model.layers,
            model=self.model,
            micro_batch=self.micro_batch,
            seq_len=self.seq_len,
            m=self.m,
            downstream=None if gpipe else min(downstream, per_replica_max),
            depth_factor=factor,
            floor_s=floor_s,
            max_in_flight=None if gpipe else self.max_in_flight,
            precision=self.precision,
            allow_recompute=self.recompute,
            allow_fsdp=self.fsdp,
        )


_CONTEXT_FIELDS = tuple(f.name for f in fields(ChainContext))
"""Every field of a context, derived ones included (:meth:`ChainContext.with_options` copies them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockInfeasibility:
    """Why a block fits nowhere: its cluster (chain index), global index of its first stage, the smallest
    peak memory per GPU any configuration needs, and the capacity."""

    chain_index: int
    stage_index: int
    need_gib: float
    capacity_gib: float

    @property
    def excess_gib(self) -> float:
        return self.need_gib - self.capacity_gib


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitEval:
    """A split and its level-2 configurations (``None`` for a block that fits nowhere); ``floors[c]`` the
    ``Z_floor`` block ``c`` was solved with (:func:`polish`; empty: all 0)."""

    split: tuple[int, ...]
    configs: tuple[BlockConfig | None, ...]
    step_s: float
    excess_gib: float
    infeasible: tuple[BlockInfeasibility, ...]
    floors: tuple[float, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.infeasible

    @property
    def score(self) -> tuple[float, float]:
        return (self.excess_gib, self.step_s)


def proportional_split(layers: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``ℓ_c ∝ weights[c]``, every ``ℓ_c ≥ 1``, ``Σ ℓ_c = layers`` (largest remainder). Needs ``layers ≥ len``."""
    n = len(weights)
    if layers < n:
        raise ValueError(f"{layers} layers cannot give each of {n} blocks one")
    total = float(sum(weights))
    spare = layers - n  # one layer each first, the rest by weight
    raw = [spare * w / total for w in weights]
    out = [1 + math.floor(r) for r in raw]
    left = layers - sum(out)
    order = sorted(range(n), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in order[:left]:
        out[i] += 1
    return tuple(out)


_NO_DEGREES_GIB = 1e6
_FULL_NEIGHBOURHOOD = 16  # chains up to this length get the third move phase
_Memo = dict[tuple[int, int, bool, bool, int], tuple[BlockConfig | None, float]]
BlockSolver = Callable[[BlockProblem], BlockConfig | None]


def _block(ctx: ChainContext, memo: _Memo | None, c: int, first: int, layers: int, downstream: int,
           solver: BlockSolver | None = None, explain: bool = True) -> tuple[BlockConfig | None, float, float]:
    """``(config, need_gib_if_infeasible, capacity)`` of one block, memoised per call of :func:`level1` on what
    its problem depends on: the cluster, the layer count, whether it holds the embedding and the head, and
    the stages downstream (a block's first layer matters only through the first two). ``explain=False``
    (no memo): an infeasible block's need is not priced (``inf``)."""
    key = (c, layers, first == 0, first + layers == ctx.model.layers, downstream)
    cap = ctx.clusters[c].gpu_memory_gib
    if memo is not None:
        hit = memo.get(key)
        if hit is not None:
            return hit[0], hit[1], cap
    p = ctx.problem(c, first, layers, downstream)
    cfg = (solver or block_bound_cached)(p)
    need = 0.0
    if cfg is None and not explain:
        need = math.inf
    elif cfg is None:
        worst = min_memory_config(p)
        need = max(worst.memory_gib) if worst is not None else math.inf
    if memo is not None:
        memo[key] = (cfg, need)
    return cfg, need, cap


def memory_caps(ctx: ChainContext) -> list[int]:
    """The most layers each block can hold in memory (some degrees with a balanced sub-split fit), assuming
    one stage per block downstream; binary search, ``O(C·log L)`` candidate scans, no solver calls. Plain
    degrees first; where their caps cannot hold every layer, with recomputation and FSDP too (level 2's
    second tier)."""
    if ctx.recompute or ctx.fsdp:
        caps = _memory_caps(ctx.with_options(recompute=False, fsdp=False))
        if min(caps) >= 1 and sum(caps) >= ctx.model.layers:
            return caps
    return _memory_caps(ctx)


def _memory_caps(ctx: ChainContext) -> list[int]:
    n = len(ctx.clusters)
    L = ctx.model.layers
    if n == 1:
        return [L]
    caps: list[int] = []
    for c in range(n):
        # One problem per block, its layer count and embedding/head flags set per probe (the only fields the
        # probes change): min_peak_fits of ctx.problem(c, first, mid, n − 1 − c) without building each problem,
        # the bisection in one kernel call (block 0 holds the embedding, the last block the head, the others
        # neither).
        fl, it = problem_vectors(ctx.problem(c, 0 if c == 0 else 1, L - (n - 1), n - 1 - c))
        caps.append(int(bisect_memory_cap(fl, it, c, n, L)))
    return caps


def layer_caps(ctx: ChainContext) -> list[int]:
    """The most layers each block of the chain can hold in memory under *some* degrees, exactly.

    For fixed degrees ``k`` (``pp`` sub-stages) a sub-stage's memory is linear in its layers, so the block
    holds ``ℓ`` layers iff ``pp ≤ ℓ ≤ U_k = Σ_j u_{k,j}`` (level 2's per-sub-stage caps ``u_{k,j}``, all
    ``≥ 1``); the block's cap is ``max_k U_k``. Holding fewer layers can *exclude* degrees (``pp ≤ ℓ``), so
    memory is not monotone in ``ℓ`` and no bisection is used. Each block is placed where it holds the least:
    block 0 with the embedding, the last block with the head, the others neither, and one stage per later
    block downstream (more stages downstream only add in-flight micro-batches). ``0`` when no degrees fit
    even one layer per sub-stage. A single-cluster chain's one block is exactly the problem level 1
    solves (all layers, embedding and head, nothing downstream), so its cap is exact."""
    n = len(ctx.clusters)
    L = ctx.model.layers
    hi = L - (n - 1)
    caps: list[int] = []
    for c in range(n):
        first = 0 if c == 0 else (L - hi if c == n - 1 else 1)
        # max_k Σ_j u_{k,j} over the degrees whose every u_{k,j} ≥ 1, in one kernel call (the same caps as
        # level 2's memory_caps of each of block_candidates(p)).
        best = block_layer_cap(*problem_vectors(ctx.problem(c, first, hi, n - 1 - c)))
        caps.append(min(best, hi))
    return caps


def no_split_fits(ctx: ChainContext) -> bool:
    """Whether the chain's :func:`layer_caps` prove that no layer split fits memory: every split gives block
    ``c`` at least one and at most ``caps[c]`` layers if it fits, so ``Σ caps < L`` (or a zero cap) leaves
    none. Sound, not complete (a split may still fail for other reasons); exact for a single cluster (its
    block fits iff some degrees' sub-stage caps hold every layer, level 2's own test). Level 1 would return
    an infeasible split; the planner skips it unless no micro-batch count fits, when the least infeasible
    split is needed to explain why."""
    caps = layer_caps(ctx)
    return min(caps) < 1 or sum(caps) < ctx.model.layers


def water_filled_split(layers: int, weights: Sequence[float], caps: Sequence[int]) -> tuple[int, ...]:
    """``ℓ_c ∝ weights[c]`` but never above ``caps[c]`` (the excess goes to the blocks with room, in
    proportion to their weights); falls back to the plain proportional split when the caps cannot hold
    every layer."""
    n = len(weights)
    if sum(caps) < layers:
        return proportional_split(layers, weights)
    fixed: dict[int, int] = {}
    while True:
        free = [c for c in range(n) if c not in fixed]
        left = layers - sum(fixed.values())
        split = dict(zip(free, proportional_split(left, [weights[c] for c in free]), strict=True)) if free else {}
        over = [c for c in free if split[c] > caps[c]]
        if not over:
            out = {**fixed, **split}
            return tuple(out[c] for c in range(n))
        for c in over:
            fixed[c] = caps[c]
        if len(fixed) == n or layers - sum(fixed.values()) < n - len(fixed):
            return proportional_split(layers, weights)


def evaluate_split(ctx: ChainContext, split: Sequence[int], *, memo: _Memo | None = None,
                   solver: BlockSolver | None = None, explain: bool = True) -> SplitEval:
    """Step 2 of the module docstring (``memo``: a dict shared by evaluations of one context and solver;
    ``solver``: level 2's exact optimum (the module's ``block_bound_cached``, looked up at call time) by
    default, :func:`~spiderflow.core.tpa.level2.solve_block_cached` for CP-SAT). ``explain=False``, for a
    caller that only keeps a feasible split: an infeasible split's blocks are solved all the same (the same
    level-2 questions), but the least memory of the blocks no configuration fits is not priced (their
    ``need_gib`` is ``inf``)."""
    if memo is not None and not explain:
        raise ValueError("evaluate_split: a memo holds priced blocks; explain=False takes none")
    n = len(split)
    firsts = [0] * n
    acc = 0
    for c, k in enumerate(split):
        firsts[c] = acc
        acc += k
    configs: list[BlockConfig | None] = [None] * n
    bad: list[BlockInfeasibility] = []
    downstream = 0
    pps = [1] * n
    for c in range(n - 1, -1, -1):
        cfg, need, cap = _block(ctx, memo, c, firsts[c], split[c], min(downstream, ctx.m), solver, explain)
        configs[c] = cfg
        if cfg is None:
            bad.append(BlockInfeasibility(chain_index=c, stage_index=-1, need_gib=need, capacity_gib=cap))
        else:
            pps[c] = cfg.pp
        downstream += pps[c]
    # Global stage index of each block's first stage.
    starts = [0] * n
    for c in range(1, n):
        starts[c] = starts[c - 1] + pps[c - 1]
    bad = [
        BlockInfeasibility(chain_index=b.chain_index, stage_index=starts[b.chain_index], need_gib=b.need_gib,
                           capacity_gib=b.capacity_gib)
        for b in sorted(bad, key=lambda b: b.chain_index)
    ]
    if bad:
        # A block with no admissible degrees at all counts as far over memory (finite, so moves compare).
        excess = sum(_NO_DEGREES_GIB if math.isinf(b.excess_gib) else max(b.excess_gib, 1e-9) for b in bad)
        return SplitEval(split=tuple(split), configs=tuple(configs), step_s=math.inf, excess_gib=excess,
                         infeasible=tuple(bad))
    step = step_estimate(ctx, [c for c in configs if c is not None])
    return SplitEval(split=tuple(split), configs=tuple(configs), step_s=step, excess_gib=0.0, infeasible=())


def step_estimate(ctx: ChainContext, configs: Sequence[BlockConfig]) -> float:
    """The costmodel closed form over every sub-stage of ``configs`` (one per chain cluster): equal to
    :func:`spiderflow.core.costmodel.evaluate`'s ``step_time_s`` of the plan these configurations make
    (level 2's ``compute_s`` includes the per-layer overhead, ``allreduce_s`` the optimizer step)."""
    bottleneck = 0.0
    fill = 0.0
    comm = 0.0
    ar = 0.0
    for c, cfg in enumerate(configs):
        bottleneck = max(bottleneck, cfg.bottleneck_s)
        fill += sum(cfg.compute_s)
        if cfg.pp > 1:
            bottleneck = max(bottleneck, cfg.intra_boundary_s)
            comm += (cfg.pp - 1) * cfg.intra_boundary_s
        if c < len(configs) - 1:
            p = ctx.boundaries_s[c]
            bottleneck = max(bottleneck, p)
            comm += p
        ar = max(ar, max(cfg.allreduce_s))
    return (ctx.m - 1) * bottleneck + fill + 2.0 * comm + ar


def _bottleneck_block(ev: SplitEval) -> int:
    if ev.infeasible:
        return max(ev.infeasible, key=lambda b: b.excess_gib).chain_index
    best, arg = -1.0, 0
    for c, cfg in enumerate(ev.configs):
        assert cfg is not None
        if cfg.bottleneck_s > best:
            best, arg = cfg.bottleneck_s, c
    return arg


def _far_targets(ev: SplitEval, b: int, k: int = 3) -> tuple[int, ...]:
    """Where a layer of block ``b`` may travel when neither neighbour takes it: the ``k`` nearest blocks on
    each side and the ``k`` feasible blocks with the most slack (smallest ``T/d``)."""
    n = len(ev.split)
    near = [c for c in range(b - k - 1, b + k + 2) if 0 <= c < n and abs(c - b) > 1]
    slack = sorted(
        (c for c, cfg in enumerate(ev.configs) if cfg is not None and c != b),
        key=lambda c: (ev.configs[c].bottleneck_s, c),  # type: ignore[union-attr]
    )[:k]
    return tuple(dict.fromkeys(near + slack))


def level1(ctx: ChainContext, *, initial: Sequence[int] | None = None, max_moves: int | None = None) -> SplitEval:
    """Steps 1–3 of the module docstring; returns the best split found (possibly infeasible)."""
    n = len(ctx.clusters)
    L = ctx.model.layers
    if initial is None:
        weights = [g * c.effective_tflops for g, c in zip(ctx.gpus, ctx.clusters, strict=True)]
        initial = water_filled_split(L, weights, memory_caps(ctx))
    memo: _Memo = {}
    ev = evaluate_split(ctx, initial, memo=memo)
    # Every split evaluated so far (the phases and the rounds revisit splits; with the block memo shared, a
    # second evaluation would give the same result).
    seen: dict[tuple[int, ...], SplitEval] = {ev.split: ev}
    budget = max_moves if max_moves is not None else L * n
    for _ in range(budget):
        best: SplitEval | None = None
        for moves in _move_phases(ev):
            for src, dst in moves:
                if ev.split[src] <= 1 or src == dst:
                    continue
                split = list(ev.split)
                split[src] -= 1
                split[dst] += 1
                key = tuple(split)
                cand = seen.get(key)
                if cand is None:
                    cand = seen[key] = evaluate_split(ctx, split, memo=memo)
                if best is None or cand.score < best.score:
                    best = cand
            if best is not None and _improves(best, ev):
                break
        if best is None or not _improves(best, ev):
            break
        ev = best
    return ev


def polish(ctx: ChainContext, ev: SplitEval) -> SplitEval:
    """Step 4: re-solve each block knowing the bottleneck ``Z_floor`` the rest of the chain imposes (level 2
    then trades a slower-but-harmless bottleneck for less fill or gradient sync); keep a re-solve when the
    step estimate improves and the block's pipeline depth does not grow (so no upstream block's in-flight
    memory grows). ``O(C)`` level-2 solves.
    """
    if not ev.feasible or len(ev.split) < 2:
        return ev
    configs = [cfg for cfg in ev.configs if cfg is not None]
    best = step_estimate(ctx, configs)
    n = len(configs)
    floors = list(ev.floors or (0.0,) * n)
    for c in range(n):
        others = [cfg for j, cfg in enumerate(configs) if j != c]
        floor = max(
            [cfg.bottleneck_s for cfg in others]
            + [cfg.intra_boundary_s for cfg in others if cfg.pp > 1]
            + list(ctx.boundaries_s)
        )
        floor = float(f"{floor:.4g}")  # a coarse key: neighbouring splits share solves
        downstream = sum(cfg.pp for cfg in configs[c + 1:])
        p = ctx.problem(c, sum(ev.split[:c]), ev.split[c], min(downstream, ctx.m), floor_s=floor)
        cfg = block_bound_cached(p)
        if cfg is None or cfg.pp > configs[c].pp:
            continue
        trial = [*configs[:c], cfg, *configs[c + 1:]]
        step = step_estimate(ctx, trial)
        if step < best * (1.0 - 1e-9):
            configs, best = trial, step
            floors[c] = floor
    return SplitEval(split=ev.split, configs=tuple(configs), step_s=best, excess_gib=0.0, infeasible=(),
                     floors=tuple(floors))


def certify(ctx: ChainContext, ev: SplitEval) -> SplitEval:
    """Step 5: the configurations of a feasible split solved by level 2's CP-SAT model (the problems
    steps 2–4 scored, floors included), from the last block to the first. The CP-SAT optimum equals the
    exact one; should CP-SAT return a configuration with another pipeline depth (a tie, or a better
    optimum), the upstream blocks' in-flight profiles follow it and the split is re-evaluated with
    CP-SAT. ``O(C)`` cached CP-SAT lookups."""
    if not ev.feasible:
        return ev
    n = len(ev.split)
    floors = ev.floors or (0.0,) * n
    configs: list[BlockConfig | None] = [None] * n
    downstream = 0
    first = sum(ev.split)
    for c in range(n - 1, -1, -1):
        first -= ev.split[c]
        cfg = solve_block_cached(ctx.problem(c, first, ev.split[c], min(downstream, ctx.m), floor_s=floors[c]))
        old = ev.configs[c]
        if cfg is None or old is None or cfg.pp != old.pp:
            return evaluate_split(ctx, ev.split, solver=solve_block_cached)
        configs[c] = cfg
        downstream += cfg.pp
    done = [cfg for cfg in configs if cfg is not None]
    return SplitEval(split=ev.split, configs=tuple(configs), step_s=step_estimate(ctx, done), excess_gib=0.0,
                     infeasible=(), floors=tuple(floors))


def _improves(new: SplitEval, old: SplitEval) -> bool:
    """Strictly better score, by more than rounding noise on the step time."""
    if new.excess_gib != old.excess_gib:
        return new.excess_gib < old.excess_gib
    return new.step_s < old.step_s * (1.0 - 1e-9)


def _move_phases(ev: SplitEval) -> list[list[tuple[int, int]]]:
    """Candidate single-layer moves ``(from block, to block)``, in the order step 3 tries them."""
    n = len(ev.split)
    b = _bottleneck_block(ev)
    # A block no degrees fit at all (too few layers for its GPUs) takes a layer; any other bottleneck
    # gives one away.
    inward = any(x.chain_index == b and math.isinf(x.need_gib) for x in ev.infeasible)

    def pair(other: int) -> tuple[int, int]:
        return (other, b) if inward else (b, other)

    phases = [
        [pair(c) for c in (b - 1, b + 1) if 0 <= c < n],
        # Over memory, the layer may go anywhere that helps; otherwise to the near and idle blocks.
        [pair(c) for c in (range(n) if ev.infeasible else _far_targets(ev, b))],
    ]
    if ev.feasible and n <= _FULL_NEIGHBOURHOOD:
        # The fill term Σ T_s also counts: the blocks with the longest per-micro-batch time give a layer
        # to any block.
        configs = [cfg for cfg in ev.configs if cfg is not None]
        heavy = sorted(range(n), key=lambda c: (-sum(configs[c].compute_s), c))[:3]
        phases.append([(src, dst) for src in heavy for dst in range(n) if dst != src])
    return phases


@dataclass(frozen=True, slots=True, kw_only=True)
class DpCrossing:
    """Verdict of the cross-cluster DP rule for chain positions ``(c, c+1)``."""

    index: int
    allowed: bool
    reason: str
    hierarchical_allreduce_s: float
    pipeline_saving_s: float

    @property
    def gain_s(self) -> float:
        """Seconds per step replication would save (negative: pipelining is better)."""
        return self.pipeline_saving_s - self.hierarchical_allreduce_s if self.allowed else -math.inf


def hierarchical_allreduce_time(
    nbytes: float, clusters: Sequence[Cluster], gpus: Sequence[int], wan_gbps: float, wan_latency_ms: float
) -> float:
    """Reduce-scatter in each cluster, ring all-reduce of the shard across clusters, all-gather in each.

    ``T = max_c AR_{n_c}(x, B_c) + AR_{|C|}(x / min n_c, b_wan) + |C|·λ`` (the in-cluster reduce-scatter and
    all-gather together cost one in-cluster ring all-reduce).
    """
    inner = max(
        allreduce_time(nbytes, n, c.intra_node_gbps if n <= c.gpus_per_node else c.inter_node_gbps)
        for c, n in zip(clusters, gpus, strict=True)
    )
    shard = nbytes / max(1, min(gpus))
    return inner + allreduce_time(shard, len(clusters), wan_gbps, wan_latency_ms)


def dp_crossing(ctx: ChainContext, ev: SplitEval, topo: Topology) -> list[DpCrossing]:
    """Apply the cross-cluster DP rule of the module docstring to every adjacent pair of the chain.

    The saving is the closed-form step of the split minus the step with blocks ``c`` and ``c+1`` merged
    into one block replicated on both clusters (the boundary between them disappears; the merged block
    admits a micro-batch every ``T_merged / (2·d)``; its gradients sync hierarchically across the link).
    """
    out: list[DpCrossing] = []
    if not ev.feasible:
        return out
    configs = [cfg for cfg in ev.configs if cfg is not None]
    current = step_estimate(ctx, configs)
    n = len(ev.split)
    firsts = [sum(ev.split[:c]) for c in range(n)]
    downstream = [sum(cfg.pp for cfg in configs[c + 1:]) for c in range(n)]
    for c in range(n - 1):
        u, v = ctx.clusters[c], ctx.clusters[c + 1]
        if u.name == v.name:
            continue
        if u.gpu != v.gpu or ctx.gpus[c] != ctx.gpus[c + 1]:
            out.append(DpCrossing(index=c, allowed=False, reason="different GPU types or counts",
                                  hierarchical_allreduce_s=math.inf, pipeline_saving_s=0.0))
            continue
        first = firsts[c]
        merged_layers = ev.split[c] + ev.split[c + 1]
        # An estimate for extras only (not a plan's block): the exact optimum, no CP-SAT solve.
        merged = block_bound_cached(ctx.problem(c, first, merged_layers, downstream[c + 1]))
        if merged is None:
            out.append(DpCrossing(index=c, allowed=False, reason="the merged block does not fit in memory",
                                  hierarchical_allreduce_s=math.inf, pipeline_saving_s=0.0))
            continue
        grad = float(grad_bytes_per_value(ctx.precision)) * stage_params(ctx.model, first, first + merged_layers - 1) \
            / merged.tp
        t_ar = hierarchical_allreduce_time(
            grad, (u, v), (ctx.gpus[c], ctx.gpus[c + 1]),
            topo.bandwidth_gbps(u.name, v.name), topo.latency_ms(u.name, v.name),
        )
        others = [cfg for i, cfg in enumerate(configs) if i not in (c, c + 1)]
        bounds = [p for i, p in enumerate(ctx.boundaries_s) if i != c]
        bottleneck = max(
            [cfg.bottleneck_s for cfg in others] + bounds + [max(merged.compute_s) / (2 * merged.dp)]
            + [cfg.intra_boundary_s for cfg in others if cfg.pp > 1]
        )
        fill = sum(sum(cfg.compute_s) for cfg in others) + sum(merged.compute_s)
        comm = sum(bounds) + sum((cfg.pp - 1) * cfg.intra_boundary_s for cfg in [*others, merged])
        ar_others = max((max(cfg.allreduce_s) for cfg in others), default=0.0)
        replicated = (ctx.m - 1) * bottleneck + fill + 2.0 * comm + max(ar_others, t_ar)
        saving = current - replicated + t_ar  # what the pipeline side saves, before paying the sync
        out.append(DpCrossing(index=c, allowed=replicated < current,
                              reason="hierarchical all-reduce vs pipeline boundary",
                              hierarchical_allreduce_s=t_ar, pipeline_saving_s=saving))
    return out
