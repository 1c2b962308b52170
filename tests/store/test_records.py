"""Stored records: one codec per key kind, round trips, and malformed values named by key and field (never a
``KeyError`` or ``JSONDecodeError``); through a service, a corrupt record is DATA_LOSS naming the key."""

from __future__ import annotations

import json

import grpc
import grpc.aio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.repo import JobRepository
from services.scheduler.service import SchedulerService
from spiderflow.core.catalog import model_preset
from spiderflow.core.cycle import WaitState
from spiderflow.core.domain import Cluster, Plan, ReplicaShare, Stage
from spiderflow.core.errors import CorruptRecordError, ValidationError
from spiderflow.exec.spec import CheckpointManifest, ShardInfo
from spiderflow.formats import job_from_dict, plan_from_dict, plan_to_dict
from spiderflow.jobs import JobRecord, JobState, Progress
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.rpc.errors import from_rpc_error
from spiderflow.rpc.server import open_channel, serve
from spiderflow.store import MemoryStore, keys, records

SPEC = job_from_dict({"id": "alice~j1", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 20,
                      "gpus": {"min": 1, "max": 3}, "tenant": "alice"})
PLAN = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1, tp=1, dp=2,
                          replicas=(ReplicaShare(cluster="a", dp=1), ReplicaShare(cluster="b", dp=1))),
                    Stage(cluster="c", first_layer=2, last_layer=3)),
            micro_batches=4, step_time_s=0.5, throughput_tokens_per_s=10.0, memory_gib_per_gpu=(1.0, 2.0),
            usd_per_step=0.01, extras={"bubble": 0.2})
MANIFEST = CheckpointManifest(job_id="alice~j1", step=10, model=model_preset("gpt-tiny"),
                              shards=(ShardInfo(first_layer=0, last_layer=model_preset("gpt-tiny").layers - 1,
                                                path="/ckpt/step-10/.metadata"),), root="/ckpt")


def _job() -> JobRecord:
    r = JobRecord.new(SPEC, request_id="r1", now=1.0)
    r = r.to(JobState.PLACED, "placed", now=2.0, plan=PLAN, allocation={"a": 1, "b": 1, "c": 1}, attempt=1)
    return r.to(JobState.RUNNING, "started", now=3.0, progress=Progress(step=3, steps=20, loss=float("nan")))


SAMPLES: list[tuple[str, records.Record]] = [
    (keys.cluster_key("a"), records.Registration(cluster="a", agent_id="a-1", principal="a-1",
                                                 address="127.0.0.1:1", pid=3, started_at=1.5)),
    (keys.lease_owner_key(0x2A), records.LeaseOwner(cluster="a")),
    (keys.profile_key("a"), records.ProfileRecord(
        cluster=Cluster(name="a", gpu="A100-80G", nodes=1, gpus_per_node=4, free_gpus=4),
        tflops=records.Series(value=100.0, samples=2), agent_id="a-1", agent_address="127.0.0.1:1",
        measured_at=1.0, updated_at=2.0)),
    (keys.link_key("a", "b"), records.LinkRecord(src="a", dst="b", bandwidth=records.Series(value=1.0),
                                                 latency=records.Series(value=5.0, pending=1, pending_mean=9.0),
                                                 measured_at=1.0, updated_at=2.0, probe_bytes=10)),
    (keys.job_key(SPEC.id), _job()),
    (keys.request_key("r1", "alice"), records.RequestRecord(job=SPEC.id)),
    (keys.allocation_key("a"), records.AllocationRecord(gpus={SPEC.id: 1, "j2": 3})),
    (keys.assignment_key("a", SPEC.id), records.Assignment.of(_job(), "a")),
    (keys.wait_key(SPEC.id), WaitState(until=9.0, gpus=3, claim=(("a", 1), ("c", 2)), run_s=4.0, reason="w")),
    (keys.rendezvous_key(SPEC.id, 1), records.RendezvousInfo(host="127.0.0.1", port=29500, checkpoint_dir="/c",
                                                             checkpoint_every=5, resume=MANIFEST)),
    (keys.checkpoint_key(SPEC.id), records.CheckpointRecord(manifest=MANIFEST, attempt=1, cluster="c", at=7.0)),
    (keys.metrics_key(SPEC.id, attempt=1, step=3), records.MetricsRecord(points=(
        records.StepPoint(attempt=1, step=3, loss=4.5, tokens_per_s=100.0, step_time_s=0.4,
                          predicted_step_time_s=0.5, stage=1, busy_s=0.3, predicted_stage_busy_s=(0.2, 0.3),
                          time=12.0),
        records.StageBusyPoint(attempt=1, step=3, stage=0, busy_s=0.25, time=12.0)))),
    (keys.metrics_dropped_key(SPEC.id), records.DroppedPoints(count=12)),
    (keys.leader_key(keys.SCHEDULER, 0x2A), records.LeaderRecord(address="127.0.0.1:50051")),
]


def _same(a: object, b: object) -> bool:
    """Equality where a NaN loss equals itself (compare the encodings)."""
    return a == b or (type(a) is type(b) and json.dumps(repr(a)) == json.dumps(repr(b)))


