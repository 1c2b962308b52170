"""Device, process groups and in-stage parallelism of one worker: the same code on CPU (gloo) and GPU (NCCL).

- :func:`pick_device`: ``cuda:N`` (``N`` = local rank modulo the visible GPUs) where CUDA is available,
  else ``cpu``; :func:`backends` names the collective backends for that device;
- :class:`Groups`: every process group of a plan, created collectively in one fixed order on every rank —
  per stage the ``dp × tp`` :class:`~torch.distributed.device_mesh.DeviceMesh` (``tp`` groups: one
  replica's ranks; ``dp`` groups: one tp index across the stage's replicas; with replicas on several
  clusters also the per-cluster and cross-cluster groups of the hierarchical all-reduce) and one
  point-to-point group per pipeline *channel* (a virtual-stage link and a direction), so sends and
  receives on a channel match by issue order alone;
- :func:`parallelize_stage`: tensor parallelism (``parallelize_module`` with each block's
  ``tp_plan()``), activation checkpointing (``Stage.recompute``), FSDP2 ``fully_shard`` per block and on
  the stage root (``Stage.sharding == fsdp``);
- :class:`FsdpSync`: FSDP inside a pipeline. Replicas of a stage run different micro-batches at different
  times, so no collective may run inside a micro-batch: parameters are all-gathered once at the start of
  a step, gradients accumulate unsharded without communication, and one reduce-scatter (a sum) runs at
  the end of the step — the same protocol ``torch.distributed.pipelining`` uses for FSDP stages;
- :class:`Precision` handling: :func:`autocast` (bf16/fp16 compute, fp32 master weights and optimizer
  state), :class:`LossScaler` (fp16 dynamic loss scaling, one decision for the whole job).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spiderflow.core.domain import Precision, Sharding, Stage

__all__ = [
    "FsdpSync",
    "Groups",
    "LossScaler",
    "autocast",
    "backends",
    "compute_dtype",
    "parallelize_stage",
    "pick_device",
    "wire_dtype",
]


def pick_device(local_rank: int) -> torch.device:
    """``cuda:N`` with ``N = local_rank mod visible GPUs`` when CUDA is available, else ``cpu``.

    ``LOCAL_RANK`` in the environment (torchrun, Slurm wrappers) takes precedence over ``local_rank``."""
    env = os.environ.get("LOCAL_RANK")
    if env is not None and env.isdigit():
        local_rank = int(env)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def backends(device: torch.device) -> tuple[str, str]:
    """``(default process group backend, in-cluster collective backend)`` for ``device``: on GPUs
    ``cpu:gloo,cuda:nccl`` (CPU objects such as barriers and the loss stay on gloo) and ``nccl``; on CPU
    ``gloo`` for both."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl", "nccl"
    return "gloo", "gloo"


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype matmuls run in."""
    return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(precision, torch.float32)


def wire_dtype(precision: Precision) -> torch.dtype:
    """The dtype of activations and gradients sent between stages (:attr:`Precision.value_bytes`)."""
    return compute_dtype(precision)


@contextlib.contextmanager
def autocast(device: torch.device, precision: Precision) -> Iterator[None]:
    """Mixed-precision compute for bf16/fp16 (parameters stay fp32: master weights and optimizer state);
    TF32 matmuls for tf32; nothing for fp32."""
    if precision in (Precision.BF16, Precision.FP16):
        with torch.autocast(device_type=device.type, dtype=compute_dtype(precision)):
            yield
        return
    if device.type == "cuda":
        tf32 = precision is Precision.TF32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    yield


class LossScaler:
    """Dynamic loss scaling for fp16 (identity otherwise): the last stage back-propagates ``loss · scale``,
    every rank unscales its gradients, one all-reduce over the whole job decides whether any gradient
    overflowed; on overflow every rank skips the step and the scale halves, after ``interval`` clean steps
    it doubles."""

    def __init__(self, precision: Precision, *, init_scale: float = 2.0**16, interval: int = 2000) -> None:
        self.enabled = precision is Precision.FP16
        self.scale = init_scale if self.enabled else 1.0
        self.interval = interval
        self._clean = 0
        self.skipped = 0

    def unscale_and_check(self, params: Sequence[torch.Tensor], device: torch.device) -> bool:
        """Divide gradients by the scale; True when the step may be applied (no rank saw inf/nan)."""
        if not self.enabled:
            return True
        bad = torch.zeros(1, device=device)
        for p in params:
            if p.grad is not None:
                g = _local(p.grad)
                g.div_(self.scale)
                bad += (~torch.isfinite(g)).any().float()
        dist.all_reduce(bad)
        if float(bad.item()) > 0:
            self.scale /= 2
            self._clean = 0
            self.skipped += 1
            return False
        self._clean += 1
        if self._clean >= self.interval:
            self.scale *= 2
            self._clean = 0
        return True


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


# ------------------------------------------------------------------------------------------- process groups


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCoord:
    """Where a rank sits: stage, replica (global within the stage), tp index, and the replica's cluster."""

    rank: int
    stage: int
    replica: int
    tp_rank: int
    cluster: str


