r"""Shared machinery of the placement policies: per-topology arrays, the vectorised chain scorer, GPU
allocation, the level-1 fallback planner and unsatisfiability diagnosis.

Everything follows :mod:`spiderflow.core.costmodel` (same symbols, same formulas). Two evaluators live here:

**Chain scorer** (:func:`score_chains`, used inside searches). Scores ``N`` candidate chains at once
(numpy over an ``N × K`` array of cluster indices, ``-1`` padded) in O(N·K) time. For chain position
``i`` with cluster ``c``, ``g_i`` GPUs, achieved per-GPU rate ``F_c`` and ``R_i = g_i·F_c``:

- layers are split continuously in proportion to ``R_i`` and water-filled against each position's
  memory capacity ``cap_i`` (layers the cluster can hold with tensor-parallel groups of
  ``min(8, GPUs/node)`` GPUs, one pipeline sub-stage per group; ``k − i`` micro-batches in flight);
- every position runs at least one layer (``ℓ_i ← max(ℓ_i, 1)``);
- ``tp_i`` = the power of two ≤ min(8, GPUs/node) dividing ``g_i`` that minimises the position's own
  ``(m−1)·T_i/d_i + T_i + Y_i``; ``d_i = g_i / tp_i``;
- ``T_i = ℓ_i·(3f / (tp_i F_c) + 4·AR_tp(A) + o_c) (+ head on the last position)``, ``o_c`` the cluster's
  calibrated fixed time per layer (``layer_overhead_ms``; 0 unless calibrated);
- ``Y_i = AR_{d_i}(g·params_i/tp_i) + ℓ_i·u_c``, ``g`` bytes per gradient value, ``u_c`` the calibrated optimizer
  step per layer (``optimizer_ms_per_layer``; 0 unless calibrated);
- ``step = (m−1)·max(max_i T_i/d_i, max P) + Σ T_i + 2 Σ P + max_i Y_i``;
- where a profile measured the work outside the blocks, the embedding's time per micro-batch joins the first
  position's ``T``, and its optimizer step, the input pipeline (``b·⌈m/d⌉`` samples) and the head's optimizer
  step the first's and the last's ``Y`` (:func:`~spiderflow.core.costmodel.breakdown`).

**Level-1 fallback planner** (:func:`fallback_plan_chain`, the exact planner used until
:func:`spiderflow.core.tpa.plan_chain` exists). For an ordered allocation ``[(cluster, gpus), ...]``:

1. split layers in proportion to ``g_c·F_c`` (each cluster ≥ 1 layer);
2. per cluster block choose ``(pp, tp, dp)`` — ``pp ∈ {1..6, 8, 12, 16}`` pipeline sub-stages inside the
   cluster (for memory, or to keep replicas' gradient all-reduce inside a node), ``tp`` a power of two ≤
   GPUs/node, ``dp = ⌊g / (pp·tp)⌋`` — minimising the block's own
   ``(m−1)·max T/d + Σ T + 2·(pp−1)·P_int + max Y`` subject to memory (exact 1F1B in-flight counts:
   blocks are chosen from the last cluster to the first, each under the sub-stages its downstream blocks
   chose, so every block is priced with the in-flight depth the final plan has). Where a profile measured
   the work outside the blocks, ``T`` and ``Y`` take it as :func:`~spiderflow.core.costmodel.breakdown`
   does: the embedding's time per micro-batch in the ``T`` of the chain's first sub-stage, the head's in the
   last one's, and per step the embedding's optimizer and the input pipeline (``b·⌈m/d⌉`` samples) with the
   first sub-stage's gradient all-reduce in its ``Y``, the head's optimizer with the last one's; so do the
   clusters' calibrated terms: ``layer_overhead_ms`` per layer in every sub-stage's ``T``,
   ``optimizer_ms_per_layer`` per layer with every sub-stage's gradient all-reduce in its ``Y``;
3. move one boundary by one or four layers at a time while ``(memory excess, step time)`` improves
   lexicographically (a move re-chooses the two blocks and, when their sub-stage counts change, every
   block before them). The search also starts from the scorer's memory-aware water-filled split and the
   better result is kept;
4. memory first (:func:`memory_first_split`): a dynamic programme over the clusters from the last to the
   first and the stages downstream finds the shallowest structure (degrees and balanced sub-stages per
   cluster) that holds every layer. When the proportional split starts over memory it runs before the
   search, and proves at once that nothing fits when no structure holds the layers; when the search ends
   over memory, the search starts once more from that structure's split (kept when better), and if it
   still ends over memory the structure itself is the plan.

The result is passed through :func:`spiderflow.core.costmodel.evaluate`; a plan that does not fit memory
raises :class:`~spiderflow.core.errors.UnschedulableError` with ``constraint="memory"``. Steps 2-3 (the block
search, the chain's step time and the boundary search, one compiled call per start, blocks memoised per
chain) and the dynamic programme of step 4 run compiled (:mod:`spiderflow.core.kernels.fallback`: the same
expressions on the same operands in the same order, so bitwise the same plans).

:func:`plan_chain` dispatches to the TPA planner when ``spiderflow.core.tpa.plan_chain`` is importable and
to the fallback otherwise, so every policy's final plan goes through the same planner.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog

from spiderflow.core.costmodel import (
    GIB,
    LOGIT_ONCE_BYTES,
    LOGIT_SAVED_BYTES,
    RESERVED_GIB,
    activation_bytes,
    allreduce_time,
    compute_rate_tflops,
    evaluate,
    fits_memory,
    grad_bytes_per_value,
    layer_fwd_flops,
    state_bytes_per_param,
    transfer_time,
)
from spiderflow.core.domain import Cluster, JobSpec, Plan, PlanOptions, Precision, Schedule, Stage, Topology
from spiderflow.core.errors import UnschedulableError, ValidationError
from spiderflow.core.kernels.fallback import OPTIMIZER, OUTER, POS_WIDTH, new_memo
from spiderflow.core.kernels.fallback import evaluate_split as evaluate_split_kernel
from spiderflow.core.kernels.fallback import memory_first as memory_first_kernel
from spiderflow.core.kernels.fallback import optimise_split as optimise_split_kernel
from spiderflow.core.kernels.formulas import allreduce_times, transfer_times
from spiderflow.core.kernels.scorer import greedy_rows, score_rows
from spiderflow.core.memo import BoundedTable
from spiderflow.core.placement.base import Objective, PlacementResult, PlacementStatus, Planner

__all__ = [
    "LOCAL_PLANNER",
    "ChainScores",
    "Finalised",
    "JobConsts",
    "LocalPlanner",
    "ScoreTables",
    "TopoArrays",
    "allocate_greedy",
    "cached_plan",
    "chain_allocation",
    "check_plan",
    "diagnose",
    "fallback_plan_chain",
    "finalise",
    "job_consts",
    "objective_value",
    "plan_cache_clear",
    "plan_cache_stats",
    "plan_chain",
    "plan_key",
    "plan_objective",
    "plan_with_split",
    "score_chains",
    "score_tables",
    "topo_arrays",
    "tpa_available",
    "transfer_matrix",
    "unschedulable",
]

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]
BArr = npt.NDArray[np.bool_]

_MAX_TP = 8
_PP_CHOICES = (1, 2, 3, 4, 5, 6, 8, 12, 16)
_log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------------------------------
# Per-topology and per-job constants
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TopoArrays:
    """Per-cluster figures of one topology as arrays indexed like ``topo.clusters``.

    ``flops`` achieved FLOP/s per GPU; ``free`` free GPUs; ``mem`` bytes per GPU; ``gpn`` GPUs per node;
    ``intra``/``inter`` Gbit/s; ``watts`` board power; ``price`` $/kWh; ``bw`` widest-path Gbit/s and
    ``lat`` latency in seconds (``n × n``); ``tp_cap`` largest power-of-two TP degree per cluster;
    ``flops_fp32``/``flops_tf32`` the achieved FLOP/s in those precisions
    (:func:`~spiderflow.core.costmodel.compute_rate_tflops`; :meth:`rate` picks one); ``wire`` bytes per
    activation value each cluster's GPU type sends (:attr:`~spiderflow.core.catalog.GpuType.wire_bytes`);
    ``outer`` (5 × n) the work outside the blocks a profile measured (0 where not):
    ``embedding_us_per_token``, ``head_us_per_token``, ``embedding_optimizer_ms``, ``head_optimizer_ms``,
    ``data_ms_per_sample`` (:func:`~spiderflow.core.costmodel.measured_outer_time`,
    :func:`~spiderflow.core.costmodel.measured_step_extra`); ``calibrated`` (2 × n) the clusters' calibrated
    ``layer_overhead_ms`` and ``optimizer_ms_per_layer`` (0 unless calibrated).
    """

    names: tuple[str, ...]
    flops: FArr
    free: IArr
    mem: FArr
    gpn: IArr
    intra: FArr
    inter: FArr
    watts: FArr
    price: FArr
    bw: FArr
    lat_ms: FArr  # one-way latency between every pair, ms
    tp_cap: IArr
    flops_fp32: FArr
    flops_tf32: FArr
    wire: IArr
    outer: FArr
    calibrated: FArr

    def rate(self, precision: Precision) -> FArr:
        """Achieved FLOP/s per GPU in ``precision`` (``flops`` for bf16/fp16)."""
        if precision is Precision.FP32:
            return self.flops_fp32
        if precision is Precision.TF32:
            return self.flops_tf32
        return self.flops


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def topo_arrays(topo: Topology) -> TopoArrays:
    """The arrays of ``topo``, computed once per topology object (``topo.memo.arrays``)."""
    memo = topo.memo
    if memo.arrays is not None:
        return memo.arrays
    cl = topo.clusters
    arrays = TopoArrays(
        names=topo.names,
        flops=np.array([c.effective_tflops * 1e12 for c in cl]),
        free=np.array([c.free for c in cl], dtype=np.int64),
        mem=np.array([c.gpu_memory_gib * GIB for c in cl]),
        gpn=np.array([c.gpus_per_node for c in cl], dtype=np.int64),
        intra=np.array([c.intra_node_gbps for c in cl]),
        inter=np.array([c.inter_node_gbps for c in cl]),
        watts=np.array([c.power_w for c in cl]),
        price=np.array([c.electricity_usd_per_kwh for c in cl]),
        bw=np.asarray(topo.bandwidth_matrix, dtype=np.float64),
        lat_ms=np.asarray(topo.latency_matrix, dtype=np.float64),
        tp_cap=np.array([_pow2_floor(min(_MAX_TP, c.gpus_per_node)) for c in cl], dtype=np.int64),
        flops_fp32=np.array([compute_rate_tflops(c, Precision.FP32) * 1e12 for c in cl]),
        flops_tf32=np.array([compute_rate_tflops(c, Precision.TF32) * 1e12 for c in cl]),
        wire=np.array([c.gpu_type.wire_bytes for c in cl], dtype=np.int64),
        outer=np.array([[c.embedding_us_per_token for c in cl], [c.head_us_per_token for c in cl],
                        [c.embedding_optimizer_ms for c in cl], [c.head_optimizer_ms for c in cl],
                        [c.data_ms_per_sample for c in cl]], dtype=np.float64).reshape(5, len(cl)),
        calibrated=np.array([[c.layer_overhead_ms for c in cl], [c.optimizer_ms_per_layer for c in cl]],
                            dtype=np.float64).reshape(2, len(cl)),
    )
    memo.arrays = arrays
    return arrays


@dataclass(frozen=True, slots=True, kw_only=True)
class JobConsts:
    """Per-job constants of the cost model (symbols of :mod:`spiderflow.core.costmodel`)."""

    layers: int
    m: int
    b: int
    s: int
    h: int
    heads: int
    vocab: int
    f: float  # forward FLOPs per layer per micro-batch
    head_f: float  # forward FLOPs of the head per micro-batch
    act: float  # bytes of one activation (or its gradient) in the job's precision: the TP all-reduce's message
    p_layer: float  # parameters per layer
    p_embed: float  # embedding parameters
    gpus_min: int
    gpus_max: int
    tokens: int
    p_head: float | None = None  # the head's parameters (None: as many as the embedding, a GPT-shaped head)
    precision: Precision = Precision.BF16  # the job's precision (compute rates, value and state bytes)
    state_bytes: float = 16.0  # weights, gradients and Adam state per parameter (replicated)
    grad_bytes: float = 4.0  # bytes per gradient value in the data-parallel all-reduce (fp32 in every precision)

    def wire_act(self, wire: int) -> float:
        """Bytes of one activation crossing a stage boundary from a cluster whose GPU type sends ``wire``-byte
        values: ``max(wire, value bytes)·b·s·h`` (:func:`~spiderflow.core.costmodel.wire_bytes`)."""
        return float(max(wire, self.precision.value_bytes)) * self.b * self.s * self.h

    @property
    def head_params(self) -> float:
        """The head's parameters (:attr:`~spiderflow.core.catalog.ModelSpec.head_params`)."""
        return self.p_embed if self.p_head is None else self.p_head

    def act_layer(self, tp: float | FArr) -> Any:
        """Activation bytes one in-flight micro-batch pins per layer on one GPU at TP degree ``tp``."""
        return self.s * self.b * self.h * (10.0 + 24.0 / tp + 5.0 * self.heads * self.s / (self.h * tp))

    def act_head(self, tp: float | FArr, in_flight: int = 1) -> Any:
        """The loss's bytes per GPU of the last stage with ``in_flight`` micro-batches in flight
        (:func:`~spiderflow.core.costmodel.loss_bytes`: the saved log-softmax per micro-batch, the logits' copies
        and gradients once). The chain scorers price 1F1B, whose last stage holds one micro-batch: their tables
        take the default, and their ``in-flight × head bytes`` at the last position is this figure."""
        return (in_flight * LOGIT_SAVED_BYTES + LOGIT_ONCE_BYTES) * self.b * self.s * self.vocab / tp


