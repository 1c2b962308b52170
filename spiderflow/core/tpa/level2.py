r"""TPA level 2: how one cluster runs its layer block (OR-Tools CP-SAT).

Given a cluster shape (GPU type, GPUs per node ``g``, bandwidths), the number of GPUs ``n`` the chain
gives it, a contiguous block of ``L_b`` layers (flags: holds the embedding, holds the head), the micro-batch
size ``b``, the sequence ``s``, the micro-batch count ``m`` and the schedule's in-flight profile, choose the
tensor / pipeline / data degrees ``(t, p, d)`` with ``t·p·d = n`` and the layer split over the ``p``
intra-cluster sub-stages, minimising the block's contribution to the step time under GPU memory.

Candidates ``k = (t_k, p_k, d_k)``: ``t_k`` divides ``g`` (a tensor group never straddles a node) or is a
multiple of ``g`` (whole nodes, over the inter-node bandwidth); ``t_k`` divides the heads, the key/value
heads (tensor parallelism shards whole heads, as the executor requires) and the hidden size; ``p_k ≤ L_b``;
``d_k ≤ m`` (every replica gets a micro-batch). Each candidate also comes with activation recomputation,
with FSDP-sharded replicas (``d_k > 1``; the parameters all-gathered once per step, priced with the gradient
sync) and with both — a
second tier, solved only where no plain candidate fits memory (:func:`plain`); its constants are the cost
model's for those options (:func:`spiderflow.core.kernels.level2.coefficients`).

Variables
    ``x_k ∈ {0,1}``: candidate ``k`` is chosen.
    ``ℓ_{k,j} ∈ [0, L_b]``: layers of sub-stage ``j < p_k`` under candidate ``k``.
    ``z_k ≥ 0``: bottleneck time per micro-batch of the block under ``k`` (``max_j T_{k,j} / d_k``; 0 if
    ``k`` is not chosen).
    ``a_k ≥ 0``: the slowest sub-stage's data-parallel gradient all-reduce under ``k``.

Because ``ℓ_{k,·} = 0`` whenever ``x_k = 0``, every constraint below is linear without big-M terms
(constants are multiplied by ``x_k``), which keeps the LP relaxation tight.

Constants (from :mod:`spiderflow.core.costmodel`, linear in ``ℓ`` for a fixed ``k``)
    ``T_{k,j} = τ_k·ℓ_{k,j} + η_{k,j}``  (``τ_k`` per-layer fwd+bwd time incl. TP all-reduces,
    ``η`` the head on the last sub-stage of a head-holding block — its FLOPs at the blocks' rate, or its
    measured time where a profile measured it — plus the measured embedding on sub-stage 0 of an embedding
    block);
    ``M_{k,j} = μ_{k,j}·ℓ_{k,j} + ν_{k,j}`` bytes per GPU with ``κ_{k,j} = min(⌈m/d_k⌉, φ·(R + p_k − j), K)``
    micro-batches in flight (``R`` stages downstream of the block, ``φ`` the schedule's depth factor:
    1 for 1F1B, 2 for the latency-aware schedule, ``K`` the schedule's in-flight cap if any; GPipe holds
    ``⌈m/d_k⌉``);
    ``A_{k,j} = α_k·ℓ_{k,j} + β_{k,j}`` the sub-stage's gradient sync: ring all-reduce of its gradients over
    ``d_k`` replicas (FSDP: reduce-scatter plus the step's one all-gather) plus the optimizer step (``α_k``
    includes ``u``, the cluster's calibrated optimizer seconds per layer; ``β`` the measured per-step work
    outside the blocks: embedding and head optimizer steps, input pipeline; the cost model's ``T_dp`` term);
    ``F_k = τ_k·L_b + η_k + 2(p_k−1)·P_in`` the fill (one micro-batch through the block) and the
    intra-cluster boundaries ``P_in`` over the inter-node bandwidth (activations in the cluster's wire
    format, as the cost model sends them). ``τ_k`` includes the cluster's calibrated fixed time per layer.

Constraints (numbered as in the code)
    (1) ``Σ_k x_k = 1``
    (2) ``x_k ≤ ℓ_{k,j} ≤ L_b·x_k``                      (a chosen candidate's sub-stages are non-empty)
    (3) ``Σ_j ℓ_{k,j} = L_b·x_k``                         (the block's layers are all placed)
    (4) ``ℓ_{k,j} ≤ u_{k,j}·x_k`` with ``u_{k,j} = max{ℓ : μ_{k,j}·ℓ + ν_{k,j} ≤ C}`` (GPU memory ``C``;
        the same as ``μ_{k,j}·ℓ_{k,j} + ν_{k,j}·x_k ≤ C`` for integer ``ℓ``, without rounding bytes)
    (5) ``d_k·z_k ≥ τ_k·ℓ_{k,j} + η_{k,j}·x_k``; if ``p_k > 1``: ``z_k ≥ P_in·x_k``; ``z_k ≥ Z_floor·x_k``
        (bottleneck; ``Z_floor`` the bottleneck of the rest of the chain, 0 by default)
    (6) ``a_k ≥ α_k·ℓ_{k,j} + β_{k,j}·x_k``                (gradient sync)
    (7) ``ℓ_{k,j} ≤ ℓ_{k,j+1}`` for every ``j`` with ``η_{k,j} = η_{k,j+1}``, ``β_{k,j} = β_{k,j+1}`` and
        ``u_{k,j} ≤ u_{k,j+1}`` (symmetry breaking, :func:`symmetric_pairs`: swapping such a pair's layers
        keeps (4) and the objective, so some optimum satisfies (7)). Sub-stages are *not* interchangeable in
        general: ``κ_{k,j}`` depends on ``j``, so their memory caps differ; (7) only orders them the way
        the caps allow.

Objective
    ``min Σ_k [(m−1)·z_k + a_k + F_k·x_k]`` — the block's share of ``T_pipe + T_dp`` if it were the pipeline's
    bottleneck (costmodel docstring).

Complexity: ``O(Σ_k p_k) ≤ O(n·σ(n))`` variables after :func:`_prune`; milliseconds per solve.

Solvers: :func:`solve_block` is the CP-SAT model above; :func:`solve_block_exact` reaches the same
optimum without a solver (bottleneck enumeration, microseconds) and :func:`brute_force_block` enumerates
every composition (tests only). Both are memoised by the problem — (cluster shape, GPUs, layer block,
micro-batch size and count, in-flight profile) — so a repeated block is a dictionary lookup:
:func:`block_bound_cached` (exact) and :func:`solve_block_cached` (CP-SAT, started from the exact solution
as a hint). The planner's ``level2`` option (:data:`LEVEL2_SOLVERS`) picks which one gives the plan's
configurations: ``"exact"`` (the default) or ``"cpsat"``, which solves the blocks of the chosen split with
CP-SAT (:func:`spiderflow.core.tpa.level1.certify`). Level 1's search scores its many trial splits with the
exact optimum either way. CP-SAT optimises times rounded to integer units, so where two configurations
are within a unit of each other it may return the one the unrounded cost model ranks second.

GPU mapping: ranks are packed node-major on ``⌈n/g⌉`` nodes, tensor rank innermost, then replica, then
sub-stage: GPU ``(j·d + r)·t + q`` runs tensor rank ``q`` of replica ``r`` of sub-stage ``j``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from operator import attrgetter
from typing import Literal

import numpy as np
import numpy.typing as npt
import structlog
from ortools.sat.python import cp_model

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.costmodel import (
    GIB,
    LOGIT_ONCE_BYTES,
    LOGIT_SAVED_BYTES,
    PARAM_GATHER_BYTES,
    RESERVED_GIB,
    compute_rate_tflops,
    fsdp_unsharded_bytes_per_param,
    grad_bytes_per_value,
    layer_fwd_flops,
    state_bytes_per_param,
    wire_bytes,
)
from spiderflow.core.domain import Cluster, Precision, Sharding
from spiderflow.core.kernels import level2 as kernels

__all__ = [
    "LEVEL2_SOLVERS",
    "STATS",
    "BlockConfig",
    "BlockProblem",
    "ClusterShape",
    "Degrees",
    "Level2Solver",
    "SolveStats",
    "block_bound_cached",
    "block_candidates",
    "brute_force_block",
    "cache_clear",
    "config_cost",
    "gpu_mapping",
    "memory_caps",
    "min_memory_config",
    "min_peak_fits",
    "solve_block",
    "solve_block_cached",
    "solve_block_exact",
    "symmetric_pairs",
]

log = structlog.get_logger(__name__)

Level2Solver = Literal["exact", "cpsat"]
LEVEL2_SOLVERS: tuple[Level2Solver, ...] = ("exact", "cpsat")
"""How the planner solves the blocks of the plan it returns: ``"exact"`` (:func:`block_bound_cached`) or
``"cpsat"`` (:func:`solve_block_cached`, the CP-SAT model). The first is the default."""


class _Model(cp_model.CpModel):
    """A CpModel without the camelCase aliases ortools attaches to every instance (≈2 ms per model)."""

    def _add_pre_pep8_methods(self) -> None:
        return None


_SCALE_UNITS = 1_000_000  # the largest per-layer time coefficient maps to this many integer units


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterShape:
    """The parts of a cluster level 2 depends on (its name and free count do not matter)."""

    effective_tflops: float
    memory_gib: float
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    layer_overhead_s: float = 0.0  # fixed fwd+bwd seconds per layer and micro-batch (calibrated; else 0)
    optimizer_s: float = 0.0  # optimizer step seconds per layer and training step (calibrated; else 0)
    wire_bytes: int = 2  # bytes per activation value on the wire (the GPU type's; 4 for the CPU executor)
    # Work outside the blocks a profile measured (the Cluster fields of the same names; 0: not measured, the
    # head then priced by its FLOPs at the blocks' rate; costmodel.measured_outer_time, measured_step_extra).
    embedding_us_per_token: float = 0.0
    head_us_per_token: float = 0.0
    embedding_optimizer_ms: float = 0.0
    head_optimizer_ms: float = 0.0
    data_ms_per_sample: float = 0.0

    @classmethod
    def of(cls, c: Cluster, precision: Precision = Precision.BF16) -> ClusterShape:
        """``c``'s shape for a job trained in ``precision``: its compute rate and wire format in that
        precision (:func:`~spiderflow.core.costmodel.compute_rate_tflops`,
        :func:`~spiderflow.core.costmodel.wire_bytes`)."""
        return cls(
            effective_tflops=compute_rate_tflops(c, precision),
            memory_gib=c.gpu_memory_gib,
            gpus_per_node=c.gpus_per_node,
            intra_node_gbps=c.intra_node_gbps,
            inter_node_gbps=c.inter_node_gbps,
            layer_overhead_s=float(getattr(c, "layer_overhead_ms", 0.0) or 0.0) / 1e3,
            optimizer_s=float(getattr(c, "optimizer_ms_per_layer", 0.0) or 0.0) / 1e3,
            wire_bytes=wire_bytes(c, precision),
            embedding_us_per_token=c.embedding_us_per_token,
            head_us_per_token=c.head_us_per_token,
            embedding_optimizer_ms=c.embedding_optimizer_ms,
            head_optimizer_ms=c.head_optimizer_ms,
            data_ms_per_sample=c.data_ms_per_sample,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockProblem:
    """One level-2 instance.

    ``downstream``: pipeline stages after this block (``None``: every micro-batch of a replica is in
    flight, GPipe); else sub-stage ``j`` of ``p`` holds ``min(⌈m/d⌉, depth_factor·(downstream + p − j))``
    micro-batches (1F1B: factor 1; the latency-aware schedule: factor 2). ``memory_bound=False`` drops
    constraint (4) (used to share one solve between profiles). ``floor_s``: the pipeline bottleneck set by
    the rest of the chain (``Z_floor``); below it a faster block gains nothing. ``max_in_flight``: the
    schedule's in-flight cap ``K`` (:mod:`spiderflow.core.schedules`; 1F1B family only), ``κ ≤ K``.
    ``precision``: the job's (value bytes of activations and gradients, state bytes per parameter; the
    shape's rate and wire format are already that precision's, :meth:`ClusterShape.of`).
    ``allow_recompute`` / ``allow_fsdp``: offer candidates with activation recomputation / FSDP-sharded
    replicas (:func:`block_candidates`). The solvers take them only where no plain candidate fits memory
    (:func:`plain`: the options are a second tier).
    """

    shape: ClusterShape
    gpus: int
    layers: int
    has_embed: bool
    has_head: bool
    model: ModelSpec
    micro_batch: int
    seq_len: int
    m: int
    downstream: int | None
    depth_factor: int = 1
    memory_bound: bool = True
    floor_s: float = 0.0
    max_in_flight: int | None = None
    precision: Precision = Precision.BF16
    allow_recompute: bool = True
    allow_fsdp: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Degrees:
    """A candidate: tensor, pipeline and data degrees, with activation recomputation and FSDP sharding of
    the ``dp`` replicas (the plan's ``Stage.recompute`` and ``Stage.sharding``)."""

    tp: int
    pp: int
    dp: int
    recompute: bool = False
    fsdp: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockConfig:
    """A solved block: degrees, layers per sub-stage, and the cost-model figures per sub-stage
    (``allreduce_s``: the gradient sync after the drain, all-reduce plus the optimizer step)."""

    tp: int
    pp: int
    dp: int
    layers: tuple[int, ...]
    compute_s: tuple[float, ...]
    memory_gib: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    intra_boundary_s: float
    objective_s: float
    recompute: bool = False
    fsdp: bool = False

    @property
    def degrees(self) -> Degrees:
        """The candidate this configuration runs."""
        return Degrees(tp=self.tp, pp=self.pp, dp=self.dp, recompute=self.recompute, fsdp=self.fsdp)

    @property
    def sharding(self) -> Sharding:
        """The plan's ``Stage.sharding`` of the block's sub-stages."""
        return Sharding.FSDP if self.fsdp else Sharding.REPLICATE

    @property
    def bottleneck_s(self) -> float:
        """Steady-state seconds per micro-batch of the slowest sub-stage (``max_j T_j / d``)."""
        return max(self.compute_s) / self.dp


def block_candidates(p: BlockProblem) -> list[Degrees]:
    """Every admissible candidate (module docstring), ordered by ``(t, p)``, each followed by its variants with
    FSDP (``d > 1``),
    recomputation, and both, as the problem allows."""
    return list(_candidates(p))


@lru_cache(maxsize=65536)
def _candidates(p: BlockProblem) -> tuple[Degrees, ...]:
    fl, it = _vectors(p)
    return tuple(
        Degrees(tp=t, pp=q, dp=d, recompute=bool(r), fsdp=bool(f))
        for t, q, d, r, f in kernels.candidates(fl, it).tolist()
    )


FArray = npt.NDArray[np.float64]
IArray = npt.NDArray[np.int64]


@lru_cache(maxsize=4096)
def _model_figures(model: ModelSpec, micro_batch: int, seq_len: int) -> tuple[float, float, float, float]:
    """The model family's ``(P, f, E, H)``: parameters of a layer, a layer's forward FLOPs per micro-batch,
    the embedding's and the head's parameters (the catalog's figures, memoised: they are read per problem)."""
    return (float(model.params_per_layer), layer_fwd_flops(model, micro_batch, seq_len),
            float(model.embedding_params), float(model.head_params))


_Parts = tuple[ClusterShape, ModelSpec, tuple[float, ...], tuple[float, ...], tuple[int, ...], tuple[int, ...],
               tuple[int, ...]]
_PARTS: dict[tuple[int, int, int, int, Precision], _Parts] = {}
_PARTS_MAX = 4096


def _parts(p: BlockProblem) -> _Parts:
    """The fields of :func:`_vectors` that only depend on ``p``'s shape, model, micro-batch size, sequence and
    precision — ``(shape, model, fl[:6], fl[7:], it[2:9], it[18:21], it[23:])`` — memoised on those objects'
    identity (the entry keeps them alive and is checked against them, so an identity is never mistaken), so
    the blocks of one chain cluster read the catalogue's and the cost model's figures once."""
    sh, model = p.shape, p.model
    key = (id(sh), id(model), p.micro_batch, p.seq_len, p.precision)
    hit = _PARTS.get(key)
    if hit is not None and hit[0] is sh and hit[1] is model:
        return hit
    if len(_PARTS) >= _PARTS_MAX:
        _PARTS.clear()
    out: _Parts = (
        sh, model,
        (sh.effective_tflops, sh.memory_gib, sh.intra_node_gbps, sh.inter_node_gbps, sh.layer_overhead_s,
         sh.optimizer_s),
        (GIB, RESERVED_GIB * GIB, *_model_figures(model, p.micro_batch, p.seq_len), LOGIT_SAVED_BYTES,
         LOGIT_ONCE_BYTES, sh.embedding_us_per_token, sh.head_us_per_token, sh.embedding_optimizer_ms,
         sh.head_optimizer_ms, sh.data_ms_per_sample),
        (sh.gpus_per_node, sh.wire_bytes, model.hidden, model.heads, model.vocab, p.micro_batch, p.seq_len),
        (state_bytes_per_param(p.precision), p.precision.value_bytes,
         state_bytes_per_param(p.precision, Sharding.FSDP)),
        (model.kv_heads or model.heads, grad_bytes_per_value(p.precision), PARAM_GATHER_BYTES,
         fsdp_unsharded_bytes_per_param(p.precision)),
    )
    _PARTS[key] = out
    return out


def _vectors(p: BlockProblem) -> tuple[FArray, IArray]:
    """``p`` as the kernels' problem vectors (:mod:`spiderflow.core.kernels.level2`: ``fl`` and ``it``); the
    fields that do not vary between the blocks of a chain cluster come from :func:`_parts`."""
    _, _, fl_head, fl_tail, it_shape, it_precision, it_tail = _parts(p)
    fl = np.array((*fl_head, p.floor_s, *fl_tail), dtype=np.float64)
    it = np.array(
        (p.gpus, p.layers, *it_shape, p.m, p.downstream or 0, p.downstream is not None, p.depth_factor,
         p.max_in_flight or 0, p.max_in_flight is not None, p.has_embed, p.has_head, p.memory_bound,
         *it_precision, p.allow_recompute, p.allow_fsdp, *it_tail),
        dtype=np.int64,
    )
    return fl, it


_Solve = Callable[[FArray, IArray, IArray, FArray], tuple[int, int, int, int, int, float, float]]


def _solved(p: BlockProblem, solve: _Solve) -> BlockConfig | None:
    """Run ``solve`` (:func:`spiderflow.core.kernels.level2.solve_exact` or a kernel with its signature) on ``p``
    and build the configuration it picks (``None`` when it picks none)."""
    fl, it = _vectors(p)
    return _solved_vectors(fl, it, max(1, min(p.layers, p.gpus)), solve)


def _solved_vectors(fl: FArray, it: IArray, width: int, solve: _Solve) -> BlockConfig | None:
    """:func:`_solved` of the problem with vectors ``fl``/``it`` (``width``: ``max(1, min(L_b, n))``)."""
    lay = np.empty(width, np.int64)
    figs = np.empty((3, width), np.float64)
    tp, pp, dp, rc, fs, obj, p_in = solve(fl, it, lay, figs)
    if tp == 0:
        return None
    compute, mem, ar = figs[:, :pp].tolist()
    return BlockConfig(
        tp=tp, pp=pp, dp=dp, layers=tuple(lay[:pp].tolist()), compute_s=tuple(compute), memory_gib=tuple(mem),
        allreduce_s=tuple(ar), intra_boundary_s=p_in, objective_s=obj, recompute=bool(rc), fsdp=bool(fs),
    )


@dataclass(frozen=True, slots=True)
class _Coeffs:
    tau: float  # per-layer fwd+bwd seconds
    eta_head: float  # head seconds on the head-holding sub-stage
    mu: tuple[float, ...]  # memory bytes per layer, per sub-stage
    nu: tuple[float, ...]  # memory constant bytes, per sub-stage
    alpha: float  # gradient sync seconds per layer (all-reduce + optimizer step)
    beta: tuple[float, ...]  # all-reduce constant seconds, per sub-stage
    p_in: float  # intra-cluster boundary seconds
    eta_embed: float = 0.0  # the measured embedding's seconds on sub-stage 0 of an embedding block (else 0)

    def stage_time(self, p: BlockProblem, k: Degrees, j: int, n: int) -> float:
        """``T_{k,j}`` of sub-stage ``j`` holding ``n`` layers: ``τ·n + η_{k,j}`` (the head on the last
        sub-stage of a head block, the measured embedding on sub-stage 0 of an embedding block), in the
        kernel's order of operations (:func:`spiderflow.core.kernels.level2.coefficients`)."""
        t = self.tau * n + (self.eta_head if (p.has_head and j == k.pp - 1) else 0.0)
        if p.has_embed and j == 0 and self.eta_embed != 0.0:
            t += self.eta_embed
        return t

    def eta(self, p: BlockProblem, k: Degrees, j: int) -> float:
        """``η_{k,j}``: the stage time's constant on sub-stage ``j``."""
        return self.stage_time(p, k, j, 0)

    def eta_total(self, p: BlockProblem) -> float:
        """``Σ_j η_{k,j}``: the head's and the measured embedding's time in the block."""
        e = self.eta_head if p.has_head else 0.0
        if p.has_embed and self.eta_embed != 0.0:
            e += self.eta_embed
        return e


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
    """The module docstring's constants of candidate ``k`` (:func:`spiderflow.core.kernels.level2.coefficients`)."""
    fl, it = _vectors(p)
    mu = np.empty(k.pp, np.float64)
    nu = np.empty(k.pp, np.float64)
    beta = np.empty(k.pp, np.float64)
    tau, eta_head, eta_embed, alpha, p_in = kernels.coefficients(
        fl, it, k.tp, k.pp, k.dp, k.recompute, k.fsdp, mu, nu, beta)
    return _Coeffs(tau, eta_head, tuple(mu.tolist()), tuple(nu.tolist()), alpha, tuple(beta.tolist()), p_in,
                   eta_embed)


def config_cost(p: BlockProblem, k: Degrees, layers: tuple[int, ...], coeffs: _Coeffs | None = None) -> BlockConfig:
    """The cost-model figures of candidate ``k`` with the given layers per sub-stage (no feasibility check);
    ``coeffs``: ``k``'s constants for ``p`` when the caller has them already."""
    c = coeffs if coeffs is not None else _coeffs(p, k)
    compute = tuple(c.stage_time(p, k, j, n) for j, n in enumerate(layers))
    mem = _memory_gib(c, layers)
    ar = tuple(c.alpha * n + c.beta[j] for j, n in enumerate(layers))
    p_in = c.p_in if k.pp > 1 else 0.0
    obj = (p.m - 1) * max(max(compute) / k.dp, p_in, p.floor_s) + sum(compute) + 2 * (k.pp - 1) * p_in + max(ar)
    return BlockConfig(
        tp=k.tp, pp=k.pp, dp=k.dp, layers=layers, compute_s=compute, memory_gib=mem, allreduce_s=ar,
        intra_boundary_s=p_in, objective_s=obj, recompute=k.recompute, fsdp=k.fsdp,
    )


def _memory_gib(c: _Coeffs, layers: tuple[int, ...]) -> tuple[float, ...]:
    """GiB per GPU of each sub-stage holding ``layers`` (a configuration's ``memory_gib``)."""
    return tuple((c.mu[j] * n + c.nu[j]) / GIB for j, n in enumerate(layers))


def _fitting_cost(p: BlockProblem, k: Degrees, layers: tuple[int, ...]) -> BlockConfig | None:
    """:func:`config_cost` of ``k`` with ``layers`` when its peak memory fits ``p``'s GPUs
    (``max(memory_gib) ≤ memory_gib``), else ``None``: the memory is tested before the other figures are
    built."""
    c = _coeffs(p, k)
    if not max(_memory_gib(c, layers)) <= p.shape.memory_gib:
        return None
    return config_cost(p, k, layers, c)


def _fitting_vectors(fl: FArray, it: IArray, cfg: BlockConfig) -> BlockConfig | None:
    """:func:`_fitting_cost` of ``cfg``'s degrees and layers under the problem with vectors ``fl``/``it`` (one
    kernel call, :func:`spiderflow.core.kernels.level2.fitting_cost`: the same figures, bit for bit)."""
    pp = cfg.pp
    figs = np.empty((3, pp), np.float64)
    fits, obj, p_in = kernels.fitting_cost(fl, it, cfg.tp, pp, cfg.dp, cfg.recompute, cfg.fsdp,
                                           np.array(cfg.layers, np.int64), figs)
    if not fits:
        return None
    compute, mem, ar = figs.tolist()
    return BlockConfig(
        tp=cfg.tp, pp=pp, dp=cfg.dp, layers=cfg.layers, compute_s=tuple(compute), memory_gib=tuple(mem),
        allreduce_s=tuple(ar), intra_boundary_s=p_in, objective_s=obj, recompute=cfg.recompute, fsdp=cfg.fsdp,
    )


def _balanced(n_layers: int, parts: int) -> tuple[int, ...]:
    q, r = divmod(n_layers, parts)
    return tuple(q + (1 if j < r else 0) for j in range(parts))


@lru_cache(maxsize=65536)
def min_memory_config(p: BlockProblem) -> BlockConfig | None:
    """The configuration with the smallest peak memory per GPU (every candidate with its min-peak split) —
    used to explain infeasibility and to steer level 1 off memory overflows. Memoised on the problem.

    The min-peak split of ``L_b`` layers over ``p`` sub-stages (each ≥ 1) is greedy: one layer at a time
    to the sub-stage whose memory ``μ_j·ℓ_j + ν_j`` grows least (ties: the first) — exact for a bottleneck
    of increasing linear functions. The least peak wins, ties keep the first candidate in ``(t, p)``
    order (:func:`spiderflow.core.kernels.level2.min_memory_config`)."""
    return _solved(p, kernels.min_memory_config)


def min_peak_fits(p: BlockProblem) -> bool:
    """Whether :func:`min_memory_config` of ``p`` fits its memory (``max(memory_gib) ≤ memory_gib``), without
    building the splits: the min-peak split of candidate ``k`` takes the ``L_b − p`` smallest increments
    ``μ_j·n + ν_j`` (every sub-stage starts at one layer), so its peak is within the capacity iff every
    sub-stage holds one layer and the most layers each holds within it, ``u_j``, add up to ``L_b``. Each
    ``u_j`` is tested with the same expression as the configuration's memory (``(μ_j·n + ν_j)/GiB``).
    ``O(p)`` per candidate instead of ``O(L_b log p)`` (:func:`spiderflow.core.kernels.level2.min_peak_fits`)."""
    fl, it = _vectors(p)
    return bool(kernels.min_peak_fits(fl, it))


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
    survivors = [(k, c) for i, (k, c) in enumerate(survivors)
                 if not any(_dominates(p, other, oc, k, c) for other, oc in survivors[:i])]
    return [k for k, _ in survivors], [c for _, c in survivors]


def _dominates(p: BlockProblem, a: Degrees, ca: _Coeffs, b: Degrees, cb: _Coeffs) -> bool:
    """Whether candidate ``a`` (same degrees as ``b``, other options) is at least as good as ``b`` for every
    split: no larger time or sync constants, the same boundary, and memory caps that hold at least as many
    layers per sub-stage — so every split of ``b`` is one of ``a`` with no larger objective. :func:`_prune`
    lets only an earlier candidate remove a later one it dominates, so that of two that tie (FSDP's step
    all-gather plus reduce-scatter moves the bytes of the replicas' all-reduce) the first stays, as the exact
    solver keeps the first of equal objectives."""
    if (a.tp, a.pp, a.dp) != (b.tp, b.pp, b.dp) or a == b or ca.p_in != cb.p_in:
        return False
    if ca.tau > cb.tau or ca.eta_head > cb.eta_head or ca.eta_embed > cb.eta_embed or ca.alpha > cb.alpha:
        return False
    if any(x > y for x, y in zip(ca.beta, cb.beta, strict=True)):
        return False
    ua, ub = memory_caps(p, a), memory_caps(p, b)
    return all(min(x, p.layers) >= min(y, p.layers) for x, y in zip(ua, ub, strict=True))


def memory_caps(p: BlockProblem, k: Degrees) -> tuple[int, ...]:
    """``u_{k,j}``: the most layers sub-stage ``j`` of candidate ``k`` holds within GPU memory (the exact
    test :func:`config_cost` and the plan checks apply; ``L_b`` for every sub-stage when constraint (4) is
    off): the largest ``ℓ ≤ L_b`` with ``(μ_{k,j}·ℓ + ν_{k,j})/GiB ≤ C``, 0 if none. Memoised on the problem
    (every candidate's caps at once)."""
    if not p.memory_bound:
        return (p.layers,) * k.pp
    hit = _memory_caps(p).get((k.tp, k.pp, k.dp, k.recompute, k.fsdp))
    if hit is None:  # not one of p's candidates
        fl, it = _vectors(p)
        out = np.empty(k.pp, np.int64)
        kernels.memory_caps(fl, it, k.tp, k.pp, k.dp, k.recompute, k.fsdp, out)
        hit = tuple(out.tolist())
    return hit


@lru_cache(maxsize=8192)  # an entry holds every candidate's caps
def _memory_caps(p: BlockProblem) -> dict[tuple[int, int, int, int, int], tuple[int, ...]]:
    """:func:`memory_caps` of each of ``p``'s candidates, by ``(t, p, d, recompute, fsdp)``."""
    fl, it = _vectors(p)
    cands, start, caps = kernels.memory_caps_all(fl, it)
    flat: list[int] = caps.tolist()
    bounds: list[int] = start.tolist()
    return {
        (t, q, d, r, f): tuple(flat[bounds[i]:bounds[i + 1]]) for i, (t, q, d, r, f) in enumerate(cands.tolist())
    }


def symmetric_pairs(p: BlockProblem, k: Degrees) -> list[int]:
    """Sub-stages ``j`` for which the model may require ``ℓ_{k,j} ≤ ℓ_{k,j+1}`` without losing an optimum.

    Exchange argument: if ``η_{k,j} = η_{k,j+1}`` and ``β_{k,j} = β_{k,j+1}`` (same time and sync terms per
    layer and constant) and ``u_{k,j} ≤ u_{k,j+1}`` (the later sub-stage has at least as much memory room),
    swapping the layer counts of a solution with ``ℓ_{k,j} > ℓ_{k,j+1}`` keeps (4) — the larger count moves
    to the roomier sub-stage — and leaves the objective unchanged. Middle sub-stages usually qualify
    (in-flight ``κ_{k,j}`` falls with ``j``, so ``u`` rises), but not always: they are only *ordered*, not
    interchangeable, when their caps differ.
    """
    c = _coeffs(p, k)
    u = memory_caps(p, k)
    eta = [c.eta(p, k, j) for j in range(k.pp)]
    return [
        j for j in range(k.pp - 1)
        if eta[j] == eta[j + 1] and c.beta[j] == c.beta[j + 1] and u[j] <= u[j + 1]
    ]


def solve_block(
    p: BlockProblem, *, time_limit_s: float = 5.0, hint: BlockConfig | None = None, symmetry: bool = True
) -> BlockConfig | None:
    """Solve the CP-SAT model of the module docstring; ``None`` when no candidate fits in memory.

    ``hint``: a solution (e.g. :func:`solve_block_exact`'s) given to CP-SAT as its starting point; the
    solver keeps it unless it proves a strictly better one in its integer time units. Its objective also
    serves :func:`_prune` as an upper bound, so candidates whose lower bound cannot reach it are not
    modelled at all. ``symmetry`` adds
    the ordering constraints (7). Times are integers in units of ``max_k τ_k / 10^6`` (rounded up: a
    solution's rounded objective is within ``10^-6·(m + L_b + 2p)·max τ`` of its real one); the returned
    configuration is re-costed exactly with :func:`config_cost`.
    """
    for q in _tiers(p):
        out = _solve_cpsat(q, time_limit_s=time_limit_s, hint=hint, symmetry=symmetry)
        if out is not None:
            return out
    return None


def _solve_cpsat(p: BlockProblem, *, time_limit_s: float, hint: BlockConfig | None, symmetry: bool
                 ) -> BlockConfig | None:
    """One tier of :func:`solve_block`."""
    if hint is not None and hint.degrees not in block_candidates(p):
        hint = None  # a solution of the other tier
    cands, coeffs = _prune(p, block_candidates(p), upper=hint.objective_s if hint is not None else math.inf)
    if not cands or p.layers < 1:
        return None
    unit = max(c.tau for c in coeffs) / _SCALE_UNITS  # seconds per integer time unit

    def t_int(x: float) -> int:
        return math.ceil(x / unit)

    model = _Model()
    lb = p.layers
    xs = [model.new_bool_var(f"x{i}") for i in range(len(cands))]
    ells: list[list[cp_model.IntVar]] = []
    zs: list[cp_model.IntVar] = []
    as_: list[cp_model.IntVar] = []
    model.add_exactly_one(xs)  # (1)
    terms = []
    for i, (k, c, x) in enumerate(zip(cands, coeffs, xs, strict=True)):
        caps = memory_caps(p, k)
        row = [model.new_int_var(0, max(0, min(lb, u)), f"l{i}_{j}") for j, u in enumerate(caps)]
        ells.append(row)
        for ell, u in zip(row, caps, strict=True):
            model.add(ell >= x)  # (2)
            model.add(ell <= min(lb, u) * x)  # (2) and (4): u = max{ℓ : μℓ + ν ≤ C}
        model.add(sum(row) == lb * x)  # (3)
        if symmetry:
            for j in symmetric_pairs(p, k):
                model.add(row[j] <= row[j + 1])  # (7)
        tau = t_int(c.tau)
        p_in = c.p_in if k.pp > 1 else 0.0
        # Upper bounds from the rounded integer coefficients, so rounding can never cut a solution off.
        z_k = model.new_int_var(0, tau * lb + t_int(c.eta_head) + t_int(c.eta_embed) + t_int(p_in)
                                + t_int(p.floor_s), f"z{i}")
        a_k = model.new_int_var(0, t_int(c.alpha) * lb + max(t_int(b) for b in c.beta), f"a{i}")
        zs.append(z_k)
        as_.append(a_k)
        for j, ell in enumerate(row):
            eta = _eta_int(p, k, c, j, t_int)
            model.add(z_k * k.dp >= tau * ell + eta * x)  # (5)
            model.add(a_k >= t_int(c.alpha) * ell + t_int(c.beta[j]) * x)  # (6)
        if k.pp > 1:
            model.add(z_k >= t_int(p_in) * x)  # (5) a boundary can be the bottleneck too
        if p.floor_s > 0:
            model.add(z_k >= t_int(p.floor_s) * x)  # (5) the rest of the chain's bottleneck
        fill = c.tau * lb + c.eta_total(p) + 2 * (k.pp - 1) * p_in
        terms.extend([(p.m - 1) * z_k, a_k, t_int(fill) * x])
    model.minimize(sum(terms))
    if hint is not None:
        _add_hint(model, p, cands, coeffs, xs, ells, zs, as_, hint, t_int)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = time_limit_s
    # The model is small and already pruned: presolve costs more than it saves (measured ~2x per solve),
    # and the full LP relaxation (level 2) proves the bottleneck bound sooner.
    solver.parameters.cp_model_presolve = False
    solver.parameters.linearization_level = 2
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    for i, x in enumerate(xs):
        if solver.boolean_value(x):
            layers = tuple(int(solver.value(v)) for v in ells[i])
            return config_cost(p, cands[i], layers)
    return None  # pragma: no cover - exactly one x is true in any solution


def _add_hint(
    model: cp_model.CpModel, p: BlockProblem, cands: list[Degrees], coeffs: list[_Coeffs],
    xs: list[cp_model.IntVar], ells: list[list[cp_model.IntVar]], zs: list[cp_model.IntVar],
    as_: list[cp_model.IntVar], hint: BlockConfig, t_int: Callable[[float], int],
) -> None:
    """A complete assignment for ``hint`` (all other candidates at 0); a hint outside the candidates is
    ignored. Layer counts are put in the order (7) requires (the exchange argument keeps it optimal)."""
    chosen = hint.degrees
    if chosen not in cands:
        return
    i = cands.index(chosen)
    layers = _ordered(p, chosen, list(hint.layers))
    c = coeffs[i]
    for n, (x, row, z_k, a_k) in enumerate(zip(xs, ells, zs, as_, strict=True)):
        on = n == i
        model.add_hint(x, on)
        for j, ell in enumerate(row):
            model.add_hint(ell, layers[j] if on else 0)
        if not on:
            model.add_hint(z_k, 0)
            model.add_hint(a_k, 0)
            continue
        k = cands[n]
        p_in = c.p_in if k.pp > 1 else 0.0
        z = max(
            [math.ceil((t_int(c.tau) * ell + _eta_int(p, k, c, j, t_int)) / k.dp) for j, ell in enumerate(layers)]
            + [t_int(p_in) if k.pp > 1 else 0, t_int(p.floor_s) if p.floor_s > 0 else 0]
        )
        a = max(t_int(c.alpha) * ell + t_int(c.beta[j]) for j, ell in enumerate(layers))
        model.add_hint(z_k, z)
        model.add_hint(a_k, a)


def _eta_int(p: BlockProblem, k: Degrees, c: _Coeffs, j: int, t_int: Callable[[float], int]) -> int:
    """``η_{k,j}`` in the model's integer units (the head's and the embedding's, each rounded)."""
    e = t_int(c.eta_head) if (p.has_head and j == k.pp - 1) else 0
    return e + (t_int(c.eta_embed) if (p.has_embed and j == 0) else 0)


def _ordered(p: BlockProblem, k: Degrees, layers: list[int]) -> list[int]:
    """``layers`` with every run of :func:`symmetric_pairs` sorted ascending (same memory fit, same cost)."""
    out = list(layers)
    pairs = set(symmetric_pairs(p, k))
    j = 0
    while j < k.pp:
        end = j
        while end in pairs:
            end += 1
        out[j:end + 1] = sorted(out[j:end + 1])
        j = end + 1
    return out


def solve_block_exact(p: BlockProblem) -> BlockConfig | None:
    """The optimum of the module docstring's model without a solver; ``None`` when no candidate fits in
    memory. Same optimum as :func:`solve_block` (which rounds times to integer units) and
    :func:`brute_force_block`. Runs as one kernel call (:func:`spiderflow.core.kernels.level2.solve_exact`).

    First :func:`_prune`'s tests drop candidates that cannot be optimal; then each survivor, in ``(t, p)``
    order, gets its best split under the best objective so far (a candidate whose best split does not beat
    it gives none). Ties keep the first candidate in ``(t, p)`` order (a later one must be better by a
    relative ``10⁻¹²``).

    Best split of a fixed candidate ``k`` (exact): the objective is
    ``(m−1)·max(Z/d, P_in, Z_floor) + A + const`` with ``Z = max_j (τ·ℓ_j + η_j)`` and
    ``A = max_j (α·ℓ_j + β_j)``, both maxima of increasing functions of the ``ℓ_j``. For a threshold ``Z``
    each sub-stage may hold at most ``v_j(Z) = min(u_j, max{ℓ : τℓ + η_j ≤ Z})`` layers (``u_j`` its memory
    cap, :func:`memory_caps`); the least ``A`` is then the smallest level with
    ``Σ_j min(v_j, max{ℓ : αℓ + β_j ≤ A}) ≥ L_b`` (water-filling, exact for a bottleneck of increasing
    linear functions; a binary search over the sorted distinct levels ``αℓ + β_j``). ``Z`` runs over the
    values ``τℓ + η_j`` in increasing order; it stops once ``(m−1)·max(Z/d, …) + A_∞ + const`` (``A_∞`` the
    least ``A`` under the memory caps only) cannot beat the best found (relative slack ``10⁻⁹``), or once
    ``A`` reaches ``A_∞``. The split at the best ``(Z, A)`` takes ``min(u_j, v_j(Z), max{ℓ : αℓ + β_j ≤ A})``
    layers per sub-stage and gives the surplus back one layer at a time from the sub-stage with the
    highest memory (ties: the first; every term only shrinks). A one-sub-stage candidate has one split,
    ``(L_b,)``: two binary searches give its ``Z`` and ``A``. Counts ``max{ℓ ≤ L_b : sℓ + b ≤ level}``
    accept a relative ``10⁻¹²`` above the level. ``O(L_b·p·log L_b)`` per candidate in the worst case.
    """
    for q in _tiers(p):
        out = _solved(q, kernels.solve_exact)
        if out is not None:
            return out
    return None


@lru_cache(maxsize=65536)
def _exact_memo(p: BlockProblem) -> BlockConfig | None:
    return solve_block_exact(p)


@dataclass(slots=True)
class SolveStats:
    """Counters of the CP-SAT path since the last :func:`cache_clear` (for benchmarks and tests)."""

    cpsat_solves: int = 0
    cpsat_seconds: float = 0.0
    cpsat_improved_hint: int = 0  # CP-SAT found a strictly better objective than the exact hint
    lookups: int = 0


STATS = SolveStats()


@lru_cache(maxsize=65536)
def _cpsat_memo(p: BlockProblem) -> BlockConfig | None:
    hint = _exact_memo(p)
    t0 = time.perf_counter()
    out = solve_block(p, hint=hint)
    STATS.cpsat_solves += 1
    STATS.cpsat_seconds += time.perf_counter() - t0
    if out is not None and (hint is None or out.objective_s < hint.objective_s * (1.0 - 1e-9)):
        STATS.cpsat_improved_hint += 1
        log.warning("tpa.level2_hint_improved", layers=p.layers, gpus=p.gpus, cpsat_s=out.objective_s,
                    exact_s=hint.objective_s if hint is not None else None)
    return out


_family_key = attrgetter(*(f.name for f in fields(BlockProblem) if f.name != "downstream"))
"""Every field of a problem but its in-flight depth, as a tuple: equal for two problems exactly when
``replace(p, downstream=-1)`` is (a family of :class:`_Cached`), without building that problem."""


class _Cached:
    """A level-2 solver memoised on the (hashable, frozen) problem, solving as few problems as it can.

    The objective does not depend on the in-flight profile, only constraint (4) does: the optimum of the
    memory-free model is solved once per (shape, GPUs, block, b, s, m, floor) and reused whenever it fits
    ``p``'s memory (the feasible set shrinks, the optimum stays). Otherwise the optimum already solved for a
    shallower in-flight depth of the same block is reused when it fits; only then is ``p`` itself solved.
    """

    def __init__(self, solve: Callable[[BlockProblem], BlockConfig | None]) -> None:
        self._solve = solve
        self._answers: dict[BlockProblem, BlockConfig | None] = {}
        self._families: dict[tuple[object, ...], list[tuple[int | None, BlockConfig | None]]] = {}

    def clear(self) -> None:
        self._answers.clear()
        self._families.clear()

    def __call__(self, p: BlockProblem) -> BlockConfig | None:
        STATS.lookups += 1
        try:
            return self._answers[p]
        except KeyError:
            pass
        if len(self._answers) >= _MAX_ANSWERS:  # bounded: a long-lived planner must not grow
            self._answers.clear()
        out = self._answers[p] = self._compute(p)
        return out

    def _compute(self, p: BlockProblem) -> BlockConfig | None:
        free = self._solve(replace(p, downstream=0, depth_factor=1, memory_bound=False, max_in_flight=None))
        if free is None:
            return None
        cfg = config_cost(p, free.degrees, free.layers)
        if max(cfg.memory_gib) <= p.shape.memory_gib:
            return cfg
        return self._family(p, lambda: self._solve(p))

    def _family(self, p: BlockProblem, solve: Callable[[], BlockConfig | None],
                fit: Callable[[BlockConfig], BlockConfig | None] | None = None) -> BlockConfig | None:
        """The optimum of ``p`` already solved for a shallower in-flight depth of the same block when it fits,
        else ``solve()`` (``p`` solved), remembered for the deeper ones. ``fit(prev)``: :func:`_fitting_cost`
        of ``prev``'s degrees and layers under ``p`` (the default; a caller with ``p``'s vectors passes the
        kernel's, :func:`_fitting_vectors`)."""
        family = _family_key(p)  # the fields of replace(p, downstream=-1): the same keys, not built
        if len(self._families) >= _MAX_ANSWERS:
            self._families.clear()
        solved = self._families.setdefault(family, [])
        for d, prev in solved:
            if prev is None or p.downstream is None or d is None or d > p.downstream:
                continue
            cfg = _fitting_cost(p, prev.degrees, prev.layers) if fit is None else fit(prev)
            if cfg is not None:
                return cfg
        out = solve()
        solved.append((p.downstream, out))
        return out


class _ExactCached(_Cached):
    """:class:`_Cached` for the exact solver, run on the kernels' problem vectors (:func:`_vectors`, built once
    per problem): the memory-free problem and the first tier are the problem's vectors with their fields
    set, and every solve is memoised on its vectors (the kernel's whole input), so no intermediate problem
    is built or hashed. Same answers as ``_Cached(solve_block_exact)``.

    One more saving: the memory-free optimum is a plain configuration whenever ``p`` has plain candidates
    (its first tier has no memory to fail on), so where no plain configuration fits ``p`` (its first tier,
    memory-bound, far cheaper to solve than the memory-free problem) the memory-free optimum cannot fit
    either and is not solved; the answer is the one the memory-free test would have passed on to.
    """

    def __init__(self) -> None:
        super().__init__(_exact_memo)
        self._solves: dict[bytes, BlockConfig | None] = {}

    def clear(self) -> None:
        super().clear()
        self._solves.clear()

    def _tier(self, fl: FArray, it: IArray, width: int) -> BlockConfig | None:
        key = fl.tobytes() + it.tobytes()
        try:
            return self._solves[key]
        except KeyError:
            pass
        if len(self._solves) >= _MAX_SOLVES:  # as many as the problem-keyed memo of solve_block_exact holds
            self._solves.clear()
        out = self._solves[key] = _solved_vectors(fl, it, width, kernels.solve_exact)
        return out

    def _compute(self, p: BlockProblem) -> BlockConfig | None:
        fl, it = _vectors(p)
        width = max(1, min(p.layers, p.gpus))
        options = p.allow_recompute or p.allow_fsdp
        first = it.copy()  # the first tier: plain(p)
        first[kernels.I_ALLOW_RECOMPUTE] = 0
        first[kernels.I_ALLOW_FSDP] = 0
        if self._tier(fl, first, width) is not None or not kernels.candidates(fl, first).shape[0]:
            free = it.copy()  # replace(p, downstream=0, depth_factor=1, memory_bound=False, max_in_flight=None)
            free[kernels.I_DOWNSTREAM] = 0
            free[kernels.I_HAS_DOWNSTREAM] = 1
            free[kernels.I_DEPTH_FACTOR] = 1
            free[kernels.I_MEMORY_BOUND] = 0
            free[kernels.I_MAX_IN_FLIGHT] = 0
            free[kernels.I_HAS_MAX_IN_FLIGHT] = 0
            cfg = self._exact(fl, free, width, options)
            if cfg is None:
                return None
            cfg = _fitting_vectors(fl, it, cfg)
            if cfg is not None:
                return cfg
        return self._family(p, lambda: self._exact(fl, it, width, options), lambda prev: _fitting_vectors(fl, it, prev))

    def _exact(self, fl: FArray, it: IArray, width: int, options: bool) -> BlockConfig | None:
        """:func:`solve_block_exact` of the problem with vectors ``fl``/``it`` (``options``: it allows
        recomputation or FSDP, so it has a second tier)."""
        if options:
            first = it.copy()
            first[kernels.I_ALLOW_RECOMPUTE] = 0
            first[kernels.I_ALLOW_FSDP] = 0
            out = self._tier(fl, first, width)
            if out is not None:
                return out
        return self._tier(fl, it, width)


_MAX_ANSWERS = 262144
_MAX_SOLVES = 65536
_CPSAT = _Cached(_cpsat_memo)
_EXACT = _ExactCached()


def solve_block_cached(p: BlockProblem) -> BlockConfig | None:
    """Level 2 as the planner runs it: the CP-SAT model (:func:`solve_block`) with the exact optimum as its
    hint, memoised on the problem (see :class:`_Cached`: a repeated block is a dictionary lookup)."""
    return _CPSAT(p)


def block_bound_cached(p: BlockProblem) -> BlockConfig | None:
    """The exact optimum of ``p`` (:func:`solve_block_exact`), memoised like :func:`solve_block_cached`:
    the cheap score level 1 ranks its trial splits with (same optimum as CP-SAT, proven by the tests)."""
    return _EXACT(p)


def cache_clear() -> None:
    """Forget every memoised level-2 solve and reset :data:`STATS`."""
    _exact_memo.cache_clear()
    _cpsat_memo.cache_clear()
    _CPSAT.clear()
    _EXACT.clear()
    min_memory_config.cache_clear()
    _COEFFS.clear()
    _memory_caps.cache_clear()
    _candidates.cache_clear()
    _model_figures.cache_clear()
    _PARTS.clear()
    STATS.cpsat_solves = 0
    STATS.cpsat_seconds = 0.0
    STATS.cpsat_improved_hint = 0
    STATS.lookups = 0


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    out: list[tuple[int, ...]] = []
    for first in range(1, total - parts + 2):
        out.extend((first, *rest) for rest in _compositions(total - first, parts - 1))
    return out


def brute_force_block(p: BlockProblem) -> BlockConfig | None:
    """Reference solver: every candidate × every composition of the block; same objective as the ILP.

    Exponential in ``p``; for tests on tiny instances only.
    """
    for q in _tiers(p):
        best: BlockConfig | None = None
        cap = q.shape.memory_gib
        for k in block_candidates(q):
            for layers in _compositions(q.layers, k.pp):
                cfg = config_cost(q, k, layers)
                if max(cfg.memory_gib) > cap:
                    continue
                if best is None or cfg.objective_s < best.objective_s - 1e-12:
                    best = cfg
        if best is not None:
            return best
    return None


def plain(p: BlockProblem) -> BlockProblem:
    """``p`` without the option candidates (recomputation, FSDP)."""
    return replace(p, allow_recompute=False, allow_fsdp=False) if (p.allow_recompute or p.allow_fsdp) else p


def _tiers(p: BlockProblem) -> tuple[BlockProblem, ...]:
    """The problems level 2 solves in turn until one has a solution: the plain candidates, then (where ``p``
    allows them) every candidate. A block runs recomputation or FSDP only where no plain configuration fits
    memory: at a micro-batch size where the plain block fits, the cost model's edge for FSDP (a
    reduce-scatter instead of an all-reduce, its all-gathers assumed hidden) is within the model's error and
    would change plans for nothing; where it does not fit, the options give a plan, and the planner takes the
    larger micro-batches they allow when the step is faster."""
    q = plain(p)
    return (q,) if q is p else (q, p)


def gpu_mapping(cfg: BlockConfig, gpus_per_node: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """``mapping[j][r]`` = the ``(node, gpu)`` pairs running replica ``r`` of sub-stage ``j`` (tensor ranks
    in order), packed node-major as the module docstring states."""
    out = []
    for j in range(cfg.pp):
        reps = []
        for r in range(cfg.dp):
            base = (j * cfg.dp + r) * cfg.tp
            reps.append(tuple(divmod(base + q, gpus_per_node) for q in range(cfg.tp)))
        out.append(tuple(reps))
    return tuple(out)
