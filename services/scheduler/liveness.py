"""Jobs whose agents stopped reporting: detected by the leader's reconcile step and re-placed.

A job holding GPUs (PLACED or RUNNING) is *stale* at time ``now`` when its record has not changed for
longer than its bound

    bound = stale_s + 3 · step_time_s

(``step_time_s``: its plan's predicted step time). Every progress report of a new step rewrites the
record (``updated_at``), so a job whose agents report is never stale; one whose agents died, lost their
path to every scheduler replica, or never started its workers is. The cycle then moves it to
RESCHEDULING (releasing its GPUs), and the next placement resumes it from its last checkpoint. With the
cycle running at least every ``cycle_interval`` seconds, a stale job is re-placed within
``bound + cycle_interval`` of its last report. ``stale_s <= 0`` disables the check.

Pure: no I/O.
"""

from __future__ import annotations

from spiderflow.jobs import JobRecord, JobState

__all__ = ["DEFAULT_STALE_S", "stale_bound", "stale_reason"]

DEFAULT_STALE_S = 300.0
"""Default silence (seconds, before the step-time allowance) after which a job holding GPUs is stale."""


def stale_bound(r: JobRecord, stale_s: float) -> float:
    """The silence after which ``r`` is stale (module docstring)."""
    return stale_s + 3.0 * (r.plan.step_time_s if r.plan is not None else 0.0)


def stale_reason(r: JobRecord, now: float, *, stale_s: float) -> str:
    """Why ``r`` must be re-placed because nobody reports on it ("" when it need not)."""
    if stale_s <= 0 or r.state not in (JobState.PLACED, JobState.RUNNING):
        return ""
    silent = now - r.updated_at
    bound = stale_bound(r, stale_s)
    if silent <= bound:
        return ""
    return (f"no report from its agents for {silent:.0f} s (bound {bound:.0f} s); re-placing from its last "
            "checkpoint")