def job_consts(job: JobSpec) -> JobConsts:
    """Constants of ``job``; the micro-batch count is ``global_batch / micro_batch``; values, gradients and
    state in the job's precision (:func:`~spiderflow.core.costmodel.state_bytes_per_param` of a replicated stage,
    :func:`~spiderflow.core.costmodel.grad_bytes_per_value`)."""
    model = job.model
    m = job.micro_batches_total
    b = max(1, job.global_batch // m)
    return JobConsts(
        layers=model.layers, m=m, b=b, s=job.seq_len, h=model.hidden, heads=model.heads, vocab=model.vocab,
        f=layer_fwd_flops(model, b, job.seq_len), head_f=2.0 * b * job.seq_len * model.hidden * model.vocab,
        act=activation_bytes(model, b, job.seq_len, job.precision.value_bytes),
        p_layer=float(model.params_per_layer), p_embed=float(model.embedding_params), gpus_min=job.gpus.min,
        gpus_max=job.gpus.max, tokens=job.tokens_per_step, p_head=float(model.head_params), precision=job.precision,
        state_bytes=float(state_bytes_per_param(job.precision)), grad_bytes=float(grad_bytes_per_value(job.precision)),
    )


def transfer_matrix(ta: TopoArrays, jc: JobConsts) -> FArr:
    """``P_uv`` seconds for one activation between every pair (widest path; ``inf`` if unreachable), in the
    sending cluster's wire format and the job's precision (:meth:`JobConsts.wire_act`). A pair is reachable
    only if both directions are: a pipeline sends activations ``u → v`` and gradients back ``v → u`` (a live
    snapshot can hold one direction before the other's agent has measured it)."""
    sent = np.array([jc.wire_act(int(w)) for w in ta.wire], dtype=np.float64)[:, None]
    p = transfer_times(sent, ta.bw, ta.lat_ms)
    p[np.isinf(p.T)] = np.inf
    np.fill_diagonal(p, 0.0)
    return p


def objective_value(step_s: Any, usd: Any, objective: Objective) -> Any:
    """The score to minimise: step time, dollars per step, or ``step · √usd`` (balanced)."""
    if objective is Objective.COST:
        return usd
    if objective is Objective.BALANCED:
        return step_s * np.sqrt(usd)
    return step_s


def plan_objective(plan: Plan, objective: Objective) -> float:
    """:func:`objective_value` of an evaluated plan."""
    return float(objective_value(plan.step_time_s, plan.usd_per_step, objective))


# --------------------------------------------------------------------------------------------------
# Vectorised chain scorer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainScores:
    """Scores of ``N`` candidate chains. ``feasible`` = memory capacity suffices, every position gets a
    layer, the GPUs used lie in the job's range and every hop is reachable."""

    step: FArr
    usd: FArr
    gpus: IArr
    feasible: BArr
    capacity_ratio: FArr  # Σ cap / L (≥ 1 when the chain can hold the model)
    layers: FArr  # the continuous, capacity water-filled layer split (N × K)

    def score(self, objective: Objective) -> FArr:
        out = np.asarray(objective_value(self.step, self.usd, objective), dtype=np.float64)
        return np.where(self.feasible, out, np.inf)


_TP_CHOICES = np.array([1, 2, 4, 8], dtype=np.int64)[:, None, None]
"""The tensor-parallel degrees :func:`score_chains` weighs, along a leading axis."""


@dataclass(frozen=True, slots=True)
class ScoreTables:
    """Per-cluster and per-degree figures :func:`score_chains` reads, for one topology's arrays and one job:
    computed once (:func:`score_tables`) and gathered per chain position. Every entry is the expression the
    scorer would otherwise evaluate per position, on the same operands, so the scores are the same."""

    ta: TopoArrays
    jc: JobConsts
    fig: FArr  # (11, n): flops, memory bytes, intra and inter Gbit/s, watts, $/kWh, then the measured work
    # outside the blocks: the embedding's seconds per micro-batch, its optimizer's seconds per step, the input
    # pipeline's seconds per micro-batch (b samples), the head's optimizer's seconds per step; then the calibrated
    # optimizer seconds per layer and step (u_c)
    ints: IArr  # (2, n): GPUs per node, largest TP degree
    per_layer_t: FArr  # (4, n): per TP choice, 3f/(t·F) + 4·AR_t(A) + o_c seconds per layer (o_c calibrated)
    head_t: FArr  # (4, n): per TP choice, 3·f_head/(t·F), or the measured head's η·b·s (not divided by t)
    by_tp: FArr  # (5, 9): indexed by TP degree 1..8: w·p/t, activation bytes per layer, w·p_embed/t, head bytes,
    # gradient bytes per value (w: state bytes per parameter; all in the job's precision)


def score_tables(ta: TopoArrays, jc: JobConsts) -> ScoreTables:
    """The :class:`ScoreTables` of ``ta`` and ``jc`` (rates, message, gradient and state bytes in the job's
    precision)."""
    rate = ta.rate(jc.precision)
    fl = rate[None, :]
    ar_tp = allreduce_times(jc.act, _TP_CHOICES[:, :, 0], ta.intra[None, :])
    with np.errstate(divide="ignore", invalid="ignore"):
        # with the calibrated fixed time per layer (costmodel.stage_compute_time; 0 unless calibrated)
        per_layer_t = 3.0 * jc.f / (_TP_CHOICES[:, :, 0] * fl) + 4.0 * ar_tp + ta.calibrated[0][None, :] / 1e3
        head_t = 3.0 * jc.head_f / (_TP_CHOICES[:, :, 0] * fl)
    # Measured head and loss (costmodel.measured_outer_time): replicated under TP, so the same at every degree.
    head_t = np.where(ta.outer[1] != 0.0, ta.outer[1] * jc.b * jc.s / 1e6, head_t)
    outer = np.stack([np.where(ta.outer[0] != 0.0, ta.outer[0] * jc.b * jc.s / 1e6, 0.0), ta.outer[2] / 1e3,
                      ta.outer[4] * jc.b / 1e3, ta.outer[3] / 1e3, ta.calibrated[1] / 1e3])
    by_tp = np.zeros((5, 9))
    for t in (1, 2, 4, 8):
        by_tp[:, t] = (jc.state_bytes * jc.p_layer / t, jc.act_layer(t), jc.state_bytes * jc.p_embed / t,
                       jc.act_head(t), jc.grad_bytes)
    return ScoreTables(
        ta=ta, jc=jc, fig=np.concatenate([np.stack([rate, ta.mem, ta.intra, ta.inter, ta.watts, ta.price]), outer]),
        ints=np.stack([ta.gpn, ta.tp_cap]), per_layer_t=np.asarray(per_layer_t, dtype=np.float64),
        head_t=np.asarray(head_t, dtype=np.float64), by_tp=by_tp,
    )


def score_chains(ta: TopoArrays, jc: JobConsts, p: FArr, chains: IArr, gpus: IArr,
                 tables: ScoreTables | None = None) -> ChainScores:
    """Closed-form scores of chains (see the module docstring). ``chains``/``gpus``: ``N × K``, ``-1``/0 pad.

    Positions are left-aligned (valid positions first). O(N·K), compiled
    (:func:`spiderflow.core.kernels.scorer.score_rows`). Each row's scores depend on that row alone (not on the
    other chains or the padding width). ``tables``: :func:`score_tables` of ``ta`` and ``jc`` when the caller
    scores many batches (else computed here).
    """
    if tables is None or tables.ta is not ta or tables.jc is not jc:
        tables = score_tables(ta, jc)
    chains = np.ascontiguousarray(chains, dtype=np.int64)
    n, k = chains.shape
    step = np.empty(n)
    usd = np.empty(n)
    used = np.empty(n, dtype=np.int64)
    feasible = np.empty(n, dtype=np.bool_)
    capacity = np.empty(n)
    layers = np.empty((n, k))
    score_rows(chains, np.ascontiguousarray(gpus, dtype=np.int64), tables.fig, tables.ints, tables.per_layer_t,
               tables.head_t, tables.by_tp, np.ascontiguousarray(p, dtype=np.float64), int(jc.m), int(jc.layers),
               float(jc.p_layer), float(jc.p_embed), int(jc.gpus_min), int(jc.gpus_max), _RESERVED_BYTES,
               step, usd, used, feasible, capacity, layers)
    return ChainScores(step=step, usd=usd, gpus=used, feasible=feasible, capacity_ratio=capacity, layers=layers)


_RESERVED_BYTES = RESERVED_GIB * GIB


def allocate_greedy(ta: TopoArrays, chains: IArr, gpus_max: int, rate: FArr | None = None) -> IArr:
    """GPUs per chain position: the fastest clusters of each chain (by ``rate``, FLOP/s per GPU: the job's
    precision's, :meth:`TopoArrays.rate`; ``ta.flops`` when not given) take all their free GPUs first (ties:
    chain order), until ``gpus_max`` is reached (``N × K`` in, ``N × K`` out; compiled,
    :func:`spiderflow.core.kernels.scorer.greedy_rows`)."""
    chains = np.ascontiguousarray(chains, dtype=np.int64)
    out = np.empty_like(chains)
    greedy_rows(chains, ta.free, ta.flops if rate is None else rate, int(gpus_max), out)
    return out


# --------------------------------------------------------------------------------------------------
# Level-1 fallback planner (exact cost model formulas; the split search runs compiled)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Block:
    """The chosen configuration of one cluster's layer block."""

    excess: float  # bytes over memory on the worst GPU (≤ 0 when it fits)
    local: float  # the block's own objective
    pp: int
    tp: int
    dp: int
    sizes: tuple[int, ...]
    tmax: float  # slowest sub-stage T
    tsum: float  # Σ sub-stage T
    y: float  # max over sub-stages of the gradient all-reduce plus the calibrated optimizer step and the measured
    # per-step work
    p_int: float  # internal boundary time


def _position(jc: JobConsts, c: Cluster, g: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """One chain position's row of the kernels' ``pos`` and ``pos_i`` (:mod:`spiderflow.core.kernels.fallback`):
    memory bytes per GPU left after the reserve, intra- and inter-node Gbit/s, ``P_int``, then per tensor
    degree ``tp = 2^t ≤ min(8, GPUs/node, g)`` the block's ``T`` per layer (the cluster's calibrated
    ``layer_overhead_ms`` included), activation bytes per layer, head activation bytes and head ``T`` (zeros for
    the degrees not tried), then the work outside the blocks a profile measured (from
    :data:`~spiderflow.core.kernels.fallback.OUTER`: the embedding's seconds per micro-batch, its optimizer's
    seconds per step, the input pipeline's seconds per micro-batch of ``b`` samples, the head optimizer's seconds
    per step; 0 where not measured), then the calibrated optimizer seconds per layer and step
    (:data:`~spiderflow.core.kernels.fallback.OPTIMIZER`, ``optimizer_ms_per_layer``; 0 unless calibrated);
    ``(g, GPUs per node, degrees tried)``. Memoised process-wide (bounded, :func:`_position_row`) on the job's
    constants, the cluster's figures and ``g``: a pure function of those values, shared by every snapshot that
    has such a cluster."""
    return _position_row(jc, compute_rate_tflops(c, jc.precision) * 1e12, c.gpu_memory_gib, c.gpus_per_node,
                         c.intra_node_gbps, c.inter_node_gbps, jc.wire_act(c.gpu_type.wire_bytes), g,
                         c.head_us_per_token, c.embedding_us_per_token, c.embedding_optimizer_ms,
                         c.data_ms_per_sample, c.head_optimizer_ms, c.layer_overhead_ms, c.optimizer_ms_per_layer)


@lru_cache(maxsize=50_000)
def _position_row(jc: JobConsts, fl: float, mem_gib: float, gpn: int, intra: float, inter: float, wire: float,
                  g: int, head_us: float = 0.0, embed_us: float = 0.0, embed_opt_ms: float = 0.0,
                  data_ms: float = 0.0, head_opt_ms: float = 0.0, overhead_ms: float = 0.0,
                  opt_ms: float = 0.0) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """:func:`_position` of a cluster with these figures (``fl`` FLOP/s per GPU in the job's precision,
    ``wire`` activation bytes on the wire, ``head_us`` the head's measured µs per token, 0 if not measured:
    then the head's ``T`` is that time at every degree, as :func:`~spiderflow.core.costmodel.stage_compute_time`
    prices it, instead of its FLOPs; ``embed_us``, ``embed_opt_ms``, ``data_ms``, ``head_opt_ms`` the
    profile's ``embedding_us_per_token``, ``embedding_optimizer_ms``, ``data_ms_per_sample`` and
    ``head_optimizer_ms``, 0 if not measured, as :func:`~spiderflow.core.costmodel.measured_outer_time` and
    :func:`~spiderflow.core.costmodel.measured_step_extra` price them; ``overhead_ms`` and ``opt_ms`` the
    cluster's calibrated ``layer_overhead_ms`` and ``optimizer_ms_per_layer``, 0 unless calibrated, as
    :func:`~spiderflow.core.costmodel.stage_compute_time` and :func:`~spiderflow.core.costmodel.breakdown` price
    them)."""
    row: list[float] = [mem_gib * GIB - RESERVED_GIB * GIB, intra, inter, transfer_time(wire, inter, 0.0)]
    tp = 1
    while tp <= min(_MAX_TP, gpn, g):
        ar_tp = allreduce_time(jc.act, tp, intra if tp <= gpn else inter)
        head_t = head_us * jc.b * jc.s / 1e6 if head_us else 3.0 * jc.head_f / (tp * fl)
        row += [3.0 * jc.f / (tp * fl) + 4.0 * ar_tp + overhead_ms / 1e3, jc.act_layer(tp), jc.act_head(tp), head_t]
        tp *= 2
    n = (len(row) - 4) // 4
    row += [0.0] * (OUTER - len(row))
    row += [embed_us * jc.b * jc.s / 1e6 if embed_us else 0.0, embed_opt_ms / 1e3, data_ms * jc.b / 1e3,
            head_opt_ms / 1e3]
    row += [0.0] * (OPTIMIZER - len(row))
    row += [opt_ms / 1e3]
    return tuple(row), (g, gpn, n)


class _ChainEval:
    """Evaluates layer splits of one ordered allocation with the exact cost-model formulas, compiled
    (:mod:`spiderflow.core.kernels.fallback`). A block depends only on its position, its layer count and the
    stages downstream of its start; the blocks chosen are memoised per evaluator."""

    def __init__(self, topo: Topology, job: JobSpec, alloc: Sequence[tuple[str, int]], *, exact_gpus: bool,
                 slack: int = 0, every_shape: bool = False):
        self.jc = jc = job_consts(job)
        self.clusters = [topo.cluster(c) for c, _ in alloc]
        self.gpus = [g for _, g in alloc]
        self.exact = exact_gpus
        self.slack = slack if exact_gpus else 0  # GPUs each cluster may leave unused in exact mode
        self.hops = []
        for (a, _), (b, _) in itertools.pairwise(alloc):
            sent = jc.wire_act(topo.cluster(a).gpu_type.wire_bytes)
            self.hops.append(transfer_time(sent, topo.bandwidth_gbps(a, b), topo.latency_ms(a, b)))
        rows = [_position(jc, c, g) for c, g in zip(self.clusters, self.gpus, strict=True)]
        k = len(rows)
        self.pos = np.array([x for r in rows for x in r[0]], dtype=np.float64).reshape(k, POS_WIDTH)
        self.pos_i = np.array([x for r in rows for x in r[1]], dtype=np.int64).reshape(k, 3)
        self.job_f = np.array([jc.p_layer, jc.p_embed, jc.head_params, jc.state_bytes, jc.grad_bytes],
                              dtype=np.float64)
        mode = 1 if exact_gpus else 2 if every_shape else 0  # the kernel's GPU mode
        self.job_i = np.array([jc.m, jc.layers, mode, self.slack], dtype=np.int64)
        self.hop_arr = np.array(self.hops, dtype=np.float64)
        self.memo = new_memo(k, jc.layers, jc.m)
        self.memory_first: tuple[int, tuple[list[int], list[_Shape]] | None] | None = None  # memory_first_split

    def _blocks(self, sizes: Sequence[int], out_f: FArr, out_i: IArr) -> list[_Block]:
        blocks: list[_Block] = []
        for nl, (excess, local, tmax, tsum, y), (pp, tp, dp, big), p_int in zip(
                sizes, out_f.tolist(), out_i.tolist(), self.pos[:, 3].tolist(), strict=True):
            base, rem = divmod(nl, pp)
            shape = (base + 1,) * rem + (base,) * (pp - rem) if big else (base,) * (pp - rem) + (base + 1,) * rem
            blocks.append(_Block(excess, local, pp, tp, dp, shape, tmax, tsum, y, p_int))
        return blocks

    def excess_step(self, sizes: Sequence[int], pps: Sequence[int]) -> tuple[float, float]:
        """``(memory excess, step time)`` of a layer split (every block ≥ 1 layer) given assumed sub-stage
        counts."""
        return self._evaluate(sizes, pps)[:2]

    def evaluate_split(self, sizes: Sequence[int], pps: Sequence[int]) -> tuple[float, float, list[_Block]]:
        """``(memory excess, step time, blocks)`` of a layer split (every block ≥ 1 layer) given assumed
        sub-stage counts. The step is the cost model's ``(m − 1)·max(beat, boundaries) + Σ T + 2·Σ boundaries
        + max Y``, summed in chain order."""
        excess, step, out_f, out_i = self._evaluate(sizes, pps)
        return excess, step, self._blocks(sizes, out_f, out_i)

    def _evaluate(self, sizes: Sequence[int], pps: Sequence[int]) -> tuple[float, float, FArr, IArr]:
        k = len(self.gpus)
        out_f = np.empty((k, 5))
        out_i = np.empty((k, 4), dtype=np.int64)
        excess, step = evaluate_split_kernel(
            np.array(sizes, dtype=np.int64), np.array(pps, dtype=np.int64), self.pos, self.pos_i,
            self.hop_arr, self.job_f, self.job_i, *self.memo, out_f, out_i)
        return excess, step, out_f, out_i

    def optimise(self, sizes: Sequence[int], *, local_search: bool) -> tuple[list[int], list[_Block],
                                                                             tuple[float, float]]:
        """The split search of the module docstring from ``sizes`` (step 3, one start): the final split, its
        blocks and ``(memory excess, step time)`` of that split under the blocks' own sub-stage counts."""
        k = len(self.gpus)
        arr = np.array(sizes, dtype=np.int64)
        out_f = np.empty((k, 5))
        out_i = np.empty((k, 4), dtype=np.int64)
        key = optimise_split_kernel(arr, local_search, self.pos, self.pos_i, self.hop_arr, self.job_f,
                                    self.job_i, *self.memo, out_f, out_i)
        final = arr.tolist()
        return final, self._blocks(final, out_f, out_i), key


def _proportional_split(weights: Sequence[float], layers: int) -> list[int]:
    k = len(weights)
    tot = sum(weights)
    raw = [layers * w / tot for w in weights] if tot > 0 else [layers / k] * k
    sizes = [max(1, math.floor(x)) for x in raw]
    while sum(sizes) > layers:
        j = max((i for i in range(k) if sizes[i] > 1), key=lambda i: sizes[i] - raw[i])
        sizes[j] -= 1
    while sum(sizes) < layers:
        j = max(range(k), key=lambda i: raw[i] - sizes[i])
        sizes[j] += 1
    return sizes


def _blocks_to_plan(ev: _ChainEval, alloc: Sequence[tuple[str, int]], sizes: Sequence[int],
                    blocks: Sequence[_Block]) -> Plan:
    stages: list[Stage] = []
    first = 0
    for (name, _), blk in zip(alloc, blocks, strict=True):
        for sz in blk.sizes:
            stages.append(Stage(cluster=name, first_layer=first, last_layer=first + sz - 1, tp=blk.tp, dp=blk.dp))
            first += sz
    return Plan(stages=tuple(stages), micro_batches=ev.jc.m, schedule=Schedule.ONE_F_ONE_B)


def _validate_allocation(topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]]) -> None:
    if not allocation:
        raise ValidationError("allocation", "a chain needs at least one cluster", [])
    seen: set[str] = set()
    for i, (name, g) in enumerate(allocation):
        c = topo.cluster(name)
        if name in seen:
            raise ValidationError(f"allocation[{i}]", "a cluster appears twice in the chain", name)
        seen.add(name)
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValidationError(f"allocation[{i}].gpus", "must be a positive integer", g)
        if g > c.free:
            raise UnschedulableError(
                f"cluster {name} has {c.free} free GPUs, {g} requested", constraint="free_gpus"
            )
    if len(allocation) > job.model.layers:
        raise UnschedulableError(
            f"a chain of {len(allocation)} clusters needs ≥ {len(allocation)} layers; the model has "
            f"{job.model.layers}", constraint="layers",
        )


