"""The pure codecs of the topology, trace, job and plan documents: parsed JSON/YAML values (dicts, lists,
scalars) to domain objects and back, with validation.

Reading and parsing files is the adapter's (:mod:`spiderflow.formats`, which re-exports everything here);
this module reads nothing, so the scheduler, the simulator and the stored-records module decode the same way.

Topology::

    {"clusters": [{"name": "virginia", "gpu": "A100-80G", "nodes": 2, "gpus_per_node": 8,
                   "intra_node_gbps": 2400, "inter_node_gbps": 200,
                   "electricity_usd_per_kwh": 0.08, "free_gpus": 16}],
     "links": [{"a": "virginia", "b": "ohio", "bandwidth_gbps": 1.12, "latency_ms": 11}]}

Trace::

    {"jobs": [{"id": "j1", "model": "gpt3-6.7b", "global_batch": 512, "micro_batch": 1, "seq_len": 2048,
               "steps": 1000, "gpus": {"min": 8, "max": 64}, "arrival_s": 0, "priority": 0, "tenant": "a"}]}

An optional top-level ``"source"`` string cites where measured figures come from (bundled presets); it
is informational and not part of the :class:`~spiderflow.core.domain.Topology`.

``model`` is a preset name, a Hugging Face ``config.json`` path, or an object (see
:func:`model_from_value`); ``data`` and ``optimizer`` are optional objects (:func:`data_from_value`,
:func:`optimizer_from_value`)::

    "data": {"kind": "corpus", "path": "/data/*.jsonl", "tokenizer": "/data/tokenizer.json"},
    "optimizer": {"lr": 3e-4, "warmup_steps": 100, "schedule": "cosine", "weight_decay": 0.1,
                  "betas": [0.9, 0.95], "grad_clip": 1.0}

``constraints`` (optional, :func:`constraints_from_value`) says where the job may run::

    "constraints": {"gpu_types": ["A100", "H100-80G"], "exclude_clusters": ["ohio"], "regions": ["us-east"]}

Every rejection is a :class:`~spiderflow.core.errors.ValidationError` whose ``field`` is the dotted path of the
offending value (``clusters[2].gpu``), so callers can print one line that names the field and value.
Unknown keys are rejected too: a misspelt optional field must not be silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from spiderflow.core.catalog import MeasuredCost, ModelSpec, model_preset
from spiderflow.core.domain import (
    Cluster,
    Constraints,
    DataSpec,
    GpuRange,
    JobSpec,
    Link,
    OptimizerSpec,
    Plan,
    ReplicaShare,
    Schedule,
    Stage,
    Topology,
)
from spiderflow.core.errors import ValidationError

__all__ = [
    "HfConfigReader",
    "constraints_from_value",
    "constraints_to_dict",
    "data_from_value",
    "data_to_dict",
    "job_from_dict",
    "job_to_dict",
    "model_from_value",
    "model_to_value",
    "optimizer_from_value",
    "optimizer_to_dict",
    "plan_from_dict",
    "plan_to_dict",
    "topology_from_dict",
    "topology_to_dict",
    "trace_from_dict",
    "trace_to_dict",
]

HfConfigReader = Callable[[str, str, str], ModelSpec]
"""Reads a Hugging Face ``config.json`` into a model: ``(path, field, name) -> ModelSpec``, raising a
:class:`~spiderflow.core.errors.ValidationError` that names ``field``. The codec never reads a file itself;
the adapter :mod:`spiderflow.formats` passes one that does (:func:`spiderflow.hfconfig.load_hf_config`)."""

_CLUSTER_FIELDS = {
    "name": str, "gpu": str, "nodes": int, "gpus_per_node": int, "intra_node_gbps": float,
    "inter_node_gbps": float, "electricity_usd_per_kwh": float, "free_gpus": int, "tflops": float,
    "mfu": float, "memory_gib": float, "layer_overhead_ms": float,
    "optimizer_ms_per_layer": float, "region": str, "lat": float, "lon": float,
}
_LINK_FIELDS = {"a": str, "b": str, "bandwidth_gbps": float, "latency_ms": float, "directed": bool}
_JOB_FIELDS = {
    "id": str, "model": object, "global_batch": int, "micro_batch": int, "seq_len": int, "steps": int,
    "gpus": dict, "arrival_s": float, "priority": int, "tenant": str, "precision": str, "data": dict,
    "optimizer": dict, "constraints": dict, "checkpoint_every": int,
}
_MODEL_FIELDS = {
    "name": str, "layers": int, "hidden": int, "heads": int, "vocab": int, "family": str, "kv_heads": int,
    "ffn_hidden": int, "qkv_bias": bool, "tie_embeddings": bool, "rope_theta": float, "rotary_pct": float,
    "norm_eps": float, "max_positions": int, "parallel_residual": bool, "hf_config": str, "weights": str,
    "save_to": str, "entry_point": str, "measured": dict,
}
_MEASURED_FIELDS = {"embed_params": int, "layer_params": int, "head_params": int, "layer_flops_per_token": float,
                    "seq_len": int}
_PATH_KEYS = ("weights", "save_to")
_DATA_FIELDS = {"kind": str, "path": str, "dtype": str, "tokenizer": str, "text_field": str, "cache_dir": str,
                "seed": int}
_OPTIMIZER_FIELDS = {"lr": float, "warmup_steps": int, "schedule": str, "min_lr_ratio": float,
                     "decay_steps": int, "weight_decay": float, "betas": list, "eps": float, "grad_clip": float}


def _check_type(where: str, value: Any, kind: type) -> Any:
    if kind is object:
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValidationError(where, "must be a number", value)
        if math.isnan(value) or math.isinf(value):
            raise ValidationError(where, "must be finite", value)
        return float(value)
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValidationError(where, "must be an integer", value)
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValidationError(where, "must be true or false", value)
        return value
    if not isinstance(value, kind):
        raise ValidationError(where, f"must be a {kind.__name__}", value)
    return value


def _fields(where: str, raw: Any, spec: Mapping[str, type], required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValidationError(where, "must be an object", raw)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in spec:
            raise ValidationError(f"{where}.{key}" if where else str(key), "unknown field", value)
        if value is None and key not in required:
            continue
        out[key] = _check_type(f"{where}.{key}" if where else key, value, spec[key])
    for key in required:
        if key not in out:
            raise ValidationError(f"{where}.{key}" if where else key, "is required")
    return out


def _rebase(e: ValidationError, prefix: str, local: str) -> ValidationError:
    """Re-express an error raised by a dataclass (``clusters[name].gpu``) with the file's path."""
    suffix = e.field.split(".", 1)[1] if "." in e.field else e.field
    return ValidationError(f"{prefix}.{suffix}" if local else prefix, e.reason, e.value)


