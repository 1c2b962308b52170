"""``python -m spiderflow.gateway --config FILE``: run a cluster's gateway in the foreground.

``FILE`` is an agent configuration (YAML/JSON; :mod:`agent.config`) or any mapping with the same keys:
``cluster``, ``tls_dir`` and the ``gateway:`` section (:class:`~spiderflow.gateway.protocol.GatewayConfig`);
other keys are ignored, so the agent's own file serves. ``--cluster`` and ``--tls-dir`` override the file
(``gateway.tls_dir`` wins over the top-level ``tls_dir``). ``--ready-file`` receives ``{"pid", "port",
"redirect_port"}`` once both listeners are bound. SIGTERM/SIGINT stop it. A bad configuration exits with
code 2 and one line naming the field.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spiderflow.core.errors import ValidationError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spiderflow.gateway",
                                     description="a cluster's gateway: cross-cluster TCP over one mTLS port")
    parser.add_argument("--config", required=True, help="agent configuration file with a gateway: section")
    parser.add_argument("--cluster", help="this cluster's name (default: the file's cluster)")
    parser.add_argument("--tls-dir", help="the cluster's agent bundle (default: gateway.tls_dir, else tls_dir)")
    parser.add_argument("--ready-file", help="write {pid, port, redirect_port} as JSON here once serving")
    parser.add_argument("--log-format", choices=["auto", "json", "console"], default="auto")
    args = parser.parse_args(argv)

    from spiderflow.formats import load_document
    from spiderflow.gateway.protocol import gateway_config
    from spiderflow.runtime import configure_logging, run_until_signalled, write_ready_file

    configure_logging(json_logs=True if args.log_format == "json" else None if args.log_format == "auto" else False)
    try:
        doc = load_document(args.config) or {}
        if not isinstance(doc, dict):
            raise ValidationError("config", "must be a mapping", type(doc).__name__)
        config = gateway_config(doc.get("gateway"))
        cluster = args.cluster or doc.get("cluster")
        if not cluster:
            raise ValidationError("cluster", "is required (flag or config file)")
        tls_dir = args.tls_dir or config.tls_dir or doc.get("tls_dir")
        if not tls_dir:
            raise ValidationError("gateway.tls_dir", "is required: the gateway serves mutual TLS only")
        if not config.ranges:
            raise ValidationError("gateway.ranges", "is required: this cluster's address ranges")
        from spiderflow.gateway.server import Gateway

        gateway = Gateway(config, cluster=str(cluster), tls_dir=Path(tls_dir))
    except (ValidationError, OSError) as e:
        print(f"spiderflow gateway: {e}", file=sys.stderr)
        return 2

    async def run(stop: object) -> None:
        import asyncio

        assert isinstance(stop, asyncio.Event)
        await gateway.start()
        write_ready_file(Path(args.ready_file) if args.ready_file else None, port=gateway.port,
                         redirect_port=gateway.redirect_port, cluster=gateway.cluster)
        try:
            await stop.wait()
        finally:
            await gateway.close()

    try:
        return run_until_signalled(run)
    except OSError as e:  # a port already taken
        print(f"spiderflow gateway: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
