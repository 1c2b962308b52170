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

Authentication is on as deployed: mTLS (a throw-away CA, the scheduler's service certificate, one tenant
certificate per client) plus bearer tokens; ``--no-tls`` measures tokens over plaintext.

Every wait is bounded and says what it waits for on stderr: the scheduler's start (``--start-timeout``;
it campaigns once its placement kernels are loaded, which after an install compiles them), the submit
phase (``--submit-timeout``), and completion (``--timeout`` in all; ``--stall-timeout`` without a single
job finishing). A wait that runs out stops the run with a one-line reason, the scheduler log's tail and
exit code 2. Completion is watched in etcd (a few reads of the job records a second from this process),
not through ``ListJobs``, which would make the scheduler list and encode every job again and again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

import grpc.aio  # noqa: E402
import numpy as np  # noqa: E402

from spiderflow.core.errors import SpiderFlowError  # noqa: E402
from spiderflow.formats import job_from_dict  # noqa: E402
from spiderflow.jobs import JobRecord, JobState  # noqa: E402
from spiderflow.procs import ManagedProcess, spiderflow_argv  # noqa: E402
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402
from spiderflow.proto.types.v1 import types_pb2  # noqa: E402
from spiderflow.rpc import convert  # noqa: E402
from spiderflow.rpc.server import open_channel  # noqa: E402
from spiderflow.runtime import configure_logging  # noqa: E402
from spiderflow.security.auth import bearer_metadata  # noqa: E402
from spiderflow.security.certs import bundle_name, init_certs  # noqa: E402
from spiderflow.security.identity import Principal, Role  # noqa: E402
from spiderflow.security.tls import channel_credentials  # noqa: E402
from spiderflow.store import keys, records  # noqa: E402
from spiderflow.store.etcd import EtcdStore  # noqa: E402
from spiderflow.store.process import EtcdProcess  # noqa: E402

TERMINAL = {types_pb2.JOB_STATE_SUCCEEDED, types_pb2.JOB_STATE_FAILED, types_pb2.JOB_STATE_CANCELLED}
TERMINAL_STATES = frozenset({JobState.SUCCEEDED.value, JobState.FAILED.value, JobState.CANCELLED.value})


MAX_RETRIES = 5
"""Retries of one submission answered UNAVAILABLE."""


class BenchError(Exception):
    """A bounded wait ran out, or a part of the run failed: the run stops with this one-line reason."""


def _say(text: str) -> None:
    sys.stderr.write(f"load: {text}\n")
    sys.stderr.flush()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _request(i: int, tenant: str) -> scheduler_pb2.SubmitJobRequest:
    spec = job_from_dict({"id": f"load-{i:05d}", "model": "gpt-tiny", "global_batch": 8, "micro_batch": 1,
                          "seq_len": 64, "steps": 2, "gpus": {"min": 1, "max": 1}, "tenant": tenant})
    return scheduler_pb2.SubmitJobRequest(request_id=f"load-req-{i:05d}", job=convert.job_to_proto(spec))


async def _client(address: str, token: str, tenant: str, indices: list[int], latencies: list[float],
                  credentials: Any, retries: list[int]) -> None:
    """Submit one after another; an UNAVAILABLE answer (the store was slow) is retried with the same request
    id, as clients do: the retry returns the job the first try created, if it did (``created`` false)."""
    md = bearer_metadata(token)
    requests = [_request(i, tenant) for i in indices]
    async with open_channel(address, credentials=credentials) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for req in requests:
            t0 = time.perf_counter()
            for attempt in range(MAX_RETRIES + 1):
                try:
                    resp = await stub.SubmitJob(req, timeout=30, metadata=md)
                    break
                except grpc.aio.AioRpcError as e:
                    if e.code() is not grpc.StatusCode.UNAVAILABLE or attempt == MAX_RETRIES:
                        raise
                    retries.append(1)
                    await asyncio.sleep(0.2 * (attempt + 1))
            latencies.append(time.perf_counter() - t0)
            if not resp.created and resp.job.spec.id != f"{tenant}~{req.job.id}":
                raise BenchError(f"{req.request_id} answered another job: {resp.job.spec.id}")


