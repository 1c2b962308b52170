"""The emulated multi-region testbed: one network namespace per cluster, kernel-shaped links, a delay relay.

Contract
--------
* ``Testbed(topology, prefix="sf").up()`` creates, for prefix ``P`` (see :mod:`spiderflow.testbed.layout`
  for names and addresses): a router namespace ``P-router``; one namespace ``P-<short>-<i>`` per cluster
  joined to the router by a veth pair (``eth0`` in the cluster); a host veth ``P-host`` whose address
  :attr:`Testbed.host_address` (``10.N.0.1``) is how processes in the namespaces reach services on the
  host: TCP to ``host_address:PORT`` is DNAT-ed to ``127.0.0.1:PORT`` (iptables rule on ``P-host`` only,
  plus ``route_localnet`` on that interface), so etcd and gRPC services listening on loopback work
  unchanged. Host ↔ cluster traffic is neither delayed nor shaped.
* Each directed cluster pair ``a → b`` gets the topology's widest-path bandwidth (htb class on the
  router; its bucket is 1 ms at the rate and the router's veths send packets of at most 1 ms at the slowest
  rate into them, so an idle link passes no burst above its rate) and one-way latency (the delay relay,
  :mod:`spiderflow.testbed.relay`, a child process in the router namespace reached by nat REDIRECT of
  cluster-to-cluster TCP). Only TCP is delayed; other
  protocols and ``passthrough_ports`` are forwarded directly (bandwidth-shaped, no added latency).
  Processes see the router's address of their own link as the peer of relayed connections.
* :meth:`Testbed.set_link` changes a link of the running testbed (bandwidth at once, latency for data
  arriving afterwards); :meth:`Testbed.exec` / :meth:`Testbed.run` start processes in a cluster
  namespace with ``SPIDERFLOW_TESTBED_{CLUSTER,ADDRESS,HOST}`` and ``GLOO_SOCKET_IFNAME=eth0`` set.
* ``gateway_port`` (a firewall between regions): the router drops cluster-to-cluster TCP except
  connections to that port (replies of established connections and the host's services pass), so only
  the clusters' gateways (:mod:`spiderflow.gateway`) can talk across; connections to the gateway port are
  still relayed, so they get the pair's latency and bandwidth. ``gateway_redirect_port``: each cluster
  namespace gets the node-level NAT a gateway needs: its TCP to other clusters' ranges, except to
  ``gateway_port``, is REDIRECTed (``nat OUTPUT``) to that local port. ``gateway_firewall=False`` keeps
  the NAT but not the firewall (to compare direct and gateway paths on the same testbed).
  :meth:`Testbed.gateway_config` is a cluster's ``gateway:`` section for this layout;
  :meth:`Testbed.bypass_gateway` exempts one destination port of one cluster from its NAT.
* :meth:`Testbed.partition` cuts one cluster off (its router-side veth goes down: nothing reaches or leaves
  the namespace, neither peers nor the host's services; processes inside keep running and their sockets
  stay open, as in a network partition) and :meth:`Testbed.heal` reconnects it with the same shaping.
* ``cpus_per_gpu`` (cores): each cluster gets a CPU quota of ``cpus_per_gpu × total_gpus`` cores (a cgroup per
  cluster, :mod:`spiderflow.testbed.cpu`) that every process started in it runs under, so a cluster's compute
  is its own, as on real hardware, instead of whatever the other clusters on this host leave free; in a
  KVM guest, idle vCPUs then poll for up to a quota period before halting while the testbed is up
  (``halt_poll``; a halted vCPU resumes its worker on cold caches). ``None`` (the default): no limit.
  :meth:`Testbed.launch_prefix` is the argv prefix that starts a command in a cluster (its cgroup, then its
  namespace).
* :meth:`Testbed.down` removes everything (processes in the namespaces, namespaces, veths, the host
  rule, the cgroups, the state file); a failed :meth:`Testbed.up` calls it before re-raising.
  :func:`cleanup` does the same from names alone for a crashed run. State lives in ``<state_dir>/<prefix>.json``
  (``/run/spiderflow-testbed`` by default) so :meth:`Testbed.attach` finds a detached testbed.

Requires root, ``ip``, ``tc`` and ``iptables`` (nft or legacy backend, whichever works).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from spiderflow.core.domain import Topology
from spiderflow.core.errors import (
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    SpiderFlowError,
    ValidationError,
)
from spiderflow.formats import topology_from_dict, topology_to_dict
from spiderflow.gateway.protocol import GatewayConfig, GatewayPeer
from spiderflow.testbed.cpu import (
    DEFAULT_PERIOD_US,
    CpuGroup,
    cpu_hierarchy,
    create_group,
    hold_halt_polling,
    join_prefix,
    release_halt_polling,
    remove_groups,
)
from spiderflow.testbed.layout import (
    CLUSTER_IFACE,
    DEFAULT_CLASS_MINOR,
    HOST_IFACE_SUFFIX,
    Layout,
    PairShaping,
    pair_figures,
    plan_layout,
    update_link,
    validate_prefix,
)

__all__ = [
    "DEFAULT_RELAY_PORT",
    "Testbed",
    "TestbedError",
    "check_environment",
    "cleanup",
    "default_state_dir",
    "list_testbeds",
]

log = structlog.get_logger("spiderflow.testbed")

DEFAULT_RELAY_PORT = 15001
_RULE_COMMENT = "spiderflow-testbed:{prefix}"
_DEFAULT_RATE = "10gbit"
_DEFAULT_BURST = 1_250_000  # 1 ms at 10 Gbit/s


class TestbedError(SpiderFlowError):
    """A kernel/tool operation of the testbed failed; the message names the command."""

    __test__ = False  # not a pytest test class despite the name


def default_state_dir() -> Path:
    """``/run/spiderflow-testbed`` when writable, else ``<tmp>/spiderflow-testbed``."""
    for base in (Path("/run"), Path(os.environ.get("TMPDIR", "/tmp"))):
        d = base / "spiderflow-testbed"
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise TestbedError("no writable state directory (/run or $TMPDIR)")


def _iptables_backend() -> str:
    for exe in ("iptables", "iptables-legacy"):
        if shutil.which(exe) and subprocess.run([exe, "-t", "nat", "-S"], capture_output=True).returncode == 0:
            return exe
    raise PreconditionError("iptables with the nat table is not usable (install the iptables package)")


def check_environment() -> str:
    """Raise unless the testbed can run here: root, ``ip``/``tc``, a working iptables. Returns its name."""
    if os.geteuid() != 0:
        raise PermissionDeniedError("the testbed needs root (network namespaces, tc, iptables)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise PreconditionError(f"'{tool}' is not installed (install iproute2)")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        raise PreconditionError("'ip netns' is not usable here")
    return _iptables_backend()


def _sh(argv: Sequence[str], *, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _rate(gbps: float) -> str:
    return f"{max(round(gbps * 1e9), 8000)}bit"


_FRAME_BYTES = 1514
#: The most segments a GSO packet can carry (64 KiB at a 1448-byte MSS).
_MAX_GSO_SEGS = 44


def _burst(gbps: float) -> int:
    """htb burst: 1 ms at the class rate, at least two full-size frames. The router's veths send GSO packets of
    at most 1 ms at the slowest rate into them (:func:`_gso_segs`), so no 64 KiB GSO packet needs a larger
    bucket, and an idle link does not pass a message's first tens of KiB faster than its rate (a 64 KiB bucket
    made a 256 KiB message over 20 Mbit/s arrive 13 % early)."""
    return int(max(gbps * 1e9 / 8 * 0.001, 2 * _FRAME_BYTES))


def _gso_segs(slowest_gbps: float) -> int:
    """``gso_max_segs`` of a router veth: segments of at most 1 ms at the slowest pair rate into that cluster
    (1 .. 44). TCP on the router (the relay's sockets) then builds packets no larger than every htb bucket on
    that veth, while fast pairs are not cut into single segments: one segment per packet costs the relay and
    the kernel so much CPU that a 400 Mbit/s pair carried 320-360 Mbit/s on a 2-core machine (383 with 4)."""
    return int(min(max(slowest_gbps * 1e9 / 8 * 0.001 // _FRAME_BYTES, 1), _MAX_GSO_SEGS))


def _namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    out = _sh(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_namespace_processes(namespaces: Sequence[str], *, grace_s: float = 3.0) -> list[int]:
    """SIGTERM every process in ``namespaces``, SIGKILL the ones still there after ``grace_s``."""
    killed: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for ns in namespaces for p in _netns_pids(ns)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                killed.append(pid)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_netns_pids(ns) for ns in namespaces):
            time.sleep(0.05)
    return sorted(set(killed))


def _delete_host_rules(prefix: str) -> list[str]:
    comment = _RULE_COMMENT.format(prefix=prefix)
    removed: list[str] = []
    for exe in ("iptables", "iptables-legacy"):
        if shutil.which(exe) is None:
            continue
        listing = _sh([exe, "-t", "nat", "-S", "PREROUTING"], check=False)
        if listing.returncode != 0:
            continue
        for line in listing.stdout.splitlines():
            if comment in line and line.startswith("-A "):
                args = line.split()
                args[0] = "-D"
                args = [a.strip('"') for a in args]
                if _sh([exe, "-t", "nat", *args], check=False).returncode == 0:
                    removed.append(f"{exe} nat rule {comment}")
    return removed


def cleanup(prefix: str, *, state_dir: Path | None = None) -> list[str]:
    """Remove every leftover of testbed ``prefix`` by name (processes, namespaces, host veth and rule,
    state files). Safe to call when nothing is left; returns what was removed."""
    validate_prefix(prefix)
    removed: list[str] = []
    mine = [ns for ns in _namespaces() if ns.startswith(f"{prefix}-")]
    for pid in _kill_namespace_processes(mine):
        removed.append(f"process {pid}")
    removed += _delete_host_rules(prefix)
    host_iface = f"{prefix}{HOST_IFACE_SUFFIX}"
    if _sh(["ip", "link", "show", host_iface], check=False).returncode == 0:
        _sh(["ip", "link", "del", host_iface], check=False)
        removed.append(f"link {host_iface}")
    for ns in mine:
        if _sh(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(f"netns {ns}")
    hierarchy = cpu_hierarchy()
    if hierarchy is not None:
        removed += remove_groups(hierarchy, prefix)
    if release_halt_polling(prefix):
        removed.append("halt-polling hold (restored)")
    d = state_dir or default_state_dir()
    for f in sorted(d.glob(f"{prefix}.*")) + sorted(d.glob(f"{prefix}-*.log")):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
            removed.append(f"file {f}")
    if removed:
        log.info("testbed_cleanup", prefix=prefix, removed=len(removed))
    return removed


def list_testbeds(*, state_dir: Path | None = None) -> list[str]:
    """Prefixes of testbeds with a state file."""
    d = state_dir or default_state_dir()
    return sorted(p.name[: -len(".json")] for p in d.glob("*.json") if not p.name.endswith(".relay.json"))


def _used_octets(state_dir: Path) -> set[int]:
    used: set[int] = set()
    text = _sh(["ip", "-4", "-o", "addr"], check=False).stdout + _sh(["ip", "-4", "route"], check=False).stdout
    for tok in text.split():
        parts = tok.split("/")[0].split(".")
        if len(parts) == 4 and parts[0] == "10" and parts[1].isdigit():
            used.add(int(parts[1]))
    for p in state_dir.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            used.add(int(json.loads(p.read_text())["octet"]))
    return used


def _choose_octet(prefix: str, state_dir: Path) -> int:
    used = _used_octets(state_dir)
    start = zlib.crc32(prefix.encode()) % 50
    for k in range(50):
        octet = 200 + (start + k) % 50
        if octet not in used:
            return octet
    raise PreconditionError("no free 10.200-249.0.0/16 subnet for the testbed")


class _Supervised:
    """A command kept running in one cluster namespace (restarted with backoff when it exits)."""

    def __init__(self, cluster: str, argv: list[str], start: Any, restart: bool) -> None:
        self.cluster = cluster
        self.argv = argv
        self._start = start
        self.restart = restart
        self.proc: subprocess.Popen[bytes] = start()
        self.restarts = 0
        self.next_start = 0.0


class Testbed:
    """An emulated multi-region testbed for ``topology`` (see the module docstring for the contract).

    ``relay_port`` is where the relay listens in the router namespace; ``passthrough_ports`` are
    destination ports forwarded without the relay (no added latency); ``connect_retry_s`` bounds how long
    the relay retries a refused onward connect; ``cpus_per_gpu`` limits each cluster's CPU (module docstring;
    ``cpu_period_us`` is the quota's period) and, unless ``halt_poll`` is False, lets a virtual machine's
    idle vCPUs poll for up to that period before halting (:func:`spiderflow.testbed.cpu.hold_halt_polling`).
    """

    __test__ = False  # not a pytest test class despite the name

    def __init__(
        self,
        topology: Topology,
        *,
        prefix: str = "sf",
        octet: int | None = None,
        relay_port: int = DEFAULT_RELAY_PORT,
        passthrough_ports: Sequence[int] = (),
        connect_retry_s: float = 10.0,
        state_dir: Path | str | None = None,
        python: str = sys.executable,
        host_access: bool = True,
        gateway_port: int | None = None,
        gateway_redirect_port: int | None = None,
        gateway_firewall: bool = True,
        cpus_per_gpu: float | None = None,
        cpu_period_us: int = DEFAULT_PERIOD_US,
        halt_poll: bool = True,
    ) -> None:
        self.prefix = validate_prefix(prefix)
        if cpus_per_gpu is not None and not (cpus_per_gpu > 0 and math.isfinite(cpus_per_gpu)):
            raise ValidationError("cpus_per_gpu", f"must be a positive number of cores, got {cpus_per_gpu!r}")
        self.cpus_per_gpu = cpus_per_gpu
        self.cpu_period_us = cpu_period_us
        self.halt_poll = halt_poll
        self._halt_poll_ns: int | None = None
        self.topology = topology
        self.relay_port = relay_port
        self.passthrough_ports = tuple(int(p) for p in passthrough_ports)
        self.connect_retry_s = connect_retry_s
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.python = python
        self.host_access = host_access
        self.gateway_port = gateway_port
        self.gateway_redirect_port = gateway_redirect_port
        self.gateway_firewall = gateway_firewall
        if gateway_redirect_port is not None and gateway_port is None:
            raise PreconditionError("gateway_redirect_port needs gateway_port (the port the NAT leaves alone)")
        self._octet = octet
        self._layout: Layout | None = None
        self._backend = ""
        self._relay: subprocess.Popen[bytes] | None = None
        self._relay_pid = 0
        self._children: list[subprocess.Popen[bytes]] = []
        self._supervised: list[_Supervised] = []
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._is_up = False
        self._cpu_groups: dict[str, CpuGroup] = {}

    # ----------------------------------------------------------------- paths and names
    @property
    def state_file(self) -> Path:
        return self.state_dir / f"{self.prefix}.json"

    @property
    def control_socket(self) -> Path:
        return self.state_dir / f"{self.prefix}.relay.sock"

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise PreconditionError(f"testbed {self.prefix!r} is not up")
        return self._layout

    @property
    def host_address(self) -> str:
        """The host's address as seen from inside the namespaces (DNAT-ed to 127.0.0.1)."""
        return self.layout.host_address

    def address(self, cluster: str) -> str:
        """The IPv4 address of ``cluster``'s namespace."""
        return self.layout.slot(cluster).address

    def netns(self, cluster: str) -> str:
        return self.layout.slot(cluster).netns

    def cpu_limit(self, cluster: str) -> float | None:
        """``cluster``'s CPU quota in cores (``cpus_per_gpu × total_gpus``), or ``None`` when unlimited."""
        if self.cpus_per_gpu is None:
            return None
        return self.cpus_per_gpu * self.topology.cluster(cluster).total_gpus

    def launch_prefix(self, cluster: str) -> list[str]:
        """The argv prefix that runs a command in ``cluster``: into its CPU cgroup (when limited), then into
        its network namespace."""
        ns = self.netns(cluster)
        group = self._cpu_groups.get(cluster)
        return [*(join_prefix(group) if group is not None else []), "ip", "netns", "exec", ns]

    def gateway_config(self, cluster: str, *, tls_dir: str | None = None) -> GatewayConfig:
        """The ``gateway:`` section of ``cluster``'s agent on this testbed (needs ``gateway_port`` and
        ``gateway_redirect_port``): its own range, every other cluster's gateway at its namespace address."""
        if self.gateway_port is None or self.gateway_redirect_port is None:
            raise PreconditionError("the testbed was created without gateway_port and gateway_redirect_port")
        layout = self.layout
        me = layout.slot(cluster)
        return GatewayConfig(
            enabled=True, port=self.gateway_port, listen_host="0.0.0.0",
            redirect=f"127.0.0.1:{self.gateway_redirect_port}", ranges=(me.subnet,), tls_dir=tls_dir,
            peers=tuple(GatewayPeer(cluster=s.name, address=f"{s.address}:{self.gateway_port}", ranges=(s.subnet,))
                        for s in layout.clusters if s.index != me.index))

    def bypass_gateway(self, cluster: str, port: int) -> None:
        """Let ``cluster``'s TCP to destination ``port`` skip its gateway NAT (as traffic of a host without the
        node rule would): it goes direct, where the firewall (if on) drops it."""
        if self.gateway_redirect_port is None:
            raise PreconditionError("the testbed has no gateway NAT (gateway_redirect_port)")
        _sh(["ip", "netns", "exec", self.netns(cluster), self._backend, "-t", "nat", "-I", "SF_GATEWAY", "1",
             "-p", "tcp", "--dport", str(int(port)), "-j", "RETURN"])

    def pairs(self) -> dict[tuple[str, str], PairShaping]:
        """The configured figures of every directed pair (widest path of the current topology)."""
        return pair_figures(self.topology)

    def pair(self, a: str, b: str) -> PairShaping:
        try:
            return self.pairs()[(a, b)]
        except KeyError:
            raise NotFoundError(f"no pair {a!r} → {b!r} in the testbed") from None

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> Testbed:
        if not self._is_up:
            self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(
        self,
        commands: Mapping[str, Sequence[str]] | None = None,
        *,
        restart: bool = True,
    ) -> Testbed:
        """Create the testbed; start ``commands[cluster]`` (argv) in each named cluster and supervise them.

        Raises :class:`PreconditionError` if a testbed with this prefix exists. On any failure (or
        KeyboardInterrupt) everything created so far is removed before the error propagates.
        """
        self._backend = check_environment()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        existing = [ns for ns in _namespaces() if ns.startswith(f"{self.prefix}-")]
        if existing or self.state_file.exists():
            raise PreconditionError(
                f"testbed {self.prefix!r} already exists ({len(existing)} namespaces); "
                f"run 'spiderflow testbed down --prefix {self.prefix}'"
            )
        self._stop.clear()
        octet = self._octet if self._octet is not None else _choose_octet(self.prefix, self.state_dir)
        self._layout = plan_layout(self.topology, prefix=self.prefix, octet=octet)
        t0 = time.monotonic()
        try:
            self._write_state("starting")
            self._create_namespaces()
            self._limit_cpu()
            self._create_links()
            self._shape()
            self._redirect()
            self._gateway_rules()
            self._start_relay()
            self._is_up = True
            self._write_state("up")
            self._ensure_monitor()
            for cluster, argv in (commands or {}).items():
                self.supervise(cluster, argv, restart=restart)
        except BaseException:
            log.warning("testbed_up_failed", prefix=self.prefix)
            self.down()
            raise
        log.info(
            "testbed_up",
            prefix=self.prefix,
            clusters=len(self.topology.clusters),
            subnet=self.layout.subnet,
            seconds=round(time.monotonic() - t0, 2),
        )
        return self

    def down(self) -> list[str]:
        """Remove everything this testbed created (idempotent). Returns what was removed."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
            self._monitor = None
        procs = [s.proc for s in self._supervised] + self._children
        if self._relay is not None:
            procs.append(self._relay)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        for p in procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=3)
        removed = cleanup(self.prefix, state_dir=self.state_dir)
        self._is_up = False
        self._cpu_groups.clear()
        self._halt_poll_ns = None
        self._relay = None
        self._children.clear()
        self._supervised.clear()
        log.info("testbed_down", prefix=self.prefix)
        return removed

    @classmethod
    def attach(cls, prefix: str, *, state_dir: Path | str | None = None) -> Testbed:
        """A handle on a running testbed started elsewhere (e.g. by ``spiderflow testbed up --detach``)."""
        validate_prefix(prefix)
        d = Path(state_dir) if state_dir is not None else default_state_dir()
        path = d / f"{prefix}.json"
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"no testbed {prefix!r} (no state file {path})") from None
        tb = cls(
            topology_from_dict(state["topology"]),
            prefix=prefix,
            octet=int(state["octet"]),
            relay_port=int(state["relay_port"]),
            passthrough_ports=state.get("passthrough_ports", []),
            state_dir=d,
            gateway_port=state.get("gateway_port"),
            gateway_redirect_port=state.get("gateway_redirect_port"),
            gateway_firewall=bool(state.get("gateway_firewall", True)),
            cpus_per_gpu=state.get("cpus_per_gpu"),
            cpu_period_us=int(state.get("cpu_period_us", DEFAULT_PERIOD_US)),
        )
        tb._layout = plan_layout(tb.topology, prefix=prefix, octet=int(state["octet"]))
        tb._backend = str(state.get("iptables", "iptables"))
        tb._relay_pid = int(state.get("relay_pid", 0))
        tb._is_up = state.get("status") == "up"
        tb._cpu_groups = {c: CpuGroup(Path(g["path"]), float(g["cores"]), int(g["period_us"]))
                          for c, g in (state.get("cpu_groups") or {}).items()}
        tb._halt_poll_ns = state.get("guest_halt_poll_ns")
        return tb

    # ----------------------------------------------------------------- processes
    def environment(self, cluster: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of processes started in ``cluster``: ours plus the testbed variables."""
        env = dict(os.environ)
        env.update(
            SPIDERFLOW_TESTBED_CLUSTER=cluster,
            SPIDERFLOW_TESTBED_ADDRESS=self.address(cluster),
            SPIDERFLOW_TESTBED_HOST=self.host_address,
            GLOO_SOCKET_IFNAME=CLUSTER_IFACE,
            TP_SOCKET_IFNAME=CLUSTER_IFACE,
        )
        env.update(extra or {})
        return env

    def exec(
        self,
        cluster: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **popen: Any,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``cluster``'s namespace (its own session). :meth:`down` terminates it."""
        popen.setdefault("start_new_session", True)
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            [*self.launch_prefix(cluster), *argv], env=self.environment(cluster, env), **popen
        )
        self._children.append(proc)
        return proc

    def run(
        self,
        cluster: str,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        check: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``cluster``'s namespace to completion; text output captured."""
        return subprocess.run(
            [*self.launch_prefix(cluster), *argv],
            env=self.environment(cluster, env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def supervise(self, cluster: str, argv: Sequence[str], *, restart: bool = True) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``cluster`` with output to ``<state_dir>/<prefix>-<cluster>.log``; restart it
        (backoff 1 s doubling to 30 s) whenever it exits while the testbed is up, if ``restart``."""
        logfile = self.state_dir / f"{self.prefix}-{self.netns(cluster)}.log"

        def start() -> subprocess.Popen[bytes]:
            with open(logfile, "ab") as out:
                p: subprocess.Popen[bytes] = subprocess.Popen(
                    [*self.launch_prefix(cluster), *argv],
                    env=self.environment(cluster),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            log.info("testbed_process_started", cluster=cluster, pid=p.pid, argv=list(argv))
            return p

        sup = _Supervised(cluster, list(argv), start, restart)
        with self._lock:
            self._supervised.append(sup)
        self._ensure_monitor()
        self._write_state("up")
        return sup.proc

    def _ensure_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name=f"testbed-{self.prefix}", daemon=True)
            self._monitor.start()

    def _watch(self) -> None:
        """Every 0.5 s: restart the relay if it died, and supervised commands that exited (with backoff)."""
        while not self._stop.wait(0.5):
            relay = self._relay
            if relay is not None and relay.poll() is not None and self._is_up and not self._stop.is_set():
                log.warning("testbed_relay_exited", prefix=self.prefix, code=relay.returncode)
                try:
                    self._start_relay(status="up")
                    log.info("testbed_relay_restarted", prefix=self.prefix,
                             pid=self._relay.pid if self._relay is not None else 0)
                except (TestbedError, OSError) as e:
                    log.error("testbed_relay_restart_failed", prefix=self.prefix, error=str(e))
            with self._lock:
                for sup in self._supervised:
                    code = sup.proc.poll()
                    if code is None or not sup.restart:
                        continue
                    now = time.monotonic()
                    if sup.next_start == 0.0:
                        backoff = min(2.0**sup.restarts, 30.0)
                        sup.next_start = now + backoff
                        log.warning("testbed_process_exited", cluster=sup.cluster, code=code, restart_in_s=backoff)
                    elif now >= sup.next_start:
                        sup.proc = sup._start()
                        sup.restarts += 1
                        sup.next_start = 0.0
                        with contextlib.suppress(OSError):
                            self._write_state("up")

    # ----------------------------------------------------------------- shaping changes
    def set_link(
        self,
        a: str,
        b: str,
        *,
        bandwidth_gbps: float | None = None,
        latency_ms: float | None = None,
        directed: bool = False,
    ) -> dict[tuple[str, str], PairShaping]:
        """Change link ``a → b`` (and ``b → a`` unless ``directed``) of the running testbed.

        Every pair whose widest path changes is re-shaped (htb class rate and relay latency). Returns
        the pairs that changed. Bandwidth applies at once; latency to data that arrives afterwards.
        """
        layout = self.layout
        before = self.pairs()
        self.topology = update_link(
            self.topology, a, b, bandwidth_gbps=bandwidth_gbps, latency_ms=latency_ms, directed=directed
        )
        after = self.pairs()
        changed = {k: v for k, v in after.items() if before[k] != v}
        lines = []
        for (src, dst), p in changed.items():
            s, d = layout.slot(src), layout.slot(dst)
            lines.append(self._class_cmd("replace", d.router_iface, s.index, p.bandwidth_gbps))
        if lines:
            _sh(["tc", "-n", layout.router_netns, "-batch", "-"], stdin="\n".join(lines) + "\n")
            self._size_gso(after, sorted({dst for _, dst in changed}))
        self._write_relay_config()  # what a restarted relay starts from
        self._control({"op": "set", "pairs": self._pair_rows()})
        self._write_state("up")
        log.info("testbed_link_set", prefix=self.prefix, a=a, b=b, bandwidth_gbps=bandwidth_gbps,
                 latency_ms=latency_ms, directed=directed, pairs_changed=len(changed))
        return changed

    # ----------------------------------------------------------------- partitions
    def partition(self, cluster: str) -> None:
        """Cut ``cluster`` off from every peer and from the host: its veth on the router goes down (the
        kernel drops whatever is sent to or from the namespace; the cluster side keeps its address and
        routes, its processes and sockets live on). Idempotent; :meth:`heal` undoes it."""
        slot = self.layout.slot(cluster)
        _sh(["ip", "-n", self.layout.router_netns, "link", "set", slot.router_iface, "down"])
        log.info("testbed_partitioned", prefix=self.prefix, cluster=cluster, iface=slot.router_iface)

    def heal(self, cluster: str) -> None:
        """Reconnect a partitioned ``cluster``: its router veth comes up again with the same qdisc, classes
        and filters (the router's route to it returns with the link). Idempotent."""
        slot = self.layout.slot(cluster)
        _sh(["ip", "-n", self.layout.router_netns, "link", "set", slot.router_iface, "up"])
        log.info("testbed_healed", prefix=self.prefix, cluster=cluster, iface=slot.router_iface)

    def partitioned(self) -> list[str]:
        """The clusters cut off by :meth:`partition` (router veth administratively down)."""
        layout = self.layout
        out = _sh(["ip", "-n", layout.router_netns, "-o", "link", "show"]).stdout
        down = set()
        for line in out.splitlines():
            name = line.split(":", 2)[1].strip().split("@", 1)[0] if line.count(":") >= 2 else ""
            flags = line.split("<", 1)[1].split(">", 1)[0].split(",") if "<" in line else []
            if name and "UP" not in flags:
                down.add(name)
        return [s.name for s in layout.clusters if s.router_iface in down]

    # ----------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        """A JSON-able description: names, addresses, pair figures, process and relay state."""
        layout = self.layout
        present = set(_namespaces())
        relay: dict[str, Any]
        try:
            relay = self._control({"op": "stats"})
        except TestbedError as e:
            relay = {"ok": False, "error": str(e)}
        procs: dict[str, list[int]] = {s.netns: _netns_pids(s.netns) for s in layout.clusters}
        try:
            cut = set(self.partitioned())
        except TestbedError:
            cut = set()
        return {
            "prefix": self.prefix,
            "subnet": layout.subnet,
            "host_address": layout.host_address,
            "host_iface": layout.host_iface,
            "router_netns": layout.router_netns,
            "relay_port": self.relay_port,
            "relay": relay,
            "guest_halt_poll_ns": self._halt_poll_ns,
            "clusters": [
                {
                    "name": s.name,
                    "netns": s.netns,
                    "address": s.address,
                    "present": s.netns in present,
                    "partitioned": s.name in cut,
                    "cpu_cores": self.cpu_limit(s.name),
                    "pids": procs[s.netns],
                }
                for s in layout.clusters
            ],
            "pairs": [
                {"src": p.src, "dst": p.dst, "bandwidth_gbps": p.bandwidth_gbps, "latency_ms": p.latency_ms}
                for p in self.pairs().values()
            ],
        }

    # ----------------------------------------------------------------- internals
    def _write_state(self, status: str) -> None:
        with self._state_lock:
            self._write_state_locked(status)

    def _write_state_locked(self, status: str) -> None:
        layout = self.layout
        state = {
            "prefix": self.prefix,
            "status": status,
            "octet": layout.octet,
            "relay_port": self.relay_port,
            "relay_pid": self._relay.pid if self._relay is not None else self._relay_pid,
            "passthrough_ports": list(self.passthrough_ports),
            "gateway_port": self.gateway_port,
            "gateway_redirect_port": self.gateway_redirect_port,
            "gateway_firewall": self.gateway_firewall,
            "cpus_per_gpu": self.cpus_per_gpu,
            "cpu_period_us": self.cpu_period_us,
            "cpu_groups": {c: {"path": str(g.path), "cores": g.cores, "period_us": g.period_us}
                           for c, g in self._cpu_groups.items()},
            "guest_halt_poll_ns": self._halt_poll_ns,
            "iptables": self._backend,
            "topology": topology_to_dict(self.topology),
            "supervised": [{"cluster": s.cluster, "argv": s.argv, "pid": s.proc.pid} for s in self._supervised],
            "pid": os.getpid(),
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    def _in_ns(self, ns: str, script: str) -> None:
        _sh(["ip", "netns", "exec", ns, "sh", "-ec", script])

    def _create_namespaces(self) -> None:
        layout = self.layout
        for ns in layout.namespaces:
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._in_ns(
                ns,
                "echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter; echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter",
            )
        self._in_ns(layout.router_netns, "echo 1 > /proc/sys/net/ipv4/ip_forward")

    def _limit_cpu(self) -> None:
        """One cgroup per cluster with its CPU quota (nothing without ``cpus_per_gpu``)."""
        if self.cpus_per_gpu is None:
            return
        hierarchy = cpu_hierarchy()
        if hierarchy is None:
            raise PreconditionError("cpus_per_gpu needs the cgroup cpu controller (none is writable here)")
        for s in self.layout.clusters:
            cores = self.cpu_limit(s.name)
            assert cores is not None
            self._cpu_groups[s.name] = create_group(hierarchy, self.prefix, s.netns, cores,
                                                    period_us=self.cpu_period_us)
        if self.halt_poll:
            self._halt_poll_ns = hold_halt_polling(self.prefix, self.cpu_period_us * 1000)
            log.info("testbed_halt_polling", prefix=self.prefix, guest_halt_poll_ns=self._halt_poll_ns)

    def _create_links(self) -> None:
        layout = self.layout
        r = layout.router_netns
        for s in layout.clusters:
            _sh(["ip", "-n", r, "link", "add", s.router_iface, "type", "veth", "peer", "name", CLUSTER_IFACE,
                 "netns", s.netns])
            _sh(["ip", "-n", r, "addr", "add", f"{s.gateway}/24", "dev", s.router_iface])
            # one segment per packet until _shape sizes the GSO packets for this cluster's pairs
            _sh(["ip", "-n", r, "link", "set", s.router_iface, "gso_max_segs", "1", "up"])
            _sh(["ip", "-n", s.netns, "addr", "add", f"{s.address}/24", "dev", CLUSTER_IFACE])
            _sh(["ip", "-n", s.netns, "link", "set", CLUSTER_IFACE, "up"])
            _sh(["ip", "-n", s.netns, "route", "add", "default", "via", s.gateway])
        if self.host_access:
            h = layout.host_iface
            _sh(["ip", "link", "add", h, "type", "veth", "peer", "name", "host", "netns", r])
            _sh(["ip", "addr", "add", f"{layout.host_address}/24", "dev", h])
            _sh(["ip", "link", "set", h, "up"])
            _sh(["ip", "-n", r, "addr", "add", f"{layout.router_host_address}/24", "dev", "host"])
            _sh(["ip", "-n", r, "link", "set", "host", "up"])
            _sh(["ip", "route", "add", layout.subnet, "via", layout.router_host_address, "dev", h])
            Path(f"/proc/sys/net/ipv4/conf/{h}/route_localnet").write_text("1\n")
            Path(f"/proc/sys/net/ipv4/conf/{h}/rp_filter").write_text("0\n")
            _sh([self._backend, "-t", "nat", "-I", "PREROUTING", "-i", h, "-d", layout.host_address, "-p", "tcp",
                 "-m", "comment", "--comment", _RULE_COMMENT.format(prefix=self.prefix),
                 "-j", "DNAT", "--to-destination", "127.0.0.1"])

    @staticmethod
    def _class_cmd(verb: str, iface: str, src_index: int, gbps: float) -> str:
        burst = _burst(gbps)
        return (f"class {verb} dev {iface} parent 1: classid 1:{src_index + 1:x} htb rate {_rate(gbps)} "
                f"ceil {_rate(gbps)} burst {burst} cburst {burst} quantum 60000")

    def _shape(self) -> None:
        layout = self.layout
        pairs = self.pairs()
        lines: list[str] = []
        for d in layout.clusters:
            dev = d.router_iface
            lines.append(f"qdisc add dev {dev} root handle 1: htb default {DEFAULT_CLASS_MINOR:x} r2q 100")
            lines.append(f"class add dev {dev} parent 1: classid 1:{DEFAULT_CLASS_MINOR:x} htb rate {_DEFAULT_RATE}"
                         f" burst {_DEFAULT_BURST} cburst {_DEFAULT_BURST} quantum 60000")
            for s in layout.clusters:
                if s.index == d.index:
                    continue
                lines.append(self._class_cmd("add", dev, s.index, pairs[(s.name, d.name)].bandwidth_gbps))
                lines.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip src {s.address}/32 "
                             f"flowid 1:{s.index + 1:x}")
        _sh(["tc", "-n", layout.router_netns, "-batch", "-"], stdin="\n".join(lines) + "\n")
        self._size_gso(pairs, [d.name for d in layout.clusters])

    def _size_gso(self, pairs: Mapping[tuple[str, str], PairShaping], destinations: Iterable[str]) -> None:
        """Set each destination's router veth ``gso_max_segs`` from the slowest of ``pairs`` into it
        (:func:`_gso_segs`), in one ``ip -batch``. The kernel reads it when a connection is set up, so a
        connection opened before a rate decrease keeps its larger packets (at most 1 ms at the old rate) until
        it reconnects."""
        lines = []
        for name in destinations:
            slowest = min((p.bandwidth_gbps for (src, dst), p in pairs.items() if dst == name and src != name),
                          default=0.0)
            lines.append(f"link set dev {self.layout.slot(name).router_iface} gso_max_segs {_gso_segs(slowest)}")
        if lines:
            _sh(["ip", "-n", self.layout.router_netns, "-batch", "-"], stdin="\n".join(lines) + "\n")

    def _redirect(self) -> None:
        layout = self.layout
        ipt = ["ip", "netns", "exec", layout.router_netns, self._backend, "-t", "nat"]
        _sh([*ipt, "-N", "SF_RELAY"])
        _sh([*ipt, "-A", "SF_RELAY", "-s", layout.host_subnet, "-j", "RETURN"])
        _sh([*ipt, "-A", "SF_RELAY", "-d", layout.host_subnet, "-j", "RETURN"])
        for port in self.passthrough_ports:
            _sh([*ipt, "-A", "SF_RELAY", "-p", "tcp", "--dport", str(port), "-j", "RETURN"])
        for s in layout.clusters:
            _sh([*ipt, "-A", "SF_RELAY", "-d", s.gateway, "-j", "RETURN"])
        _sh([*ipt, "-A", "SF_RELAY", "-p", "tcp", "-s", layout.subnet, "-d", layout.subnet,
             "-j", "REDIRECT", "--to-ports", str(self.relay_port)])
        _sh([*ipt, "-A", "PREROUTING", "-p", "tcp", "-j", "SF_RELAY"])

    def _gateway_rules(self) -> None:
        """The firewall between regions (router, ``mangle PREROUTING``: before the relay's REDIRECT, so
        the original destination port is what is checked) and each namespace's NAT to its gateway."""
        layout = self.layout
        if self.gateway_port is None:
            return
        gw = str(self.gateway_port)
        if self.gateway_firewall:
            self._firewall(gw)
        if self.gateway_redirect_port is None:
            return
        for s in layout.clusters:
            nat = ["ip", "netns", "exec", s.netns, self._backend, "-t", "nat"]
            _sh([*nat, "-N", "SF_GATEWAY"])
            _sh([*nat, "-A", "SF_GATEWAY", "-p", "tcp", "--dport", gw, "-j", "RETURN"])
            for other in layout.clusters:
                if other.index != s.index:
                    _sh([*nat, "-A", "SF_GATEWAY", "-p", "tcp", "-d", other.subnet, "-j", "REDIRECT",
                         "--to-ports", str(self.gateway_redirect_port)])
            _sh([*nat, "-A", "OUTPUT", "-p", "tcp", "-j", "SF_GATEWAY"])

    def _firewall(self, gw: str) -> None:
        layout = self.layout
        ipt = ["ip", "netns", "exec", layout.router_netns, self._backend, "-t", "mangle"]
        _sh([*ipt, "-N", "SF_FIREWALL"])
        _sh([*ipt, "-A", "SF_FIREWALL", "-s", layout.host_subnet, "-j", "RETURN"])
        _sh([*ipt, "-A", "SF_FIREWALL", "-d", layout.host_subnet, "-j", "RETURN"])
        for s in layout.clusters:
            _sh([*ipt, "-A", "SF_FIREWALL", "-d", s.gateway, "-j", "RETURN"])
        _sh([*ipt, "-A", "SF_FIREWALL", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"])
        _sh([*ipt, "-A", "SF_FIREWALL", "-p", "tcp", "--dport", gw, "-j", "RETURN"])
        _sh([*ipt, "-A", "SF_FIREWALL", "-p", "tcp", "-s", layout.subnet, "-d", layout.subnet, "-j", "DROP"])
        _sh([*ipt, "-A", "PREROUTING", "-p", "tcp", "-j", "SF_FIREWALL"])

    def _pair_rows(self) -> list[list[float]]:
        layout = self.layout
        return [
            [layout.slot(p.src).index, layout.slot(p.dst).index, p.bandwidth_gbps, p.latency_ms]
            for p in self.pairs().values()
        ]

    def _write_relay_config(self) -> Path:
        layout = self.layout
        config = {
            "port": self.relay_port,
            "control": str(self.control_socket),
            "connect_retry_s": self.connect_retry_s,
            "addresses": {s.address: s.index for s in layout.clusters},
            "pairs": self._pair_rows(),
        }
        cfg = self.state_dir / f"{self.prefix}.relay.json"
        tmp = cfg.with_suffix(".tmp")
        tmp.write_text(json.dumps(config))
        tmp.replace(cfg)
        return cfg

    def _start_relay(self, *, status: str = "starting") -> None:
        """Start the relay in the router namespace and wait until its control socket answers."""
        layout = self.layout
        cfg = self._write_relay_config()
        logfile = self.state_dir / f"{self.prefix}.relay.log"
        with open(logfile, "ab") as out:
            self._relay = subprocess.Popen(
                ["ip", "netns", "exec", layout.router_netns, self.python, "-m", "spiderflow.testbed.relay",
                 "--config", str(cfg)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._write_state(status)
        deadline = time.monotonic() + 15.0
        while True:
            if self._relay.poll() is not None:
                tail = logfile.read_text()[-500:]
                raise TestbedError(f"the relay exited with code {self._relay.returncode}: {tail}")
            try:
                self._control({"op": "ping"}, timeout=1.0)
                return
            except TestbedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _control(self, request: Mapping[str, Any], *, timeout: float = 5.0) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(str(self.control_socket))
                s.sendall((json.dumps(request) + "\n").encode())
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
        except OSError as e:
            raise TestbedError(f"relay control socket {self.control_socket}: {e}") from None
        try:
            resp: dict[str, Any] = json.loads(buf)
        except ValueError:
            raise TestbedError(f"relay control socket: bad answer {buf[:200]!r}") from None
        if not resp.get("ok"):
            raise TestbedError(f"relay refused {request.get('op')}: {resp.get('error')}")
        return resp
