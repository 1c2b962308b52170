r"""The TPA planner entry point: a chain allocation in, an evaluated :class:`~spiderflow.core.domain.Plan` out.

``plan_chain`` searches the micro-batch count ``m`` over divisors of the global batch (micro-batch size
``b = B/m``), runs level 1 (layer split across clusters, :mod:`spiderflow.core.tpa.level1`) with level 2
(per-cluster degrees, :mod:`spiderflow.core.tpa.level2`) for the 1F1B memory profile and polishes every
feasible count's split. The count and the pipeline schedule are then chosen together on the exact event-level
timeline (:mod:`spiderflow.core.tpa.timeline`): for every polished split, every schedule whose in-flight memory
fits (GPipe, 1F1B, interleaved 1F1B, the latency-aware schedule; the split re-solved for a schedule whose
memory its configurations exceed) is ranked by a window-aware estimate
(:func:`~spiderflow.core.tpa.timeline.window_estimate`) and simulated in that order within an op budget (the
top-ranked one always; a candidate whose :func:`~spiderflow.core.tpa.timeline.step_lower_bound` cannot beat the
best simulated one is skipped). The best simulated objective wins, and its simulated step is the plan's
``step_time_s``: what the planner optimises is what it reports. Objectives within :data:`SIMULATED_TIE` of each
other tie, and the better-ranked candidate keeps it. Level 2 solves every block exactly (``level2="exact"``, the
default); with ``level2="cpsat"`` the chosen count's blocks are solved again with level 2's CP-SAT model
(:func:`~spiderflow.core.tpa.level1.certify`) and its schedules scored again on them.

Contract
    * ``allocation`` is the ordered chain of ``(cluster name, GPUs used there)``; the returned plan uses
      exactly those GPUs (``plan.gpus_by_cluster()`` equals the allocation summed per cluster), its
      stages follow the chain order, a cluster with intra-cluster pipelining appears as consecutive stages.
    * The plan is passed through :func:`~spiderflow.core.tpa.timeline.evaluate_on_timeline`: memory per GPU is
      the shared cost model's; ``step_time_s`` is the exact simulated step of the returned plan (pipeline
      makespan + gradient sync; what the choice of ``m`` and schedule minimises), throughput and dollars
      follow from it. Every other policy's plan is re-scored the same way where plans are compared (the
      scheduling cycle, ``spiderflow plan``, the benchmarks: :func:`~spiderflow.core.tpa.timeline.result_on_timeline`).
      ``extras`` adds ``timeline_step_s`` (= ``step_time_s``), ``closed_form_step_s`` (the cost model's
      closed form, what level 1 and 2 and the chain searches rank with), ``chunks`` (interleaving),
      ``micro_batch_size``, ``plan_seconds`` and ``dp_cross_gain_s`` (the best margin of the
      cross-cluster DP rule; ≤ 0 means pipelining is right everywhere).
    * Raises :class:`~spiderflow.core.errors.ValidationError` for a malformed allocation and
      :class:`~spiderflow.core.errors.UnschedulableError` (``constraint`` = ``"memory"``, ``"degrees"``,
      ``"layers"``, ``"free_gpus"`` or ``"link"``) when no configuration fits, naming the binding stage,
      cluster and GiB (e.g. ``stage 2 on cluster ohio needs 93.1 GiB per GPU, 13.1 GiB over the 80 GiB of
      A100-80G``).
    * Pure and deterministic: no I/O, no randomness; level-2 results are memoised process-wide.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import structlog

from spiderflow.core.costmodel import (
    evaluate,
    evaluate_with_breakdown,
    in_flight_microbatches,
    plan_fits_memory,
)
from spiderflow.core.domain import Cluster, JobSpec, Objective, Plan, Schedule, Stage, Topology
from spiderflow.core.errors import UnschedulableError, ValidationError
from spiderflow.core.schedules import MAX_IN_FLIGHT_KEY
from spiderflow.core.tpa.level1 import (
    BlockSolver,
    ChainContext,
    SplitEval,
    certify,
    dp_crossing,
    evaluate_split,
    level1,
    no_split_fits,
    polish,
)
from spiderflow.core.tpa.level2 import LEVEL2_SOLVERS, Level2Solver, solve_block_cached
from spiderflow.core.tpa.timeline import (
    StageInputs,
    evaluate_on_timeline,
    plan_stage_timing,
    simulate_plan,
    step_lower_bound,
    window_estimate,
)

__all__ = [
    "micro_batch_candidates", "objective_score", "plan_chain", "plan_from_split", "split_stages", "with_in_flight_cap",
]

log = structlog.get_logger(__name__)

_SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE, Schedule.GPIPE, Schedule.INTERLEAVED_1F1B)
_CAPPED = (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE)  # the schedules an in-flight cap shapes
INTERLEAVE_CHUNKS = 2
SIMULATION_OP_BUDGET = 400_000  # ops the exact timeline may simulate per plan_chain call (beyond the first)
SIMULATED_TIE = 1e-9
"""Simulated objectives this close (relative) are a tie, kept by the schedule simulated first (the better
ranked): the timeline's steady-state extrapolation is exact up to float rounding, not to the last bit."""