def topology_from_dict(raw: Any) -> Topology:
    """Build a :class:`Topology` from the parsed file format."""
    doc = _fields("", raw, {"clusters": list, "links": list, "revision": int, "source": str}, ("clusters",))
    clusters = []
    for i, c in enumerate(doc["clusters"]):
        where = f"clusters[{i}]"
        fields = _fields(where, c, _CLUSTER_FIELDS, ("name", "gpu", "nodes", "gpus_per_node"))
        try:
            clusters.append(Cluster(**fields))
        except ValidationError as e:
            raise _rebase(e, where, "x") from None
    if not clusters:
        raise ValidationError("clusters", "must list at least one cluster", [])
    links = []
    for i, link in enumerate(doc.get("links", [])):
        where = f"links[{i}]"
        fields = _fields(where, link, _LINK_FIELDS, ("a", "b", "bandwidth_gbps", "latency_ms"))
        try:
            links.append(Link(**fields))
        except ValidationError as e:
            raise _rebase(e, where, "x") from None
    return Topology(clusters=tuple(clusters), links=tuple(links), revision=doc.get("revision", 0))


def topology_to_dict(topo: Topology) -> dict[str, Any]:
    """The file format of ``topo`` (defaults omitted where they equal the implicit ones)."""
    clusters = []
    for c in topo.clusters:
        d: dict[str, Any] = {
            "name": c.name, "gpu": c.gpu, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
            "intra_node_gbps": c.intra_node_gbps, "inter_node_gbps": c.inter_node_gbps,
            "electricity_usd_per_kwh": c.electricity_usd_per_kwh, "free_gpus": c.free,
        }
        for opt in ("tflops", "mfu", "memory_gib", "lat", "lon"):
            if getattr(c, opt) is not None:
                d[opt] = getattr(c, opt)
        for calibrated in ("layer_overhead_ms", "optimizer_ms_per_layer"):
            if getattr(c, calibrated):
                d[calibrated] = getattr(c, calibrated)
        if c.region:
            d["region"] = c.region
        clusters.append(d)
    links = []
    for link in topo.links:
        ld: dict[str, Any] = {"a": link.a, "b": link.b, "bandwidth_gbps": link.bandwidth_gbps,
                              "latency_ms": link.latency_ms}
        if link.directed:
            ld["directed"] = True
        links.append(ld)
    return {"clusters": clusters, "links": links}


