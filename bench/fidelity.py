"""Predicted vs measured: the cost model against published GPU training measurements and our own executed runs.

::

    .venv/bin/python bench/fidelity.py                                   # table + summary
    .venv/bin/python bench/fidelity.py --out bench/results/fidelity.json --md bench/results/fidelity.md
    .venv/bin/python bench/fidelity.py --no-testbed --loso                 # + leave-one-source-out fit

Records:

- ``bench/fidelity_records.json``: published, citable measurements, each copied with its exact source (URL
  pinned to a commit, document, table and row) — torchtitan's ``benchmarks/`` documents (tokens/s per GPU
  and peak memory of Llama 3.1 8B/70B on H100 with FSDP/TP) and Megatron-LM's README model table (per-GPU
  model teraFLOP/s of GPT models from 1.7B to 462B on H100 with TP/PP/DP). Configuration the source does
  not state is listed per record under ``assumed``.
- ``bench/results/testbed_exec*.json`` and ``testbed_best*.json``: every executed run of ours on the CPU
  testbed (``bench/testbed_exec.py``, against firstfit and against the best baselines, one record per policy
  and round), re-predicted from the calibration the run stored and the links its planner saw (the agents'
  measured figures between the plan's stages, where the run stored them; else the links it configured).

Per record: measured and predicted step time (s), their ratio ``predicted / measured`` and the absolute
error ``|predicted − measured| / measured``; memory likewise where the source gives it. Summary: median and
worst absolute error (GPU records and testbed runs separately), the testbed runs by how many ranks their
plan runs (the emulated clusters share this host's cores, and the agents calibrate side by side) and by how
the clusters got their CPU (sharing the host's cores, or each its own quota: ``--cpus-per-gpu``), memory
error and the worst under-prediction, and the rank correlation (Spearman) between predicted and measured
per-GPU throughput across the distinct plans of one job (records sharing a ``group``; each testbed file is
one job, and the records of one plan — several policies or rounds ran it — count once, averaged).

Measured step time: ``tokens_per_step / (tokens/s per GPU × GPUs)`` for torchtitan; for Megatron-LM
``F / (GPUs × TFLOP/s per GPU)`` with ``F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``, the model-FLOPs count
its MFU column implies — the same count the cost model prices (``3·(24·b·s·h² + 4·b·s²·h)`` per layer plus
``6·b·s·h·V`` for the head), so the ratio does not depend on the FLOPs convention.

Attribution (which term is off): per GPU record the shares of the predicted timeline step taken by compute
at the catalog rate, tensor-parallel all-reduces, the pipeline bubble (fill, drain, waits) and the gradient
sync, next to the utilisation the measured step implies for the model FLOPs (``implied MFU``). ``--loso``
fits the one constant a default GPU rate has (the H100's ``mfu``) on one source's records and reports the
median error on the other source's records (leave one source out).

Memory is priced with ``fused_attention`` (no stored attention scores: torchtitan and Megatron-LM run
flash attention; the planner's default still charges the scores).
Predicted: :func:`spiderflow.core.costmodel.evaluate` (the closed form the planner's searches and
``spiderflow estimate`` use) and the exact timeline (:func:`spiderflow.core.tpa.simulate_plan`); the table's
``ratio`` is the timeline's (what the planner reports), with the closed form's alongside. The topology of a
GPU record is one cluster of ``nodes × gpus_per_node`` of the stated GPU type, the stated device memory and
the inter-node bandwidth the source states (per GPU × GPUs per node); the intra-node bandwidth is the GPU's
NVLink figure from its datasheet (cited in the record).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from spiderflow.core.catalog import ModelFamily, ModelSpec  # noqa: E402
from spiderflow.core.costmodel import (  # noqa: E402
    FSDP_PER_BLOCK_KEY,
    OVERLAP_KEY,
    SELECTIVE_RECOMPUTE_KEY,
    allreduce_time,
    breakdown,
    compute_rate_tflops,
    evaluate,
    exposed_tp_comm,
    plan_options,
    wire_bytes,
)
from spiderflow.core.domain import (  # noqa: E402
    Cluster,
    GpuRange,
    JobSpec,
    Link,
    Plan,
    Precision,
    Schedule,
    Sharding,
    Stage,
    Topology,
)
from spiderflow.core.tpa import simulate_plan  # noqa: E402

RECORDS = ROOT / "bench" / "fidelity_records.json"
TESTBED = sorted((ROOT / "bench" / "results").glob("testbed_exec*.json")) + sorted(
    (ROOT / "bench" / "results").glob("testbed_best*.json"))
"""Every executed run of ours on the CPU testbed: ``bench/testbed_exec.py``'s runs against firstfit
(``testbed_exec*``) and against the best baselines (``testbed_best*``, one record per policy and round)."""
CLUSTER = "gpu"


def megatron_flops(model: dict[str, int], batch: int, seq: int) -> float:
    """Model FLOPs of one step (Narayanan et al. 2021, without recomputation)."""
    n, h, v = model["layers"], model["hidden"], model["vocab"]
    return 72.0 * batch * seq * n * h * h * (1.0 + seq / (6.0 * h) + v / (12.0 * n * h))


RECORD_FILES: tuple[Path, ...] = (RECORDS,)
"""Files of GPU records (each ``{"records": [...]}`` in the schema of ``bench/fidelity_records.json``); a new
source of records (for example our own executor's GPU runs) is one more file here."""


def load_records(files: tuple[Path, ...] = RECORD_FILES) -> list[dict[str, Any]]:
    """Every GPU record of every source file, in file order (the one place records are read)."""
    out: list[dict[str, Any]] = []
    for path in files:
        if path.exists():
            out.extend(json.loads(path.read_text())["records"])
    return out


def framework_extras(rec: dict[str, Any]) -> dict[str, float]:
    """The cost model's framework options for a record (:func:`spiderflow.core.costmodel.plan_options`), set
    only where the record's source says the framework runs them: ``overlap`` for Megatron-LM's
    ``--tp-comm-overlap`` / ``--overlap-grad-reduce``, ``selective_recompute`` for torchtitan's op-level
    selective checkpointing (``plan.selective_ac_option == 'op'``), ``fsdp_per_block`` for torchtitan's FSDP2
    without pipelining (``framework.fsdp == 'per_block'``: resharded after each block's forward, gathered in
    bf16). torchtitan's eager fp32 loss
    (``framework.loss == 'eager_fp32_upcast'``) is the executor's own, which the cost model always prices
    (:data:`spiderflow.core.costmodel.LOGIT_BYTES`)."""
    fw, p = rec.get("framework", {}), rec["plan"]
    extras: dict[str, float] = {}
    if fw.get("tp_comm_overlap") or fw.get("overlap_grad_reduce"):
        extras[OVERLAP_KEY] = 1.0
    if p.get("activation_checkpointing") == "selective" and p.get("selective_ac_option") == "op":
        extras[SELECTIVE_RECOMPUTE_KEY] = 1.0
    if fw.get("fsdp") == "per_block" and p.get("sharding") == "fsdp":
        extras[FSDP_PER_BLOCK_KEY] = 1.0
    return extras


def record_model(m: dict[str, Any]) -> ModelSpec:
    """The record's model: ``gpt`` blocks unless it names a ``family`` (``llama``: ``kv_heads``, ``ffn_hidden``)."""
    fam = ModelFamily(m.get("family", "gpt"))
    return ModelSpec(name=m["name"], layers=m["layers"], hidden=m["hidden"], heads=m["heads"], vocab=m["vocab"],
                     family=fam, kv_heads=m.get("kv_heads"), ffn_hidden=m.get("ffn_hidden"))


def gpu_case(
    rec: dict[str, Any], profile: Any = None, mfu: float | None = None, *, options: bool = True
) -> tuple[Plan, Topology, JobSpec]:
    """The plan, topology and job of one published record (``mfu``: override the GPU type's default;
    ``options``: price the framework options the record's source states, :func:`framework_extras`)."""
    hw, p, m = rec["hardware"], rec["plan"], rec["model"]
    model = record_model(m)
    gpn = int(hw["gpus_per_node"])
    cluster = Cluster(
        name=CLUSTER, gpu=hw["gpu"], nodes=int(hw["nodes"]), gpus_per_node=gpn,
        intra_node_gbps=float(hw.get("intra_node_gbps", 600.0)),
        inter_node_gbps=float(hw["inter_node_gbps_per_gpu"]) * gpn, memory_gib=float(hw["memory_gib"]), mfu=mfu,
    )
    topo = Topology(clusters=(cluster,), links=())
    if profile is not None:
        from spiderflow.profile import apply_profile

        topo = apply_profile(topo, profile)
    pp, tp, dp = int(p["pp"]), int(p["tp"]), int(p["dp"])
    per = model.layers // pp
    if per * pp != model.layers:
        raise ValueError(f"{rec['id']}: {model.layers} layers do not split into {pp} equal stages")
    stages = tuple(
        Stage(cluster=CLUSTER, first_layer=i * per, last_layer=(i + 1) * per - 1, tp=tp, dp=dp,
              sharding=Sharding(p["sharding"]), recompute=p["activation_checkpointing"] == "full")
        for i in range(pp)
    )
    gb = int(rec["global_batch"])
    plan = Plan(stages=stages, micro_batches=gb // int(p["micro_batch"]), schedule=Schedule(p["schedule"]),
                extras=framework_extras(rec) if options else {})
    job = JobSpec(id=rec["id"], model=model, global_batch=gb, micro_batch=int(p["micro_batch"]),
                  seq_len=int(rec["seq_len"]), gpus=GpuRange(min=1, max=plan.gpus),
                  precision=Precision(rec.get("precision", "bf16")))
    return plan, topo, job


def measured_step(rec: dict[str, Any], gpus: int) -> float:
    meas = rec["measured"]
    if "tokens_per_s_per_gpu" in meas:
        return float(rec["global_batch"]) * float(rec["seq_len"]) / (float(meas["tokens_per_s_per_gpu"]) * gpus)
    return megatron_flops(rec["model"], rec["global_batch"], rec["seq_len"]) / (
        gpus * float(meas["tflops_per_gpu"]) * 1e12)


def predict(plan: Plan, topo: Topology, job: JobSpec) -> tuple[float, float, float]:
    """(closed-form step, timeline step, max memory GiB per GPU)."""
    ev = evaluate(plan, topo, job, fused_attention=True)  # every framework here runs fused attention
    tl = simulate_plan(plan, topo, job, record=False).step_s
    return ev.step_time_s, tl, max(ev.memory_gib_per_gpu)


def model_flops(plan: Plan, job: JobSpec) -> float:
    """Model FLOPs of one step as the cost model counts them (forward ×3, no recomputation)."""
    b = job.global_batch // plan.micro_batches
    head = 2.0 * b * job.seq_len * job.model.hidden * job.model.vocab
    per_mb = job.model.layers * job.model.layer_fwd_flops(b, job.seq_len) + head
    return 3.0 * per_mb * plan.micro_batches


def attribution(plan: Plan, topo: Topology, job: JobSpec, meas: float, tl: float) -> dict[str, float]:
    """Which term of the prediction is off, in fractions of the predicted (timeline) step: ``compute`` (the
    stages' matmul time at the catalog rate, recomputation included), ``tp_comm`` (tensor-parallel
    all-reduces), ``bubble`` (the timeline's step minus the busiest replica's work and the gradient sync:
    fill, drain and waits), ``dp_sync`` (gradient all-reduce/reduce-scatter after the pipeline drains); and
    ``implied_mfu``: the fraction of the GPU's bf16 datasheet peak that the measured step implies for the
    model FLOPs (Megatron's MFU definition)."""
    b = job.global_batch // plan.micro_batches
    bd = breakdown(plan, topo, job.model, micro_batch=b, seq_len=job.seq_len, precision=job.precision,
                   fused_attention=True)
    c = topo.cluster(plan.stages[0].cluster)
    busiest = max(range(len(plan.stages)),
                  key=lambda i: bd.compute_s[i] * math.ceil(plan.micro_batches / plan.stages[i].dp))
    st = plan.stages[busiest]
    per_rep = math.ceil(plan.micro_batches / st.dp)
    n_ar = (6 if st.recompute else 4) * st.layers
    vb = wire_bytes(c, job.precision)
    tp = n_ar * allreduce_time(vb * b * job.seq_len * job.model.hidden, st.tp,
                               c.intra_node_gbps if st.tp <= c.gpus_per_node else c.inter_node_gbps)
    if plan_options(plan).overlap and tp > 0.0:
        rate = st.tp * compute_rate_tflops(c, job.precision) * 1e12
        tp = exposed_tp_comm(tp, (4.0 if st.recompute else 3.0) * st.layers * 2.0 * b * job.seq_len
                             * job.model.params_per_layer / rate, st.tp)
    work = per_rep * bd.compute_s[busiest]
    tp_total = per_rep * tp
    return {
        "compute": (work - tp_total) / tl, "tp_comm": tp_total / tl, "dp_sync": bd.dp_sync_s / tl,
        "bubble": max(0.0, tl - work - bd.dp_sync_s) / tl,
        "implied_mfu": model_flops(plan, job) / (plan.gpus * c.gpu_type.peak_tflops * 1e12 * meas),
    }


def gpu_rows(profile: Any = None, mfu: float | None = None, *, options: bool = True) -> list[dict[str, Any]]:
    rows = []
    for rec in load_records():
        plan, topo, job = gpu_case(rec, profile, mfu, options=options)
        closed, tl, mem = predict(plan, topo, job)
        meas = measured_step(rec, plan.gpus)
        row: dict[str, Any] = {
            "id": rec["id"], "kind": "gpu", "source": rec["source"]["url"],
            "table": f"{rec['source']['table']} / {rec['source']['row']}", "group": rec.get("group"),
            "gpus": plan.gpus, "measured_s": meas, "predicted_s": tl, "predicted_closed_s": closed,
            "ratio": tl / meas, "ratio_closed": closed / meas, "abs_err": abs(tl - meas) / meas,
            "measured_per_gpu_tput": 1.0 / (meas * plan.gpus), "predicted_per_gpu_tput": 1.0 / (tl * plan.gpus),
            "source_kind": "torchtitan" if "torchtitan" in rec["source"]["url"] else "megatron",
            "terms": attribution(plan, topo, job, meas, tl), "options": sorted(plan.extras),
        }
        if "memory_gib" in rec["measured"]:
            mm = float(rec["measured"]["memory_gib"])
            row.update(measured_mem_gib=mm, predicted_mem_gib=mem, mem_err=(mem - mm) / mm)
        rows.append(row)
    return rows


def testbed_rows() -> list[dict[str, Any]]:
    from testbed_exec import topology as testbed_topology

    rows = []
    for path in TESTBED:
        d = json.loads(path.read_text())
        t = d["topology"]
        topo = testbed_topology(slow_mbit=t["slow_mbit"], slow_ms=t["slow_ms"], fast_mbit=t["fast_mbit"],
                                fast_ms=t["fast_ms"], gpus=t["gpus_per_cluster"])
        if "links" in t:  # the links as the run laid them out (every topology kind: slow-link, ring)
            topo = Topology(clusters=topo.clusters, links=tuple(
                Link(a=x["a"], b=x["b"], bandwidth_gbps=float(x["mbit"]) / 1000.0, latency_ms=float(x["ms"]))
                for x in t["links"]))
        configured = topo
        j = d["job"]
        model = ModelSpec(name="testbed", **j["model"])
        # Runs recorded before the agents passed the job's precision to the workers trained in fp32 (4-byte
        # activations, the calibration in fp32 too): they are priced in the precision they ran in.
        precision = Precision(d.get("executed_precision", "fp32"))
        for run in d["runs"]:
            if run.get("measured_step_s") is None:
                continue
            stages = tuple(Stage(cluster=s["cluster"], first_layer=s["layers"][0], last_layer=s["layers"][1],
                                 dp=s["gpus"]) for s in run["stages"])
            plan = Plan(stages=stages, micro_batches=int(run["micro_batches"]), schedule=Schedule(run["schedule"]))
            job = JobSpec(id=run["job"], model=model, global_batch=j["global_batch"], micro_batch=j["micro_batch"],
                          seq_len=j["seq_len"], gpus=GpuRange(min=1, max=plan.gpus), precision=precision)
            # the calibration the run was planned on: taken just before it (--recalibrate), else at start
            cal = run.get("calibration") or d["calibration"]
            topo = _calibrated(configured, cal)
            seen = _on_live_links(topo, run.get("live_links"))
            closed, tl, _ = predict(plan, seen, job)
            meas = float(run["measured_step_s"])
            shares = _share_repricing(plan, seen, job, cal, run, int(d.get("host_cores", 0)))
            rows.append({
                "id": f"{path.stem}/{run['policy']}" + (f"#{run['round']}" if "round" in run else ""),
                "kind": "testbed", "source": str(path.relative_to(ROOT)),
                "table": f"runs[{run['policy']}] {run['schedule']} m={run['micro_batches']}",
                "group": path.stem, "plan": f"{' → '.join(plan.chain)} {run['schedule']} m={run['micro_batches']}",
                "gpus": plan.gpus, "cpus_per_gpu": d.get("cpus_per_gpu"), "recalibrated": "calibration" in run,
                "measured_s": meas, "predicted_s": tl,
                "predicted_closed_s": closed, "ratio": tl / meas, "ratio_closed": closed / meas,
                "abs_err": abs(tl - meas) / meas,
                "measured_per_gpu_tput": 1.0 / (meas * plan.gpus), "predicted_per_gpu_tput": 1.0 / (tl * plan.gpus),
                **{f"ratio_{k}": v / meas for k, v in shares.items()},
            })
    return rows


def _calibrated(topo: Topology, cal: dict[str, dict[str, Any]]) -> Topology:
    """``topo``'s clusters with the calibrated figures an agent reported (``cal[cluster]``)."""
    return Topology(clusters=tuple(
        Cluster(name=c.name, gpu=c.gpu, nodes=c.nodes, gpus_per_node=c.gpus_per_node,
                tflops=cal[c.name]["tflops"], mfu=cal[c.name]["mfu"],
                layer_overhead_ms=cal[c.name]["layer_overhead_ms"],
                optimizer_ms_per_layer=cal[c.name]["optimizer_ms_per_layer"])
        for c in topo.clusters), links=topo.links)


def _on_live_links(topo: Topology, live: list[dict[str, Any]] | None) -> Topology:
    """``topo`` with the links between the plan's neighbouring stages as the agents measured them when the
    plan was made (the run's ``live_links``: each pair's widest-path figures, about 4 % below the configured
    bandwidth and 1 ms above its latency), so the record is priced on what its planner saw. Only those pairs
    remain linked (the plans price no other pair). Runs without them, or with a pair not yet measured, keep
    the configured links."""
    if not live or any(x.get("gbps") is None or x.get("ms") is None for x in live):
        return topo
    pairs = {tuple(sorted((x["src"], x["dst"]))): x for x in live}
    return Topology(clusters=topo.clusters, links=tuple(
        Link(a=x["src"], b=x["dst"], bandwidth_gbps=float(x["gbps"]), latency_ms=float(x["ms"]))
        for x in pairs.values()))


def _share_repricing(plan: Plan, topo: Topology, job: JobSpec, cal: dict[str, dict[str, float]],
                     run: dict[str, Any], cores: int) -> dict[str, float]:
    """A diagnosis, not a prediction: the run's timeline step with each cluster's calibration re-scaled from
    the core share its agent calibrated at (``share``, four agents side by side) to another share, as the
    agent scales its per-core figures to its own (``agent/profiler.py``): ``at_job_share``, the share the
    stage's ranks measured (CPU ÷ wall time of forward + backward); ``at_cores_per_rank``,
    ``min(1, host cores / the plan's ranks)``. Only for runs whose file stores the shares (empty otherwise)."""
    if not all("share" in cal.get(c, {}) for c in plan.chain) or not run.get("phases"):
        return {}
    phases = run["phases"]
    measured = {}
    for i, st in enumerate(plan.stages):
        ph = phases.get(str(i))
        if not ph or ph["forward_s"] + ph["backward_s"] <= 0:
            return {}
        measured[st.cluster] = (ph["forward_cpu_s"] + ph["backward_cpu_s"]) / (ph["forward_s"] + ph["backward_s"])
    out = {"at_job_share": measured}
    if cores > 0:
        out["at_cores_per_rank"] = {c: min(1.0, cores / plan.gpus) for c in plan.chain}

    def at(target: dict[str, float]) -> float:
        clusters = []
        for c in topo.clusters:
            if c.name not in target:
                clusters.append(c)
                continue
            k, to = cal[c.name], target[c.name]
            f = k["share"] / to  # wall time per unit of work scales with 1 / share
            clusters.append(replace(c, tflops=c.tflops / f if c.tflops else c.tflops,
                                    layer_overhead_ms=(c.layer_overhead_ms or 0.0) * f,
                                    optimizer_ms_per_layer=(c.optimizer_ms_per_layer or 0.0) * f))
        return predict(plan, Topology(clusters=tuple(clusters), links=topo.links), job)[1]

    return {k: at(v) for k, v in out.items()}


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0
        i = j + 1
    return r


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN for fewer than two distinct values."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return sxy / (sx * sy) if sx > 0 and sy > 0 else math.nan


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("gpu", "testbed"):
        sel = [r for r in rows if r["kind"] == kind]
        if sel:
            errs = [r["abs_err"] for r in sel]
            worst = max(sel, key=lambda r: r["abs_err"])
            out[kind] = {"n": len(sel), "median_abs_err": statistics.median(errs), "worst_abs_err": worst["abs_err"],
                         "worst_id": worst["id"], "median_ratio": statistics.median(r["ratio"] for r in sel),
                         "median_abs_err_closed": statistics.median(abs(r["ratio_closed"] - 1) for r in sel)}
    # Testbed records by their ranks: the emulated clusters share this host's cores (the agents calibrate
    # side by side at start), so how many ranks a plan runs decides how far its compute is from calibration.
    by_ranks: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] == "testbed":
            by_ranks.setdefault(int(r["gpus"]), []).append(r)
    out["testbed_by_ranks"] = {
        str(k): {"n": len(v), "median_ratio": statistics.median(r["ratio"] for r in v),
                 "min_ratio": min(r["ratio"] for r in v), "max_ratio": max(r["ratio"] for r in v),
                 "median_abs_err": statistics.median(r["abs_err"] for r in v)}
        for k, v in sorted(by_ranks.items())
    }
    # Testbed records by how the clusters got their CPU: sharing the host's cores, or each its own quota
    # (``--cpus-per-gpu``: the agents calibrate at the share the job's workers get).
    by_cpu: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["kind"] == "testbed":
            by_cpu.setdefault("shared" if r.get("cpus_per_gpu") is None
                              else "quota, recalibrated" if r.get("recalibrated") else "quota", []).append(r)
    out["testbed_by_cpu"] = {
        k: {"n": len(v), "median_ratio": statistics.median(r["ratio"] for r in v),
            "min_ratio": min(r["ratio"] for r in v), "max_ratio": max(r["ratio"] for r in v),
            "median_abs_err": statistics.median(r["abs_err"] for r in v),
            "worst_abs_err": max(r["abs_err"] for r in v),
            "within_10": sum(r["abs_err"] <= 0.10 for r in v)}
        for k, v in sorted(by_cpu.items())
    }
    for key in ("ratio_at_job_share", "ratio_at_cores_per_rank"):
        rs = [r for r in rows if key in r]
        if rs:
            errs = [abs(r[key] - 1.0) for r in rs]
            out[key.removeprefix("ratio_")] = {
                "n": len(rs), "median_ratio": statistics.median(r[key] for r in rs),
                "median_abs_err": statistics.median(errs), "within_10": sum(e <= 0.10 for e in errs),
                "as_predicted_median_abs_err": statistics.median(r["abs_err"] for r in rs)}
    mem = [r for r in rows if "mem_err" in r]
    if mem:
        out["memory"] = {"n": len(mem), "median_abs_err": statistics.median(abs(r["mem_err"]) for r in mem),
                         "worst_under": min(r["mem_err"] for r in mem)}
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in rows:
        if r.get("group"):  # records of one plan (several policies or rounds ran it) count once, averaged
            groups.setdefault(r["group"], {}).setdefault(r.get("plan") or r["id"], []).append(r)
    out["rank"] = {}
    for g, plans in sorted(groups.items()):
        if len(plans) < 2:
            continue
        mean = [(statistics.fmean(r["measured_per_gpu_tput"] for r in rs),
                 statistics.fmean(r["predicted_per_gpu_tput"] for r in rs)) for rs in plans.values()]
        out["rank"][g] = {"n": len(plans), "records": sum(len(rs) for rs in plans.values()),
                          "spearman": spearman([m for m, _ in mean], [p for _, p in mean])}
    return out


