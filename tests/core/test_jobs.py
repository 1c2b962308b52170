"""The job state machine and its JSON record."""

from __future__ import annotations

import pytest

from spiderflow.core.domain import Plan, Stage
from spiderflow.core.errors import PreconditionError
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobRecord, JobState
from spiderflow.store import keys, records

SPEC = job_from_dict({"id": "j1", "model": "gpt-tiny", "global_batch": 8, "gpus": {"min": 1, "max": 4}})


def test_happy_path_keeps_history() -> None:
    r = JobRecord.new(SPEC, request_id="r1", now=1.0)
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=5),), micro_batches=8)
    r = r.to(JobState.PLACED, "placed on a", now=2.0, plan=plan, allocation={"a": 1}, attempt=1)
    r = r.to(JobState.RUNNING, "started", now=3.0)
    assert r.allocation == {"a": 1}
    r = r.to(JobState.SUCCEEDED, "done", now=4.0)
    assert r.allocation == {}
    assert [t.to_state for t in r.history] == [JobState.PENDING, JobState.PLACED, JobState.RUNNING,
                                              JobState.SUCCEEDED]
    assert r.terminal
    assert records.decode(keys.job_key(r.id), records.encode(r)) == r


@pytest.mark.parametrize("terminal", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_terminal_states_never_change(terminal: JobState) -> None:
    r = JobRecord.new(SPEC, request_id="", now=0.0)
    if terminal is JobState.SUCCEEDED:
        r = r.to(JobState.PLACED, "p", now=1).to(JobState.RUNNING, "r", now=2)
    r = r.to(terminal, "end", now=3)
    for s in JobState:
        with pytest.raises(PreconditionError):
            r.to(s, "again", now=4)


def test_illegal_jump_is_refused() -> None:
    r = JobRecord.new(SPEC, request_id="", now=0.0)
    with pytest.raises(PreconditionError, match="PENDING to RUNNING"):
        r.to(JobState.RUNNING, "skip", now=1)


def test_rescheduling_cycle() -> None:
    r = JobRecord.new(SPEC, request_id="", now=0.0)
    r = r.to(JobState.PLACED, "p", now=1, allocation={"a": 2}).to(JobState.RUNNING, "r", now=2)
    r = r.to(JobState.RESCHEDULING, "cluster a lost", now=3)
    assert r.allocation == {}
    r = r.to(JobState.PLACED, "re-placed", now=4, allocation={"b": 2})
    assert r.state is JobState.PLACED and r.allocation == {"b": 2}
