"""Point-to-point transfers over one emulated link, as the executor sends them, against the cost model's price.

::

    sudo .venv/bin/python bench/testbed_links.py                       # 20 Mbit/s, 60 ms (testbed_exec's slow link)
    sudo .venv/bin/python bench/testbed_links.py --mbit 400 --ms 5 --sizes 262144,1048576 \\
        --out bench/results/testbed_links.json

A testbed (:class:`spiderflow.testbed.Testbed`) of two one-worker clusters ``a`` and ``b`` joined by one link
(``--mbit``, ``--ms``: kernel htb for the bandwidth, the delay relay for the one-way latency). Rank 0 runs in
``a``, rank 1 in ``b``; they join a gloo process group and exchange bf16 tensors of ``--sizes`` bytes with
``batch_isend_irecv`` on a subgroup of their own, as :mod:`spiderflow.exec.runtime` does on a pipeline
channel. Per size, ``--repeats`` rounds of three patterns:

* ``single``: rank 1 posts the receive 0.3 s before rank 0 sends one message (the executor posts receives
  ahead of use); measured = receipt at rank 1 − send at rank 0;
* ``train``: four messages sent back to back (a stage's consecutive micro-batches on one channel);
  measured = receipt of the last − the first send;
* ``late``: rank 1 posts the receive 0.3 s *after* rank 0 sent; measured = receipt − post. gloo sends a
  message only once the receiver has announced its receive (a ``NOTIFY_RECV_READY`` message,
  ``gloo/transport/tcp/pair.cc``), so a late receive pays the announcement's trip on top.

Price: the cost model's ``latency + bytes / bandwidth`` per message
(:func:`spiderflow.core.costmodel.boundary_time`; ``k`` messages on one link queue: ``latency + k · bytes /
bandwidth``, the timeline's FIFO link). Both processes run on this host, so their wall clocks are one clock.
Prints a table (median of the rounds, ratio measured / price) and writes ``--out``.

Needs root (network namespaces, tc, iptables); the testbed is removed on exit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spiderflow.cli.common import csv_ints  # noqa: E402

PATTERNS = ("single", "train", "late")
TRAIN = 4
POST_AHEAD_S = 0.3
STORE_PORT = 29611


def worker(rank: int, host: str, sizes: list[int], repeats: int, out: str) -> None:
    """One rank of the exchange (run inside its cluster's namespace); writes its timestamps to ``out``."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{host}:{STORE_PORT}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    channel = dist.new_group([0, 1])  # a pipeline channel: a process group of its own, as the executor's

    def post(n: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(n, dtype=torch.bfloat16)
        return buf, dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0, channel)])[0]

    def send(n: int) -> tuple[torch.Tensor, Any]:
        t = torch.zeros(n, dtype=torch.bfloat16)
        return t, dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, channel)])[0]

    events: list[tuple[str, int, int, str, float]] = []  # (pattern, size, round, what, time)
    for nbytes in sizes:
        n = nbytes // 2
        for r in range(repeats):
            for pattern in PATTERNS:
                dist.barrier()
                time.sleep(0.2)
                count = TRAIN if pattern == "train" else 1
                if rank == 1:
                    if pattern == "late":
                        dist.barrier()
                        time.sleep(POST_AHEAD_S)
                        events.append((pattern, nbytes, r, "post", time.time()))
                        post(n)[1].wait()
                    else:
                        recvs = [post(n) for _ in range(count)]
                        time.sleep(POST_AHEAD_S)
                        dist.barrier()
                        for _, w in recvs:
                            w.wait()
                    events.append((pattern, nbytes, r, "received", time.time()))
                else:
                    if pattern != "late":
                        time.sleep(POST_AHEAD_S)
                    dist.barrier()
                    events.append((pattern, nbytes, r, "sent", time.time()))
                    sends = [send(n) for _ in range(count)]
                    for _, w in sends:
                        w.wait()
    Path(out).write_text(json.dumps(events))
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from spiderflow.core.domain import Cluster, Link, Topology
    from spiderflow.testbed import Testbed, cleanup

    topo = Topology(clusters=tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1) for n in ("a", "b")),
                    links=(Link(a="a", b="b", bandwidth_gbps=args.mbit / 1000.0, latency_ms=args.ms),))
    sizes: list[int] = args.sizes
    prefix = args.prefix or f"tl{os.getpid() % 10000}"
    cleanup(prefix)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="testbed-links-") as tmp, Testbed(topo, prefix=prefix).up() as tb:
        host = tb.address("a")
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        outs = [Path(tmp) / f"rank-{r}.json" for r in (0, 1)]
        procs = [tb.exec(c, [sys.executable, str(Path(__file__).resolve()), "--worker", str(r), "--host", host,
                             "--sizes", ",".join(map(str, sizes)), "--repeats", str(args.repeats),
                             "--worker-out", str(outs[r])],
                         env=env, stdin=subprocess.DEVNULL)
                 for r, c in ((0, "a"), (1, "b"))]
        for r, p in enumerate(procs):
            if p.wait(timeout=args.timeout) != 0:
                raise SystemExit(f"rank {r} exited {p.returncode}")
        events = [e for path in outs for e in json.loads(path.read_text())]
    at = {(p, s, r, what): t for p, s, r, what, t in events}
    bw = args.mbit * 1e6 / 8.0
    rows = []
    for nbytes in sizes:
        for pattern in PATTERNS:
            count = TRAIN if pattern == "train" else 1
            start = "post" if pattern == "late" else "sent"
            took = [at[(pattern, nbytes, r, "received")] - at[(pattern, nbytes, r, start)] for r in range(args.repeats)]
            price = args.ms / 1e3 + count * nbytes / bw
            med = statistics.median(took)
            rows.append({"pattern": pattern, "bytes": nbytes, "messages": count, "measured_s": med,
                         "measured_runs_s": took, "price_s": price, "ratio": med / price})
    return {"command": " ".join(sys.argv), "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
            "link": {"mbit": args.mbit, "ms": args.ms}, "repeats": args.repeats, "rows": rows,
            "load_average": os.getloadavg(), "wall_s": time.monotonic() - t0}


def report(res: dict[str, Any]) -> str:
    lines = [f"link {res['link']['mbit']:g} Mbit/s, {res['link']['ms']:g} ms one-way; median of {res['repeats']} "
             "rounds; price = latency + messages × bytes / bandwidth",
             f"{'pattern':<8} {'bytes':>9} {'msgs':>4} {'measured ms':>11} {'price ms':>9} {'meas/price':>10}"]
    for r in res["rows"]:
        lines.append(f"{r['pattern']:<8} {r['bytes']:>9} {r['messages']:>4} {1e3 * r['measured_s']:>11.1f} "
                     f"{1e3 * r['price_s']:>9.1f} {r['ratio']:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mbit", type=float, default=20.0)
    p.add_argument("--ms", type=float, default=60.0)
    p.add_argument("--sizes", type=csv_ints(minimum=2), default=[4096, 262144, 524288],
                   help="message sizes in bytes (even), comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix", default="", help="testbed prefix (default: a fresh 'tl…')")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", default="", help="write the JSON summary here")
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--host", default="", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker >= 0:
        worker(args.worker, args.host, args.sizes, args.repeats, args.worker_out)
        return 0
    if not args.sizes or any(x % 2 for x in args.sizes) or args.repeats < 1:
        p.error("--sizes must be positive even byte counts and --repeats ≥ 1")
    if os.geteuid() != 0:
        p.error("needs root (network namespaces, tc, iptables)")
    res = measure(args)
    print(report(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
