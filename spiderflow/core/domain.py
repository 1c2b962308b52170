"""The domain model: frozen, validated value objects shared by every component.

Glossary
--------
cluster
    A set of identical GPUs in one region under one administrator, reachable by one agent. Has
    ``nodes × gpus_per_node`` GPUs of one :class:`~spiderflow.core.catalog.GpuType`, of which ``free_gpus`` are
    available to SpiderFlow.
node
    One machine of a cluster; GPUs inside a node talk over ``intra_node_gbps`` (NVLink), nodes over
    ``inter_node_gbps`` (InfiniBand/Ethernet).
GPU
    One accelerator. ``tflops`` on a cluster is the *measured* dense matmul throughput per GPU when an
    agent has calibrated it, else the catalog's peak; ``mfu`` the fraction of it a training step reaches;
    ``layer_overhead_ms`` a fixed time per transformer layer and micro-batch (forward + backward) on top of
    FLOPs at that rate — per-operator launch and framework costs that do not shrink with the problem size
    — and ``optimizer_ms_per_layer`` the optimizer step's time per layer and training step (both 0 unless
    an agent's calibration measured them). The work outside the layers, when a profile measured it
    (:func:`spiderflow.profile.apply_profile`; all 0 otherwise, and the embedding and head are priced by
    FLOPs): ``embedding_us_per_token`` and ``head_us_per_token`` (head and loss) forward + backward per
    token of a micro-batch, ``embedding_optimizer_ms`` and ``head_optimizer_ms`` their optimizer steps per
    training step, ``data_ms_per_sample`` the host's input pipeline per sample and step.
link
    A measured inter-cluster connection ``a → b`` with ``bandwidth_gbps`` (Gbit/s) and one-way
    ``latency_ms``. Symmetric unless ``directed``. Clusters without a link talk through relays along the
    widest path.
chain
    The ordered list of clusters a job's pipeline flows through (activations go chain[i] → chain[i+1]).
stage
    One pipeline stage: a contiguous layer range ``[first_layer, last_layer]`` on one cluster, run by
    ``tp × dp`` GPUs (tensor-parallel degree ``tp``, ``dp`` replicas of the stage that split its
    micro-batches and all-reduce gradients). Layers are numbered ``0 .. L-1``; the embedding lives with
    layer 0's stage and the head/loss with layer ``L-1``'s.
rank
    One worker process of a running plan; ranks are numbered stage by stage, replica by replica.
plan
    Stages in pipeline order, the micro-batch count ``m``, the pipeline schedule, and the cost model's
    predictions (step time, throughput, memory per GPU, dollars per step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from functools import cache, cached_property
from typing import TYPE_CHECKING

from spiderflow.core import ids
from spiderflow.core.catalog import GpuType, ModelSpec, gpu_type
from spiderflow.core.errors import NotFoundError, ValidationError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from spiderflow.core.memo import SnapshotMemo

__all__ = [
    "Cluster",
    "DataKind",
    "DataSpec",
    "GpuRange",
    "JobSpec",
    "Link",
    "LrSchedule",
    "OptimizerSpec",
    "Plan",
    "Precision",
    "ReplicaShare",
    "Schedule",
    "Sharding",
    "Stage",
    "Topology",
]


def _positive(fieldname: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValidationError(fieldname, "must be a number", value)
    if value < 0 or (value == 0 and not allow_zero) or math.isinf(value):
        raise ValidationError(fieldname, "must be " + ("≥ 0" if allow_zero else "> 0"), value)


def _int(fieldname: str, value: int, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(fieldname, "must be an integer", value)
    if value < minimum:
        raise ValidationError(fieldname, f"must be ≥ {minimum}", value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A GPU cluster (see the module glossary). ``free_gpus=None`` means all GPUs are free."""

    name: str
    gpu: str
    nodes: int
    gpus_per_node: int
    intra_node_gbps: float = 600.0
    inter_node_gbps: float = 100.0
    electricity_usd_per_kwh: float = 0.10
    free_gpus: int | None = None
    tflops: float | None = None
    mfu: float | None = None
    memory_gib: float | None = None
    layer_overhead_ms: float = 0.0
    optimizer_ms_per_layer: float = 0.0
    region: str = ""
    lat: float | None = None
    lon: float | None = None
    embedding_us_per_token: float = 0.0
    head_us_per_token: float = 0.0
    embedding_optimizer_ms: float = 0.0
    head_optimizer_ms: float = 0.0
    data_ms_per_sample: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 63:
            raise ValidationError("cluster.name", "must be a non-empty string of ≤ 63 characters", self.name)
        where = f"clusters[{self.name}]"
        gpu_type(self.gpu, field=f"{where}.gpu")
        _int(f"{where}.nodes", self.nodes, minimum=1)
        _int(f"{where}.gpus_per_node", self.gpus_per_node, minimum=1)
        _positive(f"{where}.intra_node_gbps", self.intra_node_gbps)
        _positive(f"{where}.inter_node_gbps", self.inter_node_gbps)
        _positive(f"{where}.electricity_usd_per_kwh", self.electricity_usd_per_kwh, allow_zero=True)
        if self.free_gpus is None:
            object.__setattr__(self, "free_gpus", self.nodes * self.gpus_per_node)
        else:
            _int(f"{where}.free_gpus", self.free_gpus, minimum=0)
            if self.free_gpus > self.total_gpus:
                raise ValidationError(
                    f"{where}.free_gpus", f"exceeds nodes × gpus_per_node = {self.total_gpus}", self.free_gpus
                )
        if self.tflops is not None:
            _positive(f"{where}.tflops", self.tflops)
        if self.mfu is not None:
            _positive(f"{where}.mfu", self.mfu)
            if self.mfu > 1:
                raise ValidationError(f"{where}.mfu", "must be ≤ 1", self.mfu)
        if self.memory_gib is not None:
            _positive(f"{where}.memory_gib", self.memory_gib)
        _positive(f"{where}.layer_overhead_ms", self.layer_overhead_ms, allow_zero=True)
        _positive(f"{where}.optimizer_ms_per_layer", self.optimizer_ms_per_layer, allow_zero=True)
        for measured in ("embedding_us_per_token", "head_us_per_token", "embedding_optimizer_ms",
                         "head_optimizer_ms", "data_ms_per_sample"):
            _positive(f"{where}.{measured}", getattr(self, measured), allow_zero=True)

    @property
    def gpu_type(self) -> GpuType:
        return gpu_type(self.gpu)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def _with_free(self, free_gpus: int) -> Cluster:
        """This cluster with ``free_gpus`` replaced, without re-running the (already passed) validation."""
        out = object.__new__(Cluster)
        for name in _CLUSTER_FIELDS:
            object.__setattr__(out, name, getattr(self, name))
        object.__setattr__(out, "free_gpus", free_gpus)
        return out

    @property
    def free(self) -> int:
        """Free GPUs (``free_gpus`` with its default resolved)."""
        assert self.free_gpus is not None
        return self.free_gpus

    @property
    def effective_tflops(self) -> float:
        """Achieved TFLOPS per GPU in training: (measured or peak) × mfu."""
        t = self.gpu_type
        return (self.tflops if self.tflops is not None else t.peak_tflops) * (
            self.mfu if self.mfu is not None else t.default_mfu
        )

    @property
    def gpu_memory_gib(self) -> float:
        return self.memory_gib if self.memory_gib is not None else self.gpu_type.memory_gib

    @property
    def power_w(self) -> float:
        return self.gpu_type.power_w


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """An inter-cluster link ``a → b`` (and ``b → a`` unless ``directed``)."""

    a: str
    b: str
    bandwidth_gbps: float
    latency_ms: float
    directed: bool = False

    def __post_init__(self) -> None:
        where = f"links[{self.a}-{self.b}]"
        if self.a == self.b:
            raise ValidationError(f"{where}.b", "a link must join two different clusters", self.b)
        _positive(f"{where}.bandwidth_gbps", self.bandwidth_gbps)
        _positive(f"{where}.latency_ms", self.latency_ms, allow_zero=True)

    @property
    def directions(self) -> list[tuple[str, str]]:
        """The directed pairs the link's figures hold for: ``(a, b)``, and ``(b, a)`` unless ``directed``."""
        return [(self.a, self.b)] if self.directed else [(self.a, self.b), (self.b, self.a)]


