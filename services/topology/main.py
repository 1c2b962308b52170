"""``spiderflow serve topology``: run the stateless Topology service over etcd.

Options (besides ``--listen``/``--ready-file`` from ``spiderflow serve``): ``--etcd HOST:PORT`` (default
``$SPIDERFLOW_ETCD`` or ``127.0.0.1:2379``), ``--link-max-age S`` (links not re-measured for this long
leave the graph; default 60), ``--gc-interval S`` (how often stale link records are deleted; default a
quarter of the max age), ``--ewma-alpha``, ``--outlier-ratio``, ``--latency-floor-ms``,
``--shift-after`` (smoothing, see :mod:`services.topology.smoothing`); ``--tls-dir`` / ``--insecure`` /
``--tokens`` (:mod:`spiderflow.security.tls`); ``--etcd-user`` / ``--etcd-tls-dir`` (etcd authentication and
TLS, same module). With ``--tls-dir`` or ``--tokens`` the caller of ReportProfile/ReportLinks is the cluster of
its authenticated ``agent`` principal (certificate or bearer token;
:func:`services.topology.identity.caller_from_principal`); without either, the ``agent_id`` it sends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path

import structlog

from services.topology.graph import GraphConfig
from services.topology.identity import caller_from_principal, caller_from_request
from services.topology.repo import TopologyRepo
from services.topology.service import TopologyService
from services.topology.smoothing import SmoothingConfig
from spiderflow.core.errors import SpiderFlowError
from spiderflow.metrics import RpcMetricsInterceptor, add_metrics_argument, start_metrics_server
from spiderflow.rpc.server import serve
from spiderflow.runtime import parse_hostport, write_ready_file
from spiderflow.security.tls import add_etcd_arguments, add_server_arguments, etcd_options, server_security

__all__ = ["add_arguments", "graph_config", "run"]

log = structlog.get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=os.environ.get("SPIDERFLOW_ETCD", "127.0.0.1:2379"),
                   help="etcd endpoint host:port (default $SPIDERFLOW_ETCD or 127.0.0.1:2379)")
    p.add_argument("--link-max-age", type=float, default=60.0, metavar="S",
                   help="links not re-measured for S seconds leave the graph (default 60)")
    p.add_argument("--gc-interval", type=float, default=None, metavar="S",
                   help="delete stale link records every S seconds (default: max age / 4)")
    p.add_argument("--ewma-alpha", type=float, default=0.5, help="EWMA weight of a new link sample")
    p.add_argument("--outlier-ratio", type=float, default=2.0,
                   help="a sample beyond this factor of the smoothed value is an outlier")
    p.add_argument("--latency-floor-ms", type=float, default=5.0,
                   help="latency changes below this many ms are never outliers")
    p.add_argument("--shift-after", type=int, default=2,
                   help="consecutive agreeing outliers taken as a real change")
    add_metrics_argument(p)
    add_server_arguments(p)
    add_etcd_arguments(p)


def graph_config(args: argparse.Namespace) -> GraphConfig:
    """The :class:`GraphConfig` of the parsed options."""
    return GraphConfig(
        bandwidth=SmoothingConfig(alpha=args.ewma_alpha, outlier_ratio=args.outlier_ratio,
                                  shift_after=args.shift_after),
        latency=SmoothingConfig(alpha=args.ewma_alpha, outlier_ratio=args.outlier_ratio,
                                outlier_floor=args.latency_floor_ms, shift_after=args.shift_after),
        link_max_age_s=args.link_max_age,
    )


async def _collect(repo: TopologyRepo, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await repo.collect_stale_links()
        except SpiderFlowError as e:
            log.warning("topology.gc_failed", error=str(e))


async def run(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from spiderflow.store.etcd import EtcdStore

    config = graph_config(args)
    host, port = parse_hostport(args.listen, field="--listen")
    parse_hostport(args.etcd, field="--etcd")
    security = server_security(args, host=host)
    store = EtcdStore(args.etcd, **etcd_options(args))
    repo = TopologyRepo(store, config)
    metrics = start_metrics_server(args.metrics_listen)
    identity = caller_from_principal if security.authenticating else caller_from_request
    server = await serve([TopologyService(store, repo, identity=identity)], host=host, port=port,
                         credentials=security.credentials,
                         interceptors=[RpcMetricsInterceptor(), *security.interceptors])
    interval = args.gc_interval if args.gc_interval else max(0.5, config.link_max_age_s / 4)
    gc = asyncio.create_task(_collect(repo, interval), name="topology-gc")
    write_ready_file(Path(args.ready_file) if args.ready_file else None, address=server.address,
                     metrics=metrics.address if metrics else None)
    log.info("topology.serving", address=server.address, etcd=args.etcd, link_max_age_s=config.link_max_age_s,
             security=security.mode)
    try:
        await stop.wait()
    finally:
        gc.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gc
        await server.stop(grace_s=2)
        await store.close()
        if metrics:
            metrics.close()
