"""Reshardable checkpoints: torch.distributed.checkpoint (DCP) shards from every rank, a manifest last.

Layout under a checkpoint root ``D`` (a path, or an fsspec URL such as ``file:///ckpt`` or
``s3://bucket/job``; it must be reachable by every rank that saves or resumes)::

    D/step-00000005/.metadata, __0_0.distcp, __1_0.distcp, …   DCP: every rank writes its own shards
    D/step-00000005/manifest.json                             written last (default manifest hook)

What is saved is keyed by *layer-indexed* names (:mod:`spiderflow.exec.model`): ``model.<fqn>`` for every
parameter and buffer and ``optim.<fqn>.<state>`` for Adam's ``step``/``exp_avg``/``exp_avg_sq``, taken with
``torch.distributed.checkpoint.state_dict`` so tensor-parallel and FSDP-sharded parameters are saved as
DTensors (each rank writes only its shard; replicated values are written once). A rank of *any* other
plan — other layer split, tp, dp, sharding, clusters — asks DCP for exactly the keys its stage owns, in
its own layout, and DCP reshards on load.

Commit protocol (:func:`save_dcp`): every rank saves (DCP's collective save: local plans, a global plan,
writes, metadata by the coordinator), every rank hashes the files it wrote (SHA-256), the digests are
gathered, and only then does rank 0 return the manifest (with every file's size and digest) for the
caller's manifest callback (the agent puts it in etcd).

Asynchronous saves (:class:`AsyncCheckpointer`): where the process group has a CPU backend (gloo, alone or
as ``cpu:gloo,cuda:nccl``), :meth:`AsyncCheckpointer.start` stages the state to host memory and returns;
``torch.distributed.checkpoint.async_save`` writes the files in a background thread over a dedicated gloo
group (so its collectives never interleave with training's), while training goes on.
:meth:`AsyncCheckpointer.finish` — collective, after the next step or at the end of the run — waits for
every rank's write, then hashes and gathers as above: the manifest is still committed only after every
rank's shards are written and synced. Where no CPU backend exists (an NCCL-only group) or
``async_save`` is missing, the save runs synchronously and says so in the log
(``checkpoint.sync_save``). A run that dies before ``finish`` leaves a step directory without a manifest,
which resuming ignores. :func:`resume_point` refuses a checkpoint whose
files are missing, truncated or altered and falls back to the newest intact older one; :func:`retain`
keeps the newest ``N`` complete checkpoints.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.errors import ValidationError
from spiderflow.exec.spec import (
    CheckpointManifest,
    FileDigest,
    ShardInfo,
    TrainSpec,
    manifest_from_dict,
    manifest_to_dict,
)

__all__ = [
    "MANIFEST_NAME",
    "AsyncCheckpointer",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_dcp",
    "resume_point",
    "retain",
    "save_dcp",
    "step_dir",
    "verify",
    "write_manifest_file",
]

log = structlog.get_logger(__name__)

MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 22


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _fs(root: str) -> tuple[Any, str]:
    """The fsspec file system and the path inside it for a root path or URL."""
    from fsspec.core import url_to_fs  # type: ignore[import-untyped]

    fs, path = url_to_fs(str(root))
    return fs, str(path).rstrip("/")


def step_dir(root: str, step: int) -> str:
    """``root/step-XXXXXXXX`` (a path or URL, as ``root`` is)."""
    return f"{str(root).rstrip('/')}/step-{step:08d}"


def _digest(fs: Any, path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _flat_state(modules: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    flat: dict[str, Any] = {}
    for mod, opt in zip(modules, opts, strict=True):
        for k, v in get_model_state_dict(mod).items():
            flat[f"model.{k}"] = v
        osd: Any = get_optimizer_state_dict(mod, opt)
        for fqn, st in osd["state"].items():
            for name, v in st.items():
                flat[f"optim.{fqn}.{name}"] = v
    return flat


def _writer(where: str) -> Any:
    dcp = _dcp()
    if "://" in where:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(where, sync_files=True)
    return dcp.FileSystemWriter(_fs(where)[1], sync_files=True)


def _manifest(spec: TrainSpec, step: int, ranges: Sequence[Sequence[tuple[int, int]]],
              group: Any = None) -> CheckpointManifest:
    """Hash this rank's files of step ``step`` (rank 0 also the metadata), gather every rank's digests over
    ``group`` (collective) and build the manifest."""
    assert spec.checkpoint_dir is not None
    root = spec.checkpoint_dir
    where = step_dir(root, step)
    fs, path = _fs(where)
    rank = dist.get_rank()
    mine = [p for p in fs.ls(path, detail=False) if p.rsplit("/", 1)[-1].startswith(f"__{rank}_")]
    if rank == 0:
        mine += [p for p in fs.ls(path, detail=False) if p.endswith("/.metadata")]
    digests = []
    for p in sorted(mine):
        size, sha = _digest(fs, p)
        digests.append(FileDigest(name=p.rsplit("/", 1)[-1], size=size, sha256=sha))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digests, group=group)
    files = tuple(sorted((d for part in gathered for d in part), key=lambda d: d.name))
    meta = f"{where}/.metadata"
    shards = tuple(ShardInfo(first_layer=a, last_layer=b, path=meta) for stage in ranges for a, b in stage)
    return CheckpointManifest(job_id=spec.job_id, step=step, model=spec.model, shards=shards, root=str(root),
                              files=files)


def save_dcp(
    spec: TrainSpec, step: int, modules: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer],
    ranges: Sequence[Sequence[tuple[int, int]]],
) -> CheckpointManifest:
    """Save every rank's shards of step ``step`` under ``spec.checkpoint_dir`` (collective over the default
    group) and return the manifest (meaningful on rank 0, which commits it). Returns only after every rank
    has written and hashed its files."""
    assert spec.checkpoint_dir is not None
    _dcp().save(_flat_state(modules, opts), storage_writer=_writer(step_dir(spec.checkpoint_dir, step)))
    return _manifest(spec, step, ranges)


def async_unavailable() -> str | None:
    """Why an asynchronous save cannot run in this process group (``None``: it can)."""
    dcp = _dcp()
    if not hasattr(dcp, "async_save"):
        return "this torch has no torch.distributed.checkpoint.async_save"
    types = getattr(dist.distributed_c10d._get_default_group(), "_device_types", None)
    if types is not None and torch.device("cpu") not in types:
        return "the process group has no CPU backend (async_save needs gloo beside NCCL: 'cpu:gloo,cuda:nccl')"
    return None


class AsyncCheckpointer:
    """Asynchronous DCP saves of one rank (module docstring). Construct it on every rank at the same point
    (it creates its gloo group collectively). At most one save is in flight: :meth:`start` of a new one
    first finishes the previous one."""

    def __init__(self, spec: TrainSpec, ranges: Sequence[Sequence[tuple[int, int]]]) -> None:
        self.spec = spec
        self.ranges = ranges
        self.why_sync = async_unavailable()
        self.group: Any = None if self.why_sync else dist.new_group(backend="gloo")
        self._pending: tuple[int, Any] | None = None
        if self.why_sync:
            log.info("checkpoint.sync_save", reason=self.why_sync, job=spec.job_id)

    @property
    def pending_step(self) -> int | None:
        return None if self._pending is None else self._pending[0]

    def start(self, step: int, modules: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer]
              ) -> CheckpointManifest | None:
        """Begin saving step ``step`` (collective). Returns the manifest of the save this call finished —
        the previous asynchronous one, or this one when it ran synchronously — else ``None``."""
        done = self.finish()
        assert self.spec.checkpoint_dir is not None
        if self.why_sync is not None:
            return save_dcp(self.spec, step, modules, opts, self.ranges)
        writer = _writer(step_dir(self.spec.checkpoint_dir, step))
        fut = _dcp().async_save(_flat_state(modules, opts), storage_writer=writer, process_group=self.group)
        self._pending = (step, fut)
        return done

    def finish(self) -> CheckpointManifest | None:
        """Wait for the save in flight (collective: every rank calls it), hash and gather its files; its
        manifest (meaningful on rank 0), or ``None`` when none was in flight."""
        if self._pending is None:
            return None
        step, fut = self._pending
        self._pending = None
        result = getattr(fut, "upload_completion", fut)  # an AsyncSaveResponse, or the Future itself
        result.result()
        return _manifest(self.spec, step, self.ranges, group=self.group)

    def close(self) -> None:
        """Drop the dedicated group (after :meth:`finish`)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def load_dcp(
    manifest: CheckpointManifest, modules: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer],
    model: ModelSpec,
) -> None:
    """Load this rank's modules and optimizers (any layout) from ``manifest``'s checkpoint (collective)."""
    dcp = _dcp()
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    m = manifest.model
    if (m.layers, m.hidden, m.vocab, m.heads) != (model.layers, model.hidden, model.vocab, model.heads):
        raise ValidationError("checkpoint.model", f"is {m.name}, the job runs {model.name}", m.name)
    where = step_dir(manifest.root, manifest.step)
    flat = _flat_state(modules, opts)
    if "://" in where:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader: Any = FsspecReader(where)
    else:
        reader = dcp.FileSystemReader(_fs(where)[1])
    dcp.load(flat, storage_reader=reader)
    for mod, opt in zip(modules, opts, strict=True):
        msd = {k: flat[f"model.{k}"] for k in mod.state_dict()}
        set_model_state_dict(mod, msd)
        osd: Any = get_optimizer_state_dict(mod, opt)
        osd["state"] = {fqn: {name: flat[f"optim.{fqn}.{name}"] for name in st} for fqn, st in osd["state"].items()}
        set_optimizer_state_dict(mod, opt, osd)


