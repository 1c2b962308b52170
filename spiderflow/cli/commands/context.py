"""``spiderflow context list|use|show``: the named endpoints of the config file (see
:mod:`spiderflow.contexts`). ``spiderflow up`` adds one for its mesh and removes it when the mesh stops."""

from __future__ import annotations

import argparse

from spiderflow.cli.common import add_json_flag, console, fit_table, print_json
from spiderflow.contexts import config_path, is_stale, list_contexts, resolve_endpoint, use_context
from spiderflow.core.errors import NotFoundError

__all__ = ["register"]


def _list(args: argparse.Namespace) -> int:
    contexts, current = list_contexts()
    if args.json:
        print_json({"current": current, "contexts": contexts, "file": str(config_path())})
        return 0
    rows = [("*" if name == current else "", name, str(c.get("scheduler", "-")), str(c.get("dashboard", "-")),
             "stale" if is_stale(c) else ("up" if "owner_pid" in c else "-"))
            for name, c in sorted(contexts.items())]
    console.print(fit_table(f"{len(rows)} context(s) in {config_path()}",
                            ["CUR", "NAME", "SCHEDULER", "DASHBOARD", "MESH"], rows, keep=("CUR", "NAME", "SCHEDULER")))
    if not rows:
        console.print("no contexts: `spiderflow up --keep` adds one for its mesh", soft_wrap=True)
    return 0


def _use(args: argparse.Namespace) -> int:
    use_context(args.name)
    console.print(f"now using context {args.name} (scheduler {resolve_endpoint('scheduler').address})",
                  soft_wrap=True)
    return 0


def _show(args: argparse.Namespace) -> int:
    contexts, current = list_contexts()
    name = args.name or current
    doc: dict[str, object]
    if name is None:
        doc = {"name": None}
    elif name not in contexts:
        raise NotFoundError(f"context {name!r} is not in {config_path()} (spiderflow context list)")
    else:
        doc = {"name": name, **{k: v for k, v in contexts[name].items() if k != "token"}}
        if "token" in contexts[name]:
            doc["token"] = "<hidden>"
    if args.name is None:  # what a command would use now, with where each address comes from
        doc["resolved"] = {s: {"address": e.address, "source": e.source}
                           for s in ("scheduler", "topology", "planner") for e in [resolve_endpoint(s)]}  # type: ignore[arg-type]
    if args.json:
        print_json(doc)
        return 0
    rows = [(k, str(v)) for k, v in doc.items() if k != "resolved"]
    for s, r in dict(doc.get("resolved") or {}).items():  # type: ignore[call-overload]
        rows.append((f"{s} (in use)", f"{r['address']} ({r['source']})"))
    console.print(fit_table(None, ["KEY", "VALUE"], rows, keep=("KEY", "VALUE"), fold=("VALUE",), show_header=False))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("context", help="list, use or show the named endpoints (contexts) of the config file",
                       description="Contexts name a mesh's endpoints (scheduler, topology, planner, dashboard, "
                                   "TLS bundle). `spiderflow up` adds one and removes it when it stops.",
                       epilog="example: spiderflow context use local")
    csub = p.add_subparsers(dest="context_command", metavar="ACTION", required=True)
    c = csub.add_parser("list", help="every context (* marks the current one)",
                        epilog="example: spiderflow context list")
    add_json_flag(c)
    c.set_defaults(func=_list)
    c = csub.add_parser("use", help="make a context the current one", epilog="example: spiderflow context use prod")
    c.add_argument("name", metavar="NAME", help="context name (spiderflow context list)")
    c.set_defaults(func=_use)
    c = csub.add_parser("show", help="one context's settings (default: the current one, with the addresses "
                                     "commands resolve now)", epilog="example: spiderflow context show")
    c.add_argument("name", metavar="NAME", nargs="?", default=None, help="context name (default: the current one)")
    add_json_flag(c)
    c.set_defaults(func=_show)
