"""The cost model's communication formulas, compiled from their one definition in
:mod:`spiderflow.core.costmodel`.

Each formula is written once, as a scalar Python function of the cost model
(:func:`~spiderflow.core.costmodel.allreduce_time`, :func:`~spiderflow.core.costmodel.transfer_time`,
:func:`~spiderflow.core.costmodel.fsdp_gather_time`). This module compiles that same function twice:

* as a numba function (``allreduce_time``, ``transfer_time``, ``fsdp_gather_time``) for the other kernels to
  call from nopython code;
* as a numpy ufunc (:func:`allreduce_times`, :func:`transfer_times`) for the vectorised scorers and
  reference solvers, which apply it elementwise over broadcast arrays.

No copy of a formula lives anywhere else, so the compiled kernels, the numpy forms and the plain cost model
evaluate the same expression in the same order (IEEE doubles, no ``fastmath``) and agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from numba import vectorize

from spiderflow.core import costmodel
from spiderflow.core.kernels import kernel

__all__ = [
    "allreduce_time",
    "allreduce_times",
    "fsdp_gather_time",
    "transfer_time",
    "transfer_times",
]

FArr = npt.NDArray[np.float64]

allreduce_time: Callable[[float, int, float, float], float] = kernel(costmodel.allreduce_time)
""":func:`spiderflow.core.costmodel.allreduce_time`, compiled (every argument positional, latency included)."""
fsdp_gather_time: Callable[[float, int, float], float] = kernel(costmodel.fsdp_gather_time)
""":func:`spiderflow.core.costmodel.fsdp_gather_time`, compiled."""
transfer_time: Callable[[float, float, float], float] = kernel(costmodel.transfer_time)
""":func:`spiderflow.core.costmodel.transfer_time`, compiled."""

_vectorize: Callable[..., Any] = vectorize  # numba ships no annotations
_allreduce_ufunc: Any = _vectorize(["float64(float64, int64, float64, float64)"], cache=True)(
    costmodel.allreduce_time)
_transfer_ufunc: Any = _vectorize(["float64(float64, float64, float64)"], cache=True)(costmodel.transfer_time)


def allreduce_times(nbytes: npt.ArrayLike, d: npt.ArrayLike, gbps: npt.ArrayLike,
                    latency_ms: npt.ArrayLike = 0.0) -> FArr:
    """:func:`spiderflow.core.costmodel.allreduce_time` elementwise over broadcast arrays (``d`` integral):
    0 where ``d ≤ 1``, ``inf`` where ``gbps ≤ 0``."""
    out = _allreduce_ufunc(np.asarray(nbytes, dtype=np.float64), np.asarray(d, dtype=np.int64),
                           np.asarray(gbps, dtype=np.float64), np.asarray(latency_ms, dtype=np.float64))
    return cast(FArr, np.asarray(out, dtype=np.float64))


def transfer_times(nbytes: npt.ArrayLike, gbps: npt.ArrayLike, latency_ms: npt.ArrayLike) -> FArr:
    """:func:`spiderflow.core.costmodel.transfer_time` elementwise over broadcast arrays: ``inf`` where
    ``gbps ≤ 0``, the latency alone where ``gbps`` is infinite."""
    out = _transfer_ufunc(np.asarray(nbytes, dtype=np.float64), np.asarray(gbps, dtype=np.float64),
                          np.asarray(latency_ms, dtype=np.float64))
    return cast(FArr, np.asarray(out, dtype=np.float64))
