"""1F1B vs the latency-aware schedule at equal memory, executed for real on the emulated testbed.

::

    sudo .venv/bin/python bench/schedule_exec.py                      # defaults below (m=3 of 4, K=3)
    sudo .venv/bin/python bench/schedule_exec.py --micro-batches 12 --micro-batch 1   # m=12 of 1, K=3
    sudo .venv/bin/python bench/schedule_exec.py --latency-ms 60 --mbit 400 --micro-batches 3 --micro-batch 4 \\
        --steps 8 --repeats 3 --out bench/results/schedule_exec.json
    sudo .venv/bin/python bench/schedule_exec.py --max-in-flight -1  # no cap: the deeper warm-up gets more memory

Equal memory, precisely: both schedules run under the same in-flight cap ``K`` on every stage — no stage
holds activations of more than ``K`` micro-batches (of the same size, so the same peak activation bytes
per GPU) — with ``K`` = 1F1B's own peak ``min(m, S)`` by default (``--max-in-flight 0``). 1F1B is then
unchanged; the latency-aware warm-ups become ``min(2(S − i) − 1, K − 1)`` (:mod:`spiderflow.core.schedules`), so
its first stage holds exactly what 1F1B's does and no later stage more. (The later stages do hold more
than under 1F1B — up to ``K`` — which is the peak per GPU both schedules need anyway.)

A testbed (:class:`spiderflow.testbed.Testbed`) of three one-"GPU" CPU clusters ``east → mid → west`` in a
chain, both links ``--mbit`` Mbit/s with ``--latency-ms`` one-way latency (kernel htb + the delay relay).
The same three-stage pipeline (one layer block per cluster, one worker process per cluster namespace,
``python -m spiderflow.exec.worker``; rank 0 hosts the rendezvous TCPStore on its namespace address) trains
the same inline model, batch and micro-batch count with schedule ``1f1b`` and with ``latency-aware``; the
only difference between the runs is the per-stage operation order (:func:`spiderflow.core.schedules.replica_ops`).
Runs alternate (``1f1b, latency-aware, latency-aware, 1f1b, …``) over ``--repeats`` rounds, so drift in
the machine's load hits both schedules alike.

Printed per schedule: the peak in-flight micro-batches per stage (``stage_warmup + 1``: what each stage
holds in activations, under the cap) and the per-GPU memory under the cap
(:func:`spiderflow.core.costmodel.evaluate`, which honours the plan's cap); the
predicted step time of the cost model's closed form (:func:`spiderflow.core.costmodel.evaluate`, blind to the
in-flight window), of the window-aware closed form (:func:`spiderflow.core.tpa.timeline.window_estimate`) and
of the exact timeline (:func:`spiderflow.core.tpa.simulate_plan`); the measured mean step time of every run
(rank 0's step times, the first step skipped: it includes gloo's lazy connection set-up) and their mean;
and the measured ratio ``1F1B / latency-aware``. Predictions use the clusters calibrated the way agents do
it (:func:`agent.profiler.profile_cpu`: matmul TFLOPS × the mfu of a timed block, the fixed time per layer
and micro-batch, the optimizer step per layer). The workers get no explicit warm-ups: they cap their orders
from the plan's ``extras["max_in_flight"]`` (:func:`spiderflow.exec.spec.rank_ops`).

Needs root (network namespaces, tc, iptables). Everything started is stopped and the testbed removed on
exit (also on Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow.core.catalog import ModelSpec  # noqa: E402
from spiderflow.core.costmodel import evaluate  # noqa: E402
from spiderflow.core.domain import Cluster, GpuRange, JobSpec, Link, Plan, Schedule, Stage, Topology  # noqa: E402
from spiderflow.core.schedules import MAX_IN_FLIGHT_KEY, peak_in_flight, stage_warmup  # noqa: E402
from spiderflow.core.tpa import simulate_plan  # noqa: E402
from spiderflow.core.tpa.timeline import window_estimate  # noqa: E402
from spiderflow.exec.spec import Rendezvous, TrainSpec, rank_layout  # noqa: E402
from spiderflow.exec.worker import worker_argv, worker_document  # noqa: E402
from spiderflow.testbed import Testbed, cleanup  # noqa: E402

CLUSTERS = ("east", "mid", "west")
SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.LATENCY_AWARE)
STORE_PORT = 29600


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """One experiment: the chain's links and the job both schedules run."""

    latency_ms: float = 60.0
    mbit: float = 400.0
    layers: int = 3
    hidden: int = 128
    heads: int = 4
    vocab: int = 512
    seq_len: int = 64
    micro_batches: int = 3
    micro_batch: int = 4
    steps: int = 8
    max_in_flight: int = 0  # the cap K on every stage: 0 = 1F1B's peak min(m, S) (equal memory), -1 = none

    @property
    def model(self) -> ModelSpec:
        return ModelSpec(name="inline", layers=self.layers, hidden=self.hidden, heads=self.heads, vocab=self.vocab)

    @property
    def global_batch(self) -> int:
        return self.micro_batches * self.micro_batch

    @property
    def cap(self) -> int | None:
        """The in-flight cap ``K`` both schedules run under (``None``: uncapped)."""
        if self.max_in_flight < 0:
            return None
        return self.max_in_flight or min(self.micro_batches, len(CLUSTERS))