def write_manifest_file(manifest: CheckpointManifest, root: str | Any) -> str:
    """The local manifest hook: ``root/step-K/manifest.json`` (written to a temporary name, then moved)."""
    where = step_dir(str(root), manifest.step)
    fs, path = _fs(where)
    text = json.dumps(manifest_to_dict(manifest), indent=2)
    tmp = f"{path}/.{MANIFEST_NAME}.tmp"
    try:
        with fs.open(tmp, "w") as f:
            f.write(text)
        fs.mv(tmp, f"{path}/{MANIFEST_NAME}")
    except BaseException:  # a full disk (ENOSPC) or any failure: leave no partial temporary file behind
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
    return f"{where}/{MANIFEST_NAME}"


def verify(manifest: CheckpointManifest) -> str | None:
    """``None`` when every file of the checkpoint is present with its recorded size and SHA-256, else why
    not (a manifest without digests, from an older writer, is accepted if its metadata file exists)."""
    where = step_dir(manifest.root, manifest.step)
    fs, path = _fs(where)
    if not manifest.files:
        return None if fs.exists(f"{path}/.metadata") else "no .metadata"
    for f in manifest.files:
        p = f"{path}/{f.name}"
        if not fs.exists(p):
            return f"{f.name} is missing"
        if fs.size(p) != f.size:
            return f"{f.name} has {fs.size(p)} bytes, {f.size} recorded"
        if _digest(fs, p)[1] != f.sha256:
            return f"{f.name} does not match its SHA-256"
    return None


