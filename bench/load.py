"""Load: N SubmitJob calls from C concurrent clients on loopback against one scheduler leader
(simulator-backed executor, short durations), then wait until every job has completed.

    .venv/bin/python bench/load.py                       # 5,000 submissions, 16 clients
    .venv/bin/python bench/load.py --jobs 1000 --clients 8

Real parts: an etcd process and a ``spiderflow serve scheduler`` process (bearer-token authentication:
one tenant per client, so each client has its own SubmitJob rate-limit bucket). Each client submits its
share one call after another (closed loop) on its own channel. Reported (one JSON document on stdout):
submit latency p50/p90/p99/max, submissions per second over the submit phase, time until all jobs were
terminal, and the check that nothing was lost or duplicated (every id exactly once, every job SUCCEEDED,
one request record per job). Exit code 1 when the check fails. Also reported: CPU seconds the scheduler and
etcd processes (``/proc/<pid>/stat``) and the clients (this process) spent during the submit phase, and the
1-minute load average before and after it (the machine is shared: a loaded machine inflates wall-clock
figures, CPU seconds per submission much less).

``--profile PATH`` runs the scheduler under ``cProfile`` and stops it right after the submit phase (stats of
that phase, scheduling cycles included, written to PATH; read them with ``python -m pstats PATH``); completion
is then not awaited (the check covers the records in etcd only). The profiler's overhead lowers throughput:
profiled runs are for finding costs, not for the figures. ``--submit-only`` stops after the submit phase
without profiling; ``--scheduler-arg`` passes extra flags to the scheduler (experiments).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from spiderflow.formats import job_from_dict  # noqa: E402
from spiderflow.jobs import JobRecord, JobState  # noqa: E402
from spiderflow.procs import ManagedProcess, spiderflow_argv  # noqa: E402
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from spiderflow.proto.types.v1 import types_pb2  # noqa: E402
from spiderflow.rpc import convert  # noqa: E402
from spiderflow.rpc.server import open_channel  # noqa: E402
from spiderflow.security.auth import bearer_metadata  # noqa: E402
from spiderflow.store import keys, records  # noqa: E402
from spiderflow.store.etcd import EtcdStore  # noqa: E402
from spiderflow.store.process import EtcdProcess  # noqa: E402

TERMINAL = {types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_CANCELLED}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(i: int, tenant: str) -> scheduler_pb2.SubmitJobRequest:
    spec = job_from_dict({"id": f"load-{i:05d}", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1,
                          "seq_len": 64, "steps": 2, "gpus": {"min": 1, "max": 1}, "tenant": tenant})
    return scheduler_pb2.SubmitJobRequest(request_id=f"load-req-{i:05d}", job=convert.job_to_proto(spec))


async def _client(address: str, token: str, tenant: str, indices: list[int], latencies: list[float]) -> None:
    md = bearer_metadata(token)
    requests = [_request(i, tenant) for i in indices]
    async with open_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for req in requests:
            t0 = time.perf_counter()
            resp = await stub.SubmitJob(req, timeout=30, metadata=md)
            latencies.append(time.perf_counter() - t0)
            assert resp.created, req.request_id


async def _all_jobs(address: str, token: str) -> list[scheduler_pb2.Job]:
    out: list[scheduler_pb2.Job] = []
    async with open_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        page = ""
        while True:
            resp = await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000, page_token=page), timeout=30,
                                       metadata=bearer_metadata(token))
            out.extend(resp.jobs)
            page = resp.next_page_token
            if not page:
                return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="spiderflow-load-"))
    tenants = [f"tenant{c:02d}" for c in range(args.clients)]
    tokens = {t: secrets.token_hex(16) for t in tenants}
    admin = secrets.token_hex(16)
    (work / "tokens.yaml").write_text(json.dumps(
        {"tokens": {**{tok: f"tenant:{t}" for t, tok in tokens.items()}, admin: "admin:load"}}))
    etcd = EtcdProcess()
    etcd.start()
    sched: ManagedProcess | None = None
    try:
        prefix = [sys.executable, "-m", "cProfile", "-o", str(Path(args.profile).resolve()), "-m",
                  "spiderflow.cli.main"] if args.profile else spiderflow_argv()
        sched = ManagedProcess("scheduler", [
            *prefix, "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd.endpoint,
            "--topology", args.topology,
            "--executor", "sim", "--sim-min-s", str(args.sim_s), "--sim-max-s", str(args.sim_s),
            "--cycle-interval", "1", "--tokens", str(work / "tokens.yaml"), "--log-format", "json",
            "--max-queued", str(max(10_000, args.jobs * 2)), *args.scheduler_arg,
        ], log_dir=work).start(timeout=60)
        latencies: list[float] = []
        share = [list(range(c, args.jobs, args.clients)) for c in range(args.clients)]
        load_before = os.getloadavg()[0]
        etcd_pid = etcd.pid
        assert etcd_pid is not None
        cpu0 = _cpu_seconds(sched.pid), _cpu_seconds(etcd_pid), time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(sched.address, tokens[t], t, share[c], latencies)
                               for c, t in enumerate(tenants)))
        submit_s = time.perf_counter() - t0
        cpu1 = _cpu_seconds(sched.pid), _cpu_seconds(etcd_pid), time.process_time()
        load_after = os.getloadavg()[0]
        jobs: list[scheduler_pb2.Job] = []
        if args.profile or args.submit_only:  # the profile covers the submit phase only: stop the scheduler now
            sched.stop()
            sched = None
        else:  # watch them all complete
            deadline = time.perf_counter() + args.timeout
            while time.perf_counter() < deadline:
                jobs = await _all_jobs(sched.address, admin)
                if len(jobs) >= args.jobs and all(j.state in TERMINAL for j in jobs):
                    break
                await asyncio.sleep(1.0)
        done_s = time.perf_counter() - t0
        store = EtcdStore(etcd.endpoint)
        try:
            reqs, _ = await store.get_prefix(keys.ROOT + "requests/")
            stored = [records.decode_as(kv.key, kv.value, JobRecord) for kv in (await store.get_prefix(keys.JOBS))[0]]
        finally:
            await store.close()
        ids = sorted(r.id for r in stored)
        expected = sorted(f"{tenants[i % args.clients]}~load-{i:05d}" for i in range(args.jobs))  # ids per tenant
        succeeded = sum(1 for r in stored if r.state is JobState.SUCCEEDED)
        complete = args.profile or args.submit_only or (len(jobs) == args.jobs and succeeded == args.jobs)
        lat = np.array(latencies) * 1000.0
        return {
            "jobs": args.jobs, "clients": args.clients, "topology": args.topology,
            "submit_seconds": round(submit_s, 2), "submissions_per_s": round(args.jobs / submit_s, 1),
            "latency_ms": {"p50": round(float(np.percentile(lat, 50)), 2),
                           "p90": round(float(np.percentile(lat, 90)), 2),
                           "p99": round(float(np.percentile(lat, 99)), 2), "max": round(float(lat.max()), 2)},
            "submit_cpu_seconds": {"scheduler": round(cpu1[0] - cpu0[0], 2), "etcd": round(cpu1[1] - cpu0[1], 2),
                                   "clients": round(cpu1[2] - cpu0[2], 2)},
            "load_average_1m": {"before": round(load_before, 2), "after": round(load_after, 2)},
            "all_terminal_seconds": None if args.profile or args.submit_only else round(done_s, 1),
            "succeeded": succeeded,
            "nothing_lost_or_duplicated": ids == expected and len(reqs) == args.jobs and bool(complete),
        }
    finally:
        if sched is not None:
            sched.stop()
        etcd.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--topology", default=str(ROOT / "examples/topology-3.yaml"))
    p.add_argument("--sim-s", type=float, default=0.02, help="simulated run time of every job (wall seconds)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for all jobs to complete")
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument("--profile", help="run the scheduler under cProfile and write its stats here")
    p.add_argument("--submit-only", action="store_true",
                   help="stop after the submit phase (check the records in etcd, not completion)")
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="extra argument of `serve scheduler` (repeatable), e.g. --scheduler-arg=--min-cycle-interval=2")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["nothing_lost_or_duplicated"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
