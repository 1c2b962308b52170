"""``spiderflow topology``: validate, generate and show cluster topologies."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from spiderflow.cli.common import EXIT_USAGE, CliError, add_json_flag, console, print_json
from spiderflow.domain import Topology
from spiderflow.formats import load_topology, topology_to_dict

__all__ = ["register", "summarize"]


def summarize(topo: Topology) -> dict[str, Any]:
    """Counts a person checks first: clusters, GPUs by type (total and free), links, components."""
    by_type: Counter[str] = Counter()
    free_by_type: Counter[str] = Counter()
    for c in topo.clusters:
        by_type[c.gpu] += c.total_gpus
        free_by_type[c.gpu] += c.free
    comps = topo.components()
    bws = [link.bandwidth_gbps for link in topo.links]
    lats = [link.latency_ms for link in topo.links]
    return {
        "clusters": len(topo.clusters),
        "gpus": sum(by_type.values()),
        "free_gpus": sum(free_by_type.values()),
        "gpus_by_type": dict(sorted(by_type.items())),
        "free_gpus_by_type": dict(sorted(free_by_type.items())),
        "links": len(topo.links),
        "bandwidth_gbps": {"min": min(bws), "max": max(bws)} if bws else None,
        "latency_ms": {"min": min(lats), "max": max(lats)} if lats else None,
        "components": len(comps),
        "component_sizes": [len(c) for c in comps],
    }


def _validate(args: argparse.Namespace) -> int:
    topo = load_topology(args.file)
    summary = summarize(topo)
    if args.json:
        print_json(summary)
        return 0
    table = Table(title=f"{args.file}: valid topology", show_header=False)
    table.add_row("clusters", str(summary["clusters"]))
    table.add_row("GPUs (free / total)", f"{summary['free_gpus']} / {summary['gpus']}")
    for gpu, n in summary["gpus_by_type"].items():
        table.add_row(f"  {gpu}", f"{summary['free_gpus_by_type'][gpu]} / {n}")
    table.add_row("links", str(summary["links"]))
    if summary["bandwidth_gbps"]:
        table.add_row("bandwidth (Gbit/s)", "{min:g} – {max:g}".format(**summary["bandwidth_gbps"]))
        table.add_row("latency (ms)", "{min:g} – {max:g}".format(**summary["latency_ms"]))
    table.add_row("connected components", f"{summary['components']} (sizes {summary['component_sizes']})")
    console.print(table)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from spiderflow.topogen import generate_topology

    if args.clusters < 1 or args.clusters > 4096:
        raise CliError("--clusters: must be between 1 and 4096", EXIT_USAGE)
    topo = generate_topology(args.clusters, args.seed, args.kind)
    doc = topology_to_dict(topo)
    out: Path | None = args.out
    if out is None:
        print(json.dumps(doc, indent=2))
        return 0
    text = yaml.safe_dump(doc, sort_keys=False) if out.suffix in {".yaml", ".yml"} else json.dumps(doc, indent=2)
    out.write_text(text + ("\n" if not text.endswith("\n") else ""), encoding="utf-8")
    console.print(f"wrote {out}: {len(topo.clusters)} clusters, {len(topo.links)} links")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("topology", help="validate, generate or show cluster topologies")
    tsub = p.add_subparsers(dest="topology_command", metavar="ACTION", required=True)

    v = tsub.add_parser("validate", help="check a topology file and print a summary")
    v.add_argument("file", type=Path)
    add_json_flag(v)
    v.set_defaults(func=_validate)

    g = tsub.add_parser("generate", help="write a synthetic multi-region topology")
    g.add_argument("--clusters", type=int, required=True, help="number of clusters")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kind", choices=["geo", "hub", "mesh"], default="geo")
    g.add_argument("--out", type=Path, help="output file (.json or .yaml); stdout when omitted")
    g.set_defaults(func=_generate)
