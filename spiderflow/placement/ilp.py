r"""``ilp``: one global CP-SAT model for cross-cluster placement (the "ILP-based" baseline).

The model chooses jointly which clusters run the job, their order in the pipeline chain, the layer
split over the chain and each chosen cluster's tensor/data-parallel degrees, and minimises the closed-form
step time of :mod:`spiderflow.costmodel` (1F1B, ``m = global_batch / micro_batch`` micro-batches, one
stage per chosen cluster). The plan it returns is re-evaluated with :func:`spiderflow.costmodel.evaluate`
so it is scored exactly like every other policy.

Symbols (``C`` clusters, ``L`` layers, ``O_c`` the degree options of cluster ``c``)
-----------------------------------------------------------------------------
Constants, all times integerised in ticks of ``τ`` seconds (``τ = min(1 µs, greedy step / 10⁷)``):

- ``O_c = {(t, d)}``: ``t`` ∈ :func:`tp_options`, ``d ≥ 1``, ``t·d ≤ min(n_c, gpus.max)`` (``n_c`` free GPUs);
- ``α_ct`` ticks per layer of one micro-batch (3·f/(t·F_c) + 4·AR_t(A, B_tp)), ``β_ct`` head ticks;
- ``P_uv`` = ``A / b_uv + l_uv`` from the widest-path matrices (arc ``u → v`` absent when unreachable);
- ``γ_co`` ticks per parameter of the gradient all-reduce of option ``o`` (2(d−1)/d · 2 B/param /(t·B_dp));
- memory coefficients in bytes, rounded up: ``16·12h²/t`` per layer, ``16·V·h/t`` per embedding/head,
  ``a_t`` activation bytes per layer and micro-batch, ``g_t = 4·b·s·V/t`` logits, cap ``M_c − R``.

Variables:

- ``u_c ∈ {0,1}`` cluster used; ``x_co ∈ {0,1}`` option chosen; ``n_c ∈ [0, L]`` layers of ``c``;
- arc literals of one circuit over ``{depot} ∪ clusters``: ``first_c`` (depot → c), ``last_c``
  (c → depot), ``a_uv`` (u → v), self-loop ``¬u_c``;
- ``r_c ∈ [0, K]`` stages from ``c`` to the end of the chain (``last`` has 1); ``q_c = Σ_o ⌈m/d_o⌉·x_co``;
  ``k_c = min(r_c, q_c)`` 1F1B in-flight micro-batches; ``kn_c = k_c · n_c``;
- ``T_c`` stage time, ``Z`` pipeline bottleneck, ``Y`` slowest gradient all-reduce (all in ticks).

Constraints (numbered as in the code):

1. ``Σ_o x_co = u_c``                                    (a used cluster picks exactly one (t, d));
2. ``u_c ≤ n_c ≤ L·u_c``; ``Σ_c n_c = L``                   (every layer placed, ≥ 1 per used cluster);
3. ``gpus.min ≤ Σ_{c,o} t_o d_o x_co ≤ gpus.max``          (GPU range; ``t·d ≤ n_c`` by construction of ``O_c``);
4. AddCircuit over the arcs: the used clusters form one path depot → … → depot (the chain);
5. ``last_c ⇒ r_c = 1``; ``a_uv ⇒ r_u = r_v + 1``; ``¬u_c ⇒ r_c = 0``;
6. ``k_c = min(r_c, q_c)``; ``kn_c = k_c·n_c``;
7. ``x_co ⇒ T_c ≥ α_ct n_c + β_ct last_c``  and  ``d_o·Z ≥ α_ct n_c + β_ct last_c``  (compute; ``Z ≥ T/d``);
8. ``Z ≥ P_uv · a_uv``                                     (boundary transfers in the bottleneck);
9. ``x_co ⇒ Y ≥ γ_co (12h²·n_c + V·h·(first_c + last_c))``  (gradient all-reduce);
10. ``x_co ⇒ 16(12h² n_c + Vh(first_c + last_c))/t + a_t·kn_c + g_t·last_c ≤ M_c − R``  (memory per GPU);
11. symmetry: among clusters identical in every attribute and link, ``u_c ≥ u_{c'}`` for ``c < c'``.

Objective:  ``min (m − 1)·Z + Σ_c T_c + 2·Σ_uv P_uv a_uv + Y``
(= ``T_pipe + T_dp`` of :mod:`spiderflow.costmodel` for the chain, up to tick rounding).

The solver is seeded with a hint on every decision variable (``u``, ``x``, ``n``, arcs, ``first``,
``last``, ``r``) from a greedy construction (clusters by free compute, chain by
nearest widest link, layers proportional to compute, the smallest tp that fits memory), as a competent
CP-SAT user would; when CP-SAT finds no solution in its time limit the greedy plan is returned and
``stats["from_hint"] = 1``. ``optimal=True`` only when CP-SAT reports OPTIMAL for this model.

Size: ``O(C² + Σ_c |O_c|)`` Booleans (``|O_c| ≈ 2·min(n_c, gpus.max)``), ``O(C² + Σ_c |O_c|)`` constraints;
solving is NP-hard (it contains a Hamiltonian-path problem), hence the time limit.

``PlacementResult.stats`` keys: ``cp_status`` (CpSolverStatus value: 4 OPTIMAL, 2 FEASIBLE, 3 INFEASIBLE,
0 UNKNOWN, 1 MODEL_INVALID), ``objective_s`` and ``bound_s`` (model objective and best bound in seconds),
``wall_s`` (solver wall time), ``build_s`` (model construction), ``hint_step_s`` (greedy plan's step time,
``inf`` if none), ``from_hint``, ``booleans``, ``conflicts``, ``branches``, ``workers``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import structlog
from ortools.sat.python import cp_model

from spiderflow.costmodel import (
    BYTES_PER_PARAM,
    GIB,
    RESERVED_GIB,
    activation_bytes,
    allreduce_time,
    evaluate,
    fits_memory,
    layer_fwd_flops,
    transfer_time,
)
from spiderflow.domain import Cluster, JobSpec, Plan, Schedule, Stage, Topology
from spiderflow.placement.base import Budget, PlacementResult, PlacementStatus, register_policy
from spiderflow.placement.common import diagnose

__all__ = [
    "DEFAULT_TIME_LIMIT_S",
    "DEFAULT_WORKERS",
    "IlpPolicy",
    "degree_options",
    "greedy_plan",
    "tp_options",
]

DEFAULT_TIME_LIMIT_S = 60.0
DEFAULT_WORKERS = 2

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


def degree_options(cluster: Cluster, job: JobSpec) -> tuple[tuple[int, int], ...]:
    """Every ``(tp, dp)`` the ILP may give ``cluster``: ``tp ∈ tp_options``, ``tp·dp ≤ min(free, gpus.max)``."""
    cap = min(cluster.free, job.gpus.max)
    return tuple((t, d) for t in tp_options(cluster, job) for d in range(1, cap // t + 1))


def _split_layers(layers: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder split of ``layers`` proportional to ``weights``, each part ≥ 1."""
    k = len(weights)
    total = sum(weights)
    raw = [layers * w / total for w in weights]
    parts = [max(1, math.floor(x)) for x in raw]
    while sum(parts) > layers:
        i = max((j for j in range(k) if parts[j] > 1), key=lambda j: parts[j] - raw[j])
        parts[i] -= 1
    while sum(parts) < layers:
        i = max(range(k), key=lambda j: raw[j] - parts[j])
        parts[i] += 1
    return parts