async def _all_jobs(address: str, token: str, credentials: Any) -> list[scheduler_pb2.Job]:
    out: list[scheduler_pb2.Job] = []
    async with open_channel(address, credentials=credentials) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        page = ""
        while True:
            resp = await stub.ListJobs(scheduler_pb2.ListJobsRequest(page_size=1000, page_token=page), timeout=30,
                                       metadata=bearer_metadata(token))
            out.extend(resp.jobs)
            page = resp.next_page_token
            if not page:
                return out


async def _states(store: EtcdStore) -> dict[str, int]:
    """How many job records etcd holds in each state (read here, not through the scheduler)."""
    items, _ = await store.get_prefix(keys.JOBS)
    out: dict[str, int] = {}
    for kv in items:
        state = str(json.loads(kv.value).get("state", "?"))
        out[state] = out.get(state, 0) + 1
    return out


async def _wait_leader(store: EtcdStore, sched: ManagedProcess, timeout: float) -> float:
    """Seconds until a scheduler leader is elected (it campaigns once its kernels are loaded)."""
    t0 = time.perf_counter()
    last_said = t0
    while True:
        items, _ = await store.get_prefix(keys.election_name(keys.SCHEDULER) + "/")
        if items:
            return time.perf_counter() - t0
        now = time.perf_counter()
        if sched.proc is not None and sched.proc.poll() is not None:
            raise BenchError(f"the scheduler exited with {sched.proc.returncode} before leading: {sched.tail()}")
        if now - t0 > timeout:
            raise BenchError(f"no scheduler leader within {timeout:.0f} s (--start-timeout): {sched.tail()}")
        if now - last_said >= 10:
            _say(f"waiting for the scheduler to lead (loading its placement kernels), {now - t0:.0f} s")
            last_said = now
        await asyncio.sleep(0.2)


async def _submit_all(args: argparse.Namespace, address: str, tokens: dict[str, str], tenants: list[str],
                      latencies: list[float], credentials: dict[str, Any], retries: list[int]) -> None:
    share = [list(range(c, args.jobs, args.clients)) for c in range(args.clients)]
    clients = asyncio.gather(*(_client(address, tokens[t], t, share[c], latencies, credentials[t], retries)
                               for c, t in enumerate(tenants)))
    t0 = time.perf_counter()
    while True:
        done, _ = await asyncio.wait({clients}, timeout=10.0)
        if done:
            try:
                clients.result()
            except grpc.aio.AioRpcError as e:
                raise BenchError(f"SubmitJob failed after {len(latencies)} of {args.jobs} submissions "
                                 f"({len(retries)} retries): "
                                 f"{e.code().name}: {e.details()}") from None
            return
        elapsed = time.perf_counter() - t0
        if elapsed > args.submit_timeout:
            clients.cancel()
            with contextlib.suppress(BaseException):
                await clients
            raise BenchError(f"submit phase: {len(latencies)} of {args.jobs} submitted in {elapsed:.0f} s "
                             "(--submit-timeout)")
        _say(f"submitted {len(latencies)} of {args.jobs} in {elapsed:.0f} s")


async def _wait_done(args: argparse.Namespace, store: EtcdStore, sched: ManagedProcess, t0: float) -> float:
    """Seconds from ``t0`` until every job is terminal, watched in etcd; BenchError on a deadline or a stall."""
    best, best_at, last_said = -1, time.perf_counter(), 0.0
    while True:
        states = await _states(store)
        terminal = sum(n for s, n in states.items() if s in TERMINAL_STATES)
        now = time.perf_counter()
        if terminal >= args.jobs:
            return now - t0
        if terminal > best:
            best, best_at = terminal, now
        summary = ", ".join(f"{s} {n}" for s, n in sorted(states.items()))
        if sched.proc is not None and sched.proc.poll() is not None:
            raise BenchError(f"the scheduler exited with {sched.proc.returncode} with {terminal} of {args.jobs} "
                             f"jobs finished ({summary}): {sched.tail()}")
        if now - best_at > args.stall_timeout:
            raise BenchError(f"no job finished for {now - best_at:.0f} s (--stall-timeout); {terminal} of "
                             f"{args.jobs} finished ({summary}): {sched.tail()}")
        if now - t0 > args.timeout:
            raise BenchError(f"{terminal} of {args.jobs} jobs finished after {now - t0:.0f} s (--timeout; "
                             f"{summary}): {sched.tail()}")
        if now - last_said >= 10:
            _say(f"{terminal} of {args.jobs} jobs finished after {now - t0:.0f} s ({summary})")
            last_said = now
        await asyncio.sleep(args.poll_s)


