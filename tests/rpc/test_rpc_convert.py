"""Domain <-> proto converters: round trips, the file-format JSON through protobuf, field-named errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spiderflow.core.catalog import GPU_CATALOG, MODEL_PRESETS, ModelSpec
from spiderflow.core.domain import (
    Cluster,
    GpuRange,
    JobSpec,
    Link,
    Plan,
    Precision,
    Schedule,
    Sharding,
    Stage,
    Topology,
    Wait,
)
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.base import Budget, Objective, PlacementResult, PlacementStatus
from spiderflow.formats import job_from_dict, job_to_dict, topology_from_dict, topology_to_dict
from spiderflow.proto.planner.v1 import planner_pb2
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert as cv

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------- strategies

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12)
pos = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False, allow_infinity=False)


@st.composite
def clusters(draw: st.DrawFn, name: str | None = None) -> Cluster:
    nodes = draw(st.integers(1, 8))
    per = draw(st.integers(1, 8))
    opt = lambda s: draw(st.none() | s)  # noqa: E731
    return Cluster(
        name=name or draw(names), gpu=draw(st.sampled_from(sorted(GPU_CATALOG))), nodes=nodes, gpus_per_node=per,
        intra_node_gbps=draw(pos), inter_node_gbps=draw(pos),
        electricity_usd_per_kwh=draw(st.floats(0, 1, allow_nan=False)),
        free_gpus=opt(st.integers(0, nodes * per)), tflops=opt(pos),
        mfu=opt(st.floats(0.01, 1.0)), memory_gib=opt(pos), region=draw(st.sampled_from(["", "us-east-1"])),
        lat=opt(st.floats(-90, 90)), lon=opt(st.floats(-180, 180)),
    )


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    n = draw(st.integers(1, 6))
    cs = [draw(clusters(name=f"c{i}")) for i in range(n)]
    links: list[Link] = []
    used: set[tuple[str, str]] = set()
    for _ in range(draw(st.integers(0, 2 * n))):
        if n < 2:
            break
        a, b = draw(st.permutations(range(n)))[:2]
        directed = draw(st.booleans())
        pairs = {(a, b)} if directed else {(a, b), (b, a)}
        if pairs & used:
            continue
        used |= pairs
        links.append(Link(a=f"c{a}", b=f"c{b}", bandwidth_gbps=draw(pos),
                          latency_ms=draw(st.floats(0, 500, allow_nan=False)), directed=directed))
    return Topology(clusters=tuple(cs), links=tuple(links), revision=draw(st.integers(0, 2**40)))


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    if draw(st.booleans()):
        return draw(st.sampled_from(list(MODEL_PRESETS.values())))
    heads = draw(st.integers(1, 16))
    return ModelSpec(name=draw(st.sampled_from(["custom", "mine", "gpt-tiny"])), layers=draw(st.integers(1, 96)),
                     hidden=heads * draw(st.integers(1, 64)), heads=heads, vocab=draw(st.integers(1, 200_000)))


@st.composite
def jobs(draw: st.DrawFn) -> JobSpec:
    micro = draw(st.integers(1, 8))
    lo = draw(st.integers(1, 64))
    return JobSpec(
        id=draw(names), model=draw(models()), global_batch=micro * draw(st.integers(1, 256)), micro_batch=micro,
        seq_len=draw(st.integers(1, 8192)), steps=draw(st.integers(1, 10**6)),
        gpus=GpuRange(min=lo, max=lo + draw(st.integers(0, 64))),
        arrival_s=draw(st.floats(0, 1e6, allow_nan=False)), priority=draw(st.integers(-1000, 1000)),
        tenant=draw(names), precision=draw(st.sampled_from(list(Precision))),
        checkpoint_every=draw(st.none() | st.integers(0, 10**4)),
    )


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=6))
    stages, first = [], 0
    for size in sizes:
        stages.append(Stage(cluster=draw(names), first_layer=first, last_layer=first + size - 1,
                            tp=draw(st.integers(1, 8)), dp=draw(st.integers(1, 8)),
                            sharding=draw(st.sampled_from(list(Sharding))), recompute=draw(st.booleans())))
        first += size
    return Plan(
        stages=tuple(stages), micro_batches=draw(st.integers(1, 512)), schedule=draw(st.sampled_from(list(Schedule))),
        step_time_s=draw(st.floats(0, 1e4)), throughput_tokens_per_s=draw(st.floats(0, 1e7)),
        memory_gib_per_gpu=tuple(draw(st.floats(0, 100)) for _ in stages), usd_per_step=draw(st.floats(0, 10)),
        extras=draw(st.dictionaries(names, st.floats(-1e6, 1e6), max_size=3)),
    )


def _wire(msg: Any) -> Any:
    """Serialise and parse again: what the other end of a call sees."""
    return type(msg).FromString(msg.SerializeToString())


# ---------------------------------------------------------------------------------------------- round trips


@SETTINGS
@given(topologies())
def test_topology_roundtrip(topo: Topology) -> None:
    assert cv.topology_from_proto(_wire(cv.topology_to_proto(topo))) == topo
    for c in topo.clusters:
        assert cv.cluster_from_proto(_wire(cv.cluster_to_proto(c))) == c
    for link in topo.links:
        assert cv.link_from_proto(_wire(cv.link_to_proto(link))) == link


@SETTINGS
@given(jobs())
def test_job_roundtrip(job: JobSpec) -> None:
    msg = _wire(cv.job_to_proto(job))
    assert cv.job_from_proto(msg) == job
    # Through protobuf JSON too (what grpcurl sends), and it is the trace file's job object.
    text = json_format.MessageToJson(msg)
    assert cv.job_from_proto(json_format.Parse(text, types_pb2.JobSpec())) == job
    assert job_from_dict(json.loads(text)) == job


@SETTINGS
@given(models())
def test_model_roundtrip(model: ModelSpec) -> None:
    assert cv.model_from_proto_value(_wire(cv.model_to_proto_value(model))) == model
    assert cv.model_spec_from_proto(_wire(cv.model_spec_to_proto(model))) == model
    if MODEL_PRESETS.get(model.name) == model:
        assert cv.model_to_proto_value(model).string_value == model.name


@SETTINGS
@given(plans())
def test_plan_roundtrip(plan: Plan) -> None:
    back = cv.plan_from_proto(_wire(cv.plan_to_proto(plan)))
    assert back == plan
    for s in plan.stages:
        assert cv.stage_from_proto(_wire(cv.stage_to_proto(s))) == s


@pytest.mark.parametrize("schedule", list(Schedule))
def test_schedule_roundtrip(schedule: Schedule) -> None:
    value = cv.schedule_to_proto(schedule)
    assert value != types_pb2.SCHEDULE_UNSPECIFIED
    assert cv.schedule_from_proto(value) is schedule


def test_schedule_enum_covers_domain() -> None:
    assert len({cv.schedule_to_proto(s) for s in Schedule}) == len(Schedule) == len(types_pb2.Schedule.values()) - 1
    assert cv.schedule_from_proto(types_pb2.SCHEDULE_UNSPECIFIED) is Schedule.ONE_F_ONE_B
    assert cv.schedule_from_proto(types_pb2.SCHEDULE_UNSPECIFIED, default=Schedule.GPIPE) is Schedule.GPIPE
    with pytest.raises(ValidationError) as e:
        cv.schedule_from_proto(types_pb2.SCHEDULE_UNSPECIFIED, field="req.schedule", default=None)
    assert e.value.field == "req.schedule"


def test_job_states() -> None:
    proto_states = [v for v in types_pb2.JobState.values() if v != types_pb2.JOB_STATE_UNSPECIFIED]
    assert sorted(cv.JOB_STATES.values()) == sorted(proto_states)
    for name, value in cv.JOB_STATES.items():
        assert cv.job_state_to_proto(name) == value
        assert cv.job_state_from_proto(value) == name
        assert types_pb2.JobState.Name(value) == "JOB_STATE_" + name.upper()
    with pytest.raises(ValidationError, match="states\\[0\\]"):
        cv.job_state_from_proto(types_pb2.JOB_STATE_UNSPECIFIED, field="states[0]")
    with pytest.raises(ValidationError):
        cv.job_state_to_proto("sleeping")


@pytest.mark.parametrize("objective", list(Objective))
@pytest.mark.parametrize("limit", [None, 2.5])
def test_budget_roundtrip(objective: Objective, limit: float | None) -> None:
    budget = Budget(time_limit_s=limit, seed=7, objective=objective)
    assert cv.budget_from_proto(_wire(cv.budget_to_proto(budget))) == budget


def test_budget_defaults_and_errors() -> None:
    assert cv.budget_from_proto(types_pb2.Budget()) == Budget()
    with pytest.raises(ValidationError) as e:
        cv.budget_from_proto(types_pb2.Budget(time_limit_s=-1))
    assert e.value.field == "budget.time_limit_s"


@SETTINGS
@given(plans(), st.sampled_from([s for s in PlacementStatus if s is not PlacementStatus.WAIT]),
       st.none() | st.booleans())
def test_placement_result_roundtrip(plan: Plan, status: PlacementStatus, optimal: bool | None) -> None:
    result = PlacementResult(
        status=status, policy="spinsearch", plan=plan if status is PlacementStatus.SUCCESS else None,
        planning_seconds=0.25, optimal=optimal, reason="" if plan else "no chain fits", constraint="memory",
        stats={"chains_scored": 12.0},
    )
    msg = _wire(cv.placement_result_to_proto(result))
    assert isinstance(msg, planner_pb2.PlanResponse)
    assert cv.placement_result_from_proto(msg) == result


def test_a_wait_travels_as_unschedulable_with_constraint_wait() -> None:
    """The Planner service answers requests without releases, so it never waits; a wait that reached the
    wire would read back as UNSCHEDULABLE with constraint ``wait``."""
    plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=1, tp=1, dp=1),), micro_batches=1)
    result = PlacementResult(status=PlacementStatus.WAIT, policy="spinsearch", plan=plan, reason="waiting",
                             wait=Wait(after_s=5.0, plan=plan, reason="waiting"))
    back = cv.placement_result_from_proto(_wire(cv.placement_result_to_proto(result)))
    assert (back.status, back.constraint, back.reason) == (PlacementStatus.UNSCHEDULABLE, "wait", "waiting")


# ---------------------------------------------------------------------------------------------- file JSON


TRACE_JOB = {"id": "j1", "model": "gpt3-6.7b", "global_batch": 512, "micro_batch": 1, "seq_len": 2048,
             "steps": 1000, "gpus": {"min": 8, "max": 64}, "arrival_s": 0, "priority": 0, "tenant": "a"}
TOPOLOGY = {
    "clusters": [
        {"name": "virginia", "gpu": "A100-80G", "nodes": 2, "gpus_per_node": 8, "intra_node_gbps": 2400,
         "inter_node_gbps": 200, "electricity_usd_per_kwh": 0.08, "free_gpus": 16},
        {"name": "ohio", "gpu": "V100-32G", "nodes": 1, "gpus_per_node": 8},
        {"name": "oregon", "gpu": "cpu", "nodes": 1, "gpus_per_node": 2, "region": "us-west-2", "lat": 45.5},
    ],
    "links": [{"a": "virginia", "b": "ohio", "bandwidth_gbps": 1.12, "latency_ms": 11},
              {"a": "ohio", "b": "oregon", "bandwidth_gbps": 0.5, "latency_ms": 30, "directed": True}],
}


def test_trace_job_json_parses_as_proto() -> None:
    msg = json_format.Parse(json.dumps(TRACE_JOB), types_pb2.JobSpec())
    assert cv.job_from_proto(msg) == job_from_dict(TRACE_JOB)
    # The server's JSON uses the file's names (json_name), so it is a trace job again.
    out = json_format.MessageToDict(cv.job_to_proto(job_from_dict(TRACE_JOB)))
    assert out == {**TRACE_JOB, "arrival_s": 0.0, "precision": "bf16"}


def test_inline_model_json() -> None:
    doc = {**TRACE_JOB, "model": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50304}}
    job = cv.job_from_proto(json_format.Parse(json.dumps(doc), types_pb2.JobSpec()))
    assert job == job_from_dict(doc)
    assert job.model == ModelSpec(name="custom", layers=12, hidden=768, heads=12, vocab=50304)
    assert job_to_dict(job)["model"] == doc["model"]


def test_defaults_apply_when_optional_fields_are_unset() -> None:
    minimal = {"id": "j", "model": "gpt-tiny", "global_batch": 4, "gpus": {"min": 1, "max": 2}}
    job = cv.job_from_proto(json_format.Parse(json.dumps(minimal), types_pb2.JobSpec()))
    assert job == job_from_dict(minimal)
    assert (job.micro_batch, job.seq_len, job.steps, job.tenant, job.priority) == (1, 2048, 1, "default", 0)
    assert job.checkpoint_every is None  # the agents' own setting applies


def test_topology_file_json_parses_as_proto() -> None:
    msg = json_format.Parse(json.dumps(TOPOLOGY), types_pb2.Topology())
    topo = cv.topology_from_proto(msg)
    assert topo == topology_from_dict(TOPOLOGY)
    assert topo.cluster("ohio").free == 8 and topo.cluster("oregon").lat == 45.5
    assert json_format.MessageToDict(cv.topology_to_proto(topo))["links"] == [
        {"a": "virginia", "b": "ohio", "bandwidth_gbps": 1.12, "latency_ms": 11.0},
        {"a": "ohio", "b": "oregon", "bandwidth_gbps": 0.5, "latency_ms": 30.0, "directed": True},
    ]
    assert topology_from_dict(json_format.MessageToDict(cv.topology_to_proto(topo))) == topo
    assert topology_to_dict(topo)["clusters"][0] == json_format.MessageToDict(msg.clusters[0])


def test_unknown_json_field_is_rejected_by_protobuf() -> None:
    with pytest.raises(json_format.ParseError, match="gpus_total"):
        json_format.Parse(json.dumps({**TRACE_JOB, "gpus_total": 3}), types_pb2.JobSpec())


# ---------------------------------------------------------------------------------------------- errors


def _job_msg(**over: Any) -> types_pb2.JobSpec:
    doc = {**TRACE_JOB, **over}
    doc = {k: v for k, v in doc.items() if v is not None}
    return json_format.Parse(json.dumps(doc), types_pb2.JobSpec())


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"model": "gpt-99"}, "job.model"),
        ({"model": 5}, "job.model"),
        ({"model": ["gpt3-6.7b"]}, "job.model"),
        ({"model": None}, "job.model"),
        ({"model": {"layers": 2, "hidden": 100, "heads": 3, "vocab": 10}}, "job.model.heads"),
        ({"model": {"layers": 2.5, "hidden": 96, "heads": 3, "vocab": 10}}, "job.model.layers"),
        ({"model": {"layers": 2, "hidden": 96, "heads": 3}}, "job.model.vocab"),
        ({"model": {"layers": 2, "hidden": 96, "heads": 3, "vocab": 10, "depth": 1}}, "job.model.depth"),
        ({"steps": 0}, "job.steps"),
        ({"gpus": {"min": 16, "max": 8}}, "job.gpus.min"),
        ({"gpus": {"min": 0, "max": 8}}, "job.gpus.min"),
        ({"gpus": {"min": 4}}, "job.gpus.max"),
        ({"gpus": None}, "job.gpus"),
        ({"arrival_s": -1}, "job.arrival_s"),
        ({"id": None}, "job.id"),
        ({"id": ""}, "job.id"),
        ({"global_batch": None}, "job.global_batch"),
        ({"global_batch": 10, "micro_batch": 4}, "job.global_batch"),
        ({"micro_batch": 0}, "job.micro_batch"),
        ({"seq_len": -5}, "job.seq_len"),
        ({"priority": 5000}, "job.priority"),
        ({"checkpoint_every": -1}, "job.checkpoint_every"),
    ],
)
def test_invalid_job_names_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        cv.job_from_proto(_job_msg(**over))
    assert e.value.field == field, str(e.value)


def test_unknown_model_message_lists_presets() -> None:
    with pytest.raises(ValidationError) as e:
        cv.job_from_proto(_job_msg(model="gpt-99"), field="request.job")
    assert e.value.field == "request.job.model"
    assert e.value.value == "gpt-99" and "gpt3-6.7b" in e.value.reason


def _topo_msg(mutate: Any) -> types_pb2.Topology:
    doc = json.loads(json.dumps(TOPOLOGY))
    mutate(doc)
    return json_format.Parse(json.dumps(doc), types_pb2.Topology())


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["clusters"][1].update(gpu="Z80"), "topology.clusters[1].gpu"),
        (lambda d: d["clusters"][0].update(free_gpus=99), "topology.clusters[0].free_gpus"),
        (lambda d: d["clusters"][0].update(nodes=0), "topology.clusters[0].nodes"),
        (lambda d: d["clusters"][2].update(name=""), "topology.clusters[2].name"),
        (lambda d: d["clusters"][2].update(mfu=1.5), "topology.clusters[2].mfu"),
        (lambda d: d["links"][0].update(b="mars"), "topology.links[0].b"),
        (lambda d: d["links"][1].update(bandwidth_gbps=-1), "topology.links[1].bandwidth_gbps"),
        (lambda d: d["links"][1].update(latency_ms="NaN"), "topology.links[1].latency_ms"),
        (lambda d: d["clusters"].append(dict(d["clusters"][0])), "topology.clusters.name"),
        (lambda d: d.update(clusters=[], links=[]), "topology.clusters"),
    ],
)
def test_invalid_topology_names_the_field(mutate: Any, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        cv.topology_from_proto(_topo_msg(mutate))
    assert e.value.field == field, str(e.value)


def test_invalid_cluster_and_link_alone() -> None:
    with pytest.raises(ValidationError) as e:
        cv.cluster_from_proto(types_pb2.Cluster(name="x", gpu="Z80", nodes=1, gpus_per_node=1))
    assert (e.value.field, e.value.value) == ("cluster.gpu", "Z80")
    with pytest.raises(ValidationError) as e:
        cv.cluster_from_proto(types_pb2.Cluster(name="x", gpu="T4", nodes=1, gpus_per_node=0), field="req.cluster")
    assert e.value.field == "req.cluster.gpus_per_node"
    with pytest.raises(ValidationError) as e:
        cv.link_from_proto(types_pb2.Link(a="x", b="y", bandwidth_gbps=0, latency_ms=1))
    assert e.value.field == "link.bandwidth_gbps"
    with pytest.raises(ValidationError) as e:
        cv.link_from_proto(types_pb2.Link(a="x", bandwidth_gbps=1, latency_ms=1))
    assert e.value.field == "link.b"


def _plan_msg(**over: Any) -> types_pb2.Plan:
    doc: dict[str, Any] = {"stages": [{"cluster": "a", "first_layer": 0, "last_layer": 3, "tp": 2},
                                      {"cluster": "b", "first_layer": 4, "last_layer": 5}],
                           "micro_batches": 8, "schedule": "SCHEDULE_GPIPE"}
    doc.update(over)
    return json_format.Parse(json.dumps(doc), types_pb2.Plan())


def test_plan_from_json_defaults() -> None:
    plan = cv.plan_from_proto(_plan_msg())
    assert plan.schedule is Schedule.GPIPE and plan.stages[0].tp == 2 and plan.stages[1].dp == 1
    assert plan.chain == ("a", "b") and plan.step_time_s == 0.0
    assert cv.plan_from_proto(_plan_msg(schedule="SCHEDULE_UNSPECIFIED")).schedule is Schedule.ONE_F_ONE_B


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"stages": []}, "plan.stages"),
        ({"micro_batches": 0}, "plan.micro_batches"),
        ({"stages": [{"cluster": "a", "first_layer": 0, "last_layer": 1},
                     {"cluster": "b", "first_layer": 3, "last_layer": 4}]}, "plan.stages[1].first_layer"),
        ({"stages": [{"cluster": "a", "first_layer": 2, "last_layer": 1}]}, "plan.stages[0].last_layer"),
        ({"stages": [{"cluster": "", "first_layer": 0, "last_layer": 1}]}, "plan.stages[0].cluster"),
        ({"stages": [{"cluster": "a", "first_layer": 0, "last_layer": 1, "tp": -2}]}, "plan.stages[0].tp"),
        ({"schedule": 42}, "plan.schedule"),
    ],
)
def test_invalid_plan_names_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        cv.plan_from_proto(_plan_msg(**over))
    assert e.value.field == field, str(e.value)
    with pytest.raises(ValidationError) as e:
        cv.plan_from_proto(_plan_msg(**over), field="request.plan")
    assert e.value.field == "request." + field, str(e.value)
