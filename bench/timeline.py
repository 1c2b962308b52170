"""Timeline benchmark: the steady-state extrapolation against the full event simulation.

TPA scores pipeline schedules with the exact timeline (``spiderflow.core.tpa.timeline.simulate_plan`` without
records). For a long 1F1B-family pipeline it simulates about a quarter of the micro-batches, checks that
the steady state repeats, and extrapolates the rest (``_steady_extrapolation``). This script draws random
pipelines shaped like the plans TPA makes (2–20 stages, data-parallel degrees 1–8 with mixed layouts,
stage times 5–60 ms, links 0–20 ms to serialise and 0–50 ms of latency, 1F1B, the latency-aware schedule
and interleaving with two chunks) and reports, per micro-batch count: how many were extrapolated, the
seconds of the full simulation (orders built and simulated) against the extrapolating path (the attempt,
and the full simulation when it finds no period), and the largest relative difference of the step.

Usage::

    .venv/bin/python bench/timeline.py                          # 300 pipelines, seed 1
    .venv/bin/python bench/timeline.py --instances 600 --seed 2 --out bench/results/timeline.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spiderflow.cli.common import csv_ints  # noqa: E402
from spiderflow.core.domain import Schedule  # noqa: E402
from spiderflow.core.kernels import warm  # noqa: E402
from spiderflow.core.tpa import timeline  # noqa: E402
from spiderflow.core.tpa.timeline import StageTiming  # noqa: E402

Links = tuple[tuple[float, ...], ...]


def draw(rng: random.Random, m: int) -> tuple[Schedule, int, tuple[StageTiming, ...], Links, Links]:
    """One random pipeline (see the module docstring)."""
    schedule = rng.choice([Schedule.ONE_F_ONE_B, Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE,
                           Schedule.INTERLEAVED_1F1B])
    n = rng.randint(2, 20)
    chunks = 1
    if schedule is Schedule.INTERLEAVED_1F1B:
        n = rng.choice([d for d in (2, 4, 8, 16) if m % d == 0])
        chunks = 2
        dps = [1] * n  # interleaving with data parallelism can deadlock (schedules.replica_ops)
    else:
        layout = rng.choice(["uniform", "two-groups", "mixed"])
        if layout == "uniform":
            dps = [rng.choice([1, 2, 3, 4, 8])] * n
        elif layout == "two-groups":
            a, b = rng.choice([1, 2, 4]), rng.choice([1, 3, 5])
            cut = rng.randint(1, n - 1)
            dps = [a] * cut + [b] * (n - cut)
        else:
            dps = [rng.choice([1, 2, 4]) for _ in range(n)]
    base = rng.uniform(0.005, 0.06)
    stages = tuple(StageTiming(compute_s=base * d * rng.uniform(0.7, 1.3), replicas=d,
                               allreduce_s=rng.uniform(0.0, 0.5)) for d in dps)
    ser = [[0.0] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    for i in range(n):
        j = (i + 1) % n
        wan = rng.random() < 0.4
        s = rng.uniform(0.0, 0.02) if wan else rng.uniform(0.0, 0.002)
        la = rng.uniform(0.005, 0.05) if wan else 0.0
        ser[i][j] = ser[j][i] = s
        lat[i][j] = lat[j][i] = la
    return schedule, chunks, stages, tuple(map(tuple, ser)), tuple(map(tuple, lat))


def _cold() -> None:
    """Drop the memoised orders, so each path builds the ones it needs, as a first plan of a shape does."""
    timeline._frozen_orders.cache_clear()
    timeline._stage_order.cache_clear()
    timeline._frozen_packed.cache_clear()


def _full(schedule: Schedule, m: int, chunks: int, stages: tuple[StageTiming, ...], ser: Links,
          lat: Links) -> timeline.Timeline:
    """The full event simulation of all ``m`` micro-batches (orders built and packed, then simulated: the
    path :func:`~spiderflow.core.tpa.timeline.simulate_plan` takes when it does not extrapolate)."""
    return timeline._simulate_frozen(schedule, m, chunks, stages, ser, lat, None)


def measure(instances: int, seed: int, sizes: list[int]) -> dict[str, Any]:
    """Per micro-batch count: ``instances / len(sizes)`` random pipelines timed on both paths."""
    rng = random.Random(seed)
    rows: dict[int, dict[str, Any]] = {}
    for m in sizes:
        full_s = ext_s = 0.0
        done = extrapolated = 0
        worst = 0.0
        for _ in range(instances // len(sizes)):
            schedule, chunks, stages, ser, lat = draw(rng, m)
            _cold()
            t0 = time.perf_counter()
            try:
                want = _full(schedule, m, chunks, stages, ser, lat)
            except ValueError:
                continue  # an order that cannot run with this layout
            full_s += time.perf_counter() - t0
            _cold()
            t0 = time.perf_counter()
            got = timeline._steady_extrapolation(schedule, m, chunks, stages, ser, lat, None)
            if got is None:
                got = _full(schedule, m, chunks, stages, ser, lat)
            else:
                extrapolated += 1
                worst = max(worst, abs(got.step_s - want.step_s) / want.step_s)
            ext_s += time.perf_counter() - t0
            done += 1
        rows[m] = {"pipelines": done, "extrapolated": extrapolated, "full_s": full_s, "with_extrapolation_s": ext_s,
                   "speedup": full_s / ext_s if ext_s > 0 else None, "max_rel_diff": worst}
    return {"seed": seed, "instances": instances, "by_m": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=300, help="pipelines in all (split over --sizes)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sizes", type=csv_ints(minimum=16), default=[256, 512, 1024],
                    help="micro-batch counts, comma-separated (each ≥ 16, a multiple of 16 for interleaving)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    sizes: list[int] = args.sizes
    if not sizes:
        ap.error("argument --sizes: give at least one micro-batch count")
    if any(m % 16 for m in sizes):
        ap.error("argument --sizes: each must be a multiple of 16 (interleaved pipelines of up to 16 stages)")
    if args.instances < len(sizes):
        ap.error(f"argument --instances: at least one per size ({len(sizes)})")
    warm()  # the compiled kernels load before the first timed simulation
    res = measure(args.instances, args.seed, sizes)
    table = Table(title=f"steady-state extrapolation vs full simulation (seed {args.seed})")
    for col in ("m", "pipelines", "extrapolated", "full s", "with extrapolation s", "speed-up", "max rel diff"):
        table.add_column(col, justify="right")
    for m, r in res["by_m"].items():
        table.add_row(str(m), str(r["pipelines"]), str(r["extrapolated"]), f"{r['full_s']:.3f}",
                      f"{r['with_extrapolation_s']:.3f}", f"{r['speedup']:.2f}×" if r["speedup"] else "—",
                      f"{r['max_rel_diff']:.1e}")
    Console().print(table)
    if args.out:
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
