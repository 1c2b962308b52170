"""The pipeline executor: one process per rank trains its stage replica on gloo.

Per step (``m`` micro-batches of ``b = global_batch / m`` sequences; stage ``s`` of ``S``; this rank is
replica ``r`` of ``dp_s``):

1. the rank's operation order is :func:`spiderflow.schedules.replica_ops` for the plan's schedule (global
   micro-batch numbering; micro-batch ``j`` of stage ``s`` runs on replica ``j mod dp_s``), warm-ups capped
   by the plan's in-flight cap ``K`` (``plan.extras["max_in_flight"]``) unless ``TrainSpec.warmup`` sets
   them: exactly the orders :func:`spiderflow.tpa.timeline.plan_orders` simulates;
2. receives for every activation and gradient the order needs are posted up front (``irecv``; tag
   ``2j`` for activations, ``2j + 1`` for gradients without interleaving, see below), so transfers over
   slow links overlap compute; messages of successive steps on one (sender, tag) pair match in order;
3. ``F(j)``: the first stage embeds its own tokens (every rank builds the micro-batches it needs from the
   indexed data source), others wait for the activation from the owner of ``j`` in stage ``s − 1``; the
   output is sent (``isend``) to the owner of ``j`` in stage ``s + 1``; the last stage computes the loss;
4. ``B(j)``: the last stage back-propagates ``loss_j / m``, others the received gradient; the gradient of
   the stage input goes back to stage ``s − 1``;
5. after the order completes and all sends are done, each stage sums its replicas' gradients (one flat
   gloo all-reduce over the stage's data-parallel group), then Adam steps.

Because the loss of micro-batch ``j`` is scaled by ``1/m`` and gradients are summed over micro-batches
and replicas, the update equals that of one process running all ``m`` micro-batches of the global batch.

Checkpoints (every ``K`` completed steps): replica 0 of every stage saves its shard
(:mod:`spiderflow.exec.checkpoint`), all ranks pass a barrier, then rank 0 calls the manifest callback
(the agent puts the manifest in etcd; :func:`run` defaults to writing ``manifest.json``). A resumed run
loads the latest complete checkpoint under any split by re-slicing layers (model and Adam state).

Interleaved 1F1B: a stage runs ``v`` model chunks (:func:`spiderflow.exec.spec.chunk_ranges`), one module
and one Adam each; operation ``(kind, j, c)`` runs on chunk ``c``, virtual stage ``u = c·S + s``, whose
activation comes from virtual stage ``u − 1`` (the last stage's chunk ``c − 1`` when ``s = 0``); tags are
``2(j·S·v + u)`` (+1 for gradients) for the message arriving at ``u``; a hand-off between two chunks of
the same rank (one stage) stays in memory.

Replicas of a stage all run on the stage's cluster, so the data-parallel all-reduce never crosses
clusters (no hierarchical all-reduce is needed). Everything runs on gloo (CPU tensors).

Limits: ``tp > 1`` is rejected (:func:`spiderflow.exec.spec.check_runnable`); receive buffers for a whole
step are allocated up front (``m·v`` activations and gradients per rank).
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from spiderflow.exec import checkpoint as ckpt
from spiderflow.exec import hf
from spiderflow.exec.data import TokenSource, micro_batch, open_data
from spiderflow.exec.model import StageModule, build_stage
from spiderflow.exec.optim import build_optimizer, clip_grad_norm_
from spiderflow.exec.spec import (
    CheckpointManifest,
    RankInfo,
    Rendezvous,
    ShardInfo,
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

StepCallback = Callable[[StepReport], None]
ManifestCallback = Callable[[CheckpointManifest], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """What one rank did: steps ``first_step+1 … last_step`` (1-based completed-step numbers), the losses
    of those steps (last-stage ranks only, else empty), its step times, the manifests it published
    (rank 0 only) and ``phases``: where its steps after the first went (:data:`PHASES`; mean seconds per
    step, wall clock ``<phase>_s`` and this process's CPU time ``<phase>_cpu_s``)."""

    rank: int
    stage: int
    replica: int
    first_step: int
    last_step: int
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    manifests: tuple[CheckpointManifest, ...]
    phases: dict[str, float] | None = None


def init_distributed(rdv: Rendezvous, *, namespace: str = "") -> None:
    """Join the gloo process group through the TCPStore of ``rdv`` (hosting it if ``rdv.serves``).

    ``namespace`` prefixes every store key so one store can serve successive runs (e.g. one per attempt)."""
    timeout = datetime.timedelta(seconds=rdv.timeout_s)
    store: Store = TCPStore(
        rdv.host, rdv.port, rdv.world_size, is_master=rdv.serves, timeout=timeout, wait_for_workers=False
    )
    if namespace:
        store = PrefixStore(namespace, store)
    dist.init_process_group("gloo", store=store, rank=rdv.rank, world_size=rdv.world_size, timeout=timeout)


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

    def means(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {f"{k}_s": v / n for k, v in self.wall.items()}
        out.update({f"{k}_cpu_s": v / n for k, v in self.cpu.items()})
        out["steps"] = float(self.steps)
        return out


def _posted(work: dist.Work | None) -> dist.Work:
    """The handle of a point-to-point operation (``None`` only for ranks outside the group)."""
    assert work is not None
    return work


class StageRunner:
    """One rank's stage replica: its chunk modules, one Adam per chunk, process groups and the per-step
    executor (see the module docstring).

    Must be constructed on every rank of an initialised default process group (group creation is
    collective)."""

    def __init__(self, spec: TrainSpec, rank: int) -> None:
        check_runnable(spec)
        self.spec = spec
        self.layout = rank_layout(spec.plan)
        if dist.get_world_size() != len(self.layout):
            raise ValueError(f"world size {dist.get_world_size()} != ranks the plan needs ({len(self.layout)})")
        self.rank = rank
        self.info: RankInfo = self.layout[rank]
        plan = spec.plan
        self.n_stages = len(plan.stages)
        self.chunks = plan_chunks(plan)
        self.n_virtual = self.n_stages * self.chunks
        self.ranges = chunk_ranges(plan)
        self.stage = plan.stages[self.info.stage]
        self.first_rank = [0] * self.n_stages
        for info in reversed(self.layout):
            self.first_rank[info.stage] = info.rank
        self.modules: list[StageModule] = [
            build_stage(spec.model, first, last, spec.seed, max_seq_len=spec.seq_len)
            for first, last in self.ranges[self.info.stage]
        ]
        built = [build_optimizer(mod.parameters(), spec.optim, total_steps=spec.steps) for mod in self.modules]
        self.opts = [opt for opt, _ in built]
        self.lr_schedules = [sched for _, sched in built]
        self.params = [p for mod in self.modules for p in mod.parameters()]
        self.dp_group: dist.ProcessGroup | None = None
        for s, st in enumerate(plan.stages):  # collective: every rank creates every group, in order
            if st.dp > 1:
                ranks = list(range(self.first_rank[s], self.first_rank[s] + st.dp))
                group = dist.new_group(ranks)
                if s == self.info.stage:
                    self.dp_group = group
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
        """Rank running micro-batch ``j`` of ``stage``."""
        return self.first_rank[stage] + j % self.spec.plan.stages[stage].dp

    def _virtual_owner(self, u: int, j: int) -> int:
        return self.owner(u % self.n_stages, j)

    def _tag(self, j: int, u: int, backward: bool) -> int:
        """Tag of the message that arrives at virtual stage ``u`` for micro-batch ``j``."""
        return 2 * (j * self.n_virtual + u) + int(backward)

    def load(self, manifest: CheckpointManifest) -> None:
        for mod, opt in zip(self.modules, self.opts, strict=True):
            ckpt.load_stage(manifest, mod, opt, self.spec.model)

    def _batch(self, step: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = micro_batch(
            self.source, step=step, global_batch=self.spec.global_batch,
            micro_batch_size=self.spec.micro_batch_size, index=j,
        )
        return torch.from_numpy(x), torch.from_numpy(y)

    def train_step(self, step: int) -> float | None:
        """Run step ``step`` (0-based); returns the global batch's mean loss on last-stage ranks."""
        m = self.spec.plan.micro_batches
        s, last_u = self.info.stage, self.n_virtual - 1
        timer = self.timer
        timer.start()
        recvs: dict[tuple[str, int, int], tuple[torch.Tensor, dist.Work]] = {}
        local: dict[tuple[str, int, int], torch.Tensor] = {}  # hand-offs between chunks of this rank
        for kind, j, c in self.ops:
            u = c * self.n_stages + s
            if kind == "F" and u > 0 and self._virtual_owner(u - 1, j) != self.rank:
                buf = torch.empty(self.shape)
                work = dist.irecv(buf, src=self._virtual_owner(u - 1, j), tag=self._tag(j, u, False))
                recvs[("F", j, c)] = (buf, _posted(work))
            elif kind == "B" and u < last_u and self._virtual_owner(u + 1, j) != self.rank:
                buf = torch.empty(self.shape)
                work = dist.irecv(buf, src=self._virtual_owner(u + 1, j), tag=self._tag(j, u, True))
                recvs[("B", j, c)] = (buf, _posted(work))
        need_data = any((c * self.n_stages + s) in (0, last_u) for _, _, c in self.ops)
        batches = {j: self._batch(step, j) for kind, j, _ in self.ops if kind == "F"} if need_data else {}
        sends: list[tuple[torch.Tensor, dist.Work]] = []
        stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        loss_sum = 0.0

        def receive(kind: str, j: int, c: int) -> torch.Tensor:
            key = (kind, j, c)
            if key in local:
                return local.pop(key)
            buf, work = recvs.pop(key)
            timer.mark("other" if kind == "F" else "backward")
            work.wait()
            timer.mark("recv_wait")
            return buf

        def send(t: torch.Tensor, kind: str, j: int, u_dst: int) -> None:
            dst = self._virtual_owner(u_dst, j)
            if dst == self.rank:
                local[(kind, j, u_dst // self.n_stages)] = t
            else:
                work = dist.isend(t, dst=dst, tag=self._tag(j, u_dst, kind == "B"))
                sends.append((t, _posted(work)))

        for kind, j, c in self.ops:
            u = c * self.n_stages + s
            mod = self.modules[c]
            timer.mark("other")
            if kind == "F":
                x = batches[j][0] if u == 0 else receive("F", j, c).requires_grad_()
                if u == last_u:
                    out = mod(x, batches[j][1])
                    loss_sum += float(out.detach())
                else:
                    out = mod(x)
                    send(out.detach(), "F", j, u + 1)
                stash[(j, c)] = (x, out)
                timer.mark("forward")
            else:
                x, out = stash.pop((j, c))
                if u == last_u:
                    torch.autograd.backward(out / m)
                else:
                    torch.autograd.backward(out, receive("B", j, c))
                if u > 0:
                    grad = x.grad
                    assert grad is not None
                    send(grad, "B", j, u - 1)
                timer.mark("backward")
        for _, work in sends:
            work.wait()
        timer.mark("send_wait")
        self._sync_grads()
        timer.mark("grad_sync")
        if self.spec.optim.grad_clip > 0:
            clip_grad_norm_(self.params, self.spec.optim.grad_clip, weight=1.0 / self.stage.dp)
        for opt, sched in zip(self.opts, self.lr_schedules, strict=True):
            sched.at(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        if self.is_last and self.dp_group is not None:
            t = torch.tensor([loss_sum], dtype=torch.float64)
            dist.all_reduce(t, group=self.dp_group)
            loss_sum = float(t.item())
        timer.mark("other")
        timer.steps += 1
        return loss_sum / m if self.is_last else None

    def _sync_grads(self) -> None:
        """Sum gradients over the stage's replicas (one flat all-reduce)."""
        for p in self.params:
            if p.grad is None:  # a replica that ran no micro-batch this step
                p.grad = torch.zeros_like(p)
        if self.dp_group is None:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in self.params if p.grad is not None])
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for p in self.params:
            assert p.grad is not None
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n

    def save(self, step: int) -> None:
        """Save this stage's shards, one per chunk (replica 0 only; replicas are identical after the
        all-reduce)."""
        assert self.spec.checkpoint_dir is not None
        if self.info.replica == 0:
            for mod, opt in zip(self.modules, self.opts, strict=True):
                ckpt.save_shard(self.spec.checkpoint_dir, step, mod, opt)

    def manifest(self, step: int) -> CheckpointManifest:
        assert self.spec.checkpoint_dir is not None
        root = self.spec.checkpoint_dir
        shards = tuple(
            ShardInfo(first_layer=first, last_layer=last,
                      path=str(ckpt.shard_path(root, step, first, last).resolve()))
            for stage in self.ranges
            for first, last in stage
        )
        return CheckpointManifest(job_id=self.spec.job_id, step=step, model=self.spec.model, shards=shards)


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

    init_distributed(rdv, namespace=namespace)
    try:
        runner = StageRunner(spec, rdv.rank)
        info = runner.info
        bound = log.bind(job=spec.job_id, rank=info.rank, stage=info.stage, replica=info.replica)
        manifest = spec.resume_from
        if manifest is None and spec.resume and spec.checkpoint_dir is not None:
            manifest = ckpt.latest_checkpoint(spec.checkpoint_dir)
        start = 0
        if manifest is not None:
            runner.load(manifest)
            start = manifest.step
            bound.info("resumed", step=start, shards=len(manifest.shards))
        losses: list[float] = []
        times: list[float] = []
        published: list[CheckpointManifest] = []
        for step in range(start, spec.steps):
            t0 = time.perf_counter()
            if step == start + 1:
                runner.timer.reset()  # phases of the steps after the first (warm-up excluded)
            loss = runner.train_step(step)
            dt = time.perf_counter() - t0
            times.append(dt)
            if loss is not None:
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss is {loss} at step {step + 1}")
                losses.append(loss)
            report = StepReport(
                job_id=spec.job_id, step=step + 1, rank=info.rank, stage=info.stage, replica=info.replica,
                step_time_s=dt, tokens_per_s=spec.tokens_per_step / dt, loss=loss,
            )
            if on_step is not None:
                on_step(report)
            done = step + 1
            if spec.checkpoint_every and done % spec.checkpoint_every == 0:
                runner.save(done)
                dist.barrier()
                if info.rank == 0:
                    m = runner.manifest(done)
                    if publish is not None:
                        publish(m)
                    published.append(m)
                    bound.info("checkpoint", step=done, dir=str(Path(spec.checkpoint_dir or ".")))
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
            phases=runner.timer.means(),
        )
    finally:
        dist.destroy_process_group()
