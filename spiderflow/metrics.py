"""Prometheus metrics of every SpiderFlow process, and the ``/metrics`` HTTP endpoint that serves them.

Every service (``spiderflow serve topology|scheduler|planner``) and every agent takes
``--metrics-listen HOST:PORT`` (port 0 = any free port; default: no endpoint) and then serves the
Prometheus text format on ``http://HOST:PORT/metrics``; the bound address is written into the ready file
as ``"metrics"``. Metrics live in one process-wide registry, :data:`REGISTRY`:

==============================================  =========  ===================================================
name                                            type       labels / meaning
==============================================  =========  ===================================================
``spiderflow_rpc_requests_total``               counter    ``service``, ``method``, ``code`` (gRPC status name)
``spiderflow_rpc_duration_seconds``             histogram  ``service``, ``method``, ``code``: handler wall time
                                                           (a stream: until it ends)
``spiderflow_scheduler_queue_length``           gauge      jobs still queued after the leader's last cycle
``spiderflow_scheduler_placements_total``       counter    jobs placed (bound) by the leader
``spiderflow_scheduler_decisions_total``        counter    ``kind``: placed, unschedulable, deferred, ...
``spiderflow_scheduler_decision_seconds``       histogram  ``kind``: wall time of one placement decision
                                                           (policy + final plan), decisions that ran a policy
``spiderflow_scheduler_cycles_total``           counter    scheduling cycles run
``spiderflow_planner_plan_seconds``             histogram  ``strategy`` (chain, policy), ``outcome`` (planned,
                                                           unschedulable): planning wall time of Plan
``spiderflow_agent_probe_bandwidth_gbps``       gauge      ``cluster``, ``peer``: last bulk-probe bandwidth
``spiderflow_agent_probe_latency_ms``           gauge      ``cluster``, ``peer``: last one-way latency
``spiderflow_agent_probes_total``               counter    ``cluster``, ``peer``, ``result`` (ok, failed)
==============================================  =========  ===================================================

plus the process collector's ``process_*`` series. RPC metrics come from :class:`RpcMetricsInterceptor`,
a ``grpc.aio`` server interceptor each service passes to :func:`spiderflow.rpc.server.serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from spiderflow.runtime import parse_hostport

__all__ = [
    "AGENT_PROBES",
    "AGENT_PROBE_BANDWIDTH",
    "AGENT_PROBE_LATENCY",
    "PLANNER_PLAN_SECONDS",
    "REGISTRY",
    "RPC_DURATION",
    "RPC_REQUESTS",
    "SCHEDULER_CYCLES",
    "SCHEDULER_DECISIONS",
    "SCHEDULER_DECISION_SECONDS",
    "SCHEDULER_PLACEMENTS",
    "SCHEDULER_QUEUE_LENGTH",
    "MetricsServer",
    "RpcMetricsInterceptor",
    "add_metrics_argument",
    "observe_cycle",
    "observe_plan",
    "observe_probe",
    "start_metrics_server",
]

log = structlog.get_logger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
"""The registry every SpiderFlow metric is registered in (and the only one the endpoint serves)."""
ProcessCollector(registry=REGISTRY)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0)
_SOLVER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

RPC_REQUESTS = Counter("spiderflow_rpc_requests", "RPCs handled, by method and status code",
                       ("service", "method", "code"), registry=REGISTRY)
RPC_DURATION = Histogram("spiderflow_rpc_duration_seconds", "RPC handler wall time, by method and status code",
                         ("service", "method", "code"), buckets=_LATENCY_BUCKETS, registry=REGISTRY)
SCHEDULER_QUEUE_LENGTH = Gauge("spiderflow_scheduler_queue_length",
                               "Jobs still queued (pending or rescheduling) after the leader's last cycle",
                               registry=REGISTRY)
SCHEDULER_PLACEMENTS = Counter("spiderflow_scheduler_placements", "Jobs placed (bound) by the leader",
                               registry=REGISTRY)
SCHEDULER_DECISIONS = Counter("spiderflow_scheduler_decisions", "Placement decisions, by kind", ("kind",),
                              registry=REGISTRY)
SCHEDULER_DECISION_SECONDS = Histogram("spiderflow_scheduler_decision_seconds",
                                       "Wall time of one placement decision (policy and final plan), by kind",
                                       ("kind",), buckets=_SOLVER_BUCKETS, registry=REGISTRY)
SCHEDULER_CYCLES = Counter("spiderflow_scheduler_cycles", "Scheduling cycles run by the leader", registry=REGISTRY)
PLANNER_PLAN_SECONDS = Histogram("spiderflow_planner_plan_seconds", "Planning wall time of Plan requests",
                                 ("strategy", "outcome"), buckets=_SOLVER_BUCKETS, registry=REGISTRY)
AGENT_PROBE_BANDWIDTH = Gauge("spiderflow_agent_probe_bandwidth_gbps", "Last bulk-probe bandwidth to a peer, Gbit/s",
                              ("cluster", "peer"), registry=REGISTRY)
AGENT_PROBE_LATENCY = Gauge("spiderflow_agent_probe_latency_ms", "Last probed one-way latency to a peer, ms",
                            ("cluster", "peer"), registry=REGISTRY)
AGENT_PROBES = Counter("spiderflow_agent_probes", "Probes of a peer, by result", ("cluster", "peer", "result"),
                       registry=REGISTRY)


# ----------------------------------------------------------------------------- recording helpers
def observe_cycle(decisions: Iterable[Any], *, queued: int) -> None:
    """Record one scheduling cycle: its decisions (``kind`` and ``seconds`` attributes, as
    :class:`services.scheduler.cycle.Decision`) and the number of jobs still queued after it."""
    SCHEDULER_CYCLES.inc()
    counts: dict[str, int] = {}
    for d in decisions:
        kind = str(d.kind)
        counts[kind] = counts.get(kind, 0) + 1
        if d.seconds > 0:  # a policy ran (decisions made without one take no time)
            SCHEDULER_DECISION_SECONDS.labels(kind=kind).observe(d.seconds)
    for kind, n in counts.items():  # one series lookup per kind, not per decision (a queue of 10^4 jobs)
        SCHEDULER_DECISIONS.labels(kind=kind).inc(n)
    placed = counts.get("placed", 0)
    SCHEDULER_PLACEMENTS.inc(placed)
    SCHEDULER_QUEUE_LENGTH.set(max(0, queued - placed))


def observe_plan(seconds: float, *, strategy: str, ok: bool) -> None:
    """Record the planning time of one Plan request."""
    PLANNER_PLAN_SECONDS.labels(strategy=strategy, outcome="planned" if ok else "unschedulable").observe(seconds)


def observe_probe(cluster: str, peer: str, *, latency_ms: float | None, bandwidth_gbps: float | None) -> None:
    """Record one probe of ``peer`` (``latency_ms`` None: the probe failed)."""
    if latency_ms is None:
        AGENT_PROBES.labels(cluster=cluster, peer=peer, result="failed").inc()
        return
    AGENT_PROBES.labels(cluster=cluster, peer=peer, result="ok").inc()
    AGENT_PROBE_LATENCY.labels(cluster=cluster, peer=peer).set(latency_ms)
    if bandwidth_gbps:
        AGENT_PROBE_BANDWIDTH.labels(cluster=cluster, peer=peer).set(bandwidth_gbps)


# ----------------------------------------------------------------------------- RPC interceptor
_CODES = {c.value[0]: c for c in grpc.StatusCode}
Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _split(method: str) -> tuple[str, str]:
    """``/pkg.Service/Method`` → (``pkg.Service``, ``Method``)."""
    service, _, name = method.lstrip("/").rpartition("/")
    return service or "unknown", name or method


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    raw: Any = None
    with contextlib.suppress(Exception):
        raw = context.code()
    if isinstance(raw, int) and not isinstance(raw, grpc.StatusCode):
        raw = _CODES.get(raw)
    if isinstance(raw, grpc.StatusCode):
        return str(raw.name)
    if error is None:
        return "OK"
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    return "UNKNOWN"


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts every RPC and times its handler, by service, method and final status code.

    Put it first in the interceptor list so calls refused by later interceptors (authentication) are
    counted with their code too.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        import time

        self._clock = clock or time.perf_counter
        # the labelled series of each (method, code), looked up once: only served methods reach here (the
        # server answers unknown ones before the interceptors), so this stays small
        self._series: dict[tuple[str, str], tuple[Any, Any]] = {}

    def now(self) -> float:
        """The clock calls are timed with (seconds)."""
        return self._clock()

    def record(self, method: str, context: grpc.aio.ServicerContext, error: BaseException | None,
               started: float) -> None:
        """Count one finished call of ``method`` (``/pkg.Service/Method``) with its final code (from
        ``context``, else from ``error``) and its time since ``started`` (:meth:`now`)."""
        code = _code(context, error)
        series = self._series.get((method, code))
        if series is None:
            service, name = _split(method)
            series = self._series[(method, code)] = (RPC_REQUESTS.labels(service=service, method=name, code=code),
                                                     RPC_DURATION.labels(service=service, method=name, code=code))
        series[0].inc()
        series[1].observe(self._clock() - started)

    def _unary(self, method: str, behavior: Behavior) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, error = self._clock(), None
            try:
                return await behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self.record(method, context, error, started)

        return call

    def _stream(self, method: str, behavior: Behavior) -> Behavior:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started, error = self._clock(), None
            try:
                result = behavior(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:
                    await result
            except BaseException as e:
                error = e
                raise
            finally:
                self.record(method, context, error, started)

        return call

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._stream(method, handler.unary_stream), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._unary(method, handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(method, handler.stream_stream), **kw)


# ----------------------------------------------------------------------------- HTTP endpoint
@dataclass(kw_only=True)
class MetricsServer:
    """A running ``/metrics`` endpoint (a daemon thread); :meth:`close` stops it."""

    host: str
    port: int
    _httpd: Any

    @property
    def address(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._httpd.shutdown()
            self._httpd.server_close()


def start_metrics_server(listen: str | None, *, field: str = "--metrics-listen") -> MetricsServer | None:
    """Serve :data:`REGISTRY` on ``http://listen/metrics`` (``host:port``, port 0 = any free port); None
    when ``listen`` is None or empty. Raises ``ValidationError`` naming ``field`` for a malformed address
    and ``OSError`` when it cannot be bound."""
    if not listen:
        return None
    host, port = parse_hostport(listen, field=field)
    httpd, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    server = MetricsServer(host=host, port=int(httpd.server_port), _httpd=httpd)
    log.info("metrics.serving", url=server.url)
    return server


def add_metrics_argument(p: argparse.ArgumentParser) -> None:
    """``--metrics-listen HOST:PORT`` (default: no metrics endpoint)."""
    p.add_argument("--metrics-listen", metavar="HOST:PORT", default=None,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0 = any free port; "
                        "default: off)")
