r"""Region matching by look-ahead: SpinSearch's optional final choice (``lookahead``) for ``jct``.

Why. Every online per-job policy gives the job in hand its best plan now. On a pool of whole regions of
different GPU types (e.g. the ``aws-10-dtfm`` preset: H100, A100 and V100 regions of 32 GPUs) the fastest
plan of most jobs is the fastest free region, and a job arriving while it is held finds only slower ones.
Whether another assignment is better depends on *comparative advantage* (does the job in hand gain less
from the fast GPUs than the jobs expected to arrive while it runs would?) and on *how long* it holds them.

Rule. The scheduler's :class:`~spiderflow.core.domain.Outlook` gives the observed arrival rate ``λ`` and the
empirical mix ``K`` (the last arrivals' specs). Clusters are grouped into *classes* (same GPU, size and
performance; any name, location or electricity price); for a job ``k`` of the mix, ``step_k(c)`` is its
level-1 step on a whole cluster of class ``c`` (``min(size, G_max)`` GPUs; jobs that fit no single cluster
are left out of these means). Then:

- ``G_c = mean_k log(step_k(slowest) / step_k(c))``: the typical arrival's log speedup on class ``c`` over
  the slowest class it fits (0 for that one; a job of the mix that does not fit ``c`` counts 0);
- ``ρ = min(1, λ · mean_k(g_k·T_k) / G)``: the offered load (GPU-seconds asked per second over the pool's
  ``G`` GPUs; ``T_k = S_k·step_k`` on its fastest class with ``g_k`` GPUs), and ``B_c = ρ^(R_c − 1)`` the
  chance that the ``R_c − 1`` other clusters of class ``c`` are all busy when an arrival wants one (each
  busy with probability ``ρ``): holding one of several fast regions costs little while another is free;
- for a candidate allocation ``p`` of job ``j`` (``S`` steps, level-1 plan on the GPUs free now),
  ``T_j(p) = S·step_j(p)`` is its run time and ``1 − e^(−λ·T_j(p))`` the probability that a job arrives
  before it ends;
- the choice minimises ``V(p) = log T_j(p) + (1 − e^(−λ·T_j(p))) · Σ_{c ∈ p} (g_c/n_c) · B_c · G_c``
  (``g_c`` of the cluster's ``n_c`` GPUs held): the job's own log run time plus the expected log speedup
  the next arrival loses on the GPUs it holds, in the units of the per-job geometric-mean throughput the
  benchmark reports. A non-finalist must win by more than :data:`MARGIN`.

Between two candidates the price differs by the arrival's speedup between them, weighted by a probability
(≤ 1): ``j`` leaves a fast region only if it gains *less* there than the typical arrival would, i.e. by
comparative advantage (e.g. llama3-70b, whose two-region plan runs at the pace of its slower region, gains
7 % from pairing an H100 region with a V100 one instead of an A100 one; a single-region job gains 3×). When
every model gains the same factor from every class, no plan changes (up to :data:`MARGIN`).

Candidates: SpinSearch's finalists, one whole-cluster allocation per distinct free cluster (``min(free,
G_max)`` GPUs, clusters with ``≥ G_min`` free; one per class) and the caller's alternatives (SpinSearch: its
search with each class of its best finalist left out), all planned by the level-1 planner (memoised by
:func:`~spiderflow.core.placement.common.cached_plan`). The mix's single-cluster steps are memoised per
(cluster class, model shape, GPUs), so a decision costs a few level-1 plans the first time and dictionary
look-ups after. When a finalist wins, SpinSearch's choice is exactly what it is without the option.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from spiderflow.core.domain import Cluster, JobSpec, Outlook, Plan, Topology
from spiderflow.core.errors import UnschedulableError
from spiderflow.core.placement.base import Objective
from spiderflow.core.placement.common import cached_plan, check_plan, fallback_plan_chain

__all__ = [
    "MARGIN",
    "Choice",
    "Prices",
    "arrivals_outlook",
    "cluster_class",
    "cluster_prices",
    "lookahead_choice",
    "single_cluster_allocs",
    "single_cluster_step",
]

Allocation = tuple[tuple[str, int], ...]

MARGIN = 0.1
"""A non-finalist replaces SpinSearch's finalists only when its ``V`` is lower by more than this (log units:
about 10 %), the precision of a forecast from a few dozen arrivals; smaller differences keep the fastest
plan."""

_STEP_CACHE: dict[tuple[Cluster, tuple[object, ...], int], float] = {}
_STEP_CACHE_SIZE = 50_000


def _shape(job: JobSpec) -> tuple[object, ...]:
    return (job.model, job.global_batch, job.micro_batch, job.seq_len, job.gpus, job.precision)


def cluster_class(c: Cluster) -> Cluster:
    """``c`` without its name, location, electricity price and free count: clusters of one class plan alike
    (the same step for any job on the same GPUs)."""
    return replace(c, name="_", region="", lat=None, lon=None, free_gpus=None, electricity_usd_per_kwh=0.0)


def single_cluster_step(topo: Topology, cluster: str, job: JobSpec, gpus: int) -> float:
    """Step time (s) of ``job``'s level-1 plan on ``gpus`` GPUs of ``cluster`` alone; ``inf`` when no plan
    fits. Memoised per (cluster class, model shape, GPUs)."""
    c = topo.cluster(cluster)
    key = (cluster_class(c), _shape(job), gpus)
    hit = _STEP_CACHE.get(key)
    if hit is not None:
        return hit
    try:
        plan = fallback_plan_chain(topo.with_free({c.name: max(c.free, gpus)}), job, [(cluster, gpus)])
        step = plan.step_time_s if math.isfinite(plan.step_time_s) else math.inf
    except UnschedulableError:
        step = math.inf
    if len(_STEP_CACHE) >= _STEP_CACHE_SIZE:
        _STEP_CACHE.clear()
    _STEP_CACHE[key] = step
    return step


@dataclass(frozen=True, slots=True, kw_only=True)
class Prices:
    """What holding a cluster costs the expected arrivals (module docstring): per cluster name its class's
    ``B_c · G_c`` (``weight``) and size ``n_c``; the arrival rate ``λ``; ``load`` the offered load ``ρ``."""

    weight: Mapping[str, float]
    size: Mapping[str, int]
    rate_per_s: float
    load: float

    def value(self, run_s: float, alloc: Allocation) -> float:
        """``V = log T_j + (1 − e^(−λ·T_j)) · Σ_c (g_c/n_c) · B_c · G_c``."""
        held = sum(g / self.size[c] * self.weight.get(c, 0.0) for c, g in alloc)
        return math.log(run_s) + -math.expm1(-self.rate_per_s * run_s) * held


def cluster_prices(topo: Topology, outlook: Outlook) -> Prices:
    """The :class:`Prices` of every cluster of ``topo`` for ``outlook``'s arrivals (module docstring)."""
    classes: dict[Cluster, list[str]] = {}
    size: dict[str, int] = {}
    for c in topo.clusters:
        classes.setdefault(cluster_class(c), []).append(c.name)
        size[c.name] = c.nodes * c.gpus_per_node
    rep = {k: names[0] for k, names in classes.items()}
    shapes: dict[tuple[object, ...], JobSpec] = {}
    for k in outlook.mix:
        shapes.setdefault(_shape(k), k)
    # step_k(class) on a whole cluster of the class, for each distinct shape of the mix
    steps: dict[tuple[object, ...], dict[Cluster, float]] = {}
    for key, k in shapes.items():
        row = {}
        for cls, name in rep.items():
            n = size[name]
            row[cls] = single_cluster_step(topo, name, k, min(n, k.gpus.max)) if n >= k.gpus.min else math.inf
        steps[key] = row
    gains: dict[Cluster, list[float]] = {cls: [] for cls in rep}
    runs: list[float] = []
    work: list[float] = []
    for k in outlook.mix:
        row = steps[_shape(k)]
        fits = sorted(((s, cls) for cls, s in row.items() if math.isfinite(s)), key=lambda x: x[0])
        if not fits:
            continue
        best_s, best_cls = fits[0][0], fits[0][1]
        runs.append(k.steps * best_s)
        work.append(k.steps * best_s * min(size[rep[best_cls]], k.gpus.max))
        slowest = fits[-1][0]
        for s, cls in fits:
            gains[cls].append(math.log(slowest / s))
    if not runs:
        return Prices(weight={}, size=size, rate_per_s=outlook.rate_per_s, load=0.0)
    total = sum(size.values())
    load = min(1.0, outlook.rate_per_s * (sum(work) / len(work)) / total) if total else 0.0
    weight: dict[str, float] = {}
    for cls, names in classes.items():
        g = gains[cls]
        if g:
            w = load ** (len(names) - 1) * (sum(g) / len(runs))
            for name in names:
                weight[name] = w
    return Prices(weight=weight, size=size, rate_per_s=outlook.rate_per_s, load=load)


