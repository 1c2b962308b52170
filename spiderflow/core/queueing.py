r"""The multi-tenant queue policy: which queued job goes next, and which may jump ahead.

Shared by the simulator and the scheduler service; pure (no I/O, no clock: ``now`` is an argument).

Ordering (BACE-Pipe-style dynamic prioritisation, with aging)
------------------------------------------------------------
Every queued job ``j`` gets a score at time ``now``:

    score_j = w_p · priority_j                                   (user priority, −1000 … 1000)
            + w_a · wait_j / 3600                                (aging: hours waited since enqueue)
            − w_w · log10(1 + work_j / 3600)                     (remaining work in reference GPU-hours)
            − w_n · net_j · U                                    (network-heavy jobs yield when the network is busy)

``net_j ∈ [0, 1]`` is the share of the job's step time spent on cross-cluster transfers (estimated before
its first placement, measured from its plan afterwards) and ``U ∈ [0, 1]`` the current utilisation of the
inter-cluster links. Short jobs go before long ones (a long job at the head would block them:
head-of-line blocking), and jobs that would saturate busy links wait for them to drain.

Order: first the *starving* jobs (waited ≥ ``starvation_s``) by enqueue time, then everyone else by
descending score (ties: enqueue time, then id).

No starvation: the aging term grows without bound while every other term is bounded for a given job
(priority is bounded, remaining work is finite, ``net·U ≤ 1``), so a waiting job's score eventually
exceeds the score of any job that arrives later; and after ``starvation_s`` it is ordered before every
non-starving job regardless of scores. The first job in order that cannot start becomes the *head* and
gets a reservation (below), which backfilling never delays.

Backfilling (EASY, on GPU counts)
---------------------------------
When the head cannot start, :func:`reserve` computes its *shadow time* ``S``: the earliest time at
which the GPUs free now plus those released by running jobs (at their estimated ends, in order) reach
the head's need ``g_h``; ``spare = available(S) − g_h``. A later job asking for ``g`` GPUs with estimated
end ``e`` may start now iff (:func:`admits`)

    (1) g ≤ free now,   and
    (2) e ≤ S  (it is gone before the head starts)   or   g ≤ spare  (it only uses GPUs the head will not
        need); in the second case ``spare −= g`` (:func:`after_admit`).

With exact estimates the head's shadow time never moves later (tests check this). Cross-cluster
placement needs GPUs in particular clusters, so counting GPUs in aggregate is an approximation: the
head's reservation is on the pool, not on named clusters. A head whose policy chose to wait for GPUs
being released (the scheduling cycle's start-now-or-wait step) is reserved at the time it waits for instead
(:func:`reserve_at`).

Waiting for releases
--------------------
A policy may weigh starting now against waiting (``Budget.releases``). :func:`expected_releases` builds
what it is told: every job holding GPUs gives them back at its estimated end, and every other job
already waiting for releases has *claimed* the GPUs of the plan it waits for (:class:`Claim`): they are
taken at its start (a negative release) and given back at its estimated end, so two waiting jobs never
count on the same GPUs.

Complexity: :func:`order` O(q log q) for q queued jobs; :func:`reserve` O(r log r) for r running jobs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from spiderflow.core.costmodel import activation_bytes, stage_fwd_flops
from spiderflow.core.domain import JobSpec
from spiderflow.core.placement.base import Release

__all__ = [
    "REFERENCE_GBPS",
    "REFERENCE_TFLOPS",
    "Claim",
    "Holding",
    "QueuePolicy",
    "QueuedJob",
    "Reservation",
    "RunningJob",
    "admits",
    "after_admit",
    "estimate_network_share",
    "estimate_work_gpu_s",
    "expected_releases",
    "order",
    "queued_job",
    "reserve",
    "reserve_at",
    "score",
]

REFERENCE_TFLOPS = 125.0
"""Achieved TFLOPS of the reference GPU used for work estimates (an A100 at 40 % MFU)."""
REFERENCE_GBPS = 1.0
"""Reference inter-cluster bandwidth (Gbit/s) for network-share estimates before placement."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuePolicy:
    """Weights of :func:`score` and the knobs of ordering and backfilling (see the module docstring).

    ``backfill_depth`` bounds how many jobs behind a blocked head one cycle tries (each try is a
    placement decision, which costs scheduler time).
    """

    priority_weight: float = 0.1
    aging_per_hour: float = 1.0
    work_weight: float = 1.0
    network_weight: float = 1.0
    starvation_s: float = 6 * 3600.0
    backfill: bool = True
    backfill_depth: int = 4

    def __post_init__(self) -> None:
        from spiderflow.core.errors import ValidationError

        for name in ("priority_weight", "aging_per_hour", "work_weight", "network_weight", "starvation_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or math.isnan(v) or v < 0:
                raise ValidationError(f"queue.{name}", "must be a number ≥ 0", v)
        if self.aging_per_hour <= 0:
            raise ValidationError("queue.aging_per_hour", "must be > 0 (aging is what prevents starvation)",
                                  self.aging_per_hour)
        if not isinstance(self.backfill_depth, int) or self.backfill_depth < 0:
            raise ValidationError("queue.backfill_depth", "must be an integer ≥ 0", self.backfill_depth)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuedJob:
    """What the queue knows about a waiting job: ``work_gpu_s`` remaining reference GPU-seconds,
    ``network_share`` ∈ [0, 1], ``min_gpus`` its smallest acceptable allocation."""

    id: str
    enqueued_s: float
    min_gpus: int
    work_gpu_s: float
    network_share: float = 0.0
    priority: int = 0
    tenant: str = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunningJob:
    """A running job as backfilling sees it: GPUs held and estimated end time."""

    id: str
    gpus: int
    est_end_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """The head job's reservation: it starts at ``start_s``; ``spare_gpus`` GPUs free then are not needed."""

    job_id: str
    gpus: int
    start_s: float
    spare_gpus: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """A job holding GPUs (``((cluster, count), ...)``) until its estimated end ``end_s`` (absolute)."""

    job_id: str
    end_s: float
    gpus: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """A job waiting for releases: it takes ``gpus`` at ``start_s`` (absolute) for ``run_s`` seconds."""

    job_id: str
    start_s: float
    run_s: float
    gpus: tuple[tuple[str, int], ...]


def expected_releases(holding: Sequence[Holding], claims: Sequence[Claim], now: float, *,
                      gone: frozenset[str] = frozenset()) -> tuple[Release, ...]:
    """The releases a decision at ``now`` is told about (module docstring): holders' GPUs at their ends,
    claims as a negative release at their start and a positive one at their end; seconds from ``now``
    (never negative), soonest first; at equal times GPUs given back come before GPUs taken, then by job id.
    Clusters in ``gone`` (lost) and zero counts are left out; claims whose start has passed are ignored."""
    out: list[tuple[float, int, str, Release]] = []  # (seconds from now, 0 give back | 1 take, job, release)
    for h in holding:
        gpus = tuple(sorted((c, g) for c, g in h.gpus if c not in gone and g > 0))
        if gpus:
            after = max(0.0, h.end_s - now)
            out.append((after, 0, h.job_id, Release(after_s=after, gpus=gpus)))
    for c in claims:
        gpus = tuple(sorted((k, g) for k, g in c.gpus if k not in gone and g > 0))
        if not gpus or c.start_s <= now:
            continue
        start = c.start_s - now
        out.append((start, 1, c.job_id, Release(after_s=start, gpus=tuple((k, -g) for k, g in gpus))))
        out.append((start + c.run_s, 0, c.job_id, Release(after_s=start + c.run_s, gpus=gpus)))
    out.sort(key=lambda x: (x[0], x[1], x[2]))
    return tuple(x[3] for x in out)


def estimate_work_gpu_s(job: JobSpec, steps: int | None = None) -> float:
    """Remaining work in reference GPU-seconds: training FLOPs of ``steps`` (default all) / ``REFERENCE_TFLOPS``."""
    n = job.steps if steps is None else steps
    flops = 3.0 * stage_fwd_flops(job.model, 0, job.model.layers - 1, job.micro_batch, job.seq_len)
    return n * flops * job.micro_batches_total / (REFERENCE_TFLOPS * 1e12)


def estimate_network_share(job: JobSpec) -> float:
    """Share of a step spent on one cross-cluster boundary at :data:`REFERENCE_GBPS`, before placement.

    ``t_net = 2 · m · A · 8 / B_ref`` (activation forward + gradient back, ``m`` micro-batches) against
    ``t_comp = work per step / min_gpus``; returns ``t_net / (t_net + t_comp)``.
    """
    m = job.micro_batches_total
    t_net = 2.0 * m * activation_bytes(job.model, job.micro_batch, job.seq_len) * 8.0 / (REFERENCE_GBPS * 1e9)
    t_comp = estimate_work_gpu_s(job, 1) / job.gpus.min
    return t_net / (t_net + t_comp) if t_net + t_comp > 0 else 0.0


def queued_job(job: JobSpec, enqueued_s: float, *, steps_left: int | None = None,
               network_share: float | None = None) -> QueuedJob:
    """The queue's view of ``job`` (estimates from :func:`estimate_work_gpu_s` / :func:`estimate_network_share`)."""
    share = estimate_network_share(job) if network_share is None else network_share
    return QueuedJob(
        id=job.id, enqueued_s=enqueued_s, min_gpus=job.gpus.min, work_gpu_s=estimate_work_gpu_s(job, steps_left),
        network_share=min(1.0, max(0.0, share)), priority=job.priority, tenant=job.tenant,
    )


def score(job: QueuedJob, now: float, policy: QueuePolicy, network_utilization: float = 0.0) -> float:
    """The score of the module docstring (higher goes first)."""
    wait_h = max(0.0, now - job.enqueued_s) / 3600.0
    util = min(1.0, max(0.0, network_utilization))
    return (
        policy.priority_weight * job.priority
        + policy.aging_per_hour * wait_h
        - policy.work_weight * math.log10(1.0 + max(0.0, job.work_gpu_s) / 3600.0)
        - policy.network_weight * job.network_share * util
    )


def order(jobs: Sequence[QueuedJob], now: float, policy: QueuePolicy,
          network_utilization: float = 0.0) -> list[QueuedJob]:
    """Starving jobs first (by enqueue time), then the rest by descending :func:`score`."""
    starving = [j for j in jobs if now - j.enqueued_s >= policy.starvation_s]
    rest = [j for j in jobs if now - j.enqueued_s < policy.starvation_s]
    starving.sort(key=lambda j: (j.enqueued_s, j.id))
    rest.sort(key=lambda j: (-score(j, now, policy, network_utilization), j.enqueued_s, j.id))
    return starving + rest


def reserve(job_id: str, gpus: int, free_gpus: int, running: Sequence[RunningJob], now: float) -> Reservation | None:
    """The head's reservation (shadow time and spare GPUs); ``None`` if even all GPUs would not suffice."""
    avail = free_gpus
    if avail >= gpus:
        return Reservation(job_id=job_id, gpus=gpus, start_s=now, spare_gpus=avail - gpus)
    for r in sorted(running, key=lambda r: (r.est_end_s, r.id)):
        avail += r.gpus
        if avail >= gpus:
            return Reservation(job_id=job_id, gpus=gpus, start_s=max(now, r.est_end_s), spare_gpus=avail - gpus)
    return None


def reserve_at(job_id: str, gpus: int, start_s: float, free_gpus: int, running: Sequence[RunningJob],
               now: float) -> Reservation:
    """The reservation of a head job that waits for releases: it starts at ``start_s`` on ``gpus`` GPUs;
    spare = GPUs free then (free now + running jobs ending by ``start_s``) − ``gpus``."""
    avail = free_gpus + sum(r.gpus for r in running if r.est_end_s <= start_s + 1e-6)
    return Reservation(job_id=job_id, gpus=gpus, start_s=max(now, start_s), spare_gpus=max(0, avail - gpus))


def admits(res: Reservation | None, gpus: int, est_end_s: float, free_gpus: int) -> bool:
    """Rule (1)–(2) of the module docstring; with no reservation only rule (1) applies."""
    if gpus > free_gpus:
        return False
    if res is None:
        return True
    return est_end_s <= res.start_s or gpus <= res.spare_gpus


def after_admit(res: Reservation | None, gpus: int, est_end_s: float) -> Reservation | None:
    """The reservation after admitting a backfilled job (spare shrinks unless it ends before the shadow time)."""
    if res is None or est_end_s <= res.start_s:
        return res
    return replace(res, spare_gpus=res.spare_gpus - gpus)