def stage_replica_clusters(stage: Stage) -> tuple[str, ...]:
    """The cluster of each of the stage's ``dp`` replicas (``Stage.replicas`` when it spans clusters)."""
    shares = stage.replicas
    if not shares:
        return (stage.cluster,) * stage.dp
    return tuple(c for share in shares for c in (share.cluster,) * share.dp)


class Groups:
    """All process groups of a plan, built on every rank in the same order (group creation is
    collective); this rank keeps handles to its own.

    ``first_rank[s]`` is stage ``s``'s first global rank; the rank of (stage ``s``, replica ``r``, tp index
    ``t``) is ``first_rank[s] + r · tp_s + t``."""

    def __init__(
        self, stages: Sequence[Stage], rank: int, *, device: torch.device, channels: Sequence[tuple[int, int]],
        channel_backend: Callable[[int, int], str],
    ) -> None:
        _, local_backend = backends(device)
        self.device = device
        self.first_rank: list[int] = []
        n = 0
        for st in stages:
            self.first_rank.append(n)
            n += st.dp * st.tp
        self.world = n
        me = self.coord_of(stages, rank)
        self.me = me
        self.tp_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        self.dp_local_group: dist.ProcessGroup | None = None  # this cluster's replicas (cross-cluster dp)
        self.dp_cross_group: dist.ProcessGroup | None = None  # one leader per cluster (cross-cluster dp)
        self.dp_local_leader: int = rank
        self.mesh: Any = None
        for s, st in enumerate(stages):
            base = self.first_rank[s]
            tp_groups = {}
            for r in range(st.dp):
                ranks = [base + r * st.tp + t for t in range(st.tp)]
                tp_groups[r] = dist.new_group(ranks, backend=local_backend)
            dp_groups = {}
            clusters = stage_replica_clusters(st)
            for t in range(st.tp):
                ranks = [base + r * st.tp + t for r in range(st.dp)]
                dp_groups[t] = dist.new_group(ranks, backend=local_backend)
                if len(set(clusters)) > 1:
                    order = list(dict.fromkeys(clusters))
                    leaders = []
                    for c in order:
                        members = [base + r * st.tp + t for r in range(st.dp) if clusters[r] == c]
                        g = dist.new_group(members, backend=local_backend)
                        leaders.append(members[0])
                        if s == me.stage and t == me.tp_rank and rank in members:
                            self.dp_local_group = g
                            self.dp_local_leader = members[0]
                    cross = dist.new_group(leaders, backend="gloo")  # crosses clusters: TCP
                    if s == me.stage and t == me.tp_rank and rank in leaders:
                        self.dp_cross_group = cross
            if s == me.stage:
                self.tp_group = tp_groups[me.replica]
                self.dp_group = dp_groups[me.tp_rank]
                from torch.distributed.device_mesh import DeviceMesh

                mesh = torch.arange(base, base + st.dp * st.tp).reshape(st.dp, st.tp)
                self.mesh = DeviceMesh.from_group(
                    [self.dp_group, self.tp_group], device.type, mesh=mesh, mesh_dim_names=("dp", "tp")
                )
        self.channels: dict[tuple[int, int], dist.ProcessGroup] = {}
        for key in channels:  # (virtual link u → u+1, direction 0 forward / 1 backward)
            a, b = key[0] % len(stages), (key[0] + 1) % len(stages)
            members = sorted(set(self.stage_ranks(a)) | set(self.stage_ranks(b)))
            backend = channel_backend(a, b)
            g = dist.new_group(members, backend=backend)
            if rank in members:
                self.channels[key] = g
        self.channel_backends = {key: channel_backend(key[0] % len(stages), (key[0] + 1) % len(stages))
                                 for key in channels}

    def stage_ranks(self, s: int) -> range:
        end = self.first_rank[s + 1] if s + 1 < len(self.first_rank) else self.world
        return range(self.first_rank[s], end)

    def coord_of(self, stages: Sequence[Stage], rank: int) -> RankCoord:
        for s, st in enumerate(stages):
            local = rank - self.first_rank[s]
            if 0 <= local < st.dp * st.tp:
                replica, t = divmod(local, st.tp)
                return RankCoord(rank=rank, stage=s, replica=replica, tp_rank=t,
                                 cluster=stage_replica_clusters(st)[replica])
        raise ValueError(f"rank {rank} is outside the plan's {self.world} ranks")