def arrivals_outlook(arrivals: Iterable[tuple[float, JobSpec]], size: int) -> Outlook | None:
    """The :class:`Outlook` of the last ``size`` arrivals ``(time_s, spec)`` (in arrival order): rate
    ``(n − 1) / (t_last − t_first)``; ``None`` with fewer than two arrivals or no time between them."""
    last = list(arrivals)[-size:]
    if len(last) < 2:
        return None
    span = last[-1][0] - last[0][0]
    if not (span > 0 and math.isfinite(span)):
        return None
    return Outlook(rate_per_s=(len(last) - 1) / span, mix=tuple(s for _, s in last))


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """The look-ahead's pick: ``allocation`` and its level-1 ``plan``; ``finalist`` whether it is one of
    SpinSearch's own finalists; ``value`` its ``V`` and ``best_value`` the finalists' best ``V``."""

    allocation: Allocation
    plan: Plan
    finalist: bool
    value: float
    best_value: float


def _plan(topo: Topology, job: JobSpec, alloc: Allocation) -> Plan | None:
    try:
        plan = cached_plan("fallback", topo, job, alloc, Objective.JCT,
                           lambda t, j, al, o: fallback_plan_chain(t, j, al, objective=o))
    except UnschedulableError:
        return None
    if check_plan(plan, topo, job) or not math.isfinite(plan.step_time_s):
        return None
    return plan


