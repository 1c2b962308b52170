"""Search budgets as policy options: ``genetic``'s population and trials, ``ilp``'s hint, SpinSearch's GPU price.

The CLI (``spiderflow plan`` / ``simulate``) and the benchmarks build policies through
:func:`make_policy`, so a budget reaches every place a policy runs. Options a policy does not take are
ignored (one ``simulate`` run compares several policies with one set of options)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.base import PlacementPolicy, Planner, get_policy

__all__ = ["SearchOptions", "make_policy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """``trials``/``population``: ``genetic``'s budget (``None``: the published 4,900 and 100);
    ``hint``: the policies whose best plan warm-starts ``ilp`` (see :func:`spiderflow.core.placement.ilp.parse_hint`;
    ``None``: its default, the other baselines); ``gpu_price``: SpinSearch's shadow price λ of the GPUs a
    plan holds under pressure on the pool (:class:`~spiderflow.core.placement.spinsearch.SpinSearch`; ``None``
    or 0: its fastest plan); ``lookahead``: SpinSearch's region matching against the expected arrivals
    (:mod:`spiderflow.core.placement.lookahead`; ``None`` or false: off)."""

    trials: int | None = None
    population: int | None = None
    hint: str | None = None
    gpu_price: float | None = None
    lookahead: bool | None = None

    def __post_init__(self) -> None:
        if self.trials is not None and (isinstance(self.trials, bool) or self.trials < 0):
            raise ValidationError("trials", "must be an integer ≥ 0", self.trials)
        if self.population is not None and (isinstance(self.population, bool) or self.population < 1):
            raise ValidationError("population", "must be an integer ≥ 1", self.population)
        price = self.gpu_price
        if price is not None and (isinstance(price, bool) or not isinstance(price, int | float)
                                  or not math.isfinite(price) or price < 0):
            raise ValidationError("gpu_price", "must be a finite number ≥ 0", self.gpu_price)
        if self.lookahead is not None and not isinstance(self.lookahead, bool):
            raise ValidationError("lookahead", "must be true or false", self.lookahead)


def make_policy(name: str, options: SearchOptions | None = None, *, planner: Planner | None = None) -> PlacementPolicy:
    """The registered policy ``name`` with ``options`` applied where it takes them; a policy that plans its
    chains gets ``planner`` (:func:`~spiderflow.core.placement.base.get_policy`)."""
    policy = get_policy(name, planner=planner)
    opts = options or SearchOptions()
    from spiderflow.core.placement.genetic import POPULATION, TRIALS, GeneticPolicy
    from spiderflow.core.placement.ilp import IlpPolicy

    if isinstance(policy, GeneticPolicy) and (opts.trials is not None or opts.population is not None):
        return GeneticPolicy(population=opts.population if opts.population is not None else POPULATION,
                             trials=opts.trials if opts.trials is not None else TRIALS)
    if isinstance(policy, IlpPolicy) and opts.hint is not None:
        return IlpPolicy(hint=opts.hint, decomposed=policy.decomposed, planner=policy.planner)
    from spiderflow.core.placement.spinsearch import SpinSearch

    if isinstance(policy, SpinSearch) and opts.gpu_price:
        policy.gpu_price = float(opts.gpu_price)
    if isinstance(policy, SpinSearch) and opts.lookahead:
        policy.lookahead = True
    return policy
