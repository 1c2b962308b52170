"""``spiderflow estimate``: price a given plan (the JSON ``spiderflow plan --json`` prints) on a topology.

Prints the predicted step time (the exact timeline of the plan's schedule, what the planner reports) and its
parts — ``compute_s`` (the busiest replica's forward and backward work), ``transfer_s`` (activation and
gradient crossings on the critical path), ``bubble_s`` (the rest of the pipeline's makespan: fill, drain
and waits), ``allreduce_s`` (gradient synchronisation and optimizer step after the drain) — the closed
form's step, and per stage the compute time per micro-batch and the memory per GPU against the device's.
``--profile FILE`` prices with a measured profile (``docs/profiles.md``); ``--precision`` overrides the
job's precision.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from spiderflow.cli.common import EXIT_USAGE, CliError, add_json_flag, console, fit_table, print_json
from spiderflow.core.catalog import model_preset
from spiderflow.core.domain import GpuRange, JobSpec, Plan, Precision, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.formats import plan_from_dict

__all__ = ["estimate_plan", "register"]


def estimate_plan(plan: Plan, topo: Topology, job: JobSpec, *, fused_attention: bool = False) -> dict[str, Any]:
    """The estimate document of the module docstring (``fused_attention``: memory without stored attention
    scores, :func:`spiderflow.core.costmodel.layer_activation_bytes`)."""
    from spiderflow.core.costmodel import breakdown, evaluate
    from spiderflow.core.tpa import simulate_plan

    for i, st in enumerate(plan.stages):
        if st.cluster not in {c.name for c in topo.clusters}:
            raise ValidationError(f"plan.stages[{i}].cluster", "is not a cluster of the topology", st.cluster)
    if plan.stages[-1].last_layer != job.model.layers - 1:
        raise ValidationError("plan.stages", f"must cover the model's {job.model.layers} layers",
                              plan.stages[-1].last_layer + 1)
    ev = evaluate(plan, topo, job, fused_attention=fused_attention)
    b = max(1, job.global_batch // plan.micro_batches)
    bd = breakdown(plan, topo, job.model, micro_batch=b, seq_len=job.seq_len, precision=job.precision)
    tl = simulate_plan(plan, topo, job, record=False)
    compute = max(math.ceil(plan.micro_batches / st.dp) * t for st, t in zip(plan.stages, bd.compute_s, strict=True))
    transfer = 2.0 * sum(bd.boundary_s)
    sync = tl.step_s - tl.makespan_s
    stages = []
    for st, t, ar, mem in zip(plan.stages, bd.compute_s, bd.allreduce_s, ev.memory_gib_per_gpu, strict=True):
        dev = topo.cluster(st.cluster).gpu_memory_gib
        stages.append({
            "cluster": st.cluster, "first_layer": st.first_layer, "last_layer": st.last_layer, "tp": st.tp,
            "dp": st.dp, "sharding": st.sharding.value, "recompute": st.recompute,
            "compute_s_per_microbatch": t, "allreduce_s": ar, "memory_gib_per_gpu": mem, "device_gib": dev,
            "fits": mem <= dev,
        })
    return {
        "step_time_s": tl.step_s,
        "closed_form_step_s": ev.step_time_s,
        "throughput_tokens_per_s": job.tokens_per_step / tl.step_s if tl.step_s > 0 else 0.0,
        "parts": {"compute_s": compute, "transfer_s": transfer,
                  "bubble_s": max(0.0, tl.makespan_s - compute - transfer), "allreduce_s": sync},
        "precision": job.precision.value, "micro_batches": plan.micro_batches, "micro_batch": b,
        "schedule": plan.schedule.value, "stages": stages,
    }


def _estimate(args: argparse.Namespace) -> int:
    from spiderflow.presets import resolve_topology
    from spiderflow.profile import apply_profile, load_profile

    try:
        doc = json.loads(Path(args.plan).read_text())
    except OSError as e:
        raise CliError(f"--plan: cannot read {args.plan}: {e.strerror}", EXIT_USAGE) from None
    except json.JSONDecodeError as e:
        raise CliError(f"--plan: {args.plan} is not JSON: {e}", EXIT_USAGE) from None
    try:
        plan = plan_from_dict(doc, strict=False)
    except ValidationError as e:
        raise CliError(f"--plan: {e}", EXIT_USAGE) from None
    topo: Topology = resolve_topology(args.topology)
    job = JobSpec(id="estimate", model=model_preset(args.model), global_batch=args.global_batch,
                  micro_batch=max(1, args.global_batch // plan.micro_batches), seq_len=args.seq_len,
                  gpus=GpuRange(min=1, max=plan.gpus), precision=Precision(args.precision))
    if args.profile is not None:
        topo = apply_profile(topo, load_profile(args.profile), model=job.model, precision=job.precision,
                             micro_batch=job.micro_batch, seq_len=job.seq_len)
    out = estimate_plan(plan, topo, job, fused_attention=args.fused_attention)
    if args.json:
        print_json(out)
        return 0
    rows = [(str(i), s["cluster"], f"{s['first_layer']}–{s['last_layer']}", str(s["tp"]), str(s["dp"]),
             s["sharding"], "yes" if s["recompute"] else "no", f"{s['compute_s_per_microbatch']:.4g}",
             f"{s['memory_gib_per_gpu']:.1f}", f"{s['device_gib']:.0f}") for i, s in enumerate(out["stages"])]
    # columns drop from the right (the title names them) rather than cut a figure on a narrow terminal
    console.print(fit_table(f"estimate ({out['schedule']}, m={out['micro_batches']}, {out['precision']})",
                            ["stage", "cluster", "layers", "tp", "dp", "T/µbatch s", "GiB/GPU", "of GiB", "sharding",
                             "recompute"], [(*r[:5], *r[7:], *r[5:7]) for r in rows],
                            keep=("stage", "cluster", "layers", "T/µbatch s", "GiB/GPU")))
    p = out["parts"]
    console.print(f"step {out['step_time_s']:.4g} s (closed form {out['closed_form_step_s']:.4g} s): compute "
                  f"{p['compute_s']:.4g} s · bubbles {p['bubble_s']:.4g} s · transfers {p['transfer_s']:.4g} s · "
                  f"all-reduce {p['allreduce_s']:.4g} s · {out['throughput_tokens_per_s']:,.0f} tokens/s",
                  highlight=False)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("estimate", help="price a given plan (plan --json output) on a topology")
    p.add_argument("--topology", required=True, help="topology file (JSON or YAML) or preset name")
    p.add_argument("--plan", required=True, help="plan JSON (as printed by `spiderflow plan --json`)")
    p.add_argument("--model", required=True, help="model preset name (e.g. llama3-8b)")
    p.add_argument("--global-batch", type=int, default=256, help="samples per step (default 256)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sample (default 2048)")
    p.add_argument("--precision", choices=[v.value for v in Precision], default=Precision.BF16.value,
                   help="training precision (default bf16)")
    p.add_argument("--profile", type=Path, default=None, help="hardware profile (docs/profiles.md)")
    p.add_argument("--fused-attention", action="store_true",
                   help="memory without stored attention scores (flash/SDPA attention)")
    add_json_flag(p)
    p.set_defaults(func=_estimate)
