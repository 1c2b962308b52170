r"""Kernels of TPA's level 2 (:mod:`spiderflow.core.tpa.level2`): the exact block solver
(:func:`~spiderflow.core.tpa.level2.solve_block_exact`), the per-candidate constants, the sub-stage memory caps and
the min-peak memory tests.

The model, its symbols and the algorithms are :mod:`spiderflow.core.tpa.level2`'s; these kernels evaluate the
same expressions on the same operands in the same order (Python's ``int``/``float`` mixing included: an
integer operand is converted to a double where Python converts it), with Python's tie rules for ``min``
and ``max`` (the first of equal values wins) and left-to-right sums, so every figure is bitwise the one the
plain Python formulation (kept in the tests) computes.

A problem is passed as two vectors (built by the wrapper in :mod:`spiderflow.core.tpa.level2`): ``fl``
(``float64``, indices ``F_*``) and ``it`` (``int64``, indices ``I_*``); an optional field (``downstream``,
``max_in_flight``) is a value plus a presence flag. Candidates ``(t, p, d)`` are enumerated in
:func:`~spiderflow.core.tpa.level2.block_candidates`' ``(t, p)`` order; per-sub-stage constants of all
candidates are stored flat, candidate ``i``'s at ``[start[i], start[i + 1])``.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from spiderflow.core.kernels import kernel, register_warmup
from spiderflow.core.kernels.formulas import allreduce_time as _allreduce_time
from spiderflow.core.kernels.formulas import fsdp_gather_time as _fsdp_gather_time
from spiderflow.core.kernels.formulas import transfer_time as _transfer_time

__all__ = [
    "C_SIZE",
    "F_SIZE",
    "I_SIZE",
    "candidates",
    "coefficients",
    "fitting_cost",
    "memory_caps",
    "memory_caps_all",
    "min_memory_config",
    "min_peak_fits",
    "solve_exact",
]

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]

Picked = tuple[int, int, int, int, int, float, float]  # (t, p, d, recompute, fsdp, objective, P_in)

# ``fl``: the problem's real figures.
F_TFLOPS = 0  # effective TFLOPS per GPU
F_MEMORY_GIB = 1  # GPU memory C
F_INTRA_GBPS = 2
F_INTER_GBPS = 3
F_LAYER_OVERHEAD_S = 4
F_OPTIMIZER_S = 5
F_FLOOR_S = 6  # Z_floor
F_GIB = 7  # bytes per GiB
F_RESERVED_BYTES = 8  # the runtime's reserve per GPU, bytes
F_LAYER_PARAMS = 9  # P: parameters of one layer (the model family's, :attr:`ModelSpec.params_per_layer`)
F_LAYER_FLOPS = 10  # f: forward FLOPs of one layer per micro-batch (:func:`spiderflow.core.costmodel.layer_fwd_flops`)
F_EMBED_PARAMS = 11  # E: the embedding's parameters (first sub-stage of an embedding block)
F_HEAD_PARAMS = 12  # H: the head's parameters (last sub-stage of a head block)
F_LOGIT_SAVED_BYTES = 13  # the loss's bytes per logit value and in-flight micro-batch (costmodel.LOGIT_SAVED_BYTES)
F_LOGIT_ONCE_BYTES = 14  # the loss's bytes per logit value held once (costmodel.LOGIT_ONCE_BYTES)
# Work outside the blocks a profile measured on the cluster (Cluster fields of the same names; 0: not measured,
# :func:`spiderflow.core.costmodel.measured_outer_time`, :func:`spiderflow.core.costmodel.measured_step_extra`).
F_EMBEDDING_US_PER_TOKEN = 15  # the embedding's fwd+bwd µs per token (sub-stage 0 of an embedding block)
F_HEAD_US_PER_TOKEN = 16  # the head's and loss's fwd+bwd µs per token (replaces the head's FLOPs)
F_EMBEDDING_OPTIMIZER_MS = 17  # the embedding's optimizer step, ms per training step
F_HEAD_OPTIMIZER_MS = 18  # the head's optimizer step, ms per training step
F_DATA_MS_PER_SAMPLE = 19  # the input pipeline, ms per sample of the first stage
F_SIZE = 20

# ``it``: the problem's integers (flags 0/1).
I_GPUS = 0
I_LAYERS = 1  # L_b
I_GPUS_PER_NODE = 2
I_WIRE_BYTES = 3
I_HIDDEN = 4
I_HEADS = 5
I_VOCAB = 6
I_MICRO_BATCH = 7
I_SEQ_LEN = 8
I_M = 9
I_DOWNSTREAM = 10  # R, when I_HAS_DOWNSTREAM
I_HAS_DOWNSTREAM = 11  # 0: GPipe (every micro-batch of a replica in flight)
I_DEPTH_FACTOR = 12
I_MAX_IN_FLIGHT = 13  # K, when I_HAS_MAX_IN_FLIGHT
I_HAS_MAX_IN_FLIGHT = 14
I_HAS_EMBED = 15
I_HAS_HEAD = 16
I_MEMORY_BOUND = 17
I_BYTES_PER_PARAM = 18  # replicated weights, grads and optimizer state per parameter (by precision)
I_VALUE_BYTES = 19  # v: bytes of one activation or gradient value in the job's precision
I_FSDP_BYTES_PER_PARAM = 20  # the same on an FSDP shard
I_ALLOW_RECOMPUTE = 21  # candidates with activation recomputation
I_ALLOW_FSDP = 22  # candidates with FSDP-sharded replicas (d > 1; one all-gather per step)
I_KV_HEADS = 23  # key/value heads (grouped-query attention; = heads otherwise): t divides them too
I_GRAD_BYTES = 24  # bytes of one gradient value in the data-parallel sync (costmodel.grad_bytes_per_value)
I_GATHER_BYTES = 25  # bytes of one parameter value FSDP all-gathers (costmodel.PARAM_GATHER_BYTES)
I_FSDP_UNSHARDED_BYTES = 26  # bytes per parameter an FSDP stage holds unsharded through a step
I_SIZE = 27

# A candidate's row: ``(t, p, d, recompute, fsdp)``.
C_TP = 0
C_PP = 1
C_DP = 2
C_RECOMPUTE = 3
C_FSDP = 4
C_SIZE = 5

_UP = 1.0 + 1e-9  # a bound's slack
_TIE = 1.0 - 1e-12  # a strictly better objective
_LEVEL_UP = 1.0 + 1e-12  # a level's slack in a layer count
_FLOOR_LIMIT = 1e18  # |q| below this: math.floor(q) fits an int64


@kernel
def _pmax(a: float, b: float) -> float:
    """Python's ``max(a, b)``: ``a`` unless ``b > a``."""
    return b if b > a else a