def model_from_value(value: Any, *, field: str = "model", hf_config: HfConfigReader | None = None) -> ModelSpec:
    """A model from the job format.

    - a preset name (``"llama3-8b"``), or a path to a Hugging Face ``config.json`` (a string ending in
      ``.json``);
    - an inline object: ``{"layers", "hidden", "heads", "vocab"}`` plus optional architecture keys
      (``family``, ``kv_heads``, ``ffn_hidden``, ... — the fields of :class:`~spiderflow.core.catalog.ModelSpec`);
    - ``{"hf_config": PATH}`` (read here), optionally with ``weights`` (initial safetensors weights) and
      ``save_to`` (where trained weights are written);
    - ``{"name": PRESET, "weights": ..., "save_to": ...}``: a preset with weights;
    - ``{"family": "custom", "entry_point": "pkg.mod:fn", "layers", "hidden", "vocab", "measured": {...}}``
      (the CLI and SDK fill ``measured`` by building the model on the meta device).

    A ``config.json`` path is read by ``hf_config`` (:data:`HfConfigReader`); without one it is refused
    (``field`` named): the codec reads no files.
    """
    if isinstance(value, str):
        if value.endswith(".json"):
            return _read_hf(hf_config, value, field, "")
        return model_preset(value, field=field)
    fields = _fields(field, value, _MODEL_FIELDS, ())
    extra = {k: fields.pop(k) for k in _PATH_KEYS if k in fields}
    if "layers" not in fields and "hf_config" in fields:
        base = _read_hf(hf_config, fields.pop("hf_config"), f"{field}.hf_config", fields.pop("name", ""))
        if fields:
            raise ValidationError(f"{field}.{next(iter(fields))}", "cannot be combined with hf_config", None)
        return _replace_model(base, extra, field)
    if "layers" not in fields and "entry_point" not in fields and isinstance(fields.get("name"), str):
        base = model_preset(fields.pop("name"), field=f"{field}.name")
        if fields:
            raise ValidationError(f"{field}.{next(iter(fields))}", "cannot be combined with a preset name", None)
        return _replace_model(base, extra, field)
    for key in ("layers", "hidden", "heads", "vocab"):
        if key not in fields and not (key == "heads" and fields.get("family") == "custom"):
            raise ValidationError(f"{field}.{key}", "is required")
    if fields.get("family") == "custom":
        fields.setdefault("heads", 1)
    if "measured" in fields:
        m = _fields(f"{field}.measured", fields["measured"], _MEASURED_FIELDS, tuple(_MEASURED_FIELDS))
        try:
            fields["measured"] = MeasuredCost(**m)
        except ValidationError as e:
            raise _rebase(e, f"{field}.measured", "x") from None
    fields.setdefault("name", "custom")
    try:
        return ModelSpec(**fields, **extra)
    except ValidationError as e:
        raise _rebase(e, field, "x") from None


