"""The topology, trace and job files (JSON or YAML): the adapter between files and the pure codecs.

The document formats, their validation and every ``*_to_dict`` / ``*_from_dict`` conversion are
:mod:`spiderflow.core.codec`'s, re-exported here unchanged except that a model given as a Hugging Face
``config.json`` path is read from disk (:func:`spiderflow.hfconfig.load_hf_config`). This module adds the
file side: :func:`load_document` parses a file, :func:`load_topology` and :func:`load_trace` read one, and
:func:`in_file` names the file in an error (``topo.yaml: clusters[2].gpu: ...``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from spiderflow.core import codec
from spiderflow.core.catalog import ModelSpec
from spiderflow.core.codec import (
    constraints_from_value,
    constraints_to_dict,
    data_from_value,
    data_to_dict,
    job_to_dict,
    model_to_value,
    optimizer_from_value,
    optimizer_to_dict,
    plan_from_dict,
    plan_to_dict,
    topology_from_dict,
    topology_to_dict,
    trace_to_dict,
)
from spiderflow.core.domain import JobSpec, Topology
from spiderflow.core.errors import ValidationError

T = TypeVar("T")

__all__ = [
    "constraints_from_value",
    "constraints_to_dict",
    "data_from_value",
    "data_to_dict",
    "in_file",
    "job_from_dict",
    "job_to_dict",
    "load_document",
    "load_topology",
    "load_trace",
    "model_from_value",
    "model_to_value",
    "optimizer_from_value",
    "optimizer_to_dict",
    "plan_from_dict",
    "plan_to_dict",
    "read_hf_config",
    "topology_from_dict",
    "topology_to_dict",
    "trace_from_dict",
    "trace_to_dict",
]


def read_hf_config(path: str, field: str, name: str) -> ModelSpec:
    """The :data:`~spiderflow.core.codec.HfConfigReader` of the files: a Hugging Face ``config.json`` read
    from disk (:func:`spiderflow.hfconfig.load_hf_config`)."""
    from spiderflow.hfconfig import load_hf_config

    return load_hf_config(path, field=field, name=name)


def model_from_value(value: Any, *, field: str = "model") -> ModelSpec:
    """:func:`spiderflow.core.codec.model_from_value`, a ``config.json`` path read from disk."""
    return codec.model_from_value(value, field=field, hf_config=read_hf_config)


def job_from_dict(raw: Any, *, where: str = "") -> JobSpec:
    """:func:`spiderflow.core.codec.job_from_dict`, a model's ``config.json`` path read from disk."""
    return codec.job_from_dict(raw, where=where, hf_config=read_hf_config)


def trace_from_dict(raw: Any) -> list[JobSpec]:
    """:func:`spiderflow.core.codec.trace_from_dict`, a model's ``config.json`` path read from disk."""
    return codec.trace_from_dict(raw, hf_config=read_hf_config)


def load_document(path: str | Path) -> Any:
    """Parse a JSON (``.json``) or YAML (anything else) file; a clear error for unreadable input."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValidationError("file", "no such file", str(p)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValidationError("file", f"cannot read: {e}", str(p)) from None
    try:
        if p.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValidationError("file", f"not valid {'JSON' if p.suffix.lower() == '.json' else 'YAML'}: {first}",
                              str(p)) from None


def in_file(path: str | Path, parse: Callable[[Any], T], doc: Any) -> T:
    """``parse(doc)`` for a document read from ``path``: a :class:`ValidationError` names the file before
    the field (``topo.yaml: clusters[2].gpu: ...``; a document that is not an object: ``topo.yaml: must
    be an object``)."""
    try:
        return parse(doc)
    except ValidationError as e:
        raise ValidationError(f"{path}: {e.field}" if e.field else str(path), e.reason, e.value) from None


def load_topology(path: str | Path) -> Topology:
    """A topology file (JSON or YAML); errors name the file and the field."""
    return in_file(path, topology_from_dict, load_document(path))


def load_trace(path: str | Path) -> list[JobSpec]:
    """A trace file (JSON or YAML); errors name the file and the field."""
    return in_file(path, trace_from_dict, load_document(path))
