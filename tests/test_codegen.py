"""The committed generated code equals what ``scripts/codegen.py`` produces from ``protos/`` now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = Path("spiderflow") / "proto"


def _tree(base: Path) -> dict[str, bytes]:
    root = base / GENERATED
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("codegen")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "codegen.py"), "--out", str(out)], check=True,
                   capture_output=True, text=True, timeout=120)
    return out


def test_generated_code_is_fresh(regenerated: Path) -> None:
    fresh, committed = _tree(regenerated), _tree(ROOT)
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    stale = sorted(name for name in set(fresh) & set(committed) if fresh[name] != committed[name])
    assert not (missing or extra or stale), (
        "generated code is stale; run `.venv/bin/python scripts/codegen.py` and commit spiderflow/proto/: "
        f"missing={missing} extra={extra} differing={stale}"
    )


def test_every_service_is_generated(regenerated: Path) -> None:
    names = set(_tree(regenerated))
    for service in ("topology", "scheduler", "planner", "agent"):
        assert f"{service}/v1/{service}_pb2.py" in names
        assert f"{service}/v1/{service}_pb2_grpc.py" in names
        assert f"{service}/v1/{service}_pb2.pyi" in names
    assert "types/v1/types_pb2.py" in names


def test_codegen_is_deterministic(regenerated: Path, tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "codegen.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    assert _tree(tmp_path) == _tree(regenerated)


def test_staleness_is_detected(regenerated: Path, tmp_path: Path) -> None:
    """The comparison above can fail: a changed proto yields different generated code."""
    import shutil

    protos = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", protos)
    types = protos / "spiderflow" / "proto" / "types" / "v1" / "types.proto"
    types.write_text(types.read_text().replace("message ModelSpec {", "message ModelSpec {\n  string extra = 99;"))
    out = tmp_path / "out"
    # Compile the modified copy with the same generator function, pointed at the copied tree.
    code = (
        "import sys, runpy; from pathlib import Path; "
        f"g = runpy.run_path({str(ROOT / 'scripts' / 'codegen.py')!r}, run_name='codegen'); "
        f"g['generate'].__globals__['PROTOS'] = Path({str(protos)!r}); "
        f"g['generate'](Path({str(out)!r}))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    assert _tree(out)["types/v1/types_pb2.py"] != _tree(regenerated)["types/v1/types_pb2.py"]