def topology(setup: Setup, *, tflops: float | None = None, mfu: float | None = None, layer_overhead_ms: float = 0.0,
             optimizer_ms_per_layer: float = 0.0) -> Topology:
    """Three one-worker CPU clusters in a chain ``east – mid – west`` (no direct ``east – west`` link), with
    the calibration figures an agent reports (:func:`calibration`)."""
    clusters = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1, tflops=tflops, mfu=mfu,
                             layer_overhead_ms=layer_overhead_ms, optimizer_ms_per_layer=optimizer_ms_per_layer)
                     for n in CLUSTERS)
    links = tuple(Link(a=a, b=b, bandwidth_gbps=setup.mbit / 1000.0, latency_ms=setup.latency_ms)
                  for a, b in itertools.pairwise(CLUSTERS))
    return Topology(clusters=clusters, links=links)


def plan(setup: Setup, schedule: Schedule) -> Plan:
    """Layers split as evenly as possible over the chain (earlier stages take the remainder), dp = tp = 1."""
    base, extra = divmod(setup.layers, len(CLUSTERS))
    stages, first = [], 0
    for i, c in enumerate(CLUSTERS):
        n = base + (1 if i < extra else 0)
        stages.append(Stage(cluster=c, first_layer=first, last_layer=first + n - 1))
        first += n
    extras = {} if setup.cap is None else {MAX_IN_FLIGHT_KEY: float(setup.cap)}
    return Plan(stages=tuple(stages), micro_batches=setup.micro_batches, schedule=schedule, extras=extras)


def job(setup: Setup) -> JobSpec:
    return JobSpec(id="schedule-exec", model=setup.model, global_batch=setup.global_batch,
                   micro_batch=setup.micro_batch, seq_len=setup.seq_len, steps=setup.steps,
                   gpus=GpuRange(min=len(CLUSTERS), max=len(CLUSTERS)))


def in_flight(setup: Setup, schedule: Schedule) -> list[int]:
    """Peak in-flight micro-batches per stage (warm-up forwards + the one that starts the 1F1B phase)."""
    n = len(CLUSTERS)
    return [peak_in_flight(schedule, n, setup.micro_batches, i, max_in_flight=setup.cap) for i in range(n)]


def warmups(setup: Setup, schedule: Schedule) -> tuple[int, ...]:
    """Per-stage warm-ups the workers run under the cap (reported; the workers derive them from the plan)."""
    n = len(CLUSTERS)
    return tuple(stage_warmup(schedule, n, setup.micro_batches, i, max_in_flight=setup.cap) for i in range(n))


def predict(setup: Setup, schedule: Schedule, topo: Topology) -> dict[str, Any]:
    p = evaluate(plan(setup, schedule), topo, job(setup))
    return {
        "closed_form_s": p.step_time_s,
        "window_closed_form_s": window_estimate(p, topo, job(setup)),
        "timeline_s": simulate_plan(p, topo, job(setup)).step_s,
        "memory_gib_per_gpu": list(p.memory_gib_per_gpu),
    }


