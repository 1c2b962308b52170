"""The optimizer of a stage: AdamW with warm-up, a decay schedule and global gradient-norm clipping.

:func:`build_optimizer` turns an :class:`~spiderflow.core.domain.OptimizerSpec` into ``(optimizer,
lr_scheduler)``. The scheduler is stateless in the step: :meth:`StepLr.at` sets the learning rate of step
``t`` from :meth:`~spiderflow.core.domain.OptimizerSpec.lr_factor`, so a resumed or re-split job continues the
schedule exactly where it stopped without restoring any scheduler state. With ``weight_decay = 0`` AdamW's
update is Adam's, bit for bit (the decay term is skipped), so existing checkpoints keep their meaning.

:func:`clip_grad_norm_` clips by the norm over the *whole model*: each rank's squared gradient norm is
summed over every rank of the job (one all-reduce of a scalar, weighted ``1/dp`` so the replicas of a stage
count once), the same clipping coefficient is applied everywhere, as in single-process training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from spiderflow.core.domain import OptimizerSpec

__all__ = ["StepLr", "build_optimizer", "clip_grad_norm_"]


class StepLr:
    """Sets every parameter group's learning rate for a given 0-based step (``lr · lr_factor(step)``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerSpec, total_steps: int) -> None:
        self.optimizer = optimizer
        self.cfg = cfg
        self.total_steps = total_steps
        self.at(0)

    def lr(self, step: int) -> float:
        return self.cfg.lr * self.cfg.lr_factor(step, self.total_steps)

    def at(self, step: int) -> float:
        """Set and return the learning rate step ``step`` uses (call before ``optimizer.step()``)."""
        lr = self.lr(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerSpec, *, total_steps: int = 1
) -> tuple[torch.optim.Optimizer, StepLr]:
    """AdamW over ``params`` (one group; ``foreach=False`` so the update is the same on every split) and its
    learning-rate schedule over ``total_steps`` (the job's step count, for decays that end with the job)."""
    opt = torch.optim.AdamW(list(params), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            foreach=False)
    return opt, StepLr(opt, cfg, total_steps)


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter], max_norm: float, *, weight: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Scale the gradients of ``params`` so the global norm is at most ``max_norm``; returns the global norm
    before clipping. With an initialised process group the squared norms of all ranks of ``group`` are
    summed, each multiplied by ``weight`` (``1/dp`` for a replica of a stage with ``dp`` replicas): every
    rank must call it (a collective)."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    if dist.is_available() and dist.is_initialized():
        sq = sq * weight
        dist.all_reduce(sq, group=group)
    norm = math.sqrt(float(sq))
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm
