"""The pipeline executor: one process per rank trains its share of a stage, on CPU (gloo) or GPU (NCCL).

Every rank runs the same code; only the device differs (:func:`spiderflow.exec.parallel.pick_device`:
``cuda:N`` from the rank's local rank where GPUs exist, else ``cpu``). Ranks are numbered stage by stage,
replica by replica, tp index by tp index (:func:`spiderflow.exec.spec.rank_layout`).

Per step (``m`` micro-batches of ``b = global_batch / m`` sequences; stage ``s`` of ``S``; this rank is tp
index ``t`` of replica ``r`` of ``dp_s``):

1. the replica's operation order is :func:`spiderflow.core.schedules.replica_ops` for the plan's schedule
   (global micro-batch numbering; micro-batch ``j`` of stage ``s`` runs on replica ``j mod dp_s``, on all
   of its ``tp_s`` ranks), warm-ups capped by the plan's in-flight cap unless ``TrainSpec.warmup`` sets
   them: exactly the orders :func:`spiderflow.core.tpa.timeline.plan_orders` simulates;
2. point-to-point traffic runs on one process group per *channel* — a virtual-stage link ``u → u+1`` and
   a direction — so messages match by issue order alone (``batch_isend_irecv``; no tags, which NCCL
   ignores): on a channel both ends issue their messages in increasing micro-batch order. A receiving tp
   rank ``t`` takes the activation from tp rank ``t mod tp_src`` of the sending replica (all tp ranks of a
   replica hold the same activation); gradients likewise. At most ``max(recv_window, 2·depth)`` receives
   are posted ahead of use, ``depth`` being the rank's forwards before its first backward (bounded
   buffers: the schedule's own in-flight count). Channels between stages on one cluster use the in-cluster
   backend (NCCL on GPUs); between clusters gloo/TCP (NCCL with ``TrainSpec.nccl_links``), GPU tensors
   crossing a gloo link are staged through pinned host memory. Values cross links in the job's
   precision (bf16/fp16 activations and gradients; fp32 otherwise);
3. ``F(j)``: the first stage embeds its tokens, others take the received activation (upcast to fp32: the
   residual stream inside a stage is fp32); compute runs under autocast in the job's precision
   (:func:`spiderflow.exec.parallel.autocast`), the last stage computes the loss;
4. ``B(j)``: the last stage back-propagates ``loss_j · scale / m`` (``scale`` is the fp16 loss scale, else
   1), others the received gradient; the gradient of the stage input goes back;
5. after the order completes: FSDP stages reduce-scatter their accumulated gradients (a sum), replicated
   stages all-reduce them over the stage's dp group (per tp index; hierarchically when the replicas span
   clusters: reduce in each cluster, all-reduce across clusters, broadcast back); fp16 unscales and skips
   the step job-wide on overflow; Adam steps on fp32 master weights.

Because the loss of micro-batch ``j`` is scaled by ``1/m`` and gradients are summed over micro-batches
and replicas, the update equals that of one process running all ``m`` micro-batches of the global batch.

In-stage parallelism (:func:`spiderflow.exec.parallel.parallelize_stage`): tensor parallelism with DTensor
on the stage's ``dp × tp`` mesh through each block's ``tp_plan()``, activation checkpointing when
``Stage.recompute``, FSDP2 when ``Stage.sharding`` is ``fsdp``.

Checkpoints (every ``K`` completed steps; :mod:`spiderflow.exec.checkpoint`): every rank saves its shards
with torch.distributed.checkpoint, all ranks sync, then rank 0 calls the manifest callback (the agent puts
the manifest in etcd; :func:`run` defaults to writing ``manifest.json``). A run resumes from the newest
complete, intact checkpoint under any other plan (layer split, tp, dp, FSDP, clusters).

Interleaved 1F1B: a stage runs ``v`` model chunks (:func:`spiderflow.exec.spec.chunk_ranges`), one module
and one Adam each; operation ``(kind, j, c)`` runs on chunk ``c``, virtual stage ``u = c·S + s``; a
hand-off between two chunks of one rank (``S = 1``) stays in memory.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from spiderflow.exec import checkpoint as ckpt
from spiderflow.exec import hf
from spiderflow.exec.data import TokenSource, micro_batch, open_data
from spiderflow.exec.model import StageModule, build_stage
from spiderflow.exec.optim import build_optimizer, clip_grad_norm_
from spiderflow.exec.parallel import (
    FsdpSync,
    Groups,
    LossScaler,
    autocast,
    backends,
    parallelize_stage,
    pick_device,
    wire_dtype,
)
from spiderflow.exec.spec import (
    CheckpointManifest,
    RankInfo,
    Rendezvous,
    StepReport,
    TrainSpec,
    check_runnable,
    chunk_ranges,
    plan_chunks,
    rank_layout,
    rank_ops,
)

__all__ = [
    "PHASES",
    "ManifestCallback",
    "RunResult",
    "StageRunner",
    "StepCallback",
    "init_distributed",
    "run",
]

log = structlog.get_logger(__name__)

PHASES = ("forward", "backward", "recv_wait", "send_wait", "grad_sync", "optimizer", "other")
"""Phases of a step timed by :class:`StageRunner`: forward and backward compute of the micro-batches
(embedding, head and loss included), waiting for received activations / gradients, waiting for the
step's sends to complete, the data-parallel gradient all-reduce, the optimizer step, and the rest
(posting receives, building batches, loss bookkeeping)."""

BUSY_PHASES = ("forward", "backward", "grad_sync", "optimizer")
"""The phases of a step that are the stage's own work (its busy time, ``StepReport.busy_s``): waiting for other
stages and bookkeeping excluded."""

StepCallback = Callable[[StepReport], None]
ManifestCallback = Callable[[CheckpointManifest], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What one rank did: steps ``first_step+1 … last_step`` (1-based completed-step numbers), the losses
    of those steps (last-stage ranks only, else empty), its step times, the manifests it published
    (rank 0 only), ``phases``: where its steps after the first went (:data:`PHASES`; mean seconds per
    step, wall clock ``<phase>_s`` and this process's CPU time ``<phase>_cpu_s``) and, on a GPU, ``memory``
    (:func:`device_memory`: the rank's peak allocated and reserved bytes and the device's used memory, GiB)."""

    rank: int
    stage: int
    replica: int
    first_step: int
    last_step: int
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    manifests: tuple[CheckpointManifest, ...]
    phases: dict[str, float] | None = None
    memory: dict[str, float] | None = None


