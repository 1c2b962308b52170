"""Profiling the cluster's accelerators with torch.

:func:`profile_devices` measures what this machine has:

- with CUDA devices: their count (GPUs per node), catalog type (from the device name and memory), memory
  per GPU, and dense bf16 matmul TFLOPS of device 0 (timed ``n × n`` matmuls after a warm-up);
- without: the CPU as one device of GPU type ``cpu`` — host memory, **measured** fp32 matmul TFLOPS and
  the **calibrated** training efficiency ``mfu`` (:func:`profile_cpu`).

The timed loop runs for about ``seconds`` (after one warm-up) and counts ``2·n³`` FLOPs per matmul.
torch is imported only when measuring. A declared cluster (:class:`~agent.config.GpuDeclaration`)
skips device discovery: its TFLOPS are the declared ones, or measured for type ``cpu``, or left unset
(the catalog's peak) for other types.

Calibration of ``mfu`` (type ``cpu``)
-------------------------------------
The cost model predicts compute as ``3 · layer_fwd_flops / (tflops · mfu)``
(:func:`spiderflow.costmodel.stage_compute_time`). :func:`measure_training_tflops` times forward +
backward of one real transformer block (:class:`spiderflow.exec.model.Block`, the executor's module) at a
representative size (:data:`CALIBRATION_SHAPE`) and counts ``3 · layer_fwd_flops`` per iteration, the
cost model's own formula; ``mfu = achieved / matmul TFLOPS``, bounded to ``(0, 1]``. So
``tflops · mfu`` is the FLOP rate a stage worker actually reaches on this host, per-op overheads
(LayerNorm, GELU, softmax, autograd) included. A CPU "GPU" is one worker process running
``torch.set_num_threads(1)`` (:mod:`agent.executor`), so both measurements run with :data:`CPU_WORKER_THREADS`
threads. Limits: one size is measured, so a model much smaller or larger than :data:`CALIBRATION_SHAPE` runs
at a different efficiency (on the 2-core dev machine, h=128, b=1: the block at s=64 reaches ~0.75× the FLOP
rate of s=128, at s=256 ~1.1×; medians of 6 interleaved measurements) — gpt-tiny at s=64 therefore runs
≈ 1.3× slower than predicted; embedding, head, optimizer step and pipeline messaging are not part of the
block. **CUDA devices are not calibrated** (no GPU to test on here): their ``mfu`` stays the catalog's
``default_mfu``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import structlog

from spiderflow.errors import ValidationError

__all__ = [
    "CALIBRATION_SHAPE",
    "CPU_WORKER_THREADS",
    "DeviceProfile",
    "calibrate_mfu",
    "catalog_name",
    "host_memory_gib",
    "measure_matmul_tflops",
    "measure_training_tflops",
    "profile_cpu",
    "profile_devices",
]

log = structlog.get_logger(__name__)

CPU_WORKER_THREADS = 1
"""``torch.set_num_threads`` of a CPU stage worker (the executor's ``TrainSpec.threads``): one CPU "GPU"."""

CALIBRATION_SHAPE = {"hidden": 128, "heads": 4, "seq_len": 128, "batch": 1}
"""The block timed by :func:`measure_training_tflops` by default: gpt-tiny's layer width at twice its demo
sequence length (``3 · layer_fwd_flops`` ≈ 0.16 GFLOP per iteration: ~10 ms on one core)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """What profiling found: catalog ``gpu`` type, ``count`` devices on this node, ``memory_gib`` per
    device, measured ``tflops`` per device (None when not measured), the raw ``device_name`` and the
    calibrated ``mfu`` (None when not calibrated: the catalog's default applies)."""

    gpu: str
    count: int
    memory_gib: float
    tflops: float | None
    device_name: str
    mfu: float | None = None


def catalog_name(device_name: str, memory_gib: float) -> str:
    """The catalog GPU type of a CUDA device name (``"NVIDIA A100-SXM4-80GB"`` → ``A100-80G``);
    :class:`ValidationError` (field ``gpu``) for a device the catalog does not know — declare it then."""
    n = device_name.upper()
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
                          threads: int | None = None) -> float:
    """Dense matmul throughput on ``device`` in TFLOPS: fp32 on the CPU, bf16 on CUDA (CPU work with
    ``threads`` torch threads when given, else torch's default)."""
    with _torch_threads(threads):
        return _matmul_tflops(device, size, seconds)


def _matmul_tflops(device: str, size: int, seconds: float) -> float:
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

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

    from spiderflow.catalog import ModelSpec
    from spiderflow.costmodel import layer_fwd_flops
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


def calibrate_mfu(matmul_tflops: float, training_tflops: float) -> float:
    """``mfu = training / matmul`` TFLOPS, bounded to ``(0, 1]`` (a training rate above the matmul rate —
    load from other processes during the matmul — is taken as 1)."""
    if not (matmul_tflops > 0 and training_tflops > 0):
        raise ValueError(f"TFLOPS must be positive: matmul {matmul_tflops}, training {training_tflops}")
    return min(1.0, training_tflops / matmul_tflops)


def profile_cpu(*, seconds: float = 0.5, threads: int = CPU_WORKER_THREADS) -> DeviceProfile:
    """The CPU as one ``cpu`` "GPU" (one worker with ``threads`` threads): host memory, matmul TFLOPS and
    the calibrated ``mfu`` (module docstring). Takes about ``3 × seconds`` (matmul, then the block for
    twice as long)."""
    tflops = measure_matmul_tflops(device="cpu", size=512, seconds=seconds, threads=threads)
    achieved = measure_training_tflops(seconds=2 * seconds, threads=threads)
    mfu = calibrate_mfu(tflops, achieved)
    log.info("agent.calibrated", gpu="cpu", matmul_tflops=tflops, training_tflops=achieved, mfu=mfu,
             threads=threads, **CALIBRATION_SHAPE)
    return DeviceProfile(gpu="cpu", count=1, memory_gib=host_memory_gib(), tflops=tflops,
                         device_name=f"cpu ({os.cpu_count()} cores, {threads} thread(s) per worker)", mfu=mfu)


def profile_devices(*, seconds: float = 0.5) -> DeviceProfile:
    """Profile the local accelerators (or the CPU); see the module docstring."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        props = torch.cuda.get_device_properties(0)
        mem = props.total_memory / 2**30
        tflops = measure_matmul_tflops(device="cuda:0", size=4096, seconds=seconds)
        prof = DeviceProfile(gpu=catalog_name(props.name, mem), count=torch.cuda.device_count(), memory_gib=mem,
                             tflops=tflops, device_name=props.name)
    else:
        prof = profile_cpu(seconds=seconds)
    log.info("agent.profiled", gpu=prof.gpu, count=prof.count, memory_gib=round(prof.memory_gib, 2),
             tflops=prof.tflops, mfu=prof.mfu, device=prof.device_name)
    return prof
