"""A complete SpiderFlow mesh on one machine: embedded etcd, the three services and one agent per cluster.

This is what ``spiderflow up`` runs and what the end-to-end tests start: every component is a separate
process on real ports, started exactly as an operator would (``spiderflow serve ...``,
``spiderflow agent ...``). Agents run on loopback, or — with ``testbed=True`` (root) — inside the emulated
multi-region testbed's network namespaces with kernel-shaped links.

With ``etcd_tls=True`` the embedded etcd serves only TLS and requires client certificates of its own CA:
``spiderflow certs init`` material is written under ``<workdir>/certs`` (the ``etcd-server`` certificate is
also valid for the testbed's host address), and the topology service and the scheduler connect with
``--etcd-tls-dir <workdir>/certs/etcd-client``. Agents never get etcd's address or credentials: they reach the
control plane's state through the scheduler's ``Control`` API (``--scheduler``). gRPC between the components
stays plaintext on loopback (the services refuse plaintext on any other address).

With ``gateway=True`` (needs ``testbed``) the clusters talk across regions only through their gateways
(:mod:`spiderflow.gateway`): the testbed's router drops cluster-to-cluster TCP except to the gateway port,
each namespace's NAT sends cross-cluster TCP to its gateway's local port, and every agent starts its
cluster's gateway beside itself (its ``gateway:`` section in ``<workdir>/agent-<cluster>.json``, certificates
of ``spiderflow certs init`` under ``<workdir>/gateway-certs``, mutual TLS between the gateways).

Contract: :meth:`LocalMesh.start` either returns with everything serving and every cluster registered, or
raises after stopping whatever it had started; :meth:`LocalMesh.stop` (also on ``with`` exit) stops every
process and removes every namespace, and is idempotent.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import structlog

from spiderflow.core.domain import Cluster, Topology
from spiderflow.core.errors import UnavailableError, ValidationError
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.store.process import EtcdProcess

__all__ = ["GATEWAY_PORT", "GATEWAY_REDIRECT_PORT", "SAMPLE_CLUSTERS", "LocalMesh", "sample_topology"]

log = structlog.get_logger(__name__)

GATEWAY_PORT = 15443
"""The gateways' public (mTLS) port on the testbed: the only TCP port open between its clusters."""
GATEWAY_REDIRECT_PORT = 15080
"""Where each testbed namespace's NAT sends cross-cluster TCP (the gateway's local port)."""

SAMPLE_CLUSTERS = ("virginia", "frankfurt", "tokyo", "oregon", "sao-paulo", "sydney", "mumbai", "london")


def sample_topology(n: int = 3) -> Topology:
    """``n`` single-"GPU" CPU clusters (one worker process each), fully linked: the local demo topology.

    On loopback the links are as fast as the machine; with the testbed they get the shaped figures below.
    """
    from spiderflow.core.domain import Link

    if not 1 <= n <= len(SAMPLE_CLUSTERS):
        raise ValidationError("--clusters", f"must be between 1 and {len(SAMPLE_CLUSTERS)}", n)
    names = SAMPLE_CLUSTERS[:n]
    clusters = tuple(
        Cluster(name=name, gpu="cpu", nodes=1, gpus_per_node=1, electricity_usd_per_kwh=0.05 + 0.03 * i)
        for i, name in enumerate(names)
    )
    links = tuple(
        Link(a=names[i], b=names[j], bandwidth_gbps=0.4 if (i + j) % 2 else 0.2, latency_ms=5.0 + 10.0 * (j - i))
        for i in range(n) for j in range(i + 1, n)
    )
    return Topology(clusters=clusters, links=links)


def _port_if_free(port: int) -> int:
    """``port`` when nothing listens on it on loopback now, else 0 (any free port)."""
    if not port:
        return 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return 0
    return port


