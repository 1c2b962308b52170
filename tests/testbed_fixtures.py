"""Shared helpers of the tests on the emulated testbed (network namespaces, kernel-shaped links; root only).

- :func:`netns_skip_reason` — why the testbed cannot run here (None when it can); modules skip with it.
- :func:`leftovers_of_testbed` — what of a testbed is still on the machine after ``down()`` (empty: nothing).
- :class:`LiveMesh` — etcd and the topology service on the host's loopback, one ``spiderflow agent`` per
  cluster inside its namespace (reaching the host through the testbed's DNAT), optionally a scheduler;
  :meth:`LiveMesh.close` stops everything it started.
- :func:`live_mesh` — a testbed plus its :class:`LiveMesh`, torn down and checked for leftovers afterwards.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from spiderflow.core.domain import Topology
from spiderflow.core.errors import SpiderFlowError
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.store.process import EtcdProcess
from spiderflow.testbed import Testbed, check_environment, cleanup
from spiderflow.testbed.cpu import cpu_hierarchy

__all__ = ["NICE", "ROOT", "LiveMesh", "leftovers_of_testbed", "live_mesh", "netns_skip_reason"]

ROOT = Path(__file__).resolve().parents[1]
# Agents and probes are measuring instruments: a raised priority keeps a shared machine's load out of RTTs.
NICE = ["nice", "-n", "-5"]


def netns_skip_reason(probe: str = "sfnetnschk") -> str | None:
    """Why the testbed cannot run here (not root, tools missing, ``ip netns add`` refused), or None."""
    try:
        check_environment()
    except SpiderFlowError as e:
        return str(e)
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "'ip netns add' is not usable here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def leftovers_of_testbed(prefix: str) -> list[str]:
    """Everything of testbed ``prefix`` still on the machine: namespaces, the host veth and route, the
    host's DNAT rule (empty when fully removed)."""
    left = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(f"{prefix}-")]
    if subprocess.run(["ip", "link", "show", f"{prefix}-host"], capture_output=True).returncode == 0:
        left.append(f"link {prefix}-host")
    for exe in ("iptables", "iptables-legacy"):
        rules = subprocess.run([exe, "-t", "nat", "-S"], capture_output=True, text=True).stdout
        if f"spiderflow-testbed:{prefix}" in rules:
            left.append(f"{exe} rule")
    if f"{prefix}-host" in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout:
        left.append("host route")
    hierarchy = cpu_hierarchy()
    if hierarchy is not None and hierarchy.base(prefix).exists():
        left.append(f"cgroup {hierarchy.base(prefix)}")
    return left


