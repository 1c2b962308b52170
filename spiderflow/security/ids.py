"""Paths built from ids that provably stay inside their root (:func:`inside`), and the id grammar.

The grammar and tenant-qualified job ids live in the pure :mod:`spiderflow.core.ids`; they are re-exported
here, so ``from spiderflow.security import ids`` gives both the grammar and :func:`inside`.
"""

from __future__ import annotations

import os
from pathlib import Path

from spiderflow.core.errors import ValidationError
from spiderflow.core.ids import (
    DEFAULT_TENANT,
    ID_PATTERN,
    MAX_ID,
    MAX_TENANT,
    SEP,
    check_id,
    check_job_id,
    check_tenant,
    qualify,
    split_job_id,
)

__all__ = [
    "DEFAULT_TENANT",
    "ID_PATTERN",
    "MAX_ID",
    "MAX_TENANT",
    "SEP",
    "check_id",
    "check_job_id",
    "check_tenant",
    "inside",
    "qualify",
    "split_job_id",
]


def inside(root: str | os.PathLike[str], *parts: str) -> Path:
    """``root / part / ...`` after checking that each part is one id of the grammar (or a qualified job
    id) and that the resolved result lies inside the resolved ``root`` (symbolic links included).
    ValidationError naming ``path`` otherwise: an id can never make a path escape its root."""
    for p in parts:
        if SEP in p:
            check_job_id("path", p)
        else:
            check_id("path", p)
    base = Path(root).resolve()
    out = base.joinpath(*parts)
    resolved = out.resolve()
    if resolved != base and base not in resolved.parents:
        raise ValidationError("path", f"escapes its root {str(base)!r}", str(out))
    return out