MFU_GRID = tuple(round(0.25 + 0.005 * i, 3) for i in range(111))  # 0.25 … 0.80
"""H100 utilisations the leave-one-source-out fit tries."""


def leave_one_source_out(*, options: bool = True) -> list[dict[str, Any]]:
    """The only constant a default-fitted GPU rate has, the GPU type's ``mfu``, fitted on one source's records
    (the grid value with the least median |error|) and scored on the other source's: how well a fitted
    default carries from one framework's measurements to another's."""
    per_mfu = {x: gpu_rows(mfu=x, options=options) for x in MFU_GRID}
    out = []
    for fit_on in ("torchtitan", "megatron"):
        def med(rows: list[dict[str, Any]], kind: str) -> float:
            return float(statistics.median(r["abs_err"] for r in rows if r["source_kind"] == kind))

        best = min(MFU_GRID, key=lambda x: (med(per_mfu[x], fit_on), x))
        other = "megatron" if fit_on == "torchtitan" else "torchtitan"
        rows = per_mfu[best]
        out.append({"fit_on": fit_on, "mfu": best, "fit_median_abs_err": med(rows, fit_on),
                    "held_out": other, "held_out_median_abs_err": med(rows, other),
                    "all_median_abs_err": statistics.median(r["abs_err"] for r in rows)})
    return out


