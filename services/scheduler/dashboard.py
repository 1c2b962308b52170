"""The scheduler's dashboard (:mod:`spiderflow.dashboard.server`) fed from the scheduler's own sources: the
job records in etcd, the live topology, the metrics history and the agents' logs (:mod:`services.scheduler.observe`)."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.scheduler.observe import JobObserver
from services.scheduler.repo import JobRepository
from services.scheduler.topology_source import TopologySource
from spiderflow.core.domain import Topology
from spiderflow.jobs import JobRecord
from spiderflow.proto.scheduler.v1 import scheduler_pb2
from spiderflow.runtime import parse_hostport
from spiderflow.security.auth import Authenticator, TokenTable

if TYPE_CHECKING:  # the server (aiohttp) is imported only when a dashboard is asked for
    from spiderflow.dashboard.server import DashboardSources, StartedDashboard

__all__ = ["add_dashboard_argument", "start_scheduler_dashboard"]


def add_dashboard_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dashboard-listen", metavar="HOST:PORT",
                   help="serve the read-only web dashboard here (port 0: any free port; default: no dashboard); "
                        "authenticated like the API (--tokens, --tls-dir)")


def _sources(repo: JobRepository, topology: TopologySource, observer: JobObserver) -> DashboardSources:
    from spiderflow.dashboard.server import DashboardSources

    async def jobs() -> list[JobRecord]:
        stored, _ = await repo.list()
        return [s.record for s in stored]

    async def job(job_id: str) -> JobRecord:
        return (await repo.get(job_id)).record

    async def topo() -> Topology:
        return await topology.snapshot()

    async def metrics(job_id: str) -> list[dict[str, Any]]:
        resp = await observer.metrics(job_id, 0)
        return [{"attempt": p.attempt, "step": p.step, "loss": p.loss, "tokens_per_s": p.tokens_per_s,
                 "step_time_s": p.step_time_s, "predicted_step_time_s": p.predicted_step_time_s,
                 "time": p.time.ToNanoseconds() / 1e9, "stage_busy_s": list(p.stage_busy_s),
                 "predicted_stage_busy_s": list(p.predicted_stage_busy_s)} for p in resp.points]

    async def logs(job_id: str, tail: int) -> list[tuple[str, str]]:
        files: dict[str, bytearray] = {}
        req = scheduler_pb2.GetJobLogsRequest(job_id=job_id, rank=-1)
        async for m in observer.logs(req):
            label = f"{m.cluster}/a{m.attempt}/r{m.rank}/{'out' if m.stream == 'stdout' else 'err'}"
            buf = files.setdefault(label, bytearray())
            buf += m.data
            if len(buf) > 4 * tail:
                del buf[: len(buf) - tail]
        return [(label, bytes(buf[-tail:]).decode(errors="replace")) for label, buf in sorted(files.items())]

    return DashboardSources(jobs=jobs, job=job, topology=topo, metrics=metrics, logs=logs)


async def start_scheduler_dashboard(args: argparse.Namespace, repo: JobRepository, topology: TopologySource,
                                    observer: JobObserver) -> StartedDashboard | None:
    """The dashboard of ``--dashboard-listen`` (None when not asked for), with the API's authentication."""
    if not getattr(args, "dashboard_listen", None):
        return None
    from spiderflow.dashboard.server import DashboardServer, start_dashboard

    host, port = parse_hostport(args.dashboard_listen, field="--dashboard-listen")
    tokens = TokenTable.load(Path(args.tokens)) if getattr(args, "tokens", None) else None
    tls_dir = getattr(args, "tls_dir", None)
    context: ssl.SSLContext | None = None
    if tls_dir:
        d = Path(tls_dir)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(d / "ca.crt"))
        context.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
        context.verify_mode = ssl.CERT_OPTIONAL if tokens is not None else ssl.CERT_REQUIRED
    auth = Authenticator(tokens=tokens, certificates=bool(tls_dir)) if tokens is not None or tls_dir else None
    server = DashboardServer(_sources(repo, topology, observer), authenticator=auth)
    return await start_dashboard(server, host, port, ssl_context=context)
