"""GPU catalog and model presets.

Peak figures are dense (no sparsity) bf16/fp16 tensor-core TFLOPS from the vendors' datasheets; memory
in GiB as sold; board power in watts. ``default_mfu`` is the fraction of peak a well-tuned transformer
training step reaches before an agent has calibrated the cluster (agents replace it with measurements).
The ``cpu`` entry is a placeholder for local runs: its throughput is always measured by the agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from spiderflow.core.errors import ValidationError

__all__ = [
    "GPU_CATALOG",
    "MODEL_PRESETS",
    "GpuType",
    "MeasuredCost",
    "ModelFamily",
    "ModelSpec",
    "gpu_type",
    "model_preset",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuType:
    """One accelerator model.

    ``peak_tflops``: dense bf16/fp16 TFLOPS; ``memory_gib``: device memory; ``power_w``: board power;
    ``default_mfu``: model-FLOPs utilisation assumed until measured; ``wire_bytes``: bytes per activation
    value sent between pipeline stages (2 = bf16; the executor sends activations in the job's compute dtype on every
    device, so :func:`~spiderflow.core.costmodel.wire_bytes` widens it to 4 for fp32/tf32 jobs).
    ``fp32_tflops``: dense fp32 (CUDA-core) TFLOPS and ``tf32_tflops``: dense TF32 tensor-core TFLOPS from the
    same datasheets (``None``: no TF32 tensor cores, TF32 runs at the fp32 rate; both ``None``: the type's
    rate does not depend on precision, as for ``cpu``, whose rate agents calibrate in bf16).
    """

    name: str
    peak_tflops: float
    memory_gib: float
    power_w: float
    default_mfu: float = 0.40
    wire_bytes: int = 2
    fp32_tflops: float | None = None
    tf32_tflops: float | None = None

    def precision_tflops(self, precision: str) -> float:
        """Dense peak TFLOPS of matmuls in ``precision`` (``bf16``/``fp16`` = :attr:`peak_tflops`)."""
        if precision in ("bf16", "fp16") or self.fp32_tflops is None:
            return self.peak_tflops
        if precision == "tf32" and self.tf32_tflops is not None:
            return self.tf32_tflops
        return self.fp32_tflops


GPU_CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType(name="H100-80G", peak_tflops=989.0, memory_gib=80, power_w=700, fp32_tflops=67.0, tf32_tflops=494.5),
        GpuType(name="H200-141G", peak_tflops=989.0, memory_gib=141, power_w=700, fp32_tflops=67.0,
                tf32_tflops=494.5),
        GpuType(name="A100-80G", peak_tflops=312.0, memory_gib=80, power_w=400, fp32_tflops=19.5, tf32_tflops=156.0),
        GpuType(name="A100-40G", peak_tflops=312.0, memory_gib=40, power_w=400, fp32_tflops=19.5, tf32_tflops=156.0),
        GpuType(name="V100-32G", peak_tflops=125.0, memory_gib=32, power_w=300, fp32_tflops=15.7),
        GpuType(name="V100-16G", peak_tflops=125.0, memory_gib=16, power_w=300, fp32_tflops=15.7),
        GpuType(name="A10G", peak_tflops=70.0, memory_gib=24, power_w=300, fp32_tflops=31.2, tf32_tflops=35.0),
        GpuType(name="L4", peak_tflops=121.0, memory_gib=24, power_w=72, fp32_tflops=30.3, tf32_tflops=60.0),
        GpuType(name="T4", peak_tflops=65.0, memory_gib=16, power_w=70, fp32_tflops=8.1),
        GpuType(name="RTX3090", peak_tflops=71.0, memory_gib=24, power_w=350, default_mfu=0.35,
                fp32_tflops=35.6, tf32_tflops=35.6),
        GpuType(name="RTX4090", peak_tflops=165.0, memory_gib=24, power_w=450, default_mfu=0.35,
                fp32_tflops=82.6, tf32_tflops=82.6),
        # Local runs: the agent measures matmul TFLOPS and host memory; these are only defaults.
        GpuType(name="cpu", peak_tflops=0.05, memory_gib=16, power_w=65, default_mfu=0.5),
    )
}


def gpu_type(name: str, *, field: str = "gpu") -> GpuType:
    """Look up a GPU type by catalog name; :class:`ValidationError` naming ``field`` if unknown."""
    try:
        return GPU_CATALOG[name]
    except KeyError:
        known = ", ".join(sorted(GPU_CATALOG))
        raise ValidationError(field, f"unknown GPU type; known: {known}", name) from None


class ModelFamily(StrEnum):
    """Decoder architectures the executor builds (:mod:`spiderflow.exec.model`).

    - ``gpt``: pre-LN blocks, learned positions, GELU MLP ``h → 4h → h``, untied head (the original block);
    - ``llama``: RMSNorm, SwiGLU MLP ``h → ffn_hidden → h``, rotary positions, grouped-query attention
      with ``kv_heads`` key/value heads, untied head unless ``tie_embeddings`` (Llama, Mistral; Qwen2 with
      ``qkv_bias``);
    - ``gpt2``: Hugging Face GPT-2 (LayerNorm with biases, learned positions, tanh-GELU MLP);
    - ``neox``: GPT-NeoX / Pythia (LayerNorm, partial rotary ``rotary_pct``, parallel residual);
    - ``custom``: the user's own layers from ``entry_point`` (parameters and FLOPs measured on the meta
      device and carried in ``measured``).
    """

    GPT = "gpt"
    LLAMA = "llama"
    GPT2 = "gpt2"
    NEOX = "neox"
    CUSTOM = "custom"


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredCost:
    """Figures of a ``custom`` model measured on the meta device: parameters of the embedding, of one
    layer (the mean over layers) and of the head, and the forward FLOPs per token of one layer at
    ``seq_len`` (attention's ``s²`` term included at that length)."""

    embed_params: int
    layer_params: int
    head_params: int
    layer_flops_per_token: float
    seq_len: int

    def __post_init__(self) -> None:
        for fname in ("embed_params", "layer_params", "head_params", "seq_len"):
            v = getattr(self, fname)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValidationError(f"model.measured.{fname}", "must be an integer ≥ 0", v)
        if not self.layer_flops_per_token >= 0:
            raise ValidationError("model.measured.layer_flops_per_token", "must be ≥ 0", self.layer_flops_per_token)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer of one :class:`ModelFamily`.

    ``layers`` L, ``hidden`` h, ``heads`` (query heads), ``vocab`` V; ``kv_heads`` (default ``heads``;
    must divide ``heads``), ``ffn_hidden`` f (default ``4h``; required for ``llama``), ``qkv_bias``
    (biases on q, k, v: Qwen2), ``tie_embeddings`` (the head starts as a copy of the token embedding; in
    a pipeline the two copies train untied), ``rope_theta``, ``rotary_pct`` (fraction of each head's
    dimensions rotated: NeoX), ``norm_eps``, ``max_positions`` (rows of a learned position table; 0: the
    job's sequence length), ``parallel_residual`` (NeoX's ``x + attn(LN1 x) + mlp(LN2 x)``).
    ``hf_config`` (the ``config.json`` it came from), ``weights`` (local
    safetensors file, directory or glob of initial weights in Hugging Face names) and ``save_to`` (a
    directory the trained weights are written to, in the same format, when the job ends) are paths on the
    workers' file system. ``entry_point`` (``package.module:function``) and ``measured`` describe a
    ``custom`` model.

    Parameter counts (``params_per_layer``, ``embedding_params``, ``head_params``) are exact for every
    family except ``gpt``, which keeps the classic approximation ``12·h²`` per layer and ``V·h`` each for
    the embedding and the head.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    family: ModelFamily = ModelFamily.GPT
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rotary_pct: float = 1.0
    norm_eps: float = 1e-5
    max_positions: int = 0
    parallel_residual: bool = True
    hf_config: str = ""
    weights: str = ""
    save_to: str = ""
    entry_point: str = ""
    measured: MeasuredCost | None = None

    def __post_init__(self) -> None:
        for fname in ("layers", "hidden", "heads", "vocab"):
            v = getattr(self, fname)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValidationError(f"model.{fname}", "must be a positive integer", v)
        try:
            object.__setattr__(self, "family", ModelFamily(self.family))
        except ValueError:
            raise ValidationError("model.family", f"must be one of {[f.value for f in ModelFamily]}",
                                  self.family) from None
        if self.hidden % self.heads:
            raise ValidationError("model.heads", f"must divide hidden={self.hidden}", self.heads)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        kv = self.kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0 or self.heads % kv:
            raise ValidationError("model.kv_heads", f"must be a positive divisor of heads={self.heads}", kv)
        if self.ffn_hidden is None:
            if self.family is ModelFamily.LLAMA:
                raise ValidationError("model.ffn_hidden", "is required for the llama family")
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        f = self.ffn_hidden
        if not isinstance(f, int) or isinstance(f, bool) or f <= 0:
            raise ValidationError("model.ffn_hidden", "must be a positive integer", f)
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            raise ValidationError("model.rope_theta", "must be > 0", self.rope_theta)
        if not (isinstance(self.rotary_pct, int | float) and 0 < self.rotary_pct <= 1):
            raise ValidationError("model.rotary_pct", "must be in (0, 1]", self.rotary_pct)
        if not (isinstance(self.norm_eps, int | float) and 0 < self.norm_eps < 1):
            raise ValidationError("model.norm_eps", "must be in (0, 1)", self.norm_eps)
        if not isinstance(self.max_positions, int) or isinstance(self.max_positions, bool) \
                or self.max_positions < 0:
            raise ValidationError("model.max_positions", "must be an integer ≥ 0", self.max_positions)
        for key in ("weights", "save_to"):
            if getattr(self, key) and self.family not in (ModelFamily.LLAMA, ModelFamily.GPT2, ModelFamily.NEOX):
                raise ValidationError(f"model.{key}", "Hugging Face weights need the llama, gpt2 or neox family",
                                      getattr(self, key))
        if self.family is ModelFamily.CUSTOM:
            if not self.entry_point or ":" not in self.entry_point:
                raise ValidationError("model.entry_point", "must be 'package.module:function'", self.entry_point)
            if self.measured is None:
                raise ValidationError("model.measured", "is required for a custom model (measure it with "
                                      "spiderflow model show or submit through the CLI/SDK)")
        elif self.entry_point:
            raise ValidationError("model.entry_point", "is only for the custom family", self.entry_point)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the k (and of the v) projection: ``kv_heads · head_dim``."""
        assert self.kv_heads is not None
        return self.kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        assert self.ffn_hidden is not None
        return self.ffn_hidden

    @property
    def params_per_layer(self) -> int:
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.family is ModelFamily.GPT:
            return 12 * h * h
        if self.family is ModelFamily.LLAMA:
            return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h + ((h + 2 * kv) if self.qkv_bias else 0)
        if self.family in (ModelFamily.GPT2, ModelFamily.NEOX):
            return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        assert self.measured is not None
        return self.measured.layer_params

    @property
    def embedding_params(self) -> int:
        if self.family is ModelFamily.CUSTOM:
            assert self.measured is not None
            return self.measured.embed_params
        pos = self.max_positions * self.hidden if self.family is ModelFamily.GPT2 else 0
        return self.vocab * self.hidden + pos

    @property
    def head_params(self) -> int:
        """The head's parameters: final norm and output projection (a tied head counts once, with the
        embedding, as Hugging Face counts it)."""
        h, v = self.hidden, self.vocab
        if self.family is ModelFamily.GPT:
            return v * h
        if self.family is ModelFamily.CUSTOM:
            assert self.measured is not None
            return self.measured.head_params
        norm = h if self.family is ModelFamily.LLAMA else 2 * h
        return norm + (0 if self.tie_embeddings else v * h)

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params + self.head_params

    def layer_fwd_flops(self, b: int, s: int) -> float:
        """Forward FLOPs of one layer on ``b`` sequences of ``s`` tokens: ``2·b·s·P_layer + 4·b·s²·h``
        (matmuls plus attention scores and values), the measured figure per token for ``custom``."""
        if self.family is ModelFamily.CUSTOM:
            assert self.measured is not None
            return self.measured.layer_flops_per_token * b * s
        return 2.0 * b * s * self.params_per_layer + 4.0 * b * s * s * self.hidden


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(name="gpt-tiny", layers=6, hidden=128, heads=4, vocab=512),
        ModelSpec(name="gpt3-1.3b", layers=24, hidden=2048, heads=16, vocab=50304),
        ModelSpec(name="gpt3-2.7b", layers=32, hidden=2560, heads=32, vocab=50304),
        ModelSpec(name="gpt3-6.7b", layers=32, hidden=4096, heads=32, vocab=50304),
        ModelSpec(name="gpt3-13b", layers=40, hidden=5120, heads=40, vocab=50304),
        ModelSpec(name="llama-tiny", family=ModelFamily.LLAMA, layers=4, hidden=128, heads=4, kv_heads=2,
                  ffn_hidden=352, vocab=512, rope_theta=10000.0),
        # Meta's published configurations (config.json of Meta-Llama-3-8B / -70B).
        ModelSpec(name="llama3-8b", family=ModelFamily.LLAMA, layers=32, hidden=4096, heads=32, kv_heads=8,
                  ffn_hidden=14336, vocab=128256, rope_theta=500000.0),
        ModelSpec(name="llama3-70b", family=ModelFamily.LLAMA, layers=80, hidden=8192, heads=64, kv_heads=8,
                  ffn_hidden=28672, vocab=128256, rope_theta=500000.0),
    )
}


def model_preset(name: str, *, field: str = "model") -> ModelSpec:
    """Look up a model preset; :class:`ValidationError` naming ``field`` if unknown."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        known = ", ".join(MODEL_PRESETS)
        raise ValidationError(field, f"unknown model preset; known: {known}", name) from None