@kernel
def _pmin(a: float, b: float) -> float:
    """Python's ``min(a, b)``: ``a`` unless ``b < a``."""
    return b if b < a else a


@kernel
def _floor(q: float, top: int) -> int:
    """``math.floor(q)`` where it fits an int64; else a value on the same side beyond ``[0, top]`` (callers
    clip the floor to that range, so the result is the same)."""
    if -_FLOOR_LIMIT < q < _FLOOR_LIMIT:
        return math.floor(q)
    return top + 1 if q > 0.0 else -1


@kernel
def _divides(tp: int, gpus: int, g: int, heads: int, kv_heads: int, hidden: int) -> bool:
    return (gpus % tp == 0 and (g % tp == 0 or tp % g == 0) and heads % tp == 0 and kv_heads % tp == 0
            and hidden % tp == 0)


@kernel
def _time_terms(fl: FArr, it: IArr, tp: int, recompute: bool) -> tuple[float, float, float]:
    r"""``(τ, η_head, η_emb)``: a layer's fwd+bwd seconds, the head's and the embedding's, for one replica of
    ``t``-way tensor parallelism (:func:`spiderflow.core.costmodel.stage_compute_time`):

    * ``τ = c·f/(t·F) + o + n_AR·AR_t(v·b·s·h, B_tp)``, ``c = 3`` (``4`` with recomputation: the blocks'
      forward runs again in backward) and ``n_AR = 4`` (``6``);
    * ``η_head = 3·2·b·s·h·V/(t·F)`` (the head is never recomputed), or where a profile measured the head
      and its loss, ``η_c·b·s`` (µs per token; not divided by ``t``: the executor replicates the head);
    * ``η_emb = e_c·b·s`` where a profile measured the embedding, else 0
      (:func:`spiderflow.core.costmodel.measured_outer_time`).

    FSDP adds nothing per micro-batch: the executor all-gathers a stage's parameters once per step, priced
    with the gradient sync (:func:`coefficients`' ``α``, ``β``)."""
    h = it[I_HIDDEN]
    v = it[I_VOCAB]
    b = it[I_MICRO_BATCH]
    s = it[I_SEQ_LEN]
    g = it[I_GPUS_PER_NODE]
    vb = it[I_VALUE_BYTES]
    flops_rate = tp * fl[F_TFLOPS] * 1e12
    tp_bw = fl[F_INTRA_GBPS] if tp <= g else fl[F_INTER_GBPS]
    ar = _allreduce_time(float(vb) * b * s * h, tp, tp_bw, 0.0)
    if recompute:
        tau = 4.0 * fl[F_LAYER_FLOPS] / flops_rate + fl[F_LAYER_OVERHEAD_S] + 6 * ar
    else:
        tau = 3.0 * fl[F_LAYER_FLOPS] / flops_rate + fl[F_LAYER_OVERHEAD_S] + 4 * ar
    if fl[F_HEAD_US_PER_TOKEN] != 0.0:
        eta_head = fl[F_HEAD_US_PER_TOKEN] * b * s / 1e6
    else:
        eta_head = 6.0 * b * s * h * v / flops_rate  # 3·2·b·s·h·V / rate (3.0 * 2.0 is exactly 6.0)
    eta_embed = fl[F_EMBEDDING_US_PER_TOKEN] * b * s / 1e6 if fl[F_EMBEDDING_US_PER_TOKEN] != 0.0 else 0.0
    return tau, eta_head, eta_embed


@kernel
def candidates(fl: FArr, it: IArr) -> IArr:
    """Every admissible ``(t, p, d, recompute, fsdp)`` of the problem (rows), ordered by ``(t, p)``, then the
    plain candidate, FSDP, recomputation, both: :func:`spiderflow.core.tpa.level2.block_candidates`. FSDP only
    with ``d > 1`` replicas; each option only where the problem allows it."""
    gpus = it[I_GPUS]
    g = it[I_GPUS_PER_NODE]
    heads = it[I_HEADS]
    hidden = it[I_HIDDEN]
    layers = it[I_LAYERS]
    m = it[I_M]
    n_rc = 2 if it[I_ALLOW_RECOMPUTE] != 0 else 1
    n = 0
    for rep in range(2):  # count, then fill
        out = np.empty((n, C_SIZE), np.int64)
        q = 0
        for tp in range(1, gpus + 1):
            if not _divides(tp, gpus, g, heads, it[I_KV_HEADS], hidden):
                continue
            rest = gpus // tp
            for pp in range(1, rest + 1):
                if rest % pp:
                    continue
                dp = gpus // (tp * pp)
                if pp > layers or dp > m:
                    continue
                for rc in range(n_rc):
                    for fs in range(2):
                        if fs == 1 and (it[I_ALLOW_FSDP] == 0 or dp < 2):
                            continue
                        if rep == 1:
                            out[q, C_TP] = tp
                            out[q, C_PP] = pp
                            out[q, C_DP] = dp
                            out[q, C_RECOMPUTE] = rc
                            out[q, C_FSDP] = fs
                        q += 1
        if rep == 0:
            n = q
        else:
            return out
    return np.empty((0, C_SIZE), np.int64)  # unreachable


