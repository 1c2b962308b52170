"""Keep numba's on-disk cache of the core's kernels consistent with their sources.

numba invalidates a cached kernel when its own module's file changes, not when a kernel it calls from
another module changes: ``kernels/search.py`` inlines functions of ``kernels/level2.py``, so after an edit
of ``level2.py`` the cached ``search`` kernels would still run the old arithmetic. :func:`drop_stale`
compares a digest of every kernel module's source with the one stamped beside the cache and, when they
differ, removes the package's cached kernels so that they are compiled afresh. An installed package whose
files only change by reinstalling is unaffected; the check costs a few file reads."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

__all__ = ["drop_stale", "sources_digest"]

STAMP = "spiderflow-kernel-sources.sha256"


def _package_dir() -> Path:
    """The kernel package's directory, found without importing it (that would import numba)."""
    spec = importlib.util.find_spec("spiderflow.core.kernels")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).resolve().parent


def sources_digest(package: Path | None = None) -> str:
    """SHA-256 over the kernel package's ``*.py`` files (names and contents, in name order)."""
    root = package or _package_dir()
    h = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def drop_stale(package: Path | None = None) -> bool:
    """Remove the cached kernels (``__pycache__/*.nbi``, ``*.nbc``) when the sources changed since they were
    stamped, and stamp the current digest (creating the cache directory first, so that a fresh checkout's
    first kernels are cached under a stamp); ``True`` when something was removed. Does nothing where the
    package directory is read-only (numba then caches elsewhere and compiles what it cannot find)."""
    root = package or _package_dir()
    cache = root / "__pycache__"
    stamp = cache / STAMP
    digest = sources_digest(root)
    try:
        if stamp.read_text().strip() == digest:
            return False
    except OSError:
        pass
    removed = False
    try:
        cache.mkdir(exist_ok=True)  # stamped before the first kernel is cached, so no later check drops it
        for path in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            path.unlink(missing_ok=True)
            removed = True
        tmp = cache / f"{STAMP}.tmp"
        tmp.write_text(digest + "\n")
        tmp.replace(stamp)
    except OSError:
        return removed
    return removed
