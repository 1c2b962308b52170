"""Predicted vs measured on a GPU: the cost model against the executor's own runs of ``bench/gpu_check.py``.

::

    .venv/bin/python bench/gpu_fidelity.py                                    # table + summary
    .venv/bin/python bench/gpu_fidelity.py --check bench/results/gpu_check-h200.json \\
        --profile bf16=bench/results/profile-h200-bf16.json --profile tf32=bench/results/profile-h200-tf32.json \\
        --out bench/results/gpu_fidelity.json --md bench/results/gpu_fidelity.md

Every run of the check is one stage holding the whole model on one GPU (``gpu_check.py``'s ``runs`` part).
Each is priced as ``spiderflow estimate`` prices a plan (:func:`spiderflow.cli.commands.estimate.estimate_plan`,
the exact timeline of the plan's schedule; memory without stored attention scores, since the executor's
blocks run ``scaled_dot_product_attention``) on a one-GPU cluster of the device's catalog type:

- **defaults**: the catalog's datasheet peak × its default utilisation, no per-layer overhead, no optimizer
  time: what the planner uses when nobody profiled the hardware;
- **agent**: the cluster as an agent on that device reports it (``gpu_check.py``'s ``agent`` part,
  :func:`agent.profiler.profile_devices`: measured bf16 matmul rate, the rate and per-layer overhead fitted
  on the executor's block at two micro-batch sizes, the optimizer step per block);
- **profile**: the same cluster with the profile measured on that device in the same session
  (``spiderflow profile``: the executor's blocks at the runs' micro-batch sizes, the optimizer step per
  block, the memory no tensor accounts for; in profiles that carry them, the embedding and the head with its
  loss at the same sizes, their optimizer steps and the input pipeline per sample) folded in
  (:func:`spiderflow.profile.apply_profile`, blocks, embedding and head interpolated at the run's
  micro-batch size), in the run's precision.

Measured step time: the median wall time of the run's steps 3 to 6 (the first two warm up the allocator
and the kernels). Measured memory: the device's used memory at the end of training (the allocator's peak
reserve, the CUDA context and library workspaces) and, beside it, the peak of allocated tensors. Predicted
memory: the cost model's per GPU (its fixed reserve included) and, with a profile, that plus the measured
memory outside torch's allocator beyond the reserve (``memory_overhead_gib``), the device's used memory as
the profile prices it.
Per run: the ratio predicted / measured and the absolute error; summary: median and worst absolute error
per pricing, and the rank correlation (Spearman) of predicted and measured step time across the plans of
one job (the runs of GPT-3 1.3B in bf16 at global batch 16: micro-batch counts 2–16 and recomputation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fidelity import spearman  # noqa: E402

from spiderflow.cli.commands.estimate import estimate_plan  # noqa: E402
from spiderflow.core.catalog import model_preset  # noqa: E402
from spiderflow.core.costmodel import RESERVED_GIB  # noqa: E402
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Precision, Topology  # noqa: E402
from spiderflow.formats import plan_from_dict  # noqa: E402
from spiderflow.profile import Profile, apply_profile, load_profile  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEFAULT_CHECK = RESULTS / "gpu_check-h200.json"
DEFAULT_AGENT = RESULTS / "gpu_check-h200-agent.json"
DEFAULT_PROFILES = {"bf16": RESULTS / "profile-h200-bf16.json", "tf32": RESULTS / "profile-h200-tf32.json"}
JOB_GROUP = ("gpt3-1.3b", "bf16", 16)
"""(model, precision, global batch) of the runs that are plans of one job (rank correlation)."""


def device_gpu(check: dict[str, Any]) -> str:
    """The catalog type of the device the check ran on."""
    from agent.profiler import catalog_name

    env = check["parts"]["env"]
    return catalog_name(env["name"], float(env["memory_gib"]))


def price(run: dict[str, Any], gpu: str, profile: Profile | None,
          agent: dict[str, Any] | None = None) -> dict[str, Any]:
    """The estimate document of one run: catalog defaults, or the cluster an agent reported (``agent``: a
    :class:`agent.profiler.DeviceProfile` as a dict), or with a profile folded in."""
    model = model_preset(run["model"])
    plan = plan_from_dict(run["plan"], strict=False)
    precision = Precision(run["precision"])
    job = JobSpec(id=run["name"], model=model, global_batch=run["global_batch"], micro_batch=run["micro_batch"],
                  seq_len=run["seq_len"], gpus=GpuRange(min=1, max=1), precision=precision)
    cluster = Cluster(name=plan.stages[0].cluster, gpu=gpu, nodes=1, gpus_per_node=1)
    if agent is not None:
        cluster = Cluster(name=cluster.name, gpu=gpu, nodes=1, gpus_per_node=1, tflops=agent["tflops"],
                          mfu=agent["mfu"], layer_overhead_ms=agent["layer_overhead_ms"],
                          optimizer_ms_per_layer=agent["optimizer_ms_per_layer"])
    topo = Topology(clusters=(cluster,), links=())
    if profile is not None:
        topo = apply_profile(topo, profile, model=model, precision=precision, micro_batch=job.micro_batch,
                             seq_len=job.seq_len)
    return estimate_plan(plan, topo, job, fused_attention=True)


def rows(check: dict[str, Any], profiles: dict[str, Profile],
         agent: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    gpu = device_gpu(check)
    out = []
    for run in check["parts"]["runs"]:
        if "step_time_s" not in run:
            continue
        default = price(run, gpu, None)
        prof = profiles.get(run["precision"])
        measured = float(run["step_time_s"])
        mem = run.get("memory") or {}
        row: dict[str, Any] = {
            "run": run["name"], "model": run["model"], "precision": run["precision"],
            "global_batch": run["global_batch"], "micro_batch": run["micro_batch"],
            "micro_batches": run["plan"]["micro_batches"], "recompute": bool(run["plan"]["stages"][0]["recompute"]),
            "measured_step_s": measured, "measured_steps_s": run["step_times_s"],
            "default_step_s": default["step_time_s"], "default_ratio": default["step_time_s"] / measured,
            "measured_device_gib": mem.get("device_used_gib"), "measured_allocated_gib": mem.get("peak_allocated_gib"),
            "measured_reserved_gib": mem.get("peak_reserved_gib"),
            "predicted_memory_gib": default["stages"][0]["memory_gib_per_gpu"],
            "phases": run.get("phases"),
        }
        if agent is not None:
            a = price(run, gpu, None, agent)
            row.update(agent_step_s=a["step_time_s"], agent_ratio=a["step_time_s"] / measured)
        if prof is not None:
            p = price(run, gpu, prof)
            entry = prof.gpus.get(gpu)
            overhead = entry.memory_overhead_gib if entry is not None and entry.memory_overhead_gib else 0.0
            device_gib = p["stages"][0]["memory_gib_per_gpu"] + max(0.0, overhead - RESERVED_GIB)
            row.update(profile_step_s=p["step_time_s"], profile_ratio=p["step_time_s"] / measured,
                       profile_parts=p["parts"], profile_memory_gib=p["stages"][0]["memory_gib_per_gpu"],
                       profile_device_gib=device_gib,
                       profile_compute_s_per_microbatch=p["stages"][0]["compute_s_per_microbatch"])
            if mem.get("device_used_gib"):
                row["profile_memory_ratio"] = device_gib / mem["device_used_gib"]
        if mem.get("device_used_gib"):
            row["memory_ratio"] = row["predicted_memory_gib"] / mem["device_used_gib"]
        out.append(row)
    return out


def summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    def errs(key: str) -> list[float]:
        return [abs(r[key] - 1.0) for r in rs if key in r]

    out: dict[str, Any] = {"runs": len(rs)}
    for key, name in (("default_ratio", "defaults"), ("agent_ratio", "agent"), ("profile_ratio", "profile"),
                      ("memory_ratio", "memory"), ("profile_memory_ratio", "profile_memory")):
        e = errs(key)
        if e:
            out[name] = {"median_abs_error": statistics.median(e), "worst_abs_error": max(e),
                         "within_10pct": sum(x <= 0.10 for x in e), "n": len(e),
                         "ratios": [round(r[key], 4) for r in rs if key in r],
                         "worst_under": max((1.0 - r[key] for r in rs if key in r), default=0.0)}
    group = [r for r in rs if (r["model"], r["precision"], r["global_batch"]) == JOB_GROUP]
    if len(group) >= 2:
        meas = [r["measured_step_s"] for r in group]
        out["rank_correlation"] = {
            "job": "/".join(map(str, JOB_GROUP)), "plans": len(group),
            "defaults": spearman([r["default_step_s"] for r in group], meas),
            **({"agent": spearman([r["agent_step_s"] for r in group], meas)}
               if all("agent_step_s" in r for r in group) else {}),
            **({"profile": spearman([r["profile_step_s"] for r in group], meas)}
               if all("profile_step_s" in r for r in group) else {}),
        }
    return out


def markdown(rs: list[dict[str, Any]], summ: dict[str, Any], device: str) -> str:
    lines = [f"Executor runs on one {device} (`bench/gpu_check.py`), priced by `bench/gpu_fidelity.py`.", "",
             "| run | b × m | measured s | defaults s | ratio | agent s | ratio | profile s | ratio "
             "| memory GiB (device / tensors) | predicted GiB | ratio | with profile GiB | ratio |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rs:
        lines.append(
            f"| {r['run']} | {r['micro_batch']} × {r['micro_batches']} | {r['measured_step_s']:.3f} "
            f"| {r['default_step_s']:.3f} | {r['default_ratio']:.3f} | {r.get('agent_step_s', float('nan')):.3f} "
            f"| {r.get('agent_ratio', float('nan')):.3f} | {r.get('profile_step_s', float('nan')):.3f} "
            f"| {r.get('profile_ratio', float('nan')):.3f} | {r['measured_device_gib']:.1f} / "
            f"{r['measured_allocated_gib']:.1f} | {r['predicted_memory_gib']:.1f} "
            f"| {r.get('memory_ratio', float('nan')):.3f} | {r.get('profile_device_gib', float('nan')):.1f} "
            f"| {r.get('profile_memory_ratio', float('nan')):.3f} |")
    lines.append("")
    for name in ("defaults", "agent", "profile", "memory", "profile_memory"):
        if name in summ:
            s = summ[name]
            lines.append(f"- {name}: median |error| {s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}, "
                         f"{s['within_10pct']} of {s['n']} within ±10 %; worst under-prediction "
                         f"{max(0.0, s['worst_under']):.1%}")
    if "rank_correlation" in summ:
        rc = summ["rank_correlation"]
        lines.append(f"- rank correlation over the {rc['plans']} plans of {rc['job']}: "
                     + ", ".join(f"{k} {rc[k]:+.2f}" for k in ("defaults", "agent", "profile") if k in rc))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, default=DEFAULT_CHECK, help="gpu_check.json of a device run")
    ap.add_argument("--profile", action="append", default=None, metavar="PRECISION=FILE",
                    help="profile measured on the same device, per precision (repeatable)")
    ap.add_argument("--agent", type=Path, default=DEFAULT_AGENT,
                    help="gpu_check.json whose agent part priced the 'agent' column (skipped when absent)")
    ap.add_argument("--out", type=Path, help="write rows and summary as JSON")
    ap.add_argument("--md", type=Path, help="write the table as Markdown")
    args = ap.parse_args(argv)
    try:
        check = json.loads(args.check.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"gpu_fidelity: --check: cannot read {args.check}: {e}", file=sys.stderr)
        return 2
    paths = dict(DEFAULT_PROFILES)
    for spec in args.profile or []:
        prec, _, path = spec.partition("=")
        if not path:
            print(f"gpu_fidelity: --profile: expected PRECISION=FILE (got {spec!r})", file=sys.stderr)
            return 2
        paths[prec] = Path(path)
    profiles = {prec: load_profile(p) for prec, p in paths.items() if Path(p).exists()}
    agent = None
    if args.agent.exists():
        try:
            agent = json.loads(args.agent.read_text())["parts"]["agent"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            print(f"gpu_fidelity: --agent: no agent part in {args.agent}: {e}", file=sys.stderr)
            return 2
    rs = rows(check, profiles, agent)
    summ = summary(rs)
    md = markdown(rs, summ, check["parts"]["env"].get("name", "GPU"))
    print(md)
    if args.out:
        args.out.write_text(json.dumps({"rows": rs, "summary": summ}, indent=1) + "\n")
    if args.md:
        args.md.write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
