"""Checks of a job's files before it runs (torch-free: the scheduler and the agents import this).

- :func:`check_job_paths` (submission, in the scheduler): the data paths, the tokenizer, the initial
  weights exist and are readable, and ``save_to`` can be created — cheap, no file is read;
- :func:`preflight` (placement, in each agent before it starts workers): the data source is opened as the
  workers will open it (a corpus is tokenized into its cache here, token files are checked against the
  vocabulary) and the weight files' headers hold every tensor the model needs.

Either raises :class:`~spiderflow.core.errors.ValidationError` naming the field (``data.path``,
``data.tokenizer``, ``data.vocab``, ``model.weights``, ``model.save_to``), so a bad path fails the job at
submission or placement, never during training.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from spiderflow.core.catalog import ModelSpec
from spiderflow.core.domain import DataSpec, JobSpec
from spiderflow.core.errors import ValidationError

__all__ = ["check_job_paths", "check_model_paths", "preflight", "weight_files"]


def weight_files(weights: str, *, field: str = "model.weights") -> list[Path]:
    """The safetensors files ``weights`` names (a file, a directory's ``*.safetensors``, or a glob)."""
    p = Path(weights)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(weights))
    if not files:
        raise ValidationError(field, "names no safetensors file", weights)
    for f in files:
        if not os.access(f, os.R_OK):
            raise ValidationError(field, "is not readable", str(f))
    return files


def check_model_paths(model: ModelSpec) -> None:
    """``model.weights`` names readable safetensors files; ``model.save_to`` is (or can be made) a writable
    directory."""
    if model.weights:
        weight_files(model.weights)
    if model.save_to:
        p = Path(model.save_to)
        while not p.exists() and p.parent != p:
            p = p.parent
        if not p.is_dir() or not os.access(p, os.W_OK):
            raise ValidationError("model.save_to", "is not a writable directory", model.save_to)


def check_job_paths(job: JobSpec) -> None:
    """The submission-time checks (see the module docstring)."""
    from spiderflow.exec.data import check_data_access

    check_data_access(job.data)
    check_model_paths(job.model)


def _check_weight_names(model: ModelSpec) -> None:
    from safetensors import safe_open

    from spiderflow.exec.hfnames import hf_names, tied_source

    have: set[str] = set()
    for f in weight_files(model.weights):
        try:
            with safe_open(str(f), framework="numpy") as fh:
                have.update(fh.keys())
        except Exception as e:  # safetensors raises its own error type for a malformed header
            raise ValidationError("model.weights", f"{f} is not a safetensors file: {e}", model.weights) from None
    have |= {"transformer." + k for k in have if k.startswith(("h.", "wte.", "wpe.", "ln_f."))}
    for name in hf_names(model, 0, model.layers - 1):
        if name not in have and not (model.tie_embeddings and tied_source(model) in have):
            raise ValidationError("model.weights", f"has no tensor {name}", model.weights)


def preflight(spec: object) -> None:
    """The placement-time checks of a :class:`~spiderflow.exec.spec.TrainSpec` (see the module docstring)."""
    from spiderflow.exec.data import open_data
    from spiderflow.exec.spec import TrainSpec

    assert isinstance(spec, TrainSpec)
    data: DataSpec = spec.data
    open_data(data, vocab=spec.model.vocab, seq_len=spec.seq_len)
    check_model_paths(spec.model)
    if spec.model.weights:
        _check_weight_names(spec.model)
