"""Profiling the cluster's accelerators with torch.

:func:`profile_devices` measures what this machine has:

- with CUDA devices: their count (GPUs per node), catalog type (from the device name and memory), memory
  per GPU, and dense bf16 matmul TFLOPS of device 0 (timed ``n × n`` matmuls after a warm-up);
- without: the CPU as one device of GPU type ``cpu`` — host memory, **measured** matmul TFLOPS and the
  **calibrated** training efficiency ``mfu`` (:func:`profile_cpu`), both in bf16
  (:data:`CPU_CALIBRATION_PRECISION`, the jobs' default precision, which the executor runs on CPU too).

The timed loop runs for about ``seconds`` (after one warm-up) and counts ``2·n³`` FLOPs per matmul.
torch is imported only when measuring. A declared cluster (:class:`~agent.config.GpuDeclaration`)
skips device discovery: its TFLOPS are the declared ones, or measured for type ``cpu``, or left unset
(the catalog's peak) for other types.

Calibration of ``mfu``, ``layer_overhead_ms`` and ``optimizer_ms_per_layer`` (type ``cpu``)
--------------------------------------------------------------------------------------
The cost model predicts a layer's forward + backward on one micro-batch as
``3 · layer_fwd_flops / (tflops · mfu) + layer_overhead_ms`` (:func:`spiderflow.core.costmodel.stage_compute_time`):
a rate plus a fixed cost. On a CPU the fixed cost is large — per-operator dispatch, autograd bookkeeping
and small-kernel inefficiency do not shrink with ``b·s`` (on the 2-core dev machine, one thread, h=128:
~0.5 ms per layer against ~1.3 ms of FLOPs at gpt-tiny's s=64) — so one rate measured at one size
mis-predicts every other size. :func:`measure_training_fit` therefore times forward + backward of one real
transformer block (:class:`spiderflow.exec.model.Block`, the executor's module, under bf16 autocast over fp32
weights as the executor runs a bf16 job: :data:`CPU_CALIBRATION_PRECISION`) at two sequence lengths
(:data:`CALIBRATION_SEQ_LENS`, b=1, :data:`CALIBRATION_SHAPE`'s width) and fits the line
``t(F) = F / R + o`` through the two points, ``F = 3 · layer_fwd_flops`` (the cost model's own formula):
``R`` is the achieved training FLOP rate, ``o`` the fixed time per layer and micro-batch. The same rounds
time the executor's optimizer step (per-parameter Adam) on the block's parameters, ``u`` per layer and
training step. The matmul TFLOPS, the optimizer step and the two block sizes are measured *interleaved*
in several rounds (medians per quantity), so a burst of load from other processes hits them alike and
cannot tilt the fit or the ratios.

Times are the calibrating thread's CPU time (``time.thread_time``), which load from other processes
leaves nearly unchanged, so the fit is stable; the host's load enters once, as the *share* ``σ`` of a
core the thread obtained over the calibration (median CPU / wall time of the timed slices: 1 on an idle
core, ~2/3 with three busy single-thread processes on two cores). The reported figures are wall clock, as
the job's workers see them if that load persists: ``tflops = σ · matmul``, ``R_wall = σ · R``,
``mfu = R_wall / tflops`` bounded to ``(0, 1]``, ``layer_overhead_ms = 1000 · o / σ`` (≥ 0) and
``optimizer_ms_per_layer = 1000 · u / σ``. So ``tflops · mfu`` is the FLOP rate a stage worker reaches at
large sizes and the overhead what it pays per layer on top. A CPU "GPU" is one worker process running
``torch.set_num_threads(1)`` (:mod:`agent.executor`), so every measurement runs with
:data:`CPU_WORKER_THREADS` threads.

Limits: embedding and head are counted by FLOPs only; the pipeline messages' CPU cost (gloo on loopback:
~0.05–0.2 ms per message on the dev machine) and the rest of a step's bookkeeping are not modelled; the
rate keeps rising slowly past the larger size (larger GEMMs), so much larger layers run somewhat faster
than predicted. The share is a snapshot: when other work on the host starts or stops between the
calibration and the job, the job's step time moves by the ratio of the shares (measured: a calibration
at σ ≈ 0.3 followed by a job whose workers got ≈ 0.7 ran 2.5× faster than predicted).
CUDA devices are calibrated the same way (:func:`calibrate_gpu`): the executor's block of
:data:`GPU_CALIBRATION_SHAPE` (bf16 autocast over fp32 master weights, as the executor trains) timed at the
micro-batch sizes of :data:`GPU_CALIBRATION_BATCHES`, the same line fitted through the points, ``mfu`` the
fitted rate over the measured bf16 matmul rate, ``layer_overhead_ms`` the intercept and
``optimizer_ms_per_layer`` the executor's AdamW step over the block. The line is one shape's: blocks much
wider or narrower than the calibration's run at other rates, which a profile of the job's own blocks
(``spiderflow profile``, ``docs/profiles.md``) captures.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog

from spiderflow.core.errors import ValidationError

__all__ = [
    "CALIBRATION_SEQ_LENS",
    "CALIBRATION_SHAPE",
    "CPU_WORKER_THREADS",
    "GPU_CALIBRATION_BATCHES",
    "GPU_CALIBRATION_SHAPE",
    "DeviceProfile",
    "GpuCalibration",
    "TrainingFit",
    "calibrate_gpu",
    "calibrate_mfu",
    "catalog_name",
    "fit_rate_overhead",
    "host_memory_gib",
    "measure_matmul_tflops",
    "measure_training_fit",
    "measure_training_tflops",
    "profile_cpu",
    "profile_devices",
]

log = structlog.get_logger(__name__)

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32"}
"""The torch dtype of each precision's operands (tf32: fp32 operands, TF32 matmuls)."""