def _finish(topo: Topology, job: JobSpec, plan: Plan) -> Plan:
    plan = evaluate(plan, topo, job)
    ok, worst, excess = fits_memory(plan, topo)
    if not ok:
        st = plan.stages[worst]
        raise UnschedulableError(
            f"stage {worst} on {st.cluster} needs {plan.memory_gib_per_gpu[worst]:.1f} GiB per GPU, "
            f"{excess:.1f} GiB more than its GPUs have", constraint="memory",
        )
    return plan


@dataclass(frozen=True, slots=True)
class _Shape:
    """One block of a memory-first structure: degrees, sub-stages, the most layers they hold (balanced
    sizes) and whether the bigger sub-stages come first."""

    tp: int
    pp: int
    dp: int
    cap: int
    big_first: bool


def memory_first_split(ev: _ChainEval) -> tuple[int, tuple[list[int], list[_Shape]] | None]:
    """A layer split and per-block degrees that fit memory, when the level-1 search found none: the
    shallowest pipeline whose blocks hold every layer.

    Dynamic programme from the last block to the first over the number of stages downstream ``d`` (the
    in-flight depth of every earlier block): per ``d`` the most layers the blocks from here on hold (over the
    planner's degrees: the most layers a block holds at degrees ``(tp, pp, ⌊g/(tp·pp)⌋)`` with balanced
    sub-stage sizes, as the planner forms them, under the cost model's 1F1B memory with exact in-flight
    counts, the embedding on the chain's first sub-stage and the head on its last), keeping only states that
    hold more with more stages (fewer stages downstream never hurt an earlier block). The first structure, by
    stage count, that holds ``L`` layers gets a split in proportion to ``g·F`` within each block's
    ``[pp, cap]``. Compiled (:func:`spiderflow.core.kernels.fallback.memory_first`).

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
    found = np.empty((k, 5), dtype=np.int64)
    most, fits = memory_first_kernel(ev.pos, ev.pos_i, ev.job_f, ev.job_i, found)
    if not fits:
        return most, None
    chosen = [_Shape(tp=tp, pp=pp, dp=dp, cap=cap, big_first=big == 1) for tp, pp, dp, cap, big in found.tolist()]
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
    every_shape: bool = False,
) -> Plan:
    """The level-1 planner of the module docstring for an ordered ``allocation`` of ``(cluster, gpus)``.

    Returns an evaluated plan using at most ``gpus`` GPUs per cluster (exactly ``gpus`` when that is needed
    to keep the job's GPU minimum). Raises :class:`UnschedulableError` (``constraint`` = ``memory``,
    ``layers`` or ``free_gpus``) when no split fits. ``objective`` is accepted for interface parity; the
    split minimises step time (for fixed GPUs, dollars per step are proportional to it).

    A block prefers the shapes that use all of its cluster's GPUs (and ``pp = 1`` with ``dp = ⌊g/tp⌋``), and
    takes a pipelined shape that leaves some idle only when none of those fits memory. ``every_shape``: all
    shapes ``(tp, pp, ⌊g/(tp·pp)⌋)`` compete alike (on 31 GPUs, ``pp 3 × tp 2 × dp 5`` on 30 against
    ``tp 4 × dp 7`` on 28); :func:`finalise` asks for this plan's GPUs as one more allocation for TPA.
    """
    del objective
    _validate_allocation(topo, job, allocation)
    ev = _ChainEval(topo, job, allocation, exact_gpus=False, every_shape=every_shape)
    weights = [g * compute_rate_tflops(c, ev.jc.precision) for (_, g), c in zip(allocation, ev.clusters, strict=True)]
    start = _proportional_split(weights, job.model.layers)
    first_ev = ev
    if ev.excess_step(start, [1] * len(start))[0] > 0:
        # Over memory from the start: the memory-first structures tell at once whether anything can fit.
        most = memory_first_split(ev)[0]
        if most < job.model.layers:
            raise UnschedulableError(
                f"no split of {job.model.name}'s {job.model.layers} layers fits the memory of this chain: with "
                f"the micro-batches in flight its clusters hold at most {most} at any degrees", constraint="memory")
    sizes, blocks, key = ev.optimise(start, local_search=True)
    if len(allocation) > 1:
        # Second start: the scorer's memory-aware water-filled split (escapes memory-bound local optima).
        ta = topo_arrays(topo)
        chain = np.array([[topo.index[c] for c, _ in allocation]], dtype=np.int64)
        gpus = np.array([[g for _, g in allocation]], dtype=np.int64)
        filled = score_chains(ta, ev.jc, transfer_matrix(ta, ev.jc), chain, gpus).layers[0]
        start = _proportional_split([float(x) for x in filled], job.model.layers)
        if start != sizes:
            sizes2, blocks2, key2 = ev.optimise(start, local_search=True)
            if key2 < key:
                sizes, blocks, key = sizes2, blocks2, key2
    if key[0] > 0:
        # Over memory: start once more from the memory-first structure's split (it fits under that
        # structure's degrees, so the search usually ends within memory from there).
        split = memory_first_split(ev)[1]
        if split is not None and split[0] != sizes:
            sizes3, blocks3, key3 = ev.optimise(list(split[0]), local_search=True)
            if key3 < key:
                sizes, blocks, key = sizes3, blocks3, key3
    if sum(b.pp * b.tp * b.dp for b in blocks) < job.gpus.min <= sum(g for _, g in allocation):
        # Keep the GPU minimum: first let each cluster leave at most the range's slack unused, then none.
        slack = sum(g for _, g in allocation) - job.gpus.min
        for sl in ((slack, 0) if slack > 0 else (0,)):
            ev = _ChainEval(topo, job, allocation, exact_gpus=True, slack=sl)
            sizes_x, blocks_x, _ = ev.optimise(sizes, local_search=True)
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
    sizes, blocks, _ = ev.optimise(list(sizes), local_search=False)
    return _finish(topo, job, _blocks_to_plan(ev, allocation, sizes, blocks))


Level2 = Literal["exact", "cpsat"]
LEVEL2_CHOICES: tuple[Level2, ...] = ("exact", "cpsat")
"""TPA's level-2 solvers (the same names as :data:`spiderflow.core.tpa.level2.LEVEL2_SOLVERS`, which this
module cannot import: TPA is optional here)."""


def _check_level2(level2: str) -> None:
    if level2 not in LEVEL2_CHOICES:
        raise ValidationError("level2", f"must be one of {', '.join(LEVEL2_CHOICES)}", level2)


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalPlanner:
    """The in-process :class:`~spiderflow.core.placement.base.Planner`: TPA (:func:`spiderflow.core.tpa.plan_chain`,
    level 2 solved by ``level2``) when importable, else the level-1 planner; memoised (:func:`plan_chain`).
    The Planner service runs the same code for the same inputs (``services.planner.client.RemotePlanner``)."""

    level2: Level2 = "exact"

    def __post_init__(self) -> None:
        _check_level2(self.level2)

    @property
    def name(self) -> str:
        return f"local/{self.level2}"

    def plan(self, topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], options: PlanOptions) -> Plan:
        """The plan of ``allocation`` (see :class:`~spiderflow.core.placement.base.Planner`)."""
        if options.max_in_flight is not None:
            from spiderflow.core.tpa import plan_chain as tpa_plan_chain

            capped: Plan = tpa_plan_chain(topo, job, allocation, objective=options.objective, level2=self.level2,
                                          max_in_flight=options.max_in_flight, explain=options.explain)
            return capped
        return plan_chain(topo, job, allocation, objective=options.objective, level2=self.level2,
                          explain=options.explain)


LOCAL_PLANNER = LocalPlanner()
"""The default planner of the policies that plan their chains (SpinSearch, BACE)."""


def tpa_available() -> bool:
    """Whether the TPA planner's ``plan_chain`` can be imported."""
    try:
        from spiderflow.core.tpa import plan_chain as _pc  # noqa: F401
    except ImportError:
        return False
    return True