def markdown(rows: list[dict[str, Any]], summ: dict[str, Any], title: str) -> str:
    lines = [f"### {title}", "", "| record | GPUs | measured s | predicted s (timeline) | ratio | closed-form ratio "
             "| memory GiB meas / pred |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mem = (f"{r['measured_mem_gib']:.1f} / {r['predicted_mem_gib']:.1f}" if "mem_err" in r else "")
        lines.append(f"| {r['id']} | {r['gpus']} | {r['measured_s']:.4g} | {r['predicted_s']:.4g} | "
                     f"{r['ratio']:.3f} | {r['ratio_closed']:.3f} | {mem} |")
    lines.append("")
    for kind in ("gpu", "testbed"):
        if kind in summ:
            s = summ[kind]
            lines.append(f"- {kind}: n={s['n']}, median |error| {s['median_abs_err']:.1%}, worst "
                         f"{s['worst_abs_err']:.1%} ({s['worst_id']}), median ratio {s['median_ratio']:.3f}; closed "
                         f"form median |error| {s['median_abs_err_closed']:.1%}")
    for k, s in summ.get("testbed_by_ranks", {}).items():
        lines.append(f"- testbed plans on {k} ranks: n={s['n']}, ratio (predicted / measured) median "
                     f"{s['median_ratio']:.3f}, range {s['min_ratio']:.3f}–{s['max_ratio']:.3f}, median |error| "
                     f"{s['median_abs_err']:.1%}")
    for k, s in summ.get("testbed_by_cpu", {}).items():
        how = {"quota": "each cluster its own CPU quota (--cpus-per-gpu), calibrated at start",
               "quota, recalibrated": "each cluster its own CPU quota, calibrated again just before each job "
                                      "(--recalibrate)"}.get(k, "the clusters sharing the host's cores")
        lines.append(f"- testbed runs with {how}: n={s['n']}, {s['within_10']} within ±10 %, median |error| "
                     f"{s['median_abs_err']:.1%}, worst {s['worst_abs_err']:.1%}, ratio (predicted / measured) "
                     f"median {s['median_ratio']:.3f}, range {s['min_ratio']:.3f}–{s['max_ratio']:.3f}")
    for key, what in (("at_job_share", "the share their ranks measured"),
                      ("at_cores_per_rank", "min(1, host cores / ranks)")):
        if key in summ:
            s = summ[key]
            lines.append(f"- testbed runs re-priced at {what} (a diagnosis; runs that store the calibration's "
                         f"share): n={s['n']}, median ratio {s['median_ratio']:.3f}, median |error| "
                         f"{s['median_abs_err']:.1%} ({s['within_10']} within ±10 %; as predicted "
                         f"{s['as_predicted_median_abs_err']:.1%})")
    if "memory" in summ:
        s = summ["memory"]
        lines.append(f"- memory: n={s['n']}, median |error| {s['median_abs_err']:.1%}, worst signed "
                     f"{s['worst_under']:+.1%}")
    for g, s in summ["rank"].items():
        recs = f", {s['records']} records" if s.get("records", s["n"]) != s["n"] else ""
        lines.append(f"- rank correlation {g} (n={s['n']} distinct plans{recs}): {s['spearman']:+.2f}")
    terms = [r for r in rows if "terms" in r]
    if terms:
        lines += ["", "Shares of the predicted (timeline) step and the utilisation the measurement implies:", "",
                  "| record | ratio | compute | TP all-reduce | bubble | DP sync | implied MFU |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in terms:
            t = r["terms"]
            lines.append(f"| {r['id']} | {r['ratio']:.3f} | {t['compute']:.0%} | {t['tp_comm']:.0%} "
                         f"| {t['bubble']:.0%} | {t['dp_sync']:.0%} | {t['implied_mfu']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the records and summary as JSON")
    ap.add_argument("--md", type=Path, help="write the table as Markdown")
    ap.add_argument("--profile", type=Path, help="price the GPU records with this profile (docs/profiles.md)")
    ap.add_argument("--mfu", type=float, help="price the GPU records with this mfu instead of the catalog default "
                    "(what-if; the fitted default is the catalog's)")
    ap.add_argument("--no-testbed", action="store_true", help="GPU records only")
    ap.add_argument("--no-framework-options", action="store_true", help="price the GPU records without the "
                    "framework options their sources state (overlap, selective recomputation): the model before")
    ap.add_argument("--loso", action="store_true", help="also fit the H100 mfu on each source and score it on the "
                    "other (leave one source out)")
    args = ap.parse_args(argv)
    profile = None
    if args.profile is not None:
        from spiderflow.profile import load_profile

        profile = load_profile(args.profile)
    options = not args.no_framework_options
    rows = gpu_rows(profile, args.mfu, options=options) + ([] if args.no_testbed else testbed_rows())
    summ = summary(rows)
    title = "Fidelity" + (f" with profile {args.profile}" if args.profile else " (defaults, no profile)")
    if not options:
        title += ", framework options off"
    md = markdown(rows, summ, title)
    if args.loso:
        loso = leave_one_source_out(options=options)
        summ["leave_one_source_out"] = loso
        md += "\nLeave one source out (H100 `mfu` fitted on one source, scored on the other):\n\n"
        md += "| fitted on | mfu | median abs error there | held out | median abs error there | all records |\n"
        md += "|---|---:|---:|---|---:|---:|\n"
        for f in loso:
            md += (f"| {f['fit_on']} | {f['mfu']:.3f} | {f['fit_median_abs_err']:.1%} | {f['held_out']} | "
                   f"{f['held_out_median_abs_err']:.1%} | {f['all_median_abs_err']:.1%} |\n")
    print(md)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "summary": summ}, indent=1) + "\n")
    if args.md:
        args.md.write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
