"""SpiderFlow's plan vs ``firstfit``'s plan, run for real on the emulated testbed.

::

    sudo .venv/bin/python bench/testbed_exec.py                       # defaults below
    sudo .venv/bin/python bench/testbed_exec.py --steps 12 --seq-len 256 --global-batch 16 --micro-batch 4 \\
        --slow-mbit 20 --slow-ms 60 --fast-mbit 400 --fast-ms 5 --out bench/results/testbed_exec.json

A whole mesh (:class:`spiderflow.mesh.LocalMesh` with ``testbed=True``: embedded etcd, the three services,
one agent per cluster in its own network namespace, links shaped by the kernel and delayed by the relay)
on four one-"GPU" CPU clusters ``alpha, bravo, charlie, delta``: ``alpha, bravo, delta`` fully linked by
fast links (``--fast-mbit``/``--fast-ms``), ``charlie`` attached only by the slow link ``bravo–charlie``
(``--slow-mbit``/``--slow-ms``). Traffic follows the widest path (cost model and testbed alike), so a slow
link in a complete graph would just be bypassed through a third cluster: here every path to ``charlie``
crosses it.

The job needs a pipeline across three clusters (``gpus`` min = max = 3) of an inline model whose
activations are large (``--seq-len``, ``--micro-batch``), so crossing the slow link costs more than a
stage's compute. It is submitted twice through the real scheduler, one run after the other: with policy
``spinsearch`` and with policy ``firstfit``. ``firstfit`` is topology-oblivious: clusters by free GPUs,
name order on ties, i.e. ``alpha → bravo → charlie``, which crosses the slow link by construction;
SpinSearch sees the measured links and can avoid it (``alpha, bravo, delta`` in some order).

For each run: the chain, the plan's predicted step time (the cost model on the live, agent-measured
topology: calibrated TFLOPS × mfu, per-layer overhead and optimizer time, probed links) and the measured
mean step time from the job's progress events (steps after the first; progress is coalesced by the agent,
so these are the reported steps), plus, as a cross-check, the mean of every step of the last-stage worker
(its ``done`` event in its stdout file, kept in its agent's work dir) and every rank's step breakdown
(:data:`spiderflow.exec.runtime.PHASES`, wall and CPU time), and the exact timeline of the plan re-run on
the compute its ranks measured (:func:`timeline_on_measured_compute`). Prints a table and the ratio
``firstfit / spinsearch`` of measured mean step times (the target: ≥ 1.3), the spread between runs of one
plan, whichever policies chose it (:func:`plan_spread`: differences between policies within it are not
theirs), and writes a JSON summary (``--out``) with the agents' calibration figures.

Every cluster gets its own CPU (``--cpus-per-gpu auto``: a cgroup quota of ``0.8 × cores ÷ workers`` per
worker, and idle vCPUs poll before halting: :mod:`spiderflow.testbed.cpu`), so each agent calibrates at the
share its cluster's workers get later, whatever the other clusters do. With ``--cpus-per-gpu none`` the
clusters share the host's cores, as every run before the quota did: the agents then calibrate side by side
at start (four calibrations on the cores at once), while a three-stage job's workers compete less (three
workers, and less still when they wait on a slow link), so the calibrated rate is the host's under a load
the job does not recreate. The timeline on measured compute shows what the links and schedule alone predict.

With ``--recalibrate`` every agent measures its CPU again just before each job (``SIGHUP``: the same
calibration as at start, :meth:`agent.agent.Agent.recalibrate`), the job is planned on those figures, and
each run stores them (``runs[].calibration``). This machine's speed drifts between runs by more than the
model's error (the same plan measured up to 1.33× apart), so a calibration minutes old prices a run on
another machine than the one it ran on. The price: each policy then plans on its own draw of the
calibration (a sample, like any measurement), so near-tied plans are told apart by noise; without it every
policy plans on the same figures, which is the fairer setting for comparing policies. Off by default.

Needs root (network namespaces, tc, iptables). Everything the run starts is stopped on exit (also on
Ctrl-C / SIGTERM); a crashed run's testbed is removed with ``spiderflow testbed down --prefix P``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow import joblogs  # noqa: E402
from spiderflow.core.domain import Cluster, JobSpec, Link, Plan, Topology  # noqa: E402
from spiderflow.core.errors import UnavailableError  # noqa: E402
from spiderflow.core.placement import get_policy, load_builtin_policies  # noqa: E402
from spiderflow.core.placement.base import Budget  # noqa: E402
from spiderflow.core.tpa.timeline import StageTiming, plan_stage_timing, simulate_plan  # noqa: E402
from spiderflow.exec.spec import rank_layout  # noqa: E402
from spiderflow.formats import job_from_dict  # noqa: E402
from spiderflow.jobs import JobState  # noqa: E402
from spiderflow.mesh import LocalMesh  # noqa: E402
from spiderflow.sdk import Client, JobEvent  # noqa: E402

CLUSTERS = ("alpha", "bravo", "charlie", "delta")
SLOW = ("bravo", "charlie")  # firstfit's chain alpha → bravo → charlie crosses it


def topology(*, slow_mbit: float, slow_ms: float, fast_mbit: float, fast_ms: float, gpus: int = 1) -> Topology:
    """Four CPU clusters of ``gpus`` workers each: ``alpha, bravo, delta`` fully linked by fast links and
    ``charlie`` reachable only over the slow ``bravo–charlie`` link.

    Traffic between clusters follows the widest path (the cost model's and the testbed's rule), so in a
    complete graph one slow link would simply be bypassed through a third cluster; here every path to
    ``charlie`` crosses it, and a chain that includes ``charlie`` pays for it."""
    clusters = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=gpus) for n in CLUSTERS)
    fast = [("alpha", "bravo"), ("alpha", "delta"), ("bravo", "delta")]
    links = [Link(a=a, b=b, bandwidth_gbps=fast_mbit / 1000.0, latency_ms=fast_ms) for a, b in fast]
    links.append(Link(a=SLOW[0], b=SLOW[1], bandwidth_gbps=slow_mbit / 1000.0, latency_ms=slow_ms))
    return Topology(clusters=clusters, links=tuple(links))


def ring_topology(*, slow_mbit: float, slow_ms: float, fast_mbit: float, fast_ms: float, gpus: int = 1) -> Topology:
    """Four CPU clusters on a ring of geo-like links: ``alpha–bravo`` and ``charlie–delta`` fast
    (``--fast-*``), ``bravo–charlie`` a quarter of the fast bandwidth at 4× its latency, ``delta–alpha``
    an eighth at 8×, and the two diagonals slow (``--slow-*``). Every pair is linked, so the widest path
    may detour through a third cluster; which clusters, how many (the job takes 2 or 3) and in which order
    are the policies' to choose."""
    clusters = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=gpus) for n in CLUSTERS)
    spec = [("alpha", "bravo", fast_mbit, fast_ms), ("charlie", "delta", fast_mbit, fast_ms),
            ("bravo", "charlie", fast_mbit / 4, fast_ms * 4), ("alpha", "delta", fast_mbit / 8, fast_ms * 8),
            ("alpha", "charlie", slow_mbit, slow_ms), ("bravo", "delta", slow_mbit, slow_ms)]
    links = tuple(Link(a=a, b=b, bandwidth_gbps=mbit / 1000.0, latency_ms=ms) for a, b, mbit, ms in spec)
    return Topology(clusters=clusters, links=links)