def plan_chain(
    topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], *, objective: Objective = Objective.JCT,
    level2: Level2 = "exact", explain: bool = True,
) -> Plan:
    """Plan an ordered allocation with the TPA planner when available, else :func:`fallback_plan_chain`.
    ``level2``: TPA's solver for the plan's blocks (``"exact"`` or ``"cpsat"``, see
    :func:`spiderflow.core.tpa.plan_chain`); ``explain=False``: a caller that holds another plan of the chain only
    needs to know that TPA's does not fit (the memory error is then the cheaper one of
    :func:`spiderflow.core.tpa.plan_chain`; the plans are the same).

    Memoised across calls (:func:`cached_plan`): both planners are pure functions of the job's shape,
    the allocation, the allocated clusters' static figures and the paths between them."""
    _check_level2(level2)
    return cached_plan("plan_chain", topo, job, allocation, objective,
                       lambda t, j, a, o: _plan_chain_uncached(t, j, a, o, level2, explain),
                       variant=level2 if explain else f"{level2}/brief")


def _plan_chain_uncached(
    topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], objective: Objective,
    level2: Level2 = "exact", explain: bool = True,
) -> Plan:
    try:
        from spiderflow.core.tpa import plan_chain as tpa_plan_chain
    except ImportError:
        return fallback_plan_chain(topo, job, allocation, objective=objective)
    plan: Plan = tpa_plan_chain(topo, job, allocation, objective=objective, level2=level2, explain=explain)
    return plan