def micro_batch_candidates(global_batch: int, n_blocks: int, *, limit: int = 6) -> list[int]:
    """Divisors ``m`` of the global batch to try: those ≥ the chain length (fewer micro-batches than
    stages leaves stages idle) — all divisors if none is — thinned to ``limit`` values spread evenly in
    ``log m`` and always including the largest (smallest micro-batches: least activation memory)."""
    divs = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    pool = [d for d in divs if d >= n_blocks] or divs
    if len(pool) <= limit:
        return pool
    lo, hi = math.log(pool[0]), math.log(pool[-1])
    picked: list[int] = []
    for i in range(limit):
        target = lo + (hi - lo) * i / (limit - 1)
        best = min(pool, key=lambda d: (abs(math.log(d) - target), d))
        if best not in picked:
            picked.append(best)
    return sorted(picked)


def objective_score(plan: Plan, objective: Objective, step_s: float) -> float:
    """The quantity ``objective`` minimises for a plan whose step takes ``step_s`` seconds."""
    usd = plan.usd_per_step * (step_s / plan.step_time_s) if plan.step_time_s > 0 else plan.usd_per_step
    if objective is Objective.COST:
        return usd
    if objective is Objective.BALANCED:
        return step_s * math.sqrt(max(usd, 0.0))
    return step_s


def split_stages(ctx: ChainContext, ev: SplitEval) -> tuple[Stage, ...]:
    """The stages of a feasible split (block ``c``'s sub-stages consecutive, in chain order): the same for every
    schedule of the split."""
    stages: list[Stage] = []
    first = 0
    for cl, cfg in zip(ctx.clusters, ev.configs, strict=True):
        if cfg is None:
            raise ValueError("plan_from_split needs a feasible split")
        for n in cfg.layers:
            stages.append(Stage(cluster=cl.name, first_layer=first, last_layer=first + n - 1, tp=cfg.tp, dp=cfg.dp,
                                sharding=cfg.sharding, recompute=cfg.recompute))
            first += n
    return tuple(stages)


def plan_from_split(ctx: ChainContext, ev: SplitEval, *, chunks: int = 1,
                    stages: tuple[Stage, ...] | None = None) -> Plan:
    """The plan of a feasible split (its :func:`split_stages`; ``stages``: those when the caller has them
    already) under the context's schedule; the context's in-flight cap goes to ``extras["max_in_flight"]``
    for the 1F1B family."""
    extras = {"chunks": float(chunks)} if ctx.schedule is Schedule.INTERLEAVED_1F1B else {}
    if ctx.max_in_flight is not None and ctx.schedule in _CAPPED:
        extras[MAX_IN_FLIGHT_KEY] = float(ctx.max_in_flight)
    return Plan(stages=split_stages(ctx, ev) if stages is None else stages, micro_batches=ctx.m,
                schedule=ctx.schedule, extras=extras)


def with_in_flight_cap(plan: Plan, topo: Topology, job: JobSpec, max_in_flight: int) -> Plan:
    """``plan`` (same stages and ``m``) held to at most ``K = max_in_flight`` micro-batches in flight per stage
    replica, evaluated: 1F1B and the latency-aware schedule carry ``extras["max_in_flight"] = K`` (capped
    warm-ups); GPipe and interleaved 1F1B stay as they are where their own in-flight count is within ``K``,
    else run as capped 1F1B (their orders cannot be capped). Memory never grows; the closed-form step is
    unchanged except that interleaving's shorter fill is lost when it becomes 1F1B. ``ValidationError`` for
    ``K < 1``."""
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise ValidationError("max_in_flight", "must be an integer ≥ 1", max_in_flight)
    if plan.schedule not in _CAPPED and _peak_in_flight(plan) <= max_in_flight:
        return evaluate(plan, topo, job)
    extras = {k: v for k, v in plan.extras.items() if k != "chunks"}
    extras[MAX_IN_FLIGHT_KEY] = float(max_in_flight)
    schedule = plan.schedule if plan.schedule in _CAPPED else Schedule.ONE_F_ONE_B
    return evaluate(replace(plan, schedule=schedule, extras=extras), topo, job)


