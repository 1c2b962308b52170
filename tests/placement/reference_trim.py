"""The GPU tuning of SpinSearch's candidates as plain Python over :class:`~spiderflow.core.placement.spinsearch._Scorer`
calls: the reference the compiled :func:`spiderflow.core.kernels.scorer.trim_rows` must match exactly. The chains
are tuned in lockstep, every chain's candidates of a round scored in one call."""

from __future__ import annotations

import numpy as np

from spiderflow.core.placement.base import Objective
from spiderflow.core.placement.spinsearch import TRIM_TOLERANCE, Chain, _Scorer

__all__ = ["trim_reference"]


def trim_reference(scorer: _Scorer, chains: list[Chain], objective: Objective) -> list[tuple[int, ...]]:
    """Tune the GPUs of each chain: moves that lower the estimated objective (shifting 1, 2, 4 or a node's
    worth of GPUs between positions, or removing some) are taken first; then, for ``jct``, removals that
    stay within ``TRIM_TOLERANCE`` of the untrimmed score (no drift), largest removal first.

    The chains are tuned in lockstep, each round's candidates of every chain still moving scored in one
    call; each chain takes the steps it would take alone (a row's scores depend on that row only)."""
    ta = scorer.ta
    state: list[tuple[tuple[int, ...], float, float]] = []  # (GPUs, score, untrimmed score)
    for chain in chains:
        _, _, _, g = scorer.score([chain])
        cur = tuple(int(x) for x in g[0, : len(chain)])
        raw, _, _, _ = scorer.score([chain], [cur])
        state.append((cur, float(raw[0]), float(raw[0])))
    rounds = [3 * len(c) for c in chains]
    active = [i for i, n in enumerate(rounds) if n > 0]
    while active:
        batch: list[tuple[int, list[tuple[int, ...]]]] = []
        for i in active:
            chain, (cur, _, _) = chains[i], state[i]
            cands: list[tuple[int, ...]] = []
            for pos, u in enumerate(chain):
                gi = cur[pos]
                step_i = int(ta.tp_cap[u])
                opts = {gi // 2, gi - int(ta.gpn[u]), gi - step_i, gi - 1, (gi // step_i) * step_i}
                for o in sorted(opts):
                    if 1 <= o < gi:
                        cands.append((*cur[:pos], o, *cur[pos + 1 :]))
                for j, v in enumerate(chain):
                    if j == pos:
                        continue
                    for delta in {1, 2, 4, step_i}:
                        if gi - delta >= 1 and cur[j] + delta <= int(ta.free[v]):
                            new = list(cur)
                            new[pos] -= delta
                            new[j] += delta
                            cands.append(tuple(new))
            if cands:
                batch.append((i, cands))
        if not batch:
            break
        raw_all, _, _, _ = scorer.score([chains[i] for i, cands in batch for _ in cands],
                                        [c for _, cands in batch for c in cands])
        active = []
        at = 0
        for i, cands in batch:
            raw_c = raw_all[at: at + len(cands)]
            at += len(cands)
            cur, cur_score, base = state[i]
            rounds[i] -= 1
            j = int(np.argmin(raw_c))
            if raw_c[j] < cur_score * (1 - 1e-9):
                state[i] = (cands[j], float(raw_c[j]), base)
            elif objective is not Objective.JCT:
                continue
            else:
                ok = [k for k in range(len(cands)) if raw_c[k] <= base * (1 + TRIM_TOLERANCE)
                      and sum(cands[k]) < sum(cur)]
                if not ok:
                    continue
                j = min(ok, key=lambda k: (sum(cands[k]), raw_c[k]))
                state[i] = (cands[j], float(raw_c[j]), base)
            if rounds[i] > 0:
                active.append(i)
    return [cur for cur, _, _ in state]