PLAN_CACHE_SIZE = 4096
_PLAN_CACHE: BoundedTable[Plan | UnschedulableError] = BoundedTable(PLAN_CACHE_SIZE)
"""Chain plans by :func:`plan_key`: a memo of a pure function keyed by value (every figure the plan depends
on is in the key, none by identity), so it is shared across snapshots and topology revisions: a new
revision keeps the plans of the allocations whose clusters and paths it did not change."""
_PLAN_CACHE_STATS = {"hits": 0, "misses": 0}


_STATIC_FIELDS = tuple(f.name for f in fields(Cluster) if f.name != "free_gpus")
"""Every field of a cluster but its free GPUs (calibration fields included)."""


def _static(c: Cluster) -> tuple[Any, ...]:
    """Every field of the cluster except its free GPUs (calibration fields included)."""
    return tuple(getattr(c, f) for f in _STATIC_FIELDS)


def plan_key(topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]],
             objective: Objective, *, tpa_only: bool = False) -> tuple[Any, ...] | None:
    """What a chain plan depends on, or ``None`` when the allocation is not valid on ``topo`` (then the
    planner is called, so it raises its own error). The plan is a pure function of: the job's shape
    (model, global and micro batch, sequence length, GPU range, precision — not its id, steps or arrival), the
    ordered allocation, each allocated cluster's static figures (not its free GPUs: they only bound the
    allocation, checked here), the widest-path bandwidth and latency between every pair of allocated
    clusters, and the objective. ``tpa_only``: the key of a TPA plan, which reads only the model, the
    global batch, the sequence length and the precision of the job (it chooses the micro-batch count itself)."""
    idx = topo.index
    seen: set[str] = set()
    for name, g in allocation:
        i = idx.get(name)
        if i is None or name in seen or isinstance(g, bool) or not isinstance(g, int):
            return None
        if not 1 <= g <= topo.clusters[i].free:
            return None
        seen.add(name)
    if not allocation:
        return None
    ii = [idx[n] for n, _ in allocation]
    bw = topo.bandwidth_matrix[np.ix_(ii, ii)]
    lat = topo.latency_matrix[np.ix_(ii, ii)]
    shape = (job.model, job.global_batch, job.seq_len, job.precision) if tpa_only else (
        job.model, job.global_batch, job.micro_batch, job.seq_len, job.gpus, job.precision)
    return (*shape, tuple(allocation), tuple(_static(topo.clusters[i]) for i in ii), bw.tobytes(), lat.tobytes(),
            objective)


