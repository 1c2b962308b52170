"""The read-only web dashboard the scheduler serves (``--dashboard-listen HOST:PORT``).

One page (``index.html``, plain JavaScript, no external resources) polls a small JSON API:

=====================================  ====================================================================
``GET /api/overview``                  clusters (GPUs, free GPUs), measured links, jobs, the queue with reasons
``GET /api/jobs/<job>``                one job: state, plan stages, prediction, progress, history
``GET /api/jobs/<job>/metrics``        every reported step (loss, tokens/s, measured and predicted step time)
``GET /api/jobs/<job>/gantt.svg``      the plan's pipeline schedule as a Gantt chart (:mod:`spiderflow.viz.gantt`)
``GET /api/jobs/<job>/logs``           the end of every rank's output (``?bytes=N`` per file, default 16 KiB)
=====================================  ====================================================================

Authentication is the API's: with a tokens file, a bearer token (``Authorization`` header, or once as
``?token=`` which sets an HttpOnly cookie and redirects to the clean URL); under mTLS the dashboard serves
HTTPS with the scheduler's certificate and takes the client certificate's principal. Tenants see only their
own jobs (others are NOT_FOUND, as in the API); without authentication (a loopback development mesh)
everything is visible. Nothing here writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from spiderflow.core.domain import Topology
from spiderflow.core.errors import NotFoundError, SpiderFlowError, UnauthenticatedError, ValidationError
from spiderflow.formats import plan_to_dict
from spiderflow.jobs import JobRecord, JobState
from spiderflow.security import authz
from spiderflow.security.auth import Authenticator
from spiderflow.security.identity import Principal

__all__ = ["DashboardServer", "DashboardSources", "start_dashboard"]

log = structlog.get_logger(__name__)

COOKIE = "spiderflow_token"
LOG_TAIL_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class DashboardSources:
    """Where the dashboard reads from: ``jobs()`` every job record, ``job(id)`` one (NotFoundError),
    ``topology()`` the live snapshot, ``metrics(id)`` the history as the API's response, ``logs(id, n)``
    the last ``n`` bytes of every rank's output as ``[(label, text)]``."""

    jobs: Callable[[], Awaitable[list[JobRecord]]]
    job: Callable[[str], Awaitable[JobRecord]]
    topology: Callable[[], Awaitable[Topology]]
    metrics: Callable[[str], Awaitable[list[dict[str, Any]]]]
    logs: Callable[[str, int], Awaitable[list[tuple[str, str]]]]


def _clusters(r: JobRecord) -> set[str]:
    return set(r.allocation) | ({s.cluster for s in r.plan.stages} if r.plan is not None else set())


def _summary(r: JobRecord) -> dict[str, Any]:
    done = r.spec.steps if r.state is JobState.SUCCEEDED else r.progress.step
    return {
        "id": r.id, "tenant": r.spec.tenant, "model": r.spec.model.name, "state": str(r.state), "reason": r.reason,
        "step": done, "steps": r.spec.steps, "attempt": r.attempt, "policy": r.policy, "priority": r.spec.priority,
        "gpus": r.plan.gpus if r.plan is not None else 0, "created_at": r.created_at, "updated_at": r.updated_at,
        "chain": list(r.plan.chain) if r.plan is not None else [],
        "loss": r.progress.loss, "step_time_s": r.progress.step_time_s,
        "predicted_step_time_s": r.plan.step_time_s if r.plan is not None else None,
    }


