"""``spiderflow plan``: place one job on a topology (a file or a bundled preset) with a placement policy and
show the plan.

Prints one JSON object with ``--json`` (``policy``, ``status``, ``planning_seconds``, ``step_time_s``,
``throughput_tokens_per_s``, ``optimal``, ``stages``, ``micro_batches``, ``schedule``,
``memory_gib_per_gpu``, ``usd_per_step``, ``chain``, ``gpus``, ``stats``), else a table. An unschedulable
job ends with a one-line reason naming the binding constraint and exit code 1; bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from spiderflow.catalog import model_preset
from spiderflow.cli.common import EXIT_FAILED, EXIT_USAGE, CliError, add_json_flag, console, print_json
from spiderflow.domain import GpuRange, JobSpec, Plan, Topology

__all__ = ["parse_gpus", "register", "result_to_dict"]


OBJECTIVES = ("jct", "cost", "balanced")
"""The values of :class:`spiderflow.placement.base.Objective` (not imported here: the placement code loads
its compiled kernels, and every CLI command would pay for it at start)."""
LEVEL2 = ("exact", "cpsat")
"""The values of :data:`spiderflow.placement.common.LEVEL2_CHOICES`."""


def parse_gpus(value: str) -> GpuRange:
    """``N`` (exactly N GPUs) or ``MIN:MAX``; :class:`CliError` (exit 2) otherwise."""
    try:
        if ":" in value:
            lo, hi = value.split(":", 1)
            return GpuRange(min=int(lo), max=int(hi))
        n = int(value)
        return GpuRange(min=n, max=n)
    except ValueError as e:
        raise CliError(f"--gpus: expected N or MIN:MAX with 1 ≤ MIN ≤ MAX ({e})", EXIT_USAGE) from None


def _stage_dicts(plan: Plan) -> list[dict[str, Any]]:
    return [
        {"cluster": s.cluster, "first_layer": s.first_layer, "last_layer": s.last_layer, "gpus": s.gpus,
         "tp": s.tp, "dp": s.dp}
        for s in plan.stages
    ]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def result_to_dict(res: Any) -> dict[str, Any]:
    """The JSON document of a placement result (plan fields are ``null`` when there is no plan)."""
    plan = res.plan
    return {
        "policy": res.policy,
        "status": res.status.value,
        "planning_seconds": res.planning_seconds,
        "step_time_s": _finite(plan.step_time_s) if plan else None,
        "throughput_tokens_per_s": plan.throughput_tokens_per_s if plan else None,
        "optimal": res.optimal,
        "stages": _stage_dicts(plan) if plan else [],
        "micro_batches": plan.micro_batches if plan else None,
        "schedule": plan.schedule.value if plan else None,
        "memory_gib_per_gpu": list(plan.memory_gib_per_gpu) if plan else [],
        "usd_per_step": plan.usd_per_step if plan else None,
        "chain": list(plan.chain) if plan else [],
        "gpus": plan.gpus if plan else 0,
        "reason": res.reason,
        "constraint": res.constraint,
        "stats": {k: _finite(v) for k, v in res.stats.items()},
    }


def _table(doc: dict[str, Any]) -> None:
    table = Table(title=f"plan by {doc['policy']} ({doc['planning_seconds'] * 1e3:.1f} ms)")
    for col in ("stage", "cluster", "layers", "GPUs", "tp", "dp", "GiB/GPU"):
        table.add_column(col, justify="left" if col == "cluster" else "right")
    for i, (st, mem) in enumerate(zip(doc["stages"], doc["memory_gib_per_gpu"], strict=True)):
        table.add_row(str(i), st["cluster"], f"{st['first_layer']}–{st['last_layer']}", str(st["gpus"]),
                      str(st["tp"]), str(st["dp"]), f"{mem:.1f}")
    console.print(table)
    console.print(
        f"step {doc['step_time_s']:.3f} s · {doc['throughput_tokens_per_s']:,.0f} tokens/s · "
        f"{doc['gpus']} GPUs · {doc['micro_batches']} micro-batches ({doc['schedule']}) · "
        f"${doc['usd_per_step']:.6f} electricity/step"
        + {True: " · proven optimal", False: " · not proven optimal (time limit)", None: ""}[doc["optimal"]],
        highlight=False,
    )


def _plan(args: argparse.Namespace) -> int:
    from spiderflow.runtime import configure_logging

    configure_logging(level="warning")
    if args.time_limit is not None and not args.time_limit > 0:
        raise CliError(f"--time-limit: must be > 0 (got {args.time_limit})", EXIT_USAGE)
    from spiderflow.placement.base import Budget, Objective, get_policy
    from spiderflow.placement.common import set_level2
    from spiderflow.presets import resolve_topology

    topo: Topology = resolve_topology(args.topology)
    job = JobSpec(
        id="cli", model=model_preset(args.model), global_batch=args.global_batch, micro_batch=args.micro_batch,
        seq_len=args.seq_len, gpus=parse_gpus(args.gpus),
    )
    render: Any = None
    if args.gantt is not None:
        try:
            gantt = importlib.import_module("spiderflow.viz.gantt")
            render = gantt.render_gantt
        except (ImportError, AttributeError):
            raise CliError("--gantt: the Gantt renderer (spiderflow.viz.gantt) is not available", EXIT_USAGE) from None
    policy = get_policy(args.policy)
    set_level2(policy, args.level2)
    budget = Budget(time_limit_s=args.time_limit, seed=args.seed, objective=Objective(args.objective))
    res = policy.place(topo, job, budget)
    doc = result_to_dict(res)
    if not res.ok:
        if args.json:
            print_json(doc)
        what = f" ({res.constraint})" if res.constraint else ""
        raise CliError(f"{res.status.value}{what}: {res.reason}", EXIT_FAILED)
    assert res.plan is not None
    if render is not None:
        render(res.plan, topo, job, Path(args.gantt))
    if args.json:
        print_json(doc)
    else:
        _table(doc)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="place one job on a topology with a placement policy")
    p.add_argument("--topology", required=True, help="topology file (JSON or YAML) or preset name (e.g. aws-10-dtfm)")
    p.add_argument("--model", required=True, help="model preset name (e.g. gpt3-6.7b)")
    p.add_argument("--gpus", required=True, help="GPUs: N (exactly) or MIN:MAX")
    p.add_argument("--policy", default="spinsearch", help="placement policy (default: spinsearch)")
    p.add_argument("--global-batch", type=int, default=256, help="samples per step (default 256)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--time-limit", type=float, default=None, help="search time limit in seconds (ilp, genetic)")
    p.add_argument("--seed", type=int, default=0, help="seed of the policy's random generator")
    p.add_argument("--objective", choices=OBJECTIVES, default="jct", help="what to optimise")
    p.add_argument("--level2", choices=LEVEL2, default="exact",
                   help="TPA's solver for the plan's blocks (spinsearch, bace): exact (default) or the CP-SAT model")
    p.add_argument("--gantt", type=Path, default=None, help="write a Gantt chart of the pipeline to FILE")
    add_json_flag(p)
    p.set_defaults(func=_plan)