_CLUSTER_FIELDS = tuple(f.name for f in fields(Cluster))


@dataclass(frozen=True, kw_only=True)
class Topology:
    """An immutable snapshot of the cluster graph.

    ``revision`` is the etcd revision it was read at (0 for files). Pairwise figures between clusters that
    share no link come from relaying along the *widest path* (maximum bottleneck bandwidth; latency summed
    along that path); unreachable pairs have bandwidth 0 and infinite latency.
    """

    clusters: tuple[Cluster, ...]
    links: tuple[Link, ...] = ()
    revision: int = 0

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for c in self.clusters:
            if c.name in seen:
                raise ValidationError("clusters.name", "duplicate cluster name", c.name)
            seen.add(c.name)
        pairs: set[tuple[str, str]] = set()
        for i, link in enumerate(self.links):
            for end in ("a", "b"):
                if getattr(link, end) not in seen:
                    raise ValidationError(f"links[{i}].{end}", "unknown cluster", getattr(link, end))
            for pair in link.directions:
                if pair in pairs:
                    raise ValidationError(f"links[{i}]", "duplicate link", f"{pair[0]}-{pair[1]}")
                pairs.add(pair)

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.clusters)

    @cached_property
    def index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def cluster(self, name: str) -> Cluster:
        try:
            return self.clusters[self.index[name]]
        except KeyError:
            raise NotFoundError(f"cluster {name!r} is not in the topology") from None

    @cached_property
    def direct(self) -> dict[tuple[str, str], Link]:
        """Directed adjacency: ``(u, v) → link``."""
        out: dict[tuple[str, str], Link] = {}
        for link in self.links:
            for pair in link.directions:
                out[pair] = link
        return out

    @cached_property
    def memo(self) -> SnapshotMemo:
        """The placement memo tables of this network snapshot (:mod:`spiderflow.core.memo`): its tables are
        shared by every :meth:`with_free` copy and go with the snapshot."""
        from spiderflow.core.memo import SnapshotMemo

        return SnapshotMemo()

    @cached_property
    def _paths(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """All-pairs widest paths (bandwidth Gbit/s, latency ms): a vectorised Floyd–Warshall, O(n³/…)."""
        import numpy as np

        n = len(self.clusters)
        bw = np.zeros((n, n))
        lat = np.full((n, n), np.inf)
        for (u, v), link in self.direct.items():
            i, j = self.index[u], self.index[v]
            bw[i, j] = link.bandwidth_gbps
            lat[i, j] = link.latency_ms
        np.fill_diagonal(bw, np.inf)
        np.fill_diagonal(lat, 0.0)
        for k in range(n):
            via = np.minimum(bw[:, k : k + 1], bw[k : k + 1, :])
            via_lat = lat[:, k : k + 1] + lat[k : k + 1, :]
            better = (via > bw) | ((via == bw) & (via_lat < lat))
            bw = np.where(better, via, bw)
            lat = np.where(better, via_lat, lat)
        return bw, lat

    def bandwidth_gbps(self, u: str, v: str) -> float:
        """Bandwidth from ``u`` to ``v`` (direct link, else widest relay path; ∞ for u == v)."""
        return float(self._paths[0][self.index[u], self.index[v]])

    def latency_ms(self, u: str, v: str) -> float:
        """One-way latency from ``u`` to ``v`` along the path :meth:`bandwidth_gbps` uses."""
        return float(self._paths[1][self.index[u], self.index[v]])

    @property
    def bandwidth_matrix(self) -> npt.NDArray[np.float64]:
        """``n × n`` widest-path bandwidths in Gbit/s, indexed like :attr:`clusters`."""
        return self._paths[0]

    @property
    def latency_matrix(self) -> npt.NDArray[np.float64]:
        return self._paths[1]

    def components(self) -> list[list[str]]:
        """Weakly connected components, each sorted, largest first."""
        parent = {n: n for n in self.names}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for link in self.links:
            parent[find(link.a)] = find(link.b)
        groups: dict[str, list[str]] = {}
        for n in self.names:
            groups.setdefault(find(n), []).append(n)
        return sorted((sorted(g) for g in groups.values()), key=lambda g: (-len(g), g))

    def with_free(self, free: dict[str, int]) -> Topology:
        """A copy with some clusters' ``free_gpus`` replaced (e.g. after reserving GPUs for a job).

        Only the new figures are validated (integers ≥ 0): everything else was validated when this snapshot
        was built, so the copy skips the constructors' checks (placement searches call this per candidate)."""
        clusters = []
        for c in self.clusters:
            f = free.get(c.name)
            if f is None or f == c.free_gpus:
                clusters.append(c)
                continue
            _int(f"clusters[{c.name}].free_gpus", f, minimum=0)
            if f > c.total_gpus:
                raise ValidationError(f"clusters[{c.name}].free_gpus",
                                      f"exceeds nodes × gpus_per_node = {c.total_gpus}", f)
            clusters.append(c._with_free(f))
        out = object.__new__(Topology)
        object.__setattr__(out, "clusters", tuple(clusters))
        object.__setattr__(out, "links", self.links)
        object.__setattr__(out, "revision", self.revision)
        # Names, links and paths are unchanged: reuse what this snapshot already computed (and share its
        # sub-topologies, see only()).
        self.__dict__.setdefault("_subsets", {})
        out.__dict__["memo"] = self.memo.derive()
        for key in ("names", "index", "direct", "_paths", "_subsets"):
            if key in self.__dict__:
                out.__dict__[key] = self.__dict__[key]
        return out

    def only(self, names: Iterable[str]) -> Topology:
        """The sub-topology of the clusters ``names`` (kept in this snapshot's order; unknown names ignored)
        and the links among them, with this snapshot's free GPUs and revision. Its pairwise bandwidth and
        latency are this snapshot's (widest paths may still relay through the other clusters' links: those
        clusters only give no GPUs). The sub-topology's structure (and so its path matrices, which the
        placement memos key on) is built once per set of names and shared by every :meth:`with_free` copy
        of this snapshot; each call only applies the current free GPUs."""
        keep = frozenset(names)
        if keep.issuperset(self.names):
            return self
        subsets: dict[frozenset[str], Topology] = self.__dict__.setdefault("_subsets", {})
        base = subsets.get(keep)
        if base is None:
            if len(subsets) >= 256:
                subsets.clear()
            base = Topology(clusters=tuple(c for c in self.clusters if c.name in keep),
                            links=tuple(lk for lk in self.links if lk.a in keep and lk.b in keep),
                            revision=self.revision)
            import numpy as np

            ix = np.array([self.index[c.name] for c in base.clusters], dtype=np.int64)
            bw, lat = self._paths
            base.__dict__["_paths"] = (bw[np.ix_(ix, ix)], lat[np.ix_(ix, ix)])  # shared by the copies below
            subsets[keep] = base
        return base.with_free({c.name: c.free for c in self.clusters if c.name in keep})

    @property
    def total_free_gpus(self) -> int:
        return sum(c.free for c in self.clusters)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuRange:
    """The GPUs a job accepts: at least ``min``, at most ``max``."""

    min: int
    max: int

    def __post_init__(self) -> None:
        _int("gpus.min", self.min, minimum=1)
        _int("gpus.max", self.max, minimum=1)
        if self.min > self.max:
            raise ValidationError("gpus.min", f"must be ≤ gpus.max ({self.max})", self.min)


class Precision(StrEnum):
    """Numeric precision of training: the compute dtype of matmuls and of the values that cross links.

    ``BF16`` (default) and ``FP16`` keep fp32 master weights and optimizer state (``FP16`` with dynamic
    loss scaling); ``FP32`` trains in fp32 throughout; ``TF32`` keeps fp32 tensors and lets matmuls run
    on TF32 tensor cores."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    TF32 = "tf32"

    @property
    def value_bytes(self) -> int:
        """Bytes of one activation or gradient value sent between stages in this precision."""
        return 2 if self in (Precision.BF16, Precision.FP16) else 4

class DataKind(StrEnum):
    """Where a job's tokens come from: ``synthetic`` (a seeded Markov chain, the default), ``tokens`` (token
    shards ``.bin``/``.npy`` by path, directory or glob) or ``corpus`` (JSONL or text files tokenized once
    with a local tokenizer file and cached as shards)."""

    SYNTHETIC = "synthetic"
    TOKENS = "tokens"
    CORPUS = "corpus"


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    """A job's training data.

    ``path``: a file, a directory or a glob (``tokens``: ``.bin``/``.npy`` shards; ``corpus``: ``.jsonl``
    files, one object per line with the text under ``text_field``, or plain ``.txt`` files, one document per
    line); ``dtype`` of ``.bin`` shards; ``tokenizer``: a local Hugging Face ``tokenizer.json`` (``corpus``
    only); ``cache_dir``: where tokenized shards are kept (default: ``.spiderflow-tokens`` next to the
    first corpus file); ``seed``: the Markov chain (``synthetic``) or the window order. Paths are on the
    agents' file system; they are checked at submission and at placement, never first during training.
    ``kind="file"`` is read as ``tokens``.
    """

    kind: DataKind = DataKind.SYNTHETIC
    path: str | None = None
    dtype: str = "uint16"
    tokenizer: str = ""
    text_field: str = "text"
    cache_dir: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        kind = "tokens" if self.kind == "file" else self.kind
        try:
            object.__setattr__(self, "kind", DataKind(kind))
        except ValueError:
            raise ValidationError("data.kind", f"must be one of {[k.value for k in DataKind]}", self.kind) from None
        if self.kind is not DataKind.SYNTHETIC and not self.path:
            raise ValidationError("data.path", f"is required for {self.kind.value} data", self.path)
        if self.dtype not in ("uint16", "uint32"):
            raise ValidationError("data.dtype", "must be uint16 or uint32", self.dtype)
        if self.kind is DataKind.CORPUS and not self.tokenizer:
            raise ValidationError("data.tokenizer", "is required for corpus data (a local tokenizer.json)")
        if self.kind is not DataKind.CORPUS and self.tokenizer:
            raise ValidationError("data.tokenizer", "is only for corpus data", self.tokenizer)
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValidationError("data.text_field", "must be a non-empty string", self.text_field)
        _int("data.seed", self.seed, minimum=0)


class LrSchedule(StrEnum):
    """Learning-rate shape after warm-up: ``constant``, ``cosine`` or ``linear`` decay to
    ``min_lr_ratio · lr`` at ``decay_steps``."""

    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    """AdamW and its learning-rate schedule.

    ``lr`` peak learning rate; ``warmup_steps`` linear warm-up from ``lr / warmup_steps``; ``schedule`` and
    ``min_lr_ratio`` the decay after warm-up, reaching ``min_lr_ratio · lr`` at ``decay_steps`` (0: the
    job's step count); ``weight_decay`` decoupled (AdamW); ``betas``, ``eps`` Adam's; ``grad_clip`` the
    maximum global gradient norm over the whole model (0: no clipping)."""

    lr: float = 1e-3
    warmup_steps: int = 0
    schedule: LrSchedule = LrSchedule.CONSTANT
    min_lr_ratio: float = 0.1
    decay_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 0.0

    def __post_init__(self) -> None:
        _positive("optimizer.lr", self.lr)
        _int("optimizer.warmup_steps", self.warmup_steps, minimum=0)
        _int("optimizer.decay_steps", self.decay_steps, minimum=0)
        try:
            object.__setattr__(self, "schedule", LrSchedule(self.schedule))
        except ValueError:
            raise ValidationError("optimizer.schedule", f"must be one of {[k.value for k in LrSchedule]}",
                                  self.schedule) from None
        _positive("optimizer.min_lr_ratio", self.min_lr_ratio, allow_zero=True)
        if self.min_lr_ratio > 1:
            raise ValidationError("optimizer.min_lr_ratio", "must be ≤ 1", self.min_lr_ratio)
        _positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ValidationError("optimizer.betas", "needs two numbers", self.betas)
        for i, b in enumerate(self.betas):
            _positive(f"optimizer.betas[{i}]", b, allow_zero=True)
            if b >= 1:
                raise ValidationError(f"optimizer.betas[{i}]", "must be < 1", b)
        _positive("optimizer.eps", self.eps)
        _positive("optimizer.grad_clip", self.grad_clip, allow_zero=True)

    def lr_factor(self, step: int, total_steps: int) -> float:
        """The learning rate of 0-based step ``step`` as a fraction of ``lr``: ``(step + 1) / warmup`` during
        warm-up, then the schedule from 1 down to ``min_lr_ratio`` over ``[warmup, decay_steps or
        total_steps]`` (held at the floor afterwards)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule is LrSchedule.CONSTANT:
            return 1.0
        end = self.decay_steps or total_steps
        span = max(1, end - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * t)) if self.schedule is LrSchedule.COSINE else 1 - t
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * shape