@kernel
def coefficients(
    fl: FArr, it: IArr, tp: int, pp: int, dp: int, recompute: bool, fsdp: bool, mu: FArr, nu: FArr, beta: FArr
) -> tuple[float, float, float, float, float]:
    r"""Candidate ``(t, p, d)``'s constants (with recomputation and FSDP as ``recompute``/``fsdp`` say):
    ``(τ, η_head, η_emb, α, P_in)`` returned, ``μ_j``, ``ν_j``, ``β_j`` written into ``mu[:pp]``, ``nu[:pp]``,
    ``beta[:pp]``. With the cost model's symbols (:mod:`spiderflow.core.costmodel`; ``F`` the GPU's FLOP/s in the
    job's precision, ``P``, ``E``, ``H`` the parameters of a layer, of the embedding and of the head and ``f``
    a layer's forward FLOPs, all from the model family; ``v`` the precision's value bytes, ``AR_k(x, B)`` the
    ring all-reduce, ``AG_k(x, B)`` the ring all-gather/reduce-scatter):

    * ``τ``, ``η_head`` (on the last sub-stage of a head block), ``η_emb`` (on sub-stage 0 of an embedding
      block): :func:`_time_terms`;
    * ``κ_j = ⌈m/d⌉`` (GPipe) or ``max(1, min(⌈m/d⌉, φ·(R + p − j)))``, then ``min(κ_j, K)`` under a cap;
    * ``μ_j = σ·P/(t·d_σ) + ω·P/t + κ_j·a`` with ``σ`` the state bytes per parameter (replicated: by
      precision; FSDP: on the shard, ``d_σ = d``; else ``d_σ = 1``), ``ω`` the bytes per parameter an FSDP
      stage holds unsharded through a step (``it[I_FSDP_UNSHARDED_BYTES]``; 0 for replicas) and
      ``a = s·b·h·(10 + 24/t + 5·a_h·s/(h·t))`` the
      activations a block keeps (``v·s·b·h``, its input, with recomputation);
    * ``ν_j = σ·X_j/(t·d_σ) + ω·X_j/t + reserve`` (``X_j``: ``E`` on sub-stage 0 of an embedding block, ``H`` on the
      last of a head block) plus ``(κ_j·λ + λ₁)·b·s·V/t`` (the loss, :func:`spiderflow.core.costmodel.loss_bytes`:
      ``λ`` = ``fl[F_LOGIT_SAVED_BYTES]`` per in-flight micro-batch, ``λ₁`` = ``fl[F_LOGIT_ONCE_BYTES]`` once) on
      the head sub-stage, plus one block's full
      activations rebuilt in backward under recomputation;
    * ``α = S_d(γ·P/t, B_dp) + u``; ``β_j = S_d(γ·X_j/t, B_dp)`` (0 when ``X_j = 0``; ``γ`` the gradient
      bytes per value, ``it[I_GRAD_BYTES]``), ``S = AR`` for replicas; under FSDP ``S_d(x) = AG_d(x) +
      AG_d(π·x/γ)``: the gradients' reduce-scatter and the step's one all-gather of the parameters (``π`` the
      gathered bytes per parameter, ``it[I_GATHER_BYTES]``; :func:`spiderflow.core.costmodel._dp_sync_time`);
      ``β_j`` also carries the per-step work outside the blocks a profile measured
      (:func:`spiderflow.core.costmodel.measured_step_extra`): on sub-stage 0 of an embedding block the
      embedding's optimizer step and the input pipeline of its ``⌈m/d⌉·b`` samples, on the head sub-stage the
      head's optimizer step;
    * ``P_in = w·b·s·h / B_inter`` (the cluster's wire format in the job's precision).

    ``B_tp`` is the intra-node bandwidth when ``t ≤ g``, ``B_dp`` when ``t·d ≤ g``, else the inter-node one."""
    h = it[I_HIDDEN]
    a = it[I_HEADS]
    v = it[I_VOCAB]
    b = it[I_MICRO_BATCH]
    s = it[I_SEQ_LEN]
    m = it[I_M]
    g = it[I_GPUS_PER_NODE]
    vb = it[I_VALUE_BYTES]
    gb = it[I_GRAD_BYTES]
    pg = it[I_GATHER_BYTES]
    intra = fl[F_INTRA_GBPS]
    inter = fl[F_INTER_GBPS]
    params_per_layer = fl[F_LAYER_PARAMS]
    tau, eta_head, eta_embed = _time_terms(fl, it, tp, recompute)
    act_full = s * b * h * (10.0 + 24.0 / tp + 5.0 * a * s / (h * tp))
    act_layer = float(vb) * s * b * h if recompute else act_full
    per_replica = math.ceil(m / dp)
    stage_gpus = tp * dp
    dp_bw = intra if stage_gpus <= g else inter
    if fsdp:
        alpha = (_fsdp_gather_time(gb * params_per_layer / tp, dp, dp_bw)
                 + _fsdp_gather_time(pg * params_per_layer / tp, dp, dp_bw) + fl[F_OPTIMIZER_S])
        bpp = it[I_FSDP_BYTES_PER_PARAM]
        unsharded = float(it[I_FSDP_UNSHARDED_BYTES])
        shards = tp * dp
    else:
        alpha = _allreduce_time(gb * params_per_layer / tp, dp, dp_bw, 0.0) + fl[F_OPTIMIZER_S]
        bpp = it[I_BYTES_PER_PARAM]
        unsharded = 0.0
        shards = tp
    gpipe = it[I_HAS_DOWNSTREAM] == 0
    downstream = it[I_DOWNSTREAM]
    capped = it[I_HAS_MAX_IN_FLIGHT] != 0 and not gpipe
    has_embed = it[I_HAS_EMBED] != 0
    has_head = it[I_HAS_HEAD] != 0
    reserved = fl[F_RESERVED_BYTES]
    for j in range(pp):
        inflight = per_replica if gpipe else max(1, min(per_replica, it[I_DEPTH_FACTOR] * (downstream + pp - j)))
        if capped:
            inflight = min(inflight, it[I_MAX_IN_FLIGHT])
        embed = has_embed and j == 0
        head = has_head and j == pp - 1
        extra_params = (fl[F_EMBED_PARAMS] if embed else 0.0) + (fl[F_HEAD_PARAMS] if head else 0.0)
        mu[j] = bpp * params_per_layer / shards + inflight * act_layer
        const = bpp * extra_params / shards + reserved
        if fsdp:
            mu[j] += unsharded * params_per_layer / tp
            const += unsharded * extra_params / tp
        if recompute:
            const += act_full
        if head:
            const += (inflight * fl[F_LOGIT_SAVED_BYTES] + fl[F_LOGIT_ONCE_BYTES]) * b * s * v / tp
        nu[j] = const
        if extra_params == 0.0:
            beta[j] = 0.0
        elif fsdp:
            beta[j] = (_fsdp_gather_time(gb * extra_params / tp, dp, dp_bw)
                       + _fsdp_gather_time(pg * extra_params / tp, dp, dp_bw))
        else:
            beta[j] = _allreduce_time(gb * extra_params / tp, dp, dp_bw, 0.0)
        if embed:
            step = fl[F_EMBEDDING_OPTIMIZER_MS] / 1e3 + fl[F_DATA_MS_PER_SAMPLE] * (b * per_replica) / 1e3
            if step != 0.0:
                beta[j] += step
        if head and fl[F_HEAD_OPTIMIZER_MS] != 0.0:
            beta[j] += fl[F_HEAD_OPTIMIZER_MS] / 1e3
    p_in = _transfer_time(float(it[I_WIRE_BYTES]) * b * s * h, inter, 0.0)
    return tau, eta_head, eta_embed, alpha, p_in