class DashboardServer:
    """The aiohttp application (see the module docstring); ``authenticator`` None: no authentication."""

    def __init__(self, sources: DashboardSources, *, authenticator: Authenticator | None = None) -> None:
        self.sources = sources
        self.authenticator = authenticator
        self._gantt: dict[tuple[str, int], str] = {}
        self.app = web.Application(middlewares=[self._auth_middleware])
        self.app.add_routes([
            web.get("/", self._index),
            web.get("/api/overview", self._overview),
            web.get("/api/jobs/{job}", self._job),
            web.get("/api/jobs/{job}/metrics", self._metrics),
            web.get("/api/jobs/{job}/gantt.svg", self._gantt_svg),
            web.get("/api/jobs/{job}/logs", self._logs),
        ])

    # -- authentication -------------------------------------------------------------------------------

    def _principal(self, request: web.Request) -> Principal | None:
        if self.authenticator is None:
            return None
        token = request.cookies.get(COOKIE) or request.query.get("token")
        header = request.headers.get("Authorization")
        metadata = [("authorization", header)] if header else [("authorization", f"Bearer {token}")] if token else []
        auth_context = None
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        if ssl_object is not None:
            der = ssl_object.getpeercert(binary_form=True)
            if der:
                auth_context = {"x509_pem_cert": [ssl.DER_cert_to_PEM_cert(der).encode()]}
        return self.authenticator.authenticate(metadata, auth_context)

    @web.middleware
    async def _auth_middleware(self, request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            principal = self._principal(request)
        except UnauthenticatedError as e:
            return web.json_response({"error": str(e), "code": "UNAUTHENTICATED"}, status=401)
        if "token" in request.query and self.authenticator is not None:
            query = {k: v for k, v in request.query.items() if k != "token"}
            resp = web.HTTPFound(request.rel_url.with_query(query))
            resp.set_cookie(COOKIE, request.query["token"], httponly=True, samesite="Strict")
            return resp
        request["principal"] = principal
        try:
            return await handler(request)
        except NotFoundError as e:
            return web.json_response({"error": str(e), "code": "NOT_FOUND"}, status=404)
        except ValidationError as e:
            return web.json_response({"error": str(e), "code": "INVALID_ARGUMENT"}, status=400)
        except SpiderFlowError as e:
            return web.json_response({"error": str(e), "code": type(e).__name__}, status=503)

    async def _visible(self, request: web.Request) -> JobRecord:
        job_id = request.match_info["job"]
        r = await self.sources.job(job_id)
        authz.require_visible(request["principal"], job_id, r.spec.tenant, _clusters(r))
        return r

    # -- pages ----------------------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.StreamResponse:
        page = resources.files("spiderflow.dashboard").joinpath("index.html").read_text(encoding="utf-8")
        return web.Response(text=page, content_type="text/html", headers={"Cache-Control": "no-store"})

    async def _overview(self, request: web.Request) -> web.StreamResponse:
        principal = request["principal"]
        records = [r for r in await self.sources.jobs()
                   if authz.can_see(principal, r.spec.tenant, _clusters(r))]
        records.sort(key=lambda r: (r.created_at, r.id))
        doc: dict[str, Any] = {"time": time.time(), "jobs": [_summary(r) for r in records]}
        doc["queue"] = [{"id": r.id, "priority": r.spec.priority, "reason": r.reason, "state": str(r.state)}
                        for r in records if r.state in (JobState.PENDING, JobState.RESCHEDULING)]
        try:
            topo = await self.sources.topology()
        except SpiderFlowError as e:
            doc["clusters"], doc["links"], doc["topology_error"] = [], [], str(e)
        else:
            used: dict[str, int] = {}
            for r in records:
                if not r.terminal:
                    for c, g in r.allocation.items():
                        used[c] = used.get(c, 0) + g
            doc["clusters"] = [{"name": c.name, "region": c.region, "gpu": c.gpu, "gpus": c.total_gpus,
                                "free_gpus": c.free, "in_use": used.get(c.name, 0), "tflops": c.tflops,
                                "lat": c.lat, "lon": c.lon} for c in topo.clusters]
            doc["links"] = [{"a": lk.a, "b": lk.b, "bandwidth_gbps": lk.bandwidth_gbps, "latency_ms": lk.latency_ms,
                             "directed": lk.directed} for lk in topo.links]
        return web.json_response(doc)

    async def _job(self, request: web.Request) -> web.StreamResponse:
        r = await self._visible(request)
        doc = _summary(r)
        doc["plan"] = plan_to_dict(r.plan) if r.plan is not None else None
        doc["history"] = [{"from": str(t.from_state) if t.from_state else "", "to": str(t.to_state),
                           "reason": t.reason, "time": t.at} for t in r.history]
        doc["spec"] = {"global_batch": r.spec.global_batch, "micro_batch": r.spec.micro_batch,
                       "seq_len": r.spec.seq_len, "layers": r.spec.model.layers}
        return web.json_response(doc)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        r = await self._visible(request)
        return web.json_response({"job": r.id, "points": await self.sources.metrics(r.id)})

    async def _gantt_svg(self, request: web.Request) -> web.StreamResponse:
        r = await self._visible(request)
        if r.plan is None:
            raise NotFoundError(f"job {r.id} has no plan yet")
        key = (r.id, r.attempt)
        svg = self._gantt.get(key)
        if svg is None:
            topo = await self.sources.topology()
            svg = await asyncio.to_thread(_render_svg, r, topo)
            if len(self._gantt) > 64:
                self._gantt.clear()
            self._gantt[key] = svg
        return web.Response(text=svg, content_type="image/svg+xml")

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        r = await self._visible(request)
        try:
            n = int(request.query.get("bytes", LOG_TAIL_BYTES))
        except ValueError:
            raise ValidationError("bytes", "must be an integer", request.query.get("bytes")) from None
        if not 0 < n <= 1024 * 1024:
            raise ValidationError("bytes", "must be in 1..1048576", n)
        parts = await self.sources.logs(r.id, n)
        return web.json_response({"job": r.id, "files": [{"label": label, "text": text} for label, text in parts]})


def _render_svg(r: JobRecord, topo: Topology) -> str:
    from spiderflow.viz.gantt import render_gantt

    assert r.plan is not None
    missing = {s.cluster for s in r.plan.stages} - {c.name for c in topo.clusters}
    if missing:
        raise NotFoundError(f"the clusters {', '.join(sorted(missing))} of this plan are gone from the topology")
    with tempfile.TemporaryDirectory() as d:
        path = render_gantt(r.plan, topo, r.spec, Path(d) / "gantt.svg")
        return path.read_text(encoding="utf-8")


@dataclass(kw_only=True)
class StartedDashboard:
    """A running dashboard: its ``url`` and how to stop it."""

    runner: web.AppRunner
    url: str

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.runner.cleanup()


async def start_dashboard(server: DashboardServer, host: str, port: int, *,
                          ssl_context: ssl.SSLContext | None = None) -> StartedDashboard:
    """Serve ``server`` on ``host:port`` (0: any free port); returns its URL."""
    runner = web.AppRunner(server.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    shown = f"[{host}]" if ":" in host else host
    url = f"{'https' if ssl_context else 'http'}://{shown}:{bound}/"
    log.info("dashboard.serving", url=url, authenticated=server.authenticator is not None)
    return StartedDashboard(runner=runner, url=url)