class LocalMesh:
    """Start/stop a mesh for ``topology`` with its logs under ``workdir`` (a temp dir when None).

    Agents are spawned side by side, so their CPU calibrations (``--profile-seconds profile_seconds``,
    about four times that long; :mod:`agent.profiler`) run at the same time: each measures the share of a
    core it gets while the other co-located clusters' workers are busy too, as they are in a pipeline."""

    def __init__(self, topology: Topology, *, workdir: Path | None = None, testbed: bool = False,
                 scheduler_args: Sequence[str] = (), agent_args: Sequence[str] = (), lease_ttl: int = 4,
                 keep_workdir: bool = False, testbed_prefix: str = "sf", profile_seconds: float = 1.5,
                 etcd_tls: bool = False, service_ports: dict[str, int] | None = None,
                 cluster_args: Mapping[str, Sequence[str]] | None = None,
                 agents_dir: Path | None = None, dashboard_port: int | None = None,
                 gateway: bool = False, cpus_per_gpu: float | None = None) -> None:
        self.topology = topology
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="spiderflow-mesh-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.testbed_enabled = testbed
        if gateway and not testbed:
            from spiderflow.core.errors import ValidationError

            raise ValidationError("--gateway", "needs --testbed (the firewall and the NAT live in its namespaces)")
        self.gateway = gateway
        if cpus_per_gpu is not None and not testbed:
            from spiderflow.core.errors import ValidationError

            raise ValidationError("--cpus-per-gpu", "needs --testbed (the limits are per testbed cluster)")
        self.cpus_per_gpu = cpus_per_gpu
        """With the testbed: each cluster's CPU quota per "GPU" (:mod:`spiderflow.testbed.cpu`); None: none."""
        self.testbed_prefix = testbed_prefix
        self.scheduler_args = list(scheduler_args)
        self.agent_args = list(agent_args)
        self.cluster_args = {name: list(args) for name, args in (cluster_args or {}).items()}
        """More agent arguments for one cluster's agent (e.g. ``--config`` naming its launcher)."""
        self.lease_ttl = lease_ttl
        self.profile_seconds = profile_seconds
        self.keep_workdir = keep_workdir
        self.agents_dir = agents_dir or self.workdir / "agents"
        self.dashboard_port = dashboard_port
        """Serve the scheduler's web dashboard on this loopback port (0: any; taken: any); None: none."""
        """The agents' work directories (``<agents_dir>/<cluster>``: workers' specs and logs); outside
        ``workdir`` they outlive the mesh (``spiderflow up`` keeps them under the state directory)."""
        self.etcd_tls = etcd_tls
        self.service_ports = dict(service_ports or {})
        """Preferred loopback port per service (e.g. the clients' defaults); a taken one falls back to any."""
        self.etcd_args: list[str] = []
        """``--etcd-tls-dir DIR`` of the services once started with ``etcd_tls`` (else empty; agents get none)."""
        self.etcd: EtcdProcess | None = None
        self.services: dict[str, ManagedProcess] = {}
        self.agents: dict[str, ManagedProcess] = {}
        self.testbed: Any = None
        self._stopped = False

    # -- addresses ------------------------------------------------------------------------------------

    @property
    def etcd_endpoint(self) -> str:
        assert self.etcd is not None
        return self.etcd.endpoint

    def address(self, service: str) -> str:
        return self.services[service].address

    @property
    def dashboard_url(self) -> str | None:
        """The scheduler's dashboard URL (with ``dashboard_port``), once started."""
        proc = self.services.get("scheduler")
        url = proc.ready_doc.get("dashboard") if proc is not None else None
        return str(url) if url else None

    def addresses(self) -> dict[str, str]:
        return {"etcd": self.etcd_endpoint, **{name: p.address for name, p in self.services.items()}}

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> Self:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _service(self, name: str, *args: str) -> ManagedProcess:
        return self._services((name, args))[0]

    def _services(self, *specs: tuple[str, Sequence[str]]) -> list[ManagedProcess]:
        """Start services ``(name, args)`` side by side (their imports overlap); each listens on its
        preferred port when that is free, else (or if it was taken meanwhile) on any port."""
        spawned = []
        for name, args in specs:
            port = _port_if_free(self.service_ports.get(name, 0))
            spawned.append((name, args, port, self._spawn_service(name, port, args)))
        started: list[ManagedProcess] = []
        try:
            for name, args, port, proc in spawned:
                try:
                    proc.wait_ready(timeout=60)
                except UnavailableError:
                    if not port:
                        raise
                    proc = self._spawn_service(name, 0, args).wait_ready(timeout=60)  # port taken meanwhile
                self.services[name] = proc
                log.info("mesh.service_started", service=name, address=proc.address, pid=proc.pid)
                started.append(proc)
        except BaseException:
            for name, _, _, proc in spawned:
                if name not in self.services:  # the registered ones go with the mesh's stop()
                    with contextlib.suppress(Exception):
                        proc.stop(grace_s=5)
            raise
        return started

    def _spawn_service(self, name: str, port: int, args: Sequence[str]) -> ManagedProcess:
        argv = spiderflow_argv("serve", name, "--listen", f"127.0.0.1:{port}", "--log-format", "json", *args)
        return ManagedProcess(name, argv, log_dir=self.workdir / "logs").spawn()

    def _start(self, timeout: float) -> None:
        host = "127.0.0.1"
        prefix: list[str] = []
        if self.testbed_enabled:  # first: etcd's certificate names the address agents reach it at
            from spiderflow.testbed import Testbed

            testbed = Testbed(self.topology, prefix=self.testbed_prefix,
                              gateway_port=GATEWAY_PORT if self.gateway else None,
                              gateway_redirect_port=GATEWAY_REDIRECT_PORT if self.gateway else None,
                              cpus_per_gpu=self.cpus_per_gpu)
            testbed.up()  # cleans up after itself if it fails; never take down another run's testbed of this prefix
            self.testbed = testbed
            host = testbed.host_address
        data = self.workdir / "etcd"
        tls = None
        if self.etcd_tls:
            from spiderflow.security.certs import init_certs
            from spiderflow.store.tls import EtcdTLS

            certs = self.workdir / "certs"
            init_certs(certs, hosts=[host] if host != "127.0.0.1" else [], admin=False)
            tls = EtcdTLS.from_dir(certs / "etcd-server", require_cert=True)
            self.etcd_args = ["--etcd-tls-dir", str(certs / "etcd-client")]
        self.etcd = EtcdProcess(data_dir=data, tls=tls)
        self.etcd.start()
        topo, planner = self._services(("topology", ("--etcd", self.etcd_endpoint, *self.etcd_args)),
                                       ("planner", ()))
        self._service("scheduler", "--etcd", self.etcd_endpoint, *self.etcd_args, "--topology-service", topo.address,
                      "--planner", planner.address, *self.scheduler_args,
                      *(["--dashboard-listen", f"127.0.0.1:{_port_if_free(self.dashboard_port)}"]
                        if self.dashboard_port is not None else []))
        for c in self.topology.clusters:  # spawned side by side (imports and profiling overlap), then awaited
            self.agents[c.name] = self._agent(c, host, prefix, wait=False)
        for c in self.topology.clusters:
            proc = self.agents[c.name].wait_ready(timeout=90)
            log.info("mesh.agent_started", cluster=c.name, address=proc.address, pid=proc.pid)
        self.wait_for_clusters(len(self.topology.clusters), timeout=timeout)

    def _agent_argv(self, c: Cluster, host: str) -> list[str]:
        listen = f"{self.testbed.address(c.name)}:0" if self.testbed is not None else "127.0.0.1:0"
        def remote(addr: str) -> str:
            return addr.replace("127.0.0.1", host) if self.testbed is not None else addr

        argv = spiderflow_argv(
            # agents get the control plane's address, never etcd's (nor its credentials)
            "agent", "--cluster", c.name,
            "--topology-service", remote(self.address("topology")), "--scheduler", remote(self.address("scheduler")),
            "--listen", listen, "--gpu", c.gpu, "--nodes", str(c.nodes), "--gpus-per-node", str(c.gpus_per_node),
            "--electricity", str(c.electricity_usd_per_kwh), "--lease-ttl", str(self.lease_ttl),
            "--work-dir", str(self.agents_dir / c.name), "--checkpoint-dir", str(self.workdir / "checkpoints"),
            "--log-format", "json", "--profile-seconds", str(self.profile_seconds), *self.agent_args,
            *self.cluster_args.get(c.name, ()),
        )
        if c.free_gpus is not None and c.free_gpus != c.total_gpus:
            argv += ["--free-gpus", str(c.free_gpus)]
        if self.gateway:
            argv += ["--config", str(self._gateway_file(c.name))]
        return argv

    def _gateway_file(self, cluster: str) -> Path:
        """The agent config file carrying ``cluster``'s ``gateway:`` section (and its certificates)."""
        import json

        from spiderflow.gateway.protocol import config_to_dict
        from spiderflow.security.certs import init_certs

        certs = self.workdir / "gateway-certs"
        if not (certs / f"agent-{cluster}" / "server.crt").exists():
            init_certs(certs, clusters=[c.name for c in self.topology.clusters], etcd=False, admin=False)
        path = self.workdir / f"agent-{cluster}.json"
        section = self.testbed.gateway_config(cluster, tls_dir=str(certs / f"agent-{cluster}"))
        path.write_text(json.dumps({"gateway": config_to_dict(section)}))
        return path

    def _agent(self, c: Cluster, host: str, prefix: list[str], *, wait: bool = True) -> ManagedProcess:
        argv = self._agent_argv(c, host)
        if self.testbed is not None:
            env = {k: v for k, v in self.testbed.environment(c.name).items() if k.startswith(("SPIDERFLOW_TESTBED",
                                                                                                "GLOO_", "TP_"))}
            proc = ManagedProcess(f"agent-{c.name}", argv, log_dir=self.workdir / "logs", env=env,
                                  prefix=self.testbed.launch_prefix(c.name))
        else:
            proc = ManagedProcess(f"agent-{c.name}", argv, log_dir=self.workdir / "logs")
        if not wait:
            return proc.spawn()
        proc.start(timeout=90)
        log.info("mesh.agent_started", cluster=c.name, address=proc.address, pid=proc.pid)
        return proc

    def wait_for_clusters(self, n: int, timeout: float = 60.0) -> Topology:
        """Block until the topology service lists ``n`` clusters (their agents registered and profiled) and a
        measured link in both directions of every link of the mesh's topology (each end's agent has probed
        it once: every measured link is one direction, its source agent's).

        Without the links, the scheduler would place the first job on the figures of the links measured so
        far (a pair not yet probed is priced through the others, a cluster whose own probes have not landed
        is unreachable from), and re-place it a moment later when the rest arrive."""
        from spiderflow.sdk import Client

        want = {pair for link in self.topology.links for pair in ((link.a, link.b), (link.b, link.a))}
        deadline = time.monotonic() + timeout
        last = 0
        measured = 0
        why = ""
        while time.monotonic() < deadline:
            try:
                with Client(self.address("scheduler"), topology=self.address("topology"), timeout_s=5) as sf:
                    topo = sf.topology()
                last = len(topo.clusters)
                measured = len(want & {pair for link in topo.links for pair in link.directions})
                if last >= n and measured == len(want):
                    return topo
            except UnavailableError:  # not answering yet
                pass
            except ValidationError as e:  # no cluster yet: an agent is ready before its registration lands
                why = f" ({e})"
            for name, proc in self.agents.items():
                if not proc.alive():
                    raise UnavailableError(f"agent {name} exited: {proc.tail()}")
            time.sleep(0.25)
        if last < n:
            raise UnavailableError(f"only {last} of {n} clusters registered within {timeout:.0f} s{why}")
        raise UnavailableError(f"only {measured} of the {len(want)} link directions between the clusters were measured "
                               f"within {timeout:.0f} s")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for proc in self.agents.values():  # agents deregister side by side; then each is awaited
            with contextlib.suppress(Exception):
                proc.signal(signal.SIGTERM)
        for name, proc in list(self.agents.items()):
            with contextlib.suppress(Exception):
                proc.stop(grace_s=10)
            log.info("mesh.agent_stopped", cluster=name)
        names = [n for n in ("scheduler", "planner", "topology") if n in self.services]
        for name in names:  # the services drain side by side too; then each is awaited
            with contextlib.suppress(Exception):
                self.services[name].signal(signal.SIGTERM)
        for name in names:
            with contextlib.suppress(Exception):
                self.services[name].stop(grace_s=10)
        if self.testbed is not None:
            with contextlib.suppress(Exception):
                self.testbed.down()
        if self.etcd is not None:
            with contextlib.suppress(Exception):
                self.etcd.close()
        if self._own_dir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
