"""``spiderflow serve planner``: run the stateless Planner service."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import structlog

from services.planner.service import DEFAULT_POLICY, PlannerService
from spiderflow.core.kernels import warm
from spiderflow.core.placement.common import LEVEL2_CHOICES
from spiderflow.metrics import RpcMetricsInterceptor, add_metrics_argument, start_metrics_server
from spiderflow.rpc.server import serve
from spiderflow.runtime import parse_hostport, write_ready_file
from spiderflow.security.tls import add_server_arguments, server_security

__all__ = ["add_arguments", "run"]

log = structlog.get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--default-policy", default=DEFAULT_POLICY, help="policy when a request names none")
    p.add_argument("--level2", choices=LEVEL2_CHOICES, default="exact",
                   help="TPA's solver for the blocks of a plan: the exact optimum (default) or the CP-SAT model")
    add_server_arguments(p)
    add_metrics_argument(p)


async def run(args: argparse.Namespace, stop: asyncio.Event) -> None:
    host, port = parse_hostport(args.listen, field="--listen")
    security = server_security(args, host=host)
    metrics = start_metrics_server(args.metrics_listen)
    warm()  # load the compiled kernels before the first request
    server = await serve([PlannerService(default_policy=args.default_policy, level2=args.level2)], host=host, port=port,
                         credentials=security.credentials,
                         interceptors=[RpcMetricsInterceptor(), *security.interceptors])
    write_ready_file(Path(args.ready_file) if args.ready_file else None, address=server.address,
                     metrics=metrics.address if metrics else None)
    log.info("planner.serving", address=server.address, security=security.mode)
    await stop.wait()
    await server.stop(grace_s=5)
    if metrics:
        metrics.close()