def complete_checkpoints(root: str) -> list[CheckpointManifest]:
    """Every checkpoint under ``root`` with a readable manifest, newest first (not yet verified)."""
    fs, path = _fs(root)
    if not fs.isdir(path):
        return []
    out = []
    for d in fs.ls(path, detail=False):
        name = d.rstrip("/").rsplit("/", 1)[-1]
        f = f"{d.rstrip('/')}/{MANIFEST_NAME}"
        if not name.startswith("step-") or not fs.exists(f):
            continue
        try:
            with fs.open(f, "r") as fh:
                m = manifest_from_dict(json.loads(fh.read()), where=f"{f}:")
        except (ValidationError, ValueError) as e:
            log.warning("checkpoint.unreadable_manifest", path=f, error=str(e))
            continue
        if not m.root:
            object.__setattr__(m, "root", str(root))
        out.append(m)
    return sorted(out, key=lambda m: m.step, reverse=True)


def latest_checkpoint(root: str, *, before: int | None = None) -> CheckpointManifest | None:
    """The newest complete *and intact* checkpoint under ``root`` (older than step ``before`` if given);
    damaged ones are logged and skipped."""
    for m in complete_checkpoints(str(root)):
        if before is not None and m.step >= before:
            continue
        why = verify(m)
        if why is None:
            return m
        log.warning("checkpoint.refused", step=m.step, root=str(root), reason=why)
    return None


def resume_point(spec: TrainSpec) -> CheckpointManifest | None:
    """Where a run starts: ``spec.resume_from`` if intact; if it is damaged, the newest intact older
    checkpoint under its root; with ``spec.resume`` the newest intact one under ``spec.checkpoint_dir``;
    else ``None`` (the seed's initialisation)."""
    m = spec.resume_from
    if m is not None:
        if not m.root:  # a manifest of an older writer: its root is two levels above its metadata
            m = CheckpointManifest(job_id=m.job_id, step=m.step, model=m.model, shards=m.shards,
                                   root=m.shards[0].path.rsplit("/", 2)[0], files=m.files)
        why = verify(m)
        if why is None:
            return m
        log.warning("checkpoint.refused", step=m.step, root=m.root, reason=why)
        return latest_checkpoint(m.root, before=m.step)
    if spec.resume and spec.checkpoint_dir is not None:
        return latest_checkpoint(spec.checkpoint_dir)
    return None


def retain(root: str, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (and incomplete step
    directories older than the oldest kept one); returns the deleted steps."""
    fs, path = _fs(root)
    done = complete_checkpoints(root)
    if len(done) <= keep:
        return []
    oldest_kept = done[keep - 1].step
    deleted = []
    for d in fs.ls(path, detail=False):
        name = d.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) < oldest_kept:
            fs.rm(d, recursive=True)
            deleted.append(int(name[5:]))
    return sorted(deleted)
