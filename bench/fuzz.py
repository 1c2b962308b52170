"""Long fuzzing run: ``--cases N`` hypothesis cases per RPC (Scheduler, Planner, Topology, Agent, Control) and
per file format, against real servicers over a real etcd, with the oracle of ``tests/fuzz/fuzz_harness.py``
(never INTERNAL/UNKNOWN/UNAVAILABLE, the server keeps answering, a refused request writes nothing; the
agent's ``ReadLogs`` is called as the control plane and, every case, as a wrong identity, which must be
PERMISSION_DENIED). ``--list`` prints every target.

    .venv/bin/python bench/fuzz.py --cases 10000            # every RPC and format
    .venv/bin/python bench/fuzz.py --cases 2000 --rpc Planner/Plan --seed 7

Hypothesis stops a run early when a strategy has few distinct values (``GetTopology`` has no fields), so
runs are repeated with successive seeds until N cases were sent. A case that breaks the oracle is a
finding: it is recorded (distinct findings by their first line, with one example request) and the run
goes on. Prints one JSON document: per target the cases sent, the status codes seen, the wall time and the
findings (exit code 1 when there is any).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "fuzz"), str(ROOT / "tests")]  # the harness imports tests/idle_agent.py

from fuzz_harness import WRONG_IDENTITY, FuzzTarget  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from strategies import RPCS, documents, requests  # noqa: E402

from spiderflow.core.errors import ValidationError  # noqa: E402
from spiderflow.formats import topology_from_dict, trace_from_dict  # noqa: E402
from spiderflow.runtime import configure_logging  # noqa: E402
from spiderflow.store.process import EtcdProcess  # noqa: E402

FORMATS: dict[str, Any] = {"format/topology": topology_from_dict, "format/trace": trace_from_dict}


def _settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))


def _run_batches(name: str, n: int, base_seed: int, one: Any, strategy: Any) -> dict[str, Any]:
    sent = 0
    t0 = time.perf_counter()
    batch = 0
    counter = [0]
    findings: dict[str, dict[str, Any]] = {}

    def count(x: Any) -> None:
        counter[0] += 1
        try:
            one(x)
        except Exception as e:  # the oracle's AssertionError, or a loader's crash
            text = f"{type(e).__name__}: {e}"
            key = text.splitlines()[0][:300] if text else type(e).__name__
            row = findings.setdefault(key, {"count": 0, "example": text[:3000]})
            row["count"] += 1

    while sent < n and batch < 10_000:
        counter[0] = 0
        case = seed(base_seed + batch)(_settings(min(n - sent, 2000))(given(strategy)(count)))
        case()  # type: ignore[no-untyped-call]
        sent += counter[0]
        batch += 1
    return {"cases": sent, "seconds": round(time.perf_counter() - t0, 1), "batches": batch, "findings": findings}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000, help="cases per RPC and per file format")
    p.add_argument("--rpc", action="append", help="only these targets (Service/Method or format/KIND)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument("--list", action="store_true", help="print every target (RPC and file format) and exit")
    args = p.parse_args(argv)
    if args.list:
        sys.stdout.write("\n".join([*sorted(RPCS), *FORMATS]) + "\n")
        return 0
    unknown = [t for t in args.rpc or [] if t not in RPCS and t not in FORMATS]
    if unknown:
        p.error(f"--rpc: unknown target(s) {', '.join(unknown)}; --list prints them")
    configure_logging(level="error")
    targets = args.rpc or [*sorted(RPCS), *FORMATS]
    etcd = EtcdProcess()
    etcd.start()
    target = FuzzTarget(etcd.endpoint, stream_s=0.05).start()
    report: dict[str, Any] = {"cases_per_target": args.cases, "seed": args.seed, "targets": {}}
    failed = False
    try:
        for name in targets:
            try:
                if name in FORMATS:
                    loader = FORMATS[name]

                    def one(doc: Any, loader: Any = loader) -> None:
                        with contextlib.suppress(ValidationError):
                            loader(doc)

                    row = _run_batches(name, args.cases, args.seed, one, documents(name.split("/")[1]))
                else:
                    row = _run_batches(name, args.cases, args.seed,
                                       lambda req, name=name: target.check(name, req), requests(name))
                    row["codes"] = dict(target.codes.get(name, {}))
                    wrong = target.codes.get(name + WRONG_IDENTITY)
                    if wrong:
                        row["codes_wrong_identity"] = dict(wrong)
                row["cases_per_s"] = round(row["cases"] / max(row["seconds"], 1e-9), 1)
                failed = failed or bool(row["findings"])
            except Exception as e:  # the harness itself failed: report it and go on with the other targets
                failed = True
                row = {"failure": f"{type(e).__name__}: {e}"[:4000]}
            report["targets"][name] = row
            sys.stderr.write(f"{name}: {json.dumps(row)}\n")
    finally:
        target.close()
        etcd.close()
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
