"""GPU catalog and model presets.

Peak figures are dense (no sparsity) bf16/fp16 tensor-core TFLOPS from the vendors' datasheets; memory
in GiB as sold; board power in watts. ``default_mfu`` is the fraction of peak a well-tuned transformer
training step reaches before an agent has calibrated the cluster (agents replace it with measurements).
The ``cpu`` entry is a placeholder for local runs: its throughput is always measured by the agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from spiderflow.errors import ValidationError

__all__ = ["GPU_CATALOG", "MODEL_PRESETS", "GpuType", "ModelSpec", "gpu_type", "model_preset"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuType:
    """One accelerator model.

    ``peak_tflops``: dense bf16/fp16 TFLOPS; ``memory_gib``: device memory; ``power_w``: board power;
    ``default_mfu``: model-FLOPs utilisation assumed until measured; ``wire_bytes``: bytes per activation
    value sent between pipeline stages (2 = bf16 on GPUs; 4 on ``cpu``, where the executor trains in fp32).
    ``fp32_tflops``: dense fp32 (CUDA-core) TFLOPS and ``tf32_tflops``: dense TF32 tensor-core TFLOPS from the
    same datasheets (``None``: no TF32 tensor cores, TF32 runs at the fp32 rate; both ``None``: the type's
    rate does not depend on precision, as for ``cpu``, whose rate is measured in fp32).
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
        # The CPU executor (gloo) sends fp32 activations: 4 bytes per value on the wire.
        GpuType(name="cpu", peak_tflops=0.05, memory_gib=16, power_w=65, default_mfu=0.5, wire_bytes=4),
    )
}


def gpu_type(name: str, *, field: str = "gpu") -> GpuType:
    """Look up a GPU type by catalog name; :class:`ValidationError` naming ``field`` if unknown."""
    try:
        return GPU_CATALOG[name]
    except KeyError:
        known = ", ".join(sorted(GPU_CATALOG))
        raise ValidationError(field, f"unknown GPU type; known: {known}", name) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer.

    ``layers`` L, ``hidden`` h, ``heads``, ``vocab`` V. Per-layer parameters are taken as ``12·h²``
    (attention 4h², MLP 8h²), embedding and head ``V·h`` each.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int

    def __post_init__(self) -> None:
        for fname in ("layers", "hidden", "heads", "vocab"):
            v = getattr(self, fname)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValidationError(f"model.{fname}", "must be a positive integer", v)
        if self.hidden % self.heads:
            raise ValidationError("model.heads", f"must divide hidden={self.hidden}", self.heads)

    @property
    def params_per_layer(self) -> int:
        return 12 * self.hidden * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + 2 * self.embedding_params


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(name="gpt-tiny", layers=6, hidden=128, heads=4, vocab=512),
        ModelSpec(name="gpt3-1.3b", layers=24, hidden=2048, heads=16, vocab=50304),
        ModelSpec(name="gpt3-2.7b", layers=32, hidden=2560, heads=32, vocab=50304),
        ModelSpec(name="gpt3-6.7b", layers=32, hidden=4096, heads=32, vocab=50304),
        ModelSpec(name="gpt3-13b", layers=40, hidden=5120, heads=40, vocab=50304),
        ModelSpec(name="llama3-8b", layers=32, hidden=4096, heads=32, vocab=128256),
        ModelSpec(name="llama3-70b", layers=80, hidden=8192, heads=64, vocab=128256),
    )
}


def model_preset(name: str, *, field: str = "model") -> ModelSpec:
    """Look up a model preset; :class:`ValidationError` naming ``field`` if unknown."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        known = ", ".join(MODEL_PRESETS)
        raise ValidationError(field, f"unknown model preset; known: {known}", name) from None