def _peak_in_flight(plan: Plan) -> int:
    """The most micro-batches any stage replica holds under ``plan``'s schedule (cost model, uncapped)."""
    n = len(plan.stages)
    return max(in_flight_microbatches(plan.schedule, plan.micro_batches, st.dp, i, n)
               for i, st in enumerate(plan.stages))


def _validate(topo: Topology, allocation: Sequence[tuple[str, int]]) -> tuple[list[Cluster], list[int]]:
    if not allocation:
        raise ValidationError("allocation", "needs at least one (cluster, gpus) entry", [])
    clusters: list[Cluster] = []
    gpus: list[int] = []
    used: dict[str, int] = {}
    for i, entry in enumerate(allocation):
        try:
            name, n = entry
        except (TypeError, ValueError):
            raise ValidationError(f"allocation[{i}]", "must be a (cluster name, gpus) pair", entry) from None
        if name not in topo.index:
            raise ValidationError(f"allocation[{i}].cluster", "unknown cluster", name)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValidationError(f"allocation[{i}].gpus", "must be an integer ≥ 1", n)
        c = topo.cluster(name)
        clusters.append(c)
        gpus.append(n)
        used[name] = used.get(name, 0) + n
    for name, n in used.items():
        free = topo.cluster(name).free
        if n > free:
            raise UnschedulableError(
                f"cluster {name} has {free} free GPUs, the chain asks for {n}", constraint="free_gpus"
            )
    for u, v in itertools.pairwise(clusters):
        if u.name != v.name and topo.bandwidth_gbps(u.name, v.name) <= 0:
            raise UnschedulableError(f"no network path from cluster {u.name} to cluster {v.name}", constraint="link")
        if u.name != v.name and topo.bandwidth_gbps(v.name, u.name) <= 0:  # the gradients go back
            raise UnschedulableError(f"no network path from cluster {v.name} back to cluster {u.name} (the "
                                     f"gradients' direction)", constraint="link")
    return clusters, gpus


def _memory_error(ctx: ChainContext, ev: SplitEval) -> UnschedulableError:
    worst = max(ev.infeasible, key=lambda b: b.excess_gib)
    c = ctx.clusters[worst.chain_index]
    if math.isinf(worst.need_gib):
        return UnschedulableError(
            f"cluster {c.name} cannot run its {ev.split[worst.chain_index]} layers on "
            f"{ctx.gpus[worst.chain_index]} GPUs with any tensor/pipeline/data degrees",
            constraint="degrees",
        )
    return UnschedulableError(
        f"stage {worst.stage_index} on cluster {c.name} needs {worst.need_gib:.1f} GiB per GPU, "
        f"{worst.excess_gib:.1f} GiB over the {c.gpu_memory_gib:g} GiB of {c.gpu}",
        constraint="memory",
    )


