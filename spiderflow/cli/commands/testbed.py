"""``spiderflow testbed``: the emulated multi-region testbed (network namespaces, shaped links).

``up`` stays in the foreground until Ctrl-C/SIGTERM and then removes everything; with ``--detach`` it
returns once the testbed is up (``down`` removes it later; started commands then run unsupervised).
Every subcommand needs root and the ``ip``/``tc``/``iptables`` tools; without them it exits with 2.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from rich.table import Table

from spiderflow.cli.common import EXIT_USAGE, CliError, add_json_flag, console, positive_float, print_json
from spiderflow.core.errors import PermissionDeniedError, PreconditionError

__all__ = ["register"]


def _require_environment() -> None:
    from spiderflow.testbed import check_environment

    try:
        check_environment()
    except (PermissionDeniedError, PreconditionError) as e:
        raise CliError(str(e), EXIT_USAGE) from None


def _state_dir(args: argparse.Namespace) -> Path | None:
    return Path(args.state_dir) if args.state_dir else None


def _commands(args: argparse.Namespace, tb: Any) -> list[tuple[str, list[str]]]:
    templates: list[str] = list(args.command or [])
    if args.agents:
        addr = str(args.agents)
        for local in ("127.0.0.1:", "localhost:"):
            if addr.startswith(local):  # the host's loopback, as seen from inside the namespaces
                addr = "{host}:" + addr[len(local):]
        templates.append(
            shlex.join([sys.executable, "-m", "spiderflow.cli.main", "agent"])
            + " --cluster {cluster} --topology-service " + shlex.quote(addr)
        )
    out: list[tuple[str, list[str]]] = []
    for name in tb.topology.names:
        fields = {"cluster": name, "address": tb.address(name), "host": tb.host_address,
                  "netns": tb.netns(name), "prefix": tb.prefix}
        for tpl in templates:
            try:
                out.append((name, [part.format(**fields) for part in shlex.split(tpl)]))
            except (KeyError, ValueError, IndexError) as e:
                raise CliError(f"--command: bad template {tpl!r}: {e}", EXIT_USAGE) from None
    return out


def _summary(status: dict[str, Any]) -> Table:
    t = Table(title=f"testbed {status['prefix']} ({status['subnet']}, host {status['host_address']})")
    for col in ("cluster", "netns", "address", "cpu cores", "processes"):
        t.add_column(col)
    for c in status["clusters"]:
        cores = c.get("cpu_cores")
        t.add_row(c["name"], c["netns"] + ("" if c["present"] else " (missing)"), c["address"],
                  "host's" if cores is None else f"{cores:g}", str(len(c["pids"])))
    return t


def _pairs_table(status: dict[str, Any]) -> Table:
    t = Table(title="directed pairs (widest path)")
    for col in ("src", "dst", "Mbit/s", "one-way ms"):
        t.add_column(col, justify="right" if col in ("Mbit/s", "one-way ms") else "left")
    for p in status["pairs"]:
        t.add_row(p["src"], p["dst"], f"{p['bandwidth_gbps'] * 1000:g}", f"{p['latency_ms']:g}")
    return t


def _ignore_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)


def _up(args: argparse.Namespace) -> int:
    from spiderflow.formats import load_topology
    from spiderflow.testbed import Testbed

    _require_environment()
    topo = load_topology(args.topology)
    tb = Testbed(
        topo,
        prefix=args.prefix,
        relay_port=args.relay_port,
        passthrough_ports=args.passthrough_port or (),
        connect_retry_s=args.connect_retry,
        state_dir=_state_dir(args),
        cpus_per_gpu=args.cpus_per_gpu,
    )

    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGHUP, on_signal)
    tb.up()
    try:
        cmds = _commands(args, tb)
        for cluster, argv in cmds:
            tb.supervise(cluster, argv)
        status = tb.status()
        if args.json:
            print_json(status)
        else:
            console.print(_summary(status))
            console.print(_pairs_table(status))
        if args.detach:
            console.print(f"detached; remove with: spiderflow testbed down --prefix {tb.prefix}", style="dim")
            return 0
        console.print("up; Ctrl-C tears it down", style="dim")
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    except BaseException:
        _ignore_signals()
        tb.down()
        raise
    _ignore_signals()  # a second Ctrl-C must not interrupt the teardown
    tb.down()
    console.print(f"testbed {tb.prefix} removed")
    return 0


def _down(args: argparse.Namespace) -> int:
    from spiderflow.core.errors import NotFoundError
    from spiderflow.testbed import Testbed, cleanup

    _require_environment()
    try:
        tb = Testbed.attach(args.prefix, state_dir=_state_dir(args))
        removed = tb.down()
    except NotFoundError:
        removed = cleanup(args.prefix, state_dir=_state_dir(args))
    if args.json:
        print_json({"prefix": args.prefix, "removed": removed})
    else:
        console.print(f"testbed {args.prefix}: removed {len(removed)} objects" if removed
                      else f"testbed {args.prefix}: nothing to remove")
    return 0


def _status(args: argparse.Namespace) -> int:
    from spiderflow.testbed import Testbed, list_testbeds

    _require_environment()
    prefixes = [args.prefix] if args.prefix else list_testbeds(state_dir=_state_dir(args))
    statuses = [Testbed.attach(p, state_dir=_state_dir(args)).status() for p in prefixes]
    if args.json:
        print_json(statuses[0] if args.prefix else statuses)
        return 0
    if not statuses:
        console.print("no testbed is up")
    for s in statuses:
        console.print(_summary(s))
        console.print(_pairs_table(s))
        relay = s["relay"]
        console.print(f"relay: {'up' if relay.get('ok') else 'DOWN'} "
                      f"({relay.get('connections', 0)} open connections, {relay.get('bytes', 0)} bytes relayed)")
    return 0


def _exec(args: argparse.Namespace) -> int:
    from spiderflow.testbed import Testbed

    _require_environment()
    argv = list(args.argv)
    if "--" in argv:  # options given after CLUSTER (REMAINDER swallowed them): parse them here
        cut = argv.index("--")
        late = argparse.ArgumentParser(prog="spiderflow testbed exec", add_help=False)
        late.add_argument("--prefix", default=args.prefix)
        late.add_argument("--state-dir", default=args.state_dir)
        opts, unknown = late.parse_known_args(argv[:cut])
        if unknown:
            raise CliError(f"exec: unexpected arguments before --: {' '.join(unknown)}", EXIT_USAGE)
        args.prefix, args.state_dir = opts.prefix, opts.state_dir
        argv = argv[cut + 1 :]
    if not argv:
        raise CliError("exec: give a command after --", EXIT_USAGE)
    tb = Testbed.attach(args.prefix, state_dir=_state_dir(args))
    tb.netns(args.cluster)
    proc = subprocess.run(["ip", "netns", "exec", tb.netns(args.cluster), *argv], env=tb.environment(args.cluster))
    return proc.returncode


def _set_link(args: argparse.Namespace) -> int:
    from spiderflow.testbed import Testbed

    _require_environment()
    if args.bandwidth_gbps is None and args.latency_ms is None:
        raise CliError("set-link: give --bandwidth-gbps and/or --latency-ms", EXIT_USAGE)
    tb = Testbed.attach(args.prefix, state_dir=_state_dir(args))
    changed = tb.set_link(args.a, args.b, bandwidth_gbps=args.bandwidth_gbps, latency_ms=args.latency_ms,
                          directed=args.directed)
    rows = [{"src": p.src, "dst": p.dst, "bandwidth_gbps": p.bandwidth_gbps, "latency_ms": p.latency_ms}
            for p in changed.values()]
    if args.json:
        print_json({"changed": rows})
    else:
        console.print(f"{len(rows)} directed pairs re-shaped")
    return 0


def _measure(args: argparse.Namespace) -> int:
    from spiderflow.testbed import Testbed
    from spiderflow.testbed.measure import measure_pairs

    _require_environment()
    tb = Testbed.attach(args.prefix, state_dir=_state_dir(args))
    pairs = None
    if args.pair:
        pairs = []
        for spec in args.pair:
            src, sep, dst = spec.partition(":")
            if not sep:
                raise CliError(f"--pair: expected SRC:DST (got {spec!r})", EXIT_USAGE)
            tb.pair(src, dst)
            pairs.append((src, dst))
    rows = measure_pairs(tb, pairs, seconds=args.seconds)
    if args.json:
        print_json([{"src": m.src, "dst": m.dst, "want_mbps": m.want_mbps, "got_mbps": m.got_mbps,
                     "want_rtt_ms": m.want_rtt_ms, "got_rtt_ms": m.got_rtt_ms, "relay_cpu_s": m.relay_cpu_s}
                    for m in rows])
        return 0
    t = Table(title=f"testbed {tb.prefix}: configured vs measured")
    for col in ("src", "dst", "Mbit/s want", "got", "err", "RTT ms want", "got", "err", "relay CPU s"):
        t.add_column(col, justify="left" if col in ("src", "dst") else "right")
    for m in rows:
        t.add_row(m.src, m.dst, f"{m.want_mbps:g}", f"{m.got_mbps:.1f}", f"{m.bandwidth_error:+.1%}",
                  f"{m.want_rtt_ms:g}", f"{m.got_rtt_ms:.1f}", f"{m.rtt_error:+.1%}", f"{m.relay_cpu_s:.2f}")
    console.print(t)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("testbed", help="emulated multi-region testbed on this machine (needs root)")
    tsub = p.add_subparsers(dest="testbed_command", metavar="SUBCOMMAND", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--prefix", default="sf", help="name prefix of the testbed's namespaces (default sf)")
        q.add_argument("--state-dir", default=None, help="where the state file lives (default /run/...)")

    up = tsub.add_parser("up", help="create the testbed from a topology file")
    up.add_argument("--topology", required=True, help="topology file (YAML or JSON)")
    common(up)
    up.add_argument("--detach", action="store_true", help="return once up instead of waiting for Ctrl-C")
    up.add_argument("--relay-port", type=int, default=15001, help="relay port inside the router namespace")
    up.add_argument("--connect-retry", type=float, default=10.0, metavar="SECONDS",
                    help="how long the relay retries a refused onward connect (default 10)")
    up.add_argument("--passthrough-port", type=int, action="append",
                    help="TCP destination port forwarded without added latency (repeatable)")
    up.add_argument("--cpus-per-gpu", type=positive_float, default=None, metavar="CORES",
                    help="limit each cluster's processes to CORES × its GPUs cores of this host (a cgroup CPU quota "
                         "per cluster: its compute is its own, whatever the other clusters run); default: no limit")
    up.add_argument("--command", action="append", metavar="TEMPLATE",
                    help="command to run and supervise in every cluster; {cluster} {address} {host} "
                         "{netns} {prefix} are substituted")
    up.add_argument("--agents", metavar="ADDR",
                    help="start 'spiderflow agent --cluster NAME --topology-service ADDR' in every cluster "
                         "(127.0.0.1:PORT / localhost:PORT / {host}:PORT mean the host's loopback PORT)")
    add_json_flag(up)
    up.set_defaults(func=_up)

    down = tsub.add_parser("down", help="remove a testbed (also the leftovers of a crashed one)")
    common(down)
    add_json_flag(down)
    down.set_defaults(func=_down)

    st = tsub.add_parser("status", help="show running testbeds")
    st.add_argument("--prefix", default=None, help="only this testbed")
    st.add_argument("--state-dir", default=None)
    add_json_flag(st)
    st.set_defaults(func=_status)

    ex = tsub.add_parser("exec", help="run a command inside a cluster's namespace")
    ex.add_argument("cluster")
    common(ex)
    ex.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD", help="the command and its arguments")
    ex.set_defaults(func=_exec)

    me = tsub.add_parser("measure", help="measure bandwidth and RTT of directed pairs on a running testbed")
    common(me)
    me.add_argument("--pair", action="append", metavar="SRC:DST", help="only these pairs (repeatable)")
    me.add_argument("--seconds", type=float, default=1.2, help="bulk transfer length per pair")
    add_json_flag(me)
    me.set_defaults(func=_measure)

    sl = tsub.add_parser("set-link", help="change a link's shaping on a running testbed")
    sl.add_argument("a")
    sl.add_argument("b")
    common(sl)
    sl.add_argument("--bandwidth-gbps", type=float, default=None)
    sl.add_argument("--latency-ms", type=float, default=None)
    sl.add_argument("--directed", action="store_true", help="change a → b only")
    add_json_flag(sl)
    sl.set_defaults(func=_set_link)
