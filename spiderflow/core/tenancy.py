r"""Tenants share the pool: per-tenant quotas, fair-share order between tenants, and jobs that can never fit.

Pure (no I/O, no clock). The scheduling cycle calls :func:`arrange` on the queue after
:func:`spiderflow.core.queueing.order` has ordered it; the job service enforces the admission quotas
(:class:`TenantQuota`: queued jobs and open watches per tenant) before it writes anything.

Parking
-------
A queued job is *parked* for the cycle, never becoming the head of the queue nor taking a backfill slot:

1. when it can never fit the pool: ``gpus.min`` exceeds every GPU the topology offers (``capacity``);
   its reason says so, and it is reconsidered each cycle (clusters may join);
2. when its tenant is at its GPU quota: ``held_t + taken_t + gpus.min > max_gpus``, with ``held_t`` the
   GPUs the tenant's placed and running jobs hold and ``taken_t`` the minimum GPUs of the tenant's jobs
   kept before it in this cycle's order.

Fair share (max-min on GPUs, progressive filling)
-------------------------------------------------
The kept jobs are interleaved between tenants, each tenant's own jobs keeping their order. Repeatedly,
the next job is the first remaining job of the tenant with the least

    (held_t + taken_t,   demand_t,   first position of t in the input order)

where ``demand_t`` is the sum of ``gpus.min`` over the tenant's kept jobs (the tenant asking for less
goes first on a tie: max-min fairness satisfies the smallest demands first), and ``taken_t`` grows by a
job's ``gpus.min`` when that job is taken. So a tenant flooding the queue gets one turn per round like
every other tenant, a tenant holding GPUs yields to those that hold fewer, and another tenant's small
job is at most (number of tenants − 1) places from the front of the order whatever one tenant queued.

Complexity: O(q log T) for q queued jobs of T tenants.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from spiderflow.core.errors import ValidationError

__all__ = ["Arrangement", "Entry", "TenantQuota", "arrange"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantQuota:
    """Bounds each tenant separately (``None``: unbounded). ``max_queued``: PENDING + RESCHEDULING jobs;
    ``max_gpus``: GPUs held by PLACED + RUNNING jobs; ``max_watches``: open WatchJob streams."""

    max_queued: int | None = None
    max_gpus: int | None = None
    max_watches: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_queued", "max_gpus", "max_watches"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValidationError(f"tenant_quota.{name}", "must be an integer ≥ 1 (or unset)", v)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """A queued job as :func:`arrange` sees it."""

    job_id: str
    tenant: str
    min_gpus: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrangement:
    """The order to try the kept jobs in, and why each parked job is parked (``unresolvable``: the reason
    is that it can never fit the pool, not a quota)."""

    order: list[str] = field(default_factory=list)
    parked: dict[str, str] = field(default_factory=dict)
    unresolvable: frozenset[str] = frozenset()


def arrange(queue: Sequence[Entry], *, held: Mapping[str, int], capacity: int,
            quota: TenantQuota | None = None) -> Arrangement:
    """Park what cannot be placed this cycle and order the rest fairly between tenants (module docstring).
    ``queue`` is in the queue policy's order; ``held``: GPUs held per tenant; ``capacity``: GPUs the whole
    pool offers."""
    parked: dict[str, str] = {}
    unresolvable: set[str] = set()
    taken: dict[str, int] = {}
    kept: dict[str, list[Entry]] = {}
    first: dict[str, int] = {}
    max_gpus = quota.max_gpus if quota is not None else None
    for e in queue:
        if e.min_gpus > capacity:
            parked[e.job_id] = (f"needs at least {e.min_gpus} GPUs and the whole pool offers {capacity}: it cannot "
                                "run until clusters join")
            unresolvable.add(e.job_id)
            continue
        h = held.get(e.tenant, 0)
        t = taken.get(e.tenant, 0)
        if max_gpus is not None and h + t + e.min_gpus > max_gpus:
            parked[e.job_id] = (f"tenant {e.tenant} is at its GPU quota ({h} held, {t} queued ahead, quota "
                                f"{max_gpus})")
            continue
        taken[e.tenant] = t + e.min_gpus
        kept.setdefault(e.tenant, []).append(e)
        first.setdefault(e.tenant, len(first))
    demand = {t: sum(e.min_gpus for e in jobs) for t, jobs in kept.items()}
    heap: list[tuple[int, int, int, str]] = [(held.get(t, 0), demand[t], first[t], t) for t in kept]
    heapq.heapify(heap)
    nxt = dict.fromkeys(kept, 0)
    out: list[str] = []
    while heap:
        share, d, pos, tenant = heapq.heappop(heap)
        e = kept[tenant][nxt[tenant]]
        out.append(e.job_id)
        nxt[tenant] += 1
        if nxt[tenant] < len(kept[tenant]):
            heapq.heappush(heap, (share + e.min_gpus, d, pos, tenant))
    return Arrangement(order=out, parked=parked, unresolvable=frozenset(unresolvable))
