"""Domain <-> proto converters for the shared types (``spiderflow.types.v1``) and the planner's replies.

Contract
--------
* ``*_to_proto(x)`` never fails for a valid domain object and writes every field, so
  ``*_from_proto(*_to_proto(x)) == x`` for every domain object ``x`` (the round-trip tests check it).
* ``*_from_proto(msg, field=...)`` validates exactly like the file loaders of :mod:`spiderflow.formats`
  (the message field names are the file keys) and raises :class:`~spiderflow.core.errors.ValidationError`
  whose ``field`` is the dotted path from ``field``, e.g. ``job.gpus.min``, ``topology.clusters[2].gpu``,
  ``plan.stages[1].first_layer``. An unknown model preset fails with ``job.model``.
* Proto3 presence: optional fields that are unset take the domain defaults; a field that is set is
  validated as given (an explicit ``steps: 0`` is rejected, not defaulted). Empty strings count as unset
  for ``JobSpec.tenant`` (default tenant) and as missing for required names (``job.id``).

The module is pure (no I/O, no grpc import); it only needs the generated message classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format, struct_pb2  # type: ignore[import-untyped]

from spiderflow.core.catalog import MODEL_PRESETS, ModelSpec
from spiderflow.core.domain import (
    Cluster,
    DataSpec,
    JobSpec,
    Link,
    OptimizerSpec,
    Plan,
    ReplicaShare,
    Schedule,
    Sharding,
    Stage,
    Topology,
)
from spiderflow.core.errors import ValidationError
from spiderflow.core.placement.base import Budget, Objective, PlacementResult, PlacementStatus
from spiderflow.formats import job_from_dict, model_from_value, model_to_value, topology_from_dict
from spiderflow.proto.planner.v1 import planner_pb2
from spiderflow.proto.types.v1 import types_pb2

__all__ = [
    "JOB_STATES",
    "budget_from_proto",
    "budget_to_proto",
    "cluster_from_proto",
    "cluster_to_proto",
    "job_from_proto",
    "job_state_from_proto",
    "job_state_to_proto",
    "job_to_proto",
    "link_from_proto",
    "link_to_proto",
    "max_in_flight_from_proto",
    "model_from_proto_value",
    "model_spec_from_proto",
    "model_spec_to_proto",
    "model_to_proto_value",
    "placement_result_from_proto",
    "placement_result_to_proto",
    "plan_from_proto",
    "plan_to_proto",
    "schedule_from_proto",
    "schedule_to_proto",
    "stage_from_proto",
    "stage_to_proto",
    "topology_from_proto",
    "topology_to_proto",
]

# ---------------------------------------------------------------------------------------------- helpers


def _join(prefix: str, path: str) -> str:
    if not prefix:
        return path
    return f"{prefix}.{path}" if path else prefix


def _rebased(e: ValidationError, prefix: str, *, drop_first: bool = False) -> ValidationError:
    """``e`` with its field re-rooted at ``prefix`` (optionally replacing its first path component)."""
    path = e.field
    if drop_first:
        path = path.split(".", 1)[1] if "." in path else ""
    return ValidationError(_join(prefix, path), e.reason, e.value)


def _present(msg: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The optional (presence-tracking) fields of ``msg`` that are set."""
    return {n: getattr(msg, n) for n in names if msg.HasField(n)}


def _enum_name(enum: Any, value: int) -> str:
    try:
        return str(enum.Name(value))
    except ValueError:
        return str(value)


# ---------------------------------------------------------------------------------------------- topology

_CLUSTER_OPTIONAL = (
    "intra_node_gbps", "inter_node_gbps", "electricity_usd_per_kwh", "free_gpus", "tflops", "mfu",
    "memory_gib", "lat", "lon", "layer_overhead_ms", "optimizer_ms_per_layer",
)


def _cluster_dict(msg: types_pb2.Cluster) -> dict[str, Any]:
    d: dict[str, Any] = {"name": msg.name, "gpu": msg.gpu, "nodes": msg.nodes, "gpus_per_node": msg.gpus_per_node}
    d.update(_present(msg, _CLUSTER_OPTIONAL))
    if msg.region:
        d["region"] = msg.region
    return d


def _link_dict(msg: types_pb2.Link) -> dict[str, Any]:
    return {"a": msg.a, "b": msg.b, "bandwidth_gbps": msg.bandwidth_gbps, "latency_ms": msg.latency_ms,
            "directed": msg.directed}