@kernel
def _count(slope: float, const: float, level: float, top: int) -> int:
    """The largest ``ℓ ≤ top`` with ``slope·ℓ + const ≤ level`` (0 if none; ``top`` if ``slope`` is 0)."""
    if slope <= 0.0:
        return top if const <= level * _LEVEL_UP + 1e-300 else 0
    n = min(top, max(0, _floor((level - const) / slope, top)))
    while n < top and slope * (n + 1) + const <= level * _LEVEL_UP:
        n += 1
    while n > 0 and slope * n + const > level * _LEVEL_UP:
        n -= 1
    return n


@kernel
def _caps_into(mu: FArr, nu: FArr, pp: int, cap: float, gib: float, top: int, memory_bound: bool,
               out: IArr) -> None:
    """``u_j`` of one candidate into ``out[:pp]`` (``top`` for every sub-stage when memory is not bound)."""
    for j in range(pp):
        if not memory_bound:
            out[j] = top
            continue
        u = _count(mu[j] / gib, nu[j] / gib, cap, top)
        while u > 0 and (mu[j] * u + nu[j]) / gib > cap:
            u -= 1
        out[j] = u


@kernel
def _levels(slope: float, consts: FArr, top: int, buf: FArr) -> FArr:
    """The sorted distinct values ``slope·n + b`` (``b`` in ``consts``, ``1 ≤ n ≤ top``), a view of ``buf`` (or
    of a new array when ``buf`` is shorter than ``consts.size·top``). A run of equal values keeps one
    (``0.0`` and ``-0.0`` are one level, as in a set; callers only compare levels). For ``slope ≥ 0`` each
    ``b``'s values rise with ``n`` (rounding is monotone), so the runs are merged; otherwise sorted."""
    nc = consts.size
    if buf.size < nc * top:
        buf = np.empty(nc * top, np.float64)
    k = 0
    if slope >= 0.0:
        heads = np.ones(nc, np.int64)  # the next n of each run
        while True:
            pick = -1
            val = 0.0
            for q in range(nc):
                if heads[q] <= top:
                    x = slope * heads[q] + consts[q]
                    if pick < 0 or x < val:
                        pick = q
                        val = x
            if pick < 0:
                break
            heads[pick] += 1
            if k == 0 or val != buf[k - 1]:
                buf[k] = val
                k += 1
        return buf[:k]
    vals = buf[:nc * top]
    q = 0
    for b in consts:
        for n in range(1, top + 1):
            vals[q] = slope * n + b
            q += 1
    vals.sort()
    for x in vals:
        if k == 0 or x != vals[k - 1]:
            vals[k] = x
            k += 1
    return vals[:k]


@kernel
def _first_level(levels: FArr, slope: float, const: float, top: int) -> float:
    """The least of the sorted ``levels`` at which :func:`_count` reaches ``top`` (binary search)."""
    lo = 0
    hi = levels.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _count(slope, const, levels[mid], top) >= top:
            hi = mid
        else:
            lo = mid + 1
    return float(levels[lo])