CPU_WORKER_THREADS = 1
"""``torch.set_num_threads`` of a CPU stage worker (the executor's ``TrainSpec.threads``): one CPU "GPU"."""

CALIBRATION_SHAPE = {"hidden": 128, "heads": 4, "seq_len": 128, "batch": 1}
"""The block timed by :func:`measure_training_tflops` by default: gpt-tiny's layer width at twice its demo
sequence length (``3 · layer_fwd_flops`` ≈ 0.18 GFLOP per iteration: ~4 ms on one core)."""

CPU_CALIBRATION_PRECISION = "bf16"
"""The precision :func:`measure_training_fit` times the block in: the jobs' default (``JobSpec.precision``),
which the executor runs under bf16 autocast on CPU as on GPUs. Blocks in bf16 and fp32 run at different
rates on a CPU (on the dev machine's AVX512-BF16 cores, h=128, one thread: bf16 1.5× slower than fp32 at
32 tokens, 1.25× faster at 1,024), and the ``cpu`` type has no per-precision datasheet ratio, so a cluster's
calibrated rate is its bf16 rate: jobs in other precisions are priced at it."""

CALIBRATION_SEQ_LENS = (32, 256)
"""The two sequence lengths of :func:`measure_training_fit` (block of :data:`CALIBRATION_SHAPE`'s width,
b=1): ``3 · layer_fwd_flops`` ≈ 0.04 and 0.40 GFLOP, ~1.4 and ~7 ms on one core of the dev machine, where
the fixed cost is about a third and a tenth of the time."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """What profiling found: catalog ``gpu`` type, ``count`` devices on this node, ``memory_gib`` per
    device, measured ``tflops`` per device (None when not measured), the raw ``device_name`` and the
    calibrated ``mfu`` (None when not calibrated: the catalog's default applies), ``layer_overhead_ms``
    and ``optimizer_ms_per_layer`` (0 when not calibrated)."""

    gpu: str
    count: int
    memory_gib: float
    tflops: float | None
    device_name: str
    mfu: float | None = None
    layer_overhead_ms: float = 0.0
    optimizer_ms_per_layer: float = 0.0


def catalog_name(device_name: str, memory_gib: float) -> str:
    """The catalog GPU type of a CUDA device name (``"NVIDIA A100-SXM4-80GB"`` → ``A100-80G``);
    :class:`ValidationError` (field ``gpu``) for a device the catalog does not know — declare it then."""
    n = device_name.upper()
    if "H200" in n:
        return "H200-141G"
    if "H100" in n:
        return "H100-80G"
    if "A100" in n:
        return "A100-80G" if memory_gib > 50 else "A100-40G"
    if "V100" in n:
        return "V100-32G" if memory_gib > 20 else "V100-16G"
    for key, name in (("A10G", "A10G"), ("L4", "L4"), ("T4", "T4"), ("3090", "RTX3090"), ("4090", "RTX4090")):
        if key in n:
            return name
    raise ValidationError("gpu", "device not in the GPU catalog; declare it with --gpu", device_name)


def host_memory_gib() -> float:
    """Physical memory of this machine, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Run with ``torch.set_num_threads(threads)`` (unchanged when None), restoring the previous count."""
    import torch

    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_matmul_tflops(*, device: str = "cpu", size: int = 512, seconds: float = 0.5,
                          threads: int | None = None, precision: str = "bf16") -> float:
    """Dense matmul throughput on ``device`` in TFLOPS: fp32 on the CPU; on CUDA in ``precision`` (bf16/fp16
    operands, ``tf32`` fp32 operands with TF32 matmuls, ``fp32`` without) — CPU work with ``threads`` torch
    threads when given, else torch's default."""
    with _torch_threads(threads):
        return _matmul_tflops(device, size, seconds, precision)


def _matmul_tflops(device: str, size: int, seconds: float, precision: str = "bf16") -> float:
    import torch

    cuda = device.startswith("cuda")
    dtype = getattr(torch, _DTYPES[precision]) if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    prev_tf32 = torch.backends.cuda.matmul.allow_tf32 if cuda else False
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        with torch.no_grad():
            torch.matmul(a, b)  # warm-up
            sync()
            n = 0
            t0 = time.perf_counter()
            while True:
                torch.matmul(a, b)
                n += 1
                if n % 4 == 0:
                    sync()
                    if time.perf_counter() - t0 >= seconds:
                        break
            elapsed = time.perf_counter() - t0
    finally:
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return 2.0 * size**3 * n / elapsed / 1e12


def measure_training_tflops(
    *, hidden: int = CALIBRATION_SHAPE["hidden"], heads: int = CALIBRATION_SHAPE["heads"],
    seq_len: int = CALIBRATION_SHAPE["seq_len"], batch: int = CALIBRATION_SHAPE["batch"], seconds: float = 1.0,
    threads: int | None = CPU_WORKER_THREADS,
) -> float:
    """Achieved training TFLOPS on the CPU: forward + backward of one :class:`~spiderflow.exec.model.Block`
    (``batch × seq_len × hidden`` input) timed for about ``seconds`` after two warm-up iterations, counting
    ``3 · layer_fwd_flops`` per iteration (the cost model's formula). The median of three equal slices of
    the timed loop is used, so a burst of load from other processes skews it less."""
    import torch

    from spiderflow.core.catalog import ModelSpec
    from spiderflow.core.costmodel import layer_fwd_flops
    from spiderflow.exec.model import Block

    flops = 3.0 * layer_fwd_flops(ModelSpec(name="calibration", layers=1, hidden=hidden, heads=heads, vocab=1),
                                  batch, seq_len)
    with _torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = Block(hidden, heads)
        x = torch.randn(batch, seq_len, hidden, requires_grad=True)
        grad = torch.randn(batch, seq_len, hidden)

        def iteration() -> None:
            block(x).backward(grad)
            block.zero_grad(set_to_none=True)
            x.grad = None

        for _ in range(2):  # warm-up (allocator, kernels' first-call paths)
            iteration()
        rates: list[float] = []
        for _ in range(3):
            n, t0 = 0, time.perf_counter()
            while n == 0 or time.perf_counter() - t0 < seconds / 3:
                iteration()
                n += 1
            rates.append(flops * n / (time.perf_counter() - t0))
    return sorted(rates)[1] / 1e12


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingFit:
    """What :func:`measure_training_fit` found. CPU-time figures of the calibrating thread: matmul TFLOPS,
    the fitted training rate ``R`` (TFLOPS), the fixed time per layer and micro-batch ``o`` (ms) and the
    points ``(FLOPs per iteration, median CPU seconds)`` the line went through, the block's optimizer step
    ``u`` (ms; Adam as the executor runs it); ``share``, the fraction of a core the thread obtained (median
    CPU / wall time over the timed slices); and the wall-clock figures the cost model uses:
    ``matmul_tflops = share · cpu matmul``, ``rate_tflops = share · R``, ``layer_overhead_ms = o / share``,
    ``optimizer_ms_per_layer = u / share``."""

    cpu_matmul_tflops: float
    cpu_rate_tflops: float
    cpu_layer_overhead_ms: float
    points: tuple[tuple[float, float], ...]
    share: float
    cpu_optimizer_ms_per_layer: float = 0.0

    @property
    def matmul_tflops(self) -> float:
        return self.share * self.cpu_matmul_tflops

    @property
    def rate_tflops(self) -> float:
        return self.share * self.cpu_rate_tflops

    @property
    def layer_overhead_ms(self) -> float:
        return self.cpu_layer_overhead_ms / self.share

    @property
    def optimizer_ms_per_layer(self) -> float:
        return self.cpu_optimizer_ms_per_layer / self.share


def fit_rate_overhead(points: list[tuple[float, float]] | tuple[tuple[float, float], ...]) -> tuple[float, float]:
    """Least-squares line ``t = F / R + o`` through ``(F, t)`` points (FLOPs, seconds); returns ``(R, o)``
    in FLOP/s and seconds. A non-increasing line (noise) or a negative intercept falls back to no
    overhead and the rate of the largest point: ``(F_max / t_max, 0)``."""
    if len(points) < 1 or any(not (f > 0 and t > 0) for f, t in points):
        raise ValueError(f"points must have positive FLOPs and times: {points}")
    big_f, big_t = max(points)
    if len(points) < 2:
        return big_f / big_t, 0.0
    n = len(points)
    mf = sum(f for f, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((f - mf) ** 2 for f, _ in points)
    slope = sum((f - mf) * (t - mt) for f, t in points) / var if var > 0 else 0.0
    intercept = mt - slope * mf
    if slope <= 0 or intercept < 0:
        return big_f / big_t, 0.0
    return 1.0 / slope, intercept


def measure_training_fit(
    *, hidden: int = CALIBRATION_SHAPE["hidden"], heads: int = CALIBRATION_SHAPE["heads"],
    seq_lens: tuple[int, ...] = CALIBRATION_SEQ_LENS, batch: int = 1, seconds: float = 0.5, rounds: int = 6,
    matmul_size: int = 512, threads: int | None = CPU_WORKER_THREADS, precision: str = CPU_CALIBRATION_PRECISION,
) -> TrainingFit:
    """Matmul TFLOPS and the rate + per-layer overhead fit of the module docstring. ``rounds`` rounds each
    time the matmul for ``seconds / rounds`` and every block size for ``1.5 · seconds / rounds`` (whole
    iterations, at least one) and the block's Adam step for ``0.25 · seconds / rounds``; the per-quantity
    medians over rounds are used. Takes about ``(1.25 + 1.5 · len(seq_lens)) · seconds`` plus warm-up.
    ``precision`` (``bf16``, ``fp16``, ``fp32`` or ``tf32``): the block runs under
    :func:`spiderflow.exec.parallel.autocast` and the matmul in that precision's compute dtype."""
    import torch

    from spiderflow.core.catalog import ModelSpec
    from spiderflow.core.costmodel import layer_fwd_flops
    from spiderflow.core.domain import Precision
    from spiderflow.exec.model import Block
    from spiderflow.exec.parallel import autocast, compute_dtype

    if rounds < 1 or not seq_lens:
        raise ValueError("need at least one round and one sequence length")
    prec = Precision(precision)
    spec = ModelSpec(name="calibration", layers=1, hidden=hidden, heads=heads, vocab=1)
    flops = [3.0 * layer_fwd_flops(spec, batch, s) for s in seq_lens]
    with _torch_threads(threads), torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        mm_dtype = compute_dtype(prec)  # the matmul in the block's compute dtype
        a = torch.randn(matmul_size, matmul_size).to(mm_dtype)
        b = torch.randn(matmul_size, matmul_size).to(mm_dtype)
    with _torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = Block(hidden, heads)
        inputs = [(torch.randn(batch, s, hidden, requires_grad=True), torch.randn(batch, s, hidden))
                  for s in seq_lens]
        # the executor's optimizer (spiderflow.exec.runtime): per-parameter Adam over the block's parameters
        opt_block = Block(hidden, heads)
        opt_block(inputs[0][0].detach()).backward(inputs[0][1])
        adam = torch.optim.Adam(opt_block.parameters(), lr=1e-9, foreach=False)

        def optimizer_step() -> None:
            adam.step()

        cpu = torch.device("cpu")

        def iteration(i: int) -> None:
            x, grad = inputs[i]
            with autocast(cpu, prec):  # as the executor runs a block in the job's precision
                out = block(x)
            out.backward(grad)
            block.zero_grad(set_to_none=True)
            x.grad = None

        def matmul() -> None:
            with torch.no_grad():
                torch.matmul(a, b)

        def timed(fn: Callable[[], None], budget: float) -> tuple[float, float]:
            """Seconds per call, wall and this thread's CPU time, over whole calls for about ``budget``."""
            n, t0, c0 = 0, time.perf_counter(), time.thread_time()
            while n == 0 or time.perf_counter() - t0 < budget:
                fn()
                n += 1
            return (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n

        matmul()
        optimizer_step()
        for i in range(len(seq_lens)):  # warm-up (allocator, kernels' first-call paths)
            for _ in range(2):
                iteration(i)
        mm: list[tuple[float, float]] = []
        steps: list[tuple[float, float]] = []
        timings: list[list[tuple[float, float]]] = [[] for _ in seq_lens]
        for _ in range(rounds):
            mm.append(timed(matmul, seconds / rounds))
            steps.append(timed(optimizer_step, 0.25 * seconds / rounds))
            for i in range(len(seq_lens)):
                timings[i].append(timed(functools.partial(iteration, i), 1.5 * seconds / rounds))
    shares = [min(1.0, c / w) for w, c in [*mm, *steps, *(x for size in timings for x in size)] if w > 0 and c > 0]
    cpu_matmul = 2.0 * matmul_size**3 / statistics.median(c for _, c in mm) / 1e12
    points = tuple((f, statistics.median(c for _, c in ts)) for f, ts in zip(flops, timings, strict=True))
    rate, overhead = fit_rate_overhead(points)
    return TrainingFit(cpu_matmul_tflops=cpu_matmul, cpu_rate_tflops=rate / 1e12,
                       cpu_layer_overhead_ms=overhead * 1e3, points=points,
                       share=statistics.median(shares) if shares else 1.0,
                       cpu_optimizer_ms_per_layer=statistics.median(c for _, c in steps) * 1e3)


def calibrate_mfu(matmul_tflops: float, training_tflops: float) -> float:
    """``mfu = training / matmul`` TFLOPS, bounded to ``(0, 1]`` (a training rate above the matmul rate —
    load from other processes during the matmul — is taken as 1)."""
    if not (matmul_tflops > 0 and training_tflops > 0):
        raise ValueError(f"TFLOPS must be positive: matmul {matmul_tflops}, training {training_tflops}")
    return min(1.0, training_tflops / matmul_tflops)


def profile_cpu(*, seconds: float = 0.5, threads: int = CPU_WORKER_THREADS,
                precision: str = CPU_CALIBRATION_PRECISION) -> DeviceProfile:
    """The CPU as one ``cpu`` "GPU" (one worker with ``threads`` threads): host memory, matmul TFLOPS, the
    calibrated ``mfu`` and ``layer_overhead_ms`` (module docstring; :func:`measure_training_fit`). Takes
    about ``4 × seconds``."""
    fit = measure_training_fit(seconds=seconds, threads=threads, precision=precision)
    mfu = calibrate_mfu(fit.matmul_tflops, fit.rate_tflops)
    overhead = fit.layer_overhead_ms
    log.info("agent.calibrated", gpu="cpu", matmul_tflops=fit.matmul_tflops, training_tflops=fit.rate_tflops,
             mfu=mfu, layer_overhead_ms=overhead, optimizer_ms_per_layer=fit.optimizer_ms_per_layer,
             share=fit.share, cpu_matmul_tflops=fit.cpu_matmul_tflops,
             cpu_training_tflops=fit.cpu_rate_tflops, cpu_layer_overhead_ms=fit.cpu_layer_overhead_ms,
             points=[(f, round(t, 6)) for f, t in fit.points], threads=threads,
             hidden=CALIBRATION_SHAPE["hidden"], seq_lens=list(CALIBRATION_SEQ_LENS))
    return DeviceProfile(gpu="cpu", count=1, memory_gib=host_memory_gib(), tflops=fit.matmul_tflops,
                         device_name=f"cpu ({os.cpu_count()} cores, {threads} thread(s) per worker)", mfu=mfu,
                         layer_overhead_ms=overhead, optimizer_ms_per_layer=fit.optimizer_ms_per_layer)


GPU_CALIBRATION_SHAPE = {"hidden": 2048, "heads": 16, "seq_len": 2048}
GPU_CALIBRATION_BATCHES = (1, 8)
"""The blocks :func:`calibrate_gpu` times on a CUDA device: a 1.3B-class GPT block at 2,048 tokens per
sequence, micro-batches of 1 and 8 sequences (``3 · layer_fwd_flops`` ≈ 0.7 and 5.8 TFLOP; ~3 and ~11 ms
on an H200, where the fixed cost is about 60 % and 17 % of the time)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuCalibration:
    """What :func:`calibrate_gpu` found: matmul TFLOPS in bf16, the fitted training rate ``R`` (TFLOPS) and
    fixed time per layer and micro-batch ``o`` (ms) of the executor's block, the points ``(FLOPs, seconds)``
    the line went through and the optimizer step per block (ms)."""

    matmul_tflops: float
    rate_tflops: float
    layer_overhead_ms: float
    optimizer_ms_per_layer: float
    points: tuple[tuple[float, float], ...]


def calibrate_gpu(
    *, device: str = "cuda:0", hidden: int = GPU_CALIBRATION_SHAPE["hidden"],
    heads: int = GPU_CALIBRATION_SHAPE["heads"], seq_len: int = GPU_CALIBRATION_SHAPE["seq_len"],
    batches: tuple[int, ...] = GPU_CALIBRATION_BATCHES, seconds: float = 0.5, matmul_size: int = 8192,
    repeats: int = 5,
) -> GpuCalibration:
    """The GPU counterpart of :func:`measure_training_fit`: the executor's block (:func:`time_block`, bf16
    autocast over fp32 master weights) timed at every micro-batch size of ``batches``, the line
    ``t(F) = F / R + o`` fitted through the points (:func:`fit_rate_overhead`), the bf16 matmul rate and the
    optimizer step (:func:`time_optimizer`). A GPU runs one worker alone, so wall clock is the measure."""
    from spiderflow.core.catalog import ModelSpec
    from spiderflow.core.costmodel import layer_fwd_flops

    spec = ModelSpec(name="calibration", layers=1, hidden=hidden, heads=heads, vocab=1)
    matmul = measure_matmul_tflops(device=device, size=matmul_size, seconds=seconds, precision="bf16")
    points = tuple(
        (3.0 * layer_fwd_flops(spec, b, seq_len),
         sum(time_block(hidden=hidden, heads=heads, micro_batch=b, seq_len=seq_len, precision="bf16",
                        device=device, repeats=repeats)) / 1e3)
        for b in batches
    )
    rate, overhead = fit_rate_overhead(points)
    return GpuCalibration(matmul_tflops=matmul, rate_tflops=rate / 1e12, layer_overhead_ms=overhead * 1e3,
                          optimizer_ms_per_layer=time_optimizer(hidden=hidden, heads=heads, device=device),
                          points=points)


def profile_devices(*, seconds: float = 0.5) -> DeviceProfile:
    """Profile the local accelerators (or the CPU); see the module docstring."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        props = torch.cuda.get_device_properties(0)
        mem = props.total_memory / 2**30
        cal = calibrate_gpu(device="cuda:0", seconds=seconds)
        log.info("agent.calibrated", gpu=props.name, matmul_tflops=cal.matmul_tflops,
                 training_tflops=cal.rate_tflops, layer_overhead_ms=cal.layer_overhead_ms,
                 optimizer_ms_per_layer=cal.optimizer_ms_per_layer, points=[(f, round(t, 6)) for f, t in cal.points])
        prof = DeviceProfile(gpu=catalog_name(props.name, mem), count=torch.cuda.device_count(), memory_gib=mem,
                             tflops=cal.matmul_tflops, device_name=props.name,
                             mfu=calibrate_mfu(cal.matmul_tflops, cal.rate_tflops),
                             layer_overhead_ms=cal.layer_overhead_ms, optimizer_ms_per_layer=cal.optimizer_ms_per_layer)
    else:
        prof = profile_cpu(seconds=seconds)
    log.info("agent.profiled", gpu=prof.gpu, count=prof.count, memory_gib=round(prof.memory_gib, 2),
             tflops=prof.tflops, mfu=prof.mfu, layer_overhead_ms=prof.layer_overhead_ms,
             optimizer_ms_per_layer=prof.optimizer_ms_per_layer, device=prof.device_name)
    return prof


def _fwd_bwd_ms(
    forward: Callable[[], Any], backward: Callable[[Any], None], *, device: str, repeats: int,
    reset: Callable[[], None],
) -> tuple[float, float]:
    """``(forward_ms, backward_ms)``: medians of ``repeats`` timed ``backward(forward())`` runs after one
    warm-up, synchronised around each phase on CUDA; ``reset`` runs between runs, untimed."""
    import torch

    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    fwd, bwd = [], []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        out = forward()
        sync()
        t1 = time.perf_counter()
        backward(out)
        sync()
        t2 = time.perf_counter()
        reset()
        if i:  # the first run warms up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return 1e3 * statistics.median(fwd), 1e3 * statistics.median(bwd)


@contextlib.contextmanager
def _tf32_restored() -> Iterator[None]:
    """Restore the TF32 flags that :func:`spiderflow.exec.parallel.autocast` sets for ``tf32``/``fp32``."""
    import torch

    prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def time_block(
    *, hidden: int, heads: int, micro_batch: int, seq_len: int, precision: str = "bf16", device: str = "cpu",
    repeats: int = 3, accumulate: bool = True,
) -> tuple[float, float]:
    """``(forward_ms, backward_ms)`` of one real transformer block (:class:`spiderflow.exec.model.Block`, the
    executor's module) on ``device`` in ``precision`` at ``micro_batch × seq_len``, run as the executor runs
    it: fp32 parameters and residual stream, bf16/fp16 under autocast (the weights cast afresh every
    micro-batch), TF32 matmuls for ``tf32`` (:func:`spiderflow.exec.parallel.autocast`). With ``accumulate``
    the parameters' gradients are kept between runs, so every timed backward accumulates into existing
    gradients, as the executor's micro-batches 2..m do. Medians of ``repeats`` timed runs after one
    warm-up (CUDA runs are synchronised around each phase)."""
    import torch

    from spiderflow.core.domain import Precision
    from spiderflow.exec.model import Block
    from spiderflow.exec.parallel import autocast

    dev = torch.device(device)
    prec = Precision(precision)
    with _tf32_restored():
        block = Block(hidden, heads, device=device)
        x = torch.randn(micro_batch, seq_len, hidden, device=device, requires_grad=True)

        def forward() -> torch.Tensor:
            with autocast(dev, prec):
                y: torch.Tensor = block(x)
            return y

        def reset() -> None:
            if not accumulate:
                block.zero_grad(set_to_none=True)
            x.grad = None

        return _fwd_bwd_ms(forward, lambda y: y.float().sum().backward(),
                           device=device, repeats=repeats, reset=reset)


def time_embedding(
    *, hidden: int, vocab: int, micro_batch: int, seq_len: int, precision: str = "bf16", device: str = "cpu",
    repeats: int = 3,
) -> tuple[float, float]:
    """``(forward_ms, backward_ms)`` of the executor's embedding (token + learned position lookup, fp32
    weights; :mod:`spiderflow.exec.model`) at ``micro_batch × seq_len`` under the executor's autocast, the
    backward accumulating into existing gradients (the dense ``vocab × hidden`` gradient of the token
    table); medians as :func:`time_block`."""
    import torch

    from spiderflow.core.domain import Precision
    from spiderflow.exec.model import _Embed
    from spiderflow.exec.parallel import autocast

    dev = torch.device(device)
    prec = Precision(precision)
    with _tf32_restored():
        embed = _Embed(vocab, hidden, seq_len, device=device)
        ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
        grad = torch.randn(micro_batch, seq_len, hidden, device=device)

        def forward() -> torch.Tensor:
            with autocast(dev, prec):
                y: torch.Tensor = embed(ids)
            return y

        return _fwd_bwd_ms(forward, lambda y: y.backward(grad),
                           device=device, repeats=repeats, reset=lambda: None)


def time_head(
    *, hidden: int, vocab: int, micro_batch: int, seq_len: int, precision: str = "bf16", device: str = "cpu",
    repeats: int = 3,
) -> tuple[float, float]:
    """``(forward_ms, backward_ms)`` of the executor's head and loss (final LayerNorm, the ``hidden × vocab``
    projection under autocast, ``cross_entropy`` of the logits upcast to fp32; :mod:`spiderflow.exec.model`)
    at ``micro_batch × seq_len``, from an fp32 residual stream, the backward accumulating into existing
    gradients and returning the input's gradient; medians as :func:`time_block`."""
    import torch

    from spiderflow.core.domain import Precision
    from spiderflow.exec.model import _Head
    from spiderflow.exec.parallel import autocast

    dev = torch.device(device)
    prec = Precision(precision)
    with _tf32_restored():
        head = _Head(vocab, hidden, device=device)
        x = torch.randn(micro_batch, seq_len, hidden, device=device, requires_grad=True)
        targets = torch.randint(0, vocab, (micro_batch, seq_len), device=device)

        def forward() -> torch.Tensor:
            with autocast(dev, prec):
                loss: torch.Tensor = head(x, targets)
            return loss

        def reset() -> None:
            x.grad = None

        return _fwd_bwd_ms(forward, lambda loss: (loss * 0.5).backward(),
                           device=device, repeats=repeats, reset=reset)


def time_data(*, vocab: int, seq_len: int, samples: int = 4, device: str = "cpu", repeats: int = 3) -> float:
    """Milliseconds per sample of the executor's per-step input pipeline: the synthetic token source
    (:class:`spiderflow.exec.data.SyntheticTokens`, built once as the executor builds it) drawing
    ``samples`` samples of ``seq_len + 1`` tokens and copying inputs and targets to ``device``; the median
    of ``repeats`` batches after one warm-up. It runs on the host before every step's first forward."""
    import torch

    from spiderflow.exec.data import SyntheticTokens, micro_batch

    source = SyntheticTokens(vocab=vocab, seq_len=seq_len, seed=0)
    ts = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        x, y = micro_batch(source, step=i, global_batch=samples, micro_batch_size=samples, index=0)
        xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        del xt, yt
        if i:
            ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts) / samples


def time_module_optimizer(module: object, *, device: str = "cpu", repeats: int = 5) -> float:
    """Milliseconds of the executor's optimizer step (AdamW on fp32 master weights) over ``module``'s
    parameters (a ``torch.nn.Module``) on ``device``: the median of ``repeats`` steps after two warm-ups."""
    import torch

    from spiderflow.core.domain import OptimizerSpec
    from spiderflow.exec.optim import build_optimizer

    assert isinstance(module, torch.nn.Module)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    opt, _ = build_optimizer(module.parameters(), OptimizerSpec())
    ts = []
    for i in range(repeats + 2):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def time_optimizer(*, hidden: int, heads: int, device: str = "cpu", repeats: int = 5) -> float:
    """Milliseconds of the executor's optimizer step (:func:`spiderflow.exec.optim.build_optimizer`: AdamW on
    fp32 master weights) over one block's parameters on ``device``: the median of ``repeats`` steps after
    two warm-ups — the cost model's ``optimizer_ms_per_layer``."""
    from spiderflow.exec.model import Block

    return time_module_optimizer(Block(hidden, heads, device=device), device=device, repeats=repeats)


def cuda_context_gib(device: str = "cuda:0") -> float:
    """GiB of ``device`` in use beyond what torch's caching allocator holds: the CUDA context, the cuBLAS
    and cuDNN workspaces and kernel images (and other processes' memory, so measure on an idle device) —
    the part of a worker's footprint no tensor accounts for."""
    import torch

    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0.0, (total - free - torch.cuda.memory_reserved(device)) / 2**30)


