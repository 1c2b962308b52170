"""``spiderflow plan``: place one job on a topology (a file or a bundled preset) with a placement policy and
show the plan.

Prints one JSON object with ``--json`` (``policy``, ``status``, ``planning_seconds``, ``step_time_s``,
``throughput_tokens_per_s``, ``optimal``, ``stages``, ``micro_batches``, ``schedule``,
``memory_gib_per_gpu``, ``usd_per_step``, ``chain``, ``gpus``, ``stats``, and ``search``: what the search did
— ``trials``/``evaluations``/``population`` for ``genetic``, ``bound_s``/``gap``/``hint_step_s`` for ``ilp``),
else a table. An unschedulable
job ends with a one-line reason naming the binding constraint and exit code 1; bad arguments exit 2.

``--dry-run`` also builds every worker's launch spec for the plan without starting anything and adds a
``ranks`` list (one entry per rank: cluster, node, device, stage, tp/dp coordinates, process groups,
precision, predicted memory; :func:`spiderflow.exec.spec.launch_ranks`), or refuses with the reason the
executor would give (exit 1). ``--plan PLAN.json`` checks a saved plan (a ``plan --json`` document or a
worker spec's ``plan`` object) instead of placing the job.
"""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from spiderflow.cli.common import EXIT_FAILED, EXIT_USAGE, CliError, add_json_flag, console, print_json
from spiderflow.cli.constraints import add_constraint_options, constraint_overrides, split_gpus
from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import Constraints, GpuRange, JobSpec, Plan, Precision, Topology
from spiderflow.core.errors import ValidationError

__all__ = ["add_search_options", "parse_gpus", "register", "result_to_dict"]


OBJECTIVES = ("jct", "cost", "balanced")
"""The values of :class:`spiderflow.core.placement.base.Objective` (not imported here: the placement code loads
its compiled kernels, and every CLI command would pay for it at start)."""
LEVEL2 = ("exact", "cpsat")
"""The values of :data:`spiderflow.core.placement.common.LEVEL2_CHOICES`."""


def parse_gpus(value: str) -> GpuRange:
    """``N`` (exactly N GPUs) or ``MIN:MAX``, after an optional ``TYPE:`` (see :func:`_job_constraints`);
    :class:`CliError` (exit 2) otherwise."""
    try:
        _, value = split_gpus(value)
    except argparse.ArgumentTypeError as e:
        raise CliError(f"--gpus: {e}", EXIT_USAGE) from None
    try:
        if ":" in value:
            lo, hi = value.split(":", 1)
            return GpuRange(min=int(lo), max=int(hi))
        n = int(value)
        return GpuRange(min=n, max=n)
    except ValueError as e:
        raise CliError(f"--gpus: expected [TYPE:]N or [TYPE:]MIN:MAX with 1 ≤ MIN ≤ MAX ({e})", EXIT_USAGE) from None


def _job_constraints(args: argparse.Namespace) -> Constraints:
    """The job's constraints from ``--gpus TYPE:N`` and the constraint options; :class:`CliError` (exit 2)
    for a contradiction."""
    try:
        kind, _ = split_gpus(args.gpus)
        return Constraints(**constraint_overrides(args, kind))  # type: ignore[arg-type]
    except (argparse.ArgumentTypeError, ValidationError) as e:
        raise CliError(f"{e}", EXIT_USAGE) from None


def _constrained(topo: Topology, job: JobSpec) -> Topology:
    """The view of ``topo`` the policy gets for ``job``'s constraints; :class:`CliError` for a cluster name
    the topology lacks (exit 2) or constraints no cluster satisfies (exit 1)."""
    from spiderflow.core.constraints import unsatisfiable, view

    c = job.constraints
    for flag, names in (("--cluster", c.clusters), ("--exclude-cluster", c.exclude_clusters)):
        missing = [n for n in names if n not in topo.index]
        if missing:
            raise CliError(f"{flag}: no cluster {missing[0]!r} in the topology (it has {', '.join(topo.names)})",
                           EXIT_USAGE)
    why = unsatisfiable(topo, job)
    if why:
        raise CliError(f"unschedulable (constraints): {why}", EXIT_FAILED)
    return view(topo, job)


