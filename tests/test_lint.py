"""ruff over the whole tree and ``mypy --strict`` over the pure core run as part of the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# mypy --strict covers the whole pure core, and these typed adapters beside it.
CORE = ["spiderflow/core"]
TYPED_ADAPTERS = [
    "spiderflow/formats.py",
    "spiderflow/store",
    "spiderflow/gateway/protocol.py",
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
    targets = [t for t in CORE + TYPED_ADAPTERS if (ROOT / t).exists()]
    r = subprocess.run([_tool("mypy"), *targets], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


# What the pure core must never import, at module level or inside a function: the network, etcd, torch,
# the OS, threads and processes.
FORBIDDEN = {
    "grpc", "etcd3", "aetcd", "torch", "os", "pathlib", "subprocess", "socket", "shutil", "threading",
    "multiprocessing", "concurrent", "asyncio", "signal", "tempfile",
}
CORE_PACKAGE = "spiderflow.core"


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (line, dotted name), wherever the import statement is, plus the
    literal targets of ``importlib.import_module`` calls (an f-string counts by its literal prefix)."""
    import ast

    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            mod = node.module or ""
            if mod == "spiderflow":  # from spiderflow import x: the module imported is spiderflow.x
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                arg = arg.values[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                out.append((node.lineno, arg.value))
    return out


def _core_violation(name: str) -> str | None:
    root = name.split(".")[0]
    if root in FORBIDDEN:
        return "the OS, the network, etcd or torch"
    if root == "spiderflow" and not (name == CORE_PACKAGE or name.startswith(CORE_PACKAGE + ".")):
        return "a SpiderFlow adapter"
    return None


def test_the_core_imports_no_os_network_etcd_torch_or_adapter() -> None:
    files = sorted((ROOT / "spiderflow" / "core").rglob("*.py"))
    assert len(files) > 30, "the core package was not found"
    bad = [f"{f.relative_to(ROOT)}:{line}: imports {name} ({why})"
           for f in files for line, name in _imports(f) if (why := _core_violation(name)) is not None]
    assert not bad, "\n".join(bad)


def test_the_core_check_catches_function_level_and_adapter_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import math\n"
        "from spiderflow.core import domain\n"
        "def f():\n"
        "    import os.path\n"
        "    from spiderflow.store import keys\n"
        "    from spiderflow import jobs\n"
        "    import importlib\n"
        "    importlib.import_module(f'spiderflow.rpc.{1}')\n",
        encoding="utf-8",
    )
    flagged = [name for _, name in _imports(probe) if _core_violation(name)]
    assert flagged == ["os.path", "spiderflow.store", "spiderflow.jobs", "spiderflow.rpc."]