@cache
def _gpu_names() -> dict[str, str]:
    """Every GPU name a constraint may use, lower-cased, to its canonical spelling: the catalog's type names
    (``A100-80G``) and their families (``A100``: the name before the first ``-``). Built once (the catalog
    is fixed); callers only read it."""
    from spiderflow.core.catalog import GPU_CATALOG

    out = {n.split("-", 1)[0].lower(): n.split("-", 1)[0] for n in GPU_CATALOG}
    out.update({n.lower(): n for n in GPU_CATALOG})
    return out


def _names(fieldname: str, value: object, *, gpu: bool = False) -> tuple[str, ...]:
    """``value`` (a list or tuple of strings) as a tuple without duplicates; GPU names canonicalised."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ValidationError(fieldname, "must be a list of names", value)
    known = _gpu_names() if gpu else {}
    out: list[str] = []
    for i, v in enumerate(value):
        if not isinstance(v, str) or not v.strip() or len(v) > 63:
            raise ValidationError(f"{fieldname}[{i}]", "must be a non-empty name of ≤ 63 characters", v)
        if gpu:
            canonical = known.get(v.strip().lower())
            if canonical is None:
                raise ValidationError(f"{fieldname}[{i}]", "unknown GPU type; known: "
                                      + ", ".join(sorted(set(known.values()))), v)
            v = canonical
        if v not in out:
            out.append(v)
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraints:
    """Where a job may run; every field empty (the default): anywhere.

    ``gpu_types``: GPU types allowed — catalog names (``A100-80G``) or families (``A100``: every A100 type),
    in any case, stored canonically; ``clusters`` / ``exclude_clusters``: cluster names allowed / never used;
    ``regions`` / ``exclude_regions``: cluster ``region`` labels allowed / never used. A cluster is allowed
    when it passes every non-empty field. A name both allowed and excluded is a contradiction (an error
    naming the field). Every placement policy sees only the allowed clusters (:mod:`spiderflow.core.constraints`);
    constraints decide where a job computes and keeps its state, not which network paths carry its traffic
    between allowed clusters (relayed along the widest path as for any job)."""

    gpu_types: tuple[str, ...] = ()
    clusters: tuple[str, ...] = ()
    exclude_clusters: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    exclude_regions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.gpu_types == () and self.clusters == () and self.exclude_clusters == () and self.regions == ()
                and self.exclude_regions == ()):
            return  # the default (anywhere): nothing to check, the common case of every submission
        for name in ("gpu_types", "clusters", "exclude_clusters", "regions", "exclude_regions"):
            object.__setattr__(self, name, _names(f"constraints.{name}", getattr(self, name),
                                                  gpu=name == "gpu_types"))
        for allow, exclude in (("clusters", "exclude_clusters"), ("regions", "exclude_regions")):
            allowed = set(getattr(self, allow))
            for i, v in enumerate(getattr(self, exclude)):
                if v in allowed:
                    raise ValidationError(f"constraints.{exclude}[{i}]", f"contradicts {allow}, which allows it", v)

    @property
    def empty(self) -> bool:
        """No restriction at all."""
        return not (self.gpu_types or self.clusters or self.exclude_clusters or self.regions
                    or self.exclude_regions)

    def allows(self, cluster: Cluster) -> bool:
        """Whether ``cluster`` passes every non-empty field."""
        if self.gpu_types and cluster.gpu not in self.gpu_types \
                and cluster.gpu.split("-", 1)[0] not in self.gpu_types:
            return False
        if self.clusters and cluster.name not in self.clusters:
            return False
        if cluster.name in self.exclude_clusters:
            return False
        if self.regions and cluster.region not in self.regions:
            return False
        return not (self.exclude_regions and cluster.region in self.exclude_regions)

    def describe(self) -> str:
        """The non-empty fields, e.g. ``gpu_types A100, H100-80G; exclude_clusters ohio``."""
        parts = [f"{name} {', '.join(getattr(self, name))}" for name in
                 ("gpu_types", "clusters", "exclude_clusters", "regions", "exclude_regions") if getattr(self, name)]
        return "; ".join(parts) or "none"


__all__ += ["Constraints"]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """A training job, as in the trace file format (field names match the proto and the file).

    ``data`` and ``optimizer`` say what it trains on and how (defaults: synthetic tokens, AdamW at a
    constant ``1e-3``); ``constraints`` where it may run (default: anywhere). ``checkpoint_every``: steps
    between checkpoints (0: none, so a re-placed job starts over; ``None``: the agents' default, their
    ``--checkpoint-every``)."""

    id: str
    model: ModelSpec
    global_batch: int
    micro_batch: int = 1
    seq_len: int = 2048
    steps: int = 1
    gpus: GpuRange
    arrival_s: float = 0.0
    priority: int = 0
    tenant: str = "default"
    precision: Precision = Precision.BF16
    data: DataSpec = field(default_factory=DataSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    constraints: Constraints = field(default_factory=Constraints)
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.constraints, Constraints):
            raise ValidationError("constraints", "must be a Constraints", self.constraints)
        # ids: the grammar of spiderflow.core.ids; a stored job's id is qualified by its own tenant
        tenant, _ = ids.split_job_id("id", self.id)
        _int("global_batch", self.global_batch, minimum=1)
        _int("micro_batch", self.micro_batch, minimum=1)
        if self.global_batch % self.micro_batch:
            raise ValidationError(
                "global_batch", f"must be a multiple of micro_batch ({self.micro_batch})", self.global_batch
            )
        _int("seq_len", self.seq_len, minimum=1)
        _int("steps", self.steps, minimum=1)
        if self.checkpoint_every is not None:
            _int("checkpoint_every", self.checkpoint_every, minimum=0)
        _positive("arrival_s", self.arrival_s, allow_zero=True)
        _int("priority", self.priority, minimum=-1000)
        if self.priority > 1000:
            raise ValidationError("priority", "must be ≤ 1000", self.priority)
        ids.check_tenant("tenant", self.tenant)
        if ids.SEP in self.id and tenant != self.tenant:
            raise ValidationError("id", f"is qualified by tenant {tenant!r}, not by the job's tenant", self.id)
        if self.precision.__class__ is not Precision:
            try:
                object.__setattr__(self, "precision", Precision(self.precision))
            except ValueError:
                raise ValidationError(
                    "precision", f"must be one of {', '.join(p.value for p in Precision)}", self.precision
                ) from None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def micro_batches_total(self) -> int:
        """Micro-batches per step before data parallelism: ``global_batch / micro_batch``."""
        return self.global_batch // self.micro_batch


class Schedule(StrEnum):
    """Pipeline schedules. ``LATENCY_AWARE`` deepens warm-up to hide slow links (CrossPipe-style)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LATENCY_AWARE = "latency-aware"


