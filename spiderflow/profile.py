"""Hardware profiles: measured rates and bandwidths that replace the cost model's catalog constants.

A profile is a plain JSON or YAML document (format in ``docs/profiles.md``)::

    version: 1
    gpus:
      H100-80G:                       # a GPU type of the catalog (or "cpu")
        matmul_tflops: {bf16: 720.0, tf32: 360.0, fp32: 50.0}
        mfu: 0.45                     # achieved share of matmul_tflops in training blocks (optional)
        layer_overhead_ms: 0.0        # fixed time per block and micro-batch, forward + backward
        optimizer_ms_per_layer: 0.0
        memory_overhead_gib: 4.0      # framework + allocator reserve per GPU
        nccl:
          intra_node: {allreduce_gbps: 2900.0, p2p_gbps: 3000.0, latency_us: 12.0}
          inter_node: {allreduce_gbps: 380.0, p2p_gbps: 390.0, latency_us: 25.0}
        blocks:                       # measured transformer blocks (optional)
          - {hidden: 4096, heads: 32, precision: bf16, micro_batch: 1, seq_len: 8192, tp: 1,
             forward_ms: 14.2, backward_ms: 29.1}
        embedding:                    # measured embedding / head + loss per micro-batch (optional)
          - {hidden: 4096, vocab: 128256, precision: bf16, micro_batch: 1, seq_len: 8192,
             forward_ms: 0.3, backward_ms: 2.9, optimizer_ms: 6.1}
        head: [...]                   # the same keys
        data:                         # the host's input pipeline (optional)
          - {seq_len: 8192, ms_per_sample: 2.4}
    clusters:                         # per-cluster overrides of the same keys (optional)
      east: {nccl: {inter_node: {allreduce_gbps: 200.0}}}

:func:`apply_profile` folds a profile into a topology, so every consumer of the topology — the cost model,
both TPA levels, the timeline, the simulator — prices with it unchanged:

- compute: a cluster's ``tflops``/``mfu`` become the profile's rate. Where measured blocks of the job's
  shape (``hidden``, ``heads``, ``precision``) exist, the rate is interpolated from them at the job's
  ``micro_batch × seq_len`` (log-linear in tokens per micro-batch between the nearest measured sizes,
  clamped at the ends) as ``3·f / (tp · (forward + backward))`` with ``f`` the block's forward FLOPs, and
  ``mfu`` is 1 (the blocks are the training rate). Else ``matmul_tflops[precision] × mfu``.
- communication: ``intra_node_gbps``/``inter_node_gbps`` become the measured all-reduce bus bandwidths.
- outside the blocks: measured embedding and head (with its loss) entries of the job's shape become the
  cluster's forward + backward µs per token (interpolated like the blocks) and their optimizer steps, the
  data entry its input pipeline per sample (:func:`outer_us_per_token`, :func:`data_ms_per_sample`;
  priced by :func:`spiderflow.core.costmodel.measured_outer_time` and ``measured_step_extra``).
- memory: the device memory the planner may use shrinks by the measured overhead beyond the cost model's
  fixed reserve (:data:`spiderflow.core.costmodel.RESERVED_GIB`).

Everything here except :func:`load_profile` is pure.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from spiderflow.core.catalog import GPU_CATALOG, ModelSpec
from spiderflow.core.costmodel import RESERVED_GIB, layer_fwd_flops
from spiderflow.core.domain import Cluster, Precision, Topology
from spiderflow.core.errors import ValidationError

__all__ = [
    "BlockTiming",
    "DataTiming",
    "DeviceEntry",
    "LinkEntry",
    "OuterTiming",
    "Profile",
    "apply_profile",
    "block_rate_tflops",
    "data_ms_per_sample",
    "load_profile",
    "outer_us_per_token",
    "parse_profile",
    "profile_to_dict",
]

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockTiming:
    """One measured transformer block: forward and backward milliseconds of one micro-batch on one GPU."""

    hidden: int
    heads: int
    precision: Precision
    micro_batch: int
    seq_len: int
    tp: int
    forward_ms: float
    backward_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterTiming:
    """The embedding, or the head with its loss, measured: forward and backward milliseconds of one micro-batch
    on one GPU, and (optional) the optimizer step over its parameters per training step."""

    hidden: int
    vocab: int
    precision: Precision
    micro_batch: int
    seq_len: int
    forward_ms: float
    backward_ms: float
    optimizer_ms: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DataTiming:
    """The host's input pipeline: milliseconds per sample of ``seq_len`` tokens drawn and copied to the GPU."""

    seq_len: int
    ms_per_sample: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkEntry:
    """Measured collective figures of one link class (inside a node or across nodes)."""

    allreduce_gbps: float | None = None
    p2p_gbps: float | None = None
    latency_us: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceEntry:
    """What a profile says about one GPU type (or, under ``clusters``, one cluster)."""

    matmul_tflops: Mapping[str, float] = field(default_factory=dict)
    mfu: float | None = None
    layer_overhead_ms: float | None = None
    optimizer_ms_per_layer: float | None = None
    memory_overhead_gib: float | None = None
    intra_node: LinkEntry = LinkEntry()
    inter_node: LinkEntry = LinkEntry()
    blocks: tuple[BlockTiming, ...] = ()
    embedding: tuple[OuterTiming, ...] = ()
    head: tuple[OuterTiming, ...] = ()
    data: tuple[DataTiming, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """A parsed profile: entries per GPU type and per-cluster overrides."""

    gpus: Mapping[str, DeviceEntry]
    clusters: Mapping[str, DeviceEntry] = field(default_factory=dict)


def _num(path: str, v: Any, *, positive: bool = True, nonneg: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(float(v)):
        raise ValidationError(path, "must be a finite number", v)
    x = float(v)
    if positive and not nonneg and x <= 0:
        raise ValidationError(path, "must be > 0", v)
    if nonneg and x < 0:
        raise ValidationError(path, "must be ≥ 0", v)
    return x


def _int(path: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValidationError(path, "must be a positive integer", v)
    return int(v)


def _mapping(path: str, v: Any) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise ValidationError(path, "must be a mapping", v)
    return v


def _link(path: str, v: Any) -> LinkEntry:
    d = _mapping(path, v)
    known = {"allreduce_gbps", "p2p_gbps", "latency_us"}
    for k in d:
        if k not in known:
            raise ValidationError(f"{path}.{k}", f"unknown key (known: {', '.join(sorted(known))})", k)
    return LinkEntry(
        allreduce_gbps=_num(f"{path}.allreduce_gbps", d["allreduce_gbps"]) if "allreduce_gbps" in d else None,
        p2p_gbps=_num(f"{path}.p2p_gbps", d["p2p_gbps"]) if "p2p_gbps" in d else None,
        latency_us=_num(f"{path}.latency_us", d["latency_us"], nonneg=True) if "latency_us" in d else None,
    )


def _precision(path: str, v: Any) -> Precision:
    try:
        return Precision(v)
    except ValueError:
        raise ValidationError(path, f"must be one of {', '.join(p.value for p in Precision)}", v) from None


_OUTER_KEYS = ("hidden", "vocab", "precision", "micro_batch", "seq_len", "forward_ms", "backward_ms", "optimizer_ms")


def _list(path: str, v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValidationError(path, "must be a list", v)
    return v


def _known(path: str, d: Mapping[str, Any], known: tuple[str, ...], required: tuple[str, ...]) -> None:
    for k in d:
        if k not in known:
            raise ValidationError(f"{path}.{k}", f"unknown key (known: {', '.join(sorted(known))})", k)
    for k in required:
        if k not in d:
            raise ValidationError(f"{path}.{k}", "is required", None)


def _outer_list(path: str, v: Any) -> tuple[OuterTiming, ...]:
    out = []
    for i, raw in enumerate(_list(path, v)):
        p = f"{path}[{i}]"
        d = _mapping(p, raw)
        _known(p, d, _OUTER_KEYS, ("hidden", "vocab", "micro_batch", "seq_len", "forward_ms", "backward_ms"))
        out.append(OuterTiming(
            hidden=_int(f"{p}.hidden", d["hidden"]), vocab=_int(f"{p}.vocab", d["vocab"]),
            precision=_precision(f"{p}.precision", d.get("precision", "bf16")),
            micro_batch=_int(f"{p}.micro_batch", d["micro_batch"]), seq_len=_int(f"{p}.seq_len", d["seq_len"]),
            forward_ms=_num(f"{p}.forward_ms", d["forward_ms"]), backward_ms=_num(f"{p}.backward_ms", d["backward_ms"]),
            optimizer_ms=(_num(f"{p}.optimizer_ms", d["optimizer_ms"], nonneg=True) if "optimizer_ms" in d else None),
        ))
    return tuple(out)


def _data_list(path: str, v: Any) -> tuple[DataTiming, ...]:
    out = []
    for i, raw in enumerate(_list(path, v)):
        p = f"{path}[{i}]"
        d = _mapping(p, raw)
        _known(p, d, ("seq_len", "ms_per_sample"), ("seq_len", "ms_per_sample"))
        out.append(DataTiming(seq_len=_int(f"{p}.seq_len", d["seq_len"]),
                              ms_per_sample=_num(f"{p}.ms_per_sample", d["ms_per_sample"], nonneg=True)))
    return tuple(out)


def _entry(path: str, v: Any) -> DeviceEntry:
    d = _mapping(path, v)
    known = {"matmul_tflops", "mfu", "layer_overhead_ms", "optimizer_ms_per_layer", "memory_overhead_gib", "nccl",
             "blocks", "embedding", "head", "data"}
    for k in d:
        if k not in known:
            raise ValidationError(f"{path}.{k}", f"unknown key (known: {', '.join(sorted(known))})", k)
    mt = {str(_precision(f"{path}.matmul_tflops", k)): _num(f"{path}.matmul_tflops.{k}", x)
          for k, x in _mapping(f"{path}.matmul_tflops", d.get("matmul_tflops", {})).items()}
    mfu = _num(f"{path}.mfu", d["mfu"]) if "mfu" in d else None
    if mfu is not None and mfu > 1:
        raise ValidationError(f"{path}.mfu", "must be in (0, 1]", d["mfu"])
    nccl = _mapping(f"{path}.nccl", d.get("nccl", {}))
    for k in nccl:
        if k not in ("intra_node", "inter_node"):
            raise ValidationError(f"{path}.nccl.{k}", "unknown key (known: inter_node, intra_node)", k)
    blocks_raw = d.get("blocks", [])
    if not isinstance(blocks_raw, list):
        raise ValidationError(f"{path}.blocks", "must be a list", blocks_raw)
    blocks = []
    for i, b in enumerate(blocks_raw):
        bp = f"{path}.blocks[{i}]"
        bd = _mapping(bp, b)
        for k in ("hidden", "heads", "micro_batch", "seq_len", "forward_ms", "backward_ms"):
            if k not in bd:
                raise ValidationError(f"{bp}.{k}", "is required", None)
        blocks.append(BlockTiming(
            hidden=_int(f"{bp}.hidden", bd["hidden"]), heads=_int(f"{bp}.heads", bd["heads"]),
            precision=_precision(f"{bp}.precision", bd.get("precision", "bf16")),
            micro_batch=_int(f"{bp}.micro_batch", bd["micro_batch"]), seq_len=_int(f"{bp}.seq_len", bd["seq_len"]),
            tp=_int(f"{bp}.tp", bd.get("tp", 1)), forward_ms=_num(f"{bp}.forward_ms", bd["forward_ms"]),
            backward_ms=_num(f"{bp}.backward_ms", bd["backward_ms"]),
        ))
    return DeviceEntry(
        embedding=_outer_list(f"{path}.embedding", d.get("embedding", [])),
        head=_outer_list(f"{path}.head", d.get("head", [])),
        data=_data_list(f"{path}.data", d.get("data", [])),
        matmul_tflops=mt, mfu=mfu,
        layer_overhead_ms=(_num(f"{path}.layer_overhead_ms", d["layer_overhead_ms"], nonneg=True)
                           if "layer_overhead_ms" in d else None),
        optimizer_ms_per_layer=(_num(f"{path}.optimizer_ms_per_layer", d["optimizer_ms_per_layer"], nonneg=True)
                                if "optimizer_ms_per_layer" in d else None),
        memory_overhead_gib=(_num(f"{path}.memory_overhead_gib", d["memory_overhead_gib"], nonneg=True)
                             if "memory_overhead_gib" in d else None),
        intra_node=_link(f"{path}.nccl.intra_node", nccl.get("intra_node", {})),
        inter_node=_link(f"{path}.nccl.inter_node", nccl.get("inter_node", {})),
        blocks=tuple(blocks),
    )


def parse_profile(doc: Any) -> Profile:
    """Validate a profile document (the mapping of ``docs/profiles.md``); :class:`ValidationError` naming the
    field (``profile.gpus.H100-80G.mfu`` …) on bad input."""
    d = _mapping("profile", doc)
    for k in d:
        if k not in ("version", "gpus", "clusters", "source"):
            raise ValidationError(f"profile.{k}", "unknown key (known: clusters, gpus, source, version)", k)
    if d.get("version", PROFILE_VERSION) != PROFILE_VERSION:
        raise ValidationError("profile.version", f"must be {PROFILE_VERSION}", d.get("version"))
    gpus = {}
    for name, v in _mapping("profile.gpus", d.get("gpus", {})).items():
        if name not in GPU_CATALOG:
            raise ValidationError(f"profile.gpus.{name}", f"unknown GPU type (known: {', '.join(sorted(GPU_CATALOG))})",
                                  name)
        gpus[str(name)] = _entry(f"profile.gpus.{name}", v)
    clusters = {str(n): _entry(f"profile.clusters.{n}", v)
                for n, v in _mapping("profile.clusters", d.get("clusters", {})).items()}
    return Profile(gpus=gpus, clusters=clusters)


def load_profile(path: str | Path) -> Profile:
    """Read and validate a JSON or YAML profile file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValidationError("profile", f"cannot read {p}: {e.strerror}", str(p)) from None
    try:
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as e:  # any parse error is the file's fault
        raise ValidationError("profile", f"{p} is not valid {p.suffix.lstrip('.') or 'JSON'}: {e}", str(p)) from None
    return parse_profile(doc)


def _link_dict(e: LinkEntry) -> dict[str, float]:
    return {k: v for k, v in (("allreduce_gbps", e.allreduce_gbps), ("p2p_gbps", e.p2p_gbps),
                              ("latency_us", e.latency_us)) if v is not None}


def _entry_dict(e: DeviceEntry) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if e.matmul_tflops:
        out["matmul_tflops"] = dict(e.matmul_tflops)
    for k in ("mfu", "layer_overhead_ms", "optimizer_ms_per_layer", "memory_overhead_gib"):
        if getattr(e, k) is not None:
            out[k] = getattr(e, k)
    nccl = {k: d for k, d in (("intra_node", _link_dict(e.intra_node)), ("inter_node", _link_dict(e.inter_node)))
            if d}
    if nccl:
        out["nccl"] = nccl
    if e.blocks:
        out["blocks"] = [{"hidden": b.hidden, "heads": b.heads, "precision": b.precision.value,
                          "micro_batch": b.micro_batch, "seq_len": b.seq_len, "tp": b.tp,
                          "forward_ms": b.forward_ms, "backward_ms": b.backward_ms} for b in e.blocks]
    for key, entries in (("embedding", e.embedding), ("head", e.head)):
        if entries:
            out[key] = [{"hidden": o.hidden, "vocab": o.vocab, "precision": o.precision.value,
                         "micro_batch": o.micro_batch, "seq_len": o.seq_len, "forward_ms": o.forward_ms,
                         "backward_ms": o.backward_ms,
                         **({} if o.optimizer_ms is None else {"optimizer_ms": o.optimizer_ms})} for o in entries]
    if e.data:
        out["data"] = [{"seq_len": x.seq_len, "ms_per_sample": x.ms_per_sample} for x in e.data]
    return out


def profile_to_dict(p: Profile) -> dict[str, Any]:
    """The document form of ``p`` (round-trips through :func:`parse_profile`)."""
    out: dict[str, Any] = {"version": PROFILE_VERSION, "gpus": {n: _entry_dict(e) for n, e in p.gpus.items()}}
    if p.clusters:
        out["clusters"] = {n: _entry_dict(e) for n, e in p.clusters.items()}
    return out


def block_rate_tflops(
    blocks: tuple[BlockTiming, ...], model: ModelSpec, precision: Precision, micro_batch: int, seq_len: int
) -> float | None:
    """Training rate (TFLOPS per GPU, forward + backward) of ``model``'s blocks at ``micro_batch × seq_len``,
    interpolated log-linearly in tokens per micro-batch from the measured tp-1 blocks of the same shape and
    precision (tp > 1 blocks are used when no tp-1 block exists: their rate is per GPU, ``tp·…``); clamped
    to the nearest measured size outside the range; ``None`` without a matching block."""
    pts: list[tuple[float, float]] = []
    for tp_wanted in (1, None):
        for b in blocks:
            if (b.hidden, b.heads, b.precision) != (model.hidden, model.heads, precision):
                continue
            if tp_wanted is not None and b.tp != tp_wanted:
                continue
            f = layer_fwd_flops(model, b.micro_batch, b.seq_len)
            rate = 3.0 * f / (b.tp * (b.forward_ms + b.backward_ms) / 1e3) / 1e12
            pts.append((math.log(b.micro_batch * b.seq_len), rate))
        if pts:
            break
    if not pts:
        return None
    pts.sort()
    return _log_linear(pts, math.log(micro_batch * seq_len))


def _log_linear(pts: list[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` on the polyline through ``pts`` (sorted by ``x``), clamped to the end points."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]  # pragma: no cover - the loop always returns


def outer_us_per_token(
    entries: tuple[OuterTiming, ...], model: ModelSpec, precision: Precision, micro_batch: int, seq_len: int
) -> tuple[float, float] | None:
    """``(µs per token, optimizer ms)`` of a measured embedding or head of ``model``'s shape (``hidden``,
    ``vocab``) in ``precision``: forward + backward per token of a micro-batch, interpolated log-linearly in
    tokens per micro-batch between the nearest measured sizes and clamped at the ends (as
    :func:`block_rate_tflops`); the optimizer step the median of the entries that carry one (0 if none).
    ``None`` without a matching entry."""
    match = [o for o in entries if (o.hidden, o.vocab, o.precision) == (model.hidden, model.vocab, precision)]
    if not match:
        return None
    pts = sorted((math.log(tokens), 1e3 * (o.forward_ms + o.backward_ms) / tokens)
                 for o in match for tokens in (o.micro_batch * o.seq_len,))
    opts = sorted(o.optimizer_ms for o in match if o.optimizer_ms is not None)
    return _log_linear(pts, math.log(micro_batch * seq_len)), (opts[len(opts) // 2] if opts else 0.0)


def data_ms_per_sample(entries: tuple[DataTiming, ...], seq_len: int) -> float | None:
    """The input pipeline's milliseconds per sample at ``seq_len``: the entry of the nearest measured
    sequence length scaled by ``seq_len`` over its own (the pipeline is linear in tokens); ``None`` without
    entries."""
    if not entries:
        return None
    near = min(entries, key=lambda x: (abs(math.log(x.seq_len / seq_len)), x.seq_len))
    return near.ms_per_sample * seq_len / near.seq_len


def _merge(a: DeviceEntry | None, b: DeviceEntry | None) -> DeviceEntry | None:
    """``b`` over ``a`` field by field."""
    if a is None or b is None:
        return b if a is None else a

    def link(x: LinkEntry, y: LinkEntry) -> LinkEntry:
        return LinkEntry(allreduce_gbps=y.allreduce_gbps if y.allreduce_gbps is not None else x.allreduce_gbps,
                         p2p_gbps=y.p2p_gbps if y.p2p_gbps is not None else x.p2p_gbps,
                         latency_us=y.latency_us if y.latency_us is not None else x.latency_us)

    return DeviceEntry(
        matmul_tflops={**a.matmul_tflops, **b.matmul_tflops},
        mfu=b.mfu if b.mfu is not None else a.mfu,
        layer_overhead_ms=b.layer_overhead_ms if b.layer_overhead_ms is not None else a.layer_overhead_ms,
        optimizer_ms_per_layer=(b.optimizer_ms_per_layer if b.optimizer_ms_per_layer is not None
                                else a.optimizer_ms_per_layer),
        memory_overhead_gib=b.memory_overhead_gib if b.memory_overhead_gib is not None else a.memory_overhead_gib,
        intra_node=link(a.intra_node, b.intra_node), inter_node=link(a.inter_node, b.inter_node),
        blocks=b.blocks or a.blocks, embedding=b.embedding or a.embedding, head=b.head or a.head,
        data=b.data or a.data,
    )


def _apply_cluster(c: Cluster, e: DeviceEntry, model: ModelSpec | None, precision: Precision,
                   micro_batch: int, seq_len: int) -> Cluster:
    changes: dict[str, Any] = {}
    rate = block_rate_tflops(e.blocks, model, precision, micro_batch, seq_len) if model is not None else None
    if rate is not None:
        # The blocks are the training rate in the job's precision; the cost model scales effective_tflops by
        # the catalog's precision ratio for fp32/tf32, so store the bf16-equivalent rate.
        gt = c.gpu_type
        scale = 1.0
        if precision in (Precision.FP32, Precision.TF32) and gt.fp32_tflops is not None:
            scale = gt.peak_tflops / gt.precision_tflops(precision.value)
        changes.update(tflops=rate * scale, mfu=1.0)
    else:
        mt = e.matmul_tflops.get("bf16") or e.matmul_tflops.get("fp16")
        if mt is None and e.matmul_tflops and c.gpu_type.fp32_tflops is None:
            mt = e.matmul_tflops.get("fp32")  # a CPU profile written in fp32 (``spiderflow profile --precision fp32``)
        if mt is not None:
            changes["tflops"] = mt
        if e.mfu is not None:
            changes["mfu"] = e.mfu
    if e.layer_overhead_ms is not None:
        changes["layer_overhead_ms"] = e.layer_overhead_ms
    if e.optimizer_ms_per_layer is not None:
        changes["optimizer_ms_per_layer"] = e.optimizer_ms_per_layer
    if e.intra_node.allreduce_gbps is not None:
        changes["intra_node_gbps"] = e.intra_node.allreduce_gbps
    if e.inter_node.allreduce_gbps is not None:
        changes["inter_node_gbps"] = e.inter_node.allreduce_gbps
    if model is not None:  # the work outside the blocks is the job's: its shape and sequence length
        for key, entries in (("embedding", e.embedding), ("head", e.head)):
            got = outer_us_per_token(entries, model, precision, micro_batch, seq_len)
            if got is not None:
                changes[f"{key}_us_per_token"], changes[f"{key}_optimizer_ms"] = got
        data = data_ms_per_sample(e.data, seq_len)
        if data is not None:
            changes["data_ms_per_sample"] = data
    if e.memory_overhead_gib is not None:
        changes["memory_gib"] = max(0.0, c.gpu_memory_gib - max(0.0, e.memory_overhead_gib - RESERVED_GIB))
    return replace(c, **changes) if changes else c


def apply_profile(
    topo: Topology, profile: Profile, *, model: ModelSpec | None = None, precision: Precision = Precision.BF16,
    micro_batch: int = 1, seq_len: int = 2048,
) -> Topology:
    """``topo`` with every cluster's figures replaced by the profile's (module docstring): the entry of the
    cluster's GPU type, overridden by the cluster's own entry. Clusters the profile does not mention are
    unchanged. ``model``/``precision``/``micro_batch``/``seq_len`` select and interpolate measured blocks and
    the work outside them (embedding, head, input pipeline: applied only for a given ``model``)."""
    out = []
    for c in topo.clusters:
        e = _merge(profile.gpus.get(c.gpu), profile.clusters.get(c.name))
        out.append(c if e is None else _apply_cluster(c, e, model, precision, micro_batch, seq_len))
    return replace(topo, clusters=tuple(out))
