"""Layer-indexed checkpoints: one shard file per stage, a manifest once every stage has saved.

Layout under a checkpoint directory ``D`` (must be reachable by every rank that saves or resumes: a shared
file system, or a directory the agents synchronise)::

    D/step-00000005/stage-000-001.pt     model + Adam state of layers 0..1 (the embedding with layer 0)
    D/step-00000005/stage-002-005.pt
    D/step-00000005/manifest.json        written last, only when all shards exist

A shard is ``{"step", "first_layer", "last_layer", "model": {name: tensor}, "optim": {name: {"step",
"exp_avg", "exp_avg_sq"}}}`` with the layer-indexed parameter names of :mod:`spiderflow.exec.model`, so a
stage of *any* split loads the shards overlapping its layer range, merges them and keeps its own keys.
Files are written to a temporary name and renamed, so a crash never leaves a truncated shard or manifest
behind; a step directory without ``manifest.json`` is incomplete and never resumed from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from spiderflow.catalog import ModelSpec
from spiderflow.errors import ValidationError
from spiderflow.exec.model import StageModule, merge_state_dicts, slice_state_dict
from spiderflow.exec.spec import CheckpointManifest, ShardInfo, manifest_from_dict, manifest_to_dict

__all__ = [
    "MANIFEST_NAME",
    "latest_checkpoint",
    "load_optimizer_state_by_name",
    "load_stage",
    "optimizer_state_by_name",
    "save_shard",
    "shard_path",
    "step_dir",
    "write_manifest_file",
]

MANIFEST_NAME = "manifest.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def shard_path(root: str | Path, step: int, first_layer: int, last_layer: int) -> Path:
    return step_dir(root, step) / f"stage-{first_layer:03d}-{last_layer:03d}.pt"


def optimizer_state_by_name(opt: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The per-parameter state of a single-group optimizer over ``module.parameters()``, keyed by name."""
    names = [n for n, _ in module.named_parameters()]
    state = opt.state_dict()["state"]
    return {names[i]: dict(st) for i, st in state.items()}


def load_optimizer_state_by_name(
    opt: torch.optim.Optimizer, module: torch.nn.Module, states: Mapping[str, Mapping[str, Any]]
) -> None:
    """Inverse of :func:`optimizer_state_by_name`; every parameter of ``module`` must have a state."""
    names = [n for n, _ in module.named_parameters()]
    missing = [n for n in names if n not in states]
    if missing:
        raise ValidationError("checkpoint.optim", "has no optimizer state for some parameters", missing[:3])
    sd = opt.state_dict()
    sd["state"] = {i: dict(states[n]) for i, n in enumerate(names)}
    opt.load_state_dict(sd)


def _atomic_write_bytes(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:  # a full disk (ENOSPC) or any failure: leave no partial temporary file behind
        tmp.unlink(missing_ok=True)
        raise


def save_shard(
    root: str | Path, step: int, module: StageModule, opt: torch.optim.Optimizer
) -> ShardInfo:
    """Save a stage's model and optimizer state after ``step`` completed steps; returns its shard entry."""
    path = shard_path(root, step, module.first_layer, module.last_layer)
    payload = {
        "step": step,
        "first_layer": module.first_layer,
        "last_layer": module.last_layer,
        "model": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optim": optimizer_state_by_name(opt, module),
    }
    _atomic_write_bytes(path, lambda p: torch.save(payload, p))
    return ShardInfo(first_layer=module.first_layer, last_layer=module.last_layer, path=str(path.resolve()))


def write_manifest_file(manifest: CheckpointManifest, root: str | Path) -> Path:
    """The local manifest hook: ``root/step-K/manifest.json``, written atomically."""
    path = step_dir(root, manifest.step) / MANIFEST_NAME
    text = json.dumps(manifest_to_dict(manifest), indent=2)
    _atomic_write_bytes(path, lambda p: p.write_text(text))
    return path


def latest_checkpoint(root: str | Path) -> CheckpointManifest | None:
    """The complete checkpoint with the highest step under ``root`` (``None`` if there is none)."""
    base = Path(root)
    if not base.is_dir():
        return None
    best: CheckpointManifest | None = None
    for d in base.glob("step-*"):
        f = d / MANIFEST_NAME
        if not f.is_file():
            continue
        m = manifest_from_dict(json.loads(f.read_text()), where=f"{f}:")
        if best is None or m.step > best.step:
            best = m
    return best


def load_stage(
    manifest: CheckpointManifest, module: StageModule, opt: torch.optim.Optimizer, model: ModelSpec
) -> None:
    """Load ``module`` (any layer range) and ``opt`` from the shards of ``manifest`` that overlap it.

    Raises :class:`ValidationError` if the checkpoint is of another model or lacks a needed parameter."""
    if manifest.model.layers != model.layers or manifest.model.hidden != model.hidden \
            or manifest.model.vocab != model.vocab or manifest.model.heads != model.heads:
        raise ValidationError("checkpoint.model", f"is {manifest.model.name}, the job runs {model.name}",
                              manifest.model.name)
    first, last = module.first_layer, module.last_layer
    parts = [
        torch.load(s.path, map_location="cpu", weights_only=True)
        for s in manifest.shards
        if s.first_layer <= last and s.last_layer >= first
    ]
    weights = slice_state_dict(merge_state_dicts(p["model"] for p in parts), model, first, last)
    module.load_state_dict(weights, strict=True)
    optim = slice_state_dict(merge_state_dicts(p["optim"] for p in parts), model, first, last)
    load_optimizer_state_by_name(opt, module, optim)  # type: ignore[arg-type]
