"""Job record encoding reuses each spec's and plan's JSON text (built once per object): the stored value is
still exactly the record's document, read back to the same record, and never another object's text."""

from __future__ import annotations

import json
from dataclasses import replace

from spiderflow.core.domain import Plan, ReplicaShare, Stage
from spiderflow.formats import job_from_dict
from spiderflow.jobs import JobRecord, JobState, Progress
from spiderflow.store import keys, records

SPEC = job_from_dict({"id": "alice~j1", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 20,
                      "gpus": {"min": 1, "max": 3}, "tenant": "alice"})
PLAN = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1, tp=1, dp=2,
                          replicas=(ReplicaShare(cluster="a", dp=1), ReplicaShare(cluster="b", dp=1))),
                    Stage(cluster="c", first_layer=2, last_layer=3)),
            micro_batches=4, step_time_s=0.5, throughput_tokens_per_s=10.0, memory_gib_per_gpu=(1.0, 2.0),
            usd_per_step=0.01, extras={"bubble": 0.2})


def _lifecycle() -> list[JobRecord]:
    """One job through its states (the same spec and plan objects throughout, as the scheduler keeps them)."""
    pending = JobRecord.new(SPEC, request_id="r1", now=1.0)
    noted = pending.with_reason("queued behind bob~j0", now=1.5)
    placed = noted.to(JobState.PLACED, "placed on a,b,c", now=2.0, plan=PLAN, allocation={"a": 2, "c": 1},
                      attempt=1, policy="spinsearch", topology_revision=7)
    running = placed.to(JobState.RUNNING, "started", now=3.0)
    done = replace(running.to(JobState.SUCCEEDED, "trained 20 steps", now=4.0),
                   progress=Progress(step=20, steps=20, loss=1.25, step_time_s=0.5, tokens_per_s=None))
    return [pending, noted, placed, running, done]


def test_every_state_of_a_job_encodes_to_its_document_and_decodes_to_the_same_record() -> None:
    key = keys.job_key(SPEC.id)
    for rec in _lifecycle():
        for _ in range(2):  # the second encoding reuses the spec's (and plan's) text
            value = records.encode(rec)
            assert json.loads(value) == records._job_to_doc(rec)
            assert records.decode_as(key, value, JobRecord) == rec


def test_new_specs_and_plans_never_get_an_older_objects_text() -> None:
    """Specs made and dropped one after another (their memory, and so their ``id()``, is reused) each encode
    with their own id and plan, past the number of texts kept (old entries are dropped)."""
    for i in range(records.FRAGMENTS_KEPT + 500):
        spec = replace(SPEC, id=f"alice~j{i}", steps=1 + i % 50)
        plan = replace(PLAN, step_time_s=0.1 + i) if i % 3 == 0 else None
        rec = JobRecord.new(spec, request_id=f"r{i}", now=float(i))
        if plan is not None:
            rec = rec.to(JobState.PLACED, "placed", now=float(i), plan=plan, allocation={"a": 1}, attempt=1)
        doc = json.loads(records.encode(rec))
        assert (doc["spec"]["id"], doc["spec"]["steps"]) == (f"alice~j{i}", 1 + i % 50)
        assert (doc["plan"] or {}).get("step_time_s") == (None if plan is None else 0.1 + i)
    assert len(records._fragments) <= records.FRAGMENTS_KEPT