def run_once(tb: Testbed, setup: Setup, schedule: Schedule, *, port: int, workdir: Path, python: str,
             timeout: float) -> dict[str, Any]:
    """One training run of ``setup`` under ``schedule``: one worker per cluster namespace; returns every
    rank's ``done`` event (step times, losses)."""
    pl = plan(setup, schedule)
    # No explicit warm-ups: the workers cap them from the plan's extras["max_in_flight"] (rank_ops), the
    # same orders the timeline simulates.
    spec = TrainSpec(job_id=f"sched-{schedule.value}", model=setup.model, plan=pl, seq_len=setup.seq_len,
                     global_batch=setup.global_batch, steps=setup.steps, seed=0, threads=1)
    layout = rank_layout(pl)
    rdv = Rendezvous(host=tb.address(layout[0].cluster), port=port, world_size=len(layout), rank=0,
                     timeout_s=min(timeout, 120.0))
    path = workdir / f"spec-{port}.json"
    path.write_text(json.dumps(worker_document(spec, rdv, namespace=f"run-{port}")))
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs: list[tuple[int, subprocess.Popen[bytes], Path, Path]] = []
    try:
        for info in layout:
            out, err = workdir / f"run-{port}-rank-{info.rank}.out", workdir / f"run-{port}-rank-{info.rank}.err"
            with open(out, "wb") as fo, open(err, "wb") as fe:
                p = tb.exec(info.cluster, worker_argv(str(path), info.rank, python=python), env=env,
                            stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, cwd=str(ROOT))
            procs.append((info.rank, p, out, err))
        deadline = time.monotonic() + timeout
        for rank, p, _, err in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{schedule.value}: rank {rank} did not finish within {timeout:.0f} s") from None
            if p.returncode != 0:
                raise RuntimeError(f"{schedule.value}: rank {rank} exited {p.returncode}:\n"
                                   f"{err.read_text()[-2000:]}")
    finally:
        for _, p, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    done: dict[int, dict[str, Any]] = {}
    for rank, _, out, _ in procs:
        for line in out.read_text().splitlines():
            if line.startswith("{"):
                ev = json.loads(line)
                if ev.get("event") == "done":
                    done[rank] = ev
    if len(done) != len(procs):
        missing = sorted(set(range(len(procs))) - set(done))
        raise RuntimeError(f"{schedule.value}: missing done events from ranks {missing}")
    rank0 = [float(t) for t in done[0]["step_times_s"]][1:]
    last = max(done)
    return {
        "schedule": schedule.value,
        "measured_step_s": statistics.mean(rank0),
        "rank0_step_times_s": rank0,
        "last_stage_mean_step_s": statistics.mean(float(t) for t in done[last]["step_times_s"][1:]),
        "losses": done[last]["losses"],
    }


def calibration() -> dict[str, float]:
    """One CPU worker's calibration, measured as agents do (:func:`agent.profiler.profile_cpu`): ``tflops``,
    ``mfu``, ``layer_overhead_ms`` and ``optimizer_ms_per_layer`` (the :class:`Cluster` fields an agent
    fills in)."""
    from agent.profiler import profile_cpu

    prof = profile_cpu(seconds=0.5)
    assert prof.tflops is not None and prof.mfu is not None
    return {"tflops": prof.tflops, "mfu": prof.mfu, "layer_overhead_ms": prof.layer_overhead_ms,
            "optimizer_ms_per_layer": prof.optimizer_ms_per_layer}


def experiment(setup: Setup, *, repeats: int, prefix: str, timeout: float = 300.0,
               python: str = sys.executable, calibrate: bool = True,
               log: Any = print) -> dict[str, Any]:
    """Bring up the testbed, run both schedules ``repeats`` times each (alternating), take it down;
    returns predictions, per-run measurements and the measured ratio ``1F1B / latency-aware``."""
    calib: dict[str, Any] = {"tflops": None, "mfu": None}
    if calibrate:
        calib = dict(calibration())
    topo = topology(setup, **calib)
    predicted = {s.value: predict(setup, s, topo) for s in SCHEDULES}
    peaks = {s.value: in_flight(setup, s) for s in SCHEDULES}
    runs: list[dict[str, Any]] = []
    cleanup(prefix)
    tb = Testbed(topology(setup), prefix=prefix)
    t0 = time.monotonic()
    try:
        tb.up()
        with tempfile.TemporaryDirectory(prefix="schedule-exec-") as tmp:
            port = STORE_PORT
            for r in range(repeats):
                order = SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]
                for s in order:
                    port += 1
                    res = run_once(tb, setup, s, port=port, workdir=Path(tmp), python=python, timeout=timeout)
                    res["round"] = r
                    runs.append(res)
                    log(f"round {r} {s.value:<13} measured {res['measured_step_s']:.3f} s/step "
                        f"(last stage {res['last_stage_mean_step_s']:.3f}), final loss {res['losses'][-1]:.3f}")
    finally:
        tb.down()
    measured = {s.value: statistics.mean(r["measured_step_s"] for r in runs if r["schedule"] == s.value)
                for s in SCHEDULES}
    f1, la = Schedule.ONE_F_ONE_B.value, Schedule.LATENCY_AWARE.value
    per_round = [
        next(x["measured_step_s"] for x in runs if x["round"] == r and x["schedule"] == f1)
        / next(x["measured_step_s"] for x in runs if x["round"] == r and x["schedule"] == la)
        for r in range(repeats)
    ]
    return {
        "setup": asdict(setup),
        "max_in_flight": setup.cap,
        "warmups": {s.value: list(warmups(setup, s)) for s in SCHEDULES},
        "calibration": calib,
        "peak_in_flight": peaks,
        "predicted": predicted,
        "runs": runs,
        "measured_mean_step_s": measured,
        "ratio_1f1b_over_latency_aware": measured[f1] / measured[la],
        "ratio_per_round": per_round,
        "predicted_timeline_ratio": predicted[f1]["timeline_s"] / predicted[la]["timeline_s"],
        "wall_s": time.monotonic() - t0,
    }