def cached_plan(
    kind: str, topo: Topology, job: JobSpec, allocation: Sequence[tuple[str, int]], objective: Objective,
    planner: Any, *, variant: str = "",
) -> Plan:
    """``planner(topo, job, allocation, objective)`` memoised by :func:`plan_key` (process-wide, at most
    :data:`PLAN_CACHE_SIZE` entries, oldest dropped first); ``variant`` tells apart planners of the same
    ``kind`` run with other options. An :class:`UnschedulableError` is memoised too and raised again;
    other errors are not memoised."""
    key = plan_key(topo, job, [(n, g) for n, g in allocation], objective,
                   tpa_only=kind == "plan_chain" and tpa_available())
    if key is None:
        plan: Plan = planner(topo, job, allocation, objective)
        return plan
    key = (kind, variant, *key)
    hit = _PLAN_CACHE.get(key)
    if hit is not None:
        _PLAN_CACHE_STATS["hits"] += 1
        if isinstance(hit, UnschedulableError):
            raise hit
        return hit
    _PLAN_CACHE_STATS["misses"] += 1
    try:
        out: Plan | UnschedulableError = planner(topo, job, allocation, objective)
    except UnschedulableError as e:
        out = e
    _PLAN_CACHE.put(key, out)
    if isinstance(out, UnschedulableError):
        raise out
    return out