def _read_hf(reader: HfConfigReader | None, path: str, field: str, name: str) -> ModelSpec:
    if reader is None:
        raise ValidationError(field, "a config.json path cannot be read here (give the model inline or by preset)",
                              path)
    return reader(path, field, name)


def _replace_model(base: ModelSpec, extra: dict[str, Any], field: str) -> ModelSpec:
    try:
        return dataclasses.replace(base, **extra)
    except ValidationError as e:
        raise _rebase(e, field, "x") from None


def model_to_value(model: ModelSpec) -> str | dict[str, Any]:
    """The job-format value of ``model``: its preset name when it is exactly a preset, else the inline
    object with every field that differs from the default (architecture fully resolved, so readers never
    need the original ``config.json``)."""
    from spiderflow.core.catalog import MODEL_PRESETS

    if MODEL_PRESETS.get(model.name) == model:
        return model.name
    out: dict[str, Any] = {}
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSpec)}
    for f in dataclasses.fields(ModelSpec):
        v = getattr(model, f.name)
        if f.name in ("layers", "hidden", "heads", "vocab") or v != defaults[f.name]:
            if f.name == "measured" and v is not None:
                v = dataclasses.asdict(v)
            out[f.name] = v.value if f.name == "family" else v
    if out.get("name") == "custom":  # the name an unnamed inline model gets back
        out.pop("name")
    if out.get("kv_heads") == model.heads:
        out.pop("kv_heads")
    if model.family.value != "llama" and out.get("ffn_hidden") == 4 * model.hidden:
        out.pop("ffn_hidden")
    return out


def data_from_value(raw: Any, *, field: str = "data") -> DataSpec:
    """A job's ``data`` object (:class:`~spiderflow.core.domain.DataSpec`)."""
    fields = _fields(field, raw, _DATA_FIELDS, ())
    try:
        return DataSpec(**fields)
    except ValidationError as e:
        raise _rebase(e, field, "x") from None


