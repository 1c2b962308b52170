"""Hypothesis strategies for every RPC request of the Scheduler, Planner, Topology, Agent and Control services
and for the topology/trace file formats.

Two families, mixed by :func:`requests`:

* **structural** (:func:`message`): any message the proto descriptor admits — every scalar at its edges
  (NaN, ±inf, negative, 2^63-1, unknown enum numbers, long and odd unicode strings), repeated and map
  fields, oneofs, nested messages down to a depth limit, well-known types (``Value``, ``Timestamp``);
* **near-valid** (:func:`valid_request` + :func:`mutated`): a request that would succeed (a real job, a
  real topology, a real plan) with a few fields replaced by structural values, which reaches the deep
  validation paths the structural family rarely gets past.

Budgets are kept short (``time_limit_s`` ≤ 0.5 s when valid) so a fuzzed Plan request never asks the
ILP for minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf import descriptor as _d
from google.protobuf.message import Message
from hypothesis import strategies as st

from agent.registration import Registration
from spiderflow.formats import job_from_dict, load_topology
from spiderflow.proto.agent.v1 import agent_pb2
from spiderflow.proto.control.v1 import control_pb2
from spiderflow.proto.planner.v1 import planner_pb2
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.proto.topology.v1 import topology_pb2
from spiderflow.proto.types.v1 import types_pb2
from spiderflow.rpc import convert
from spiderflow.store import keys

__all__ = ["RPCS", "documents", "message", "mutated", "requests", "valid_request"]

_F = _d.FieldDescriptor
WORDS = ["", "default", "gpt-tiny", "gpt3-1.3b", "llama3-8b", "virginia", "ohio", "oregon", "A100-80G",
         "H100-80G", "spinsearch", "ilp", "genetic", "firstfit", "bace", "tpa", "job-0001", "req-0001",
         "a", "/", "../..", "\x00", "ü", "🚀", "%s%n", "' OR 1=1", "alice", "bob"]

text = st.one_of(st.sampled_from(WORDS), st.text(max_size=40),
                 st.text(alphabet=st.characters(codec="utf-8"), min_size=100, max_size=400))
ints32 = st.one_of(st.sampled_from([0, 1, -1, 2, 8, 64, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
ints64 = st.one_of(st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**40]), st.integers(-(2**63), 2**63 - 1))
uints32 = st.integers(0, 2**32 - 1)
uints64 = st.integers(0, 2**64 - 1)
floats = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-300, 1e300, float("nan"), float("inf"), float("-inf")]),
                   st.floats(allow_nan=True, allow_infinity=True))

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    _F.TYPE_DOUBLE: floats, _F.TYPE_FLOAT: st.floats(width=32),
    _F.TYPE_INT32: ints32, _F.TYPE_SINT32: ints32, _F.TYPE_SFIXED32: ints32,
    _F.TYPE_INT64: ints64, _F.TYPE_SINT64: ints64, _F.TYPE_SFIXED64: ints64,
    _F.TYPE_UINT32: uints32, _F.TYPE_FIXED32: uints32, _F.TYPE_UINT64: uints64, _F.TYPE_FIXED64: uints64,
    _F.TYPE_BOOL: st.booleans(), _F.TYPE_STRING: text, _F.TYPE_BYTES: st.binary(max_size=64),
}


def budget() -> st.SearchStrategy[types_pb2.Budget]:
    """Budgets with short or invalid time limits and any objective number."""
    return st.builds(
        lambda limit, seed, objective: types_pb2.Budget(
            **({"time_limit_s": limit} if limit is not None else {}), seed=seed, objective=objective),
        st.one_of(st.none(), st.floats(0.01, 0.5), st.sampled_from([0.0, -1.0, float("nan"), float("-inf")])),
        ints64, st.one_of(st.sampled_from(list(types_pb2.Objective.values())), ints32))


def timestamp() -> st.SearchStrategy[Any]:
    from google.protobuf import timestamp_pb2

    return st.builds(lambda s, n: timestamp_pb2.Timestamp(seconds=s, nanos=n), st.integers(-62135596800, 253402300799),
                     st.integers(0, 999_999_999))


OVERRIDES: dict[str, Callable[[], st.SearchStrategy[Any]]] = {
    "spiderflow.types.v1.Budget": budget,
    "google.protobuf.Timestamp": timestamp,
}


def _enum(field: _d.FieldDescriptor) -> st.SearchStrategy[int]:
    known = [v.number for v in field.enum_type.values]
    return st.one_of(st.sampled_from(known), ints32)  # proto3 enums are open: unknown numbers arrive too


def _value(field: _d.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == _F.TYPE_MESSAGE:
        return message(field.message_type, depth + 1)
    if field.type == _F.TYPE_ENUM:
        return _enum(field)
    return _SCALARS[field.type]


@st.composite
def _message(draw: st.DrawFn, desc: _d.Descriptor, depth: int, max_depth: int) -> Message:
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(desc)()
    oneof_fields = {f.name for o in desc.oneofs for f in o.fields if not o.name.startswith("_")}
    chosen = {draw(st.sampled_from([None, *[f.name for f in o.fields]])) for o in desc.oneofs
              if not o.name.startswith("_")}
    for field in desc.fields:
        if field.name in oneof_fields and field.name not in chosen:
            continue
        is_msg = field.type == _F.TYPE_MESSAGE
        if is_msg and depth >= max_depth:
            continue
        if not draw(st.booleans()) and field.name not in chosen:
            continue
        if field.is_repeated:
            if is_msg and field.message_type.GetOptions().map_entry:
                kf, vf = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                entries = draw(st.dictionaries(_value(kf, depth), _value(vf, depth), max_size=3))
                target = getattr(msg, field.name)
                for k, v in entries.items():
                    if vf.type == _F.TYPE_MESSAGE:
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
                continue
            items = draw(st.lists(_value(field, depth), max_size=4))
            if is_msg:
                getattr(msg, field.name).extend(items)
            else:
                getattr(msg, field.name).extend(items)
        elif is_msg:
            getattr(msg, field.name).CopyFrom(draw(message(field.message_type, depth + 1, max_depth)))
        else:
            setattr(msg, field.name, draw(_value(field, depth)))
    return msg


def message(desc: _d.Descriptor, depth: int = 0, max_depth: int = 4) -> st.SearchStrategy[Any]:
    """Any message of type ``desc`` (structural family)."""
    override = OVERRIDES.get(desc.full_name)
    if override is not None:
        return override()
    return _message(desc, depth, max_depth)


# ---------------------------------------------------------------------------------------- near-valid

_TOPOLOGY = load_topology(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples/topology-3.yaml")


@st.composite
def valid_job(draw: st.DrawFn, job_id: str | None = None) -> types_pb2.JobSpec:
    lo = draw(st.integers(1, 4))
    doc = {"id": job_id or f"fz-{draw(st.integers(0, 10**9))}", "model": draw(st.sampled_from(["gpt-tiny",
                                                                                                 "gpt3-1.3b"])),
           "global_batch": draw(st.sampled_from([8, 16])), "micro_batch": 1, "seq_len": 64,
           "steps": draw(st.integers(1, 10)), "gpus": {"min": lo, "max": lo + draw(st.integers(0, 4))},
           "tenant": draw(st.sampled_from(["default", "alice"]))}
    return convert.job_to_proto(job_from_dict(doc))


def _plan_proto(job: types_pb2.JobSpec) -> types_pb2.Plan:
    """Two stages (virginia, ohio) covering the job's layers."""
    layers = convert.job_from_proto(job).model.layers
    half = max(1, layers // 2)
    return types_pb2.Plan(stages=[types_pb2.Stage(cluster="virginia", first_layer=0, last_layer=half - 1, tp=1, dp=1),
                                  types_pb2.Stage(cluster="ohio", first_layer=half, last_layer=layers - 1, tp=1,
                                                  dp=1)], micro_batches=2)


@st.composite
def valid_request(draw: st.DrawFn, rpc: str) -> Message:
    """A request of ``rpc`` that is well formed (it may still fail: an unknown job, no registration)."""
    job_ids = st.sampled_from(["fz-1", "fz-2", "nope"])
    topo = convert.topology_to_proto(_TOPOLOGY)
    if rpc == "Scheduler/SubmitJob":
        return scheduler_pb2.SubmitJobRequest(request_id=f"rq-{draw(st.integers(0, 50))}", job=draw(valid_job()),
                                              policy=draw(st.sampled_from(["", "spinsearch", "firstfit"])))
    if rpc == "Scheduler/GetJob":
        return scheduler_pb2.GetJobRequest(job_id=draw(job_ids))
    if rpc == "Scheduler/ListJobs":
        # no token, an old offset, cursors ([0.0, "alice~j1"] and [1e18, "x"]), and anything
        page_tokens = st.sampled_from(["", "1", "WzAuMCwgImFsaWNlfmoxIl0=", "WzFlKzE4LCAieCJd"]) | st.text(max_size=40)
        return scheduler_pb2.ListJobsRequest(page_size=draw(st.integers(0, 5)), tenant=draw(st.sampled_from(
            ["", "alice"])), page_token=draw(page_tokens))
    if rpc == "Scheduler/WatchJob":
        return scheduler_pb2.WatchJobRequest(job_id=draw(job_ids), from_revision=draw(st.integers(0, 10)))
    if rpc == "Scheduler/CancelJob":
        return scheduler_pb2.CancelJobRequest(job_id=draw(job_ids), reason="fuzz")
    if rpc == "Scheduler/ReportProgress":
        return scheduler_pb2.ReportProgressRequest(job_id=draw(job_ids), cluster="virginia", attempt=1,
                                                   progress=[types_pb2.ProgressEvent(step=1, steps_total=5)])
    if rpc == "Scheduler/GetJobLogs":
        return scheduler_pb2.GetJobLogsRequest(
            job_id=draw(job_ids), attempt=draw(st.integers(0, 2)), cluster=draw(st.sampled_from(["", "fz", "other"])),
            rank=draw(st.integers(-1, 1)), follow=draw(st.booleans()),
            stream=draw(st.sampled_from(["", "stdout", "stderr"])))
    if rpc == "Scheduler/GetJobMetrics":
        return scheduler_pb2.GetJobMetricsRequest(job_id=draw(job_ids), limit=draw(st.integers(0, 3)))
    if rpc == "Scheduler/DeleteJob":
        return scheduler_pb2.DeleteJobRequest(job_id=draw(job_ids))
    if rpc == "Planner/Plan":
        req = planner_pb2.PlanRequest(topology=topo, job=draw(valid_job()),
                                      budget=types_pb2.Budget(time_limit_s=0.2))
        if draw(st.booleans()):
            req.chain.clusters.extend(draw(st.permutations(["virginia", "ohio", "oregon"]))[:2])
        else:
            req.policy = draw(st.sampled_from(["spinsearch", "firstfit", "bace"]))
        return req
    if rpc == "Planner/Estimate":
        job = draw(valid_job())
        return planner_pb2.EstimateRequest(topology=topo, job=job, plan=_plan_proto(job))
    if rpc == "Topology/ReportProfile":
        return topology_pb2.ReportProfileRequest(
            agent_id="fz-agent", agent_address="127.0.0.1:1",
            cluster=types_pb2.Cluster(name="fz", gpu="A100-80G", nodes=1, gpus_per_node=8, free_gpus=4))
    if rpc == "Topology/ReportLinks":
        return topology_pb2.ReportLinksRequest(cluster="fz", agent_id="fz-agent", measurements=[
            topology_pb2.LinkMeasurement(target="fz2", bandwidth_gbps=10.0, latency_ms=5.0, probe_bytes=1 << 20,
                                         rtt_samples=3)])
    if rpc == "Topology/GetTopology":
        return topology_pb2.GetTopologyRequest()
    if rpc == "Topology/WatchTopology":
        return topology_pb2.WatchTopologyRequest()
    if rpc == "Agent/ProbeEcho":
        return agent_pb2.ProbeEchoRequest(payload=draw(st.binary(max_size=64)), sequence=draw(st.integers(0, 9)))
    if rpc == "Agent/ProbeDownload":
        return agent_pb2.ProbeDownloadRequest(total_bytes=draw(st.integers(1, 1 << 16)),
                                              chunk_bytes=draw(st.integers(0, 1 << 14)))
    if rpc == "Agent/GetStatus":
        return agent_pb2.GetStatusRequest()
    if rpc == "Agent/ReadLogs":
        offsets = draw(st.lists(st.builds(
            agent_pb2.ReadLogsOffset, attempt=st.integers(0, 2), rank=st.integers(-1, 1),
            stream=st.sampled_from(["stdout", "stderr", ""]), offset=st.integers(0, 4000)), max_size=3))
        return agent_pb2.ReadLogsRequest(job_id=draw(st.sampled_from(["fz-1", "fz-2", "nope"])),
                                         attempt=draw(st.integers(0, 2)), rank=draw(st.integers(-1, 1)),
                                         follow=draw(st.booleans()), stream=draw(st.sampled_from(["", "stdout",
                                                                                                  "stderr"])),
                                         offsets=offsets)
    if rpc.startswith("Control/"):
        return _control_request(draw, rpc)
    raise KeyError(rpc)


def _control_request(draw: st.DrawFn, rpc: str) -> Message:
    """A well-formed call of the agents' Control API by cluster ``fz`` (keys it may and may not touch)."""
    key = draw(st.sampled_from([keys.cluster_key("fz"), keys.cluster_key("other"), keys.CLUSTERS,
                                keys.assignments_prefix("fz"), keys.rendezvous_key("fz-1", 1),
                                keys.checkpoint_key("fz-1"), keys.profile_key("fz"), keys.job_key("fz-1"),
                                keys.ROOT]))
    cluster = draw(st.sampled_from(["fz", "fz", "other"]))
    lease = draw(st.integers(0, 1 << 40))
    if rpc == "Control/Get":
        return control_pb2.GetRequest(cluster=cluster, key=key)
    if rpc == "Control/List":
        return control_pb2.ListRequest(cluster=cluster, prefix=key)
    if rpc == "Control/Revision":
        return control_pb2.RevisionRequest(cluster=cluster)
    if rpc == "Control/Put":
        value = draw(st.sampled_from([
            Registration(cluster="fz", agent_id="fz-agent", principal="fz-agent", address="127.0.0.1:1").encode(),
            b'{"step": 1, "attempt": 1, "cluster": "fz"}', b"{}", b"\xff"]))
        return control_pb2.PutRequest(cluster=cluster, key=key, value=value, lease=lease, compare=draw(st.booleans()),
                                      expected_mod_revision=draw(st.integers(0, 50)))
    if rpc == "Control/Delete":
        return control_pb2.DeleteRequest(cluster=cluster, key=key)
    if rpc == "Control/Watch":
        return control_pb2.WatchRequest(cluster=cluster, prefix=key, start_revision=draw(st.integers(0, 50)))
    if rpc == "Control/GrantLease":
        return control_pb2.GrantLeaseRequest(cluster=cluster, ttl=draw(st.integers(0, 7200)))
    if rpc == "Control/KeepAlive":
        return control_pb2.KeepAliveRequest(cluster=cluster, lease=lease)
    if rpc == "Control/RevokeLease":
        return control_pb2.RevokeLeaseRequest(cluster=cluster, lease=lease)
    raise KeyError(rpc)


@st.composite
def mutated(draw: st.DrawFn, base: Message) -> Message:
    """``base`` with one to three fields (at any depth, chosen at random) replaced by structural values
    or cleared."""
    msg = type(base)()
    msg.CopyFrom(base)
    for _ in range(draw(st.integers(1, 3))):
        target: Message = msg
        for _depth in range(3):  # walk into a set sub-message sometimes
            subs = [f for f in target.DESCRIPTOR.fields if f.type == _F.TYPE_MESSAGE
                    and not f.is_repeated and target.HasField(f.name)]
            if not subs or not draw(st.booleans()):
                break
            target = getattr(target, draw(st.sampled_from(subs)).name)
        if not target.DESCRIPTOR.fields:
            break
        field = draw(st.sampled_from(list(target.DESCRIPTOR.fields)))
        if draw(st.integers(0, 4)) == 0:
            target.ClearField(field.name)
            continue
        if field.is_repeated:
            if field.type == _F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                target.ClearField(field.name)
                continue
            items = draw(st.lists(_value(field, 2), max_size=3))
            target.ClearField(field.name)
            getattr(target, field.name).extend(items)
        elif field.type == _F.TYPE_MESSAGE:
            getattr(target, field.name).CopyFrom(draw(message(field.message_type, 2)))
        else:
            setattr(target, field.name, draw(_value(field, 2)))
    return msg


RPCS: dict[str, type[Message]] = {
    "Scheduler/SubmitJob": scheduler_pb2.SubmitJobRequest,
    "Scheduler/GetJob": scheduler_pb2.GetJobRequest,
    "Scheduler/ListJobs": scheduler_pb2.ListJobsRequest,
    "Scheduler/WatchJob": scheduler_pb2.WatchJobRequest,
    "Scheduler/CancelJob": scheduler_pb2.CancelJobRequest,
    "Scheduler/ReportProgress": scheduler_pb2.ReportProgressRequest,
    "Scheduler/GetJobLogs": scheduler_pb2.GetJobLogsRequest,
    "Scheduler/GetJobMetrics": scheduler_pb2.GetJobMetricsRequest,
    "Scheduler/DeleteJob": scheduler_pb2.DeleteJobRequest,
    "Planner/Plan": planner_pb2.PlanRequest,
    "Planner/Estimate": planner_pb2.EstimateRequest,
    "Topology/ReportProfile": topology_pb2.ReportProfileRequest,
    "Topology/ReportLinks": topology_pb2.ReportLinksRequest,
    "Topology/GetTopology": topology_pb2.GetTopologyRequest,
    "Topology/WatchTopology": topology_pb2.WatchTopologyRequest,
    "Agent/ProbeEcho": agent_pb2.ProbeEchoRequest,
    "Agent/ProbeDownload": agent_pb2.ProbeDownloadRequest,
    "Agent/GetStatus": agent_pb2.GetStatusRequest,
    "Agent/ReadLogs": agent_pb2.ReadLogsRequest,
    "Control/Get": control_pb2.GetRequest,
    "Control/List": control_pb2.ListRequest,
    "Control/Revision": control_pb2.RevisionRequest,
    "Control/Put": control_pb2.PutRequest,
    "Control/Delete": control_pb2.DeleteRequest,
    "Control/Watch": control_pb2.WatchRequest,
    "Control/GrantLease": control_pb2.GrantLeaseRequest,
    "Control/KeepAlive": control_pb2.KeepAliveRequest,
    "Control/RevokeLease": control_pb2.RevokeLeaseRequest,
}
"""Every RPC (``Service/Method``) and its request type."""


def requests(rpc: str) -> st.SearchStrategy[Message]:
    """Requests of ``rpc``: structural, well formed, and well formed with mutations."""
    return st.one_of(message(RPCS[rpc].DESCRIPTOR), valid_request(rpc), valid_request(rpc).flatmap(mutated))


# ------------------------------------------------------------------------------------------ file formats

json_leaf = st.one_of(st.none(), st.booleans(), ints64, floats, text)
json_values = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                              st.dictionaries(text, inner, max_size=4)),
                           max_leaves=20)