def device_memory(device: torch.device) -> dict[str, float] | None:
    """On a CUDA device: ``peak_allocated_gib`` (tensors, the caching allocator's high-water mark),
    ``peak_reserved_gib`` (what the allocator held from the driver at its peak: tensors plus its cache and
    fragmentation) and ``device_used_gib`` (the whole device's used memory now, as the driver reports it:
    the reserve, the CUDA context, cuBLAS/NCCL workspaces and other processes); ``None`` on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "device_used_gib": (total - free) / 2**30, "device_total_gib": total / 2**30}


def init_distributed(rdv: Rendezvous, *, namespace: str = "", backend: str = "gloo") -> None:
    """Join the default process group (``backend``: ``gloo`` on CPU, ``cpu:gloo,cuda:nccl`` on GPUs, see
    :func:`spiderflow.exec.parallel.backends`) through the TCPStore of ``rdv`` (hosting it if ``rdv.serves``).

    ``namespace`` prefixes every store key so one store can serve successive runs (e.g. one per attempt)."""
    timeout = datetime.timedelta(seconds=rdv.timeout_s)
    store: Store = TCPStore(
        rdv.host, rdv.port, rdv.world_size, is_master=rdv.serves, timeout=timeout, wait_for_workers=False
    )
    if namespace:
        store = PrefixStore(namespace, store)
    dist.init_process_group(backend, store=store, rank=rdv.rank, world_size=rdv.world_size, timeout=timeout)


class _PhaseTimer:
    """Accumulates wall and CPU (``time.process_time``) seconds per phase; :meth:`mark` closes the
    interval since the previous mark and books it to ``phase``."""

    def __init__(self) -> None:
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._t = time.perf_counter()
        self._c = time.process_time()

    def start(self) -> None:
        self._t = time.perf_counter()
        self._c = time.process_time()

    def mark(self, phase: str) -> None:
        t, c = time.perf_counter(), time.process_time()
        self.wall[phase] += t - self._t
        self.cpu[phase] += c - self._c
        self._t, self._c = t, c

    def reset(self) -> None:
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def busy(self) -> float:
        """Wall seconds booked so far to the stage's own work: :data:`BUSY_PHASES`."""
        return sum(self.wall[p] for p in BUSY_PHASES)

    def means(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {f"{k}_s": v / n for k, v in self.wall.items()}
        out.update({f"{k}_cpu_s": v / n for k, v in self.cpu.items()})
        out["steps"] = float(self.steps)
        return out


@dataclass(slots=True)
class _Recv:
    """A posted receive: the buffer (pinned host memory when a GPU tensor crosses a gloo link) and its
    handle."""

    buf: torch.Tensor
    work: dist.Work


class StageRunner:
    """One rank's share of a stage: its chunk modules (parallelised), one Adam per chunk, process groups
    and the per-step executor (see the module docstring).

    Must be constructed on every rank of an initialised default process group (group creation is
    collective)."""

    def __init__(self, spec: TrainSpec, rank: int, device: torch.device | None = None) -> None:
        check_runnable(spec)
        self.spec = spec
        self.layout = rank_layout(spec.plan)
        if dist.get_world_size() != len(self.layout):
            raise ValueError(f"world size {dist.get_world_size()} != ranks the plan needs ({len(self.layout)})")
        self.rank = rank
        self.info: RankInfo = self.layout[rank]
        self.device = device if device is not None else pick_device(self.info.local_rank)
        plan = spec.plan
        self.n_stages = len(plan.stages)
        self.chunks = plan_chunks(plan)
        self.n_virtual = self.n_stages * self.chunks
        self.ranges = chunk_ranges(plan)
        self.stage = plan.stages[self.info.stage]
        _, local_backend = backends(self.device)

        def channel_backend(a: int, b: int) -> str:
            same = plan.stages[a].cluster == plan.stages[b].cluster
            if same or (spec.nccl_links and self.device.type == "cuda"):
                return local_backend
            return "gloo"

        channels = [] if self.n_stages == 1 else [(u, d) for u in range(self.n_virtual - 1) for d in (0, 1)]
        self.groups = Groups(plan.stages, rank, device=self.device, channels=channels,
                             channel_backend=channel_backend)
        self.first_rank = self.groups.first_rank
        self.modules: list[StageModule] = []
        self.fsdp: list[FsdpSync] = []
        for first, last in self.ranges[self.info.stage]:
            mod = build_stage(spec.model, first, last, spec.seed, max_seq_len=spec.seq_len).to(self.device)
            sharded = parallelize_stage(mod, self.stage, self.groups)
            if sharded:
                self.fsdp.append(FsdpSync(sharded))
            self.modules.append(mod)
        built = [build_optimizer(mod.parameters(), spec.optim, total_steps=spec.steps) for mod in self.modules]
        self.opts = [opt for opt, _ in built]
        self.lr_schedules = [sched for _, sched in built]
        self.params = [p for mod in self.modules for p in mod.parameters()]
        self.dp_group = self.groups.dp_group if self.stage.dp > 1 else None
        self.scaler = LossScaler(spec.precision)
        self.wire = wire_dtype(spec.precision)
        # Without explicit warm-ups the plan's in-flight cap K applies (the orders the timeline simulates).
        self.ops = rank_ops(spec, self.info.stage, self.info.replica)
        self.source: TokenSource = open_data(spec.data, vocab=spec.model.vocab, seq_len=spec.seq_len)
        self.shape = (spec.micro_batch_size, spec.seq_len, spec.model.hidden)
        self.timer = _PhaseTimer()

    @property
    def module(self) -> StageModule:
        """The stage's module when it runs a single chunk."""
        if len(self.modules) != 1:
            raise AttributeError("an interleaved stage runs several chunk modules; use .modules")
        return self.modules[0]

    @property
    def is_first(self) -> bool:
        return self.info.stage == 0

    @property
    def is_last(self) -> bool:
        return self.info.stage == self.n_stages - 1

    def owner(self, stage: int, j: int) -> int:
        """First rank (tp index 0) of the replica running micro-batch ``j`` of ``stage``."""
        st = self.spec.plan.stages[stage]
        return self.first_rank[stage] + (j % st.dp) * st.tp

    def _source_rank(self, u_src: int, j: int) -> int:
        """The rank this rank receives micro-batch ``j``'s message from, sent by virtual stage ``u_src``."""
        s = u_src % self.n_stages
        return self.owner(s, j) + self.info.tp_rank % self.spec.plan.stages[s].tp

    def _dest_ranks(self, u_dst: int, j: int) -> list[int]:
        """The ranks of virtual stage ``u_dst`` that take this rank's message for micro-batch ``j``."""
        s = u_dst % self.n_stages
        tp_dst = self.spec.plan.stages[s].tp
        return [self.owner(s, j) + t for t in range(tp_dst) if t % self.stage.tp == self.info.tp_rank]

    def load(self, manifest: CheckpointManifest) -> None:
        ckpt.load_dcp(manifest, self.modules, self.opts, self.spec.model)

    def _batch(self, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = micro_batch(
            self.source, step=step, global_batch=self.spec.global_batch,
            micro_batch_size=self.spec.micro_batch_size, index=j,
        )
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def _staged(self, key: tuple[int, int]) -> bool:
        """Whether a GPU tensor on channel ``key`` must go through host memory (a gloo link)."""
        return self.device.type == "cuda" and self.groups.channel_backends[key] == "gloo"

    def _post_recv(self, key: tuple[int, int], src: int) -> _Recv:
        staged = self._staged(key)
        buf = torch.empty(self.shape, dtype=self.wire, device="cpu" if staged else self.device,
                          pin_memory=staged)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, src, self.groups.channels[key])])
        return _Recv(buf=buf, work=works[0])

    def _send(self, t: torch.Tensor, key: tuple[int, int], dsts: list[int]) -> list[tuple[torch.Tensor, dist.Work]]:
        if not dsts:
            return []
        t = t.to(self.wire)
        if self._staged(key):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t)
            t = host
        t = t.contiguous()
        group = self.groups.channels[key]
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, d, group) for d in dsts])
        return [(t, w) for w in works]

    def train_step(self, step: int) -> float | None:
        """Run step ``step`` (0-based); returns the global batch's mean loss on last-stage ranks."""
        m = self.spec.plan.micro_batches
        s, last_u = self.info.stage, self.n_virtual - 1
        timer = self.timer
        timer.start()
        for f in self.fsdp:
            f.begin_step()
        # Receives this rank needs, in operation order: (op index, kind, j, chunk, channel, source rank).
        needs: list[tuple[int, str, int, int, tuple[int, int], int]] = []
        if self.n_stages > 1:
            for i, (kind, j, c) in enumerate(self.ops):
                u = c * self.n_stages + s
                if kind == "F" and u > 0:
                    needs.append((i, "F", j, c, (u - 1, 0), self._source_rank(u - 1, j)))
                elif kind == "B" and u < last_u:
                    needs.append((i, "B", j, c, (u, 1), self._source_rank(u + 1, j)))
        posted: dict[tuple[str, int, int], _Recv] = {}
        nxt = 0
        # The schedule keeps up to ``depth`` micro-batches in flight on this rank (its forwards before its
        # first backward); receives for that many activations and as many gradients may be outstanding, so a
        # sender on a slow link is never held back by a receive not yet posted (the latency-aware schedule
        # hides link latency that way). Buffers stay bounded by the schedule's own in-flight count.
        depth = next((i for i, (kind, _, _) in enumerate(self.ops) if kind == "B"), len(self.ops))
        window = max(self.spec.recv_window, 2 * depth)

        def post_until(i: int) -> None:
            nonlocal nxt
            while nxt < len(needs) and (len(posted) < window or needs[nxt][0] <= i):
                _, kind, j, c, key, src = needs[nxt]
                posted[(kind, j, c)] = self._post_recv(key, src)
                nxt += 1

        local: dict[tuple[str, int, int], torch.Tensor] = {}  # hand-offs between chunks of this rank (S = 1)
        need_data = any((c * self.n_stages + s) in (0, last_u) for _, _, c in self.ops)
        batches = {j: self._batch(step, j) for kind, j, _ in self.ops if kind == "F"} if need_data else {}
        sends: list[tuple[torch.Tensor, dist.Work]] = []
        stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        loss_sum = 0.0
        scale = self.scaler.scale

        def receive(kind: str, j: int, c: int) -> torch.Tensor:
            key = (kind, j, c)
            if key in local:
                return local.pop(key)
            rec = posted.pop(key)
            timer.mark("other" if kind == "F" else "backward")
            rec.work.wait()
            timer.mark("recv_wait")
            return rec.buf.to(self.device, non_blocking=True)

        def send(t: torch.Tensor, kind: str, j: int, u_dst: int) -> None:
            if self.n_stages == 1:
                local[(kind, j, u_dst // self.n_stages)] = t
                return
            key = (u_dst - 1, 0) if kind == "F" else (u_dst, 1)
            sends.extend(self._send(t, key, self._dest_ranks(u_dst, j)))

        for i, (kind, j, c) in enumerate(self.ops):
            post_until(i)
            u = c * self.n_stages + s
            mod = self.modules[c]
            timer.mark("other")
            if kind == "F":
                x = batches[j][0] if u == 0 else receive("F", j, c).float().requires_grad_()
                with autocast(self.device, self.spec.precision):
                    if u == last_u:
                        out = mod(x, batches[j][1])
                        loss_sum += float(out.detach())
                    else:
                        out = mod(x)
                if u != last_u:
                    send(out.detach(), "F", j, u + 1)
                stash[(j, c)] = (x, out)
                timer.mark("forward")
            else:
                x, out = stash.pop((j, c))
                if u == last_u:
                    torch.autograd.backward(out * (scale / m))
                else:
                    g = receive("B", j, c)
                    torch.autograd.backward(out, g.to(out.dtype))
                if u > 0:
                    grad = x.grad
                    assert grad is not None
                    send(grad, "B", j, u - 1)
                timer.mark("backward")
        for _, work in sends:
            work.wait()
        timer.mark("send_wait")
        for f in self.fsdp:
            f.end_step()
        self._sync_grads()
        timer.mark("grad_sync")
        if self.scaler.unscale_and_check(self.params, self.device):
            if self.spec.optim.grad_clip > 0:
                clip_grad_norm_(self.params, self.spec.optim.grad_clip, weight=1.0 / self.stage.dp)
            for opt, sched in zip(self.opts, self.lr_schedules, strict=True):
                sched.at(step)
                opt.step()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        if self.is_last and self.dp_group is not None:
            t = torch.tensor([loss_sum], dtype=torch.float64 if self.device.type == "cpu" else torch.float32,
                             device=self.device)
            dist.all_reduce(t, group=self.dp_group)
            loss_sum = float(t.item())
        timer.mark("other")
        timer.steps += 1
        return loss_sum / m if self.is_last else None

    def _sync_grads(self) -> None:
        """Sum the replicated parameters' gradients over the stage's replicas (one flat all-reduce per tp
        index; hierarchical when the replicas span clusters). FSDP-sharded parameters are already summed."""
        plain = [] if self.fsdp else self.params  # an FSDP stage shards every parameter (root included)
        for p in plain:
            if p.grad is None:  # a replica that ran no micro-batch this step
                p.grad = torch.zeros_like(p)
        if self.dp_group is None or not plain:
            return
        grads = [_local(p.grad) for p in plain if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        g = self.groups
        if g.dp_local_group is not None:
            dist.all_reduce(flat, group=g.dp_local_group)
            if g.dp_cross_group is not None:
                host = flat.cpu() if flat.device.type != "cpu" else flat
                dist.all_reduce(host, group=g.dp_cross_group)
                if host is not flat:
                    flat.copy_(host)
            dist.broadcast(flat, src=g.dp_local_leader, group=g.dp_local_group)
        else:
            dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for grad in grads:
            n = grad.numel()
            grad.copy_(flat[offset : offset + n].view_as(grad))
            offset += n

    def save(self, step: int) -> CheckpointManifest:
        """Save every rank's shards of step ``step`` (collective); returns the manifest to commit."""
        assert self.spec.checkpoint_dir is not None
        return ckpt.save_dcp(self.spec, step, self.modules, self.opts, self.ranges)


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def run(
    spec: TrainSpec,
    rdv: Rendezvous,
    *,
    on_step: StepCallback | None = None,
    on_checkpoint: ManifestCallback | None = None,
    namespace: str = "",
) -> RunResult:
    """Run this rank of ``spec`` to ``spec.steps`` and leave the process group.

    Joins the group (:func:`init_distributed`), resumes if asked (``spec.resume_from``, else with
    ``spec.resume`` the latest complete checkpoint under ``spec.checkpoint_dir``), trains, checkpoints every
    ``spec.checkpoint_every`` steps and calls ``on_step`` after every step on every rank. ``on_checkpoint``
    (rank 0 only) publishes a complete checkpoint; by default it writes ``manifest.json`` next to the
    shards. Raises what the training raises (the agent reports it as the job's error); the process group
    is destroyed in every case.
    """
    torch.set_num_threads(spec.threads)
    check_runnable(spec)
    if rdv.world_size != spec.world_size:
        raise ValueError(f"rendezvous.world_size {rdv.world_size} != ranks the plan needs ({spec.world_size})")
    publish = on_checkpoint
    if publish is None and spec.checkpoint_dir is not None:
        root = spec.checkpoint_dir

        def publish(manifest: CheckpointManifest) -> None:
            ckpt.write_manifest_file(manifest, root)

    device = pick_device(rank_layout(spec.plan)[rdv.rank].local_rank)
    init_distributed(rdv, namespace=namespace, backend=backends(device)[0])
    try:
        runner = StageRunner(spec, rdv.rank, device)
        info = runner.info
        bound = log.bind(job=spec.job_id, rank=info.rank, stage=info.stage, replica=info.replica)
        manifest = ckpt.resume_point(spec)
        start = 0
        if manifest is not None:
            runner.load(manifest)
            start = manifest.step
            bound.info("resumed", step=start, root=manifest.root)
        losses: list[float] = []
        times: list[float] = []
        published: list[CheckpointManifest] = []
        saver = (ckpt.AsyncCheckpointer(spec, runner.ranges)
                 if spec.checkpoint_dir is not None and spec.checkpoint_every else None)

        def commit(m: CheckpointManifest | None) -> None:
            """Publish a finished save (rank 0): every rank's shards are written, synced and hashed."""
            if m is None or info.rank != 0:
                return
            if publish is not None:
                publish(m)
            published.append(m)
            ckpt.retain(spec.checkpoint_dir or ".", spec.checkpoint_keep)
            bound.info("checkpoint", step=m.step, dir=str(spec.checkpoint_dir))

        for step in range(start, spec.steps):
            t0 = time.perf_counter()
            if step == start + 1:
                runner.timer.reset()  # phases of the steps after the first (warm-up excluded)
            busy0 = runner.timer.busy()
            loss = runner.train_step(step)
            dt = time.perf_counter() - t0
            busy = runner.timer.busy() - busy0
            times.append(dt)
            if loss is not None:
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {step + 1}")
                losses.append(loss)
            report = StepReport(
                job_id=spec.job_id, step=step + 1, rank=info.rank, stage=info.stage, replica=info.replica,
                step_time_s=dt, tokens_per_s=spec.tokens_per_step / dt, loss=loss, busy_s=busy,
            )
            if on_step is not None:
                on_step(report)
            done = step + 1
            if saver is not None:
                # The save started after the previous step was written while this step trained: finish it
                # (collective) and commit its manifest; then start this step's save if one is due.
                commit(saver.finish())
                if done % spec.checkpoint_every == 0:
                    commit(saver.start(done, runner.modules, runner.opts))
        if saver is not None:
            commit(saver.finish())
            saver.close()
        memory = device_memory(device)  # before the barrier and export add their own buffers
        dist.barrier()
        if spec.model.save_to:  # trained weights back in the Hugging Face format they came in
            if info.replica == 0:
                for mod in runner.modules:
                    hf.export_stage_weights(mod, spec.model.save_to)
            dist.barrier()
            if info.rank == 0:
                hf.write_export_index(spec.model, [r for stage in runner.ranges for r in stage], spec.model.save_to)
        return RunResult(
            rank=info.rank, stage=info.stage, replica=info.replica, first_step=start, last_step=spec.steps,
            losses=tuple(losses), step_times_s=tuple(times), manifests=tuple(published),
            phases=runner.timer.means(), memory=memory,
        )
    finally:
        dist.destroy_process_group()