def _stage_dicts(plan: Plan) -> list[dict[str, Any]]:
    return [
        {"cluster": s.cluster, "first_layer": s.first_layer, "last_layer": s.last_layer, "gpus": s.gpus,
         "tp": s.tp, "dp": s.dp, "sharding": s.sharding.value, "recompute": s.recompute}
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
        "search": {k: _finite(res.stats[k]) for k in _SEARCH_KEYS if k in res.stats},
    }


def add_search_options(p: Any) -> None:
    """``--trials``/``--population`` (genetic), ``--hint`` (ilp) and ``--gpu-price`` (spinsearch): search
    budgets as options."""
    p.add_argument("--trials", type=int, default=None, help="genetic: GA trials (default: the published 4900)")
    p.add_argument("--population", type=int, default=None, help="genetic: GA population (default: 100)")
    p.add_argument("--hint", default=None,
                   help="ilp: policies whose best plan warm-starts the solver: 'baselines' (default: firstfit, "
                        "bace, greedy), 'own', or names such as 'spinsearch' (the upper reference)")
    p.add_argument("--gpu-price", type=float, default=None,
                   help="spinsearch: shadow price λ ≥ 0 of the GPUs a plan holds on a busy pool (the plan "
                        "of least finish time × (1 + λ·pressure·GPU share) is kept; default 0: the fastest plan)")


_SEARCH_KEYS = ("trials", "evaluations", "population", "shapes", "initial_step_s", "cp_status", "objective_s",
                "bound_s", "gap", "hint_step_s", "hint_source", "hint_in_model", "finish", "finish_s", "candidates",
                "paths_planned", "target_gpus")


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


def _dry_run(doc: dict[str, Any], plan: Plan, job: JobSpec, topo: Topology | None) -> dict[str, Any]:
    """``doc`` plus the ``ranks`` the executor would start; :class:`CliError` (exit 1) if it would refuse."""
    from spiderflow.core.errors import SpiderFlowError
    from spiderflow.exec.spec import TrainSpec, launch_ranks
    from spiderflow.formats import plan_to_dict

    try:
        spec = TrainSpec(job_id=job.id, model=job.model, plan=plan, seq_len=job.seq_len,
                         global_batch=job.global_batch, steps=max(1, job.steps), precision=job.precision)
        per_node = {c.name: c.gpus_per_node for c in topo.clusters} if topo is not None else None
        ranks = launch_ranks(spec, gpus_per_node=per_node, memory_gib=tuple(plan.memory_gib_per_gpu))
    except SpiderFlowError as e:
        raise CliError(f"the executor refuses this plan: {e}", EXIT_FAILED) from None
    return {**doc, "plan": plan_to_dict(plan), "world_size": len(ranks), "ranks": ranks}


def _load_plan(path: Path) -> Plan:
    import json

    from spiderflow.core.errors import ValidationError
    from spiderflow.formats import plan_from_dict

    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CliError(f"--plan: cannot read {path}: {e}", EXIT_USAGE) from None
    if isinstance(raw, dict) and isinstance(raw.get("plan"), dict):
        raw = raw["plan"]
    try:
        plan = plan_from_dict(raw, strict=False)
    except ValidationError as e:
        raise CliError(f"--plan: {e}", EXIT_USAGE) from None
    mem = raw.get("memory_gib_per_gpu") if isinstance(raw, dict) else None
    if isinstance(mem, list) and all(isinstance(x, (int, float)) for x in mem):
        plan = Plan(stages=plan.stages, micro_batches=plan.micro_batches, schedule=plan.schedule,
                    step_time_s=plan.step_time_s, memory_gib_per_gpu=tuple(float(x) for x in mem),
                    extras=plan.extras)
    return plan