@kernel
def _distinct(x: FArr, idx: IArr, out: FArr) -> FArr:
    """The distinct values of ``x`` in order of first occurrence (a view of ``out``); ``idx[j]``: ``x[j]``'s
    position among them."""
    k = 0
    for j in range(x.size):
        pos = -1
        for q in range(k):
            if out[q] == x[j]:
                pos = q
                break
        if pos < 0:
            out[k] = x[j]
            pos = k
            k += 1
        idx[j] = pos
    return out[:k]


@kernel
def _fill(levels: FArr, i: int, alpha: float, betas: FArr, lb: int, limits: IArr, bidx: IArr,
          cnt: IArr) -> tuple[int, int]:
    """At A-level ``levels[i]``: ``(min_j n_j, Σ_j min(limits_j, n_j))`` with ``n_j`` sub-stage ``j``'s layer
    count under that level (one :func:`_count` per distinct ``β``)."""
    lvl = levels[i]
    for q in range(betas.size):
        cnt[q] = _count(alpha, betas[q], lvl, lb)
    least = cnt[bidx[0]]
    total = 0
    for j in range(limits.size):
        n = cnt[bidx[j]]
        least = min(least, n)
        total += min(limits[j], n)
    return least, total


@kernel
def _least_a(levels: FArr, alpha: float, betas: FArr, lb: int, limits: IArr, bidx: IArr,
             cnt: IArr) -> tuple[bool, float]:
    """``(found, A)``: the least A-level at which the sub-stages under ``limits`` hold every layer."""
    lo = 0
    hi = levels.size - 1
    if _fill(levels, hi, alpha, betas, lb, limits, bidx, cnt)[1] < lb:
        return False, 0.0
    while lo < hi:
        mid = (lo + hi) // 2
        least, total = _fill(levels, mid, alpha, betas, lb, limits, bidx, cnt)
        if least >= 1 and total >= lb:
            hi = mid
        else:
            lo = mid + 1
    return True, levels[lo]


@kernel
def _config_cost(
    m: int, pp: int, dp: int, floor_s: float, gib: float, has_head: bool, tau: float, eta_head: float,
    alpha: float, p_in: float, mu: FArr, nu: FArr, beta: FArr, layers: IArr, figs: FArr, has_embed: bool,
    eta_embed: float,
) -> tuple[float, float, float]:
    """:func:`spiderflow.core.tpa.level2.config_cost`: per sub-stage compute, memory (GiB) and gradient sync into
    ``figs[0:3, :pp]``; returns ``(objective, intra-cluster boundary, peak memory)``."""
    top_compute = 0.0
    total = 0.0
    top_ar = 0.0
    peak = 0.0
    for j in range(pp):
        n = layers[j]
        c = tau * n + (eta_head if (has_head and j == pp - 1) else 0.0)
        if has_embed and j == 0 and eta_embed != 0.0:
            c += eta_embed
        mem = (mu[j] * n + nu[j]) / gib
        ar = alpha * n + beta[j]
        figs[0, j] = c
        figs[1, j] = mem
        figs[2, j] = ar
        if j == 0:
            top_compute = c
            top_ar = ar
            peak = mem
        else:
            top_compute = _pmax(top_compute, c)
            top_ar = _pmax(top_ar, ar)
            peak = _pmax(peak, mem)
        total += c
    boundary = p_in if pp > 1 else 0.0
    obj = ((m - 1) * _pmax(_pmax(top_compute / dp, boundary), floor_s) + total + 2 * (pp - 1) * boundary
           + top_ar)
    return obj, boundary, peak


