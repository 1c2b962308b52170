"""Device check of the executor and the cost model on one GPU: ``python bench/gpu_check.py --out DIR``.

Sized for one H100/H200 in about 6 minutes (``--budget-s`` stops starting new training runs past it); ``--cpu``
runs the same code on CPU with a tiny model (the smoke test of this script). Like the executor's workers, the
check runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the variable is set
(:data:`spiderflow.exec.worker.CUDA_ALLOC_CONF`). Every part is independent: a part
that fails prints its error and the next one runs. ``DIR/gpu_check.json`` is rewritten after every part, so
whatever finished survives a timeout; ``bench/gpu_fidelity.py`` prices its runs afterwards.

Parts (``--parts``, comma-separated; default ``env,profile,agent,runs``, the others on request):

``env``
    torch, CUDA and the device as torch sees it.
``profile``
    What ``spiderflow profile`` measures on this node (``docs/profiles.md``): the matmul rate and the executor's
    transformer blocks of the runs' models at their micro-batch sizes, in bf16 and in tf32, their embedding
    and head with its loss at the same sizes, the optimizer step per block, over the embedding and over the
    head, the input pipeline per sample and the memory no tensor accounts for → ``DIR/profile-bf16.json``,
    ``DIR/profile-tf32.json``.
``agent``
    What an agent on this node reports (:func:`agent.profiler.profile_devices`): the calibrated rate,
    ``mfu``, per-layer overhead and optimizer step of the device.
``runs``
    Training runs of the executor itself (one worker process, one stage holding the whole model, synthetic
    tokens): GPT-3 1.3B at global batch 16 × 2048 tokens under several plans of one job (micro-batch counts
    2–16, recomputation, tf32) and GPT-3 2.7B, then, if the time budget allows, GPT-3 1.3B in one
    micro-batch of 16. Per run: every step's wall time, the executor's phase split and the peak memory
    (allocated, reserved, device).
``trace``
    One run of the executor (GPT-3 1.3B, micro-batches of 8 sequences) in this process under
    ``torch.profiler``: where one step's GPU time goes, by kernel → ``DIR/trace.txt``.
``pipeline``
    bf16 training of a small GPT over 2 pipeline stages (two worker processes sharing the device, gloo
    between them, GPU tensors staged through pinned memory) against an fp32 reference of the same steps;
    the run checkpoints with torch.distributed.checkpoint.
``resume``
    That checkpoint resumed on CPU in fp32 for one step: the loss against the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from spiderflow.core.catalog import ModelSpec, model_preset  # noqa: E402
from spiderflow.core.domain import Plan, Precision, Schedule, Stage  # noqa: E402
from spiderflow.exec.data import SyntheticTokens, micro_batch  # noqa: E402
from spiderflow.exec.spec import Rendezvous, TrainSpec  # noqa: E402
from spiderflow.exec.worker import cuda_allocator_env, worker_argv, worker_document  # noqa: E402
from spiderflow.formats import plan_to_dict  # noqa: E402

PARTS = ("env", "profile", "agent", "runs", "trace", "pipeline", "resume")
DEFAULT_PARTS = ("env", "profile", "agent", "runs")
"""The parts run without ``--parts`` (about 6 minutes on one H200); trace, pipeline and resume on request."""


def reference(model: ModelSpec, seq: int, batch: int, m: int, steps: int, lr: float,
              device: torch.device) -> list[float]:
    """fp32 single-process training of the same steps (TF32 off): the losses the runs must reproduce."""
    from spiderflow.exec.model import build_full

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    net = build_full(model, 0, max_seq_len=seq).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    src = SyntheticTokens(vocab=model.vocab, seq_len=seq, seed=0)
    out = []
    for step in range(steps):
        total = 0.0
        for j in range(m):
            x, y = micro_batch(src, step=step, global_batch=batch, micro_batch_size=batch // m, index=j)
            loss = net(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))
            (loss / m).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total / m)
    return out


def launch(spec: TrainSpec, tmp: Path, env_extra: dict[str, str]) -> list[list[dict[str, Any]]]:
    """Run every rank of ``spec`` as a worker process on this node; their JSON events, rank by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdv = Rendezvous(host="127.0.0.1", port=port, world_size=spec.world_size, rank=0, timeout_s=300)
    path = tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(worker_document(spec, rdv)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", **env_extra)
    procs = [subprocess.Popen(worker_argv(str(path), r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(spec.world_size)]
    events = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} failed ({p.returncode}):\n{err[-3000:]}\n{out[-1000:]}")
        events.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return events


def done_event(events: list[list[dict[str, Any]]], *, with_losses: bool = False) -> dict[str, Any]:
    for evs in events:
        for e in evs:
            if e["event"] == "done" and (e["losses"] or not with_losses):
                return e
    raise RuntimeError("no rank reported its result")


class Report:
    """The JSON document of this check, rewritten after every part."""

    def __init__(self, out: Path) -> None:
        self.path = out / "gpu_check.json"
        self.doc: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parts": {}}

    def put(self, part: str, value: Any) -> None:
        self.doc["parts"][part] = value
        self.path.write_text(json.dumps(self.doc, indent=1) + "\n")


def part_env(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
                           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        out.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                   memory_gib=total / 2**30, free_gib=free / 2**30, cuda=torch.version.cuda,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))  # type: ignore[no-untyped-call]
        try:
            out["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            out["nvidia_smi"] = f"unavailable: {e}"
    print(f"[env] {out}", flush=True)
    return out


def part_profile(out: Path, gpu: bool) -> dict[str, Any]:
    """The profile ``spiderflow profile`` writes (its function, :func:`agent.profiler.build_profile`, called in
    this process: the device image need not hold the CLI's other dependencies), once per precision."""
    from agent.profiler import build_profile
    from spiderflow.profile import parse_profile

    if gpu:
        small, big = model_preset("gpt3-1.3b"), model_preset("gpt3-2.7b")
        jobs = [("bf16", [small, big], [1, 2, 4, 8, 16]), ("tf32", [small], [1, 2, 4, 8])]
        seqs = [2048]
    else:
        jobs = [("fp32", [ModelSpec(name="check-tiny", layers=4, hidden=64, heads=4, vocab=256)], [1, 2])]
        seqs = [32]
    docs: dict[str, Any] = {}
    for precision, models, mbs in jobs:
        t0 = time.perf_counter()
        doc = build_profile(blocks=[(m.hidden, m.heads) for m in models], micro_batches=mbs, seq_lens=seqs,
                            precision=precision, seconds=0.5, outer=[(m.hidden, m.vocab) for m in models])
        parse_profile(doc)  # what is written reads back
        (out / f"profile-{precision}.json").write_text(json.dumps(doc, indent=1) + "\n")
        docs[precision] = doc
        gpus: dict[str, Any] = doc["gpus"]  # type: ignore[assignment]
        entry = next(iter(gpus.values()))
        print(f"[profile] {precision}: {time.perf_counter() - t0:.1f} s; matmul {entry.get('matmul_tflops')} TFLOPS; "
              f"optimizer {entry.get('optimizer_ms_per_layer')} ms/block; "
              f"memory overhead {entry.get('memory_overhead_gib')} GiB", flush=True)
        for blk in entry.get("blocks", []):
            print(f"    block h={blk['hidden']} a={blk['heads']} b={blk['micro_batch']} s={blk['seq_len']}: "
                  f"fwd {blk['forward_ms']:.2f} ms bwd {blk['backward_ms']:.2f} ms", flush=True)
        for key in ("embedding", "head"):
            for o in entry.get(key, []):
                print(f"    {key} h={o['hidden']} V={o['vocab']} b={o['micro_batch']} s={o['seq_len']}: "
                      f"fwd {o['forward_ms']:.2f} ms bwd {o['backward_ms']:.2f} ms; optimizer "
                      f"{o['optimizer_ms']:.2f} ms", flush=True)
        for d in entry.get("data", []):
            print(f"    data s={d['seq_len']}: {d['ms_per_sample']:.2f} ms per sample", flush=True)
    if gpu:
        torch.cuda.empty_cache()  # the runs' workers measure the device's memory: hold none of it here
    return docs


def run_configs(gpu: bool) -> list[dict[str, Any]]:
    """The training runs: name, model, precision, micro-batch count, recomputation, steps."""
    if not gpu:
        tiny = ModelSpec(name="check-tiny", layers=4, hidden=64, heads=4, vocab=256)
        return [{"name": f"tiny-m{m}", "model": tiny, "precision": Precision.FP32, "m": m, "recompute": False,
                 "global_batch": 8, "seq_len": 32, "steps": 4} for m in (2, 4)]
    small, big = model_preset("gpt3-1.3b"), model_preset("gpt3-2.7b")
    out: list[dict[str, Any]] = []
    for m in (16, 8, 4, 2):
        out.append({"name": f"gpt3-1.3b-bf16-m{m}", "model": small, "precision": Precision.BF16, "m": m,
                    "recompute": False})
    out.append({"name": "gpt3-1.3b-bf16-m4-recompute", "model": small, "precision": Precision.BF16, "m": 4,
                "recompute": True})
    out.append({"name": "gpt3-1.3b-tf32-m4", "model": small, "precision": Precision.TF32, "m": 4, "recompute": False})
    out.append({"name": "gpt3-2.7b-bf16-m4", "model": big, "precision": Precision.BF16, "m": 4, "recompute": False})
    out.append({"name": "gpt3-1.3b-bf16-m1", "model": small, "precision": Precision.BF16, "m": 1, "recompute": False})
    for c in out:
        c.update(global_batch=16, seq_len=2048, steps=6)
    return out


def part_runs(tmp: Path, gpu: bool, env_extra: dict[str, str], deadline: float,
              save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for c in run_configs(gpu):
        if time.monotonic() > deadline:
            results.append({"name": c["name"], "skipped": "time budget spent"})
            print(f"[runs] {c['name']}: skipped (time budget spent)", flush=True)
            continue
        model: ModelSpec = c["model"]
        plan = Plan(stages=(Stage(cluster="gpu", first_layer=0, last_layer=model.layers - 1,
                                  recompute=c["recompute"]),),
                    micro_batches=c["m"], schedule=Schedule.ONE_F_ONE_B)
        spec = TrainSpec(job_id=c["name"], model=model, plan=plan, seq_len=c["seq_len"],
                         global_batch=c["global_batch"], steps=c["steps"], precision=c["precision"])
        rec: dict[str, Any] = {"name": c["name"], "model": model.name, "precision": c["precision"].value,
                               "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                               "global_batch": c["global_batch"], "seq_len": c["seq_len"],
                               "micro_batch": c["global_batch"] // c["m"], "plan": plan_to_dict(plan)}
        t0 = time.perf_counter()
        try:
            done = done_event(launch(spec, tmp, env_extra), with_losses=True)
        except Exception as e:  # the next run still runs
            rec["error"] = f"{type(e).__name__}: {e}"
            print(f"[runs] {c['name']}: FAILED {rec['error'][:3000]}", flush=True)
        else:
            times = done["step_times_s"]
            steady = sorted(times[2:] or times[1:] or times)
            rec.update(wall_s=time.perf_counter() - t0, step_times_s=times,
                       step_time_s=steady[len(steady) // 2], losses=done["losses"], phases=done["phases"],
                       memory=done.get("memory"))
            mem = rec["memory"] or {}
            print(f"[runs] {c['name']}: step {rec['step_time_s']:.4f} s (median of steps 3-{len(times)}; all "
                  f"{', '.join(f'{t:.3f}' for t in times)}); peak allocated "
                  f"{mem.get('peak_allocated_gib', float('nan')):.2f} GiB, reserved "
                  f"{mem.get('peak_reserved_gib', float('nan')):.2f} GiB, device "
                  f"{mem.get('device_used_gib', float('nan')):.2f} GiB; loss {done['losses'][-1]:.4f}; "
                  f"{rec['wall_s']:.1f} s wall", flush=True)
        results.append(rec)
        save(results)
    return results


def part_agent() -> dict[str, Any]:
    from dataclasses import asdict

    from agent.profiler import profile_devices

    prof = asdict(profile_devices())
    print(f"[agent] {prof}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return prof


def part_trace(out: Path, gpu: bool) -> dict[str, Any]:
    """One step of the executor under torch.profiler, in this process (one rank)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from spiderflow.exec.runtime import run

    if gpu:
        model, m, batch, seq, steps = model_preset("gpt3-1.3b"), 2, 16, 2048, 5
    else:
        model, m, batch, seq, steps = ModelSpec(name="check-tiny", layers=4, hidden=64, heads=4, vocab=256), 2, 8, 32, 5
    plan = Plan(stages=(Stage(cluster="gpu", first_layer=0, last_layer=model.layers - 1),), micro_batches=m)
    spec = TrainSpec(job_id="trace", model=model, plan=plan, seq_len=seq, global_batch=batch, steps=steps,
                     precision=Precision.BF16 if gpu else Precision.FP32)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
    with profile(activities=activities, schedule=schedule(wait=2, warmup=1, active=1)) as prof:
        result = run(spec, Rendezvous(host="127.0.0.1", port=port, world_size=1, rank=0, timeout_s=120),
                     on_step=lambda _r: prof.step())
    sort = "self_device_time_total" if gpu else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
    except (AttributeError, KeyError, RuntimeError):
        table = prof.key_averages().table(sort_by="self_cuda_time_total" if gpu else sort, row_limit=40)
    (out / "trace.txt").write_text(table)
    print("[trace] step 4 of gpt3-1.3b, b=8 × m=2:\n" + "\n".join(table.splitlines()[:28]), flush=True)
    return {"step_times_s": list(result.step_times_s), "table": "trace.txt"}


def part_pipeline(tmp: Path, gpu: bool, device: torch.device, env_extra: dict[str, str]) -> dict[str, Any]:
    if gpu:
        model = ModelSpec(name="check-small", layers=4, hidden=1024, heads=16, vocab=32000)
        seq, batch, m, steps = 512, 8, 4, 8
    else:
        model = ModelSpec(name="check-tiny", layers=4, hidden=64, heads=4, vocab=256)
        seq, batch, m, steps = 32, 8, 4, 4
    lr = 1e-3
    ref = reference(model, seq, batch, m, steps + 1, lr, device)  # one more step: the CPU resume trains it
    stages = (Stage(cluster="a", first_layer=0, last_layer=model.layers // 2 - 1),
              Stage(cluster="b", first_layer=model.layers // 2, last_layer=model.layers - 1))
    plan = Plan(stages=stages, micro_batches=m, schedule=Schedule.ONE_F_ONE_B)
    spec = TrainSpec(job_id="check", model=model, plan=plan, seq_len=seq, global_batch=batch, steps=steps,
                     lr=lr, precision=Precision.BF16, checkpoint_dir=str(tmp / "ck"), checkpoint_every=steps // 2)
    t0 = time.perf_counter()
    got = done_event(launch(spec, tmp, env_extra), with_losses=True)["losses"]
    worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref[:steps], strict=True))
    print(f"[pipeline] bf16 2-stage loss (last step) {got[-1]:.4f} vs fp32 reference {ref[steps - 1]:.4f}; worst "
          f"relative gap over {steps} steps {worst:.2%} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return {"model": model.name, "steps": steps, "losses": got, "reference": ref, "worst_relative_gap": worst,
            "checkpoint_dir": str(tmp / "ck"), "_model": model, "_shape": (seq, batch, m, lr)}


def part_resume(tmp: Path, pipe: dict[str, Any]) -> dict[str, Any]:
    model: ModelSpec = pipe["_model"]
    seq, batch, m, lr = pipe["_shape"]
    steps = pipe["steps"]
    plan = Plan(stages=(Stage(cluster="c", first_layer=0, last_layer=model.layers - 1),), micro_batches=m)
    spec = TrainSpec(job_id="check", model=model, plan=plan, seq_len=seq, global_batch=batch, steps=steps + 1,
                     lr=lr, precision=Precision.FP32, checkpoint_dir=pipe["checkpoint_dir"], resume=True,
                     threads=min(8, os.cpu_count() or 1))
    got = done_event(launch(spec, tmp, {"CUDA_VISIBLE_DEVICES": ""}), with_losses=True)["losses"]
    k = steps + 1 - len(got)
    ref = pipe["reference"][k]
    print(f"[resume] checkpoint of step {k} resumed on CPU fp32: loss {got[0]:.4f} vs reference {ref:.4f} "
          f"(relative gap {abs(got[0] - ref) / abs(ref):.2%})", flush=True)
    return {"from_step": k, "loss": got[0], "reference": ref}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="smoke mode: tiny models on CPU")
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json and the profiles")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="start no training run after this many seconds (default 330: the last, 16 × 1, is skipped "
                    "unless the others ran fast; 400 runs it, about 45 s more on an H200)")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"gpu_check: --parts: unknown {', '.join(unknown)} (known: {', '.join(PARTS)})", file=sys.stderr)
        return 2
    start = time.monotonic()
    cuda_allocator_env(os.environ)  # before the first CUDA allocation; the workers inherit it
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    env_extra = {} if gpu else {"CUDA_VISIBLE_DEVICES": ""}
    failed = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = args.out or tmp
        out.mkdir(parents=True, exist_ok=True)
        report = Report(out)
        pipe: dict[str, Any] | None = None
        for part in PARTS:
            if part not in parts:
                continue
            t0 = time.perf_counter()
            try:
                if part == "env":
                    report.put("env", part_env(device))
                elif part == "profile":
                    report.put("profile", part_profile(out, gpu))
                elif part == "agent":
                    report.put("agent", part_agent())
                elif part == "trace":
                    report.put("trace", part_trace(out, gpu))
                elif part == "runs":
                    report.put("runs", part_runs(tmp, gpu, env_extra, start + args.budget_s,
                                                 lambda rs: report.put("runs", rs)))
                elif part == "pipeline":
                    pipe = part_pipeline(tmp, gpu, device, env_extra)
                    report.put("pipeline", {k: v for k, v in pipe.items() if not k.startswith("_")})
                elif part == "resume":
                    if pipe is None:
                        raise RuntimeError("needs the pipeline part's checkpoint")
                    report.put("resume", part_resume(tmp, pipe))
            except Exception as e:
                failed.append(part)
                report.put(part, {"error": f"{type(e).__name__}: {e}"})
                print(f"[{part}] FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()
            print(f"[{part}] {time.perf_counter() - t0:.1f} s (total {time.monotonic() - start:.1f} s)", flush=True)
    print(f"done in {time.monotonic() - start:.1f} s; failed parts: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