@pytest.mark.parametrize(("key", "record"), SAMPLES, ids=[keys.parse(k).kind.value for k, _ in SAMPLES])
def test_every_kind_round_trips_through_the_one_codec(key: str, record: records.Record) -> None:
    assert _same(records.decode(key, records.encode(record)), record)
    assert isinstance(records.decode_as(key, records.encode(record), type(record)), type(record))


def test_every_key_kind_has_a_sample() -> None:
    assert {keys.parse(k).kind for k, _ in SAMPLES} == set(keys.KeyKind)


@pytest.mark.parametrize(("key", "value", "field"), [
    (keys.job_key("j1"), b"{", "value"),
    (keys.job_key("j1"), b"[]", "value"),
    (keys.job_key(SPEC.id), b"{}", "spec"),
    (keys.job_key("other"), records.encode(_job()), "spec.id"),  # the record of another job under this key
    (keys.allocation_key("a"), b'{"j1": "two"}', "j1"),
    (keys.allocation_key("a"), b'{"j1": 0}', "j1"),
    (keys.wait_key("j1"), b'{"until": 1}', "claim"),
    (keys.request_key("r1"), b"", "value"),
    (keys.request_key("r1"), b"\xff", "value"),
    (keys.metrics_dropped_key("j1"), b"many", "value"),
    (keys.metrics_key("j1", attempt=1, step=1), b'[{"attempt": 1}]', "[0].step"),
    (keys.rendezvous_key("j1", 1), b'{"host": "h", "port": 0, "checkpoint_dir": "", "checkpoint_every": 1}',
     "port"),
    (keys.checkpoint_key("j1"), b'{"attempt": 1, "cluster": "c"}', "shards"),
    (keys.cluster_key("a"), records.Registration(cluster="b", agent_id="x", principal="x", address="h:1").encode(),
     "cluster"),
])
def test_a_malformed_value_names_its_key_and_field(key: str, value: bytes, field: str) -> None:
    with pytest.raises(CorruptRecordError) as e:
        records.decode(key, value)
    assert (e.value.key, e.value.field) == (key, field), str(e.value)
    assert key in str(e.value)


def test_an_assignment_with_a_bad_plan_names_the_plan_field() -> None:
    a = records.Assignment.of(_job(), "a")
    doc = json.loads(records.encode(a))
    doc["plan"]["stages"][1]["tp"] = 0
    key = keys.assignment_key("a", SPEC.id)
    with pytest.raises(CorruptRecordError) as e:
        records.decode(key, json.dumps(doc).encode())
    assert (e.value.key, e.value.field) == (key, "plan.stages[1].tp")


def test_one_plan_codec_keeps_every_field_and_reads_plan_json_documents() -> None:
    assert plan_from_dict(plan_to_dict(PLAN)) == PLAN
    doc = {"policy": "spinsearch", "optimal": None, "micro_batches": 2, "schedule": "gpipe", "step_time_s": None,
           "stages": [{"cluster": "a", "first_layer": 0, "last_layer": 3, "gpus": 4, "tp": 2, "extra": 1}]}
    with pytest.raises(ValidationError, match=r"plan\.policy"):
        plan_from_dict(doc)
    lenient = plan_from_dict(doc, strict=False)
    assert lenient.stages[0].dp == 2 and lenient.step_time_s == 0.0
    with pytest.raises(ValidationError, match=r"plan.stages\[0\].gpus"):
        plan_from_dict({"micro_batches": 1, "stages": [{"cluster": "a", "first_layer": 0, "last_layer": 0,
                                                        "gpus": 3, "tp": 2, "dp": 1}]})


@settings(max_examples=150)
@given(kind=st.sampled_from([k for k, _ in SAMPLES]),
       value=st.one_of(st.binary(max_size=40), st.recursive(
           st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
           max_leaves=8).map(lambda d: json.dumps(d).encode())))
def test_garbage_under_any_key_is_a_corrupt_record_error_or_a_record(kind: str, value: bytes) -> None:
    try:
        records.decode(kind, value)
    except CorruptRecordError as e:
        assert e.key == kind and e.field


async def test_a_service_reading_a_corrupt_record_answers_data_loss_naming_the_key() -> None:
    store = MemoryStore()
    repo = JobRepository(store)
    await repo.submit(SPEC, "r1")
    await store.put(keys.job_key(SPEC.id), b'{"spec": {}}')
    server = await serve([SchedulerService(repo)])
    try:
        async with open_channel(server.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=SPEC.id), timeout=10,
                                  metadata=(("x-spiderflow-tenant", "alice"),))
    finally:
        await server.stop(grace_s=0)
    assert e.value.code() is grpc.StatusCode.DATA_LOSS, e.value.details()
    assert keys.job_key(SPEC.id) in (e.value.details() or "")
    err = from_rpc_error(e.value)
    assert isinstance(err, CorruptRecordError) and err.key == keys.job_key(SPEC.id)
    assert err.field.startswith("spec"), err.field
