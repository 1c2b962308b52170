"""``spiderflow certs init``: a development CA and one certificate bundle per component.

    spiderflow certs init --dir certs --cluster virginia --cluster ohio --tenant alice --tenant bob

writes ``certs/ca/`` and the bundles ``scheduler``, ``planner``, ``topology``, ``agent-<cluster>``,
``tenant-<tenant>`` and ``admin`` (layout: :mod:`spiderflow.security.certs`), and under a separate etcd CA
(``certs/etcd-ca/``) the bundles ``etcd-server`` (etcd's ``--cert-file``/``--key-file``/``--trusted-ca-file``)
and ``etcd-client`` (``--etcd-tls-dir`` of services and agents). Point a service at its bundle with
``--tls-dir certs/scheduler`` and a client with ``--tls-dir certs/tenant-alice`` (or ``SPIDERFLOW_TLS_DIR``).
Running it again reuses the CAs and adds only missing bundles; ``--no-etcd`` skips the etcd bundles.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from spiderflow.cli.common import add_json_flag, console, print_json
from spiderflow.security.certs import init_certs

__all__ = ["register"]


def _init(args: argparse.Namespace) -> int:
    bundles = init_certs(Path(args.dir), clusters=args.cluster or [], tenants=args.tenant or [],
                         hosts=args.host or [], etcd=not args.no_etcd, force=args.force)
    if args.json:
        print_json({"dir": str(args.dir), "bundles": [
            {"path": str(b.path), "principal": str(b.principal) if b.principal else None, "subject": b.subject}
            for b in bundles]})
        return 0
    for b in bundles:
        console.print(f"{b.path}  [dim]{b.principal or b.subject}[/dim]")
    if not bundles:
        console.print(f"nothing to do: every bundle exists in {args.dir} (--force re-issues)")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("certs", help="development certificates for mTLS")
    csub = p.add_subparsers(dest="certs_command", metavar="ACTION", required=True)
    i = csub.add_parser("init", help="create a dev CA and per-component certificate bundles")
    i.add_argument("--dir", default="certs", help="output directory (default: ./certs)")
    i.add_argument("--cluster", action="append", metavar="NAME", help="an agent bundle for this cluster")
    i.add_argument("--tenant", action="append", metavar="NAME", help="a client bundle for this tenant")
    i.add_argument("--host", action="append", metavar="NAME",
                   help="an extra DNS name or IP every certificate is valid for (e.g. a compose service)")
    i.add_argument("--no-etcd", action="store_true",
                   help="skip the etcd CA and the etcd-server/etcd-client bundles")
    i.add_argument("--force", action="store_true", help="re-issue bundles that exist")
    add_json_flag(i)
    i.set_defaults(func=_init)
