"""``spiderflow serve SERVICE``: run one SpiderFlow service in the foreground (what compose and
``spiderflow up`` start). Stops gracefully on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from spiderflow.runtime import configure_logging, run_until_signalled

__all__ = ["LOAD_SERVICES", "ONLY_SERVICE", "SERVICES", "register"]

SERVICES: dict[str, tuple[str, str]] = {
    "planner": ("services.planner.main", "the stateless TPA planner (Plan, Estimate)"),
    "scheduler": ("services.scheduler.main", "the job API and the leader-elected SpinSearch scheduler"),
    "topology": ("services.topology.main", "the live cluster graph built from agent reports"),
}


def _run(args: argparse.Namespace) -> int:
    configure_logging(json_logs=True if args.log_format == "json" else None if args.log_format == "auto" else False)
    module: Any = importlib.import_module(SERVICES[args.service][0])
    return run_until_signalled(lambda stop: module.run(args, stop))


LOAD_SERVICES = True
"""Whether :func:`register` imports the services to add their options; the ``spiderflow`` entry point turns it
off unless the command is ``serve`` (or ``completion``): the services load the placement code and its
compiled kernels, which every other command would otherwise pay for at start."""


ONLY_SERVICE: str | None = None
"""When set (by the entry point, for ``spiderflow serve SERVICE``), :func:`register` imports only that service;
the others get a parser without their options (a service's imports are seconds of start-up)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run a SpiderFlow service (planner, scheduler, topology)",
                       epilog="example: spiderflow serve planner --listen 127.0.0.1:50053")
    ssub = p.add_subparsers(dest="service", metavar="SERVICE", required=True)
    if not LOAD_SERVICES:
        for name, (_, help_text) in SERVICES.items():
            ssub.add_parser(name, help=help_text)
        return
    for name, (modname, help_text) in SERVICES.items():
        if ONLY_SERVICE is not None and name != ONLY_SERVICE:
            ssub.add_parser(name, help=help_text)
            continue
        try:
            module: Any = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            continue
        sp = ssub.add_parser(name, help=help_text)
        sp.add_argument("--listen", default="127.0.0.1:0", help="host:port to serve gRPC on (port 0 = any free)")
        sp.add_argument("--ready-file", help="write {address, pid} as JSON here once serving")
        sp.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
        module.add_arguments(sp)
        sp.set_defaults(func=_run)
