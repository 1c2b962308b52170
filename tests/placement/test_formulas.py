"""The compiled communication formulas are the cost model's, bit for bit, as numba functions and as ufuncs."""

from __future__ import annotations

import math

import numpy as np

from spiderflow.core import costmodel
from spiderflow.core.kernels import formulas


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or np.float64(a).tobytes() == np.float64(b).tobytes()


def test_array_and_compiled_forms_equal_the_cost_model_bitwise() -> None:
    rng = np.random.default_rng(7)
    n = 400
    nbytes = rng.uniform(0.0, 1e10, n)
    d = rng.integers(0, 65, n)
    gbps = rng.uniform(0.0, 2400.0, n)
    gbps[::37], gbps[5::41] = 0.0, math.inf  # unreachable and unbounded links
    lat = rng.uniform(0.0, 300.0, n)
    ar = formulas.allreduce_times(nbytes, d, gbps, lat)
    tr = formulas.transfer_times(nbytes, gbps, lat)
    for i in range(n):
        x, k, g, ms = float(nbytes[i]), int(d[i]), float(gbps[i]), float(lat[i])
        assert _same(ar[i], costmodel.allreduce_time(x, k, g, ms)), i
        assert _same(formulas.allreduce_time(x, k, g, ms), costmodel.allreduce_time(x, k, g, ms)), i
        assert _same(tr[i], costmodel.transfer_time(x, g, ms)), i
        assert _same(formulas.transfer_time(x, g, ms), costmodel.transfer_time(x, g, ms)), i
        assert _same(formulas.fsdp_gather_time(x, k, g), costmodel.fsdp_gather_time(x, k, g)), i


def test_array_forms_broadcast() -> None:
    tp = np.array([1, 2, 4, 8])[:, None]
    intra = np.array([100.0, 600.0, 2400.0])[None, :]
    out = formulas.allreduce_times(1e8, tp, intra)
    assert out.shape == (4, 3) and (out[0] == 0.0).all() and (out[1:] > 0).all()