def cluster_to_proto(c: Cluster) -> types_pb2.Cluster:
    msg = types_pb2.Cluster(
        name=c.name, gpu=c.gpu, nodes=c.nodes, gpus_per_node=c.gpus_per_node,
        intra_node_gbps=c.intra_node_gbps, inter_node_gbps=c.inter_node_gbps,
        electricity_usd_per_kwh=c.electricity_usd_per_kwh, free_gpus=c.free, region=c.region,
    )
    for opt in ("tflops", "mfu", "memory_gib", "lat", "lon"):
        if getattr(c, opt) is not None:
            setattr(msg, opt, getattr(c, opt))
    for calibrated in ("layer_overhead_ms", "optimizer_ms_per_layer"):
        if getattr(c, calibrated):
            setattr(msg, calibrated, getattr(c, calibrated))
    return msg


def cluster_from_proto(msg: types_pb2.Cluster, *, field: str = "cluster") -> Cluster:
    """A validated :class:`Cluster`; errors name ``{field}.<key>`` (e.g. ``cluster.gpu``)."""
    try:
        topo = topology_from_dict({"clusters": [_cluster_dict(msg)]})
    except ValidationError as e:
        # The loader reports clusters[0].<key>; re-root it at ``field``.
        raise _rebased(e, field, drop_first=True) from None
    return topo.clusters[0]


def link_to_proto(link: Link) -> types_pb2.Link:
    return types_pb2.Link(a=link.a, b=link.b, bandwidth_gbps=link.bandwidth_gbps, latency_ms=link.latency_ms,
                          directed=link.directed)


def link_from_proto(msg: types_pb2.Link, *, field: str = "link") -> Link:
    """A validated :class:`Link` (its ends are not checked against a topology here)."""
    if not msg.a:
        raise ValidationError(_join(field, "a"), "is required")
    if not msg.b:
        raise ValidationError(_join(field, "b"), "is required")
    try:
        return Link(a=msg.a, b=msg.b, bandwidth_gbps=msg.bandwidth_gbps, latency_ms=msg.latency_ms,
                    directed=msg.directed)
    except ValidationError as e:
        raise _rebased(e, field, drop_first=True) from None


def topology_to_proto(topo: Topology) -> types_pb2.Topology:
    return types_pb2.Topology(
        clusters=[cluster_to_proto(c) for c in topo.clusters],
        links=[link_to_proto(link) for link in topo.links],
        revision=topo.revision,
    )


def topology_from_proto(msg: types_pb2.Topology, *, field: str = "topology") -> Topology:
    """A validated :class:`Topology`; errors name e.g. ``topology.clusters[1].gpu``, ``topology.links[0].b``."""
    doc = {
        "clusters": [_cluster_dict(c) for c in msg.clusters],
        "links": [_link_dict(link) for link in msg.links],
        "revision": msg.revision,
    }
    try:
        return topology_from_dict(doc)
    except ValidationError as e:
        raise _rebased(e, field) from None


# ---------------------------------------------------------------------------------------------- jobs


def model_to_proto_value(model: ModelSpec) -> struct_pb2.Value:
    """A preset name when ``model`` is exactly a preset, else the inline object of
    :func:`~spiderflow.formats.model_to_value` (with its name unless it is ``custom``)."""
    value = struct_pb2.Value()
    raw = model_to_value(model)
    if isinstance(raw, str):
        value.string_value = raw
        return value
    if raw.get("name") == "custom":
        raw.pop("name")
    value.struct_value.update(raw)
    return value


def _model_raw(value: struct_pb2.Value, field: str) -> str | dict[str, Any]:
    try:
        raw = json_format.MessageToDict(value)
    except ValueError as e:  # NaN/Infinity number values have no JSON form
        raise ValidationError(field, f"must be a preset name or an object {{layers, hidden, heads, vocab}}: {e}",
                              None) from None
    if not isinstance(raw, str | dict):
        raise ValidationError(field, "must be a preset name or an object {layers, hidden, heads, vocab}", raw)
    return raw


def model_from_proto_value(value: struct_pb2.Value, *, field: str = "model") -> ModelSpec:
    """A preset name string or an inline ``{layers, hidden, heads, vocab[, name]}`` object."""
    return model_from_value(_model_raw(value, field), field=field)