@kernel
def _best_split(
    m: int, dp: int, pp: int, lb: int, floor_s: float, has_head: bool, tau: float, eta_head: float,
    alpha: float, beta: FArr, mu: FArr, nu: FArr, p_in: float, caps: IArr, bound: float, out: IArr,
    fscr: FArr, iscr: IArr, lscr: FArr, first_eta: float,
) -> bool:
    """The optimal layers per sub-stage of one candidate into ``out[:pp]`` (``False``: nothing fits memory
    or nothing beats ``bound``): :func:`spiderflow.core.tpa.level2.solve_block_exact`'s best split (bottleneck
    enumeration over ``Z``, water-filling for ``A``). Scratch: ``fscr`` ``(3, ≥ pp)``, ``iscr`` ``(5, ≥ pp)``,
    ``lscr`` ``(2, ·)`` (best ``≥ 3·lb``: at most three distinct ``β`` and ``η``). ``first_eta``: the measured
    embedding's ``η`` on sub-stage 0 of an embedding block (else 0)."""
    if pp > lb:
        return False
    least = caps[0]
    total = 0
    for j in range(pp):
        least = min(least, caps[j])
        total += caps[j]
    if least < 1 or total < lb:
        return False
    last_eta = eta_head if has_head else 0.0  # η_j: the head on the last sub-stage, else 0
    if pp == 1:
        if first_eta != 0.0:
            last_eta += first_eta
        one = fscr[0, :1]
        one[0] = beta[0]
        a_inf = _first_level(_levels(alpha, one, lb, lscr[0]), alpha, beta[0], lb)
        one[0] = last_eta
        z = _first_level(_levels(tau, one, lb, lscr[1]), tau, last_eta, lb)
        const = tau * lb + last_eta
        if (m - 1) * _pmax(z / dp, _pmax(0.0, floor_s)) + a_inf + const > bound * _UP:
            return False
        out[0] = lb
        return True
    etas = fscr[0, :pp]
    etas[:] = 0.0
    etas[pp - 1] = last_eta
    etas[0] += first_eta
    flat = _pmax(p_in, floor_s)
    eta_sum = 0.0
    for j in range(pp):
        eta_sum += etas[j]
    const = tau * lb + eta_sum + 2 * (pp - 1) * p_in

    bidx = iscr[0, :pp]
    betas = _distinct(beta[:pp], bidx, fscr[1])
    cnt = iscr[1]
    a_levels = _levels(alpha, betas, lb, lscr[0])
    found, a_inf = _least_a(a_levels, alpha, betas, lb, caps[:pp], bidx, cnt)
    if not found:
        return False
    eidx = iscr[2, :pp]
    distinct = _distinct(etas, eidx, fscr[2])
    under = iscr[3]
    zs = _levels(tau, distinct, lb, lscr[1])
    limits = iscr[4, :pp]
    have = False
    best_val = 0.0
    best_z = 0.0
    best_a = 0.0
    for z in zs:
        if (m - 1) * _pmax(z / dp, flat) + a_inf + const > _pmin(bound, best_val if have else math.inf) * _UP:
            break
        for q in range(distinct.size):
            under[q] = _count(tau, distinct[q], z, lb)
        least = lb
        total = 0
        for j in range(pp):
            limits[j] = min(caps[j], under[eidx[j]])
            least = limits[j] if j == 0 else min(least, limits[j])
            total += limits[j]
        if least < 1 or total < lb:
            continue
        ok, a = _least_a(a_levels, alpha, betas, lb, limits, bidx, cnt)
        if not ok:
            continue
        val = (m - 1) * _pmax(z / dp, flat) + a + const
        if not have or val < best_val:
            have = True
            best_val = val
            best_z = z
            best_a = a
        if a <= a_inf:
            break  # larger Z cannot lower A any more
    if not have:
        return False
    total = 0
    for j in range(pp):
        out[j] = min(caps[j], _count(tau, etas[j], best_z, lb), _count(alpha, beta[j], best_a, lb))
        total += out[j]
    # Give back the surplus from the sub-stages with the highest memory (ties: the first sub-stage).
    for _ in range(total - lb):
        pick = -1
        top = 0.0
        for j in range(pp):
            if out[j] > 1:
                mem = mu[j] * out[j] + nu[j]
                if pick < 0 or mem > top:
                    pick = j
                    top = mem
        out[pick] -= 1
    return True


@kernel
def _all_coefficients(
    fl: FArr, it: IArr, cands: IArr
) -> tuple[IArr, FArr, FArr, FArr, FArr, FArr, FArr, FArr, FArr]:
    """Every candidate's constants: ``(start, τ, η_head, α, P_in, μ, ν, β, η_emb)`` (per-sub-stage ones flat)."""
    nk = cands.shape[0]
    start = np.empty(nk + 1, np.int64)
    start[0] = 0
    for i in range(nk):
        start[i + 1] = start[i] + cands[i, 1]
    tau = np.empty(nk, np.float64)
    eta = np.empty(nk, np.float64)
    eta_e = np.empty(nk, np.float64)
    alpha = np.empty(nk, np.float64)
    p_in = np.empty(nk, np.float64)
    mu = np.empty(start[nk], np.float64)
    nu = np.empty(start[nk], np.float64)
    beta = np.empty(start[nk], np.float64)
    for i in range(nk):
        s0 = start[i]
        s1 = start[i + 1]
        tau[i], eta[i], eta_e[i], alpha[i], p_in[i] = coefficients(
            fl, it, cands[i, C_TP], cands[i, C_PP], cands[i, C_DP], cands[i, C_RECOMPUTE] != 0,
            cands[i, C_FSDP] != 0, mu[s0:s1], nu[s0:s1], beta[s0:s1])
    return start, tau, eta, alpha, p_in, mu, nu, beta, eta_e


