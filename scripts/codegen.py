"""Regenerate the Python code for every .proto under ``protos/`` (the one codegen command).

Generated modules land in ``spiderflow/proto/`` (mirroring ``protos/spiderflow/proto/``) and are never
edited by hand; ``tests/test_codegen.py`` fails when they are stale.

    python scripts/codegen.py            # write into the repository
    python scripts/codegen.py --out DIR  # write elsewhere (the staleness test compares the two)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    """Compile every proto into ``out``; returns the proto files compiled."""
    import grpc_tools

    files = sorted(PROTOS.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(f) for f in files],
    ]
    if files and protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Every generated directory is a regular package.
    for f in files:
        d = (out / f.relative_to(PROTOS)).parent
        while d != out and d.is_relative_to(out):
            (d / "__init__.py").touch()
            d = d.parent
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT)
    args = ap.parse_args()
    files = generate(args.out)
    print(f"generated {len(files)} proto file(s) into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
