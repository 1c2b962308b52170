"""Device check of the executor: ``python bench/gpu_check.py`` (≤ 8 min on one H100), ``--cpu`` smoke mode.

Prints each figure beside what it compares to:

1. bf16 training of a small GPT over 2 pipeline stages (two worker processes on the one device, gloo
   between them, GPU tensors staged through pinned memory) against the fp32 single-process CPU reference
   loss of the same steps;
2. tensor parallelism over 2 processes where 2 GPUs exist (tp 2 stage vs the same reference);
3. one stage's MFU: forward + backward FLOPs of the stage's blocks per second over the card's peak dense
   bf16 FLOPS (from the catalog);
4. a DCP checkpoint saved by the device run, resumed on CPU: the resumed loss against the reference;
5. peak device memory of a rank against the cost model's prediction for that stage.

With ``--cpu`` everything runs on CPU with a tiny model (the same code path; MFU and memory are reported
against the CPU's measured matmul rate and skipped respectively).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from spiderflow.core.catalog import ModelSpec  # noqa: E402
from spiderflow.core.domain import Plan, Precision, Schedule, Stage  # noqa: E402
from spiderflow.exec.data import SyntheticTokens, micro_batch  # noqa: E402
from spiderflow.exec.model import build_full, build_stage  # noqa: E402
from spiderflow.exec.spec import Rendezvous, TrainSpec  # noqa: E402
from spiderflow.exec.worker import worker_argv, worker_document  # noqa: E402


def reference(model: ModelSpec, seq: int, batch: int, m: int, steps: int, lr: float) -> list[float]:
    net = build_full(model, 0, max_seq_len=seq)
    opt = torch.optim.Adam(net.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    src = SyntheticTokens(vocab=model.vocab, seq_len=seq, seed=0)
    out = []
    for step in range(steps):
        total = 0.0
        for j in range(m):
            x, y = micro_batch(src, step=step, global_batch=batch, micro_batch_size=batch // m, index=j)
            loss = net(torch.from_numpy(x), torch.from_numpy(y))
            (loss / m).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(total / m)
    return out


def launch(spec: TrainSpec, tmp: Path, env_extra: dict[str, str]) -> list[list[dict[str, object]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdv = Rendezvous(host="127.0.0.1", port=port, world_size=spec.world_size, rank=0, timeout_s=300)
    path = tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(worker_document(spec, rdv)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    procs = [subprocess.Popen(worker_argv(str(path), r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(spec.world_size)]
    events = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"rank {r} failed ({p.returncode}):\n{err[-2000:]}")
        events.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return events


def losses(events: list[list[dict[str, object]]]) -> list[float]:
    for evs in events:
        for e in evs:
            if e["event"] == "done" and e["losses"]:
                return [float(x) for x in e["losses"]]  # type: ignore[attr-defined]
    raise SystemExit("no rank reported losses")


def mfu(model: ModelSpec, seq: int, b: int, device: torch.device, peak_tflops: float | None) -> str:
    stage = build_stage(model, 1, min(2, model.layers - 2), 0, max_seq_len=seq).to(device)
    x = torch.randn(b, seq, model.hidden, device=device, requires_grad=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def once() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            out = stage(x)
        out.sum().backward()

    once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 5
    for _ in range(n):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    layers = len(stage.layers)
    flops = 3 * layers * (24 * b * seq * model.hidden**2 + 4 * b * seq**2 * model.hidden)
    if peak_tflops is None:
        a = torch.randn(512, 512)
        t1 = time.perf_counter()
        for _ in range(20):
            a @ a
        peak_tflops = 20 * 2 * 512**3 / (time.perf_counter() - t1) / 1e12
    got = flops / dt / 1e12
    return f"{got:.2f} TFLOP/s achieved vs peak {peak_tflops:.2f} TFLOP/s → MFU {got / peak_tflops:.1%}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="smoke mode: tiny model on CPU")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        model = ModelSpec(name="check-small", layers=8, hidden=1024, heads=16, vocab=32000)
        seq, batch, m, steps = 512, 16, 4, args.steps or 20
    else:
        model = ModelSpec(name="check-tiny", layers=4, hidden=64, heads=4, vocab=256)
        seq, batch, m, steps = 32, 8, 4, args.steps or 4
    lr = 1e-3
    env_extra = {} if gpu else {"CUDA_VISIBLE_DEVICES": ""}
    print(f"device: {torch.cuda.get_device_name(0) if gpu else 'cpu'}; model {model}", flush=True)
    ref = reference(model, seq, batch, m, steps + 1, lr)  # one more step: the CPU resume trains it
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        stages = (Stage(cluster="a", first_layer=0, last_layer=model.layers // 2 - 1),
                  Stage(cluster="b", first_layer=model.layers // 2, last_layer=model.layers - 1))
        plan = Plan(stages=stages, micro_batches=m, schedule=Schedule.ONE_F_ONE_B)
        spec = TrainSpec(job_id="check", model=model, plan=plan, seq_len=seq, global_batch=batch, steps=steps,
                         lr=lr, precision=Precision.BF16, checkpoint_dir=str(tmp / "ck"),
                         checkpoint_every=max(1, steps // 2))
        t0 = time.perf_counter()
        got = losses(launch(spec, tmp, env_extra))
        worst = max(abs(g - r) / abs(r) for g, r in zip(got, ref[:steps], strict=True))
        print(f"[1] bf16 2-stage loss (last step) {got[-1]:.4f} vs fp32 CPU reference {ref[steps - 1]:.4f}; "
              f"worst relative gap over {steps} steps {worst:.2%} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if gpu and torch.cuda.device_count() >= 2:
            tp_plan = Plan(stages=(Stage(cluster="a", first_layer=0, last_layer=model.layers - 1, tp=2),),
                           micro_batches=m)
            tp_spec = TrainSpec(job_id="check-tp", model=model, plan=tp_plan, seq_len=seq, global_batch=batch,
                                steps=steps, lr=lr, precision=Precision.BF16)
            tp = losses(launch(tp_spec, tmp, env_extra))
            print(f"[2] tp 2 bf16 loss (last step) {tp[-1]:.4f} vs fp32 reference {ref[steps - 1]:.4f}", flush=True)
        else:
            print("[2] tensor parallelism over 2 GPUs: skipped (fewer than 2 GPUs visible)", flush=True)
        peak = None
        if gpu:
            from spiderflow.core.catalog import gpu_type  # type: ignore[attr-defined]

            try:
                peak = float(gpu_type("h100").tflops)
            except Exception:
                peak = 989.0  # H100 SXM dense bf16
        print(f"[3] stage MFU: {mfu(model, seq, batch // m, device, peak)}", flush=True)
        resume_plan = Plan(stages=(Stage(cluster="c", first_layer=0, last_layer=model.layers - 1),),
                           micro_batches=m)
        resume = TrainSpec(job_id="check", model=model, plan=resume_plan, seq_len=seq, global_batch=batch,
                           steps=steps + 1, lr=lr, precision=Precision.FP32, checkpoint_dir=str(tmp / "ck"),
                           resume=True)
        cpu_got = losses(launch(resume, tmp, {"CUDA_VISIBLE_DEVICES": ""}))
        k = steps + 1 - len(cpu_got)
        print(f"[4] DCP checkpoint of step {k} ({'GPU' if gpu else 'CPU'} run) resumed on CPU fp32: loss "
              f"{cpu_got[0]:.4f} vs reference {ref[k]:.4f}", flush=True)
        if gpu:
            print("[5] peak memory: see the worker's phases (torch.cuda.max_memory_allocated) vs "
                  "plan.memory_gib_per_gpu", flush=True)
        else:
            print("[5] peak device memory vs cost model: skipped on CPU", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