def _micro_batches(job: JobSpec) -> int:
    return job.micro_batches_total


def _layer_capacity(c: Cluster, job: JobSpec, t: int, d: int, rank: int, first: bool, last: bool) -> int:
    """Most layers a stage on ``c`` with degrees ``(t, d)`` holds in memory at ``rank`` (1 = last stage)."""
    mdl, b, s = job.model, job.micro_batch, job.seq_len
    k = min(math.ceil(_micro_batches(job) / d), rank)
    free = c.gpu_memory_gib * GIB - RESERVED_GIB * GIB
    free -= BYTES_PER_PARAM * mdl.embedding_params * (int(first) + int(last)) / t
    free -= k * 4.0 * b * s * mdl.vocab / t if last else 0.0
    per_layer = BYTES_PER_PARAM * mdl.params_per_layer / t + k * s * b * mdl.hidden * (
        10.0 + 24.0 / t + 5.0 * mdl.heads * s / (mdl.hidden * t))
    return max(0, int(free // per_layer))


def _capped_split(layers: int, weights: Sequence[float], caps: Sequence[int]) -> list[int] | None:
    """Integer split of ``layers`` ∝ ``weights`` with ``1 ≤ part_i ≤ caps_i`` (water-filling), or ``None``."""
    k = len(weights)
    if sum(caps) < layers or min(caps) < 1 or layers < k:
        return None
    parts = [1] * k
    left = layers - k
    while left > 0:
        # give the next layer to the stage furthest below its proportional share, among those with room
        total = sum(weights)
        room = [i for i in range(k) if parts[i] < caps[i]]
        i = max(room, key=lambda j: (weights[j] / total * layers - parts[j], -j))
        parts[i] += 1
        left -= 1
    return parts


def greedy_plan(topo: Topology, job: JobSpec) -> Plan | None:
    """The warm start: a feasible plan (memory, free GPUs, GPU range) or ``None`` if none was built.

    For every chain length ``K``: the ``K`` clusters with the most free compute
    (``min(n_c, gpus.max)·F_c``) that are reachable from the first; chain order by repeatedly appending
    the remaining cluster with the widest link from the chain's end; GPUs handed out in that compute order
    up to ``gpus.max``; layers split proportionally to each stage's compute but capped by what its memory
    holds at the largest tp (water-filling); then per stage the smallest tp that still holds its layers.
    The best evaluated plan wins. O(K_max · (C·K + L·K)) time.
    """
    m = _micro_batches(job)
    L = job.model.layers
    bw = topo.bandwidth_matrix
    usable = [c for c in topo.clusters if c.free > 0 and tp_options(c, job)]
    usable.sort(key=lambda c: (-min(c.free, job.gpus.max) * c.effective_tflops, c.name))
    if not usable:
        return None
    first = usable[0]
    reach = [c for c in usable if bw[topo.index[first.name], topo.index[c.name]] > 0]
    best: Plan | None = None
    kmax = min(len(reach), L, job.gpus.max)
    for k in range(1, kmax + 1):
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

        def cap(i: int, t: int, order: list[Cluster] = order, gpus: dict[str, int] = gpus, k: int = k) -> int:
            c = order[i]
            return _layer_capacity(c, job, t, max(1, gpus[c.name] // t), k - i, i == 0, i == k - 1)

        tmax = [tp_options(c, job)[-1] for c in order]
        split = _capped_split(L, [gpus[c.name] * c.effective_tflops for c in order],
                              [cap(i, tmax[i]) for i in range(k)])
        if split is None:
            continue
        tps = [next((t for t in tp_options(c, job) if cap(i, t) >= split[i]), tmax[i]) for i, c in enumerate(order)]
        stages: list[Stage] = []
        first_layer = 0
        for c, n, t in zip(order, split, tps, strict=True):
            stages.append(Stage(cluster=c.name, first_layer=first_layer, last_layer=first_layer + n - 1,
                                tp=t, dp=max(1, gpus[c.name] // t)))
            first_layer += n
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
            c.tflops, c.mfu, c.memory_gib)


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
                 use_hint: bool = True) -> None:
        self.workers = workers
        self.default_time_limit_s = default_time_limit_s
        self.use_hint = use_hint

    def place(self, topo: Topology, job: JobSpec, budget: Budget | None = None) -> PlacementResult:
        budget = budget if budget is not None else Budget()
        t0 = time.perf_counter()
        res = self._place(topo, job, budget, t0)
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
        built = _Model(topo, job, hint)
        build_s = time.perf_counter() - t0
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.05, limit - build_s)
        solver.parameters.num_workers = self.workers
        solver.parameters.random_seed = budget.seed
        status = solver.solve(built.model)
        stats: dict[str, float] = {
            "cp_status": float(int(status)),
            "wall_s": solver.wall_time,
            "build_s": build_s,
            "hint_step_s": hint.step_time_s if hint is not None else math.inf,
            "from_hint": 0.0,
            "booleans": float(built.booleans),
            "conflicts": float(solver.num_conflicts),
            "branches": float(solver.num_branches),
            "workers": float(self.workers),
        }
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            stats["objective_s"] = solver.objective_value * built.tick
            stats["bound_s"] = solver.best_objective_bound * built.tick
            plan = evaluate(built.decode(solver), topo, job)
            return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=plan,
                                   planning_seconds=time.perf_counter() - t0,
                                   optimal=status == cp_model.OPTIMAL, stats=stats)
        if status == cp_model.UNKNOWN and hint is not None:
            stats["from_hint"] = 1.0
            return PlacementResult(status=PlacementStatus.SUCCESS, policy=self.name, plan=hint,
                                   planning_seconds=time.perf_counter() - t0, optimal=False, stats=stats)
        if status == cp_model.INFEASIBLE:
            return self._infeasible(topo, job, t0, stats, limit)
        return self._fail(PlacementStatus.UNSCHEDULABLE if status == cp_model.UNKNOWN else PlacementStatus.ERROR,
                          f"CP-SAT ended with {solver.status_name(status)} and no plan within {limit:g} s",
                          "time_limit", t0, stats)

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

    def __init__(self, topo: Topology, job: JobSpec, hint: Plan | None) -> None:
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

        cand = [i for i, c in enumerate(topo.clusters) if c.free > 0 and degree_options(c, job)]
        self.cand = cand
        K = max(1, min(len(cand), L, job.gpus.max))
        A = activation_bytes(mdl, b, s)
        f = layer_fwd_flops(mdl, b, s)
        head = 2.0 * b * s * mdl.hidden * mdl.vocab
        p_layer = float(mdl.params_per_layer)
        emb = float(mdl.embedding_params)
        bwm, latm = topo.bandwidth_matrix, topo.latency_matrix

        u: dict[int, cp_model.IntVar] = {}
        n: dict[int, cp_model.IntVar] = {}
        first: dict[int, cp_model.IntVar] = {}
        last: dict[int, cp_model.IntVar] = {}
        r: dict[int, cp_model.IntVar] = {}
        T: dict[int, cp_model.IntVar] = {}
        self.x: dict[int, list[tuple[int, int, cp_model.IntVar]]] = {}
        arcs: list[tuple[int, int, cp_model.IntVar]] = []
        self.arc: dict[tuple[int, int], cp_model.IntVar] = {}

        # Upper bounds on tick quantities (for variable domains).
        t_hi = 1
        for i in cand:
            c = topo.clusters[i]
            t_hi = max(t_hi, ticks(L * 3.0 * f / c.effective_tflops / 1e12 + 3.0 * head / c.effective_tflops / 1e12
                                   + 4 * L * allreduce_time(A, c.gpus_per_node, c.inter_node_gbps)) + 1)
        ptick: dict[tuple[int, int], int] = {
            (i, j): ticks(transfer_time(A, float(bwm[i, j]), float(latm[i, j])))
            for i in cand for j in cand if i != j and bwm[i, j] > 0
        }
        p_hi = max(ptick.values(), default=0)
        gpu_terms: list[cp_model.LinearExpr] = []
        z = model.new_int_var(0, max(t_hi, p_hi, 1), "Z")
        y = model.new_int_var(0, 1 << 50, "Y")
        self.z, self.y = z, y
        sum_t: list[cp_model.IntVar] = []
        for i in cand:
            c = topo.clusters[i]
            u[i] = model.new_bool_var(f"u{i}")
            n[i] = model.new_int_var(0, L, f"n{i}")
            first[i] = model.new_bool_var(f"first{i}")
            last[i] = model.new_bool_var(f"last{i}")
            r[i] = model.new_int_var(0, K, f"r{i}")
            T[i] = model.new_int_var(0, t_hi, f"T{i}")
            sum_t.append(T[i])
            opts = degree_options(c, job)
            xs = [(t, d, model.new_bool_var(f"x{i}_{t}_{d}")) for t, d in opts]
            self.x[i] = xs
            # (1) one option per used cluster
            model.add(sum(v for _, _, v in xs) == u[i])
            # (2) layers only on used clusters, at least one each
            model.add(n[i] >= u[i])
            model.add(n[i] <= L * u[i])
            # (3) GPU range (collected below)
            gpu_terms.extend(t * d * v for t, d, v in xs)
            # (6) in-flight micro-batches k = min(r, q), kn = k·n
            q = model.new_int_var(0, m, f"q{i}")
            model.add(q == sum(math.ceil(m / d) * v for _, d, v in xs))
            k = model.new_int_var(0, min(K, m), f"k{i}")
            model.add_min_equality(k, [r[i], q])
            kn = model.new_int_var(0, min(K, m) * L, f"kn{i}")
            model.add_multiplication_equality(kn, [k, n[i]])
            coefs = {t: self._coefs(c, t, job, b, f, head, A, ticks) for t in tp_options(c, job)}
            cap = math.floor(c.gpu_memory_gib * GIB) - math.ceil(RESERVED_GIB * GIB)
            for t, d, v in xs:
                co = coefs[t]
                # (7) stage time and its share of the bottleneck
                model.add(T[i] >= co.alpha * n[i] + co.beta * last[i]).only_enforce_if(v)
                model.add(d * z >= co.alpha * n[i] + co.beta * last[i]).only_enforce_if(v)
                # (9) gradient all-reduce of this stage (ticks per parameter × parameters)
                bdp = c.intra_node_gbps if t * d <= c.gpus_per_node else c.inter_node_gbps
                per_param = allreduce_time(2.0 / t, d, bdp) / tick
                if per_param > 0:
                    model.add(y >= math.ceil(per_param * p_layer) * n[i]
                              + math.ceil(per_param * emb) * (first[i] + last[i])).only_enforce_if(v)
                # (10) memory per GPU
                model.add(co.mem_layer * n[i] + co.mem_embed * (first[i] + last[i]) + co.act_layer * kn
                          + co.logits * last[i] <= cap).only_enforce_if(v)
            self._uses = u
        # (2) all layers placed
        model.add(sum(n.values()) == L)
        # (3) GPU range
        model.add(sum(gpu_terms) >= job.gpus.min)
        model.add(sum(gpu_terms) <= job.gpus.max)
        # (4) one path through the used clusters: node 0 is the depot, cluster i is node pos+1
        node = {i: p + 1 for p, i in enumerate(cand)}
        circuit: list[tuple[int, int, cp_model.LiteralT]] = []
        ptimes: list[tuple[int, cp_model.IntVar]] = []
        for i in cand:
            circuit.append((0, node[i], first[i]))
            circuit.append((node[i], 0, last[i]))
            circuit.append((node[i], node[i], ~u[i]))
            # (5) ranks
            model.add(r[i] == 1).only_enforce_if(last[i])
            model.add(r[i] == 0).only_enforce_if(~u[i])
            for j in cand:
                if i == j or bwm[i, j] <= 0:
                    continue
                a = model.new_bool_var(f"a{i}_{j}")
                self.arc[(i, j)] = a
                circuit.append((node[i], node[j], a))
                model.add(r[i] == r[j] + 1).only_enforce_if(a)
                pt = ptick[(i, j)]
                ptimes.append((pt, a))
                # (8) boundary in the bottleneck
                if pt > 0:
                    model.add(z >= pt).only_enforce_if(a)
                arcs.append((i, j, a))
        model.add_circuit(circuit)
        # (11) symmetry breaking between interchangeable clusters
        for i, j in _identical_pairs(topo, cand):
            model.add(u[i] >= u[j])
        self.n, self.first, self.last, self.r, self.T = n, first, last, r, T
        self.booleans = sum(len(v) for v in self.x.values()) + len(arcs) + 3 * len(cand)
        # Objective: (m − 1)·Z + Σ T + 2·Σ P·a + Y
        model.minimize((m - 1) * z + sum(sum_t) + 2 * sum(pt * a for pt, a in ptimes) + y)
        if hint is not None:
            self._hint(hint)

    @staticmethod
    def _coefs(c: Cluster, t: int, job: JobSpec, b: int, f: float, head: float, A: float,
               ticks: Callable[[float], int]) -> _Coefs:
        mdl, s = job.model, job.seq_len
        F = c.effective_tflops * 1e12
        btp = c.intra_node_gbps if t <= c.gpus_per_node else c.inter_node_gbps
        return _Coefs(
            alpha=ticks(3.0 * f / (t * F) + 4 * allreduce_time(A, t, btp)),
            beta=ticks(3.0 * head / (t * F)),
            mem_layer=math.ceil(BYTES_PER_PARAM * mdl.params_per_layer / t),
            mem_embed=math.ceil(BYTES_PER_PARAM * mdl.embedding_params / t),
            act_layer=math.ceil(s * b * mdl.hidden * (10.0 + 24.0 / t + 5.0 * mdl.heads * s / (mdl.hidden * t))),
            logits=math.ceil(4.0 * b * s * mdl.vocab / t),
        )

    def _hint(self, plan: Plan) -> None:
        """Hint the greedy plan on the decision variables (used clusters, options, layers, arcs, ranks)."""
        model = self.model
        idx = self.topo.index
        used = {idx[st.cluster]: (pos, st) for pos, st in enumerate(plan.stages)}
        S = len(plan.stages)
        for i in self.cand:
            hit = used.get(i)
            model.add_hint(self._uses[i], hit is not None)
            model.add_hint(self.n[i], hit[1].layers if hit else 0)
            model.add_hint(self.first[i], hit is not None and hit[0] == 0)
            model.add_hint(self.last[i], hit is not None and hit[0] == S - 1)
            model.add_hint(self.r[i], S - hit[0] if hit else 0)
            for t, d, v in self.x[i]:
                model.add_hint(v, hit is not None and hit[1].tp == t and hit[1].dp == d)
        chain = [idx[st.cluster] for st in plan.stages]
        on = set(itertools.pairwise(chain))
        for key, a in self.arc.items():
            model.add_hint(a, key in on)

    def decode(self, solver: cp_model.CpSolver) -> Plan:
        """The chain and degrees of the solver's solution as an (unevaluated) plan."""
        nxt: dict[int, int] = {}
        for (i, j), a in self.arc.items():
            if solver.boolean_value(a):
                nxt[i] = j
        start = next(i for i in self.cand if solver.boolean_value(self.first[i]))
        chain = [start]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        stages: list[Stage] = []
        layer = 0
        for i in chain:
            t, d = next((t, d) for t, d, v in self.x[i] if solver.boolean_value(v))
            nl = solver.value(self.n[i])
            stages.append(Stage(cluster=self.topo.clusters[i].name, first_layer=layer,
                                last_layer=layer + nl - 1, tp=t, dp=d))
            layer += nl
        return Plan(stages=tuple(stages), micro_batches=_micro_batches(self.job), schedule=Schedule.ONE_F_ONE_B)


register_policy("ilp", IlpPolicy)
