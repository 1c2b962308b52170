"""Reference enumerators for tiny instances: every layer split × every per-cluster configuration."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from spiderflow.core.tpa.level1 import ChainContext, SplitEval, step_estimate
from spiderflow.core.tpa.level2 import BlockConfig, BlockProblem, block_candidates, config_cost, plain


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered ways to write ``total`` as ``parts`` positive integers."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def block_configs(p: BlockProblem) -> list[BlockConfig]:
    """Every candidate degree triple × every layer composition that fits ``p``'s memory: the plain ones, or
    where none fits, those with recomputation and FSDP too (level 2's tiers)."""
    for q in (plain(p), p):
        out = []
        for k in block_candidates(q):
            for layers in compositions(q.layers, k.pp):
                cfg = config_cost(q, k, layers)
                if max(cfg.memory_gib) <= q.shape.memory_gib:
                    out.append(cfg)
        if out:
            return out
    return []


def brute_force_chain(ctx: ChainContext) -> SplitEval | None:
    """The split and configurations minimising the closed-form step under memory (``None``: infeasible).

    Blocks are enumerated from the last to the first so each knows how many stages follow it.
    """
    n = len(ctx.clusters)
    best: SplitEval | None = None

    def rec(
        split: tuple[int, ...], c: int, downstream: int, tail: tuple[BlockConfig, ...]
    ) -> Iterator[tuple[BlockConfig, ...]]:
        if c < 0:
            yield tail
            return
        p = ctx.problem(c, sum(split[:c]), split[c], min(downstream, ctx.m))
        for cfg in block_configs(p):
            yield from rec(split, c - 1, downstream + cfg.pp, (cfg, *tail))

    for split in compositions(ctx.model.layers, n):
        for configs in rec(split, n - 1, 0, ()):
            step = step_estimate(ctx, configs)
            if best is None or step < best.step_s:
                best = SplitEval(split=split, configs=configs, step_s=step, excess_gib=0.0, infeasible=())
    if best is not None and not math.isfinite(best.step_s):
        return None
    return best
