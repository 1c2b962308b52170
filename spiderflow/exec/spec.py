"""What a training worker needs to run, as plain validated values (no torch: agents import this freely).

- :class:`TrainSpec`: model, plan, batch, steps, optimizer, data, checkpointing (one per job, identical on
  every rank);
- :class:`Rendezvous`: the ``torch.distributed`` TCPStore address and this process's rank;
- :class:`RankInfo` / :func:`rank_layout`: ranks are numbered stage by stage, replica by replica (stage 0's
  ``dp_0`` replicas are ranks ``0 … dp_0 − 1``, stage 1's follow, …); micro-batch ``j`` of stage ``s`` runs
  on replica ``j mod dp_s``;
- :class:`StepReport`, :class:`CheckpointManifest`: what flows back to the agent through callbacks.

``*_to_dict`` / ``*_from_dict`` convert to and from the JSON a worker reads (``python -m
spiderflow.exec.worker --spec FILE.json``); parse errors are :class:`ValidationError` with a field path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.domain import DataSpec, OptimizerSpec, Plan, Precision, Schedule, Sharding, Stage
from spiderflow.core.errors import PreconditionError, ValidationError
from spiderflow.core.schedules import Op, plan_max_in_flight, replica_ops
from spiderflow.formats import (
    data_from_value,
    data_to_dict,
    model_from_value,
    model_to_value,
    optimizer_from_value,
    optimizer_to_dict,
    plan_from_dict,
    plan_to_dict,
)

__all__ = [
    "CheckpointManifest",
    "DataSpec",
    "FileDigest",
    "RankInfo",
    "Rendezvous",
    "ShardInfo",
    "StepReport",
    "TrainSpec",
    "check_runnable",
    "chunk_ranges",
    "launch_ranks",
    "manifest_from_dict",
    "manifest_to_dict",
    "model_to_dict",
    "plan_chunks",
    "rank_layout",
    "rank_ops",
    "ranks_of_cluster",
    "spec_from_dict",
    "spec_to_dict",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where ranks meet: a ``torch.distributed`` TCPStore at ``host:port``. ``serve`` makes this process host
    the store (default: rank 0 does); with ``serve=False`` on every rank someone else (an agent, a test)
    hosts it. ``timeout_s`` bounds rendezvous and every collective/point-to-point wait."""

    host: str
    port: int
    world_size: int
    rank: int
    serve: bool | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValidationError("rendezvous.host", "must be a non-empty string", self.host)
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValidationError("rendezvous.port", "must be in 1..65535", self.port)
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValidationError("rendezvous.world_size", "must be ≥ 1", self.world_size)
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValidationError("rendezvous.rank", f"must be in [0, {self.world_size})", self.rank)
        if self.timeout_s <= 0:
            raise ValidationError("rendezvous.timeout_s", "must be > 0", self.timeout_s)

    @property
    def serves(self) -> bool:
        return self.rank == 0 if self.serve is None else self.serve


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSpec:
    """One job's training run.

    ``steps`` is the job's total step count: a run resumed at step ``k`` trains steps ``k … steps − 1``.
    The micro-batch size is ``global_batch / plan.micro_batches`` (must divide). ``checkpoint_every = K``
    saves after every ``K``-th completed step (0: never) under ``checkpoint_dir``; ``resume`` starts from
    the latest complete checkpoint found there (or from ``resume_from`` if given) instead of from the
    seed's initialisation. ``warmup`` optionally overrides the per-stage warm-up depth of the 1F1B family
    (one entry per stage, non-increasing). ``threads`` is ``torch.set_num_threads`` in the worker.

    ``precision`` is the job's (:class:`~spiderflow.core.domain.Precision`; fp32 when a worker file does not say,
    so older files run as before). ``nccl_links`` sends pipeline traffic between stages on *different*
    clusters over NCCL instead of gloo/TCP (only where the operator has a routable GPU fabric between
    them; stages on one cluster always use the in-cluster backend). ``checkpoint_keep`` complete
    checkpoints are retained. ``recv_window`` bounds the receives a rank has posted ahead of the operation
    that consumes them (buffers per rank: at most ``recv_window`` activations or gradients).
    """

    job_id: str
    model: ModelSpec
    plan: Plan
    seq_len: int
    global_batch: int
    steps: int
    seed: int = 0
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    data: DataSpec = field(default_factory=DataSpec)
    optimizer: OptimizerSpec | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    resume_from: CheckpointManifest | None = None
    warmup: tuple[int, ...] | None = None
    threads: int = 1
    precision: Precision = Precision.FP32
    nccl_links: bool = False
    checkpoint_keep: int = 3
    recv_window: int = 2

    def __post_init__(self) -> None:
        if self.precision.__class__ is not Precision:
            try:
                object.__setattr__(self, "precision", Precision(self.precision))
            except ValueError:
                raise ValidationError("precision", f"must be one of {', '.join(p.value for p in Precision)}",
                                      self.precision) from None
        for name in ("checkpoint_keep", "recv_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValidationError(name, "must be an integer ≥ 1", v)
        if not isinstance(self.job_id, str) or not self.job_id:
            raise ValidationError("job_id", "must be a non-empty string", self.job_id)
        for name in ("seq_len", "global_batch", "steps", "threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValidationError(name, "must be an integer ≥ 1", v)
        if self.global_batch % self.plan.micro_batches:
            raise ValidationError(
                "global_batch", f"must be a multiple of plan.micro_batches ({self.plan.micro_batches})",
                self.global_batch,
            )
        if self.plan.layers != self.model.layers:
            raise ValidationError("plan.stages", f"cover {self.plan.layers} layers, the model has "
                                  f"{self.model.layers}", self.plan.layers)
        if not self.lr > 0:
            raise ValidationError("lr", "must be > 0", self.lr)
        if isinstance(self.checkpoint_every, bool) or self.checkpoint_every < 0:
            raise ValidationError("checkpoint_every", "must be ≥ 0", self.checkpoint_every)
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValidationError("checkpoint_dir", "is required when checkpoint_every > 0", self.checkpoint_dir)
        if self.warmup is not None:
            if len(self.warmup) != len(self.plan.stages):
                raise ValidationError("warmup", f"needs one entry per stage ({len(self.plan.stages)})", self.warmup)
            pairs = zip(self.warmup, self.warmup[1:], strict=False)
            if any(w < 0 for w in self.warmup) or any(a < b for a, b in pairs):
                raise ValidationError("warmup", "must be ≥ 0 and non-increasing along the pipeline",
                                      self.warmup)

    @property
    def optim(self) -> OptimizerSpec:
        """The optimizer: ``optimizer`` if given, else AdamW with ``lr``, ``betas`` and ``eps`` and nothing
        else (no warm-up, decay, weight decay or clipping)."""
        if self.optimizer is not None:
            return self.optimizer
        return OptimizerSpec(lr=self.lr, betas=self.betas, eps=self.eps)

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // self.plan.micro_batches

    @property
    def world_size(self) -> int:
        """Worker processes the plan needs (``Σ_s dp_s · tp_s``)."""
        return sum(s.dp * s.tp for s in self.plan.stages)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def plan_chunks(plan: Plan) -> int:
    """Model chunks per stage: ``plan.extras["chunks"]`` for interleaved 1F1B (default 2, as the cost model
    assumes), else 1."""
    if plan.schedule is not Schedule.INTERLEAVED_1F1B:
        return 1
    return int(plan.extras.get("chunks", 2))


def rank_ops(spec: TrainSpec, stage: int, replica: int) -> list[Op]:
    """The operation order replica ``replica`` of stage ``stage`` runs each step
    (:func:`spiderflow.core.schedules.replica_ops`): ``spec.warmup`` if given, else the schedule's warm-ups under
    the plan's in-flight cap ``K`` (``plan.extras["max_in_flight"]``, bounded by ``min_dp · (K − 1)`` per
    stage, ``min_dp`` the smallest dp of the pipeline) — the orders :func:`spiderflow.core.tpa.timeline.plan_orders`
    simulates, so a capped plan runs capped without explicit warm-ups."""
    plan = spec.plan
    dps = [st.dp for st in plan.stages]
    return replica_ops(
        plan.schedule, len(plan.stages), plan.micro_batches, stage, dp=dps[stage], replica=replica,
        max_dp=max(dps), chunks=plan_chunks(plan), warmup=None if spec.warmup is None else spec.warmup[stage],
        max_in_flight=plan_max_in_flight(plan), min_dp=min(dps),
    )


def chunk_ranges(plan: Plan) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``[stage][chunk] → (first_layer, last_layer)``: the layers each stage runs, per model chunk.

    Without interleaving, stage ``i`` runs its plan range as one chunk. With ``v`` chunks, stage ``i``
    keeps its plan's layer *count* ``n_i`` but as ``v`` blocks of ``⌈n_i/v⌉`` or ``⌊n_i/v⌋`` layers (the
    larger first), and the model's layers are dealt out in virtual-stage order ``u = c·S + i``: chunk 0 of
    stages 0 … S−1, then chunk 1 of stages 0 … S−1, … — Megatron's interleaving, so the per-stage compute is
    what the plan priced. Raises :class:`ValidationError` if a stage has fewer layers than chunks.
    """
    v = plan_chunks(plan)
    if v < 1:
        raise ValidationError("plan.extras.chunks", "must be ≥ 1", v)
    if v == 1:
        return tuple(((st.first_layer, st.last_layer),) for st in plan.stages)
    sizes = []
    for i, st in enumerate(plan.stages):
        if st.layers < v:
            raise ValidationError(f"plan.stages[{i}]", f"has {st.layers} layers, fewer than {v} chunks", st.layers)
        base, extra = divmod(st.layers, v)
        sizes.append([base + (1 if c < extra else 0) for c in range(v)])
    out: list[list[tuple[int, int]]] = [[] for _ in plan.stages]
    nxt = 0
    for c in range(v):
        for i in range(len(plan.stages)):
            out[i].append((nxt, nxt + sizes[i][c] - 1))
            nxt += sizes[i][c]
    return tuple(tuple(r) for r in out)


def check_runnable(spec: TrainSpec) -> None:
    """Raise :class:`PreconditionError` for plans this executor cannot run faithfully.

    - a stage whose ``tp`` does not divide the model's head count (tensor parallelism shards whole heads;
      for grouped-query attention the key/value head count too) or its MLP width;
    - ``sharding = fsdp`` on a stage whose replicas span several clusters (the hierarchical all-reduce
      runs replicated stages only);
    - gradient clipping with a tensor-parallel or FSDP stage (the global norm is summed over replicated
      gradients only);
    - interleaved 1F1B whose micro-batch count is not a multiple of the stage count, or with a stage holding
      fewer layers than chunks (see :func:`chunk_ranges`).
    """
    plan = spec.plan
    kv_heads = getattr(spec.model, "kv_heads", None) or spec.model.heads
    for i, st in enumerate(plan.stages):
        if spec.model.heads % st.tp or kv_heads % st.tp:
            raise PreconditionError(
                f"plan.stages[{i}].tp = {st.tp} does not divide the model's heads ({spec.model.heads}, "
                f"key/value heads {kv_heads}); tensor parallelism shards whole heads"
            )
        if st.sharding is Sharding.FSDP and len(st.clusters) > 1:
            raise PreconditionError(
                f"plan.stages[{i}]: sharding 'fsdp' with replicas on several clusters is not supported; "
                "replicate the stage or keep its replicas on one cluster"
            )
        if spec.optim.grad_clip > 0 and (st.tp > 1 or st.sharding is Sharding.FSDP):
            raise PreconditionError(
                f"plan.stages[{i}]: gradient clipping (optimizer.grad_clip) is supported only on replicated "
                "stages without tensor parallelism; set grad_clip to 0 or re-plan with tp = 1 and replicas"
            )
    if plan_chunks(plan) > 1:
        if plan.micro_batches % len(plan.stages):
            raise PreconditionError(
                f"interleaved 1F1B needs micro_batches ({plan.micro_batches}) to be a multiple of the stage "
                f"count ({len(plan.stages)})"
            )
        try:
            chunk_ranges(plan)
        except ValidationError as e:
            raise PreconditionError(str(e)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo:
    """Rank ``rank`` runs tensor-parallel index ``tp_rank`` of replica ``replica`` of stage ``stage`` (on
    ``cluster``); ``local_rank`` is its index among the ranks its cluster's agent starts (the GPU it takes
    is ``local_rank`` modulo the node's GPUs unless the launcher sets ``LOCAL_RANK``)."""

    rank: int
    stage: int
    replica: int
    cluster: str
    tp_rank: int = 0
    local_rank: int = 0


