"""``spiderflow agent``: run a cluster's agent in the foreground (stops on SIGINT/SIGTERM, deregistering;
``SIGHUP`` re-measures the devices at the next idle moment and reports the new figures).

::

    spiderflow agent --cluster virginia --topology-service HOST:PORT --scheduler HOST:PORT[,HOST:PORT...] \\
        [--config FILE] [--listen HOST:PORT] [--advertise HOST:PORT] [--ready-file FILE] [--tls-dir DIR] \\
        [--token TOKEN] \\
        [--gpu TYPE --nodes N --gpus-per-node G [--tflops T] [--memory-gib M]] [--free-gpus F] \\
        [--electricity P] [--region R] [--lease-ttl S] [--probe-period S] [--probe-bytes B] ...

``--topology-service`` defaults to ``$SPIDERFLOW_TOPOLOGY``, ``--scheduler`` (the control plane: every scheduler
replica, comma-separated; the agent's registration, assignments, rendezvous, checkpoints and reports go through
it, and the agent holds no etcd credentials) to ``$SPIDERFLOW_SCHEDULER``. ``--etcd`` (``$SPIDERFLOW_ETCD``) is
development-only, for an agent without ``--scheduler`` that measures and reports its cluster but runs no stages,
and is refused together with ``--scheduler``;
``--listen`` to ``$SPIDERFLOW_TESTBED_ADDRESS:0`` inside a testbed namespace (else 127.0.0.1:0),
``--etcd-tls-dir`` to ``$SPIDERFLOW_ETCD_TLS_DIR``, ``--etcd-user`` to ``$SPIDERFLOW_ETCD_USER`` (the password
only from ``$SPIDERFLOW_ETCD_PASSWORD``) and ``--token`` to ``$SPIDERFLOW_TOKEN`` (prefer the environment:
a command line is visible to every local user in ``ps``). Flags
override the ``--config`` file (format in :mod:`agent.config`). ``--ready-file`` receives
``{"address", "pid", "agent_id"}`` as JSON once the Agent service serves. When the topology service
refuses the agent's identity (UNAUTHENTICATED / PERMISSION_DENIED) the agent logs ``agent.refused``,
deregisters, stops and exits with code 5 (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from spiderflow.runtime import configure_logging, run_until_signalled, write_ready_file
from spiderflow.security.tls import ENV_TOKEN, add_etcd_arguments

__all__ = ["register"]


def _config(args: argparse.Namespace) -> Any:
    from agent.config import load_config

    overrides: dict[str, Any] = {
        "cluster": args.cluster, "topology_service": args.topology_service, "etcd": args.etcd,
        "scheduler": args.scheduler, "work_dir": args.work_dir, "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every": args.checkpoint_every, "log_retention_days": args.log_retention_days,
        "listen": args.listen, "advertise": args.advertise, "tls_dir": args.tls_dir, "agent_id": args.agent_id,
        "etcd_tls_dir": args.etcd_tls_dir, "etcd_user": args.etcd_user, "token": args.token,
        "lease_ttl_s": args.lease_ttl, "profile_interval_s": args.profile_interval,
        "profile_seconds": args.profile_seconds, "recalibrate_interval_s": args.recalibrate_interval,
        "free_gpus": args.free_gpus,
        "electricity_usd_per_kwh": args.electricity, "region": args.region,
        "intra_node_gbps": args.intra_node_gbps, "inter_node_gbps": args.inter_node_gbps,
        "gpus": {"gpu": args.gpu, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "tflops": args.tflops,
                 "memory_gib": args.memory_gib},
        "probe": {"period_s": args.probe_period, "bulk_bytes": args.probe_bytes, "bulk_max_s": args.probe_max_s,
                  "echo_count": args.probe_echoes, "chunk_bytes": args.probe_chunk_bytes,
                  "timeout_s": args.probe_timeout, "busy_mode": args.busy_mode},
    }
    if args.gpu is None and any(v is not None for v in overrides["gpus"].values()):
        from spiderflow.core.errors import ValidationError

        raise ValidationError("--gpu", "is required with --nodes/--gpus-per-node/--tflops/--memory-gib")
    return load_config(args.config, overrides)


async def _start_gateway(config: Any, stop: asyncio.Event) -> asyncio.Future[None]:
    """Start the cluster's gateway beside the agent (``gateway.enabled``); the returned future supervises it
    until ``stop`` and then stops it."""
    from agent.config import work_dir_of
    from spiderflow.gateway.process import GatewayProcess

    gateway = GatewayProcess(cluster=config.cluster, config=config.gateway,
                             tls_dir=config.gateway.tls_dir or str(config.tls_dir), work_dir=work_dir_of(config))
    await gateway.start()
    return asyncio.ensure_future(gateway.supervise(stop))


def _run(args: argparse.Namespace) -> int:
    configure_logging(json_logs=True if args.log_format == "json" else None if args.log_format == "auto" else False)
    config = _config(args)  # validation errors surface before anything starts
    from agent.config import etcd_options

    if config.etcd is not None:  # development-only direct etcd: a missing bundle file or password too
        etcd_options(config)

    async def main(stop: asyncio.Event) -> None:
        from agent.agent import Agent
        from spiderflow.metrics import start_metrics_server

        metrics = start_metrics_server(args.metrics_listen)
        gateway: asyncio.Future[None] | None = None
        try:
            if config.gateway is not None and config.gateway.enabled:  # first: peers' probes may cross it
                gateway = await _start_gateway(config, stop)
            agent = Agent(config)
            # from now on SIGHUP re-measures instead of stopping the process (one made while the agent
            # measures at start is answered by that measurement)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, agent.request_recalibration)
            await agent.start()
            write_ready_file(Path(args.ready_file) if args.ready_file else None, address=agent.address,
                             agent_id=agent.agent_id, metrics=metrics.address if metrics else None)
            if config.scheduler is None:
                await agent.run(stop)
            else:
                from agent.executor import executor_for

                executor = executor_for(config, agent.address, on_busy=agent.set_busy, workers=agent.workers)
                await asyncio.gather(agent.run(stop), executor.run(stop))
        finally:
            if metrics:
                metrics.close()
            if gateway is not None:
                stop.set()
                await gateway
        if agent.refused is not None:
            raise agent.refused

    return run_until_signalled(main)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="run a cluster's agent (registers, profiles, probes peers, reports)")
    p.add_argument("--cluster", help="this cluster's name")
    p.add_argument("--topology-service", default=os.environ.get("SPIDERFLOW_TOPOLOGY"), metavar="ADDR",
                   help="topology service host:port (default $SPIDERFLOW_TOPOLOGY)")
    p.add_argument("--scheduler", default=os.environ.get("SPIDERFLOW_SCHEDULER"), metavar="ADDR",
                   help="the control plane: every scheduler replica host:port, comma-separated (default "
                        "$SPIDERFLOW_SCHEDULER); the agent holds no etcd credentials")
    p.add_argument("--etcd", default=os.environ.get("SPIDERFLOW_ETCD"), metavar="ADDR",
                   help="DEVELOPMENT ONLY, without --scheduler: an agent that only measures, reading etcd "
                        "directly (default $SPIDERFLOW_ETCD)")
    p.add_argument("--work-dir", help="worker specs and logs of the stages this agent runs (default: a "
                                      "directory under the system temp dir)")
    p.add_argument("--checkpoint-dir", help="checkpoint root, the same path on every agent (default: "
                                            "<work-dir>/checkpoints)")
    p.add_argument("--checkpoint-every", type=int, metavar="K", help="steps between checkpoints (default 10; 0: none)")
    p.add_argument("--log-retention-days", type=float, metavar="D",
                   help="delete a job's workers' logs D days after its last output (default 7; 0: never)")
    p.add_argument("--config", type=Path, help="YAML/JSON agent configuration (flags override it)")
    testbed = os.environ.get("SPIDERFLOW_TESTBED_ADDRESS")
    p.add_argument("--listen", default=f"{testbed}:0" if testbed else None,
                   help="host:port of the Agent service (default $SPIDERFLOW_TESTBED_ADDRESS:0 in a testbed "
                        "namespace, else 127.0.0.1:0; port 0 = any free)")
    p.add_argument("--advertise", help="host:port peers dial (default: the listen address)")
    p.add_argument("--agent-id", help="instance id (default: <cluster>-<random>)")
    p.add_argument("--tls-dir", help="the agent's certificate bundle (spiderflow certs init --cluster NAME): mTLS "
                                     "for its Agent service and its calls to the topology service, scheduler and peers")
    add_etcd_arguments(p)
    p.add_argument("--token", default=os.environ.get(ENV_TOKEN) or None,
                   help=f"bearer token for the topology service and the scheduler (default ${ENV_TOKEN}, "
                        "preferred: a command line shows in ps)")
    p.add_argument("--ready-file", help="write {address, pid, agent_id, metrics} as JSON here once serving")
    p.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (port 0 = any free port; default: off)")
    p.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
    p.add_argument("--lease-ttl", type=int, help="registration lease TTL, seconds (default 8)")
    p.add_argument("--profile-interval", type=float, help="re-send the profile every S seconds (default 30)")
    p.add_argument("--profile-seconds", type=float, help="duration of the timed matmul (default 0.5)")
    p.add_argument("--recalibrate-interval", type=float, metavar="S",
                   help="re-measure the devices every S seconds while idle (default 0: only on SIGHUP)")
    g = p.add_argument_group("declared GPUs (emulated clusters)")
    g.add_argument("--gpu", help="catalog GPU type (e.g. A100-80G, or cpu); default: profile local devices")
    g.add_argument("--nodes", type=int)
    g.add_argument("--gpus-per-node", type=int)
    g.add_argument("--tflops", type=float, help="per-GPU TFLOPS (default: measured for cpu, catalog peak else)")
    g.add_argument("--memory-gib", type=float)
    p.add_argument("--free-gpus", type=int, help="GPUs offered to SpiderFlow (default all)")
    p.add_argument("--electricity", type=float, metavar="USD_PER_KWH")
    p.add_argument("--region", help="free-form region label")
    p.add_argument("--intra-node-gbps", type=float)
    p.add_argument("--inter-node-gbps", type=float)
    pr = p.add_argument_group("probing")
    pr.add_argument("--probe-period", type=float, metavar="S", help="seconds between probe rounds (default 10)")
    pr.add_argument("--probe-bytes", type=int, metavar="B", help="bulk bytes per peer per round (default 4 MiB)")
    pr.add_argument("--probe-max-s", type=float, metavar="S", help="bulk probe duration cap (default 2)")
    pr.add_argument("--probe-echoes", type=int, metavar="N", help="echo round trips per peer (default 5)")
    pr.add_argument("--probe-chunk-bytes", type=int, metavar="B", help="bulk message size (default 256 KiB)")
    pr.add_argument("--probe-timeout", type=float, metavar="S", help="deadline per probe call (default 5)")
    pr.add_argument("--busy-mode", choices=["latency", "pause"], help="probing while training (default latency)")
    p.set_defaults(func=_run)