@st.composite
def _near_valid_topology(draw: st.DrawFn) -> Any:
    from spiderflow.formats import topology_to_dict

    doc: Any = topology_to_dict(_TOPOLOGY)
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(["clusters", "links"]))
        rows = doc.get(section) or []
        if not rows:
            continue
        row = rows[draw(st.integers(0, len(rows) - 1))]
        key = draw(st.sampled_from([*sorted(row), "extra"]))
        row[key] = draw(json_values)
    return doc


@st.composite
def _near_valid_trace(draw: st.DrawFn) -> Any:
    job = {"id": "j1", "model": "gpt-tiny", "global_batch": 8, "seq_len": 64, "steps": 3,
           "gpus": {"min": 1, "max": 2}, "tenant": "t", "arrival_s": 0.0}
    for _ in range(draw(st.integers(1, 3))):
        job[draw(st.sampled_from([*sorted(job), "micro_batch", "priority", "extra"]))] = draw(json_values)
    return {"jobs": [job]}


def documents(kind: str) -> st.SearchStrategy[Any]:
    """Parsed JSON/YAML documents for a loader: arbitrary JSON values and near-valid ``kind`` files
    (``topology`` or ``trace``)."""
    near = _near_valid_topology() if kind == "topology" else _near_valid_trace()
    return st.one_of(json_values, near)