def _plan(args: argparse.Namespace) -> int:
    from spiderflow.core.placement.base import Budget, Objective
    from spiderflow.core.placement.common import LocalPlanner
    from spiderflow.core.placement.options import SearchOptions, make_policy
    from spiderflow.presets import resolve_topology
    from spiderflow.runtime import configure_logging

    configure_logging(level="warning")
    if args.time_limit is not None and not args.time_limit > 0:
        raise CliError(f"--time-limit: must be > 0 (got {args.time_limit})", EXIT_USAGE)
    job = JobSpec(
        id="cli", model=model_preset(args.model), global_batch=args.global_batch, micro_batch=args.micro_batch,
        seq_len=args.seq_len, gpus=parse_gpus(args.gpus), precision=args.precision,
        constraints=_job_constraints(args),
    )
    if args.plan is not None:
        if not args.dry_run:
            raise CliError("--plan: only with --dry-run", EXIT_USAGE)
        saved = _load_plan(args.plan)
        topo_opt = resolve_topology(args.topology) if args.topology else None
        print_json(_dry_run({"policy": None, "status": "saved"}, saved, job, topo_opt))
        return 0
    if not args.topology:
        raise CliError("--topology: required (unless --plan is given)", EXIT_USAGE)
    topo: Topology = resolve_topology(args.topology)
    if args.profile is not None:
        from spiderflow.profile import apply_profile, load_profile

        topo = apply_profile(topo, load_profile(args.profile), model=job.model, precision=job.precision,
                             micro_batch=job.micro_batch, seq_len=job.seq_len)
    topo = _constrained(topo, job)
    render: Any = None
    if args.gantt is not None:
        try:
            gantt = importlib.import_module("spiderflow.viz.gantt")
            render = gantt.render_gantt
        except (ImportError, AttributeError):
            raise CliError("--gantt: the Gantt renderer (spiderflow.viz.gantt) is not available", EXIT_USAGE) from None
    try:
        options = SearchOptions(trials=args.trials, population=args.population, hint=args.hint,
                                gpu_price=args.gpu_price)
        policy = make_policy(args.policy, options, planner=LocalPlanner(level2=args.level2))
    except ValidationError as e:
        raise CliError(f"--{e.field.replace('_', '-')}: {e.reason} (got {e.value!r})", EXIT_USAGE) from None
    budget = Budget(time_limit_s=args.time_limit, seed=args.seed, objective=Objective(args.objective))
    from spiderflow.core.tpa.timeline import result_on_timeline

    res = result_on_timeline(policy.place(topo, job, budget), topo, job)  # every policy on one prediction
    doc = result_to_dict(res)
    if not res.ok:
        if args.json:
            print_json(doc)
        what = f" ({res.constraint})" if res.constraint else ""
        raise CliError(f"{res.status.value}{what}: {res.reason}", EXIT_FAILED)
    assert res.plan is not None
    if render is not None:
        render(res.plan, topo, job, Path(args.gantt))
    if args.dry_run:
        print_json(_dry_run(doc, res.plan, job, topo))
        return 0
    if args.json:
        print_json(doc)
    else:
        _table(doc)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("plan", help="place one job on a topology with a placement policy")
    p.add_argument("--topology", default=None,
                   help="topology file (JSON or YAML) or preset name (e.g. aws-10-dtfm); required unless --plan")
    p.add_argument("--model", required=True, help="model preset name (e.g. gpt3-6.7b)")
    p.add_argument("--gpus", required=True, metavar="[TYPE:]N",
                   help="GPUs: N (exactly), MIN:MAX, or with a GPU type A100:8 / H100:8:16")
    p.add_argument("--policy", default="spinsearch", help="placement policy (default: spinsearch)")
    p.add_argument("--global-batch", type=int, default=256, help="samples per step (default 256)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--precision", choices=[v.value for v in Precision], default=Precision.BF16.value,
                   help="training precision (default bf16)")
    p.add_argument("--time-limit", type=float, default=None, help="search time limit in seconds (ilp, genetic)")
    add_search_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the policy's random generator")
    p.add_argument("--objective", choices=OBJECTIVES, default="jct", help="what to optimise")
    p.add_argument("--level2", choices=LEVEL2, default="exact",
                   help="TPA's solver for the plan's blocks (spinsearch, bace): exact (default) or the CP-SAT model")
    p.add_argument("--gantt", type=Path, default=None, help="write a Gantt chart of the pipeline to FILE")
    p.add_argument("--profile", type=Path, default=None,
                   help="hardware profile (docs/profiles.md): measured rates and bandwidths replace the catalog's")
    p.add_argument("--dry-run", action="store_true",
                   help="also build every rank's launch spec and print the plan with a 'ranks' list (JSON), "
                        "or the reason the executor refuses the plan; starts nothing")
    p.add_argument("--plan", type=Path, default=None, help="with --dry-run: check this saved plan JSON instead "
                   "of placing the job")
    add_constraint_options(p)
    add_json_flag(p)
    p.set_defaults(func=_plan)