def model_spec_to_proto(model: ModelSpec) -> types_pb2.ModelSpec:
    return types_pb2.ModelSpec(name=model.name, layers=model.layers, hidden=model.hidden, heads=model.heads,
                               vocab=model.vocab)


def model_spec_from_proto(msg: types_pb2.ModelSpec, *, field: str = "model") -> ModelSpec:
    """The model a ``ModelSpec`` message names: a preset when the name and sizes are a preset's (the message
    carries no family fields), else an inline ``gpt`` model."""
    preset = MODEL_PRESETS.get(msg.name)
    if preset is not None and (preset.layers, preset.hidden, preset.heads, preset.vocab) == (
            msg.layers, msg.hidden, msg.heads, msg.vocab):
        return preset
    raw: dict[str, Any] = {"layers": msg.layers, "hidden": msg.hidden, "heads": msg.heads, "vocab": msg.vocab}
    if msg.name:
        raw["name"] = msg.name
    return model_from_value(raw, field=field)


_JOB_OPTIONAL = ("global_batch", "micro_batch", "seq_len", "steps", "arrival_s", "priority", "checkpoint_every")


_DATA_STRINGS = ("kind", "path", "dtype", "tokenizer", "text_field", "cache_dir")
_OPTIMIZER_OPTIONAL = ("lr", "warmup_steps", "min_lr_ratio", "decay_steps", "weight_decay", "eps", "grad_clip")


def data_to_proto(data: DataSpec) -> types_pb2.TrainingData:
    return types_pb2.TrainingData(kind=data.kind.value, path=data.path or "", dtype=data.dtype,
                                  tokenizer=data.tokenizer, text_field=data.text_field, cache_dir=data.cache_dir,
                                  seed=data.seed)


def _data_raw(msg: types_pb2.TrainingData) -> dict[str, Any]:
    raw: dict[str, Any] = {k: getattr(msg, k) for k in _DATA_STRINGS if getattr(msg, k)}
    raw.update(_present(msg, ("seed",)))
    return raw


def optimizer_to_proto(opt: OptimizerSpec) -> types_pb2.OptimizerConfig:
    return types_pb2.OptimizerConfig(
        lr=opt.lr, warmup_steps=opt.warmup_steps, schedule=opt.schedule.value, min_lr_ratio=opt.min_lr_ratio,
        decay_steps=opt.decay_steps, weight_decay=opt.weight_decay, betas=list(opt.betas), eps=opt.eps,
        grad_clip=opt.grad_clip,
    )


def _optimizer_raw(msg: types_pb2.OptimizerConfig) -> dict[str, Any]:
    raw: dict[str, Any] = _present(msg, _OPTIMIZER_OPTIONAL)
    if msg.schedule:
        raw["schedule"] = msg.schedule
    if msg.betas:
        raw["betas"] = list(msg.betas)
    return raw


_DEFAULT_DATA = DataSpec()
_DEFAULT_OPTIMIZER = OptimizerSpec()


def job_to_proto(job: JobSpec) -> types_pb2.JobSpec:
    msg = types_pb2.JobSpec(
        id=job.id, model=model_to_proto_value(job.model), global_batch=job.global_batch,
        micro_batch=job.micro_batch, seq_len=job.seq_len, steps=job.steps,
        gpus=types_pb2.GpuRange(min=job.gpus.min, max=job.gpus.max), arrival_s=job.arrival_s,
        priority=job.priority, tenant=job.tenant, precision=job.precision.value,
        checkpoint_every=job.checkpoint_every,
    )
    if job.data != _DEFAULT_DATA:
        msg.data.CopyFrom(data_to_proto(job.data))
    if job.optimizer != _DEFAULT_OPTIMIZER:
        msg.optimizer.CopyFrom(optimizer_to_proto(job.optimizer))
    if not job.constraints.empty:
        c = job.constraints
        msg.constraints.CopyFrom(types_pb2.ResourceConstraints(
            gpu_types=c.gpu_types, clusters=c.clusters, exclude_clusters=c.exclude_clusters, regions=c.regions,
            exclude_regions=c.exclude_regions))
    return msg


