"""The gateway's cost on the emulated testbed: the hop itself, and a training job with and without it.

::

    sudo .venv/bin/python bench/gateway.py                     # both parts, summary in bench/results/gateway.json
    sudo .venv/bin/python bench/gateway.py --part hop          # only the hop (about 30 s)
    sudo .venv/bin/python bench/gateway.py --part job --steps 20

**hop**: two clusters linked by ``--mbit``/``--ms`` (one way). The testbed runs with the gateway NAT in both
namespaces but without the firewall, and a gateway in each (mutual TLS with ``spiderflow certs init``
certificates); a probe server in ``west`` listens on two ports, one of which the NAT of ``east`` leaves alone.
So the same pair, relay and shaping carry both paths: *direct* (worker → relay → worker) and *gateway*
(worker → NAT → gateway → TLS → relay → gateway → worker), measured alternately (``--rounds``). Printed:
median RTT of 64-byte echoes (the added latency: the median of the rounds' gateway − direct), and
receiver-side throughput on the shaped link and on an unshaped one
(``--wide-mbit``), where the gateway's own ceiling shows.

**job**: ``spiderflow up``'s sample job (gpt-tiny pipelined over three CPU clusters of the sample topology) on
the testbed, once with direct links and once with ``--gateway`` (only the gateway port open between the
clusters). For each: the agent-measured links the plan was made on (the agents' probes cross the gateways
too, so the measured latency and bandwidth include the hop), the plan's predicted step time, the measured
mean step time (steps after the first) and the cost model's closed form (:func:`spiderflow.core.costmodel.evaluate`)
of the plan on those links; for the direct run also on the same links with the hop charged
(:func:`spiderflow.core.gatewaycost.with_gateways`, figures from ``--hop-ms``/``--hop-mbit`` or this run's hop
part).

Needs root. Everything started is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow.core.domain import Cluster, Link, Topology  # noqa: E402
from spiderflow.core.gatewaycost import GatewayHop, with_gateways  # noqa: E402
from spiderflow.gateway.protocol import config_to_dict  # noqa: E402
from spiderflow.security.certs import init_certs  # noqa: E402
from spiderflow.testbed import Testbed  # noqa: E402
from spiderflow.testbed.probe import wait_listening  # noqa: E402

PY = sys.executable
GW, REDIRECT = 15443, 15080
DIRECT_PORT, GATEWAY_PORT = 5301, 5302


def _probe(tb: Testbed, args: list[str], timeout: float = 120) -> dict[str, Any]:
    r = tb.run("east", ["nice", "-n", "-5", PY, "-m", "spiderflow.testbed.probe", *args], timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _rtt(tb: Testbed, port: int, count: int) -> float:
    return float(statistics.median(_probe(tb, ["rtt", tb.address("west"), str(port), "--count", str(count)])["rtt_ms"]))


def _bulk(tb: Testbed, port: int, seconds: float) -> float:
    return float(_probe(tb, ["bulk", tb.address("west"), str(port), "--seconds", str(seconds),
                             "--warmup", "0.5"])["rate_mbps"])


def hop(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    certs = work / "certs"
    init_certs(certs, clusters=["east", "west"], etcd=False, admin=False)
    topo = Topology(clusters=tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1) for n in ("east", "west")),
                    links=(Link(a="east", b="west", bandwidth_gbps=args.mbit / 1000, latency_ms=args.ms),))
    prefix = "gwb" + uuid.uuid4().hex[:5]
    with Testbed(topo, prefix=prefix, gateway_port=GW, gateway_redirect_port=REDIRECT, gateway_firewall=False) as tb:
        ready = []
        for c in ("east", "west"):
            cfg = work / f"gateway-{c}.json"
            cfg.write_text(json.dumps({"cluster": c, "gateway": config_to_dict(
                tb.gateway_config(c, tls_dir=str(certs / f"agent-{c}")))}))
            ready.append(work / f"gateway-{c}.ready")
            tb.exec(c, [PY, "-m", "spiderflow.gateway", "--config", str(cfg), "--ready-file", str(ready[-1]),
                        "--log-format", "json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in (DIRECT_PORT, GATEWAY_PORT):
            tb.exec("west", [PY, "-m", "spiderflow.testbed.probe", "serve", "--port", str(port), "--lifetime", "900"])
            wait_listening(tb.address("west"), port)
        deadline = time.monotonic() + 30
        while not all(r.exists() for r in ready):
            if time.monotonic() > deadline:
                raise RuntimeError("gateways not ready")
            time.sleep(0.05)
        tb.bypass_gateway("east", DIRECT_PORT)
        out: dict[str, Any] = {"link": {"mbit": args.mbit, "one_way_ms": args.ms}, "load_before": os.getloadavg()}
        # direct and gateway alternate, round by round, so that a change of the machine's load hits both
        rtts: dict[str, list[float]] = {"direct": [], "gateway": []}
        for _ in range(args.rounds):
            rtts["direct"].append(_rtt(tb, DIRECT_PORT, args.count))
            rtts["gateway"].append(_rtt(tb, GATEWAY_PORT, args.count))
        out["rtt_ms_rounds"] = rtts
        out["rtt_ms"] = {k: statistics.median(v) for k, v in rtts.items()}
        out["rtt_ms"]["added"] = statistics.median(g - d for d, g in zip(rtts["direct"], rtts["gateway"], strict=True))

        def throughput() -> dict[str, float]:
            rates: dict[str, list[float]] = {"direct": [], "gateway": []}
            for _ in range(args.rounds):
                rates["direct"].append(_bulk(tb, DIRECT_PORT, args.seconds))
                rates["gateway"].append(_bulk(tb, GATEWAY_PORT, args.seconds))
            return {k: statistics.median(v) for k, v in rates.items()}

        out["shaped_mbps"] = throughput()
        tb.set_link("east", "west", bandwidth_gbps=args.wide_mbit / 1000, latency_ms=args.ms)
        out["wide_link_mbit"] = args.wide_mbit
        out["wide_mbps"] = throughput()
        out["load_after"] = os.getloadavg()
    print(f"hop on {args.mbit:g} Mbit/s, {args.ms:g} ms one way: RTT direct {out['rtt_ms']['direct']:.2f} ms, "
          f"through the gateways {out['rtt_ms']['gateway']:.2f} ms (+{out['rtt_ms']['added']:.2f} ms); "
          f"throughput {out['shaped_mbps']['direct']:.0f} vs {out['shaped_mbps']['gateway']:.0f} Mbit/s; "
          f"on {args.wide_mbit:g} Mbit/s: {out['wide_mbps']['direct']:.0f} vs {out['wide_mbps']['gateway']:.0f} "
          "Mbit/s", flush=True)
    return out


def job(args: argparse.Namespace, gateway: bool, hop_figures: GatewayHop | None = None) -> dict[str, Any]:
    from spiderflow.cli.commands.up import sample_job
    from spiderflow.jobs import JobState
    from spiderflow.mesh import LocalMesh, sample_topology
    from spiderflow.sdk import Client

    topo = sample_topology(3)
    prefix = ("gwj" if gateway else "gwd") + uuid.uuid4().hex[:5]
    with LocalMesh(topo, testbed=True, testbed_prefix=prefix, gateway=gateway) as mesh, \
            Client(mesh.address("scheduler"), topology=mesh.address("topology")) as sf:
            deadline = time.monotonic() + 180
            live = sf.topology()
            while len({frozenset((lk.a, lk.b)) for lk in live.links}) < 3 and time.monotonic() < deadline:
                time.sleep(1.0)
                live = sf.topology()
            spec = sample_job(topo, steps=args.steps)
            submitted = sf.submit(spec, request_id=spec["id"])
            steps: dict[int, float] = {}
            for ev in sf.follow(submitted.id, deadline=time.monotonic() + args.timeout):
                if ev.progress and int(ev.progress.get("attempt", 1)) <= 1:
                    steps[int(ev.progress["step"])] = float(ev.progress["step_time_s"])
            final = sf.get(submitted.id)
    if final.state != JobState.SUCCEEDED or final.plan is None:
        raise RuntimeError(f"job ended {final.state}: {final.reason}")
    measured = [t for s, t in sorted(steps.items()) if s > 1]
    from spiderflow.core.costmodel import evaluate

    closed = evaluate(final.plan, live, final.spec).step_time_s  # the closed form on the links the plan saw
    with_hop = (evaluate(final.plan, with_gateways(live, live.names, hop_figures), final.spec).step_time_s
                if hop_figures is not None else None)
    result: dict[str, Any] = {
        "closed_form_step_s": closed, "closed_form_with_hop_step_s": with_hop,
        "hop": {"latency_ms": hop_figures.latency_ms, "gbps": hop_figures.gbps} if hop_figures else None,
        "gateway": gateway, "chain": list(final.plan.chain), "schedule": str(final.plan.schedule),
        "micro_batches": final.plan.micro_batches, "predicted_step_s": final.plan.step_time_s,
        "measured_step_s": statistics.mean(measured) if measured else None, "steps_reported": len(measured),
        "links": [{"a": lk.a, "b": lk.b, "mbit": round(lk.bandwidth_gbps * 1000, 1), "ms": round(lk.latency_ms, 2)}
                  for lk in live.links],
    }
    print(f"job {'through the gateways' if gateway else 'direct'}: chain {' → '.join(result['chain'])}, "
          f"predicted {result['predicted_step_s']:.3f} s, measured {result['measured_step_s']:.3f} s per step; "
          f"links {result['links']}; closed form {closed:.3f} s"
          + (f", with the measured hop charged {with_hop:.3f} s" if with_hop is not None else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["hop", "job", "all"], default="all")
    p.add_argument("--mbit", type=float, default=400.0)
    p.add_argument("--ms", type=float, default=5.0)
    p.add_argument("--wide-mbit", type=float, default=5000.0)
    p.add_argument("--count", type=int, default=21, help="echoes per RTT sample")
    p.add_argument("--rounds", type=int, default=5, help="alternating direct/gateway samples of each figure")
    p.add_argument("--seconds", type=float, default=2.5)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--hop-ms", type=float, help="one-way latency the gateways add (default: this run's hop part)")
    p.add_argument("--hop-mbit", type=float, help="the gateways' throughput ceiling (default: this run's hop part)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway.json"))
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc, iptables)", file=sys.stderr)
        return 2
    import tempfile

    summary: dict[str, Any] = {"cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="gwbench-") as tmp:
        if args.part in ("hop", "all"):
            summary["hop"] = hop(args, Path(tmp))
        if args.part in ("job", "all"):
            hop_figures = GatewayHop(latency_ms=args.hop_ms, gbps=args.hop_mbit / 1000) \
                if args.hop_ms is not None and args.hop_mbit is not None else None
            if hop_figures is None and "hop" in summary:  # this run's: half the added RTT, the gateways' ceiling
                h = summary["hop"]
                hop_figures = GatewayHop(latency_ms=max(h["rtt_ms"]["added"], 0.0) / 2,
                                         gbps=h["wide_mbps"]["gateway"] / 1000)
            summary["job"] = {"load_before": os.getloadavg(), "direct": job(args, False, hop_figures),
                              "gateway": job(args, True), "load_after": os.getloadavg()}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