def _schedule_plans(
    ctx: ChainContext, ev: SplitEval, allowed: Sequence[Schedule], topo: Topology, job: JobSpec,
    objective: Objective, max_in_flight: int | None, *, resolve: BlockSolver | None | Literal[False],
    pending: dict[Schedule, ChainContext | None] | None = None,
) -> list[_Candidate]:
    """The evaluated plans of ``ev``'s split under each allowed schedule (with their simulator inputs), with
    their window-aware objective
    (:func:`~spiderflow.core.tpa.timeline.window_estimate`): the same stages where they fit the schedule's
    in-flight memory, else the split re-solved for it (``resolve``: the level-2 solver; ``False``: no
    re-solve, the schedule is skipped).

    ``pending`` (one dict per split, shared by the calls for that split): a call with ``resolve=False``
    records there, per schedule it left out, the schedule's context when the split only needs a re-solve
    (its stages exceed the schedule's memory) and ``None`` when the schedule is out whatever the solver
    (its order, its cap or its stages rule it out); a later call on the same split then skips the latter
    and re-solves the former without building and pricing the unfitting plan again. Same candidates."""
    out: list[_Candidate] = []
    n_stages = sum(cfg.pp for cfg in ev.configs if cfg is not None)
    stages: tuple[Stage, ...] | None = None  # ev's stages, built once for all its schedules
    for sched in allowed:
        recorded = pending is not None and resolve is not False and sched in pending
        known = pending[sched] if pending is not None and recorded else None
        if recorded and known is None:
            continue  # ruled out for this split by a check that does not depend on the solver
        chunks = INTERLEAVE_CHUNKS if sched is Schedule.INTERLEAVED_1F1B else 1
        if known is None:
            if n_stages == 1 and sched is not Schedule.ONE_F_ONE_B and Schedule.ONE_F_ONE_B in allowed:
                _note_out(pending, resolve, sched, None)
                continue
            if sched is Schedule.INTERLEAVED_1F1B and ctx.m % n_stages:
                _note_out(pending, resolve, sched, None)
                continue  # Megatron's interleaved order needs m to be a multiple of the stage count
            sctx = ctx.with_options(schedule=sched)
            if stages is None:
                stages = split_stages(ctx, ev)
            raw = plan_from_split(sctx, ev, chunks=chunks, stages=stages)
            if max_in_flight is not None and sched not in _CAPPED and _peak_in_flight(raw) > max_in_flight:
                _note_out(pending, resolve, sched, None)
                continue  # its order holds more than the cap and cannot be capped
            fits = plan_fits_memory(raw, topo, job)
        else:
            sctx, fits = known, False  # recorded: the split's stages exceed this schedule's memory
        if not fits:
            if resolve is False:
                _note_out(pending, resolve, sched, sctx)
                continue
            sev = evaluate_split(sctx, ev.split, solver=resolve, explain=False)
            if not sev.feasible:
                continue
            raw = plan_from_split(sctx, sev, chunks=chunks)
        plan, bd = evaluate_with_breakdown(raw, topo, job)
        if sched is Schedule.INTERLEAVED_1F1B and any(st.layers < chunks for st in plan.stages):
            if fits:
                _note_out(pending, resolve, sched, None)
            continue
        timing = plan_stage_timing(plan, topo, job, bd=bd)
        out.append((objective_score(plan, objective, window_estimate(plan, topo, job, timing=timing)), plan, timing))
    return out


def _note_out(pending: dict[Schedule, ChainContext | None] | None, resolve: BlockSolver | None | Literal[False],
              sched: Schedule, sctx: ChainContext | None) -> None:
    """Record in ``pending`` why a ``resolve=False`` call left ``sched`` out (:func:`_schedule_plans`)."""
    if pending is not None and resolve is False:
        pending[sched] = sctx


_Candidate = tuple[float, Plan, StageInputs]
"""A candidate plan: its window-aware objective, the plan (evaluated), its simulator inputs."""


def _timing_of(plan: Plan, cands: Sequence[_Candidate]) -> StageInputs:
    return next(t for _, p, t in cands if p is plan)


class _Simulations:
    """The exact timeline's scores of candidate plans within :data:`SIMULATION_OP_BUDGET` (``spent``)."""

    def __init__(self, topo: Topology, job: JobSpec, objective: Objective) -> None:
        self.topo, self.job, self.objective = topo, job, objective
        self.spent = 0
        self.by_count: dict[int, float] = {}
        """Per micro-batch count, the best objective simulated or (where none was) the least bound that
        ruled its candidates out."""

    def _note(self, m: int, score: float) -> None:
        self.by_count[m] = min(self.by_count.get(m, math.inf), score)

    def best(self, cands: list[_Candidate]) -> tuple[float, Plan, float] | None:
        """The best simulated ``(objective, plan, step)`` of ``cands``, simulated in window-estimate order
        (the first always, the rest within the budget); a candidate whose lower bound cannot beat the best
        simulated objective so far is skipped."""
        best: tuple[float, Plan, float] | None = None
        for _, plan, timing in sorted(cands, key=lambda r: r[0]):
            ops = 2 * plan.micro_batches * len(plan.stages) * int(plan.extras.get("chunks", 1))
            if best is not None:  # the first candidate is always simulated
                if self.spent + ops > SIMULATION_OP_BUDGET:
                    continue
                bound = objective_score(plan, self.objective, step_lower_bound(plan, self.topo, self.job,
                                                                               timing=timing))
                if bound >= best[0]:
                    self._note(plan.micro_batches, bound)
                    continue  # even its lower bound cannot beat the best simulated schedule
            self.spent += ops
            try:
                step = simulate_plan(plan, self.topo, self.job, record=False, timing=timing).step_s
            except ValueError:
                # The order cannot run with this replica layout (schedules.replica_ops deadlocks, e.g.
                # interleaving with data parallelism): not a candidate.
                log.debug("tpa.schedule_skipped", job=self.job.id, schedule=str(plan.schedule),
                          m=plan.micro_batches)
                continue
            score = objective_score(plan, self.objective, step)
            self._note(plan.micro_batches, score)
            if best is None or score < best[0] * (1.0 - SIMULATED_TIE):
                best = (score, plan, step)
        return best


