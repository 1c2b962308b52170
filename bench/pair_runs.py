"""Pair SpinSearch's full-system runs of some `bench/paper.py` outputs with the baselines' runs of another.

A SpinSearch variant (e.g. `bench/paper.py --parts system --sim-policies spinsearch --gpu-price 4`) is run
alone; its ratios need the baselines' runs of the same traces, which an earlier grid holds. This takes the
baselines' runs (every label but `spinsearch`) of `--baselines FILE` (repeatable: e.g. one file per
topology kind) and the SpinSearch runs of the `RUNS` files, computes the grid and per-cell summaries
exactly as `bench/paper.py` does (:func:`paper.summarize_system`), and writes them as JSON (``--out``)
with a plain-text digest on stdout.
Runs are matched by topology kind, load, seed and wait setting; the SpinSearch runs must not overlap.

    .venv/bin/python bench/pair_runs.py --baselines bench/results/paper-grid.json \
        --out /tmp/paired.json /tmp/on-A.json /tmp/on-B.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper import REFERENCE, summarize_system, targets


def _runs(path: Path, ap: argparse.ArgumentParser) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        ap.error(f"cannot read {path}: {e}")
    runs = (doc.get("system") or {}).get("runs")
    if not isinstance(runs, list):
        ap.error(f"{path}: no full-system runs (run bench/paper.py with --parts system)")
    return runs


def _fmt(x: dict[str, Any] | None) -> str:
    return "–" if not x else f"{x['estimate']:.3f} [{x['low']:.2f}, {x['high']:.2f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baselines", type=Path, required=True, action="append",
                    help="a bench/paper.py output holding the baselines' runs (repeat for several, e.g. one per kind)")
    ap.add_argument("--out", type=Path, required=True, help="where the paired summaries go (JSON)")
    ap.add_argument("runs", type=Path, nargs="+", help="bench/paper.py outputs holding SpinSearch's runs")
    args = ap.parse_args(argv)
    runs = [r for b in args.baselines for r in _runs(b, ap) if r["label"] != REFERENCE]
    seen: set[tuple[Any, ...]] = set()
    for path in args.runs:
        for r in _runs(path, ap):
            if r["label"] != REFERENCE:
                continue
            key = (r["kind"], r["load"], r["seed"], r["wait"])
            if key in seen:
                ap.error(f"{path}: a second SpinSearch run of {key}")
            seen.add(key)
            runs.append(r)
    part = summarize_system({"runs": runs})
    doc = {"baselines": [str(b) for b in args.baselines], "runs": [str(p) for p in args.runs],
           "grid": part["grid"], "cells": part["cells"], "targets": targets({"system": part})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    for row in part["grid"]:
        for b, v in sorted(row["baselines"].items()):
            print(f"grid wait={row['group'][0]} {b}: plan tput {_fmt(v['tps_ratio'])}, mean JCT "
                  f"{_fmt(v['mean_jct_ratio'])}, median JCT {_fmt(v['median_jct_ratio'])} ({v['seeds']} traces)")
    for row in part["cells"]:
        bt, bj = row.get("best_tps_ratio"), row.get("best_mean_jct_ratio")
        print(f"cell {row['group']}: plan tput {_fmt(bt)} ({bt and bt['baseline']}), mean JCT {_fmt(bj)} "
              f"({bj and bj['baseline']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
