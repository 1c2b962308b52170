r"""The closed-form cost model shared by the scheduler, the planner, the simulator and every baseline.

Symbols (units in brackets):

- ``b`` micro-batch [samples], ``s`` sequence length [tokens], ``h`` hidden, ``a`` heads, ``V`` vocab.
- ``F_c`` achieved throughput of one GPU of cluster ``c`` [FLOP/s] = measured-or-peak TFLOPS × mfu.
- ``o_c`` fixed time per layer and micro-batch, forward + backward, on one GPU of cluster ``c`` [s]
  (``layer_overhead_ms``; per-operator launch and framework costs that do not scale with ``b·s``;
  0 unless calibrated).
- ``u_c`` optimizer step time per layer and training step on one GPU of cluster ``c`` [s]
  (``optimizer_ms_per_layer``; 0 unless calibrated).
- Per layer forward FLOPs ``f = 24·b·s·h² + 4·b·s²·h``; backward = 2 f; head forward ``2·b·s·h·V``.
- Activation crossing a stage boundary: ``A = 2·b·s·h`` bytes (bf16), the gradient coming back the same;
  ``A_c = w_c·b·s·h`` on the wire from a stage on cluster ``c``, ``w_c`` its GPU type's ``wire_bytes``
  (2 = bf16), widened to the precision's value size (:func:`wire_bytes`: the executor sends activations in the
  job's compute dtype on every device, fp32 for fp32/tf32 jobs).

Stage ``s`` (cluster ``c``, tensor degree ``t``, ``d`` replicas, layers ``ℓ_s``) per micro-batch:

    T_s = 3·FLOPs(ℓ_s) / (t · F_c)  +  |ℓ_s|·o_c  +  4·|ℓ_s|·AR_t(A, B_tp)           (compute + TP)
    AR_k(x, B) = 2(k−1)/k · x / B  (+ 2(k−1)·λ)                                        (ring all-reduce)

``B_tp`` is the intra-node bandwidth when ``t`` GPUs fit in one node, else the inter-node bandwidth.
A stage with ``d`` replicas admits one micro-batch every ``T_s / d`` in steady state.

Boundary between stages ``s`` and ``s+1``:

    P_s = A_{c_s} / b_{c_s c_{s+1}} + l_{c_s c_{s+1}}     (0 when both stages share a cluster and t fits a node;
                                                      else the cluster's inter-node bandwidth)

Pipeline step for ``m`` micro-batches, GPipe and 1F1B alike (they differ in memory, not in this bound):

    T_pipe = (m − 1) · max( max_s T_s/d_s , max_s P_s )  +  Σ_s T_s  +  2 · Σ_s P_s

(the activation crosses each boundary once forward and the gradient once backward on the critical
path, hence ``2·ΣP``). Interleaved 1F1B with ``v`` chunks divides the fill/drain term by ``v`` and
multiplies boundary crossings by ``v``. Exact event-level timings of every schedule (including the
latency-aware one) live in :mod:`spiderflow.core.schedules`; this closed form is what searches use.

Gradient synchronisation and the optimizer step, after the pipeline drains, stages in parallel:

    T_dp = max_s ( AR_{d_s}(4·params_s / t_s, B_dp(s))  +  |ℓ_s|·u_{c_s} )

(``4``: gradients are reduced in fp32 in every precision, :data:`GRAD_REDUCE_BYTES`.)

Memory per GPU of stage ``s`` (bytes):

    M_s = 18·params_s / t_s  +  k_s · act_s  +  R
    act_s = |ℓ_s| · s·b·h·(10 + 24/t + 5·a·s/(h·t))     (Korthikanti et al., no recomputation; without the
                                                        last term under ``fused_attention``)
    k_s = ⌈m/d_s⌉ for GPipe; min(⌈m/d_s⌉, S − i_s) for 1F1B (``i_s`` = stage index, ``S`` stages);
          min(⌈m/d_s⌉, 2(S − i_s)) for the latency-aware schedule; under a plan's in-flight cap ``K``
          (``plan.extras["max_in_flight"]``, :func:`spiderflow.core.schedules.plan_max_in_flight`) 1F1B and the
          latency-aware schedule hold ``min(k_s, K)`` (their warm-ups run capped at ``K − 1``)

``18`` bytes/parameter = fp32 master weights and gradients, two fp32 Adam moments and the bf16 weight copies
autocast keeps for the backward (:func:`state_bytes_per_param`).
``R`` is a fixed reserve for the runtime (:data:`RESERVED_GIB`). First/last stages add the embedding
(``V·h`` params) and the head plus its loss: ``(4·k_s + 14)·b·s·V/t`` bytes (:func:`loss_bytes`: the saved fp32
log-softmax per in-flight micro-batch, the logits' copies and gradients once).

Measured work outside the blocks (only where a profile measured it: the cluster's ``embedding_us_per_token``,
``head_us_per_token``, ``embedding_optimizer_ms``, ``head_optimizer_ms``, ``data_ms_per_sample``; all 0
otherwise and the formulas above are unchanged): the first stage's ``T_s`` adds the embedding's
``e_c·b·s``, the last stage's replaces the head's FLOPs with ``η_c·b·s`` (head and loss, not divided by
``t``: the executor replicates them); after the drain the first stage adds its embedding's optimizer step and
the host's input pipeline for its ``⌈m/d⌉·b`` samples, the last stage its head's optimizer step
(:func:`measured_outer_time`, :func:`measured_step_extra`).

Dollars per step: ``Σ_s gpus_s · W_c/1000 · step/3600 · price_c``.

Precision, sharding and recomputation (the formulas above are the bf16, replicated, no-recompute case):

- precision ``p`` (the job's): ``F_c`` scales by the GPU type's datasheet ratio of ``p``'s dense peak to the
  bf16 peak (:func:`compute_rate_tflops`); activation and TP all-reduce values take ``value_bytes(p)`` (2 for
  bf16/fp16, 4 for fp32/tf32), gradient values 4 in every precision (:data:`GRAD_REDUCE_BYTES`); replicated
  state is 20 bytes/parameter in fp32/tf32 (:func:`state_bytes_per_param`).
- ``fsdp`` stages: state ``16·params_s/(t·d)`` plus the stage unsharded through the step
  (``(8 + c)·params_s/t``, ``c`` autocast's 2-byte weight copy under bf16/fp16). As the executor runs
  FSDP2 inside a pipeline (``exec/parallel.py``: ``fully_shard(..., reshard_after_forward=False)``, no
  ``MixedPrecisionPolicy``; ``FsdpSync`` unshards every module once at the start of a step, keeps it unsharded
  through all micro-batches' forwards and backwards — no reshard after backward — and reduce-scatters and
  reshards once at the end), the stage's parameters are all-gathered once per step, in their fp32 master
  dtype (:data:`PARAM_GATHER_BYTES`), before the stage's first forward and not overlapped with compute:
  ``T_s`` is unchanged and the stage's per-step sync is ``AG_d(4·params_s/t) + AG_d(4·params_s/t)`` (the
  gather, and the gradients' reduce-scatter instead of the all-reduce; ``AG_d(x) = (d−1)/d · x/B``).
- ``recompute`` stages: 4 forward-equivalents per block instead of 3 (6 TP all-reduces instead of 4);
  activations held per in-flight micro-batch are the blocks' inputs (``v·s·b·h`` per block), plus one
  block's full activations rebuilt during backward.

Framework options a plan may carry in ``plan.extras`` (``1.0`` on, ``0.0`` or absent off; off prices exactly as
above, and the planner never sets them: they describe how other frameworks run a plan, for
``spiderflow estimate`` and ``bench/fidelity.py``):

- ``overlap`` (:data:`OVERLAP_KEY`; Megatron-LM ``--tp-comm-overlap --overlap-grad-reduce``): the TP
  all-reduces are decomposed into ``t`` chunks pipelined with the block's matmuls (Transformer Engine's
  userbuffers; Wang et al., ASPLOS 2023), so ``max(C/t, C − G)`` of their time ``C`` stays exposed (``G``:
  the matmul time they hide behind); the gradient all-reduce runs in buckets during the backward of the
  step's last micro-batch, so ``max(T_ar − ⅔·T_s, T_ar·β/P)`` stays exposed (``β``: Megatron-core's default
  bucket, ``max(4·10⁷, 10⁶·d)`` parameters; ``P`` the stage's parameters per GPU) — :func:`exposed_tp_comm`,
  :func:`exposed_dp_sync`.
- ``selective_recompute`` (:data:`SELECTIVE_RECOMPUTE_KEY`; torchtitan's ``selective_ac_option = 'op'``):
  stages without full recomputation keep, per block, its input, the attention output and the output of
  every odd-numbered matmul (1st, 3rd, …); the even-numbered matmuls and everything else are recomputed in
  backward (:func:`selective_saved_bytes`, :func:`selective_recompute_flops`).
- ``fsdp_per_block`` (:data:`FSDP_PER_BLOCK_KEY`; torchtitan's FSDP2 without pipelining: ``fully_shard`` per
  block with ``reshard_after_forward=True`` and ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``): an ``fsdp`` stage gathers each block's parameters in the compute dtype before its
  forward and again before its backward, prefetched behind the neighbouring block's compute, so
  ``T_s ← max(T_s, 2·AG_d(v·params_s/t))`` and the step's sync is the gradients' reduce-scatter alone; it
  holds two blocks unsharded at a time (the one computing and the one prefetched, parameters and gradients
  in the compute dtype: ``2·2·v·params_layer/t`` on top of the shard) instead of the whole stage.

``step_time = T_pipe + T_dp``; ``throughput = global_batch · s / step_time`` tokens/s.
Fidelity against published GPU measurements and our executed runs: ``bench/fidelity.py`` (BENCHMARKS.md).
Everything here is pure: no I/O, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from spiderflow.core.catalog import ModelFamily, ModelSpec
from spiderflow.core.domain import (
    Cluster,
    JobSpec,
    Plan,
    Precision,
    Schedule,
    Sharding,
    Stage,
    Topology,
)
from spiderflow.core.errors import ValidationError
from spiderflow.core.schedules import plan_max_in_flight

__all__ = [
    "BYTES_PER_PARAM",
    "FSDP_PER_BLOCK_KEY",
    "FSDP_UNSHARDED_BYTES",
    "GIB",
    "GRAD_REDUCE_BYTES",
    "LOGIT_BYTES",
    "LOGIT_ONCE_BYTES",
    "LOGIT_SAVED_BYTES",
    "OVERLAP_KEY",
    "PARAM_GATHER_BYTES",
    "RESERVED_GIB",
    "SELECTIVE_RECOMPUTE_KEY",
    "Breakdown",
    "PlanOptions",
    "activation_bytes",
    "allreduce_time",
    "compute_rate_tflops",
    "evaluate",
    "evaluate_with_breakdown",
    "exposed_dp_sync",
    "exposed_tp_comm",
    "fsdp_unsharded_bytes_per_param",
    "grad_bytes_per_value",
    "in_flight_microbatches",
    "layer_activation_bytes",
    "layer_fwd_flops",
    "loss_bytes",
    "measured_outer_time",
    "measured_step_extra",
    "pipeline_step_time",
    "plan_fits_memory",
    "plan_options",
    "selective_recompute_flops",
    "selective_saved_bytes",
    "stage_activation_bytes_per_microbatch",
    "stage_compute_time",
    "stage_fwd_flops",
    "stage_memory_bytes",
    "stage_params",
    "state_bytes_per_param",
    "transfer_time",
    "wire_bytes",
]

GIB = float(1 << 30)
BYTES_PER_PARAM = 18
LOGIT_SAVED_BYTES = 4.0
"""Bytes per logit value (``b·s·V/t`` of them) the last stage keeps for every in-flight micro-batch: the fp32
log-softmax ``cross_entropy(logits.float())`` saves for its backward (:func:`loss_bytes`)."""
LOGIT_ONCE_BYTES = 14.0
"""Bytes per logit value the last stage holds once, whatever its in-flight count: the bf16 logits and their fp32
copy while the loss runs, then in the loss's backward the fp32 incoming gradient, the fp32 gradient of the copy
and its bf16 cast — transient, one micro-batch at a time (:func:`loss_bytes`)."""
LOGIT_BYTES = LOGIT_SAVED_BYTES + LOGIT_ONCE_BYTES
"""Bytes per logit value the last stage holds at its peak with one micro-batch in flight (18): the loss as the
executor runs it, ``cross_entropy(logits.float())`` under bf16 autocast. Measured with the executor on an H200
(BENCHMARKS.md, "On a GPU"): each further sequence of a micro-batch added 1.73 GiB beyond the blocks' activations
at GPT-3 1.3B's vocabulary, 18.0 bytes per logit. Of these only the saved fp32 log-softmax
(:data:`LOGIT_SAVED_BYTES`) stays per in-flight micro-batch; the rest (:data:`LOGIT_ONCE_BYTES`) exists once,
during a forward or backward of the loss. torchtitan runs the same eager loss."""


def loss_bytes(model: ModelSpec, b: int, s: int, tp: int, in_flight: int) -> float:
    """Bytes of the loss the last stage holds per GPU with ``in_flight`` micro-batches in flight:
    ``(k·LOGIT_SAVED_BYTES + LOGIT_ONCE_BYTES)·b·s·V/t`` (0 with none in flight). At ``k = 1`` (1F1B's last
    stage) this is :data:`LOGIT_BYTES` per logit, bit for bit. Every restatement of the last stage's memory
    (level 2's kernel, the placement scorer and fallback tables, the ILP) takes its bytes from here."""
    if in_flight <= 0:
        return 0.0
    return (in_flight * LOGIT_SAVED_BYTES + LOGIT_ONCE_BYTES) * b * s * model.vocab / tp


RESERVED_GIB = 0.5
OVERLAP_KEY = "overlap"
"""``plan.extras`` key: communication overlapped with compute as Megatron-LM runs it (module docstring)."""
SELECTIVE_RECOMPUTE_KEY = "selective_recompute"
"""``plan.extras`` key: op-level selective activation checkpointing as torchtitan runs it (module docstring)."""
FSDP_PER_BLOCK_KEY = "fsdp_per_block"
"""``plan.extras`` key: FSDP resharded per block after forward, gathering in the compute dtype, as torchtitan
runs it without pipelining (module docstring)."""
DDP_BUCKET_PARAMS = 40_000_000
"""Megatron-core's default gradient bucket (``max(4·10⁷, 10⁶·d)`` parameters; ``megatron/core/distributed/
distributed_data_parallel.py``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """How the framework runs a plan beyond its stages (module docstring): both off for the plans the
    planner emits."""

    overlap: bool = False
    selective_recompute: bool = False
    fsdp_per_block: bool = False


def _flag(plan: Plan, key: str) -> bool:
    v = plan.extras.get(key, 0.0)
    if v not in (0.0, 1.0):
        raise ValidationError(f"plan.extras.{key}", "must be 0 or 1", v)
    return v == 1.0


def plan_options(plan: Plan) -> PlanOptions:
    """The framework options ``plan.extras`` carries (:data:`OVERLAP_KEY`, :data:`SELECTIVE_RECOMPUTE_KEY`,
    :data:`FSDP_PER_BLOCK_KEY`); a value other than 0 or 1 raises
    :class:`~spiderflow.core.errors.ValidationError` naming the key."""
    return PlanOptions(overlap=_flag(plan, OVERLAP_KEY), selective_recompute=_flag(plan, SELECTIVE_RECOMPUTE_KEY),
                       fsdp_per_block=_flag(plan, FSDP_PER_BLOCK_KEY))


def _block_matmul_widths(model: ModelSpec) -> tuple[int, ...]:
    """Output widths of one block's matmuls in call order (the order a selective policy counts them)."""
    h = model.hidden
    if model.family is ModelFamily.LLAMA:
        kv = model.kv_dim
        return (h, kv, kv, h, model.ffn, model.ffn, h)  # wq, wk, wv, wo, w1, w3, w2
    f = model.ffn_hidden or 4 * h
    return (3 * h, h, f, h)  # fused qkv, projection, fc1, fc2


def selective_saved_bytes(model: ModelSpec, tp: int, b: int, s: int, precision: Precision = Precision.BF16) -> float:
    """Bytes one block keeps per micro-batch on one GPU under op-level selective checkpointing (torchtitan's
    ``'op'`` policy: the attention output and every odd-numbered matmul's output are saved, the rest is
    recomputed): the block's input, the attention output and the saved matmul outputs, in the precision's
    value size, split over ``tp``."""
    widths = _block_matmul_widths(model)
    saved = sum(widths[0::2])
    vb = float(precision.value_bytes)
    return vb * s * b * (model.hidden + (model.hidden + saved) / tp)


def selective_recompute_flops(model: ModelSpec, b: int, s: int) -> float:
    """Forward FLOPs one block recomputes in backward under op-level selective checkpointing: the
    even-numbered matmuls (``2·b·s·h·width`` each)."""
    return sum(2.0 * b * s * model.hidden * w for w in _block_matmul_widths(model)[1::2])


def exposed_tp_comm(comm_s: float, hide_s: float, tp: int) -> float:
    """Exposed share of ``comm_s`` seconds of TP all-reduce decomposed into ``tp`` chunks and pipelined with
    ``hide_s`` seconds of matmuls: ``max(comm/t, comm − hide)``."""
    if tp <= 1:
        return comm_s
    return max(comm_s / tp, comm_s - hide_s)


def exposed_dp_sync(ar_s: float, backward_s: float, params_per_gpu: float, dp: int) -> float:
    """Exposed share of a gradient all-reduce of ``ar_s`` seconds run in buckets during ``backward_s`` seconds of
    the last micro-batch's backward: ``max(ar − backward, ar·β/P)`` (the last bucket, ``β`` parameters of
    ``P``, cannot overlap)."""
    if ar_s <= 0.0 or params_per_gpu <= 0.0:
        return ar_s
    bucket = max(float(DDP_BUCKET_PARAMS), 1e6 * dp)
    return max(ar_s - backward_s, ar_s * min(1.0, bucket / params_per_gpu))


def layer_fwd_flops(model: ModelSpec, b: int, s: int) -> float:
    """Forward FLOPs of one transformer layer: ``2·b·s·P_layer + 4·b·s²·h`` (``24·b·s·h² + 4·b·s²·h`` for
    the ``gpt`` family's ``12·h²`` parameters; :meth:`~spiderflow.core.catalog.ModelSpec.layer_fwd_flops`)."""
    return model.layer_fwd_flops(b, s)


def activation_bytes(model: ModelSpec, b: int, s: int, bytes_per_value: int = 2) -> float:
    """Bytes of the activation (or its gradient) crossing a stage boundary: ``2·b·s·h`` (bf16), or
    ``bytes_per_value·b·s·h``."""
    return float(bytes_per_value) * b * s * model.hidden


def stage_fwd_flops(model: ModelSpec, first: int, last: int, b: int, s: int) -> float:
    """Forward FLOPs of layers ``first..last``; the last layer's stage also runs the head."""
    flops = (last - first + 1) * layer_fwd_flops(model, b, s)
    if last == model.layers - 1:
        flops += 2.0 * b * s * model.hidden * model.vocab
    return flops


def stage_params(model: ModelSpec, first: int, last: int) -> float:
    """Parameters of layers ``first..last`` plus embedding (first stage) and head (last stage)."""
    p = (last - first + 1) * float(model.params_per_layer)
    if first == 0:
        p += model.embedding_params
    if last == model.layers - 1:
        p += model.head_params
    return p


def transfer_time(nbytes: float, gbps: float, latency_ms: float) -> float:
    """Seconds to move ``nbytes`` over a ``gbps`` link with one-way latency ``latency_ms``."""
    if gbps <= 0:
        return math.inf
    if math.isinf(gbps):
        return latency_ms / 1e3
    return nbytes * 8.0 / (gbps * 1e9) + latency_ms / 1e3


def allreduce_time(nbytes: float, d: int, gbps: float, latency_ms: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes`` over ``d`` members: ``2(d−1)/d · x/B + 2(d−1)·λ``."""
    if d <= 1:
        return 0.0
    if gbps <= 0:
        return math.inf
    return 2.0 * (d - 1) / d * nbytes * 8.0 / (gbps * 1e9) + 2.0 * (d - 1) * latency_ms / 1e3


def _tp_bandwidth(cluster: Cluster, tp: int) -> float:
    return cluster.intra_node_gbps if tp <= cluster.gpus_per_node else cluster.inter_node_gbps


def _dp_bandwidth(cluster: Cluster, stage_gpus: int) -> float:
    return cluster.intra_node_gbps if stage_gpus <= cluster.gpus_per_node else cluster.inter_node_gbps


def compute_rate_tflops(cluster: Cluster, precision: Precision = Precision.BF16) -> float:
    """Achieved TFLOPS per GPU of ``cluster`` in ``precision``: ``effective_tflops`` (measured-or-peak × mfu,
    a bf16 figure on GPUs) scaled by the GPU type's datasheet ratio of the precision's dense peak to the bf16
    peak (:meth:`spiderflow.core.catalog.GpuType.precision_tflops`: fp32 on CUDA cores, tf32 on TF32 tensor
    cores). ``bf16``/``fp16`` and types without per-precision figures (``cpu``, calibrated in bf16 by the
    agents, :data:`agent.profiler.CPU_CALIBRATION_PRECISION`) are unscaled."""
    if precision in (Precision.BF16, Precision.FP16):
        return cluster.effective_tflops
    gt = cluster.gpu_type
    if gt.fp32_tflops is None:
        return cluster.effective_tflops
    return cluster.effective_tflops * gt.precision_tflops(precision.value) / gt.peak_tflops


def wire_bytes(cluster: Cluster, precision: Precision = Precision.BF16) -> int:
    """Bytes per activation value a stage on ``cluster`` sends: the GPU type's wire format, widened to the
    precision's value size (fp32/tf32 training sends 4-byte activations)."""
    return max(cluster.gpu_type.wire_bytes, precision.value_bytes)


GRAD_REDUCE_BYTES = 4
"""Bytes per gradient value the data-parallel all-reduce/reduce-scatter moves in every precision: the executor
keeps fp32 master weights, so their gradients are fp32 even under bf16/fp16 autocast, and it reduces them as
they are (``exec/runtime.py``, one flat fp32 all-reduce; FSDP2 without a ``reduce_dtype`` reduce-scatters
fp32). Megatron-LM's default (``--accumulate-allreduce-grads-in-fp32`` with its distributed optimizer) and
torchtitan's ``mixed_precision_reduce = "float32"`` also reduce in fp32."""


def grad_bytes_per_value(precision: Precision = Precision.BF16) -> int:
    """Bytes per gradient value in the data-parallel all-reduce/reduce-scatter: :data:`GRAD_REDUCE_BYTES`
    (fp32) in every precision, mixed precision included (gradients are reduced in their master weights'
    fp32). Every restatement of the gradient sync (level 1 and 2 and their kernels, the chain scorers, the
    baselines) takes it from here."""
    del precision  # the same in every precision; kept so that a precision-dependent rule has one place
    return GRAD_REDUCE_BYTES


def state_bytes_per_param(precision: Precision = Precision.BF16, sharding: Sharding = Sharding.REPLICATE) -> int:
    """Bytes of weights, gradients and Adam state per parameter before sharding.

    ``bf16``/``fp16``, replicated: 18 (:data:`BYTES_PER_PARAM`): the executor trains fp32 master weights (4) with
    fp32 gradients (4) and two fp32 Adam moments (8), and autocast keeps a bf16 copy of every weight for the
    backward (2). Measured on an H200 (BENCHMARKS.md, "On a GPU"): at one sequence per micro-batch GPT-3
    1.3B's peak of allocated tensors was 28.6 GiB against 28.7 predicted this way. Megatron-LM documents the
    same 18 for bf16 parameters with fp32 gradients (``docs/source/api-guide/dist_optimizer.md``).
    ``fp32``/``tf32``, replicated: 20 (4 weights + 4 grads + 8 Adam + 4 for DDP's flat gradient buckets, which
    PyTorch keeps as a separate copy by default). ``fsdp`` (any precision): 16 on the shard (fp32 sharded
    parameters and gradients, 8 Adam; FSDP2 mixed precision keeps the sharded state in fp32); the
    unsharded working copy is priced separately (:func:`stage_memory_bytes`)."""
    if sharding is Sharding.FSDP:
        return 16
    return BYTES_PER_PARAM if precision in (Precision.BF16, Precision.FP16) else 20


FSDP_UNSHARDED_BYTES = 8
"""Bytes per parameter an FSDP stage holds unsharded through a step, on top of its shard: the fp32 parameters
all-gathered at the step's start (4) and their fp32 gradients, accumulated unsharded over the step's
micro-batches until the drain's reduce-scatter (4). The executor (``exec/parallel.py`` ``FsdpSync``) turns
off resharding after forward and after backward and gradient sync for the step, so both stay whole."""


def fsdp_unsharded_bytes_per_param(precision: Precision = Precision.BF16) -> int:
    """Bytes per parameter an FSDP stage holds beyond its shard during a step: :data:`FSDP_UNSHARDED_BYTES`,
    plus under ``bf16``/``fp16`` autocast's copy of every weight kept for the backward (2, as for replicas:
    :func:`state_bytes_per_param`)."""
    cast = BYTES_PER_PARAM - 16 if precision in (Precision.BF16, Precision.FP16) else 0
    return FSDP_UNSHARDED_BYTES + cast


def fsdp_gather_time(nbytes: float, d: int, gbps: float) -> float:
    """Ring all-gather (or reduce-scatter) of ``nbytes`` over ``d`` members: ``(d−1)/d · x/B``."""
    if d <= 1:
        return 0.0
    if gbps <= 0:
        return math.inf
    return (d - 1) / d * nbytes * 8.0 / (gbps * 1e9)


PARAM_GATHER_BYTES = 4
"""Bytes per parameter value FSDP all-gathers in every precision: the executor shards its fp32 master weights
with FSDP2 and no ``MixedPrecisionPolicy``, so ``param_dtype`` is the parameters' own fp32 (torch's
``FSDPParam.init_dtype_attrs``: no cast when ``param_dtype`` is unset); autocast casts them per op."""


def stage_compute_time(
    model: ModelSpec, cluster: Cluster, first: int, last: int, tp: int, b: int, s: int, *,
    precision: Precision = Precision.BF16, recompute: bool = False, selective: bool = False,
    overlap: bool = False, fsdp_per_block_dp: int = 1,
) -> float:
    """``T_s``: forward + backward seconds of one micro-batch on one replica (compute, the per-layer fixed
    overhead, TP all-reduces; with ``fsdp_per_block_dp = d > 1`` at least the per-block parameter gathers of
    the ``fsdp_per_block`` framework option over ``d`` shards, which prefetching hides behind compute).

    ``precision`` sets the compute rate (:func:`compute_rate_tflops`) and the TP all-reduce's value size;
    ``recompute`` runs the blocks' forward a second time in backward (4 instead of 3 forward-equivalents per
    block, 6 TP all-reduces instead of 4; the head is not recomputed). FSDP adds nothing per micro-batch: the
    executor gathers a stage's parameters once per step (priced with the gradient sync, :func:`breakdown`).
    ``selective`` (without ``recompute``) adds the
    even-numbered matmuls' forward (:func:`selective_recompute_flops`; the policy saves the reduce-scatters, so
    the TP all-reduces stay 4); ``overlap`` leaves only :func:`exposed_tp_comm` of the TP all-reduces, hidden
    behind the stage's matmuls."""
    layers = last - first + 1
    flops = 3.0 * stage_fwd_flops(model, first, last, b, s)
    outer = measured_outer_time(model, cluster, first, last, b, s)
    if cluster.head_us_per_token and last == model.layers - 1:
        flops -= 3.0 * 2.0 * b * s * model.hidden * model.vocab  # measured instead (in ``outer``)
    fwd_passes = 3.0
    if recompute:
        flops += layers * layer_fwd_flops(model, b, s)
        fwd_passes = 4.0
    elif selective:
        flops += layers * selective_recompute_flops(model, b, s)
    rate = tp * compute_rate_tflops(cluster, precision) * 1e12
    compute = flops / rate
    if cluster.layer_overhead_ms:
        compute += layers * cluster.layer_overhead_ms / 1e3
    if outer:
        compute += outer
    n_ar = 6 if recompute else 4
    vb = precision.value_bytes
    comm = n_ar * layers * allreduce_time(activation_bytes(model, b, s, vb), tp, _tp_bandwidth(cluster, tp))
    if overlap and comm > 0.0:
        matmuls = fwd_passes * layers * 2.0 * b * s * model.params_per_layer / rate
        comm = exposed_tp_comm(comm, matmuls, tp)
    t = compute + comm
    if fsdp_per_block_dp > 1:  # each block gathered before its forward and again before its backward
        gather = 2.0 * fsdp_gather_time(vb * stage_params(model, first, last) / tp, fsdp_per_block_dp,
                                        _dp_bandwidth(cluster, tp * fsdp_per_block_dp))
        t = max(t, gather)
    return t


def measured_outer_time(model: ModelSpec, cluster: Cluster, first: int, last: int, b: int, s: int) -> float:
    """Seconds per micro-batch (forward + backward) of the work outside the blocks that a profile measured on
    ``cluster`` (:func:`spiderflow.profile.apply_profile`): the embedding on the stage holding layer 0, the
    head and its loss on the stage holding the last layer, each ``us_per_token · b·s``. Both run replicated
    under tensor parallelism (the executor shards only the blocks), so ``tp`` does not divide them. 0 when
    nothing was measured (the head is then priced by its FLOPs at the blocks' rate, the embedding not)."""
    t = 0.0
    if first == 0 and cluster.embedding_us_per_token:
        t += cluster.embedding_us_per_token * b * s / 1e6
    if last == model.layers - 1 and cluster.head_us_per_token:
        t += cluster.head_us_per_token * b * s / 1e6
    return t


def measured_step_extra(model: ModelSpec, cluster: Cluster, first: int, last: int, samples: int) -> float:
    """Seconds per training step of the work outside the blocks and the pipeline that a profile measured on
    ``cluster``: the optimizer step over the embedding (stage holding layer 0) and over the head (stage
    holding the last layer), and on the first stage the host's input pipeline for its ``samples`` samples
    of the step (drawn before the step's first forward; the last stage draws its targets while the
    pipeline fills). 0 when nothing was measured."""
    t = 0.0
    if first == 0:
        t += cluster.embedding_optimizer_ms / 1e3 + cluster.data_ms_per_sample * samples / 1e3
    if last == model.layers - 1:
        t += cluster.head_optimizer_ms / 1e3
    return t


def layer_activation_bytes(model: ModelSpec, tp: int, b: int, s: int, *, fused_attention: bool = False) -> float:
    """Activation bytes one block keeps for backward per micro-batch on one GPU:
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (Korthikanti et al. 2022, no recomputation). With
    ``fused_attention`` the ``5·a·s/(h·t)`` term of the stored attention scores is dropped: fused attention
    (PyTorch's ``scaled_dot_product_attention``, flash/memory-efficient on GPUs) keeps no ``s×s`` matrix.
    The fidelity benchmark's measured peaks agree with the fused form (BENCHMARKS.md); the planner's searches
    and kernels still restate the unfused form, so it is the default until they change together."""
    h = model.hidden
    scores = 0.0 if fused_attention else 5.0 * model.heads * s / (h * tp)
    return s * b * h * (10.0 + 24.0 / tp + scores)


def stage_activation_bytes_per_microbatch(
    model: ModelSpec, first: int, last: int, tp: int, b: int, s: int, *,
    recompute: bool = False, precision: Precision = Precision.BF16, fused_attention: bool = False,
    selective: bool = False,
) -> float:
    """Activation memory one in-flight micro-batch pins on one GPU of the stage. With ``recompute`` each block
    keeps only its input (``value_bytes·s·b·h``) and the backward rebuilds one block's activations at a time
    (counted once here; the in-flight count multiplies only the inputs — see :func:`stage_memory_bytes`).
    The last stage adds the loss's saved log-softmax (:data:`LOGIT_SAVED_BYTES` per logit value; the loss's
    once-per-stage bytes are added by :func:`stage_memory_bytes`).
    With ``selective`` (and not ``recompute``) each block keeps :func:`selective_saved_bytes`."""
    per_layer = layer_activation_bytes(model, tp, b, s, fused_attention=fused_attention)
    if recompute:
        kept = float(precision.value_bytes) * s * b * model.hidden
    elif selective:
        kept = selective_saved_bytes(model, tp, b, s, precision)
    else:
        kept = per_layer
    act = (last - first + 1) * kept
    if last == model.layers - 1:
        act += LOGIT_SAVED_BYTES * b * s * model.vocab / tp
    return act


def stage_memory_bytes(
    model: ModelSpec, first: int, last: int, tp: int, b: int, s: int, in_flight: int, *,
    precision: Precision = Precision.BF16, sharding: Sharding = Sharding.REPLICATE, dp: int = 1,
    recompute: bool = False, fused_attention: bool = False, selective: bool = False, fsdp_per_block: bool = False,
) -> float:
    """``M_s``: bytes per GPU with ``in_flight`` micro-batches of activations held.

    Weights, gradients and optimizer state: :func:`state_bytes_per_param` per parameter, divided by ``tp``
    and, under ``fsdp``, by ``dp`` — plus, under ``fsdp``, the whole stage unsharded through the step
    (:func:`fsdp_unsharded_bytes_per_param` per parameter, divided by ``tp`` only): the executor's
    step-granular FSDP gathers every parameter at the step's start and accumulates full gradients until the
    drain; with ``fsdp_per_block`` (the framework option) two blocks' parameters and gradients in the compute
    dtype instead (the block computing and the one prefetched).
    With ``recompute`` the held
    activations are the blocks' inputs, plus one block's full activations rebuilt during backward; with
    ``selective`` (not ``recompute``) they are :func:`selective_saved_bytes` per block, plus likewise one block
    rebuilt. The last stage adds the loss (:func:`loss_bytes`): :data:`LOGIT_SAVED_BYTES` per logit value and
    in-flight micro-batch, and :data:`LOGIT_ONCE_BYTES` per logit value once."""
    params = stage_params(model, first, last)
    fsdp = sharding is Sharding.FSDP and dp > 1
    state = state_bytes_per_param(precision, sharding) * params / (tp * (dp if fsdp else 1))
    if fsdp and fsdp_per_block:
        state += 2.0 * 2.0 * precision.value_bytes * model.params_per_layer / tp
    elif fsdp:
        state += fsdp_unsharded_bytes_per_param(precision) * params / tp
    act = in_flight * stage_activation_bytes_per_microbatch(
        model, first, last, tp, b, s, recompute=recompute, precision=precision, fused_attention=fused_attention,
        selective=selective,
    )
    if last == model.layers - 1 and in_flight > 0:
        act += LOGIT_ONCE_BYTES * b * s * model.vocab / tp
    if recompute or selective:
        act += layer_activation_bytes(model, tp, b, s, fused_attention=fused_attention)
    return state + act + RESERVED_GIB * GIB


def in_flight_microbatches(
    schedule: Schedule, m: int, dp: int, stage_index: int, n_stages: int, *, max_in_flight: int | None = None
) -> int:
    """``k_s``: micro-batches whose activations a replica of stage ``stage_index`` holds at peak; an in-flight
    cap ``max_in_flight = K`` bounds it for 1F1B and the latency-aware schedule (the schedules whose
    warm-ups the cap shortens; GPipe and interleaved orders ignore it)."""
    per_replica = math.ceil(m / dp)
    if schedule is Schedule.GPIPE:
        return per_replica
    if schedule is Schedule.LATENCY_AWARE:
        # Deeper warm-up: up to twice the 1F1B depth (see spiderflow.core.schedules for the exact policy).
        k = min(per_replica, 2 * (n_stages - stage_index))
    else:
        k = min(per_replica, n_stages - stage_index)
    if max_in_flight is not None and schedule in (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE):
        k = min(k, max_in_flight)
    return k


def pipeline_step_time(
    compute: Sequence[float], replicas: Sequence[int], boundaries: Sequence[float], m: int, chunks: int = 1
) -> float:
    """``T_pipe`` of the module docstring; ``boundaries[i]`` is ``P`` between stage i and i+1."""
    if not compute:
        raise ValueError("a pipeline needs at least one stage")
    bottleneck = max(max(t / d for t, d in zip(compute, replicas, strict=True)), max(boundaries, default=0.0))
    fill = sum(compute) / chunks
    comm = 2.0 * sum(boundaries) * chunks
    return (m - 1) * bottleneck + fill + comm


@dataclass(frozen=True, slots=True, kw_only=True)
class Breakdown:
    """Per-stage figures behind an estimate (same order as the plan's stages). ``dp_sync_s`` is ``T_dp``:
    the slowest stage's gradient all-reduce plus optimizer step (``optimizer_s`` per stage, with the measured
    per-step work outside the blocks, :func:`measured_step_extra`, where a profile supplied it)."""

    compute_s: tuple[float, ...]
    boundary_s: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    memory_gib: tuple[float, ...]
    pipeline_s: float
    dp_sync_s: float
    optimizer_s: tuple[float, ...] = ()


def boundary_time(
    topo: Topology, model: ModelSpec, a: Stage, b_: Stage, b: int, s: int, precision: Precision = Precision.BF16
) -> float:
    """``P`` between consecutive stages ``a`` and ``b_`` (``A`` in the sending cluster's wire format,
    :func:`wire_bytes`)."""
    c = topo.cluster(a.cluster)
    nbytes = activation_bytes(model, b, s, wire_bytes(c, precision))
    if a.cluster == b_.cluster:
        return transfer_time(nbytes, c.inter_node_gbps, 0.0)
    return transfer_time(nbytes, topo.bandwidth_gbps(a.cluster, b_.cluster), topo.latency_ms(a.cluster, b_.cluster))


def _dp_sync_time(
    model: ModelSpec, st: Stage, c: Cluster, precision: Precision, *, overlap: bool = False, compute_s: float = 0.0,
    per_block: bool = False,
) -> float:
    """Gradient synchronisation of one stage: ring all-reduce of its gradients (replicated), or under ``fsdp``
    their reduce-scatter over the shards plus the step's one all-gather of the fp32 parameters
    (``AG_d`` of :data:`PARAM_GATHER_BYTES` per parameter, :func:`fsdp_gather_time`); gradient values in
    :func:`grad_bytes_per_value`. With ``overlap`` only :func:`exposed_dp_sync` of the gradients' part, behind
    the backward (``⅔·compute_s``) of the last micro-batch (the gather runs before the step's first forward:
    never hidden). ``per_block`` (the ``fsdp_per_block`` framework option): the gathers run per block inside
    the micro-batches (:func:`stage_compute_time`), so the sync is the reduce-scatter alone."""
    params = stage_params(model, st.first_layer, st.last_layer) / st.tp
    nbytes = float(grad_bytes_per_value(precision)) * params
    bw = _dp_bandwidth(c, st.gpus)
    if st.sharding is Sharding.FSDP:
        t = fsdp_gather_time(nbytes, st.dp, bw)
        gather = 0.0 if per_block else fsdp_gather_time(PARAM_GATHER_BYTES * params, st.dp, bw)
    else:
        t = allreduce_time(nbytes, st.dp, bw)
        gather = 0.0
    if overlap:
        t = exposed_dp_sync(t, 2.0 / 3.0 * compute_s, params, st.dp)
    return t + gather


def breakdown(
    plan: Plan, topo: Topology, model: ModelSpec, *, micro_batch: int, seq_len: int,
    precision: Precision = Precision.BF16, fused_attention: bool = False,
) -> Breakdown:
    """Compute every term of the module docstring for ``plan`` (in ``precision``; each stage's ``sharding``
    and ``recompute`` priced as :func:`stage_compute_time` and :func:`stage_memory_bytes` say, the plan's
    framework options as :func:`plan_options` reads them)."""
    b, s = micro_batch, seq_len
    opts = plan_options(plan)
    stages = plan.stages
    clusters = [topo.cluster(st.cluster) for st in stages]
    compute = tuple(
        stage_compute_time(model, c, st.first_layer, st.last_layer, st.tp, b, s, precision=precision,
                           recompute=st.recompute,
                           selective=opts.selective_recompute, overlap=opts.overlap,
                           fsdp_per_block_dp=st.dp if opts.fsdp_per_block and st.sharding is Sharding.FSDP else 1)
        for st, c in zip(stages, clusters, strict=True)
    )
    bounds = tuple(boundary_time(topo, model, stages[i], stages[i + 1], b, s, precision)
                   for i in range(len(stages) - 1))
    chunks = int(plan.extras.get("chunks", 2 if plan.schedule is Schedule.INTERLEAVED_1F1B else 1))
    pipe = pipeline_step_time(compute, [st.dp for st in stages], bounds, plan.micro_batches, chunks)
    ar = tuple(_dp_sync_time(model, st, c, precision, overlap=opts.overlap, compute_s=t,
                             per_block=opts.fsdp_per_block)
               for st, c, t in zip(stages, clusters, compute, strict=True))
    opt = tuple((st.last_layer - st.first_layer + 1) * c.optimizer_ms_per_layer / 1e3
                for st, c in zip(stages, clusters, strict=True))
    extra = tuple(measured_step_extra(model, c, st.first_layer, st.last_layer,
                                      b * math.ceil(plan.micro_batches / st.dp))
                  for st, c in zip(stages, clusters, strict=True))
    if any(extra):  # a profile measured the work outside the blocks: per step, after the drain
        opt = tuple(o + e for o, e in zip(opt, extra, strict=True))
    mem = _stage_memory_gib(plan, model, b, s, precision, fused_attention=fused_attention)
    return Breakdown(
        compute_s=compute, boundary_s=bounds, allreduce_s=ar, memory_gib=mem, pipeline_s=pipe,
        dp_sync_s=max((a + o for a, o in zip(ar, opt, strict=True)), default=0.0), optimizer_s=opt,
    )


def evaluate(plan: Plan, topo: Topology, job: JobSpec, *, fused_attention: bool = False) -> Plan:
    """Return ``plan`` with its predictions filled in (step time, throughput, memory, $ per step).
    ``fused_attention``: activation memory without stored attention scores (:func:`layer_activation_bytes`).

    The micro-batch size is ``job.global_batch / plan.micro_batches``.
    """
    return evaluate_with_breakdown(plan, topo, job, fused_attention=fused_attention)[0]


def evaluate_with_breakdown(
    plan: Plan, topo: Topology, job: JobSpec, *, fused_attention: bool = False
) -> tuple[Plan, Breakdown]:
    """:func:`evaluate` and the :func:`breakdown` it priced the plan with."""
    micro_batch = max(1, job.global_batch // plan.micro_batches)
    bd = breakdown(plan, topo, job.model, micro_batch=micro_batch, seq_len=job.seq_len, precision=job.precision,
                   fused_attention=fused_attention)
    step = bd.pipeline_s + bd.dp_sync_s
    usd = 0.0
    for st in plan.stages:
        c = topo.cluster(st.cluster)
        usd += st.gpus * c.power_w / 1000.0 * step / 3600.0 * c.electricity_usd_per_kwh
    return replace(
        plan,
        step_time_s=step,
        throughput_tokens_per_s=(job.tokens_per_step / step) if step > 0 and math.isfinite(step) else 0.0,
        memory_gib_per_gpu=bd.memory_gib,
        usd_per_step=usd,
    ), bd


def plan_fits_memory(plan: Plan, topo: Topology, job: JobSpec) -> bool:
    """Whether every stage of ``plan`` (not yet evaluated) fits its GPUs' memory as :func:`breakdown` prices it
    (without the other terms: a cheap check before :func:`evaluate`)."""
    mem = _stage_memory_gib(plan, job.model, max(1, job.global_batch // plan.micro_batches), job.seq_len,
                            job.precision)
    return all(g <= topo.cluster(st.cluster).gpu_memory_gib for st, g in zip(plan.stages, mem, strict=True))


def _stage_memory_gib(plan: Plan, model: ModelSpec, b: int, s: int, precision: Precision, *,
                      fused_attention: bool = False) -> tuple[float, ...]:
    """Per stage of ``plan``, the GiB one GPU holds (:func:`stage_memory_bytes` at the stage's in-flight count
    under the plan's schedule and cap, with the plan's framework options)."""
    opts = plan_options(plan)
    cap = plan_max_in_flight(plan)
    n = len(plan.stages)
    return tuple(
        stage_memory_bytes(
            model, st.first_layer, st.last_layer, st.tp, b, s,
            in_flight_microbatches(plan.schedule, plan.micro_batches, st.dp, i, n, max_in_flight=cap),
            precision=precision, sharding=st.sharding, dp=st.dp, recompute=st.recompute,
            fused_attention=fused_attention, selective=opts.selective_recompute,
            fsdp_per_block=opts.fsdp_per_block,
        ) / GIB
        for i, st in enumerate(plan.stages)
    )


def fits_memory(plan: Plan, topo: Topology) -> tuple[bool, int, float]:
    """``(ok, worst_stage_index, excess_gib)`` for a plan already passed through :func:`evaluate`."""
    worst, excess = -1, -math.inf
    for i, (st, m) in enumerate(zip(plan.stages, plan.memory_gib_per_gpu, strict=True)):
        over = m - topo.cluster(st.cluster).gpu_memory_gib
        if over > excess:
            worst, excess = i, over
    return excess <= 0, worst, excess