def job_from_proto(msg: types_pb2.JobSpec, *, field: str = "job") -> JobSpec:
    """A validated :class:`JobSpec`. Required: ``id``, ``model``, ``global_batch``, ``gpus.min``,
    ``gpus.max``; errors name ``{field}.<key>`` (``job.model``, ``job.gpus.min``, ``job.steps``)."""
    raw: dict[str, Any] = _present(msg, _JOB_OPTIONAL)
    if msg.id:
        raw["id"] = msg.id
    if msg.tenant:
        raw["tenant"] = msg.tenant
    if msg.precision:
        raw["precision"] = msg.precision
    if msg.HasField("model") and msg.model.WhichOneof("kind") not in (None, "null_value"):
        raw["model"] = _model_raw(msg.model, _join(field, "model"))
    if msg.HasField("gpus"):
        raw["gpus"] = _present(msg.gpus, ("min", "max"))
    if msg.HasField("data"):
        raw["data"] = _data_raw(msg.data)
    if msg.HasField("optimizer"):
        raw["optimizer"] = _optimizer_raw(msg.optimizer)
    if msg.HasField("constraints"):
        raw["constraints"] = {k: list(getattr(msg.constraints, k)) for k in
                              ("gpu_types", "clusters", "exclude_clusters", "regions", "exclude_regions")}
    return job_from_dict(raw, where=field)


# ---------------------------------------------------------------------------------------------- plans

_SCHEDULES: dict[Schedule, types_pb2.Schedule] = {
    Schedule.GPIPE: types_pb2.SCHEDULE_GPIPE,
    Schedule.ONE_F_ONE_B: types_pb2.SCHEDULE_ONE_F_ONE_B,
    Schedule.INTERLEAVED_1F1B: types_pb2.SCHEDULE_INTERLEAVED_1F1B,
    Schedule.LATENCY_AWARE: types_pb2.SCHEDULE_LATENCY_AWARE,
}
_SCHEDULES_BACK: dict[int, Schedule] = {int(v): k for k, v in _SCHEDULES.items()}


def schedule_to_proto(schedule: Schedule) -> types_pb2.Schedule:
    """The ``Schedule`` enum number of a domain schedule."""
    return _SCHEDULES[Schedule(schedule)]


def schedule_from_proto(
    value: int, *, field: str = "schedule", default: Schedule | None = Schedule.ONE_F_ONE_B
) -> Schedule:
    """The domain schedule; ``SCHEDULE_UNSPECIFIED`` gives ``default`` (an error when ``default`` is None)."""
    if value == types_pb2.SCHEDULE_UNSPECIFIED:
        if default is None:
            raise ValidationError(field, "must be set")
        return default
    try:
        return _SCHEDULES_BACK[value]
    except KeyError:
        raise ValidationError(field, "unknown schedule", _enum_name(types_pb2.Schedule, value)) from None


def stage_to_proto(stage: Stage) -> types_pb2.Stage:
    return types_pb2.Stage(cluster=stage.cluster, first_layer=stage.first_layer, last_layer=stage.last_layer,
                           tp=stage.tp, dp=stage.dp, sharding=stage.sharding.value, recompute=stage.recompute,
                           replicas=[types_pb2.ReplicaShare(cluster=r.cluster, dp=r.dp) for r in stage.replicas])


def stage_from_proto(msg: types_pb2.Stage, *, field: str = "stage") -> Stage:
    """A validated :class:`Stage`; ``tp``/``dp`` of 0 mean 1."""
    if not msg.cluster:
        raise ValidationError(_join(field, "cluster"), "is required")
    try:
        sharding = Sharding(msg.sharding or Sharding.REPLICATE)
    except ValueError:
        raise ValidationError(_join(field, "sharding"), f"must be one of {', '.join(v.value for v in Sharding)}",
                              msg.sharding) from None
    try:
        return Stage(cluster=msg.cluster, first_layer=msg.first_layer, last_layer=msg.last_layer,
                     tp=msg.tp or 1, dp=msg.dp or 1, sharding=sharding, recompute=msg.recompute,
                     replicas=tuple(ReplicaShare(cluster=r.cluster, dp=r.dp) for r in msg.replicas))
    except ValidationError as e:
        raise _rebased(e, field, drop_first=True) from None