#: ``--topology`` choices: the builder and the job's GPU range (min, max) on it.
TOPOLOGIES = {"slow-link": (topology, (3, 3)), "ring": (ring_topology, (2, 3))}


def job(args: argparse.Namespace, policy: str, gpus: tuple[int, int] = (3, 3)) -> dict[str, Any]:
    return {
        "id": f"tb-{policy}-{uuid.uuid4().hex[:6]}",
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab},
        "global_batch": args.global_batch, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "steps": args.steps, "gpus": {"min": gpus[0], "max": gpus[1]}, "tenant": "bench",
    }


def wait_for_links(sf: Client, n_clusters: int, timeout: float) -> Topology:
    """The live topology once every cluster pair has a measured link in both directions (each direction is
    its source agent's probe; a cluster whose own probes have not landed yet is unreachable from)."""
    deadline = time.monotonic() + timeout
    want = n_clusters * (n_clusters - 1)
    topo = sf.topology()
    while time.monotonic() < deadline:
        topo = sf.topology()
        pairs = {pair for link in topo.links if link.bandwidth_gbps > 0 for pair in link.directions}
        if len(topo.clusters) >= n_clusters and len(pairs) >= want:
            return topo
        time.sleep(1.0)
    raise UnavailableError(f"links not all measured within {timeout:.0f} s: {len(topo.links)} of {want}")


