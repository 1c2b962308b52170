"""``spiderflow up``: a whole mesh on this machine, a sample job run to completion, then teardown.

::

    spiderflow up                      # 3 CPU clusters on loopback, gpt-tiny pipelined over all three
    spiderflow up --clusters 4 --steps 60
    spiderflow up --topology FILE      # clusters (and, with --testbed, link shaping) from a file
    spiderflow up --testbed            # agents in network namespaces with kernel-shaped links (root)
    spiderflow up --keep --no-job      # keep the mesh running; prints addresses, adds a context
    spiderflow up --etcd-tls           # etcd serves TLS only, every component presents a client certificate
    spiderflow up --testbed --gateway  # only the gateways' mTLS port is open between the clusters

Starts an embedded etcd (a child process; temp data dir unless ``--data-dir``), the topology, planner and
scheduler services and one agent per cluster, each as its own process on real ports; submits the sample
job; follows it with a live progress bar; prints the plan and the predicted vs measured step time; and
stops everything on exit or Ctrl-C, leaving no process or namespace behind. Exit code 0 when the job
succeeded. While the mesh runs, a context named ``local`` (``local-2``, ... when another ``up`` holds it)
points the other commands at it; it is removed when the mesh stops. The workers' logs are kept under
``<state dir>/agents`` (:func:`spiderflow.contexts.state_dir`; under ``--data-dir`` when given) after the
mesh is gone.

``--etcd-tls`` is a flag, not the default: ``spiderflow up`` is the loopback quickstart, where the gRPC
services run plaintext (they refuse it on any other address) and ``--keep`` leaves a mesh any local client
reaches without certificates; the flag runs etcd the way a deployment does (certificates from
``spiderflow certs init`` under ``<data-dir>/certs``, ``--etcd-tls-dir`` on every component).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from spiderflow.cli.commands.jobs import add_data_and_optimizer_options, data_and_optimizer, parse_gpus, prepare_data
from spiderflow.cli.common import EXIT_FAILED, EXIT_USAGE, CliError, console, positive_float, print_json
from spiderflow.cli.constraints import add_constraint_options
from spiderflow.contexts import DEFAULT_ADDRESSES, add_context, config_path, remove_context, state_dir
from spiderflow.core.domain import Topology
from spiderflow.formats import load_topology
from spiderflow.jobs import JobState
from spiderflow.mesh import LocalMesh, sample_topology
from spiderflow.sdk import Client, Job

__all__ = ["register", "sample_job"]


def sample_job(topo: Topology, *, steps: int, clusters: int | None = None, model: Any = "gpt-tiny") -> dict[str, Any]:
    """The sample job: ``model`` (default ``gpt-tiny``) needing one GPU on each of ``clusters`` clusters (a
    cross-cluster pipeline)."""
    n = clusters or min(3, len(topo.clusters))
    return {
        "id": f"sample-{uuid.uuid4().hex[:6]}", "model": model, "global_batch": 8, "micro_batch": 1,
        "seq_len": 64, "steps": steps, "gpus": {"min": n, "max": n}, "tenant": "default",
    }


def _plan_table(job: Job) -> Table:
    table = Table(title=f"plan of {job.id} ({job.plan.schedule if job.plan else '-'}, "
                        f"{job.plan.micro_batches if job.plan else 0} micro-batches)")
    for col in ("stage", "cluster", "layers", "GPUs", "tp", "dp", "memory GiB/GPU"):
        table.add_column(col)
    if job.plan:
        for i, s in enumerate(job.plan.stages):
            mem = job.plan.memory_gib_per_gpu[i] if i < len(job.plan.memory_gib_per_gpu) else 0.0
            table.add_row(str(i), s.cluster, f"{s.first_layer}–{s.last_layer}", str(s.gpus), str(s.tp), str(s.dp),
                          f"{mem:.2f}")
    return table


def _follow(sf: Client, job_id: str, timeout_s: float) -> tuple[Job, list[float], list[float]]:
    """Watch the job to its end with a progress bar; returns the final job, step times and losses."""
    step_times: list[float] = []
    losses: list[float] = []
    deadline = time.monotonic() + timeout_s
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=console, transient=False)
    with progress:
        task = progress.add_task(job_id, total=None, info="waiting for a placement")
        last = (0, 0)  # (attempt, step): a re-placed job resumes from its checkpoint, its steps restart lower
        for ev in sf.follow(job_id, deadline=deadline):
            if time.monotonic() > deadline:
                raise CliError(f"job {job_id} did not finish within {timeout_s:.0f} s", EXIT_FAILED)
            if ev.job is not None:
                progress.update(task, total=ev.job.spec.steps, info=f"{ev.job.state}: {ev.job.reason}")
            if ev.transition is not None:
                progress.update(task, info=f"{ev.transition.to_state}: {ev.transition.reason}")
                progress.console.print(f"  {ev.transition.from_state} → {ev.transition.to_state}: "
                                       f"{ev.transition.reason}")
            if ev.progress:
                p = ev.progress
                step = int(p["step"])
                key = (int(p.get("attempt", 0)), step)
                if key > last:
                    step_times.append(float(p["step_time_s"]))
                    losses.append(float(p["loss"]))
                    last = key
                progress.update(task, completed=step, info=f"loss {p['loss']:.4f} · {p['tokens_per_s']:,.0f} tok/s")
    return sf.get(job_id), step_times, losses


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM and SIGINT behave like Ctrl-C: the mesh is torn down on the way out. (SIGINT is installed
    explicitly: a shell starts background jobs with it ignored, and ``kill -INT`` must still stop them.)"""
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    if args.topology and args.clusters is not None:
        raise CliError("give --clusters or --topology, not both", EXIT_USAGE)
    if args.testbed and os.geteuid() != 0:
        raise CliError("--testbed needs root (network namespaces and traffic shaping)", EXIT_USAGE)
    if args.gateway and not args.testbed:
        raise CliError("--gateway needs --testbed (the firewall and the NAT live in its namespaces)", EXIT_USAGE)
    if args.cpus_per_gpu is not None and not args.testbed:
        raise CliError("--cpus-per-gpu needs --testbed (the limits are per testbed cluster)", EXIT_USAGE)
    clusters = args.clusters if args.clusters is not None else 3
    topo = load_topology(args.topology) if args.topology else sample_topology(clusters)
    if args.steps < 1:
        raise CliError("--steps: must be ≥ 1", EXIT_USAGE)
    if not args.profile_seconds > 0:
        raise CliError("--profile-seconds: must be > 0", EXIT_USAGE)
    if not args.no_job:
        _apply_constraints({}, topo, args)  # bad constraints end here (exit 2), before anything starts
    workdir = Path(args.data_dir) if args.data_dir else None
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    console.print(f"starting a SpiderFlow mesh: etcd, topology, planner, scheduler, {len(topo.clusters)} agent(s)"
                  + (" in the testbed" if args.testbed else ""))
    # The services take the clients' default ports when those are free (grpcurl and the CLI then need no
    # address; the config file written below names them either way).
    ports = {name: int(addr.rsplit(":", 1)[1]) for name, addr in DEFAULT_ADDRESSES.items()}
    agents_dir = None if workdir is not None else state_dir() / "agents"
    mesh = LocalMesh(topo, workdir=workdir, testbed=args.testbed, keep_workdir=args.data_dir is not None,
                     testbed_prefix=args.testbed_prefix, etcd_tls=args.etcd_tls, service_ports=ports,
                     agents_dir=agents_dir, dashboard_port=None if args.no_dashboard else args.dashboard_port,
                     gateway=args.gateway, profile_seconds=args.profile_seconds, cpus_per_gpu=args.cpus_per_gpu)
    code = 0
    context: str | None = None
    try:
        mesh.start(timeout=args.timeout)
        addresses = mesh.addresses()
        context = add_context("local", {**{k: v for k, v in addresses.items() if k != "etcd"},
                                        "dashboard": mesh.dashboard_url, "owner_pid": os.getpid(),
                                        "data_dir": str(mesh.workdir)})
        table = Table(title="mesh", show_header=False)
        for k, v in addresses.items():
            table.add_row(k, v)
        if mesh.dashboard_url:
            table.add_row("dashboard", mesh.dashboard_url)
        table.add_row("context", f"{context} (in {config_path()})")
        table.add_row("workers' logs", str(mesh.agents_dir))
        console.print(table)
        if not args.no_job:
            code = _sample(mesh, topo, args)
        if args.keep:
            console.print(f"mesh is up as context {context}. Try: spiderflow jobs · spiderflow logs JOB · "
                          "spiderflow metrics JOB · spiderflow topology show · Ctrl-C stops everything",
                          soft_wrap=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        console.print("interrupted: stopping the mesh")
        code = 130
    finally:
        if context is not None:
            remove_context(context)
        mesh.stop()
        console.print("mesh stopped: no process left running" + (f"; context {context} removed" if context else ""))
    return code


def _sample(mesh: LocalMesh, topo: Topology, args: argparse.Namespace) -> int:
    job = sample_job(topo, steps=args.steps, model=args.model)
    job.update(data_and_optimizer(args))
    _apply_constraints(job, topo, args)
    prepare_data(job)
    with Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
        submitted = sf.submit(job, request_id=job["id"])
        console.print(f"submitted [bold]{submitted.id}[/bold]: {submitted.spec.model.name}, {args.steps} steps, "
                      f"{job['gpus']['min']} GPUs across clusters")
        final, step_times, losses = _follow(sf, submitted.id, args.timeout)
    console.print(_plan_table(final))
    predicted = final.plan.step_time_s if final.plan else 0.0
    measured = statistics.mean(step_times[1:]) if len(step_times) > 1 else (step_times[0] if step_times else 0.0)
    summary = {
        "job": final.id, "state": final.state, "reason": final.reason, "steps": final.spec.steps,
        "predicted_step_time_s": predicted, "measured_step_time_s": measured,
        "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
        "chain": list(final.plan.chain) if final.plan else [],
    }
    if args.json:
        print_json(summary)
    else:
        ratio = f" (measured/predicted = {measured / predicted:.2f})" if predicted > 0 and measured > 0 else ""
        console.print(f"[bold]{final.state}[/bold]: {final.reason}")
        console.print(f"step time: predicted {predicted:.4f} s, measured {measured:.4f} s (mean after the "
                      f"first step){ratio}")
        if losses:
            console.print(f"loss: {losses[0]:.4f} → {losses[-1]:.4f}")
    return 0 if final.state == JobState.SUCCEEDED else EXIT_FAILED


def _apply_constraints(job: dict[str, Any], topo: Topology, args: argparse.Namespace) -> None:
    """``--gpus`` and the constraint options over the sample job; without ``--gpus`` it takes one GPU on each
    of up to 3 allowed clusters."""
    from spiderflow.cli.constraints import constraint_overrides
    from spiderflow.core.constraints import allowed_clusters
    from spiderflow.core.domain import Constraints

    gpus = dict(args.gpus or {})
    given = constraint_overrides(args, gpus.pop("type", None))
    if not given:
        if gpus:
            job["gpus"] = gpus
        return
    constraints = Constraints(**given)  # type: ignore[arg-type]  # ValidationError: exit 2
    job["constraints"] = given
    job["gpus"] = gpus or {"min": max(1, min(3, len(allowed_clusters(topo, constraints))))}
    job["gpus"].setdefault("max", job["gpus"]["min"])


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run a local mesh and a sample job to completion (the quickstart)")
    p.add_argument("--clusters", type=int, help="number of local CPU clusters (default 3)")
    p.add_argument("--topology", help="topology file for the clusters")
    p.add_argument("--testbed", action="store_true", help="agents in network namespaces with shaped links (root)")
    p.add_argument("--testbed-prefix", default="sf", metavar="P",
                   help="name prefix of the testbed's namespaces (default sf; one testbed per prefix)")
    p.add_argument("--gateway", action="store_true",
                   help="with --testbed: clusters reach each other only through their gateways (one mTLS port; "
                        "the router drops every other cross-cluster TCP)")
    p.add_argument("--cpus-per-gpu", type=positive_float, default=None, metavar="CORES",
                   help="with --testbed: limit each cluster to CORES × its GPUs cores of this host (a cgroup CPU "
                        "quota: a cluster's compute is its own, as on separate machines); default: no limit")
    p.add_argument("--etcd-tls", action="store_true",
                   help="etcd serves TLS only and requires client certificates (generated under the data dir); "
                        "every component connects with --etcd-tls-dir")
    p.add_argument("--keep", action="store_true", help="keep the mesh running until Ctrl-C")
    p.add_argument("--no-job", action="store_true", help="do not submit the sample job")
    p.add_argument("--steps", type=int, default=30, help="training steps of the sample job")
    p.add_argument("--data-dir", help="keep etcd data and logs here (default: a temp dir, removed on exit)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for startup and for the job")
    p.add_argument("--profile-seconds", type=float, default=1.5, metavar="S",
                   help="timed part of each agent's CPU calibration (it takes about 4 × S plus warm-up; "
                        "shorter: a faster start, a noisier calibration)")
    p.add_argument("--dashboard-port", type=int, default=8265,
                   help="serve the web dashboard on this loopback port (taken: any free port)")
    p.add_argument("--no-dashboard", action="store_true", help="no web dashboard")
    p.add_argument("--json", action="store_true", help="print the run's summary as JSON")
    p.add_argument("--model", default="gpt-tiny",
                   help="model of the sample job: a preset (default gpt-tiny; llama-tiny, ...), a Hugging Face "
                        "config.json or package.module:function")
    p.add_argument("--gpus", type=parse_gpus, metavar="[TYPE:]N",
                   help="GPUs of the sample job: N, MIN:MAX or TYPE:N (default: one on each of up to 3 "
                        "clusters, e.g. cpu:2)")
    add_constraint_options(p)
    add_data_and_optimizer_options(p)
    p.set_defaults(func=_run)