def plan_to_proto(plan: Plan) -> types_pb2.Plan:
    return types_pb2.Plan(
        stages=[stage_to_proto(s) for s in plan.stages],
        micro_batches=plan.micro_batches,
        schedule=schedule_to_proto(plan.schedule),
        predictions=types_pb2.Predictions(
            step_time_s=plan.step_time_s,
            throughput_tokens_per_s=plan.throughput_tokens_per_s,
            memory_gib_per_gpu=list(plan.memory_gib_per_gpu),
            usd_per_step=plan.usd_per_step,
            extras=dict(plan.extras),
        ),
    )


def plan_from_proto(msg: types_pb2.Plan, *, field: str = "plan") -> Plan:
    """A validated :class:`Plan` with the message's predictions (zero when unset). Errors name e.g.
    ``plan.stages[1].first_layer`` or ``plan.micro_batches``; ``SCHEDULE_UNSPECIFIED`` means 1F1B."""
    stages = tuple(stage_from_proto(s, field=f"{field}.stages[{i}]") for i, s in enumerate(msg.stages))
    p = msg.predictions
    try:
        return Plan(
            stages=stages,
            micro_batches=msg.micro_batches,
            schedule=schedule_from_proto(msg.schedule, field=_join(field, "schedule")),
            step_time_s=p.step_time_s,
            throughput_tokens_per_s=p.throughput_tokens_per_s,
            memory_gib_per_gpu=tuple(p.memory_gib_per_gpu),
            usd_per_step=p.usd_per_step,
            extras=dict(p.extras),
        )
    except ValidationError as e:
        if e.field.startswith(field + "."):
            raise
        raise _rebased(e, field, drop_first=e.field.startswith("plan")) from None


# ---------------------------------------------------------------------------------------------- states

JOB_STATES: dict[str, types_pb2.JobState] = {
    "pending": types_pb2.JOB_STATE_PENDING,
    "placed": types_pb2.JOB_STATE_PLACED,
    "running": types_pb2.JOB_STATE_RUNNING,
    "rescheduling": types_pb2.JOB_STATE_RESCHEDULING,
    "succeeded": types_pb2.JOB_STATE_SUCCEEDED,
    "failed": types_pb2.JOB_STATE_FAILED,
    "cancelled": types_pb2.JOB_STATE_CANCELLED,
}
"""Job state names (lower case, as a domain ``StrEnum`` would spell them) -> ``JobState`` values."""
_JOB_STATES_BACK: dict[int, str] = {int(v): k for k, v in JOB_STATES.items()}


def job_state_to_proto(state: str) -> types_pb2.JobState:
    """``"running"`` (or a ``StrEnum`` member with that value) -> ``JOB_STATE_RUNNING``."""
    try:
        return JOB_STATES[str(state).lower()]
    except KeyError:
        raise ValidationError("state", f"unknown job state; known: {', '.join(JOB_STATES)}", state) from None


def job_state_from_proto(value: int, *, field: str = "state") -> str:
    """``JOB_STATE_RUNNING`` -> ``"running"``; UNSPECIFIED or an unknown number is a ValidationError."""
    try:
        return _JOB_STATES_BACK[value]
    except KeyError:
        raise ValidationError(field, "must be a job state", _enum_name(types_pb2.JobState, value)) from None


# ---------------------------------------------------------------------------------------------- planner

_OBJECTIVES: dict[Objective, types_pb2.Objective] = {
    Objective.JCT: types_pb2.OBJECTIVE_JCT,
    Objective.COST: types_pb2.OBJECTIVE_COST,
    Objective.BALANCED: types_pb2.OBJECTIVE_BALANCED,
}
_OBJECTIVES_BACK: dict[int, Objective] = {int(v): k for k, v in _OBJECTIVES.items()}


def budget_to_proto(budget: Budget) -> types_pb2.Budget:
    msg = types_pb2.Budget(seed=budget.seed, objective=_OBJECTIVES[budget.objective])
    if budget.time_limit_s is not None:
        msg.time_limit_s = budget.time_limit_s
    return msg


def budget_from_proto(msg: types_pb2.Budget, *, field: str = "budget") -> Budget:
    """A :class:`Budget`; unset time limit -> None, ``OBJECTIVE_UNSPECIFIED`` -> ``jct``."""
    limit: float | None = None
    if msg.HasField("time_limit_s"):
        limit = msg.time_limit_s
        if not limit > 0:
            raise ValidationError(_join(field, "time_limit_s"), "must be > 0", limit)
    if msg.objective == types_pb2.OBJECTIVE_UNSPECIFIED:
        objective = Objective.JCT
    else:
        try:
            objective = _OBJECTIVES_BACK[msg.objective]
        except KeyError:
            raise ValidationError(_join(field, "objective"), "unknown objective",
                                  _enum_name(types_pb2.Objective, msg.objective)) from None
    return Budget(time_limit_s=limit, seed=msg.seed, objective=objective)