class Sharding(StrEnum):
    """How a stage's data-parallel replicas hold parameters, gradients and optimizer state.

    ``REPLICATE``: every replica holds all of them and gradients are all-reduced (DDP-style).
    ``FSDP``: parameters, gradients and optimizer state are sharded over the stage's ``dp`` ranks
    (FSDP2 ``fully_shard``); parameters are all-gathered for compute, gradients reduce-scattered."""

    REPLICATE = "replicate"
    FSDP = "fsdp"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaShare:
    """``dp`` of a stage's data-parallel replicas that run on ``cluster`` (cross-cluster data parallelism)."""

    cluster: str
    dp: int

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, str) or not self.cluster:
            raise ValidationError("stage.replicas.cluster", "must be a non-empty string", self.cluster)
        _int("stage.replicas.dp", self.dp, minimum=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage (see the glossary). ``gpus == tp × dp``.

    ``sharding`` says how the ``dp`` replicas share state (:class:`Sharding`); ``recompute`` turns on
    activation checkpointing of the stage's blocks (forward activations are recomputed in backward).

    ``replicas`` (empty: all ``dp`` replicas on ``cluster``) spreads the replicas over several clusters —
    cross-cluster data parallelism: the shares' ``dp`` sum to ``dp``, the first share is on ``cluster``, no
    cluster appears twice. Gradients are then reduced inside each cluster, all-reduced across the clusters
    (one rank per cluster and tp index) and broadcast back. Only replicated stages may span clusters."""

    cluster: str
    first_layer: int
    last_layer: int
    tp: int = 1
    dp: int = 1
    sharding: Sharding = Sharding.REPLICATE
    recompute: bool = False
    replicas: tuple[ReplicaShare, ...] = ()

    def __post_init__(self) -> None:
        _int("stage.first_layer", self.first_layer, minimum=0)
        _int("stage.last_layer", self.last_layer, minimum=self.first_layer)
        _int("stage.tp", self.tp, minimum=1)
        _int("stage.dp", self.dp, minimum=1)
        if self.sharding.__class__ is not Sharding:
            try:
                object.__setattr__(self, "sharding", Sharding(self.sharding))
            except ValueError:
                raise ValidationError(
                    "stage.sharding", f"must be one of {', '.join(v.value for v in Sharding)}", self.sharding
                ) from None
        if self.recompute is not False and self.recompute is not True:
            raise ValidationError("stage.recompute", "must be true or false", self.recompute)
        if self.replicas:
            object.__setattr__(self, "replicas", tuple(self.replicas))
            clusters = [r.cluster for r in self.replicas]
            if sum(r.dp for r in self.replicas) != self.dp:
                raise ValidationError("stage.replicas", f"their dp must sum to the stage's dp ({self.dp})",
                                      [r.dp for r in self.replicas])
            if clusters[0] != self.cluster:
                raise ValidationError("stage.replicas", f"the first share must be on the stage's cluster "
                                      f"({self.cluster})", clusters[0])
            if len(set(clusters)) != len(clusters):
                raise ValidationError("stage.replicas", "name a cluster more than once", clusters)
            if len(clusters) > 1 and self.sharding is Sharding.FSDP:
                raise ValidationError("stage.replicas", "span clusters, which only a replicated stage may",
                                      self.sharding.value)

    @property
    def clusters(self) -> tuple[str, ...]:
        """The clusters the stage runs on (its own first)."""
        return tuple(r.cluster for r in self.replicas) if self.replicas else (self.cluster,)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A parallelization plan and its predictions (``step_time_s`` etc. are filled by the cost model)."""

    stages: tuple[Stage, ...]
    micro_batches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    step_time_s: float = 0.0
    throughput_tokens_per_s: float = 0.0
    memory_gib_per_gpu: tuple[float, ...] = ()
    usd_per_step: float = 0.0
    extras: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValidationError("plan.stages", "a plan needs at least one stage", ())
        _int("plan.micro_batches", self.micro_batches, minimum=1)
        expected = 0
        for i, s in enumerate(self.stages):
            if s.first_layer != expected:
                raise ValidationError(
                    f"plan.stages[{i}].first_layer", f"must be {expected} (stages are contiguous)", s.first_layer
                )
            expected = s.last_layer + 1

    @property
    def layers(self) -> int:
        return self.stages[-1].last_layer + 1

    @property
    def gpus(self) -> int:
        return sum(s.gpus for s in self.stages)

    @property
    def chain(self) -> tuple[str, ...]:
        """Clusters in pipeline order, consecutive duplicates collapsed."""
        out: list[str] = []
        for s in self.stages:
            if not out or out[-1] != s.cluster:
                out.append(s.cluster)
        return tuple(out)

    def gpus_by_cluster(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.stages:
            out[s.cluster] = out.get(s.cluster, 0) + s.gpus
        return out


# ----------------------------------------------------------------------------------------------------------
# Placement and planning vocabulary: what a decision is asked under (Objective, Budget, Release, PlanOptions)
# and what it answers (PlacementStatus, Wait, PlacementResult). The policies (spiderflow.core.placement), the
# planners (spiderflow.core.tpa, the Planner service) and the scheduling cycle (spiderflow.core.cycle) share them.

__all__ += ["Budget", "Objective", "PlacementResult", "PlacementStatus", "PlanOptions", "Release", "Wait"]


class Objective(StrEnum):
    """What a policy optimises: step time (``jct``), dollars per step (``cost``), or their product-like
    blend (``balanced``: minimise step_time × usd_per_step^0.5)."""

    JCT = "jct"
    COST = "cost"
    BALANCED = "balanced"


class PlacementStatus(StrEnum):
    """``SUCCESS``; ``WAIT`` (starting later, on GPUs being released, is better than starting now: the
    result's :class:`Wait` says until when and on which plan); ``UNSCHEDULABLE`` (may fit later, e.g. when
    GPUs free up); ``UNRESOLVABLE`` (can never fit this topology, e.g. the model exceeds total memory);
    ``ERROR`` (the policy itself failed)."""

    SUCCESS = "success"
    WAIT = "wait"
    UNSCHEDULABLE = "unschedulable"
    UNRESOLVABLE = "unschedulable-and-unresolvable"
    ERROR = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """GPUs the scheduler expects back ``after_s`` seconds from the decision (a running job's estimated
    end): ``gpus`` is ``((cluster, count), ...)``. A negative count is a reservation: GPUs another job,
    waiting for earlier releases, will take from then on (it gives them back in a later release)."""

    after_s: float
    gpus: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """Search limits. ``time_limit_s`` caps wall time where the policy supports it (ILP, genetic);
    ``seed`` seeds the policy's own ``numpy.random.Generator``; ``objective`` selects the score.

    ``releases`` (sorted by ``after_s``) is what the scheduler knows about GPUs coming back; it is given
    only to a policy that prices waiting itself, which may answer :attr:`PlacementStatus.WAIT` when
    starting later on the released GPUs scores better than starting now. Empty: no such information.

    ``demand_gpus`` is the demand on the pool besides this job that the scheduler sees at this decision:
    the GPUs held by running jobs plus the minimum GPUs of every other queued job not placed (yet) in this
    cycle. A policy may price the GPUs a plan holds by it (SpinSearch's ``gpu_price``); 0: an idle pool
    and an empty queue, or the caller does not know.

    ``outlook`` is what the scheduler has seen of the arrivals (:class:`Outlook`), given only to a policy
    that looks ahead (SpinSearch's ``lookahead``); ``None``: not known or not asked for."""

    time_limit_s: float | None = None
    seed: int = 0
    objective: Objective = Objective.JCT
    releases: tuple[Release, ...] = ()
    demand_gpus: int = 0
    outlook: Outlook | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Outlook:
    """The arrivals a scheduler has seen, as an online forecast of the jobs still to come: ``rate_per_s``
    the observed arrival rate (jobs per second, > 0) and ``mix`` the specs of the most recent arrivals (the
    empirical job mix; their ``steps`` are the whole jobs')."""

    rate_per_s: float
    mix: tuple[JobSpec, ...]

    def __post_init__(self) -> None:
        if not (isinstance(self.rate_per_s, int | float) and math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise ValidationError("outlook.rate_per_s", "must be a finite number > 0", self.rate_per_s)
        if not self.mix:
            raise ValidationError("outlook.mix", "must hold at least one job", len(self.mix))


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """How a planner plans one allocation: the ``objective``; ``explain=False`` when the caller holds
    another plan of the chain and only needs to know that this one does not fit (the error may then be
    the cheaper one; the plans are the same); ``max_in_flight`` caps the micro-batches in flight per stage
    replica (``None``: no cap)."""

    objective: Objective = Objective.JCT
    explain: bool = True
    max_in_flight: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    """A decision to wait: start ``after_s`` seconds from the decision on ``plan`` (planned on the GPUs
    expected free then), because ``reason`` (the scores of waiting and starting now)."""

    after_s: float
    plan: Plan
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementResult:
    """A policy's answer. ``plan`` is set on ``SUCCESS``; on ``WAIT`` ``wait`` says until when and
    ``plan`` is the plan it waits for (``wait.plan``), which the scheduler may reserve for it."""

    status: PlacementStatus
    policy: str
    plan: Plan | None = None
    planning_seconds: float = 0.0
    optimal: bool | None = None
    reason: str = ""
    constraint: str = ""
    stats: dict[str, float] = field(default_factory=dict)
    wait: Wait | None = None

    @property
    def ok(self) -> bool:
        return self.status is PlacementStatus.SUCCESS and self.plan is not None