def data_to_dict(data: DataSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": data.kind.value}
    default = DataSpec()
    for key in ("path", "dtype", "tokenizer", "text_field", "cache_dir", "seed"):
        v = getattr(data, key)
        if v != getattr(default, key):
            out[key] = v
    return out


def optimizer_from_value(raw: Any, *, field: str = "optimizer") -> OptimizerSpec:
    """A job's ``optimizer`` object (:class:`~spiderflow.core.domain.OptimizerSpec`)."""
    fields = _fields(field, raw, _OPTIMIZER_FIELDS, ())
    if "betas" in fields:
        betas = fields["betas"]
        if len(betas) != 2:
            raise ValidationError(f"{field}.betas", "needs two numbers", betas)
        fields["betas"] = tuple(_check_type(f"{field}.betas[{i}]", b, float) for i, b in enumerate(betas))
    try:
        return OptimizerSpec(**fields)
    except ValidationError as e:
        raise _rebase(e, field, "x") from None


def optimizer_to_dict(opt: OptimizerSpec) -> dict[str, Any]:
    default = OptimizerSpec()
    out: dict[str, Any] = {}
    for key in _OPTIMIZER_FIELDS:
        v = getattr(opt, key)
        if v != getattr(default, key):
            out[key] = list(v) if key == "betas" else (v.value if key == "schedule" else v)
    return out


def job_from_dict(raw: Any, *, where: str = "", hf_config: HfConfigReader | None = None) -> JobSpec:
    """Build a :class:`JobSpec` from a trace job object. ``where`` prefixes error fields (``jobs[3]``);
    ``hf_config`` reads a model given as a ``config.json`` path (:func:`model_from_value`)."""
    pre = f"{where}." if where else ""
    fields = _fields(where, raw, _JOB_FIELDS, ("id", "model", "global_batch", "gpus"))
    fields["model"] = model_from_value(fields["model"], field=f"{pre}model", hf_config=hf_config)
    if "data" in fields:
        fields["data"] = data_from_value(fields["data"], field=f"{pre}data")
    if "optimizer" in fields:
        fields["optimizer"] = optimizer_from_value(fields["optimizer"], field=f"{pre}optimizer")
    if "constraints" in fields:
        fields["constraints"] = constraints_from_value(fields["constraints"], field=f"{pre}constraints")
    g = _fields(f"{pre}gpus", fields["gpus"], {"min": int, "max": int}, ("min", "max"))
    try:
        fields["gpus"] = GpuRange(**g)
        return JobSpec(**fields)
    except ValidationError as e:
        raise ValidationError(f"{pre}{e.field}", e.reason, e.value) from None


def job_to_dict(job: JobSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": job.id, "model": model_to_value(job.model), "global_batch": job.global_batch,
        "micro_batch": job.micro_batch, "seq_len": job.seq_len, "steps": job.steps,
        "gpus": {"min": job.gpus.min, "max": job.gpus.max}, "arrival_s": job.arrival_s, "priority": job.priority,
        "tenant": job.tenant, "precision": job.precision.value,
    }
    if job.data != DataSpec():
        out["data"] = data_to_dict(job.data)
    if job.optimizer != OptimizerSpec():
        out["optimizer"] = optimizer_to_dict(job.optimizer)
    if not job.constraints.empty:
        out["constraints"] = constraints_to_dict(job.constraints)
    if job.checkpoint_every is not None:
        out["checkpoint_every"] = job.checkpoint_every
    return out


_CONSTRAINT_FIELDS = {"gpu_types": list, "clusters": list, "exclude_clusters": list, "regions": list,
                      "exclude_regions": list}


def constraints_from_value(raw: Any, *, field: str = "constraints") -> Constraints:
    """A job's ``constraints`` object (:class:`~spiderflow.core.domain.Constraints`): lists of names under
    ``gpu_types``, ``clusters``, ``exclude_clusters``, ``regions``, ``exclude_regions`` (each optional)."""
    fields = _fields(field, raw, _CONSTRAINT_FIELDS, ())
    try:
        return Constraints(**fields)
    except ValidationError as e:
        raise _rebase(e, field, "x") from None


def constraints_to_dict(c: Constraints) -> dict[str, Any]:
    """The non-empty fields of ``c`` as lists."""
    return {k: list(getattr(c, k)) for k in _CONSTRAINT_FIELDS if getattr(c, k)}


def trace_from_dict(raw: Any, *, hf_config: HfConfigReader | None = None) -> list[JobSpec]:
    """The jobs of a trace document (``{"jobs": [...]}``; ids unique)."""
    doc = _fields("", raw, {"jobs": list}, ("jobs",))
    jobs = [job_from_dict(j, where=f"jobs[{i}]", hf_config=hf_config) for i, j in enumerate(doc["jobs"])]
    seen: set[str] = set()
    for i, j in enumerate(jobs):
        if j.id in seen:
            raise ValidationError(f"jobs[{i}].id", "duplicate job id", j.id)
        seen.add(j.id)
    return jobs


def trace_to_dict(jobs: list[JobSpec]) -> dict[str, Any]:
    return {"jobs": [job_to_dict(j) for j in jobs]}


# ---------------------------------------------------------------------------------------------------- plans

_STAGE_FIELDS = {"cluster": str, "first_layer": int, "last_layer": int, "gpus": int, "tp": int, "dp": int,
                 "sharding": str, "recompute": bool, "replicas": list}
_PLAN_FIELDS = {"stages": list, "micro_batches": int, "schedule": str, "step_time_s": float,
                "throughput_tokens_per_s": float, "memory_gib_per_gpu": list, "usd_per_step": float, "extras": dict}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The JSON object of ``plan`` (stored in job records and assignments, printed by ``plan --json``, read back
    by :func:`plan_from_dict`)."""
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


def plan_from_dict(raw: Any, *, where: str = "plan", strict: bool = True) -> Plan:
    """The :class:`Plan` of a :func:`plan_to_dict` object; :class:`ValidationError` naming the field
    (``plan.stages[1].tp``) otherwise. A stage needs ``cluster``, ``first_layer`` and ``last_layer``; ``tp``
    defaults to 1 and ``dp`` to ``gpus / tp`` (1 without ``gpus``); ``schedule`` defaults to 1F1B. Unknown
    fields are refused, unless ``strict`` is False (a larger document holding a plan, such as ``spiderflow plan
    --json``'s: its other fields are ignored)."""
    if not strict and isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if k in _PLAN_FIELDS}
        if isinstance(raw.get("stages"), list):
            raw["stages"] = [{k: v for k, v in st.items() if k in _STAGE_FIELDS} if isinstance(st, dict) else st
                             for st in raw["stages"]]
    fields = _fields(where, raw, _PLAN_FIELDS, ("stages", "micro_batches"))
    if not fields["stages"]:
        raise ValidationError(f"{where}.stages", "must be a non-empty list", fields["stages"])
    stages: list[Stage] = []
    for i, s in enumerate(fields["stages"]):
        w = f"{where}.stages[{i}]"
        st = _fields(w, s, _STAGE_FIELDS, ("cluster", "first_layer", "last_layer"))
        if not st["cluster"]:
            raise ValidationError(f"{w}.cluster", "must be a cluster name", st["cluster"])
        tp = st.get("tp", 1)
        gpus = st.pop("gpus", None)
        if "dp" not in st:
            st["dp"] = gpus // tp if gpus is not None and tp > 0 and gpus % tp == 0 else 1
        replicas = []
        for k, r in enumerate(st.pop("replicas", [])):
            rf = _fields(f"{w}.replicas[{k}]", r, {"cluster": str, "dp": int}, ("cluster", "dp"))
            replicas.append(ReplicaShare(cluster=rf["cluster"], dp=rf["dp"]))
        try:
            stage = Stage(**st, replicas=tuple(replicas))
        except ValidationError as e:
            raise _rebase(e, w, e.field) from None
        if gpus is not None and gpus != stage.gpus:
            raise ValidationError(f"{w}.gpus", f"must equal tp × dp ({stage.gpus})", gpus)
        stages.append(stage)
    try:
        schedule = Schedule(fields.get("schedule", Schedule.ONE_F_ONE_B.value))
    except ValueError:
        raise ValidationError(f"{where}.schedule", f"must be one of {', '.join(v.value for v in Schedule)}",
                              fields.get("schedule")) from None
    memory = tuple(_check_type(f"{where}.memory_gib_per_gpu[{i}]", v, float)
                   for i, v in enumerate(fields.get("memory_gib_per_gpu", [])))
    extras = {str(k): _check_type(f"{where}.extras.{k}", v, float) for k, v in fields.get("extras", {}).items()}
    try:
        return Plan(stages=tuple(stages), micro_batches=fields["micro_batches"], schedule=schedule,
                    step_time_s=fields.get("step_time_s", 0.0),
                    throughput_tokens_per_s=fields.get("throughput_tokens_per_s", 0.0),
                    memory_gib_per_gpu=memory, usd_per_step=fields.get("usd_per_step", 0.0), extras=extras)
    except ValidationError as e:
        raise _rebase(e, where, e.field) from None
