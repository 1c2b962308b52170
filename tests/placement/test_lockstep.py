"""SpinSearch tunes several chains' GPUs in one lockstep: each chain must end where tuning it alone ends
(a row's scores depend on that row only), whatever the other chains do."""

from __future__ import annotations

import itertools

import pytest

from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec
from spiderflow.core.placement.base import Objective
from spiderflow.core.placement.common import job_consts, topo_arrays
from spiderflow.core.placement.spinsearch import _hops, _Scorer, _trim
from spiderflow.core.topogen import generate_topology


@pytest.mark.parametrize("objective", [Objective.JCT, Objective.COST])
def test_chains_tuned_together_end_where_each_alone_ends(objective: Objective) -> None:
    topo = generate_topology(10, 3, "geo")
    job = JobSpec(id="j", model=model_preset("gpt3-6.7b"), global_batch=128, seq_len=2048, steps=10,
                  gpus=GpuRange(min=8, max=96))
    ta, jc = topo_arrays(topo), job_consts(job)
    hops = _hops(topo, ta, jc)
    usable = [i for i in range(len(ta.names)) if ta.free[i] > 0]
    chains = [(u,) for u in usable[:3]] + list(itertools.permutations(usable[:4], 2))[:5] + [tuple(usable[:3])]

    def scorer() -> _Scorer:
        return _Scorer(ta, jc, hops.p, objective)

    together = _trim(scorer(), chains, objective)
    alone = [_trim(scorer(), [c], objective)[0] for c in chains]
    assert together == alone
    # Tuning moved some chain's GPUs (the comparison is not between untouched greedy allocations).
    greedy = [tuple(int(x) for x in scorer().score([c])[3][0, : len(c)]) for c in chains]
    assert together != greedy
