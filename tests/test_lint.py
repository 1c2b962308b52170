"""ruff over the whole tree and ``mypy --strict`` over the pure core run as part of the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The pure core: algorithms and domain code that must stay strictly typed.
CORE = [
    "spiderflow/domain.py",
    "spiderflow/catalog.py",
    "spiderflow/costmodel.py",
    "spiderflow/formats.py",
    "spiderflow/errors.py",
    "spiderflow/kernels",
    "spiderflow/placement",
    "spiderflow/tpa",
    "spiderflow/schedules.py",
    "spiderflow/queueing.py",
    "spiderflow/cycle.py",
    "spiderflow/sim",
    "spiderflow/store",
    "spiderflow/topogen.py",
    "spiderflow/gateway/protocol.py",
    "spiderflow/gateway/cost.py",
]


def _tool(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    if not exe.exists():
        pytest.skip(f"{name} is not installed in this environment")
    return str(exe)


def test_ruff_clean() -> None:
    r = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_core() -> None:
    targets = [t for t in CORE if (ROOT / t).exists()]
    r = subprocess.run([_tool("mypy"), *targets], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