def worker_done_events(agents_dir: Path, job_id: str, attempt: int = 1) -> dict[int, dict[str, Any]]:
    """Every rank's ``done`` event (step times, per-phase breakdown) of ``attempt`` of ``job_id``, read from
    the workers' stdout files in every agent's work dir under ``agents_dir`` (``<agents_dir>/<cluster>``,
    :attr:`spiderflow.mesh.LocalMesh.agents_dir`), where the executor keeps them
    (:func:`spiderflow.joblogs.find_logs`: ``<work_dir>/logs/<job>/attempt-<n>/<cluster>/rank-<r>.out``)."""
    out: dict[int, dict[str, Any]] = {}
    if not agents_dir.is_dir():
        return out
    for work_dir in sorted(p for p in agents_dir.iterdir() if p.is_dir()):
        for log in joblogs.find_logs(work_dir, job=job_id, attempt=attempt,
                                     streams=frozenset({joblogs.LogStream.STDOUT})):
            for line in log.path.read_text().splitlines():
                if line.startswith("{"):
                    ev = json.loads(line)
                    if ev.get("event") == "done":
                        out[int(ev["rank"])] = ev
    return out


CALIBRATION_KEYS = ("share", "cpu_training_tflops", "cpu_layer_overhead_ms", "cpu_matmul_tflops")


def _log_events(agent_log: Path, event: str) -> list[dict[str, Any]]:
    """Every ``event`` record of an agent's JSON log, in order (none when the file is missing)."""
    out: list[dict[str, Any]] = []
    with contextlib.suppress(OSError):
        for line in agent_log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict) and ev.get("event") == event:
                    out.append(ev)
    return out


def calibration_events(agent_log: Path) -> list[dict[str, float]]:
    """What each of the agent's CPU calibrations saw (its ``agent.calibrated`` events, in order): ``share``,
    the core share its thread got (CPU ÷ wall time), and the per-core figures the wall-clock ones were scaled
    from."""
    return [{k: float(ev[k]) for k in CALIBRATION_KEYS if isinstance(ev.get(k), int | float)}
            for ev in _log_events(agent_log, "agent.calibrated")]


def calibration_share(agent_log: Path) -> dict[str, float]:
    """The agent's first calibration (:func:`calibration_events`; the one at start). Empty when the log holds
    none."""
    events = calibration_events(agent_log)
    return events[0] if events else {}


def calibration_figures(c: Cluster) -> dict[str, Any]:
    """A live cluster's calibrated figures, as the planner prices them."""
    return {"tflops": c.tflops, "mfu": c.mfu, "effective_tflops": c.effective_tflops,
            "layer_overhead_ms": c.layer_overhead_ms, "optimizer_ms_per_layer": c.optimizer_ms_per_layer}


