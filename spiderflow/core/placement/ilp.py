r"""``ilp``: one global CP-SAT model for cross-cluster placement (the "ILP-based" baseline).

The model chooses jointly which clusters run the job, their order in the pipeline chain, the layer
split over the chain and each chosen cluster's degrees — tensor-parallel ``t``, data-parallel ``d`` and
pipeline depth ``p`` inside the cluster — and minimises the closed-form step time of
:mod:`spiderflow.core.costmodel` (1F1B, ``m = global_batch / micro_batch`` micro-batches). A chosen cluster
``c`` runs one contiguous *block* of ``n_c`` layers as ``p`` consecutive stages of ``t·d`` GPUs each, its
layers split evenly (the first ``n_c mod p`` stages take ``⌈n_c/p⌉`` layers, the others ``⌊n_c/p⌋``).
The plan it returns is re-evaluated with :func:`spiderflow.core.costmodel.evaluate` so it is scored exactly
like every other policy.

Symbols (``C`` clusters, ``L`` layers, ``O_c`` the degree options of cluster ``c``)
-----------------------------------------------------------------------------
Constants, all times integerised in ticks of ``τ`` seconds (``τ = min(1 µs, greedy step / 10⁷)``):

- ``O_c = {(t, d, p)}`` (:func:`degree_options`): ``t`` ∈ :func:`tp_options`, ``1 ≤ p ≤``
  :data:`MAX_PP_PER_CLUSTER`, ``t·d·p ≤ min(n_c, gpus.max)`` (``n_c`` free GPUs);
- everything in the job's precision, as the cost model prices it: ``F_c`` the rate in that precision
  (:func:`~spiderflow.core.costmodel.compute_rate_tflops`), ``A`` its value bytes (``A_u`` in the sending
  cluster's wire format, :func:`~spiderflow.core.costmodel.wire_bytes`), ``w`` bytes of state per parameter
  (16 in bf16/fp16, 20 in fp32/tf32) and ``g`` bytes per gradient value (2 or 4);
- ``α_ct`` ticks per layer of one micro-batch (3·f/(t·F_c) + 4·AR_t(A, B_tp) + o_c, ``o_c`` the cluster's
  calibrated fixed time per layer, ``layer_overhead_ms``, 0 unless calibrated), ``β_ct`` head ticks (its FLOPs,
  or the head's measured time where a profile measured it, :func:`~spiderflow.core.costmodel.measured_outer_time`);
- ``υ_c`` ticks per layer of the optimizer step (``optimizer_ms_per_layer``, 0 unless calibrated), after the
  drain with the stage's gradient all-reduce, as :func:`~spiderflow.core.costmodel.breakdown` prices it;
- the rest of the work outside the blocks that a profile measured on ``c`` (0 where not, as in
  :func:`~spiderflow.core.costmodel.measured_outer_time` and :func:`~spiderflow.core.costmodel.measured_step_extra`):
  ``η_c`` the embedding's ticks per micro-batch (on the chain's first stage, not divided by ``t``), ``ω_c`` the
  first stage's ticks per step (the embedding's optimizer step) plus ``δ_c`` per sample of its input pipeline
  (``δ_c·b·⌈m/d⌉`` for option ``o``: ``ω_co``), ``ω'_c`` the last stage's (the head's optimizer step);
- ``P_uv`` = ``A_u / b_uv + l_uv`` from the widest-path matrices (arc ``u → v`` absent when unreachable);
  ``I_c = A_c / B_inter(c)`` between two stages inside ``c``;
- ``γ_co`` ticks per parameter of the gradient all-reduce of option ``o`` (2(d−1)/d · g /(t·B_dp));
- memory coefficients in bytes, rounded up: ``μ_t = w·P_layer/t`` per layer, ``ε_t = w·V·h/t`` per
  embedding/head, ``a_t`` activation bytes per layer and micro-batch, ``g_t`` the loss of the last stage, which
  holds one micro-batch under 1F1B (:func:`~spiderflow.core.costmodel.loss_bytes`: ``(4 + 14)·b·s·V/t``); the cap
  ``M_c − R``.

Variables:

- ``u_c ∈ {0,1}`` cluster used; ``x_co ∈ {0,1}`` option chosen (``p_c = Σ_o p_o x_co``); ``n_c ∈ [0, L]``
  layers of ``c``; ``hi_c = ⌈n_c/p_c⌉``, ``lo_c = ⌊n_c/p_c⌋``;
- arc literals of one circuit over ``{depot} ∪ clusters``: ``first_c`` (depot → c), ``last_c``
  (c → depot), ``a_uv`` (u → v), self-loop ``¬u_c``;
- ``r_c`` stages from ``c``'s first stage to the end of the pipeline, ``e_c = r_c − p_c + u_c`` the same for
  ``c``'s last stage; ``q_c = Σ_o ⌈m/d_o⌉·x_co``; 1F1B in-flight micro-batches ``k_c = min(q_c, r_c)``
  (first stage of the block) and ``k'_c = min(q_c, e_c)`` (last stage); ``kh_c = k_c·hi_c``,
  ``kl_c = k'_c·lo_c``;
- ``T_c`` Σ of the block's stage times, ``Z`` pipeline bottleneck, ``Y`` slowest gradient all-reduce with the
  stage's optimizer step (calibrated) and measured per-step work (ticks).

Constraints (numbered as in the code):

1. ``Σ_o x_co = u_c``                                      (a used cluster picks exactly one (t, d, p));
2. ``p_c ≤ n_c ≤ L·u_c``, ``u_c ≤ n_c``; ``Σ_c n_c = L``;   ``x_co ⇒ p·lo_c ≤ n_c ≤ p·lo_c + p − 1`` and
   ``p·hi_c − p + 1 ≤ n_c ≤ p·hi_c``                         (every layer placed; even split in the block);
3. ``gpus.min ≤ Σ_{c,o} t_o d_o p_o x_co ≤ gpus.max``        (GPU range; ``t·d·p ≤ n_c`` by construction);
4. AddCircuit over the arcs: the used clusters form one path depot → … → depot (the chain);
5. ``last_c ⇒ r_c = p_c``; ``a_uv ⇒ r_u = r_v + p_u``; ``¬u_c ⇒ r_c = 0``;
6. ``k_c = min(q_c, r_c)``, ``k'_c = min(q_c, e_c)``; ``kh_c = k_c·hi_c``, ``kl_c = k'_c·lo_c``;
7. ``x_co ⇒ T_c ≥ α_ct n_c + β_ct last_c + η_c first_c``, ``d·Z ≥ α_ct hi_c + η_c first_c``,
   ``d·Z ≥ α_ct lo_c + β_ct last_c`` (for ``p = 1``: ``d·Z ≥ α_ct n_c + β_ct last_c + η_c first_c``)
   (block compute; slowest stage per replica; the head rides on the block's last, ``⌊·⌋``-sized, stage, the
   measured embedding on its first);
8. ``Z ≥ P_uv · a_uv``; ``x_co ∧ p_o > 1 ⇒ Z ≥ I_c``          (boundary transfers in the bottleneck);
9. ``x_co ⇒ Y ≥ γ_co (12h²·hi_c + Vh·first_c) + υ_c hi_c + ω_co first_c`` and
   ``Y ≥ γ_co (12h²·lo_c + Vh·last_c) + υ_c lo_c + ω'_c last_c`` (for ``p = 1`` one stage:
   ``Y ≥ γ_co (12h²·n_c + Vh·(first_c + last_c)) + υ_c n_c + ω_co first_c + ω'_c last_c``);
10. memory per GPU, first and last stage of the block (the middle ones are dominated by the first):
    ``x_co ⇒ μ_t hi_c + ε_t first_c + a_t kh_c ≤ M_c − R`` and
    ``μ_t lo_c + ε_t last_c + a_t kl_c + g_t last_c ≤ M_c − R``
    (for ``p = 1``: ``μ_t n_c + ε_t (first_c + last_c) + a_t kh_c + g_t last_c ≤ M_c − R``);
11. symmetry: among clusters identical in every attribute and link, ``u_c ≥ u_{c'}`` for ``c < c'``.

Objective:  ``min (m − 1)·Z + Σ_c T_c + 2·Σ_uv P_uv a_uv + 2·Σ_c I_c·Σ_o (p_o − 1) x_co + Y``
(= ``T_pipe + T_dp`` of :mod:`spiderflow.core.costmodel` for the decoded plan, up to tick rounding).

The solver is seeded with a hint on every decision variable (``u``, ``x``, ``n``, arcs, ``first``,
``last``, ``r``) from a greedy construction (clusters by free compute, chain by nearest widest link,
layers proportional to compute but water-filled against memory, one pipeline depth for all blocks tried
from {1, 2, 4, 8}, the smallest tp that holds the block), as a competent CP-SAT user would; the hint is
first completed to every variable by one solve with the hinted variables fixed (at least
:data:`HINT_COMPLETION_MIN_S`). A plan of another policy (``hint``) that beats the greedy one is hinted
whole when it lies in the model's space — the model is then built at that plan's micro-batch size, since a
planner may choose smaller micro-batches than the job's and their activation memory differs — else by its
structure (clusters, order, layers per cluster), else dropped for the greedy hint (``stats["hint_in_model"]``:
4 whole, 2 structure and layers, 1 structure, 3 the greedy hint, 0 none). With a complete hint CP-SAT's
presolve is off: it hands the hint to the search only after presolve, which can outlast the limit. The
answer is never worse than a hint that entered the model (``from_hint`` 2: the other policy's plan is
returned, the model pricing its structure with even splits and 1F1B). When CP-SAT ends without
a solution, or with one worse than the warm start, the greedy plan (a solution of the same model) is
returned and ``stats["from_hint"] = 1``.
``optimal=True`` only when CP-SAT reports OPTIMAL for this model.

The answer is then finished as greedy's and bace's are (with the default in-process planner; ``planner=None``
returns the model's plan on its closed form): the model's plan, its allocation re-planned by the planner
(micro-batch count, schedule and stages chosen on the exact timeline, :func:`~spiderflow.core.placement.common.
finalise`) and the hint policies' best plan are compared on the exact timeline, the one prediction every
policy is compared on, and the fastest is returned (``stats["finish"]`` 0 / 1 / 2, ``finish_s``). The model
prices one schedule at one micro-batch count; on plans across regions its closed form and the timeline differ
most, and this step keeps that from counting against the baseline. Bound and gap stay the model's.

Size: ``O(C² + Σ_c |O_c|)`` Booleans (``|O_c| ≈ 2·H_8·min(n_c, gpus.max)``), as many constraints; solving
is NP-hard (it contains a Hamiltonian-path problem), hence the time limit.

``PlacementResult.stats`` keys: ``cp_status`` (CpSolverStatus value: 4 OPTIMAL, 2 FEASIBLE, 3 INFEASIBLE,
0 UNKNOWN, 1 MODEL_INVALID), ``objective_s`` and ``bound_s`` (model objective and best bound in seconds),
``wall_s`` (solver wall time), ``build_s`` (greedy, model, hint completion), ``hint_step_s`` (greedy plan's
step time, ``inf`` if none), ``from_hint``, ``booleans``, ``conflicts``, ``branches``, ``workers``, ``finish``
and ``finish_s`` (above).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import structlog
from ortools.sat.python import cp_model

from spiderflow.core.costmodel import (
    GIB,
    RESERVED_GIB,
    activation_bytes,
    allreduce_time,
    compute_rate_tflops,
    evaluate,
    fits_memory,
    grad_bytes_per_value,
    layer_fwd_flops,
    loss_bytes,
    measured_outer_time,
    state_bytes_per_param,
    transfer_time,
    wire_bytes,
)
from spiderflow.core.domain import Cluster, JobSpec, Plan, Schedule, Stage, Topology
from spiderflow.core.placement.base import Budget, PlacementResult, PlacementStatus, Planner, register_policy
from spiderflow.core.placement.common import LOCAL_PLANNER, chain_allocation, check_plan, diagnose, finalise

__all__ = [
    "BASELINE_HINTS",
    "DEFAULT_HINT",
    "DEFAULT_TIME_LIMIT_S",
    "DEFAULT_WORKERS",
    "HINT_COMPLETION_MIN_S",
    "MAX_PP_PER_CLUSTER",
    "PRESOLVE_MAX_BOOLEANS",
    "IlpPolicy",
    "block_stages",
    "degree_options",
    "greedy_plan",
    "parse_hint",
    "tp_options",
]

DEFAULT_TIME_LIMIT_S = 60.0
#: The baselines whose best plan hints the ILP by default (each is fast; ``genetic`` may be named).
BASELINE_HINTS = ("firstfit", "bace", "greedy")
DEFAULT_HINT = "baselines"


def parse_hint(hint: str) -> tuple[str, ...]:
    """Policies named by a ``hint`` option: ``own`` (only the greedy construction below), ``baselines``
    (:data:`BASELINE_HINTS`), or comma-separated registered policy names (``spinsearch`` gives the
    upper reference). ``ValidationError`` on ``hint`` for an unknown or ILP name."""
    from spiderflow.core.errors import ValidationError
    from spiderflow.core.placement import load_builtin_policies
    from spiderflow.core.placement.base import REGISTRY

    if hint == "own":
        return ()
    names = BASELINE_HINTS if hint == "baselines" else tuple(n.strip() for n in hint.split(",") if n.strip())
    if not names:
        raise ValidationError("hint", "name at least one policy, 'baselines' or 'own'", hint)
    load_builtin_policies()
    for n in names:
        if n.startswith("ilp") or n == "bruteforce":
            raise ValidationError("hint", f"{n!r} cannot hint the ILP", hint)
        if n not in REGISTRY:
            raise ValidationError("hint", f"unknown policy {n!r}; known: {', '.join(sorted(REGISTRY))}", hint)
    return names
DEFAULT_WORKERS = 2
MAX_PP_PER_CLUSTER = 8
#: Above this many Booleans CP-SAT's presolve alone outlasts typical time limits (measured: > 20 s at 32
#: clusters) while the search without it finds and improves solutions; presolve is switched off there.
PRESOLVE_MAX_BOOLEANS = 1000
#: Least time given to completing a hint to a full assignment (one CP-SAT solve with the hinted variables
#: fixed; 0.1-0.8 s measured on the paper grid's instances under load): a shorter slot drops the hint.
HINT_COMPLETION_MIN_S = 1.0

_log = structlog.get_logger(__name__)


def tp_options(cluster: Cluster, job: JobSpec) -> tuple[int, ...]:
    """Tensor-parallel degrees considered on ``cluster``: powers of two that divide the head count and
    fit in one node (``t ≤ gpus_per_node``) and in the free GPUs and ``gpus.max``."""
    cap = min(cluster.gpus_per_node, cluster.free, job.gpus.max)
    out: list[int] = []
    t = 1
    while t <= cap:
        if job.model.heads % t == 0:
            out.append(t)
        t *= 2
    return tuple(out)


def degree_options(cluster: Cluster, job: JobSpec) -> tuple[tuple[int, int, int], ...]:
    """Every ``(tp, dp, pp)`` the ILP may give ``cluster``: ``tp ∈ tp_options``, ``1 ≤ pp ≤
    min(MAX_PP_PER_CLUSTER, L)``, ``tp·dp·pp ≤ min(free, gpus.max)``."""
    cap = min(cluster.free, job.gpus.max)
    return tuple(
        (t, d, p)
        for t in tp_options(cluster, job)
        for p in range(1, min(MAX_PP_PER_CLUSTER, job.model.layers) + 1)
        for d in range(1, cap // (t * p) + 1)
    )


def block_stages(cluster: str, first_layer: int, layers: int, tp: int, dp: int, pp: int) -> list[Stage]:
    """The ``pp`` stages of one cluster block: even split, the first ``layers mod pp`` one layer larger."""
    q, r = divmod(layers, pp)
    out: list[Stage] = []
    for j in range(pp):
        size = q + (1 if j < r else 0)
        out.append(Stage(cluster=cluster, first_layer=first_layer, last_layer=first_layer + size - 1, tp=tp, dp=dp))
        first_layer += size
    return out


def _micro_batches(job: JobSpec) -> int:
    return job.micro_batches_total


def _at_micro_batches(job: JobSpec, micro_batches: int) -> JobSpec:
    """``job`` with the micro-batch size of a plan of ``micro_batches`` (``job`` itself if that is not a
    whole divisor of the global batch)."""
    if micro_batches == job.micro_batches_total or micro_batches < 1 or job.global_batch % micro_batches:
        return job
    return replace(job, micro_batch=job.global_batch // micro_batches)


def _layer_capacity(c: Cluster, job: JobSpec, t: int, d: int, rank: int, first: bool, last: bool) -> int:
    """Most layers one stage on ``c`` with degrees ``(t, d)`` holds in memory at ``rank`` (1 = last stage)."""
    mdl, b, s = job.model, job.micro_batch, job.seq_len
    k = min(math.ceil(_micro_batches(job) / d), rank)
    free = c.gpu_memory_gib * GIB - RESERVED_GIB * GIB
    w = state_bytes_per_param(job.precision)
    free -= w * mdl.embedding_params * (int(first) + int(last)) / t
    free -= loss_bytes(mdl, b, s, t, k) if last else 0.0
    per_layer = w * mdl.params_per_layer / t + k * s * b * mdl.hidden * (
        10.0 + 24.0 / t + 5.0 * mdl.heads * s / (mdl.hidden * t))
    return max(0, int(free // per_layer))


def _block_capacity(c: Cluster, job: JobSpec, t: int, d: int, p: int, rank: int, first: bool, last: bool) -> int:
    """Layers a ``p``-stage block holds when its first stage sits at ``rank`` (conservative: ``p`` × the
    smaller of its first and last stage's capacity)."""
    if p == 1:
        return _layer_capacity(c, job, t, d, rank, first, last)
    a = _layer_capacity(c, job, t, d, rank, first, False)
    z = _layer_capacity(c, job, t, d, rank - p + 1, False, last)
    return p * min(a, z)


def _capped_split(layers: int, weights: Sequence[float], caps: Sequence[int], mins: Sequence[int]) -> list[int] | None:
    """Integer split of ``layers`` ∝ ``weights`` with ``mins_i ≤ part_i ≤ caps_i`` (water-filling), or ``None``."""
    k = len(weights)
    if sum(caps) < layers or sum(mins) > layers or any(lo > hi for lo, hi in zip(mins, caps, strict=True)):
        return None
    parts = list(mins)
    total = sum(weights)
    for _ in range(layers - sum(mins)):
        room = [i for i in range(k) if parts[i] < caps[i]]
        i = max(room, key=lambda j: (weights[j] / total * layers - parts[j], -j))
        parts[i] += 1
    return parts


def greedy_plan(topo: Topology, job: JobSpec) -> Plan | None:
    """The warm start: a feasible plan (memory, free GPUs, GPU range) or ``None`` if none was built.

    For every chain length ``K`` and every block depth ``p ∈ {1, 2, 4, 8}``: the ``K`` clusters with the
    most free compute (``min(n_c, gpus.max)·F_c``) reachable from the first; chain order by repeatedly
    appending the remaining cluster with the widest link from the chain's end; GPUs handed out in compute
    order up to ``gpus.max``; layers split proportionally to compute, water-filled against what each block
    holds at its largest tp; then per block the smallest tp that still holds its layers. The best plan
    wins. O(K_max · 4 · (C·K + L·K)) time.
    """
    m = _micro_batches(job)
    L = job.model.layers
    bw = topo.bandwidth_matrix
    usable = [c for c in topo.clusters if c.free > 0 and tp_options(c, job)]
    usable.sort(key=lambda c: (-min(c.free, job.gpus.max) * compute_rate_tflops(c, job.precision), c.name))
    if not usable:
        return None
    head = usable[0]
    reach = [c for c in usable if bw[topo.index[head.name], topo.index[c.name]] > 0]
    best: Plan | None = None
    for k in range(1, min(len(reach), L, job.gpus.max) + 1):
        chosen = reach[:k]
        budget = job.gpus.max
        gpus: dict[str, int] = {}
        for c in chosen:
            gpus[c.name] = min(c.free, budget - (k - len(gpus) - 1))
            budget -= gpus[c.name]
        if any(g < 1 for g in gpus.values()) or sum(gpus.values()) < job.gpus.min:
            continue
        order = [chosen[0]]
        rest = list(chosen[1:])
        while rest:
            end = topo.index[order[-1].name]
            nxt = max(rest, key=lambda c: (bw[end, topo.index[c.name]], -topo.index[c.name]))
            order.append(nxt)
            rest.remove(nxt)
        if any(bw[topo.index[a.name], topo.index[b.name]] <= 0 for a, b in itertools.pairwise(order)):
            continue
        for p_all in (1, 2, 4, 8):
            ps = [min(p_all, gpus[c.name]) for c in order]
            ranks = [sum(ps[i:]) for i in range(k)]

            def cap(i: int, t: int, order: list[Cluster] = order, ps: list[int] = ps,
                    ranks: list[int] = ranks, gpus: dict[str, int] = gpus, k: int = k) -> int:
                c = order[i]
                d = gpus[c.name] // (t * ps[i])
                if d < 1:
                    return 0
                return _block_capacity(c, job, t, d, ps[i], ranks[i], i == 0, i == k - 1)

            tmax = [max(t for t in tp_options(c, job) if t * ps[i] <= gpus[c.name]) for i, c in enumerate(order)]
            split = _capped_split(L, [gpus[c.name] * compute_rate_tflops(c, job.precision) for c in order],
                                  [cap(i, tmax[i]) for i in range(k)], ps)
            if split is None:
                continue
            stages: list[Stage] = []
            first_layer = 0
            for i, c in enumerate(order):
                t = next((t for t in tp_options(c, job) if t <= tmax[i] and cap(i, t) >= split[i]), tmax[i])
                stages += block_stages(c.name, first_layer, split[i], t, gpus[c.name] // (t * ps[i]), ps[i])
                first_layer += split[i]
            plan = evaluate(Plan(stages=tuple(stages), micro_batches=m, schedule=Schedule.ONE_F_ONE_B), topo, job)
            if (fits_memory(plan, topo)[0] and job.gpus.min <= plan.gpus <= job.gpus.max
                    and (best is None or plan.step_time_s < best.step_time_s)):
                best = plan
    return best


@dataclass(frozen=True, slots=True, kw_only=True)
class _Coefs:
    """Integerised per-(cluster, tp) constants of the model (see the module docstring)."""

    alpha: int
    beta: int
    mem_layer: int
    mem_embed: int
    act_layer: int
    logits: int


def _cluster_signature(topo: Topology, i: int) -> tuple[object, ...]:
    c = topo.clusters[i]
    return (c.gpu, c.nodes, c.gpus_per_node, c.intra_node_gbps, c.inter_node_gbps, c.free,
            c.tflops, c.mfu, c.memory_gib, c.embedding_us_per_token, c.head_us_per_token, c.embedding_optimizer_ms,
            c.head_optimizer_ms, c.data_ms_per_sample, c.layer_overhead_ms, c.optimizer_ms_per_layer)


def _identical_pairs(topo: Topology, candidates: Sequence[int]) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of clusters interchangeable in every attribute and link figure."""
    bw, lat = topo.bandwidth_matrix, topo.latency_matrix
    pairs: list[tuple[int, int]] = []
    groups: dict[tuple[object, ...], list[int]] = {}
    for i in candidates:
        groups.setdefault(_cluster_signature(topo, i), []).append(i)
    for members in groups.values():
        for x, y in itertools.pairwise(members):
            others = [k for k in range(len(topo.clusters)) if k not in (x, y)]
            same = (
                all(bw[x, k] == bw[y, k] and bw[k, x] == bw[k, y] for k in others)
                and all(lat[x, k] == lat[y, k] and lat[k, x] == lat[k, y] for k in others)
                and bw[x, y] == bw[y, x] and lat[x, y] == lat[y, x]
            )
            if same:
                pairs.append((x, y))
    return pairs


class IlpPolicy:
    """The global CP-SAT baseline. ``workers`` CP-SAT search workers; ``default_time_limit_s`` applies
    when ``Budget.time_limit_s`` is ``None``. Objective: step time (``Budget.objective`` other than
    ``jct`` is not modelled; the plan still reports its dollars per step)."""

    name = "ilp"

    def __init__(self, *, workers: int = DEFAULT_WORKERS, default_time_limit_s: float = DEFAULT_TIME_LIMIT_S,
                 use_hint: bool = True, hint: str = DEFAULT_HINT, decomposed: bool = False,
                 planner: Planner | None = LOCAL_PLANNER) -> None:
        self.planner = planner
        self.workers = workers
        self.default_time_limit_s = default_time_limit_s
        self.use_hint = use_hint
        self.hint_policies = parse_hint(hint)
        self.hint = hint
        self.decomposed = decomposed
        if decomposed:
            self.name = "ilp-decomposed"

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget if budget is not None else Budget()
        t0 = time.perf_counter()
        res = self._place(topo, job, budget, t0)
        res = replace(res, planning_seconds=time.perf_counter() - t0)  # hint policies' time included
        _log.info(
            "placement.ilp", job=job.id, revision=topo.revision, status=str(res.status),
            optimal=res.optimal, seconds=round(res.planning_seconds, 4),
            step_s=res.plan.step_time_s if res.plan else None, reason=res.reason or None,
        )
        return res

    # -- helpers -------------------------------------------------------------------------------------

    def _fail(self, status: PlacementStatus, reason: str, constraint: str, t0: float,
              stats: dict[str, float] | None = None) -> PlacementResult:
        return PlacementResult(status=status, policy=self.name, reason=reason, constraint=constraint,
                               planning_seconds=time.perf_counter() - t0, optimal=None, stats=stats or {})

    def _place(self, topo: Topology, job: JobSpec, budget: Budget, t0: float) -> PlacementResult:
        early = diagnose(topo, job, self.name)
        if early is not None:
            return replace(early, planning_seconds=time.perf_counter() - t0)
        limit = budget.time_limit_s if budget.time_limit_s is not None else self.default_time_limit_s
        hint = greedy_plan(topo, job) if self.use_hint else None
        th = time.perf_counter()
        foreign, source = self._foreign_hint(topo, job, budget)
        hint_s = time.perf_counter() - th
        t0 += hint_s  # the hint policies' own time is reported (``hint_s``), not taken from the solver's limit
        better = foreign is not None and (hint is None or foreign.step_time_s < hint.step_time_s)
        best = foreign if better else hint
        # The model is built at the best hint's micro-batch size (a planner may choose smaller micro-batches
        # than the job's, and their memory differs): otherwise that plan is outside the model's space.
        model_job = _at_micro_batches(job, best.micro_batches) if better and best is not None else job
        built = _Model(topo, model_job, best, symmetry=foreign is None and not self.decomposed)
        if hint is not None and best is not hint:
            built.model.clear_hints()  # type: ignore[no-untyped-call]
            built._hint(hint)
        chain = built.chain_of(best) if self.decomposed and best is not None else None
        if self.decomposed:
            if chain is None:
                return self._fail(PlacementStatus.UNSCHEDULABLE, "no searched chain to fix (no hint plan within "
                                  "this model's space)", "hint", t0)
            built.fix_chain(chain)
        build_s = time.perf_counter() - t0
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.05, limit - build_s)
        solver.parameters.num_workers = self.workers
        solver.parameters.random_seed = budget.seed
        if built.booleans > PRESOLVE_MAX_BOOLEANS:
            solver.parameters.cp_model_presolve = False
        in_model = 0.0
        if best is not None:
            # At least HINT_COMPLETION_MIN_S: a starved completion drops the hint (the decision may overrun
            # its limit by that much; the time is counted in ``build_s`` and the decision's wall time).
            slot = max(HINT_COMPLETION_MIN_S, min(5.0, (limit - build_s) / 4))
            if better and foreign is not None:
                built.model.clear_hints()  # type: ignore[no-untyped-call]
                if built.hint_plan(foreign) and built.complete_hint(slot):
                    in_model = 4.0
                else:
                    for layers in (True, False):
                        if built.hint_structure(foreign, layers=layers) and built.complete_hint(slot):
                            in_model = 2.0 if layers else 1.0
                            break
                if not in_model:
                    built.model.clear_hints()  # type: ignore[no-untyped-call]
                    if hint is not None:
                        built._hint(hint)
            if not in_model and hint is not None:
                in_model = 3.0 if built.complete_hint(slot) else 0.0
            build_s = time.perf_counter() - t0
            solver.parameters.max_time_in_seconds = max(0.05, limit - build_s)
            if in_model and not self.decomposed:
                # CP-SAT hands a complete hint to its search only after presolve, which on these models can
                # outlast the limit (measured: no solution within 3 s from a complete feasible hint).
                solver.parameters.cp_model_presolve = False
        status = solver.solve(built.model)
        stats: dict[str, float] = {
            "cp_status": float(int(status)),
            "wall_s": solver.wall_time,
            "build_s": build_s,
            "hint_step_s": best.step_time_s if best is not None else math.inf,
            "own_hint_step_s": hint.step_time_s if hint is not None else math.inf,
            "hint_source": source if better else -1.0,
            "hint_in_model": in_model,
            "decomposed": 1.0 if self.decomposed else 0.0,
            "hint_s": hint_s,
            "from_hint": 0.0,
            "booleans": float(built.booleans),
            "conflicts": float(solver.num_conflicts),
            "branches": float(solver.num_branches),
            "workers": float(self.workers),
        }
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            stats["objective_s"] = solver.objective_value * built.tick
            stats["bound_s"] = solver.best_objective_bound * built.tick
            obj = stats["objective_s"]
            stats["gap"] = max(0.0, (obj - stats["bound_s"]) / obj) if obj > 0 else 0.0
            plan = evaluate(built.decode(solver), topo, job)
            if status == cp_model.FEASIBLE and hint is not None and hint.step_time_s < plan.step_time_s:
                # The warm start is a solution of the model too; CP-SAT's workers may lose it.
                plan = hint
                stats["from_hint"] = 1.0
            if in_model in (1.0, 2.0, 4.0) and better and foreign is not None \
                    and foreign.step_time_s < plan.step_time_s:
                # A warm-started solver never returns worse than its start: the hint entered the model,
                # but the model prices it with even splits per block and 1F1B, coarser than its source.
                plan = foreign
                stats["from_hint"] = 2.0
            broken = check_plan(plan, topo, job)
            if broken:  # cannot happen (coefficients round towards safety); never hand out an invalid plan
                return self._fail(PlacementStatus.ERROR, "; ".join(broken), "model", t0, stats)
            plan = self._finish(topo, job, budget, plan, foreign, stats)
            return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=plan,
                                   planning_seconds=time.perf_counter() - t0,
                                   optimal=status == cp_model.OPTIMAL, stats=stats)
        if status == cp_model.UNKNOWN:
            # No solution within the limit: the best warm start that is a solution of the model (another
            # policy's plan that entered it whole or by structure), else the greedy construction.
            entered = foreign if in_model in (1.0, 2.0, 4.0) and better else None
            fallback = entered if entered is not None else hint
            if fallback is not None:
                stats["from_hint"] = 2.0 if fallback is entered else 1.0
                fallback = self._finish(topo, job, budget, fallback, foreign, stats)
                return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=fallback,
                                       planning_seconds=time.perf_counter() - t0, optimal=False, stats=stats)
        if status == cp_model.INFEASIBLE and self.decomposed and best is not None:
            # The chain fixed from ``best`` admits no plan of the model (which lacks what ``best``'s planner may
            # use: recomputation, FSDP, uneven sub-stages): the answer is ``best`` itself, the search's plan of
            # that chain, finished as every answer is.
            stats["from_hint"] = 2.0 if better else 1.0
            stats["chain_infeasible"] = 1.0
            answer = self._finish(topo, job, budget, best, foreign, stats)
            return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=answer,
                                   planning_seconds=time.perf_counter() - t0, optimal=False, stats=stats)
        if status == cp_model.INFEASIBLE:
            return self._infeasible(topo, job, t0, stats, limit)
        return self._fail(PlacementStatus.UNSCHEDULABLE if status == cp_model.UNKNOWN else PlacementStatus.ERROR,
                          f"CP-SAT ended with {solver.status_name(status)} and no plan within {limit:g} s",
                          "time_limit", t0, stats)

    def _finish(self, topo: Topology, job: JobSpec, budget: Budget, plan: Plan, foreign: Plan | None,
                stats: dict[str, float]) -> Plan:
        """The answer, compared as every policy's is: on the exact timeline. The model prices one schedule
        (1F1B) at one micro-batch count with even splits per block; the fastest on the timeline of ``plan``,
        ``plan``'s allocation re-planned by the planner (micro-batch count, schedule and stages on the
        timeline: the step greedy's and bace's answers end with, :func:`finalise`), and the best plan of the
        hint policies is returned. ``stats["finish"]``: 0 the model's plan, 1 the
        re-planned allocation, 2 the hint plan; ``finish_s`` the time this took (part of the decision's).
        Without a planner (``planner=None``): ``plan`` as the model answered it, on the closed form."""
        from spiderflow.core.errors import SpiderFlowError
        from spiderflow.core.tpa.timeline import evaluate_on_timeline

        t = time.perf_counter()
        if self.planner is None:
            stats["finish"], stats["finish_s"] = 0.0, 0.0
            return plan
        candidates: list[tuple[float, Plan]] = [(0.0, plan)]
        alloc = chain_allocation(plan)
        if alloc:
            fin = finalise(topo, job, [alloc], objective=budget.objective, planner=self.planner)
            if fin.plan is not None:
                candidates.append((1.0, fin.plan))
        if foreign is not None and foreign is not plan:
            candidates.append((2.0, foreign))
        best: tuple[float, float, Plan] | None = None
        for source, cand in candidates:
            try:
                timed = evaluate_on_timeline(cand, topo, job)
            except (SpiderFlowError, ValueError):
                continue
            if (source == 0.0 or not check_plan(timed, topo, job)) \
                    and (best is None or timed.step_time_s < best[1]):
                best = (source, timed.step_time_s, timed)
        stats["finish_s"] = time.perf_counter() - t
        if best is None:  # the model's plan runs on no timeline (cannot happen for a valid plan): as decoded
            stats["finish"] = 0.0
            return plan
        stats["finish"] = best[0]
        return best[2]

    def _foreign_hint(self, topo: Topology, job: JobSpec, budget: Budget) -> tuple[Plan | None, float]:
        """The best (least closed-form step time) valid plan of the hint policies and its index in
        :attr:`hint_policies` (``(None, -1)`` when none places the job)."""
        from spiderflow.core.placement.base import get_policy

        best: Plan | None = None
        source = -1.0
        sub = Budget(seed=budget.seed, objective=budget.objective)
        for k, name in enumerate(self.hint_policies):
            res = get_policy(name).place(topo, job, sub)
            if not res.ok or res.plan is None:
                continue
            plan = evaluate(res.plan, topo, job)  # on the closed form the model optimises (TPA reports the timeline)
            if not check_plan(plan, topo, job) and (best is None or plan.step_time_s < best.step_time_s):
                best, source = plan, float(k)
        return best, source

    def _infeasible(self, topo: Topology, job: JobSpec, t0: float, stats: dict[str, float],
                    limit: float) -> PlacementResult:
        """Name the binding constraint: memory even with every GPU free (unresolvable), else free GPUs."""
        everything = topo.with_free({c.name: c.total_gpus for c in topo.clusters})
        biggest = max(c.gpu_memory_gib for c in topo.clusters)
        if everything.total_free_gpus != topo.total_free_gpus:
            relaxed = _Model(everything, job, None)
            solver = cp_model.CpSolver()
            solver.parameters.max_time_in_seconds = max(1.0, limit - (time.perf_counter() - t0))
            solver.parameters.num_workers = self.workers
            st = solver.solve(relaxed.model)
            if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                return self._fail(
                    PlacementStatus.UNSCHEDULABLE,
                    f"no chain of free GPUs (≤ {job.gpus.max}) holds {job.model.name} in GPU memory; it would fit "
                    "if more GPUs were free", "memory", t0, stats)
            if st != cp_model.INFEASIBLE:  # undecided within the limit: do not claim it can never fit
                return self._fail(
                    PlacementStatus.UNSCHEDULABLE,
                    f"no chain of free GPUs (≤ {job.gpus.max}) holds {job.model.name} in GPU memory",
                    "memory", t0, stats)
        return self._fail(
            PlacementStatus.UNRESOLVABLE,
            f"{job.model.name} does not fit GPU memory (largest {biggest:g} GiB per GPU) on at most "
            f"{job.gpus.max} GPUs of this topology with tp ≤ GPUs per node", "memory", t0, stats)


class _Model:
    """The CP-SAT model of the module docstring, built for one (topology, job, hint)."""

    def __init__(self, topo: Topology, job: JobSpec, hint: Plan | None, *, symmetry: bool = True) -> None:
        self.topo, self.job = topo, job
        model = cp_model.CpModel()
        self.model = model
        mdl = job.model
        L = mdl.layers
        m = _micro_batches(job)
        b = max(1, job.global_batch // m)
        s = job.seq_len
        # Tick size: fine enough that rounding is negligible next to any step time of interest.
        ref = hint.step_time_s if hint is not None and math.isfinite(hint.step_time_s) else 1.0
        self.tick = tick = min(1e-6, ref / 1e7)

        def ticks(seconds: float) -> int:
            return round(seconds / tick)

        cand = [i for i, c in enumerate(topo.clusters) if c.free > 0 and tp_options(c, job)]
        self.cand = cand
        R = max(1, min(L, job.gpus.max))  # most stages a pipeline can have
        A = activation_bytes(mdl, b, s, job.precision.value_bytes)  # the TP all-reduce's message

        def sent(i: int) -> float:  # one activation leaving cluster i, in its wire format
            return activation_bytes(mdl, b, s, wire_bytes(topo.clusters[i], job.precision))

        f = layer_fwd_flops(mdl, b, s)
        head = 2.0 * b * s * mdl.hidden * mdl.vocab
        p_layer = float(mdl.params_per_layer)
        emb = float(mdl.embedding_params)
        bwm, latm = topo.bandwidth_matrix, topo.latency_matrix
        ptick: dict[tuple[int, int], int] = {
            (i, j): ticks(transfer_time(sent(i), float(bwm[i, j]), float(latm[i, j])))
            for i in cand for j in cand if i != j and bwm[i, j] > 0
        }
        itick = {i: ticks(transfer_time(sent(i), topo.clusters[i].inter_node_gbps, 0.0)) for i in cand}
        t_hi = 1
        for i in cand:
            c = topo.clusters[i]
            t_hi = max(t_hi, ticks(3.0 * (L * f + head) / (compute_rate_tflops(c, job.precision) * 1e12)
                                   + 4 * L * allreduce_time(A, c.gpus_per_node, c.inter_node_gbps)
                                   + measured_outer_time(mdl, c, 0, L - 1, b, s)
                                   + L * c.layer_overhead_ms / 1e3) + 1)
        z_hi = max(t_hi, max(ptick.values(), default=0), max(itick.values(), default=0), 1)
        z = model.new_int_var(0, z_hi, "Z")
        y = model.new_int_var(0, 1 << 50, "Y")

        self.u: dict[int, cp_model.IntVar] = {}
        self.n: dict[int, cp_model.IntVar] = {}
        self.first: dict[int, cp_model.IntVar] = {}
        self.last: dict[int, cp_model.IntVar] = {}
        self.r: dict[int, cp_model.IntVar] = {}
        self.x: dict[int, list[tuple[int, int, int, cp_model.IntVar]]] = {}
        self.arc: dict[tuple[int, int], cp_model.IntVar] = {}
        gpu_terms: list[cp_model.LinearExpr] = []
        obj_terms: list[cp_model.LinearExpr] = []
        for i in cand:
            c = topo.clusters[i]
            u = self.u[i] = model.new_bool_var(f"u{i}")
            n = self.n[i] = model.new_int_var(0, L, f"n{i}")
            first = self.first[i] = model.new_bool_var(f"first{i}")
            last = self.last[i] = model.new_bool_var(f"last{i}")
            r = self.r[i] = model.new_int_var(0, R, f"r{i}")
            hi = model.new_int_var(0, L, f"hi{i}")
            lo = model.new_int_var(0, L, f"lo{i}")
            tblk = model.new_int_var(0, t_hi, f"T{i}")
            obj_terms.append(tblk)
            xs = [(t, d, p, model.new_bool_var(f"x{i}_{t}_{d}_{p}")) for t, d, p in degree_options(c, job)]
            self.x[i] = xs
            pc = sum(p * v for _, _, p, v in xs)
            # (1) one option per used cluster
            model.add(sum(v for *_, v in xs) == u)
            # (2) layers: at least one per stage of the block, none on unused clusters
            model.add(n >= u)
            model.add(n >= pc)
            model.add(n <= L * u)
            model.add(hi <= L * u)
            model.add(lo <= L * u)
            # (3) GPU range (collected)
            gpu_terms.extend(t * d * p * v for t, d, p, v in xs)
            # (6) in-flight micro-batches of the block's first and last stage
            q = model.new_int_var(0, m, f"q{i}")
            model.add(q == sum(math.ceil(m / d) * v for _, d, _, v in xs))
            e = model.new_int_var(0, R, f"e{i}")
            model.add(e == r - pc + u)
            kf = model.new_int_var(0, min(R, m), f"k{i}")
            kl = model.new_int_var(0, min(R, m), f"kl{i}")
            model.add_min_equality(kf, [q, r])
            model.add_min_equality(kl, [q, e])
            kh = model.new_int_var(0, min(R, m) * L, f"kh{i}")
            klo = model.new_int_var(0, min(R, m) * L, f"klo{i}")
            model.add_multiplication_equality(kh, [kf, hi])
            model.add_multiplication_equality(klo, [kl, lo])
            coefs = {t: self._coefs(c, t, job, b, f, head, A, ticks) for t in tp_options(c, job)}
            cap = math.floor(c.gpu_memory_gib * GIB) - math.ceil(RESERVED_GIB * GIB)
            # the embedding and the per-step work a profile measured (0 where not: the constraints unchanged)
            eta_e = ticks(c.embedding_us_per_token * b * s / 1e6) if c.embedding_us_per_token else 0
            opt_head = ticks(c.head_optimizer_ms / 1e3)
            opt_layer = ticks(c.optimizer_ms_per_layer / 1e3)  # υ_c: the calibrated optimizer step per layer
            for t, d, p, v in xs:
                co = coefs[t]
                # (2) even split inside the block
                model.add(p * lo <= n).only_enforce_if(v)
                model.add(n <= p * lo + p - 1).only_enforce_if(v)
                model.add(p * hi >= n).only_enforce_if(v)
                model.add(p * hi <= n + p - 1).only_enforce_if(v)
                # (7) block compute and its slowest stage per replica
                if eta_e:
                    model.add(tblk >= co.alpha * n + co.beta * last + eta_e * first).only_enforce_if(v)
                    model.add(d * z >= co.alpha * hi + eta_e * first).only_enforce_if(v)
                    if p == 1:  # one stage holds the embedding and the head (hi = lo = n)
                        model.add(d * z >= co.alpha * n + co.beta * last + eta_e * first).only_enforce_if(v)
                else:
                    model.add(tblk >= co.alpha * n + co.beta * last).only_enforce_if(v)
                    model.add(d * z >= co.alpha * hi).only_enforce_if(v)
                model.add(d * z >= co.alpha * lo + co.beta * last).only_enforce_if(v)
                # (8) boundaries inside the block
                if p > 1:
                    model.add(z >= itick[i]).only_enforce_if(v)
                    obj_terms.append(2 * itick[i] * (p - 1) * v)
                # (9) gradient all-reduce (ticks per parameter × parameters of the stage)
                bdp = c.intra_node_gbps if t * d <= c.gpus_per_node else c.inter_node_gbps
                per_param = allreduce_time(grad_bytes_per_value(job.precision) / t, d, bdp) / tick
                # per layer: its gradients' share and the calibrated optimizer step (costmodel.breakdown)
                gl, ge = math.ceil(per_param * p_layer) + opt_layer, math.ceil(per_param * emb)
                # with the stage's measured per-step work (costmodel.measured_step_extra)
                opt_first = ticks(c.embedding_optimizer_ms / 1e3 + c.data_ms_per_sample * b * math.ceil(m / d) / 1e3)
                if opt_first or opt_head:
                    if p == 1:
                        model.add(y >= gl * n + ge * (first + last) + opt_first * first
                                  + opt_head * last).only_enforce_if(v)
                    else:
                        model.add(y >= gl * hi + ge * first + opt_first * first).only_enforce_if(v)
                        model.add(y >= gl * lo + ge * last + opt_head * last).only_enforce_if(v)
                elif (per_param > 0 or opt_layer) and p == 1:
                    model.add(y >= gl * n + ge * (first + last)).only_enforce_if(v)
                elif per_param > 0 or opt_layer:
                    model.add(y >= gl * hi + ge * first).only_enforce_if(v)
                    model.add(y >= gl * lo + ge * last).only_enforce_if(v)
                # (10) memory per GPU of the block's first and last stage
                if p == 1:
                    model.add(co.mem_layer * n + co.mem_embed * (first + last) + co.act_layer * kh
                              + co.logits * last <= cap).only_enforce_if(v)
                else:
                    model.add(co.mem_layer * hi + co.mem_embed * first + co.act_layer * kh <= cap).only_enforce_if(v)
                    model.add(co.mem_layer * lo + co.mem_embed * last + co.act_layer * klo
                              + co.logits * last <= cap).only_enforce_if(v)
        # (2) all layers placed
        model.add(sum(self.n.values()) == L)
        # (3) GPU range
        model.add(sum(gpu_terms) >= job.gpus.min)
        model.add(sum(gpu_terms) <= job.gpus.max)
        # (4) one path through the used clusters: node 0 is the depot, cluster i is node pos+1
        node = {i: k + 1 for k, i in enumerate(cand)}
        circuit: list[tuple[int, int, cp_model.LiteralT]] = []
        for i in cand:
            u, r = self.u[i], self.r[i]
            pc = sum(p * v for _, _, p, v in self.x[i])
            circuit.append((0, node[i], self.first[i]))
            circuit.append((node[i], 0, self.last[i]))
            circuit.append((node[i], node[i], ~u))
            # (5) ranks
            model.add(r == pc).only_enforce_if(self.last[i])
            model.add(r == 0).only_enforce_if(~u)
            for j in cand:
                if (i, j) not in ptick:
                    continue
                a = self.arc[(i, j)] = model.new_bool_var(f"a{i}_{j}")
                circuit.append((node[i], node[j], a))
                model.add(r == self.r[j] + pc).only_enforce_if(a)
                # (8) boundary in the bottleneck and on the critical path
                if ptick[(i, j)] > 0:
                    model.add(z >= ptick[(i, j)]).only_enforce_if(a)
                    obj_terms.append(2 * ptick[(i, j)] * a)
        model.add_circuit(circuit)
        # (11) symmetry breaking between interchangeable clusters
        for i, j in _identical_pairs(topo, cand) if symmetry else ():
            model.add(self.u[i] >= self.u[j])
        self.booleans = sum(len(v) for v in self.x.values()) + len(self.arc) + 3 * len(cand)
        # Objective: (m − 1)·Z + Σ T + 2·Σ P·a + 2·Σ I·(p − 1) + Y
        model.minimize((m - 1) * z + sum(obj_terms) + y)
        if hint is not None:
            self._hint(hint)

    @staticmethod
    def _coefs(c: Cluster, t: int, job: JobSpec, b: int, f: float, head: float, A: float,
               ticks: Callable[[float], int]) -> _Coefs:
        mdl, s = job.model, job.seq_len
        F = compute_rate_tflops(c, job.precision) * 1e12
        w = state_bytes_per_param(job.precision)
        btp = c.intra_node_gbps if t <= c.gpus_per_node else c.inter_node_gbps
        return _Coefs(
            # per layer: compute, the TP all-reduces and the calibrated fixed time (costmodel.stage_compute_time)
            alpha=ticks(3.0 * f / (t * F) + 4 * allreduce_time(A, t, btp) + c.layer_overhead_ms / 1e3),
            # the head and its loss: measured where a profile did (replicated under TP), else their FLOPs
            beta=ticks(c.head_us_per_token * b * s / 1e6 if c.head_us_per_token else 3.0 * head / (t * F)),
            mem_layer=math.ceil(w * mdl.params_per_layer / t),
            mem_embed=math.ceil(w * mdl.embedding_params / t),
            act_layer=math.ceil(s * b * mdl.hidden * (10.0 + 24.0 / t + 5.0 * mdl.heads * s / (mdl.hidden * t))),
            logits=math.ceil(loss_bytes(mdl, b, s, t, 1)),  # the last stage of a 1F1B chain holds one
        )

    def _hint(self, plan: Plan) -> None:
        """Hint the greedy plan on the decision variables (used clusters, options, layers, arcs, ranks)."""
        idx = self.topo.index
        blocks: list[tuple[int, int, int, int, int]] = []  # (cluster, layers, tp, dp, pp)
        for st in plan.stages:
            ci = idx[st.cluster]
            if blocks and blocks[-1][0] == ci:
                c0, nl, t, d, p = blocks[-1]
                blocks[-1] = (c0, nl + st.layers, t, d, p + 1)
            else:
                blocks.append((ci, st.layers, st.tp, st.dp, 1))
        if len({blk[0] for blk in blocks}) != len(blocks):
            return  # a cluster visited twice is outside this model's space
        model = self.model
        pos = {blk[0]: k for k, blk in enumerate(blocks)}
        rank = [sum(blk[4] for blk in blocks[k:]) for k in range(len(blocks))]
        for i in self.cand:
            k = pos.get(i)
            blk = blocks[k] if k is not None else None
            model.add_hint(self.u[i], blk is not None)
            model.add_hint(self.n[i], blk[1] if blk else 0)
            model.add_hint(self.first[i], k == 0)
            model.add_hint(self.last[i], k == len(blocks) - 1)
            model.add_hint(self.r[i], rank[k] if k is not None else 0)
            for t, d, p, v in self.x[i]:
                model.add_hint(v, blk is not None and (blk[2], blk[3], blk[4]) == (t, d, p))
        on = {(a[0], b[0]) for a, b in itertools.pairwise(blocks)}
        for key, a in self.arc.items():
            model.add_hint(a, key in on)

    def chain_of(self, plan: Plan) -> list[int] | None:
        """The plan's clusters in pipeline order (indices), ``None`` when a cluster is visited twice or
        is not a candidate of this model."""
        chain: list[int] = []
        for st in plan.stages:
            ci = self.topo.index[st.cluster]
            if not chain or chain[-1] != ci:
                chain.append(ci)
        if len(set(chain)) != len(chain) or any(i not in self.u for i in chain):
            return None
        return chain

    def hint_plan(self, plan: Plan) -> bool:
        """Hint every decision variable from ``plan`` (:meth:`_hint`); ``False`` when its chain is outside
        this model's space (a cluster visited twice, or not a candidate) or a stage spans clusters."""
        if self.chain_of(plan) is None or any(st.replicas for st in plan.stages):
            return False
        self._hint(plan)
        return True

    def hint_structure(self, plan: Plan, *, layers: bool) -> bool:
        """Hint another policy's plan by its structure only: used clusters, chain arcs, first and last,
        and (``layers``) the layers per cluster; the degrees and ranks are left to the completion.
        ``False`` when the chain is outside this model's space."""
        chain = self.chain_of(plan)
        if chain is None:
            return False
        per = {ci: 0 for ci in chain}
        for st in plan.stages:
            per[self.topo.index[st.cluster]] += st.layers
        model = self.model
        model.clear_hints()  # type: ignore[no-untyped-call]
        for i in self.cand:
            model.add_hint(self.u[i], i in per)
            model.add_hint(self.first[i], i == chain[0])
            model.add_hint(self.last[i], i == chain[-1])
            if layers:
                model.add_hint(self.n[i], per.get(i, 0))
        on = set(itertools.pairwise(chain))
        for key, a in self.arc.items():
            model.add_hint(a, key in on)
        return True

    def fix_chain(self, chain: Sequence[int]) -> None:
        """Constrain the model to ``chain`` (used clusters, their order): split and degrees stay free."""
        on = set(itertools.pairwise(chain))
        for i in self.cand:
            self.model.add(self.u[i] == int(i in chain))
            self.model.add(self.first[i] == int(i == chain[0]))
            self.model.add(self.last[i] == int(i == chain[-1]))
        for key, a in self.arc.items():
            self.model.add(a == int(key in on))

    def complete_hint(self, time_limit_s: float) -> bool:
        """Extend the hint to every variable: solve with the hinted variables fixed, then hint the whole
        solution (CP-SAT then starts from a complete feasible assignment). No-op if that fails."""
        solver = cp_model.CpSolver()
        solver.parameters.fix_variables_to_their_hinted_value = True
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = 1
        if solver.solve(self.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return False
        values = list(solver.response_proto.solution)
        self.model.clear_hints()  # type: ignore[no-untyped-call]
        for index, value in enumerate(values):
            self.model.add_hint(self.model.get_int_var_from_proto_index(index), value)
        return True

    def decode(self, solver: cp_model.CpSolver) -> Plan:
        """The chain, blocks and degrees of the solver's solution as an (unevaluated) plan."""
        nxt = {i: j for (i, j), a in self.arc.items() if solver.boolean_value(a)}
        chain = [next(i for i in self.cand if solver.boolean_value(self.first[i]))]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        stages: list[Stage] = []
        layer = 0
        for i in chain:
            t, d, p = next((t, d, p) for t, d, p, v in self.x[i] if solver.boolean_value(v))
            nl = solver.value(self.n[i])
            stages += block_stages(self.topo.clusters[i].name, layer, nl, t, d, p)
            layer += nl
        return Plan(stages=tuple(stages), micro_batches=_micro_batches(self.job), schedule=Schedule.ONE_F_ONE_B)


register_policy("ilp", IlpPolicy, with_planner=True)
register_policy("ilp-decomposed", lambda planner=LOCAL_PLANNER: IlpPolicy(decomposed=True, planner=planner),
                with_planner=True)