def single_cluster_allocs(topo: Topology, job: JobSpec) -> list[Allocation]:
    """One whole-cluster allocation (``min(free, G_max)`` GPUs) per distinct cluster with ``≥ G_min`` free."""
    out: list[Allocation] = []
    seen: set[tuple[Cluster, int]] = set()
    for c in topo.clusters:
        if c.free < job.gpus.min:
            continue
        g = min(c.free, job.gpus.max)
        sig = (cluster_class(c), g)
        if sig in seen:
            continue
        seen.add(sig)
        out.append(((c.name, g),))
    return out


def lookahead_choice(
    topo: Topology, job: JobSpec, finalists: Sequence[Allocation], outlook: Outlook,
    alternatives: Sequence[Allocation] = (),
) -> Choice | None:
    """The allocation of least ``V`` among ``finalists``, the single-cluster allocations and
    ``alternatives`` (module docstring) on the GPUs free in ``topo``; finalists win ties, earlier ones
    first. ``None`` when no allocation has a valid plan, or when a non-finalist wins by no more than
    :data:`MARGIN`."""
    prices = cluster_prices(topo, outlook)
    best: tuple[float, Allocation, Plan, bool] | None = None
    best_final = math.inf
    seen: set[Allocation] = set()
    cands = [*((a, True) for a in finalists), *((a, False) for a in single_cluster_allocs(topo, job)),
             *((a, False) for a in alternatives)]
    for alloc, is_final in cands:
        if alloc in seen:
            continue
        seen.add(alloc)
        plan = _plan(topo, job, alloc)
        if plan is None:
            continue
        v = prices.value(job.steps * plan.step_time_s, alloc)
        if is_final:
            best_final = min(best_final, v)
        if best is None or v < best[0]:
            best = (v, alloc, plan, is_final)
    if best is None:
        return None
    if not best[3] and best[0] > best_final - MARGIN:  # not better enough: SpinSearch's own choice stands
        return None
    return Choice(allocation=best[1], plan=best[2], finalist=best[3], value=best[0], best_value=best_final)