def recalibrate(mesh: LocalMesh, timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    """Every agent measures its CPU again (``SIGHUP``: :meth:`agent.agent.Agent.recalibrate`, the same
    calibration as at start); returns each cluster's figures once the topology service carries them (plus
    what the calibration saw, :func:`calibration_events`)."""
    logs = {name: mesh.workdir / "logs" / f"agent-{name}.log" for name in mesh.agents}
    before = {name: _last_event(path, "agent.recalibrated") for name, path in logs.items()}
    for proc in mesh.agents.values():
        if proc.pid is not None:
            os.kill(proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while True:
        done = {name: _last_event(path, "agent.recalibrated") for name, path in logs.items()}
        if all(ev is not None and ev != before[name] for name, ev in done.items()):
            with Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
                seen = {c.name: c for c in sf.topology().clusters}
            if all(name in seen and ev is not None
                   and math.isclose(seen[name].tflops or 0.0, float(ev["tflops"]), rel_tol=1e-9)
                   for name, ev in done.items()):
                return {name: calibration_figures(seen[name]) | calibration_events(logs[name])[-1] for name in logs}
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agents' new calibrations did not reach the topology service within "
                               f"{timeout:.0f} s")
        time.sleep(0.25)


def _last_event(log_path: Path, event: str) -> dict[str, Any] | None:
    events = _log_events(log_path, event)
    return events[-1] if events else None


def worker_step_times(agents_dir: Path, job_id: str, attempt: int = 1) -> dict[int, list[float]]:
    """Every rank's step times (its ``done`` event) from the agents' work dirs."""
    done = worker_done_events(agents_dir, job_id, attempt)
    return {r: [float(t) for t in ev["step_times_s"]] for r, ev in done.items()}


def timeline_on_measured_compute(plan: Plan, topo: Topology, spec: JobSpec,
                                  phases: dict[str, dict[str, float]]) -> float | None:
    """The exact timeline's step (:func:`spiderflow.core.tpa.simulate_plan`) of ``plan`` with every stage's
    compute and post-drain work replaced by what its ranks measured (mean over the stage's ranks of
    ``(forward + backward) / m`` per micro-batch and ``grad_sync + optimizer`` per step), the links and the
    schedule as the cost model prices them. It separates the model of links and schedules from the compute
    calibration, whose core share a shared host's other processes decide (module docstring). ``None``
    when a rank's phases are missing."""
    per_stage: dict[int, list[dict[str, float]]] = {}
    for info in rank_layout(plan):
        ph = phases.get(str(info.rank))
        if not ph:
            return None
        per_stage.setdefault(info.stage, []).append(ph)
    stages, ser, lat, chunks = plan_stage_timing(plan, topo, spec)
    m = plan.micro_batches
    measured = [
        StageTiming(compute_s=statistics.mean((p["forward_s"] + p["backward_s"]) / m for p in per_stage[i]),
                    replicas=st.replicas,
                    allreduce_s=statistics.mean(p["grad_sync_s"] + p["optimizer_s"] for p in per_stage[i]))
        for i, st in enumerate(stages)
    ]
    return simulate_plan(plan, topo, spec, record=False, timing=(measured, ser, lat, chunks)).step_s


def cpu_quota(option: str, host_cores: int, workers: int) -> float | None:
    """``--cpus-per-gpu``: ``None`` for ``none``; ``auto`` gives every worker an equal part of four fifths of the
    host's cores, at most one core; else the number given (cores, > 0)."""
    if option == "none":
        return None
    if option == "auto":
        return min(1.0, 0.8 * host_cores / max(workers, 1))
    try:
        value = float(option)
    except ValueError:
        raise ValueError(f"a number of cores, 'auto' or 'none' (got {option!r})") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"must be a positive number of cores (got {option!r})")
    return value