def _certificates(work: Path, tenants: list[str]) -> tuple[Path, dict[str, Any], Any]:
    """A throw-away CA with the scheduler's and every tenant's bundle (and the admin's): the scheduler's
    bundle directory, each tenant's channel credentials, the admin's."""
    certs = work / "certs"
    init_certs(certs, tenants=tenants, hosts=["127.0.0.1", "localhost"], etcd=False)
    creds = {t: channel_credentials(certs / bundle_name(Principal(role=Role.TENANT, name=t))) for t in tenants}
    return certs / "scheduler", creds, channel_credentials(certs / "admin")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="spiderflow-load-"))
    tenants = [f"tenant{c:02d}" for c in range(args.clients)]
    tokens = {t: secrets.token_hex(16) for t in tenants}
    admin = secrets.token_hex(16)
    (work / "tokens.yaml").write_text(json.dumps(
        {"tokens": {**{tok: f"tenant:{t}" for t, tok in tokens.items()}, admin: "admin:load"}}))
    tls_args: list[str] = []
    creds: dict[str, Any] = dict.fromkeys(tenants)
    admin_creds: Any = None
    if args.tls:
        sched_dir, creds, admin_creds = _certificates(work, tenants)
        tls_args = ["--tls-dir", str(sched_dir)]
    etcd = EtcdProcess()
    etcd.start()
    sched: ManagedProcess | None = None
    store = EtcdStore(etcd.endpoint)
    try:
        prefix = [sys.executable, "-m", "cProfile", "-o", str(Path(args.profile).resolve()), "-m",
                  "spiderflow.cli.main"] if args.profile else spiderflow_argv()
        try:
            sched = ManagedProcess("scheduler", [
                *prefix, "serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", etcd.endpoint,
                "--topology", args.topology,
                "--executor", "sim", "--sim-min-s", str(args.sim_s), "--sim-max-s", str(args.sim_s),
                "--cycle-interval", "1", "--tokens", str(work / "tokens.yaml"), *tls_args, "--log-format", "json",
                "--max-queued", str(max(10_000, args.jobs * 2)),
                # keep every finished job: the check reads them all (the default keeps 1,000 and deletes the
                # rest, so a run of more jobs never saw them all finish)
                "--retain-finished-jobs", str(max(10_000, args.jobs * 2)), *args.scheduler_arg,
            ], log_dir=work).start(timeout=args.start_timeout)
        except SpiderFlowError as e:
            raise BenchError(f"the scheduler did not start: {e}") from None
        _say(f"scheduler serving at {sched.address} ({'mTLS + tokens' if args.tls else 'tokens'}; log "
             f"{sched.log_path})")
        led = await _wait_leader(store, sched, args.start_timeout)
        _say(f"scheduler leads after {led:.1f} s; submitting {args.jobs} jobs from {args.clients} clients")
        latencies: list[float] = []
        load_before = os.getloadavg()[0]
        etcd_pid = etcd.pid
        assert etcd_pid is not None
        cpu0 = _cpu_seconds(sched.pid), _cpu_seconds(etcd_pid), time.process_time()
        t0 = time.perf_counter()
        retries: list[int] = []
        await _submit_all(args, sched.address, tokens, tenants, latencies, creds, retries)
        submit_s = time.perf_counter() - t0
        cpu1 = _cpu_seconds(sched.pid), _cpu_seconds(etcd_pid), time.process_time()
        load_after = os.getloadavg()[0]
        _say(f"submitted {args.jobs} in {submit_s:.1f} s ({args.jobs / submit_s:.0f}/s)")
        jobs: list[scheduler_pb2.Job] = []
        if args.profile or args.submit_only:  # the profile covers the submit phase only: stop the scheduler now
            sched.stop()
            sched = None
            done_s = time.perf_counter() - t0
        else:  # watch them all complete, then read them once through the API
            done_s = await _wait_done(args, store, sched, t0)
            jobs = await _all_jobs(sched.address, admin, admin_creds)
        reqs, _ = await store.get_prefix(keys.ROOT + "requests/")
        stored = [records.decode_as(kv.key, kv.value, JobRecord) for kv in (await store.get_prefix(keys.JOBS))[0]]
        ids = sorted(r.id for r in stored)
        expected = sorted(f"{tenants[i % args.clients]}~load-{i:05d}" for i in range(args.jobs))  # ids per tenant
        succeeded = sum(1 for r in stored if r.state is JobState.SUCCEEDED)
        complete = args.profile or args.submit_only or (len(jobs) == args.jobs and succeeded == args.jobs
                                                          and all(j.state in TERMINAL for j in jobs))
        lat = np.array(latencies) * 1000.0
        return {
            "jobs": args.jobs, "clients": args.clients, "topology": args.topology,
            "auth": "mTLS + bearer tokens" if args.tls else "bearer tokens (plaintext)",
            "submit_seconds": round(submit_s, 2), "submissions_per_s": round(args.jobs / submit_s, 1),
            "latency_ms": {"p50": round(float(np.percentile(lat, 50)), 2),
                           "p90": round(float(np.percentile(lat, 90)), 2),
                           "p99": round(float(np.percentile(lat, 99)), 2), "max": round(float(lat.max()), 2)},
            "submit_cpu_seconds": {"scheduler": round(cpu1[0] - cpu0[0], 2), "etcd": round(cpu1[1] - cpu0[1], 2),
                                   "clients": round(cpu1[2] - cpu0[2], 2)},
            "load_average_1m": {"before": round(load_before, 2), "after": round(load_after, 2)},
            "unavailable_retries": len(retries),
            "all_terminal_seconds": None if args.profile or args.submit_only else round(done_s, 1),
            "succeeded": succeeded,
            "nothing_lost_or_duplicated": ids == expected and len(reqs) == args.jobs and bool(complete),
        }
    finally:
        await store.close()
        if sched is not None:
            sched.stop()
        etcd.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--topology", default=str(ROOT / "examples/topology-3.yaml"))
    p.add_argument("--sim-s", type=float, default=0.02, help="simulated run time of every job (wall seconds)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds from the first submission until every job must have completed")
    p.add_argument("--stall-timeout", type=float, default=120.0,
                   help="give up when no job finished for this many seconds")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds for the scheduler to serve and lead (the first start compiles its kernels)")
    p.add_argument("--submit-timeout", type=float, default=600.0, help="seconds for the submit phase")
    p.add_argument("--poll-s", type=float, default=2.0, help="how often completion is read from etcd")
    p.add_argument("--tls", action=argparse.BooleanOptionalAction, default=True,
                   help="mTLS as well as bearer tokens (default); --no-tls: tokens over plaintext")
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument("--profile", help="run the scheduler under cProfile and write its stats here")
    p.add_argument("--submit-only", action="store_true",
                   help="stop after the submit phase (check the records in etcd, not completion)")
    p.add_argument("--scheduler-arg", action="append", default=[],
                   help="extra argument of `serve scheduler` (repeatable), e.g. --scheduler-arg=--min-cycle-interval=2")
    args = p.parse_args(argv)
    configure_logging(level="warning")  # stdout carries the JSON report only
    try:
        report = asyncio.run(run(args))
    except BenchError as e:
        _say(f"FAILED: {e}")
        return 2
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["nothing_lost_or_duplicated"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
