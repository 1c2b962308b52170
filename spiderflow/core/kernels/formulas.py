"""The cost model's communication formulas, compiled from their one definition in
:mod:`spiderflow.core.costmodel`.

Each formula is written once, as a scalar Python function of the cost model
(:func:`~spiderflow.core.costmodel.allreduce_time`, :func:`~spiderflow.core.costmodel.transfer_time`,
:func:`~spiderflow.core.costmodel.fsdp_gather_time`). This module compiles that same function twice:

* as a numba function (``allreduce_time``, ``transfer_time``, ``fsdp_gather_time``) for the other kernels to
  call from nopython code;
* applied elementwise by a compiled loop over broadcast arrays (:func:`allreduce_times`,
  :func:`transfer_times`) for the vectorised scorers and reference solvers.

No copy of a formula lives anywhere else, so the compiled kernels, the array forms and the plain cost model
evaluate the same expression in the same order (IEEE doubles, no ``fastmath``) and agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from spiderflow.core import costmodel
from spiderflow.core.kernels import kernel, register_warmup

__all__ = [
    "allreduce_time",
    "allreduce_times",
    "fsdp_gather_time",
    "transfer_time",
    "transfer_times",
]

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]

allreduce_time: Callable[[float, int, float, float], float] = kernel(costmodel.allreduce_time)
""":func:`spiderflow.core.costmodel.allreduce_time`, compiled (every argument positional, latency included)."""
fsdp_gather_time: Callable[[float, int, float], float] = kernel(costmodel.fsdp_gather_time)
""":func:`spiderflow.core.costmodel.fsdp_gather_time`, compiled."""
transfer_time: Callable[[float, float, float], float] = kernel(costmodel.transfer_time)
""":func:`spiderflow.core.costmodel.transfer_time`, compiled."""



@kernel
def _allreduce_into(nbytes: FArr, d: IArr, gbps: FArr, latency_ms: FArr, out: FArr) -> None:
    for i in range(out.shape[0]):
        out[i] = allreduce_time(nbytes[i], d[i], gbps[i], latency_ms[i])


@kernel
def _transfer_into(nbytes: FArr, gbps: FArr, latency_ms: FArr, out: FArr) -> None:
    for i in range(out.shape[0]):
        out[i] = transfer_time(nbytes[i], gbps[i], latency_ms[i])


def _spread(a: npt.ArrayLike, shape: tuple[int, ...]) -> FArr:
    """``a`` broadcast to ``shape`` as a contiguous flat ``float64`` array (a copy; the inputs are small)."""
    out = np.empty(shape, dtype=np.float64)
    out[...] = a
    return out.reshape(-1)


def _spread_int(a: npt.ArrayLike, shape: tuple[int, ...]) -> IArr:
    """``a`` broadcast to ``shape`` as a contiguous flat ``int64`` array."""
    out = np.empty(shape, dtype=np.int64)
    out[...] = a
    return out.reshape(-1)


def allreduce_times(nbytes: npt.ArrayLike, d: npt.ArrayLike, gbps: npt.ArrayLike,
                    latency_ms: npt.ArrayLike = 0.0) -> FArr:
    """:func:`spiderflow.core.costmodel.allreduce_time` elementwise over broadcast arrays (``d`` integral):
    0 where ``d ≤ 1``, ``inf`` where ``gbps ≤ 0``."""
    shape = np.broadcast(nbytes, d, gbps, latency_ms).shape
    out = np.empty(shape, dtype=np.float64)
    _allreduce_into(_spread(nbytes, shape), _spread_int(d, shape), _spread(gbps, shape),
                    _spread(latency_ms, shape), out.reshape(-1))
    return out


def transfer_times(nbytes: npt.ArrayLike, gbps: npt.ArrayLike, latency_ms: npt.ArrayLike) -> FArr:
    """:func:`spiderflow.core.costmodel.transfer_time` elementwise over broadcast arrays: ``inf`` where
    ``gbps ≤ 0``, the latency alone where ``gbps`` is infinite."""
    shape = np.broadcast(nbytes, gbps, latency_ms).shape
    out = np.empty(shape, dtype=np.float64)
    _transfer_into(_spread(nbytes, shape), _spread(gbps, shape),
                   _spread(latency_ms, shape), out.reshape(-1))
    return out


@register_warmup
def _warmup() -> None:
    allreduce_times(np.ones(2), np.array([1, 2]), 1.0, 0.0)
    transfer_times(np.ones(2), np.array([1.0, 0.0]), 0.0)
    fsdp_gather_time(1.0, 2, 1.0)