def run_one(mesh: LocalMesh, args: argparse.Namespace, policy: str, gpus: tuple[int, int] = (3, 3)) -> dict[str, Any]:
    spec = job(args, policy, gpus)
    calibration = recalibrate(mesh) if args.recalibrate else None
    with Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
        live = sf.topology()
    # The same decision the scheduler is about to take, on the same live topology: a job the policy cannot
    # place would sit pending until --timeout, so it is reported instead of submitted.
    load_builtin_policies()
    offline = get_policy(policy).place(live, job_from_dict(spec), Budget(seed=0))
    if not offline.ok:
        print(f"[{policy}] cannot place the job: {offline.reason}", flush=True)
        return {"policy": policy, "placed": False, "reason": offline.reason, "predicted_step_s": None,
                "measured_step_s": None, "stages": None, "chain": []}
    with Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
        submitted = sf.submit(spec, request_id=spec["id"], policy=policy)
        print(f"[{policy}] submitted {submitted.id}", flush=True)
        progress: dict[int, float] = {}
        ev: JobEvent
        for ev in sf.follow(submitted.id, deadline=time.monotonic() + args.timeout):
            if ev.transition is not None:
                print(f"[{policy}]   {ev.transition.from_state} → {ev.transition.to_state}: {ev.transition.reason}",
                      flush=True)
            if ev.progress and int(ev.progress.get("attempt", 1)) <= 1:
                progress[int(ev.progress["step"])] = float(ev.progress["step_time_s"])
        final = sf.get(submitted.id)
    if final.state != JobState.SUCCEEDED or final.plan is None:
        raise RuntimeError(f"{policy}: job ended {final.state}: {final.reason}")
    plan = final.plan
    reported = [t for step, t in sorted(progress.items()) if step > 1]
    # a rank's last output lines may reach its log file just after the job is reported done
    deadline = time.monotonic() + 10.0
    while len(done := worker_done_events(mesh.agents_dir, final.id)) < plan.gpus and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = {r: [float(t) for t in ev["step_times_s"]] for r, ev in done.items()}
    last_rank = max(ranks) if ranks else None
    worker = ranks[last_rank][1:] if last_rank is not None else []
    phases: dict[str, dict[str, float]] = {str(r): {k: round(v, 6) for k, v in (ev.get("phases") or {}).items()}
                                           for r, ev in sorted(done.items())}
    result = {
        **({"calibration": calibration} if calibration is not None else {}),
        "policy": policy, "placed": True, "job": final.id, "chain": list(plan.chain), "schedule": str(plan.schedule),
        "micro_batches": plan.micro_batches,
        "stages": [{"cluster": s.cluster, "layers": [s.first_layer, s.last_layer], "gpus": s.gpus}
                   for s in plan.stages],
        "predicted_step_s": plan.step_time_s,
        "measured_step_s": statistics.mean(reported) if reported else None,
        "measured_steps_reported": len(reported),
        "worker_mean_step_s": statistics.mean(worker) if worker else None,
        "worker_median_step_s": statistics.median(worker) if worker else None,
        "last_loss": final.progress.get("loss"),
        # where each rank's steps went (mean seconds per step after the first; wall and CPU time)
        "phases": phases,
        # the links between the plan's neighbouring stages as the agents measured them when it was planned
        # (null where the snapshot had no link yet)
        "live_links": [{"src": a, "dst": b, "gbps": live.bandwidth_gbps(a, b) or None,
                        "ms": live.latency_ms(a, b) if math.isfinite(live.latency_ms(a, b)) else None}
                       for a, b in zip(plan.chain, plan.chain[1:], strict=False)],
    }
    try:
        result["timeline_on_measured_compute_s"] = timeline_on_measured_compute(
            plan, live, job_from_dict(spec), phases)
    except ValueError as e:  # a rank's phases the timeline cannot take (ValidationError names which)
        result["timeline_on_measured_compute_s"] = None
        result["timeline_on_measured_compute_error"] = str(e)
        print(f"[{policy}] no timeline on the measured compute: {e}", flush=True)
    measured = f"{result['measured_step_s']:.3f}" if reported else "-"
    print(f"[{policy}] chain {' → '.join(plan.chain)} ({plan.schedule}, m={plan.micro_batches}): predicted "
          f"{plan.step_time_s:.3f} s, measured {measured} s "
          f"(worker mean {result['worker_mean_step_s']})", flush=True)
    return result


