"""Job records and their state machine (pure; stored in etcd by the scheduler service, encoded by
:mod:`spiderflow.store.records`).

States and legal transitions::

    PENDING ──► PLACED ──► RUNNING ──► SUCCEEDED
       ▲  │        │          │   └──► FAILED
       │  │        │          └──────► RESCHEDULING ──► PLACED | PENDING | FAILED | CANCELLED
       │  │        └─► RESCHEDULING / PENDING (plan withdrawn before start)
       │  └──────────────────────────► CANCELLED / FAILED
       └──── RESCHEDULING

Any non-terminal state may go to CANCELLED. Terminal states (SUCCEEDED, FAILED, CANCELLED) never change.
Every transition appends a :class:`Transition` (from, to, reason, time) to the record's history; the
service writes each new record with a compare-and-swap on the previous one's etcd revision, so two
writers can never both apply a transition.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from spiderflow.core.domain import JobSpec, Plan
from spiderflow.core.errors import PreconditionError

__all__ = [
    "TERMINAL",
    "JobRecord",
    "JobState",
    "Progress",
    "Transition",
]


class JobState(StrEnum):
    PENDING = "PENDING"
    PLACED = "PLACED"
    RUNNING = "RUNNING"
    RESCHEDULING = "RESCHEDULING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.PLACED, JobState.CANCELLED, JobState.FAILED}),
    JobState.PLACED: frozenset(
        {JobState.RUNNING, JobState.RESCHEDULING, JobState.PENDING, JobState.CANCELLED, JobState.FAILED,
         JobState.SUCCEEDED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.RESCHEDULING, JobState.CANCELLED}
    ),
    JobState.RESCHEDULING: frozenset(
        {JobState.PLACED, JobState.PENDING, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition:
    from_state: JobState | None
    to_state: JobState
    reason: str
    at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """Latest training figures reported by the job's workers."""

    step: int = 0
    steps: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    checkpoint_step: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRecord:
    """Everything the system knows about one job (the value stored under its etcd key).

    ``allocation`` is the GPUs reserved per cluster while the job holds a placement (PLACED, RUNNING);
    it is empty otherwise. ``attempt`` counts placements (1 for the first, +1 per re-placement).
    """

    spec: JobSpec
    state: JobState
    reason: str = ""
    request_id: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    plan: Plan | None = None
    policy: str = ""
    allocation: dict[str, int] = field(default_factory=dict)
    attempt: int = 0
    progress: Progress = field(default_factory=Progress)
    history: tuple[Transition, ...] = ()
    topology_revision: int = 0

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @classmethod
    def new(cls, spec: JobSpec, *, request_id: str, now: float) -> JobRecord:
        return cls(
            spec=spec, state=JobState.PENDING, reason="waiting for a placement", request_id=request_id,
            created_at=now, updated_at=now,
            history=(Transition(from_state=None, to_state=JobState.PENDING, reason="submitted", at=now),),
        )

    def to(self, state: JobState, reason: str, *, now: float, **changes: Any) -> JobRecord:
        """A new record in ``state``; :class:`PreconditionError` if the transition is illegal."""
        if state not in _ALLOWED[self.state]:
            raise PreconditionError(f"job {self.id} cannot go from {self.state} to {state}")
        if state not in (JobState.PLACED, JobState.RUNNING) and "allocation" not in changes:
            changes["allocation"] = {}
        return replace(
            self, state=state, reason=reason, updated_at=now,
            history=(*self.history, Transition(from_state=self.state, to_state=state, reason=reason, at=now)),
            **changes,
        )

    def with_reason(self, reason: str, *, now: float) -> JobRecord:
        """Same state, new human-readable reason (no history entry)."""
        return replace(self, reason=reason, updated_at=now)