def report(res: dict[str, Any]) -> str:
    s = res["setup"]
    lines = [
        f"chain {' → '.join(CLUSTERS)}: {s['mbit']:.0f} Mbit/s, {s['latency_ms']:.0f} ms one-way per link; "
        f"model L={s['layers']} h={s['hidden']} V={s['vocab']}, seq {s['seq_len']}, m={s['micro_batches']} "
        f"micro-batches of {s['micro_batch']}, {s['steps']} steps/run (first skipped); in-flight cap K = "
        f"{res['max_in_flight']} on every stage for both schedules",
        f"calibrated cpu worker: {res['calibration']['tflops']} TFLOPS × mfu {res['calibration']['mfu']}, "
        f"{res['calibration'].get('layer_overhead_ms', 0.0)} ms per layer and micro-batch, optimizer "
        f"{res['calibration'].get('optimizer_ms_per_layer', 0.0)} ms per layer",
        "",
        f"{'schedule':<14} {'in-flight/stage':>15} {'mem GiB max':>11} {'closed':>7} {'window':>7} {'timeline':>8} "
        f"{'measured':>8}  runs",
    ]
    for sched, pred in res["predicted"].items():
        runs = [r["measured_step_s"] for r in res["runs"] if r["schedule"] == sched]
        lines.append(
            f"{sched:<14} {res['peak_in_flight'][sched]!s:>15} {max(pred['memory_gib_per_gpu']):>11.4f} "
            f"{pred['closed_form_s']:>7.3f} {pred['window_closed_form_s']:>7.3f} {pred['timeline_s']:>8.3f} "
            f"{res['measured_mean_step_s'][sched]:>8.3f}  " + " ".join(f"{x:.3f}" for x in runs)
        )
    lines.append("")
    lines.append(f"1F1B / latency-aware: predicted (timeline) {res['predicted_timeline_ratio']:.2f}×, measured "
                 f"{res['ratio_1f1b_over_latency_aware']:.2f}× (per round: "
                 + ", ".join(f"{x:.2f}" for x in res["ratio_per_round"]) + ")")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Setup()
    p.add_argument("--latency-ms", type=float, default=d.latency_ms)
    p.add_argument("--mbit", type=float, default=d.mbit)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--micro-batches", type=int, default=d.micro_batches)
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--max-in-flight", type=int, default=d.max_in_flight,
                   help="cap K on every stage for both schedules; 0: 1F1B's peak min(m, S) (equal memory); -1: none")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each runs both schedules (order alternates)")
    p.add_argument("--prefix", default="", help="testbed prefix (default: a fresh 'sx…')")
    p.add_argument("--timeout", type=float, default=300.0, help="per run")
    p.add_argument("--out", default="", help="write the JSON summary here")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc, iptables)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    setup = Setup(latency_ms=args.latency_ms, mbit=args.mbit, layers=args.layers, hidden=args.hidden,
                  heads=args.heads, vocab=args.vocab, seq_len=args.seq_len, micro_batches=args.micro_batches,
                  micro_batch=args.micro_batch, steps=args.steps, max_in_flight=args.max_in_flight)
    prefix = args.prefix or "sx" + uuid.uuid4().hex[:5]
    res = experiment(setup, repeats=args.repeats, prefix=prefix, timeout=args.timeout,
                     log=lambda msg: print(msg, flush=True))
    res["command"] = "sudo .venv/bin/python bench/schedule_exec.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print()
    print(report(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