class LiveMesh:
    """etcd, the topology service, the agents of one testbed and optionally a scheduler.

    ``agent_flags`` are appended to every agent's command line (probe and lease settings); ``topology_flags``
    to the topology service's. Every process gets ``PYTHONPATH`` = the repository.
    """

    def __init__(self, tb: Testbed, tmp: Path, *, agent_flags: Sequence[str] = (),
                 topology_flags: Sequence[str] = ("--link-max-age", "30"), gpu: str = "A100-80G",
                 gpus_per_node: int = 8) -> None:
        self.tb = tb
        self.tmp = tmp
        self.agent_flags = list(agent_flags)
        self.topology_flags = list(topology_flags)
        self.gpu = gpu
        self.gpus_per_node = gpus_per_node
        self.etcd = EtcdProcess()
        self.service: ManagedProcess | None = None
        self.scheduler: ManagedProcess | None = None
        self.agents: dict[str, ManagedProcess] = {}
        self.started: list[ManagedProcess] = []

    @property
    def address(self) -> str:
        """The topology service's address on the host."""
        assert self.service is not None
        return self.service.address

    def _env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(ROOT)}

    def start(self) -> LiveMesh:
        """etcd (from the calling thread: start it from the main thread), the topology service, the agents."""
        self.etcd.start()
        self.service = ManagedProcess(
            "topology",
            spiderflow_argv("serve", "topology", "--listen", "127.0.0.1:0", "--etcd", self.etcd.endpoint,
                            "--log-format", "json", *self.topology_flags),
            log_dir=self.tmp, env=self._env(),
        ).start()
        self.started.append(self.service)
        spawned = [self.start_agent(name, wait=False) for name in self.tb.topology.names]  # side by side
        for proc in spawned:
            proc.wait_ready(timeout=60)
        return self

    def start_agent(self, cluster: str, *, wait: bool = True) -> ManagedProcess:
        """A ``spiderflow agent`` for ``cluster`` inside its namespace (a new process each call); with
        ``wait=False`` it is only spawned (:meth:`ManagedProcess.wait_ready` then waits for it)."""
        host = self.tb.host_address
        etcd_port = self.etcd.endpoint.rpartition(":")[2]
        service_port = self.address.rpartition(":")[2]
        proc = ManagedProcess(
            f"agent-{cluster}-{len(self.started)}",
            spiderflow_argv("agent", "--cluster", cluster, "--etcd", f"{host}:{etcd_port}",
                            "--topology-service", f"{host}:{service_port}",
                            "--listen", f"{self.tb.address(cluster)}:0", "--gpu", self.gpu, "--nodes", "1",
                            "--gpus-per-node", str(self.gpus_per_node), "--log-format", "json",
                            *self.agent_flags),
            log_dir=self.tmp, env={**self.tb.environment(cluster), **self._env()},
            prefix=["ip", "netns", "exec", self.tb.netns(cluster), *NICE],
        )
        self.started.append(proc)
        self.agents[cluster] = proc.start(timeout=60) if wait else proc.spawn()
        return proc

    def start_scheduler(self, *flags: str) -> ManagedProcess:
        """A scheduler on the host reading the live topology from the topology service."""
        self.scheduler = ManagedProcess(
            "scheduler",
            spiderflow_argv("serve", "scheduler", "--listen", "127.0.0.1:0", "--etcd", self.etcd.endpoint,
                            "--topology-service", self.address, "--log-format", "json", *flags),
            log_dir=self.tmp, env=self._env(),
        ).start(timeout=60)
        self.started.append(self.scheduler)
        return self.scheduler

    def close(self) -> None:
        """Stop the agents (signalled side by side, then each awaited), then the services, then etcd."""
        agents = [p for p in self.started if p is not self.service and p is not self.scheduler]
        for proc in agents:
            with contextlib.suppress(Exception):
                proc.signal(signal.SIGTERM)
        for proc in reversed(self.started):
            with contextlib.suppress(Exception):
                proc.stop(grace_s=5)
        self.etcd.close()

    def leftovers(self) -> list[str]:
        """Processes of the mesh still alive (empty after :meth:`close`)."""
        left = [f"{p.name} pid {p.proc.pid}" for p in self.started if p.proc is not None and p.proc.poll() is None]
        if self.etcd.running:
            left.append(f"etcd pid {self.etcd.pid}")
        return left


@contextlib.contextmanager
def live_mesh(topology: Topology, prefix: str, tmp: Path, **mesh: object) -> Iterator[LiveMesh]:
    """A testbed for ``topology`` under ``prefix`` with a started :class:`LiveMesh` (``mesh`` = its keyword
    arguments). Afterwards every process is stopped and the testbed removed; an AssertionError names
    whatever is left."""
    state = tmp / "state"
    cleanup(prefix, state_dir=state)
    tb = Testbed(topology, prefix=prefix, state_dir=state)
    m = LiveMesh(tb, tmp, **mesh)  # type: ignore[arg-type]
    try:
        tb.up()
        m.start()
        yield m
    finally:
        try:
            m.close()
        finally:
            tb.down()
    assert m.leftovers() == []
    assert leftovers_of_testbed(prefix) == []