def _replica_clusters(st: Stage) -> tuple[str, ...]:
    shares = st.replicas
    if not shares:
        return (st.cluster,) * st.dp
    return tuple(c for share in shares for c in (share.cluster,) * share.dp)


def rank_layout(plan: Plan) -> tuple[RankInfo, ...]:
    """All ranks of ``plan``, numbered stage by stage, replica by replica, tp index by tp index: (stage
    ``s``, replica ``r``, tp index ``t``) is rank ``first_s + r · tp_s + t``."""
    out: list[RankInfo] = []
    per_cluster: dict[str, int] = {}
    for s, st in enumerate(plan.stages):
        clusters = _replica_clusters(st)
        for r in range(st.dp):
            for t in range(st.tp):
                c = clusters[r]
                out.append(RankInfo(rank=len(out), stage=s, replica=r, cluster=c, tp_rank=t,
                                    local_rank=per_cluster.get(c, 0)))
                per_cluster[c] = per_cluster.get(c, 0) + 1
    return tuple(out)


def ranks_of_cluster(plan: Plan, cluster: str) -> tuple[RankInfo, ...]:
    """The ranks an agent of ``cluster`` must start."""
    return tuple(r for r in rank_layout(plan) if r.cluster == cluster)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """One completed step as seen by one rank.

    ``step`` counts completed steps (1-based). ``step_time_s`` is this rank's wall time for the step,
    ``tokens_per_s = global_batch · seq_len / step_time_s``. ``loss`` (mean token cross-entropy of the
    whole global batch) is known only on last-stage ranks, ``None`` elsewhere. ``busy_s`` is the part of
    the step this rank spent on its own work (forward, backward, gradient sync, optimizer), waiting for
    other stages excluded."""

    job_id: str
    step: int
    rank: int
    stage: int
    replica: int
    step_time_s: float
    tokens_per_s: float
    loss: float | None
    busy_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardInfo:
    """One stage's checkpoint file covering layers ``[first_layer, last_layer]``."""

    first_layer: int
    last_layer: int
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FileDigest:
    """One file of a checkpoint: its name inside the step directory, size and SHA-256 (hex)."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointManifest:
    """A complete checkpoint: every layer of the model is in exactly one shard, saved after ``step``
    completed steps. Written (by the manifest callback) only after all ranks saved and synced.

    ``root`` is the checkpoint directory (a path or an fsspec URL) holding ``step-K/``; ``files`` lists
    every file of the step's torch.distributed.checkpoint directory with its size and SHA-256, so a
    truncated or corrupted checkpoint is recognised and refused. ``shards`` records the layer ranges of the
    plan that wrote it (each ``path`` is the step's DCP metadata file); any other plan can load it."""

    job_id: str
    step: int
    model: ModelSpec
    shards: tuple[ShardInfo, ...]
    root: str = ""
    files: tuple[FileDigest, ...] = ()

    def __post_init__(self) -> None:
        covered = sorted((s.first_layer, s.last_layer) for s in self.shards)
        expected = 0
        for first, last in covered:
            if first != expected:
                raise ValidationError("manifest.shards", f"layer {expected} is not covered exactly once", first)
            expected = last + 1
        if expected != self.model.layers:
            raise ValidationError("manifest.shards", f"cover {expected} of {self.model.layers} layers", expected)


# ---------------------------------------------------------------------------------------------------- JSON


def _get(raw: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in raw:
        if default is ...:
            raise ValidationError(f"{where}{key}", "is required")
        return default
    v = raw[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise ValidationError(f"{where}{key}", f"has the wrong type ({type(v).__name__})", v)
    return v


def model_to_dict(model: ModelSpec) -> dict[str, Any]:
    """The job-format object of ``model`` (``{"name": PRESET}`` for an unchanged preset)."""
    raw = model_to_value(model)
    return {"name": raw} if isinstance(raw, str) else raw


def manifest_to_dict(m: CheckpointManifest) -> dict[str, Any]:
    return {"job_id": m.job_id, "step": m.step, "model": model_to_dict(m.model),
            "shards": [{"first_layer": s.first_layer, "last_layer": s.last_layer, "path": s.path}
                       for s in m.shards],
            "root": m.root, "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in m.files]}


def manifest_from_dict(raw: Any, *, where: str = "manifest.") -> CheckpointManifest:
    if not isinstance(raw, Mapping):
        raise ValidationError(where.rstrip("."), "must be an object", raw)
    shards = tuple(
        ShardInfo(first_layer=_get(s, "first_layer", f"{where}shards[{i}].", int),
                  last_layer=_get(s, "last_layer", f"{where}shards[{i}].", int),
                  path=_get(s, "path", f"{where}shards[{i}].", str))
        for i, s in enumerate(_get(raw, "shards", where, list))
    )
    return CheckpointManifest(job_id=_get(raw, "job_id", where, str), step=_get(raw, "step", where, int),
                              model=model_from_value(_get(raw, "model", where, (str, dict)), field=f"{where}model"),
                              shards=shards, root=_get(raw, "root", where, str, ""),
                              files=tuple(
                                  FileDigest(name=_get(f, "name", f"{where}files[{i}].", str),
                                             size=_get(f, "size", f"{where}files[{i}].", int),
                                             sha256=_get(f, "sha256", f"{where}files[{i}].", str))
                                  for i, f in enumerate(_get(raw, "files", where, list, []))))


def spec_to_dict(spec: TrainSpec) -> dict[str, Any]:
    return {
        "job_id": spec.job_id, "model": model_to_dict(spec.model), "plan": plan_to_dict(spec.plan),
        "seq_len": spec.seq_len, "global_batch": spec.global_batch, "steps": spec.steps, "seed": spec.seed,
        "lr": spec.lr, "betas": list(spec.betas), "eps": spec.eps,
        "data": data_to_dict(spec.data),
        "optimizer": None if spec.optimizer is None else optimizer_to_dict(spec.optimizer),
        "checkpoint_dir": spec.checkpoint_dir, "checkpoint_every": spec.checkpoint_every, "resume": spec.resume,
        "resume_from": None if spec.resume_from is None else manifest_to_dict(spec.resume_from),
        "warmup": None if spec.warmup is None else list(spec.warmup), "threads": spec.threads,
        "precision": spec.precision.value, "nccl_links": spec.nccl_links, "checkpoint_keep": spec.checkpoint_keep,
        "recv_window": spec.recv_window,
    }


def spec_from_dict(raw: Any) -> TrainSpec:
    if not isinstance(raw, Mapping):
        raise ValidationError("spec", "must be an object", raw)
    data = data_from_value({k: v for k, v in _get(raw, "data", "", dict, {}).items() if v is not None})
    opt = _get(raw, "optimizer", "", (dict, type(None)), None)
    optimizer = None if opt is None else optimizer_from_value(opt)
    betas = _get(raw, "betas", "", list, [0.9, 0.95])
    if len(betas) != 2:
        raise ValidationError("betas", "needs two numbers", betas)
    warmup = _get(raw, "warmup", "", (list, type(None)), None)
    resume_from = _get(raw, "resume_from", "", (dict, type(None)), None)
    return TrainSpec(
        job_id=_get(raw, "job_id", "", str, "job"),
        model=model_from_value(_get(raw, "model", "", (str, dict)), field="model"),
        plan=plan_from_dict(_get(raw, "plan", "", dict)),
        seq_len=_get(raw, "seq_len", "", int), global_batch=_get(raw, "global_batch", "", int),
        steps=_get(raw, "steps", "", int), seed=_get(raw, "seed", "", int, 0),
        lr=float(_get(raw, "lr", "", (int, float), 1e-3)), betas=(float(betas[0]), float(betas[1])),
        eps=float(_get(raw, "eps", "", (int, float), 1e-8)), data=data, optimizer=optimizer,
        checkpoint_dir=_get(raw, "checkpoint_dir", "", (str, type(None)), None),
        checkpoint_every=_get(raw, "checkpoint_every", "", int, 0), resume=_get(raw, "resume", "", bool, False),
        resume_from=None if resume_from is None else manifest_from_dict(resume_from),
        warmup=None if warmup is None else tuple(int(w) for w in warmup), threads=_get(raw, "threads", "", int, 1),
        precision=_get(raw, "precision", "", str, Precision.FP32.value),
        nccl_links=_get(raw, "nccl_links", "", bool, False),
        checkpoint_keep=_get(raw, "checkpoint_keep", "", int, 3), recv_window=_get(raw, "recv_window", "", int, 2),
    )


def launch_ranks(
    spec: TrainSpec, *, gpus_per_node: Mapping[str, int] | None = None,
    memory_gib: tuple[float, ...] = (),
) -> list[dict[str, Any]]:
    """What every rank of ``spec`` would run, without starting anything (``spiderflow plan --dry-run``).

    One entry per rank: ``rank``, ``cluster``, ``node`` and ``device`` (``cuda:N``; the node is the
    cluster-local rank divided by the cluster's GPUs per node, 8 when unknown), ``stage``, ``layers``,
    ``dp_rank`` / ``tp_rank`` coordinates, ``groups`` (the global ranks of its ``tp`` and ``dp`` groups, the
    ranks it receives activations from and sends them to), ``sharding``, ``recompute``, ``precision`` and
    ``predicted_memory_gib`` (the plan's per-stage prediction, ``None`` when the plan has none). Raises
    :class:`PreconditionError` (via :func:`check_runnable`) for a plan the executor would refuse."""
    check_runnable(spec)
    plan = spec.plan
    layout = rank_layout(plan)
    first = [0] * len(plan.stages)
    for info in reversed(layout):
        first[info.stage] = info.rank
    per_node = dict(gpus_per_node or {})
    out: list[dict[str, Any]] = []
    for info in layout:
        st = plan.stages[info.stage]
        base = first[info.stage]
        tp_group = [base + info.replica * st.tp + t for t in range(st.tp)]
        dp_group = [base + r * st.tp + info.tp_rank for r in range(st.dp)]
        prev = next_ = []
        if info.stage > 0:
            ps = plan.stages[info.stage - 1]
            prev = sorted({first[info.stage - 1] + r * ps.tp + info.tp_rank % ps.tp for r in range(ps.dp)})
        if info.stage + 1 < len(plan.stages):
            ns = plan.stages[info.stage + 1]
            next_ = sorted(first[info.stage + 1] + r * ns.tp + t for r in range(ns.dp) for t in range(ns.tp)
                           if t % st.tp == info.tp_rank)
        g = per_node.get(info.cluster, 8)
        out.append({
            "rank": info.rank, "cluster": info.cluster, "node": info.local_rank // g,
            "device": f"cuda:{info.local_rank % g}", "stage": info.stage,
            "layers": [st.first_layer, st.last_layer], "dp_rank": info.replica, "tp_rank": info.tp_rank,
            "groups": {"tp": tp_group, "dp": dp_group, "recv_from": prev, "send_to": next_},
            "sharding": st.sharding.value, "recompute": st.recompute, "precision": spec.precision.value,
            "predicted_memory_gib": memory_gib[info.stage] if info.stage < len(memory_gib) else None,
        })
    return out
