"""Job records and their state machine (pure; persisted as JSON in etcd by the scheduler service).

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

import json
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from spiderflow.core.domain import JobSpec, Plan, ReplicaShare, Schedule, Stage
from spiderflow.core.errors import PreconditionError, ValidationError
from spiderflow.formats import job_from_dict, job_to_dict

__all__ = [
    "TERMINAL",
    "JobRecord",
    "JobState",
    "Progress",
    "Transition",
    "plan_from_dict",
    "plan_to_dict",
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

    # --- serialisation -------------------------------------------------------------------------------

    def to_json(self) -> bytes:
        doc = {
            "spec": job_to_dict(self.spec), "state": self.state.value, "reason": self.reason,
            "request_id": self.request_id, "created_at": self.created_at, "updated_at": self.updated_at,
            "plan": plan_to_dict(self.plan) if self.plan else None, "policy": self.policy,
            "allocation": self.allocation, "attempt": self.attempt,
            "progress": {k: getattr(self.progress, k) for k in Progress.__dataclass_fields__},
            "history": [
                {"from": t.from_state.value if t.from_state else None, "to": t.to_state.value,
                 "reason": t.reason, "at": t.at}
                for t in self.history
            ],
            "topology_revision": self.topology_revision,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobRecord:
        try:
            doc = json.loads(data)
            return cls(
                spec=job_from_dict(doc["spec"]), state=JobState(doc["state"]), reason=doc["reason"],
                request_id=doc["request_id"], created_at=doc["created_at"], updated_at=doc["updated_at"],
                plan=plan_from_dict(doc["plan"]) if doc.get("plan") else None, policy=doc.get("policy", ""),
                allocation={str(k): int(v) for k, v in doc["allocation"].items()}, attempt=doc["attempt"],
                progress=Progress(**doc["progress"]),
                history=tuple(
                    Transition(from_state=JobState(t["from"]) if t["from"] else None, to_state=JobState(t["to"]),
                               reason=t["reason"], at=t["at"])
                    for t in doc["history"]
                ),
                topology_revision=doc.get("topology_revision", 0),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValidationError("job record", f"corrupt stored record: {e}") from None


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "stages": [
            {"cluster": s.cluster, "first_layer": s.first_layer, "last_layer": s.last_layer, "gpus": s.gpus,
             "tp": s.tp, "dp": s.dp, "sharding": s.sharding.value, "recompute": s.recompute,
             "replicas": [{"cluster": r.cluster, "dp": r.dp} for r in s.replicas]}
            for s in plan.stages
        ],
        "micro_batches": plan.micro_batches,
        "schedule": plan.schedule.value,
        "step_time_s": plan.step_time_s,
        "throughput_tokens_per_s": plan.throughput_tokens_per_s,
        "memory_gib_per_gpu": list(plan.memory_gib_per_gpu),
        "usd_per_step": plan.usd_per_step,
        "extras": dict(plan.extras),
    }


def plan_from_dict(doc: dict[str, Any]) -> Plan:
    return Plan(
        stages=tuple(
            Stage(cluster=s["cluster"], first_layer=s["first_layer"], last_layer=s["last_layer"], tp=s["tp"],
                  dp=s["dp"], sharding=s.get("sharding", "replicate"), recompute=s.get("recompute", False),
                  replicas=tuple(ReplicaShare(cluster=r["cluster"], dp=r["dp"]) for r in s.get("replicas", ())))
            for s in doc["stages"]
        ),
        micro_batches=doc["micro_batches"],
        schedule=Schedule(doc["schedule"]),
        step_time_s=doc.get("step_time_s", 0.0),
        throughput_tokens_per_s=doc.get("throughput_tokens_per_s", 0.0),
        memory_gib_per_gpu=tuple(doc.get("memory_gib_per_gpu", ())),
        usd_per_step=doc.get("usd_per_step", 0.0),
        extras=dict(doc.get("extras", {})),
    )