def plan_chain(
    topo: Topology,
    job: JobSpec,
    allocation: Sequence[tuple[str, int]],
    *,
    objective: Objective = Objective.JCT,
    micro_batches: Sequence[int] | None = None,
    schedules: Sequence[Schedule] | None = None,
    max_in_flight: int | None = None,
    level2: Level2Solver = "exact",
    explain: bool = True,
    recompute: bool = True,
    fsdp: bool = True,
) -> Plan:
    """Plan ``job`` on the chain ``allocation`` (module docstring: contract, errors, extras).

    ``micro_batches`` pins the micro-batch counts tried (each must divide the global batch; default
    :func:`micro_batch_candidates`); ``schedules`` the schedules tried (default all four). 1F1B always
    serves as level 1's memory profile.

    ``max_in_flight`` (``K``) is a memory cap applied the same way to every schedule: no stage replica
    holds more than ``K`` micro-batches of activations. 1F1B and the latency-aware schedule run with their
    warm-ups capped at ``K − 1`` (:mod:`spiderflow.core.schedules`; the plan carries
    ``extras["max_in_flight"] = K``, and :func:`~spiderflow.core.costmodel.evaluate` charges memory under the
    cap); GPipe and
    interleaved 1F1B, whose orders cannot be capped, are tried only where they hold at most ``K`` anyway.
    Level 1 and 2 solve the blocks under the capped in-flight profile.

    ``level2`` (:data:`~spiderflow.core.tpa.level2.LEVEL2_SOLVERS`) is the solver of the returned plan's blocks
    and of their re-solves under another schedule: ``"exact"`` (:func:`~spiderflow.core.tpa.level2.block_bound_cached`)
    or ``"cpsat"`` (the CP-SAT model, :func:`~spiderflow.core.tpa.level2.solve_block_cached`). Both reach the
    optimum of the same model; CP-SAT rounds times to integer units, so on near-ties it may pick another
    configuration. ``"cpsat"`` costs about 2–8 ms more per uncached plan.

    ``explain=False`` is for callers that only need to know that nothing fits (they hold another plan of the
    chain): the memory error then names the least infeasible split among the micro-batch counts level 1
    solved, without solving those the memory caps ruled out just to compare them.

    Complexity: ``|m candidates| × (level 1 + polish)`` plus timeline simulations of ``O(m·S·log(m·S))`` each,
    at most :data:`SIMULATION_OP_BUDGET` ops beyond the first; level-2 solves are cached across calls.
    """
    t0 = time.perf_counter()
    clusters, gpus = _validate(topo, allocation)
    model = job.model
    if model.layers < len(clusters):
        raise UnschedulableError(
            f"{model.name} has {model.layers} layers, fewer than the {len(clusters)} clusters of the chain",
            constraint="layers",
        )
    ms = list(micro_batches) if micro_batches is not None else micro_batch_candidates(job.global_batch, len(clusters))
    for i, m in enumerate(ms):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or job.global_batch % m:
            raise ValidationError(f"micro_batches[{i}]", f"must divide the global batch {job.global_batch}", m)
    if max_in_flight is not None and (
        isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1
    ):
        raise ValidationError("max_in_flight", "must be an integer ≥ 1", max_in_flight)
    if level2 not in LEVEL2_SOLVERS:
        raise ValidationError("level2", f"must be one of {', '.join(LEVEL2_SOLVERS)}", level2)
    allowed = tuple(schedules) if schedules is not None else _SCHEDULES
    if not allowed:
        raise ValidationError("schedules", "needs at least one schedule", [])
    results: list[tuple[ChainContext, SplitEval]] = []
    least_bad: tuple[ChainContext, SplitEval] | None = None
    # Level 1 for every micro-batch count, except those whose memory caps prove no split fits: they are
    # only solved (for the error's figures) when no count fits at all.
    tried: list[tuple[ChainContext, SplitEval | None]] = []
    for m in ms:
        ctx = ChainContext.build(
            topo, clusters, gpus, model, micro_batch=job.global_batch // m, seq_len=job.seq_len, m=m,
            schedule=Schedule.ONE_F_ONE_B, max_in_flight=max_in_flight, precision=job.precision,
            recompute=recompute, fsdp=fsdp,
        )
        ev = None if no_split_fits(ctx) else level1(ctx)
        tried.append((ctx, ev))
        if ev is not None and ev.feasible:
            results.append((ctx, ev))
    if not results:
        for ctx, maybe in tried:
            if maybe is None and not explain:
                continue
            ev = maybe if maybe is not None else level1(ctx)
            if least_bad is None or ev.excess_gib < least_bad[1].excess_gib:
                least_bad = (ctx, ev)
        if least_bad is None:  # brief, and every count was ruled out by its memory caps
            raise UnschedulableError(
                f"{model.name} fits this chain's memory at none of the micro-batch counts "
                f"{', '.join(str(m) for m in ms)} (the clusters' layer caps hold fewer than its {model.layers} "
                f"layers)", constraint="memory")
        raise _memory_error(*least_bad)
    # The micro-batch count and the schedule are chosen together on the exact timeline: every feasible
    # count's split is polished, and its plans under every schedule whose memory fits (re-solved where the
    # split's configurations do not) are ranked by the window-aware estimate and simulated in that order
    # within the op budget; the best simulated objective is the plan, its simulated step its step_time_s.
    sim = _Simulations(topo, job, objective)
    polished: list[tuple[ChainContext, SplitEval]] = []
    ranked: list[_Candidate] = []
    left_out: dict[int, dict[Schedule, ChainContext | None]] = {}  # per count: the schedules round 1 left out
    for ctx, ev in sorted(results, key=lambda r: r[1].step_s):
        pev = polish(ctx, ev)
        polished.append((ctx, pev))
        ranked += _schedule_plans(ctx, pev, allowed, topo, job, objective, max_in_flight, resolve=False,
                                  pending=left_out.setdefault(ctx.m, {}))
    best = sim.best(ranked)
    # The schedules whose memory the split's configurations exceed, re-solved for every count (a re-solve costs
    # a level-2 solve per block), the counts whose other schedules score best first.
    order = sorted(range(len(polished)), key=lambda i: sim.by_count.get(polished[i][0].m, math.inf))
    extra: list[_Candidate] = []
    for i in order:
        ctx, pev = polished[i]
        have = {p.schedule for _, p, _ in ranked if p.micro_batches == ctx.m}
        extra += _schedule_plans(ctx, pev, [s for s in allowed if s not in have], topo, job, objective,
                                 max_in_flight, resolve=None, pending=left_out.get(ctx.m))
    if extra:
        more = sim.best(extra if best is None else [(-math.inf, best[1], _timing_of(best[1], ranked)), *extra])
        if more is not None:
            best = more
    if level2 == "cpsat" and best is not None:
        # The chosen count's blocks solved again with CP-SAT (certify); its schedules scored again on them.
        ctx, pev = next((c, e) for c, e in polished if c.m == best[1].micro_batches)
        cev = certify(ctx, pev)
        polished = [(ctx, cev)]
        if not cev.feasible:
            raise _memory_error(ctx, cev)
        sim.spent = 0
        best = sim.best(_schedule_plans(ctx, cev, allowed, topo, job, objective, max_in_flight,
                                        resolve=solve_block_cached))
    if best is None:  # only when the pinned schedules exclude every memory-feasible one
        raise UnschedulableError(
            f"no schedule among {', '.join(s.value for s in allowed)} fits memory on this chain",
            constraint="memory",
        )
    results = polished
    _, plan, sim_step = best
    ctx, ev = next((c, e) for c, e in results if c.m == plan.micro_batches)
    crossings = dp_crossing(ctx, ev, topo)
    gain = max((d.gain_s for d in crossings), default=-math.inf)
    plan = evaluate_on_timeline(plan, topo, job, step_s=sim_step, evaluated=True)  # a candidate: evaluated
    extras = dict(plan.extras)
    extras.update(
        micro_batch_size=float(job.global_batch // plan.micro_batches),
        dp_cross_gain_s=gain if math.isfinite(gain) else 0.0,
        plan_seconds=time.perf_counter() - t0,
    )
    plan = replace(plan, extras=extras)
    log.debug(
        "tpa.plan", job=job.id, chain=[c.name for c in clusters], m=plan.micro_batches,
        schedule=str(plan.schedule), stages=len(plan.stages), step_s=plan.step_time_s,
        closed_form_step_s=extras["closed_form_step_s"], seconds=extras["plan_seconds"],
    )
    return plan