# --------------------------------------------------------------------------------------- stage parallelism


def _recompute(block: nn.Module) -> None:
    """Activation checkpointing of one block without renaming its parameters (the forward is wrapped in
    ``torch.utils.checkpoint``; hooks of submodules, e.g. tensor parallelism's, run again on recompute)."""
    inner = block.forward

    def forward(*args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False)

    block.forward = forward


def _blocks(module: nn.Module) -> list[nn.Module]:
    layers = getattr(module, "layers", None)
    return [] if layers is None else list(layers.values())


def parallelize_stage(module: nn.Module, stage: Stage, groups: Groups) -> list[nn.Module]:
    """Apply the stage's tensor parallelism, recomputation and sharding to ``module`` in place (its
    parameters must be on ``groups.device`` already); returns the FSDP modules (empty when replicated).

    Tensor parallelism uses each block's ``tp_plan()`` (``{submodule path: "colwise" | "rowwise"}``) on
    the mesh's ``tp`` dimension; embeddings, norms and the head stay replicated (their gradients are equal
    on every tp rank because DTensor reduces the gradient of the blocks' replicated inputs)."""
    mesh = groups.mesh
    if stage.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for block in _blocks(module):
            tp_plan = getattr(block, "tp_plan", None)
            if tp_plan is None:
                raise TypeError(f"{type(block).__name__} has no tp_plan(); it cannot run with tp > 1")
            plan = {path: styles[style]() for path, style in tp_plan().items()}
            parallelize_module(block, mesh["tp"], plan)
    if stage.recompute:
        for block in _blocks(module):
            _recompute(block)
    if stage.sharding is not Sharding.FSDP or stage.dp == 1:
        return []
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh["dp"]
    shard: list[nn.Module] = []
    for block in _blocks(module):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        shard.append(block)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
    shard.append(module)
    return shard


class FsdpSync:
    """FSDP2 modules of one stage driven at step granularity (see the module docstring)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        for mod in self.modules:
            mod.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # gradients are summed over replicas
            mod.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # plain SUM (gloo has no PreMulSum)
            mod.set_reduce_scatter_unused_params(True, recurse=False)  # type: ignore[operator]

    def begin_step(self) -> None:
        """All-gather every parameter once (collective over the stage's dp group, same order on every
        replica) and stop per-micro-batch communication."""
        for mod in self.modules:
            mod.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
            mod.set_reshard_after_backward(False, recurse=False)  # type: ignore[operator]
            mod.set_is_last_backward(False)  # type: ignore[operator]
        for mod in self.modules:
            mod.unshard()  # type: ignore[operator]

    def end_step(self) -> None:
        """Reduce-scatter the accumulated gradients (a sum over replicas) and reshard."""
        from torch.distributed.fsdp import fully_shard

        for mod in self.modules:
            mod.set_is_last_backward(True)  # type: ignore[operator]
            mod.set_reshard_after_backward(True, recurse=False)  # type: ignore[operator]
            mod.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]
        root = self.modules[-1]
        state = fully_shard.state(root)  # type: ignore[attr-defined]
        for st in state._state_ctx.all_states:
            for group in st._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