@kernel
def solve_exact(fl: FArr, it: IArr, layers_out: IArr, figs_out: FArr) -> Picked:
    """:func:`spiderflow.core.tpa.level2.solve_block_exact`: prune the candidates (one-layer memory test, lower
    bound against the best balanced split), then each survivor's best split in ``(t, p)`` order under the
    best objective so far; ties keep the first. Returns ``(t, p, d, recompute, fsdp, objective, intra-cluster
    boundary)`` with the winner's layers in ``layers_out[:p]`` and its compute, memory and gradient sync figures in
    ``figs_out[0:3, :p]`` (both at least ``min(L_b, GPUs)`` wide); ``t = 0`` when no candidate fits."""
    lb = it[I_LAYERS]
    cands = candidates(fl, it)
    nk = cands.shape[0]
    if nk == 0 or lb < 1:
        return 0, 0, 0, 0, 0, 0.0, 0.0
    start, tau, eta, alpha, p_ins, mu, nu, beta, eta_e = _all_coefficients(fl, it, cands)
    m = it[I_M]
    memory_bound = it[I_MEMORY_BOUND] != 0
    has_head = it[I_HAS_HEAD] != 0
    has_embed = it[I_HAS_EMBED] != 0
    floor_s = fl[F_FLOOR_S]
    gib = fl[F_GIB]
    cap_gib = fl[F_MEMORY_GIB]
    cap = cap_gib * gib
    width = 1
    for i in range(nk):
        width = max(width, cands[i, 1])
    lay = np.empty(width, np.int64)
    figs = np.empty((3, width), np.float64)
    caps = np.empty(width, np.int64)
    fscr = np.empty((3, width), np.float64)
    iscr = np.empty((5, width), np.int64)
    lscr = np.empty((2, 3 * lb), np.float64)

    # Prune: infeasible one-layer sub-stages; lower bounds against the balanced splits' objectives.
    kept = np.zeros(nk, np.bool_)
    lower = np.empty(nk, np.float64)
    upper = math.inf
    for i in range(nk):
        pp = cands[i, 1]
        dp = cands[i, 2]
        s0 = start[i]
        s1 = start[i + 1]
        if memory_bound:
            over = False
            for q in range(s0, s1):
                if mu[q] + nu[q] > cap:
                    over = True
                    break
            if over:
                continue
        p_in = p_ins[i] if pp > 1 else 0.0
        e = eta[i] if has_head else 0.0
        if has_embed and eta_e[i] != 0.0:
            e += eta_e[i]
        fill = tau[i] * lb + e + 2 * (pp - 1) * p_in
        beta_sum = 0.0
        for q in range(s0, s1):
            beta_sum += beta[q]
        lower[i] = (
            (m - 1) * _pmax(_pmax((tau[i] * lb + e) / (pp * dp), p_in), floor_s)
            + fill
            + (alpha[i] * lb + beta_sum) / pp
        )
        kept[i] = True
        if pp <= lb:
            base = lb // pp
            extra = lb % pp
            for j in range(pp):
                lay[j] = base + (1 if j < extra else 0)
            obj, _, peak = _config_cost(m, pp, dp, floor_s, gib, has_head, tau[i], eta[i], alpha[i], p_ins[i],
                                        mu[s0:s1], nu[s0:s1], beta[s0:s1], lay, figs, has_embed, eta_e[i])
            if not memory_bound or peak <= cap_gib:
                upper = _pmin(upper, obj)
    limit = upper * _UP

    have = False
    best_obj = 0.0
    best_i = -1
    best_boundary = 0.0
    for i in range(nk):
        if not kept[i] or not lower[i] <= limit:
            continue
        pp = cands[i, 1]
        dp = cands[i, 2]
        s0 = start[i]
        s1 = start[i + 1]
        _caps_into(mu[s0:s1], nu[s0:s1], pp, cap_gib, gib, lb, memory_bound, caps)
        if not _best_split(m, dp, pp, lb, floor_s, has_head, tau[i], eta[i], alpha[i], beta[s0:s1], mu[s0:s1],
                           nu[s0:s1], p_ins[i], caps[:pp], best_obj if have else math.inf, lay, fscr, iscr, lscr,
                           eta_e[i] if has_embed else 0.0):
            continue
        obj, boundary, peak = _config_cost(m, pp, dp, floor_s, gib, has_head, tau[i], eta[i], alpha[i], p_ins[i],
                                           mu[s0:s1], nu[s0:s1], beta[s0:s1], lay, figs, has_embed, eta_e[i])
        if memory_bound and peak > cap_gib:
            continue
        if not have or obj < best_obj * _TIE:
            have = True
            best_obj = obj
            best_i = i
            best_boundary = boundary
            for j in range(pp):
                layers_out[j] = lay[j]
                for r in range(3):
                    figs_out[r, j] = figs[r, j]
    if not have:
        return 0, 0, 0, 0, 0, 0.0, 0.0
    return (cands[best_i, C_TP], cands[best_i, C_PP], cands[best_i, C_DP], cands[best_i, C_RECOMPUTE],
            cands[best_i, C_FSDP], best_obj, best_boundary)


@kernel
def fitting_cost(
    fl: FArr, it: IArr, tp: int, pp: int, dp: int, recompute: bool, fsdp: bool, layers: IArr, figs: FArr
) -> tuple[bool, float, float]:
    """:func:`spiderflow.core.tpa.level2.config_cost` of candidate ``(tp, pp, dp, recompute, fsdp)`` with
    ``layers[:pp]`` layers per sub-stage, and whether its peak memory fits (``max_j memory ≤ C``): the
    candidate's constants (:func:`coefficients`) and its figures (compute, memory in GiB, gradient sync) into
    ``figs[0:3, :pp]`` in one call. Returns ``(fits, objective, intra-cluster boundary)``."""
    mu = np.empty(pp, np.float64)
    nu = np.empty(pp, np.float64)
    beta = np.empty(pp, np.float64)
    tau, eta_head, eta_embed, alpha, p_in = coefficients(fl, it, tp, pp, dp, recompute, fsdp, mu, nu, beta)
    obj, boundary, peak = _config_cost(it[I_M], pp, dp, fl[F_FLOOR_S], fl[F_GIB], it[I_HAS_HEAD] != 0, tau,
                                       eta_head, alpha, p_in, mu, nu, beta, layers, figs, it[I_HAS_EMBED] != 0,
                                       eta_embed)
    return peak <= fl[F_MEMORY_GIB], obj, boundary


@kernel
def memory_caps(fl: FArr, it: IArr, tp: int, pp: int, dp: int, recompute: bool, fsdp: bool, out: IArr) -> None:
    """``u_j`` of candidate ``(tp, pp, dp, recompute, fsdp)`` into ``out[:pp]``: the most layers sub-stage ``j``
    holds within GPU memory (``L_b`` when memory is not bound)."""
    mu = np.empty(pp, np.float64)
    nu = np.empty(pp, np.float64)
    beta = np.empty(pp, np.float64)
    coefficients(fl, it, tp, pp, dp, recompute, fsdp, mu, nu, beta)
    _caps_into(mu, nu, pp, fl[F_MEMORY_GIB], fl[F_GIB], it[I_LAYERS], it[I_MEMORY_BOUND] != 0, out)


