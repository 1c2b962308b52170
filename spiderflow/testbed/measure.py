"""Measure a running testbed's directed pairs against their configured figures (real TCP transfers).

Starts one probe server (:mod:`spiderflow.testbed.probe`) per cluster, then for each pair runs an RTT
probe (median of ``count`` echoes; expected = one-way latency there + back) and a bulk transfer of
``seconds`` (receiver-side rate; expected = the pair's bandwidth), one pair at a time. Cost per pair:
about ``seconds`` + ``count`` round trips + two interpreter starts; the servers are stopped afterwards.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from spiderflow.testbed.netns import Testbed
from spiderflow.testbed.probe import wait_listening

__all__ = ["PairMeasurement", "measure_pairs"]

#: Probes run at a raised priority so that other load on the machine disturbs the readings less.
_NICE = ["nice", "-n", "-5"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PairMeasurement:
    """Configured vs measured figures of one directed pair (bandwidth in Mbit/s, RTT in ms)."""

    src: str
    dst: str
    want_mbps: float
    got_mbps: float
    want_rtt_ms: float
    got_rtt_ms: float
    relay_cpu_s: float

    @property
    def bandwidth_error(self) -> float:
        return (self.got_mbps - self.want_mbps) / self.want_mbps if self.want_mbps else 0.0

    @property
    def rtt_error(self) -> float:
        return (self.got_rtt_ms - self.want_rtt_ms) / self.want_rtt_ms if self.want_rtt_ms else 0.0


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _relay_pid(tb: Testbed) -> int:
    from spiderflow.testbed.netns import _netns_pids

    pids = _netns_pids(tb.layout.router_netns)
    return pids[0] if pids else 0


def measure_pairs(
    tb: Testbed,
    pairs: Sequence[tuple[str, str]] | None = None,
    *,
    seconds: float = 1.2,
    count: int = 7,
    port: int = 5201,
    python: str = sys.executable,
) -> list[PairMeasurement]:
    """Measure ``pairs`` (default: every reachable directed pair) of the running testbed ``tb``."""
    configured = tb.pairs()
    todo = list(pairs) if pairs is not None else [k for k, v in configured.items() if v.bandwidth_gbps > 0]
    names = sorted({n for p in todo for n in p})
    servers = [
        tb.exec(n, [*_NICE, python, "-m", "spiderflow.testbed.probe", "serve", "--port", str(port), "--lifetime",
                    str(60 + len(todo) * (seconds + 5))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for n in names
    ]
    relay = _relay_pid(tb)
    out: list[PairMeasurement] = []
    try:
        for n in names:
            wait_listening(tb.address(n), port, timeout=30.0)
        for src, dst in todo:
            fwd, back = configured[(src, dst)], configured[(dst, src)]
            probe = [*_NICE, python, "-m", "spiderflow.testbed.probe"]
            r = tb.run(src, [*probe, "rtt", tb.address(dst), str(port), "--count", str(count)], timeout=60)
            rtt = statistics.median(json.loads(r.stdout)["rtt_ms"]) if r.returncode == 0 else float("nan")
            cpu0 = _cpu_seconds(relay)
            r = tb.run(src, [*probe, "bulk", tb.address(dst), str(port), "--seconds", str(seconds)], timeout=60)
            cpu = _cpu_seconds(relay) - cpu0
            mbps = float(json.loads(r.stdout)["rate_mbps"]) if r.returncode == 0 else float("nan")
            out.append(PairMeasurement(
                src=src, dst=dst, want_mbps=fwd.bandwidth_gbps * 1000, got_mbps=mbps,
                want_rtt_ms=fwd.latency_ms + back.latency_ms, got_rtt_ms=float(rtt), relay_cpu_s=cpu,
            ))
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            s.wait(timeout=5)
    return out