def _per_policy(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy: its last run, with ``measured_step_s`` the median over its runs (``measured_runs`` each)
    and ``predicted_step_s`` the median of the predictions."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["policy"] for r in results):
        runs = [r for r in results if r["policy"] == name]
        measured = [r["measured_step_s"] for r in runs if r["measured_step_s"]]
        predicted = [r["predicted_step_s"] for r in runs if r["predicted_step_s"]]
        out[name] = runs[-1] | {
            "measured_runs": measured, "predicted_runs": predicted,
            "measured_step_s": statistics.median(measured) if measured else None,
            "predicted_step_s": statistics.median(predicted) if predicted else None,
            "plans": [r["stages"] for r in runs]}
    return out


def plan_spread(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every plan (chain, layers, GPUs, schedule and micro-batch count) that ran more than once, whichever
    policies chose it, with its measured step times and ``max ÷ min``: how far apart two runs of one plan
    are on this machine. Differences between policies within that are not the policies'."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("measured_step_s"):
            key = json.dumps([r["stages"], r["schedule"], r["micro_batches"]])
            by.setdefault(key, []).append(r)
    out = []
    for runs in by.values():
        if len(runs) > 1:
            steps = [float(r["measured_step_s"]) for r in runs]
            out.append({"chain": runs[0]["chain"], "schedule": runs[0]["schedule"],
                        "micro_batches": runs[0]["micro_batches"], "policies": [r["policy"] for r in runs],
                        "measured_s": steps, "max_over_min": max(steps) / min(steps)})
    return sorted(out, key=lambda x: -len(x["measured_s"]))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--slow-mbit", type=float, default=20.0)
    p.add_argument("--slow-ms", type=float, default=60.0)
    p.add_argument("--fast-mbit", type=float, default=400.0)
    p.add_argument("--fast-ms", type=float, default=5.0)
    p.add_argument("--gpus", type=int, default=1, help="worker 'GPUs' per cluster")
    p.add_argument("--order", default="spinsearch,firstfit", help="policies, run one after the other")
    p.add_argument("--prices", choices=("uniform", "regional"), default="uniform",
                   help="electricity: uniform 0.10 USD/kWh, or regional 0.05 + 0.03·i by cluster (LocalMesh's default)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of --order (per policy: the median of its runs)")
    p.add_argument("--topology", choices=sorted(TOPOLOGIES), default="slow-link",
                   help="slow-link: 3 clusters wanted, every path to charlie slow; ring: 2-4 clusters wanted")
    p.add_argument("--cpus-per-gpu", default="auto", metavar="CORES|auto|none",
                   help="each cluster's CPU quota per worker (spiderflow.testbed.cpu): a number of cores; 'auto' "
                        "(default) = 0.8 × the host's cores ÷ all clusters' workers (at most 1), leaving a fifth "
                        "for the control plane and the relay; 'none': the clusters share the host's cores")
    p.add_argument("--recalibrate", action="store_true",
                   help="before each job, every agent measures its CPU again (SIGHUP) and the job is planned on it")
    p.add_argument("--prefix", default="", help="testbed prefix (default: a fresh 'tbx…')")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default="", help="write the JSON summary here")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc, iptables)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    build, gpus = TOPOLOGIES[args.topology]
    topo = build(slow_mbit=args.slow_mbit, slow_ms=args.slow_ms, fast_mbit=args.fast_mbit, fast_ms=args.fast_ms,
                 gpus=args.gpus)
    if args.prices == "regional":  # as the bundled presets' regions: electricity differs, bace follows the cheapest
        topo = replace(topo, clusters=tuple(replace(c, electricity_usd_per_kwh=round(0.05 + 0.03 * i, 4))
                                            for i, c in enumerate(topo.clusters)))
    host_cores = len(os.sched_getaffinity(0))
    try:
        cpus_per_gpu = cpu_quota(args.cpus_per_gpu, host_cores, sum(c.total_gpus for c in topo.clusters))
    except ValueError as e:
        print(f"--cpus-per-gpu: {e}", file=sys.stderr)
        return 2
    prefix = args.prefix or "tbx" + uuid.uuid4().hex[:5]
    results: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with LocalMesh(topo, testbed=True, testbed_prefix=prefix, cpus_per_gpu=cpus_per_gpu) as mesh:
        with Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
            live = wait_for_links(sf, len(topo.clusters), timeout=120)
        shares = {c.name: calibration_share(mesh.workdir / "logs" / f"agent-{c.name}.log") for c in live.clusters}
        print("live topology (agent-measured):", flush=True)
        for c in live.clusters:
            print(f"  {c.name}: tflops {c.tflops}, mfu {c.mfu}, effective {c.effective_tflops:.4f}, "
                  f"layer overhead {c.layer_overhead_ms:.3f} ms, optimizer {c.optimizer_ms_per_layer:.3f} ms/layer",
                  flush=True)
        for link in sorted(live.links, key=lambda x: (x.a, x.b)):
            print(f"  {link.a}–{link.b}: {link.bandwidth_gbps * 1000:.1f} Mbit/s, {link.latency_ms:.1f} ms", flush=True)
        for rnd in range(args.repeats):  # interleaved, so that drifting machine load hits every policy alike
            for policy in args.order.split(","):
                results.append(run_one(mesh, args, policy.strip(), gpus) | {"round": rnd + 1})
    by = _per_policy(results)
    ratio = None
    if "spinsearch" in by and "firstfit" in by and by["spinsearch"]["measured_step_s"]:
        ratio = by["firstfit"]["measured_step_s"] / by["spinsearch"]["measured_step_s"]
    # every other policy ÷ SpinSearch, measured and predicted step time (> 1: SpinSearch faster)
    versus = {r["policy"]: {"measured": (r["measured_step_s"] / by["spinsearch"]["measured_step_s"]
                                         if r["measured_step_s"] and by["spinsearch"]["measured_step_s"] else None),
                            "predicted": (r["predicted_step_s"] / by["spinsearch"]["predicted_step_s"]
                                          if r["predicted_step_s"] else None),
                            "same_plan": r["stages"] == by["spinsearch"]["stages"]}
              for r in by.values() if r["policy"] != "spinsearch" and "spinsearch" in by}
    summary = {
        "command": "sudo .venv/bin/python bench/testbed_exec.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "topology": {"kind": args.topology, "prices": {c.name: c.electricity_usd_per_kwh for c in topo.clusters},
                     "links": [{"a": lk.a, "b": lk.b, "mbit": lk.bandwidth_gbps * 1000,
                                                        "ms": lk.latency_ms} for lk in topo.links],
                     "slow": list(SLOW), "slow_mbit": args.slow_mbit, "slow_ms": args.slow_ms,
                     "fast_mbit": args.fast_mbit, "fast_ms": args.fast_ms, "gpus_per_cluster": args.gpus},
        "job": {k: v for k, v in job(args, "x", gpus).items() if k not in ("id",)},
        # the precision the workers trained in (the agents pass the job's; bench/fidelity.py re-prices in it)
        "executed_precision": job_from_dict(job(args, "x", gpus)).precision.value,
        # at start; with --recalibrate each run also carries the calibration taken just before it
        "calibration": {c.name: calibration_figures(c) | shares.get(c.name, {}) for c in live.clusters},
        "recalibrate": args.recalibrate,
        "host_cores": host_cores,  # the cores every cluster's agent and workers share
        "cpus_per_gpu": cpus_per_gpu,  # each cluster's CPU quota per worker (None: the clusters share the cores)
        "load_average_before": list(load_before),
        "runs": results,
        "per_policy": {k: {"chain": v["chain"], "stages": v["stages"], "measured_step_s": v["measured_step_s"],
                           "predicted_step_s": v["predicted_step_s"], "measured_runs": v["measured_runs"],
                           "predicted_runs": v["predicted_runs"]} for k, v in by.items()},
        "ratio_firstfit_over_spinsearch": ratio,
        "policy_over_spinsearch": versus,
        "plan_spread": plan_spread(results),
        "load_average_after": list(os.getloadavg()),
        "wall_s": time.monotonic() - t0,
    }
    print()
    print(f"{'policy':<11} {'chain':<28} {'predicted s':>11} {'measured s':>10} {'meas/pred':>9} "
          f"{'on measured compute s':>21} {'meas/that':>9}")
    for r in results:
        if not r["placed"]:
            print(f"{r['policy']:<11} not placed: {r['reason']}")
            continue
        meas = r["measured_step_s"] or 0.0
        mc = r.get("timeline_on_measured_compute_s")
        print(f"{r['policy']:<11} {' → '.join(r['chain']):<28} {r['predicted_step_s']:>11.3f} {meas:>10.3f} "
              f"{meas / r['predicted_step_s']:>9.2f} " + (f"{mc:>21.3f} {meas / mc:>9.2f}" if mc else f"{'-':>21}"))
    if ratio is not None:
        print(f"firstfit / spinsearch measured step time: {ratio:.2f}× (target ≥ 1.3)")
    for name, v in versus.items():
        meas = f"{v['measured']:.2f}×" if v["measured"] else "-"
        pred = f"{v['predicted']:.2f}×" if v["predicted"] else "-"
        print(f"{name} / spinsearch step time: measured {meas}, predicted {pred}"
              + (" (same plan)" if v["same_plan"] else ""))
    for sp in summary["plan_spread"]:
        print(f"one plan, {len(sp['measured_s'])} runs ({', '.join(sp['policies'])}): {' → '.join(sp['chain'])} "
              f"{sp['schedule']} m={sp['micro_batches']} measured {min(sp['measured_s']):.3f}–"
              f"{max(sp['measured_s']):.3f} s ({sp['max_over_min']:.2f}×: the spread between runs of one plan)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