@kernel
def memory_caps_all(fl: FArr, it: IArr) -> tuple[IArr, IArr, IArr]:
    """:func:`memory_caps` of every candidate: ``(candidates, start, caps)``, candidate ``i``'s caps at
    ``caps[start[i]:start[i + 1]]``."""
    cands = candidates(fl, it)
    start, _, _, _, _, mu, nu, _, _ = _all_coefficients(fl, it, cands)
    caps = np.empty(start[-1], np.int64)
    for i in range(cands.shape[0]):
        s0 = start[i]
        s1 = start[i + 1]
        _caps_into(mu[s0:s1], nu[s0:s1], cands[i, 1], fl[F_MEMORY_GIB], fl[F_GIB], it[I_LAYERS],
                   it[I_MEMORY_BOUND] != 0, caps[s0:s1])
    return cands, start, caps


@kernel
def min_peak_fits(fl: FArr, it: IArr) -> bool:
    """:func:`spiderflow.core.tpa.level2.min_peak_fits`: some candidate's sub-stages each hold one layer and their
    most layers within memory add up to ``L_b``."""
    cands = candidates(fl, it)
    start, _, _, _, _, mu, nu, _, _ = _all_coefficients(fl, it, cands)
    cap = fl[F_MEMORY_GIB]
    gib = fl[F_GIB]
    top = it[I_LAYERS]
    for i in range(cands.shape[0]):
        total = 0
        for q in range(start[i], start[i + 1]):
            if (mu[q] + nu[q]) / gib > cap:  # one layer
                total = -1
                break
            n = max(1, min(top, _floor((cap * gib - nu[q]) / mu[q], top)))
            while n < top and (mu[q] * (n + 1) + nu[q]) / gib <= cap:
                n += 1
            while n > 1 and (mu[q] * n + nu[q]) / gib > cap:
                n -= 1
            total += n
        if total >= top:
            return True
    return False


@kernel
def min_memory_config(fl: FArr, it: IArr, layers_out: IArr, figs_out: FArr) -> Picked:
    """:func:`spiderflow.core.tpa.level2.min_memory_config`: every candidate with its min-peak split (one layer
    at a time to the sub-stage whose memory grows least, ties: the first), the least peak wins (ties: the
    first candidate). Returns and writes what :func:`solve_exact` does for the winner's split; ``t = 0``
    when there is no candidate."""
    cands = candidates(fl, it)
    nk = cands.shape[0]
    if nk == 0:
        return 0, 0, 0, 0, 0, 0.0, 0.0
    start, tau, eta, alpha, p_ins, mu, nu, beta, eta_e = _all_coefficients(fl, it, cands)
    gib = fl[F_GIB]
    layers = it[I_LAYERS]
    width = 1
    for i in range(nk):
        width = max(width, cands[i, 1])
    alloc = np.empty(width, np.int64)
    grow = np.empty(width, np.float64)
    best_peak = 0.0
    best_i = -1
    for i in range(nk):
        pp = cands[i, 1]
        s0 = start[i]
        for j in range(pp):
            alloc[j] = 1
            grow[j] = mu[s0 + j] * 2 + nu[s0 + j]
        for _ in range(layers - pp):
            pick = 0
            for j in range(1, pp):
                if grow[j] < grow[pick]:
                    pick = j
            alloc[pick] += 1
            grow[pick] = mu[s0 + pick] * (alloc[pick] + 1) + nu[s0 + pick]
        peak = 0.0
        for j in range(pp):
            mem = (mu[s0 + j] * alloc[j] + nu[s0 + j]) / gib
            peak = mem if j == 0 else _pmax(peak, mem)
        if best_i < 0 or peak < best_peak:
            best_peak = peak
            best_i = i
            for j in range(pp):
                layers_out[j] = alloc[j]
    i = best_i
    s0 = start[i]
    s1 = start[i + 1]
    obj, boundary, _ = _config_cost(it[I_M], cands[i, 1], cands[i, 2], fl[F_FLOOR_S], gib, it[I_HAS_HEAD] != 0,
                                    tau[i], eta[i], alpha[i], p_ins[i], mu[s0:s1], nu[s0:s1], beta[s0:s1],
                                    layers_out, figs_out, it[I_HAS_EMBED] != 0, eta_e[i])
    return cands[i, C_TP], cands[i, C_PP], cands[i, C_DP], cands[i, C_RECOMPUTE], cands[i, C_FSDP], obj, boundary


@register_warmup
def _warm() -> None:
    fl = np.array([100.0, 16.0, 600.0, 100.0, 0.0, 0.0, 0.0, float(1 << 30), 0.5 * float(1 << 30),
                   12.0 * 256 * 256, 24.0 * 128 * 256 * 256 + 4.0 * 128 * 128 * 256, 512.0 * 256, 512.0 * 256,
                   4.0, 14.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    it = np.array([4, 4, 2, 2, 256, 4, 512, 1, 128, 4, 1, 1, 1, 0, 0, 1, 1, 1, 16, 2, 16, 1, 1, 4, 4, 4, 10], np.int64)
    assert fl.shape[0] == F_SIZE and it.shape[0] == I_SIZE
    lay = np.empty(4, np.int64)
    figs = np.empty((3, 4), np.float64)
    solve_exact(fl, it, lay, figs)
    min_memory_config(fl, it, lay, figs)
    min_peak_fits(fl, it)
    memory_caps(fl, it, 1, 2, 2, False, False, lay)
    memory_caps_all(fl, it)
    mu = np.empty(2, np.float64)
    coefficients(fl, it, 1, 2, 2, False, False, mu, mu.copy(), mu.copy())
    fitting_cost(fl, it, 1, 2, 2, False, False, np.array([2, 2], np.int64), figs)
