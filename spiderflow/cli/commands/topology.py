"""``spiderflow topology``: validate, generate and show cluster topologies.

``show`` reads the live graph from the topology service: ``--topology-service HOST:PORT``, else the
``SPIDERFLOW_TOPOLOGY`` environment variable, else the config file ``spiderflow up`` writes
(:func:`spiderflow.sdk.resolve_address`), else ``127.0.0.1:50052``; with the client TLS directory and token
the other commands use. It prints a table of clusters
(GPU type, GPUs free/total, measured TFLOPS, agent) and links (bandwidth, latency, age); ``--json``
prints the snapshot in the topology file format plus ``"revision"`` (``spiderflow topology validate``
accepts it). ``--png FILE`` draws the cluster map instead of the table: clusters at their lat/lon when
every cluster has them (else a spring layout), links labelled with their bandwidth (both directions when
they differ), line width growing with bandwidth.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from spiderflow.cli.common import EXIT_USAGE, CliError, add_json_flag, console, fit_table, print_json
from spiderflow.core.domain import Topology
from spiderflow.formats import load_topology, topology_to_dict

__all__ = ["DEFAULT_TOPOLOGY_SERVICE", "draw_map", "register", "summarize"]

DEFAULT_TOPOLOGY_SERVICE = "127.0.0.1:50052"


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
    from spiderflow.core.topogen import generate_topology

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


async def _fetch(address: str, timeout: float, *, tls_dir: str | None = None, token: str | None = None) -> Any:
    from spiderflow.contexts import context_value
    from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
    from spiderflow.rpc.errors import domain_errors
    from spiderflow.rpc.server import open_channel
    from spiderflow.security.auth import bearer_metadata
    from spiderflow.security.tls import channel_credentials, client_tls_dir, client_token

    bundle = client_tls_dir(tls_dir)
    if bundle is None and (ctx_dir := context_value("tls_dir")):
        bundle = Path(ctx_dir).expanduser()
    channel = open_channel(address, credentials=channel_credentials(bundle) if bundle is not None else None)
    metadata = bearer_metadata(client_token(token) or context_value("token"))
    try:
        with domain_errors():
            return await topology_pb2_grpc.TopologyStub(channel).GetTopology(
                topology_pb2.GetTopologyRequest(), timeout=timeout, metadata=metadata)
    finally:
        await channel.close()


def _bw_label(gbps: float) -> str:
    return f"{gbps:.3g} Gbit/s" if gbps >= 1 else f"{gbps * 1000:.3g} Mbit/s"


def draw_map(topo: Topology, path: Path, *, title: str = "") -> None:
    """Write a PNG of the cluster map of ``topo`` to ``path`` (matplotlib Agg, no display needed): clusters
    sized by GPUs, links as lines as thick as their bandwidth, each labelled with its bandwidth and latency,
    and a legend that says so. Colours from :mod:`spiderflow.viz.palette`."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from spiderflow.viz import palette

    names = list(topo.names)
    geo = bool(names) and all(c.lat is not None and c.lon is not None for c in topo.clusters)
    pos: dict[str, tuple[float, float]]
    if geo:
        pos = {c.name: (float(c.lon), float(c.lat)) for c in topo.clusters}  # type: ignore[arg-type]
    else:
        import networkx as nx

        g = nx.Graph()
        g.add_nodes_from(names)
        for link in topo.links:
            g.add_edge(link.a, link.b, weight=max(link.bandwidth_gbps, 1e-3))
        pos = {n: (float(x), float(y)) for n, (x, y) in nx.spring_layout(g, seed=0, weight="weight").items()}
    # One line per unordered pair; its label gives both directions when they differ.
    pairs: dict[tuple[str, str], dict[tuple[str, str], float]] = {}
    latency: dict[tuple[str, str], dict[tuple[str, str], float]] = {}
    for (u, v), link in topo.direct.items():
        pairs.setdefault((min(u, v), max(u, v)), {})[(u, v)] = link.bandwidth_gbps
        latency.setdefault((min(u, v), max(u, v)), {})[(u, v)] = link.latency_ms
    bws = [bw for d in pairs.values() for bw in d.values()]
    lo, hi = (min(bws), max(bws)) if bws else (1.0, 1.0)

    fig = Figure(figsize=(9, 6.5), dpi=110)
    ax = fig.add_subplot()
    for (u, v), both in sorted(pairs.items()):
        (x0, y0), (x1, y1) = pos[u], pos[v]
        widest = max(both.values())
        width = 1.0 + 4.0 * (math.log(widest / lo) / math.log(hi / lo) if hi > lo else 1.0)
        ax.plot([x0, x1], [y0, y1], color=palette.LINK, linewidth=width, alpha=0.7, zorder=1)
        fwd, back = both.get((u, v)), both.get((v, u))
        lat = max(latency[(u, v)].values())
        if fwd is not None and back is not None and not math.isclose(fwd, back, rel_tol=0.02):
            label = f"{u}→{v} {_bw_label(fwd)}\n{v}→{u} {_bw_label(back)}\n{lat:.3g} ms"
        else:
            label = _bw_label(widest) + ("" if fwd is not None and back is not None else
                                         f" ({u}→{v})" if fwd is not None else f" ({v}→{u})") + f" · {lat:.3g} ms"
        ax.annotate(label, ((x0 + x1) / 2, (y0 + y1) / 2), ha="center", va="center", fontsize=8, zorder=3,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#c0c0c0", "alpha": 0.9})
    gpus = [c.total_gpus for c in topo.clusters]
    for c in topo.clusters:
        x, y = pos[c.name]
        size = 300 + 900 * (c.total_gpus / max(gpus))
        ax.scatter([x], [y], s=size, color=palette.NODE, edgecolors=palette.NODE_EDGE, zorder=2)
        ax.annotate(f"{c.name}\n{c.free}/{c.total_gpus} {c.gpu}", (x, y), textcoords="offset points",
                    xytext=(0, 16 + size ** 0.5 / 2), ha="center", fontsize=9, zorder=4)
    if not names:
        ax.text(0.5, 0.5, "no clusters", ha="center", va="center", transform=ax.transAxes)
    else:
        from matplotlib.lines import Line2D

        ax.legend(handles=[
            Line2D([], [], marker="o", linestyle="", markersize=12, color=palette.NODE,
                   markeredgecolor=palette.NODE_EDGE, label="cluster: free/total GPUs, GPU type (larger: more GPUs)"),
            Line2D([], [], color=palette.LINK, linewidth=3, alpha=0.7,
                   label="link: bandwidth · latency in ms (thicker: more bandwidth)"),
        ], loc="lower center", bbox_to_anchor=(0.5, -0.02), ncol=1, fontsize=9, frameon=True, framealpha=0.9)
    ax.set_title(title or f"{len(names)} clusters, {len(topo.direct)} directed links")
    if geo:
        ax.set_xlabel("longitude")
        ax.set_ylabel("latitude")
    else:
        ax.set_axis_off()
    ax.margins(0.18)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _age(now: float, ts: Any) -> str:
    seconds = max(0.0, now - ts.ToNanoseconds() / 1e9)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _show(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from spiderflow.rpc import convert
    from spiderflow.runtime import parse_hostport
    from spiderflow.sdk import resolve_address

    address = resolve_address("topology", args.topology_service)
    parse_hostport(address, field="--address")
    from spiderflow.core.errors import UnavailableError

    try:
        resp = asyncio.run(_fetch(address, args.timeout, tls_dir=args.tls_dir, token=args.token))
    except UnavailableError as e:
        raise UnavailableError(f"topology service {address}: {e}") from None
    # An empty graph (no agent yet) is a valid snapshot, though not a valid topology file.
    topo = convert.topology_from_proto(resp.topology) if resp.topology.clusters else Topology(
        clusters=(), revision=resp.topology.revision)
    if args.png is not None:
        try:
            draw_map(topo, args.png, title=f"topology revision {topo.revision} ({address})")
        except OSError as e:
            raise CliError(f"--png: cannot write {args.png}: {e.strerror or e}", EXIT_USAGE) from None
        if not args.json:
            console.print(f"wrote {args.png}: {len(topo.clusters)} clusters, {len(topo.direct)} directed links")
    if args.json:
        doc = topology_to_dict(topo)
        doc["revision"] = topo.revision
        print_json(doc)
        return 0
    if args.png is not None:
        return 0
    now = time.time()
    agents = {s.name: s for s in resp.cluster_status}
    rows = []
    for c in topo.clusters:
        st = agents.get(c.name)
        tflops = f"{c.tflops:.3g}" if c.tflops is not None else f"{c.gpu_type.peak_tflops:g} (peak)"
        rows.append((c.name, c.gpu, f"{c.free}/{c.total_gpus}", tflops, f"{c.gpu_memory_gib:.3g}",
                     f"{c.electricity_usd_per_kwh:g}", st.agent_address if st else ""))
    # the agent's address is dropped (and the title says so) rather than cut when the terminal is narrow
    console.print(fit_table(f"clusters (topology revision {topo.revision}, {address})",
                            ["cluster", "GPU", "GPUs free/total", "TFLOPS/GPU", "memory GiB", "$/kWh", "agent"],
                            rows, keep=("cluster", "GPU", "GPUs free/total")))
    ages = {(s.a, s.b): s for s in resp.link_status}
    lt = Table(title="links (measured, smoothed)")
    for col in ("from", "to", "bandwidth", "latency ms", "age", "samples"):
        lt.add_column(col, justify="left" if col in ("from", "to") else "right")
    for link in topo.links:
        ls = ages.get((link.a, link.b))
        bw = link.bandwidth_gbps
        shown = f"{bw:.3g} Gbit/s" if bw >= 1 else f"{bw * 1000:.3g} Mbit/s"
        lt.add_row(link.a, link.b + ("" if link.directed else " (both ways)"), shown, f"{link.latency_ms:.3g}",
                   _age(now, ls.updated_at) if ls else "", str(ls.samples) if ls else "")
    console.print(lt)
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

    s = tsub.add_parser("show", help="show the live graph from the topology service")
    s.add_argument("--address", "--topology-service", dest="topology_service", metavar="ADDR",
                   help="topology service host:port (default $SPIDERFLOW_TOPOLOGY, else the current context "
                        f"`spiderflow up` writes, else {DEFAULT_TOPOLOGY_SERVICE}; no port: :50052)")
    s.add_argument("--tls-dir", help="client certificate bundle for mTLS (default: $SPIDERFLOW_TLS_DIR, the "
                                     "context's; none: plaintext)")
    s.add_argument("--token", help="bearer token (default: $SPIDERFLOW_TOKEN, the context's)")
    s.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the service")
    s.add_argument("--png", type=Path, metavar="FILE", help="draw the cluster map with link bandwidths into FILE")
    add_json_flag(s)
    s.set_defaults(func=_show)