def max_in_flight_from_proto(value: int, *, field: str = "max_in_flight") -> int | None:
    """A request's in-flight cap ``K``: 0 (unset) -> None (no cap), ``K ≥ 1`` as is; ValidationError
    naming ``field`` below 0."""
    if value < 0:
        raise ValidationError(field, "must be ≥ 0 (0: no cap)", value)
    return value or None


_STATUSES: dict[PlacementStatus, types_pb2.PlacementStatus] = {
    PlacementStatus.SUCCESS: types_pb2.PLACEMENT_STATUS_SUCCESS,
    PlacementStatus.UNSCHEDULABLE: types_pb2.PLACEMENT_STATUS_UNSCHEDULABLE,
    PlacementStatus.UNRESOLVABLE: types_pb2.PLACEMENT_STATUS_UNRESOLVABLE,
    PlacementStatus.ERROR: types_pb2.PLACEMENT_STATUS_ERROR,
}
_STATUSES_BACK: dict[int, PlacementStatus] = {int(v): k for k, v in _STATUSES.items()}


def allocation_to_proto(allocation: Sequence[tuple[str, int]]) -> planner_pb2.Allocation:
    """An ordered allocation ``((cluster, GPUs), ...)`` as the planner's ``Allocation``."""
    return planner_pb2.Allocation(clusters=[planner_pb2.ClusterGpus(cluster=c, gpus=g) for c, g in allocation])


def allocation_from_proto(msg: planner_pb2.Allocation, *, field: str = "allocation") -> list[tuple[str, int]]:
    """The ordered allocation; ``ValidationError`` naming ``allocation.clusters[i].field`` for an empty name,
    a GPU count < 1 or a repeated cluster, and ``allocation.clusters`` when it is empty."""
    if not msg.clusters:
        raise ValidationError(_join(field, "clusters"), "needs at least one (cluster, gpus) entry", [])
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for i, e in enumerate(msg.clusters):
        where = _join(field, f"clusters[{i}]")
        if not e.cluster:
            raise ValidationError(_join(where, "cluster"), "is required", e.cluster)
        if e.cluster in seen:
            raise ValidationError(_join(where, "cluster"), "a cluster may appear once", e.cluster)
        if e.gpus < 1:
            raise ValidationError(_join(where, "gpus"), "must be ≥ 1", e.gpus)
        seen.add(e.cluster)
        out.append((e.cluster, int(e.gpus)))
    return out


def placement_result_to_proto(result: PlacementResult) -> planner_pb2.PlanResponse:
    """A policy's answer; a wait (never the answer of a request without releases) travels as UNSCHEDULABLE
    with constraint ``wait``."""
    waits = result.status is PlacementStatus.WAIT
    msg = planner_pb2.PlanResponse(
        status=_STATUSES[PlacementStatus.UNSCHEDULABLE if waits else result.status], reason=result.reason,
        constraint="wait" if waits else result.constraint, policy=result.policy,
        planning_seconds=result.planning_seconds,
        stats=dict(result.stats),
    )
    if result.plan is not None:
        msg.plan.CopyFrom(plan_to_proto(result.plan))
    if result.optimal is not None:
        msg.optimal = result.optimal
    return msg


def placement_result_from_proto(msg: planner_pb2.PlanResponse, *, field: str = "response") -> PlacementResult:
    try:
        status = _STATUSES_BACK[msg.status]
    except KeyError:
        raise ValidationError(_join(field, "status"), "must be a placement status",
                              _enum_name(types_pb2.PlacementStatus, msg.status)) from None
    return PlacementResult(
        status=status,
        policy=msg.policy,
        plan=plan_from_proto(msg.plan, field=_join(field, "plan")) if msg.HasField("plan") else None,
        planning_seconds=msg.planning_seconds,
        optimal=msg.optimal if msg.HasField("optimal") else None,
        reason=msg.reason,
        constraint=msg.constraint,
        stats=dict(msg.stats),
    )