def plan_cache_clear() -> None:
    """Forget every memoised chain plan and chain-position row and reset the counters (for tests and
    benchmarks)."""
    _PLAN_CACHE.clear()
    _position_row.cache_clear()
    _PLAN_CACHE_STATS.update(hits=0, misses=0)


def plan_cache_stats() -> dict[str, int]:
    """Hits and misses of the chain-plan cache since the process started."""
    return {**_PLAN_CACHE_STATS, "size": len(_PLAN_CACHE)}


def chain_allocation(plan: Plan) -> list[tuple[str, int]] | None:
    """The chain allocation ``plan`` uses — ``(cluster, GPUs)`` in chain order, a cluster's consecutive
    stages summed — as :func:`plan_chain` takes it; ``None`` when no allocation describes the plan (replicas
    spread over clusters, or a cluster that appears twice apart)."""
    out: list[tuple[str, int]] = []
    for s in plan.stages:
        if s.replicas:
            return None
        if out and out[-1][0] == s.cluster:
            out[-1] = (s.cluster, out[-1][1] + s.tp * s.dp)
        elif any(c == s.cluster for c, _ in out):
            return None
        else:
            out.append((s.cluster, s.tp * s.dp))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Finalised:
    """The outcome of :func:`finalise`: the plan, which planner made it, and the time spent planning."""

    plan: Plan | None
    planner: str
    plan_seconds: float
    error: UnschedulableError | None
    challenger: int = -1
    """The index of the challenger (``finalise(challengers=...)``) whose plan was kept; -1: none was."""


def _every_shape_allocation(topo: Topology, job: JobSpec, alloc: Sequence[tuple[str, int]],
                            objective: Objective, level1: Plan) -> list[tuple[str, int]] | None:
    """The GPUs per cluster of ``alloc``'s level-1 plan with every shape competing alike
    (:func:`fallback_plan_chain` with ``every_shape``) when that plan is better by ``objective`` than
    ``level1``, the allocation's level-1 plan (only then is it worth a TPA plan); else None."""
    try:
        plan = cached_plan("fallback", topo, job, alloc, objective,
                           lambda t, j, a, o: fallback_plan_chain(t, j, a, objective=o, every_shape=True),
                           variant="every-shape")
    except UnschedulableError:
        return None
    return chain_allocation(plan) if plan_objective(plan, objective) < plan_objective(level1, objective) else None


def finalise(
    topo: Topology,
    job: JobSpec,
    allocations: Sequence[Sequence[tuple[str, int]]],
    *,
    objective: Objective = Objective.JCT,
    planner: Planner | None = LOCAL_PLANNER,
    tolerance: float = 0.0,
    force: bool = False,
    replan: int = 1,
    challengers: Sequence[Sequence[tuple[str, int]]] = (),
    challengers_may_grow: bool = True,
    challenger_margin: float = 0.0,
) -> Finalised:
    """Plan each candidate allocation with the fast level-1 planner, keep the best valid plan by
    ``objective``, then (with a ``planner``: in process, TPA, or the Planner service) re-plan the ``replan``
    best allocations by their level-1 plans with it — each allocation as given and, where its level-1 plan
    leaves GPUs idle, the GPUs that plan uses; for the best one also the GPUs of its level-1 plan with every
    shape competing alike (``fallback_plan_chain(every_shape=True)``) where that plan is the better level-1
    plan — and keep the best of these plans and the best level-1 plan on the exact timeline (TPA's
    prediction, :func:`spiderflow.core.tpa.timeline.evaluate_on_timeline`; the level-1 plans are ranked
    among themselves on the closed form). ``force``: ask the planner for the first allocation even when the
    level-1 planner found no plan (its error then names the binding constraint); ``planner=None``: the
    level-1 plans only. Where the level-1 planner found no allocation's memory enough, the planner is asked
    for the first one too: TPA may fit it with recomputation or FSDP.

    A later allocation replaces an earlier one only when better by more than ``tolerance`` (relative), so
    callers list preferred allocations (e.g. fewer GPUs) first. A TPA failure other than
    :class:`UnschedulableError` is logged and the level-1 plan kept (the chain is still planned by the
    shared cost model).

    ``challengers`` (with a ``planner``, once a plan was kept): allocations the caller's estimate could not
    tell from the candidates (e.g. a search's near-ties below its finalists). Each is planned by the
    ``planner`` and replaces the kept plan when better on the exact timeline by more than ``tolerance``: the
    result is never worse than without challengers, at one planner call each. ``challengers_may_grow=False``:
    only a challenger's plan that holds no more GPUs than the kept plan may replace it;
    ``challenger_margin``: a challenger must be better by more than this (relative; at least ``tolerance``).
    """
    t0 = time.perf_counter()
    best: Plan | None = None
    best_val = math.inf
    err: UnschedulableError | None = None
    valid: list[tuple[float, int, Plan, Sequence[tuple[str, int]]]] = []  # (objective, index, plan, allocation)
    chosen = -1  # the entry of valid whose plan is best
    for i, alloc in enumerate(allocations):
        try:
            plan = cached_plan("fallback", topo, job, alloc, objective,
                               lambda t, j, a, o: fallback_plan_chain(t, j, a, objective=o))
        except UnschedulableError as e:
            err = e
            continue
        if check_plan(plan, topo, job):
            continue
        val = plan_objective(plan, objective)
        if val < best_val * (1 - tolerance) or best is None:
            best, best_val, chosen = plan, val, len(valid)
        valid.append((val, i, plan, alloc))
    used = "fallback"
    # The level-1 planner plans replicated stages without recomputation: where memory stopped it on every
    # allocation, TPA (which may recompute and shard) gets the first one.
    over_memory = best is None and err is not None and err.constraint == "memory"
    if planner is not None and (best is not None or force or over_memory) and tpa_available():
        # The chosen level-1 plan first, then the others by their objective.
        rest = valid[:chosen] + valid[chosen + 1 :]
        order = [valid[chosen], *sorted(rest, key=lambda r: (r[0], r[1]))] if valid else []
        targets: list[list[tuple[str, int]]] = []
        for rank, (_, _, fplan, alloc) in enumerate(order[: max(replan, 1)]):
            # A level-1 plan may leave some of its allocation's GPUs idle (a count it cannot factor into
            # tp × dp); TPA, which uses exactly the GPUs it is given, plans those GPUs too. For the best
            # allocation, so does the level-1 plan in which every shape competes alike: 31 GPUs run best as
            # 30 (pp 3 × tp 2 × dp 5) more often than as 28, and TPA cannot find that count on 31.
            for target in ([(c, int(g)) for c, g in alloc], chain_allocation(fplan),
                           _every_shape_allocation(topo, job, alloc, objective, fplan) if rank == 0 else None):
                if target is not None and target not in targets:
                    targets.append(target)
        if not targets and allocations:
            targets.append([(c, int(g)) for c, g in allocations[0]])
        timed = False
        for target in targets:
            try:
                tplan = planner.plan(topo, job, target, PlanOptions(objective=objective, explain=best is None))
                if best is not None and not timed:  # the plans compared on TPA's prediction, the exact timeline
                    from spiderflow.core.tpa.timeline import evaluate_on_timeline

                    best, timed = evaluate_on_timeline(best, topo, job), True
                    best_val = plan_objective(best, objective)
                if check_plan(tplan, topo, job):
                    continue
                val = plan_objective(tplan, objective)
                if best is None or (val <= best_val if used == "fallback" else val < best_val * (1 - tolerance)):
                    best, used, best_val = tplan, "tpa", val
            except UnschedulableError as e:
                err = err or e
            except Exception as e:  # the TPA planner failed; keep the level-1 plan of the same chain
                _log.warning("placement.tpa_failed", job=job.id, error=repr(e), chain=[c for c, _ in target])
    won = -1
    if challengers and best is not None and planner is not None and tpa_available():
        best, used, won = _challenge(topo, job, best, used, challengers, objective, planner,
                                     max(tolerance, challenger_margin), None if challengers_may_grow else best.gpus)
    return Finalised(plan=best, planner=used, plan_seconds=time.perf_counter() - t0, error=err, challenger=won)


