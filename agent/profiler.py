"""Profiling the cluster's accelerators with torch.

:func:`profile_devices` measures what this machine has:

- with CUDA devices: their count (GPUs per node), catalog type (from the device name and memory), memory
  per GPU, and dense bf16 matmul TFLOPS of device 0 (timed ``n × n`` matmuls after a warm-up);
- without: the CPU as one device of GPU type ``cpu`` — host memory and **measured** fp32 matmul TFLOPS
  (the same timed matmul on the CPU, with torch's default thread count).

The timed loop runs for about ``seconds`` (after one warm-up) and counts ``2·n³`` FLOPs per matmul.
torch is imported only when measuring. A declared cluster (:class:`~agent.config.GpuDeclaration`)
skips device discovery: its TFLOPS are the declared ones, or measured for type ``cpu``, or left unset
(the catalog's peak) for other types.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import structlog

from spiderflow.errors import ValidationError

__all__ = ["DeviceProfile", "catalog_name", "host_memory_gib", "measure_matmul_tflops", "profile_devices"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """What profiling found: catalog ``gpu`` type, ``count`` devices on this node, ``memory_gib`` per
    device, measured ``tflops`` per device (None when not measured), and the raw ``device_name``."""

    gpu: str
    count: int
    memory_gib: float
    tflops: float | None
    device_name: str


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


def measure_matmul_tflops(*, device: str = "cpu", size: int = 512, seconds: float = 0.5) -> float:
    """Dense matmul throughput on ``device`` in TFLOPS: fp32 on the CPU, bf16 on CUDA."""
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
        tflops = measure_matmul_tflops(device="cpu", size=512, seconds=seconds)
        prof = DeviceProfile(gpu="cpu", count=1, memory_gib=host_memory_gib(), tflops=tflops,
                             device_name=f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} threads)")
    log.info("agent.profiled", gpu=prof.gpu, count=prof.count, memory_gib=round(prof.memory_gib, 2),
             tflops=prof.tflops, device=prof.device_name)
    return prof