def measure_collectives(*, nbytes: int = 1 << 24, repeats: int = 5, device: str = "cpu") -> dict[str, float]:
    """All-reduce bus bandwidth and point-to-point bandwidth of the initialised default process group (NCCL on
    GPUs, gloo on CPUs), in Gbit/s, and the small-message all-reduce latency in µs. Every rank calls it;
    figures are medians over ``repeats`` after a warm-up. All-reduce bus bandwidth is
    ``2(n−1)/n · bytes / time`` (the figure the cost model's ring formula divides by); point-to-point is
    rank 0 → rank 1 (``p2p_gbps`` is 0 on a one-rank group)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    rank = dist.get_rank()
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    small = torch.ones(1, dtype=torch.float32, device=device)

    def timed(fn: Callable[[], object]) -> float:
        ts = []
        for i in range(repeats + 1):
            dist.barrier()
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            if i:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t_ar = timed(lambda: dist.all_reduce(buf))
    t_lat = timed(lambda: dist.all_reduce(small))
    ar_gbps = (2.0 * (n - 1) / n * nbytes * 8.0 / t_ar / 1e9) if n > 1 else 0.0
    p2p_gbps = 0.0
    if n > 1:
        def p2p() -> None:
            if rank == 0:
                dist.send(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)

        t_p2p = timed(p2p)
        p2p_gbps = nbytes * 8.0 / t_p2p / 1e9
    return {"allreduce_gbps": ar_gbps, "p2p_gbps": p2p_gbps, "latency_us": 1e6 * t_lat}


def _time_outer(
    outer: list[tuple[int, int]], micro_batches: list[int], seq_lens: list[int], precision: str, device: str,
    repeats: int,
) -> dict[str, list[dict[str, object]]]:
    """The ``embedding``, ``head`` and ``data`` entries of :func:`build_profile`."""
    import torch

    from spiderflow.exec.model import _Embed, _Head

    out: dict[str, list[dict[str, object]]] = {"embedding": [], "head": [], "data": []}
    for hidden, vocab in outer:
        shape: dict[str, object] = {"hidden": hidden, "vocab": vocab, "precision": precision}
        opt_embed = time_module_optimizer(_Embed(vocab, hidden, max(seq_lens), device=device), device=device)
        opt_head = time_module_optimizer(_Head(vocab, hidden, device=device), device=device)
        for b in micro_batches:
            for s in seq_lens:
                for key, fn, opt in (("embedding", time_embedding, opt_embed), ("head", time_head, opt_head)):
                    f, bw = fn(hidden=hidden, vocab=vocab, micro_batch=b, seq_len=s, precision=precision,
                               device=device, repeats=repeats)
                    out[key].append({**shape, "micro_batch": b, "seq_len": s, "forward_ms": f, "backward_ms": bw,
                                     "optimizer_ms": opt})
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()  # the next size's logits need not fit beside this one's cache
    for s in seq_lens:
        out["data"].append({"seq_len": s, "ms_per_sample": time_data(vocab=outer[0][1], seq_len=s, device=device)})
    return out


def build_profile(
    *, blocks: list[tuple[int, int]], micro_batches: list[int], seq_lens: list[int], precision: str = "bf16",
    seconds: float = 0.5, repeats: int = 3, collectives: dict[str, dict[str, float]] | None = None,
    outer: list[tuple[int, int]] | None = None,
) -> dict[str, object]:
    """A profile document (``docs/profiles.md``) of this machine: on CPU the agent's calibration in ``precision``
    (:func:`profile_cpu`: matmul TFLOPS, mfu, per-layer and optimizer times) and the named blocks
    (``(hidden, heads)``) timed at every micro-batch × sequence length; on a CUDA device its matmul TFLOPS
    (:func:`measure_matmul_tflops`) and the blocks timed on ``cuda:0`` in ``precision``. ``outer``
    (``(hidden, vocab)`` pairs) adds the work outside the blocks, timed the same way on the same device: the
    embedding and the head with its loss at every micro-batch × sequence length (:func:`time_embedding`,
    :func:`time_head`; each with the optimizer step over its parameters, :func:`time_module_optimizer`) and
    the per-step input pipeline at every sequence length (:func:`time_data`, the first pair's vocabulary).
    ``collectives`` (from :func:`measure_collectives`, keyed ``intra_node``/``inter_node``) become the
    ``nccl`` entry."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        props = torch.cuda.get_device_properties(0)
        mem = props.total_memory / 2**30
        gpu = catalog_name(props.name, mem)
        device = "cuda:0"
        entry: dict[str, object] = {
            "matmul_tflops": {precision: measure_matmul_tflops(device=device, size=8192, seconds=seconds,
                                                               precision=precision)},
        }
    else:
        # the executor trains in the job's precision on CPU as on GPUs: calibration and blocks in ``precision``
        prof = profile_cpu(seconds=seconds, precision=precision)
        gpu, device = "cpu", "cpu"
        entry = {"matmul_tflops": {precision: prof.tflops}, "mfu": prof.mfu,
                 "layer_overhead_ms": prof.layer_overhead_ms, "optimizer_ms_per_layer": prof.optimizer_ms_per_layer}
    timed = []
    for hidden, heads in blocks:
        for b in micro_batches:
            for s in seq_lens:
                f, bw = time_block(hidden=hidden, heads=heads, micro_batch=b, seq_len=s, precision=precision,
                                   device=device, repeats=repeats)
                timed.append({"hidden": hidden, "heads": heads, "precision": precision, "micro_batch": b,
                              "seq_len": s, "tp": 1, "forward_ms": f, "backward_ms": bw})
    if timed:
        entry["blocks"] = timed
    if outer:
        entry.update(_time_outer(outer, micro_batches, seq_lens, precision, device, repeats))
    if device.startswith("cuda"):
        # Measured block rates carry the blocks' own fixed costs (no separate per-layer overhead); the
        # executor's optimizer step over the first block's shape (the job's model); the device memory no
        # tensor accounts for (CUDA context, library workspaces).
        entry["layer_overhead_ms"] = 0.0
        if blocks:
            entry["optimizer_ms_per_layer"] = time_optimizer(hidden=blocks[0][0], heads=blocks[0][1], device=device)
        entry["memory_overhead_gib"] = cuda_context_gib(device)
    if collectives:
        entry["nccl"] = collectives
    return {"version": 1, "gpus": {gpu: entry}}