def _challenge(topo: Topology, job: JobSpec, best: Plan, used: str,
               challengers: Sequence[Sequence[tuple[str, int]]], objective: Objective, planner: Planner,
               tolerance: float, max_gpus: int | None) -> tuple[Plan, str, int]:
    """:func:`finalise`'s challengers against ``best``: each planned by ``planner`` (TPA: the schedule and
    micro-batch count chosen on the exact timeline; the level-1 planner's closed form can rank a chain's
    schedules otherwise) and kept when better on the exact timeline by more than ``tolerance`` and holding at
    most ``max_gpus`` GPUs (None: any). Returns the kept plan, its planner and the winning challenger's index
    (-1: none)."""
    from spiderflow.core.tpa.timeline import carries_timeline, evaluate_on_timeline

    kept_plan, kept_used = best, used
    if carries_timeline(best):
        best_val = plan_objective(best, objective)  # the planner's own timeline step (TPA's plans)
    else:
        try:
            best_val = plan_objective(evaluate_on_timeline(best, topo, job), objective)
        except ValueError:  # an order the timeline cannot run: nothing to compare the challengers with
            return kept_plan, kept_used, -1
    won = -1
    for i, alloc in enumerate(challengers):
        if max_gpus is not None and sum(int(g) for _, g in alloc) > max_gpus:
            continue  # its plan could hold fewer GPUs than it is given, but TPA uses exactly those
        try:
            tplan = planner.plan(topo, job, [(c, int(g)) for c, g in alloc], PlanOptions(objective=objective))
        except UnschedulableError:
            continue
        except Exception as e:  # the TPA planner failed on this challenger; the kept plan stands
            _log.warning("placement.tpa_failed", job=job.id, error=repr(e), chain=[c for c, _ in alloc])
            continue
        if check_plan(tplan, topo, job) or (max_gpus is not None and tplan.gpus > max_gpus):
            continue
        val = plan_objective(tplan, objective)
        if val < best_val * (1 - tolerance):
            kept_plan, kept_used, best_val, won = tplan, "tpa", val, i
    return kept_plan, kept_used, won


# --------------------------------------------------------------------------------------------------
# Checks and diagnosis
# --------------------------------------------------------------------------------------------------


def check_plan(plan: Plan, topo: Topology, job: JobSpec) -> list[str]:
    """Violations of the hard constraints by an evaluated plan (empty when it is valid):
    contiguous layers covering the model, free GPUs per cluster, memory per GPU, the job's GPU range."""
    out: list[str] = []
    if plan.layers != job.model.layers:
        out.append(f"plan covers {plan.layers} layers, the model has {job.model.layers}")
    for name, g in plan.gpus_by_cluster().items():
        if g > topo.cluster(name).free:
            out.append(f"{name}: {g} GPUs used, {topo.cluster(name).free} free")
    for st, mem in zip(plan.stages, plan.memory_gib_per_gpu, strict=True):
        if mem > topo.cluster(st.cluster).gpu_memory_gib + 1e-9:
            out.append(f"{st.cluster}: {mem:.2f} GiB per GPU > {topo.cluster(st.cluster).gpu_memory_gib}")
    if not job.gpus.min <= plan.gpus <= job.gpus.max:
        out.append(f"plan uses {plan.gpus} GPUs, job accepts {job.gpus.min}..{job.gpus.max}")
    return out


def diagnose(topo: Topology, job: JobSpec, policy: str) -> PlacementResult | None:
    """A failed :class:`PlacementResult` when the job can obviously never fit (``UNRESOLVABLE``) or not
    now (``UNSCHEDULABLE``), naming the binding constraint; ``None`` when no obvious obstacle exists.

    Checks: GPUs (``gpus.min`` against all GPUs, then free GPUs) and memory (model states, 16 bytes per
    parameter, against the memory of the ``gpus.max`` largest-memory GPUs, all then free).
    """
    need = job.gpus.min
    total = sum(c.total_gpus for c in topo.clusters)
    free = topo.total_free_gpus
    if total < need:
        return PlacementResult(
            status=PlacementStatus.UNRESOLVABLE, policy=policy, constraint="gpus.min",
            reason=f"the job needs at least {need} GPUs; the topology has {total} in total",
        )
    if free < need:
        return PlacementResult(
            status=PlacementStatus.UNSCHEDULABLE, policy=policy, constraint="free_gpus",
            reason=f"the job needs at least {need} GPUs; {free} are free",
        )
    states = float(state_bytes_per_param(job.precision)) * job.model.total_params
    mem_per_gpu = [c.gpu_memory_gib - RESERVED_GIB for c in topo.clusters]
    for which, counts in (("all", [c.total_gpus for c in topo.clusters]), ("free", [c.free for c in topo.clusters])):
        left, have = job.gpus.max, 0.0
        for mem, n in sorted(zip(mem_per_gpu, counts, strict=True), reverse=True):
            take = min(n, left)
            have += take * mem * GIB
            left -= take
            if left <= 0:
                break
        if have < states:
            status = PlacementStatus.UNRESOLVABLE if which == "all" else PlacementStatus.UNSCHEDULABLE
            return PlacementResult(
                status=status, policy=policy, constraint="memory",
                reason=f"model states need {states / GIB:.0f} GiB; the {job.gpus.max - left} largest {which} "
                f"GPUs the job may use hold {have / GIB:.0f} GiB",
            )
    return None


def unschedulable(policy: str, err: UnschedulableError, seconds: float) -> PlacementResult:
    """A failed result carrying ``err``'s reason and constraint."""
    return PlacementResult(
        status=PlacementStatus.UNSCHEDULABLE, policy=policy, reason=str(err), constraint=err.constraint,
        planning_seconds=seconds,
    )
