"""Agent configuration: a YAML/JSON file (``--config``) and command-line flags (flags win).

File format (every key optional except where the command line provides it)::

    cluster: virginia
    topology_service: 127.0.0.1:50052
    scheduler: 127.0.0.1:50051     # the control plane: every scheduler replica, comma-separated. The agent's
                                   # registration, assignments, rendezvous, checkpoint manifests and reports
                                   # go through its Control and Scheduler APIs (any replica that answers);
                                   # the agent holds no etcd credentials
    # etcd: 127.0.0.1:2379         # DEVELOPMENT ONLY, and only without `scheduler`: an agent that measures
                                   # and reports its cluster but runs no stages, reading etcd directly
    work_dir: /var/lib/spiderflow  # worker specs and logs (default: a directory under the system temp dir)
    checkpoint_dir: /mnt/shared/ckpt  # checkpoint root every agent mounts at the same path (default:
                                   # <work_dir>/checkpoints, enough when all agents share one machine)
    checkpoint_every: 10           # steps between checkpoints of the jobs whose rank 0 runs here (0: none)
    log_retention_days: 7          # workers' logs are deleted this long after a job's last output (0: never)
    listen: 10.77.0.2:0            # where the Agent service listens (port 0 = any free port)
    advertise: 10.77.0.2:7000      # what peers dial (default: the listen address, see below)
    tls_dir: certs/agent-virginia  # mTLS bundle (``spiderflow certs init --cluster virginia``): the Agent
                                   # service, and its calls to the topology service, the scheduler and peers
    # etcd_tls_dir, etcd_user      # DEVELOPMENT ONLY, with `etcd`: TLS to etcd and its user (password only
                                   # from $SPIDERFLOW_ETCD_PASSWORD)
    token: <secret>                # bearer token sent to the topology service and the scheduler (mapped to
                                   # ``agent:<cluster>`` in their --tokens file); prefer $SPIDERFLOW_TOKEN
    agent_id: virginia-a1          # default: <cluster>-<random hex>, new at every start
    lease_ttl_s: 8                 # registration lease; the cluster vanishes ≤ TTL after the agent dies
    profile_interval_s: 30         # re-send the profile this often
    profile_seconds: 0.5           # duration of the timed matmul
    recalibrate_interval_s: 0      # re-measure the devices this often, when idle (0: only on SIGHUP)
    gpus:                          # declare an emulated cluster instead of profiling local devices
      gpu: A100-80G
      nodes: 2
      gpus_per_node: 8
      tflops: 250                  # optional: else measured for ``cpu``, catalog peak for others
      memory_gib: 80               # optional
    free_gpus: 12                  # GPUs offered to SpiderFlow (default: all)
    electricity_usd_per_kwh: 0.08
    region: us-east-1
    probe:
      period_s: 10
      echo_count: 5
      echo_bytes: 64
      bulk_bytes: 4194304
      bulk_max_s: 2.0
      chunk_bytes: 262144
      timeout_s: 5.0
      serve_cap_bytes: 67108864
      busy_mode: latency           # or "pause"
    launcher: local                # how workers start: local | slurm | kubernetes (agent.launchers)
    slurm:                         # with launcher: slurm (see SlurmConfig; docs/operations.md)
      partition: gpu
      account: ml-team
      time_limit: "04:00:00"
    kubernetes:                    # with launcher: kubernetes (see KubernetesConfig; docs/operations.md)
      image: registry.example.com/spiderflow:0.1.0
      namespace: training
    gateway:                       # one gateway per cluster (spiderflow.gateway; docs/operations.md)
      enabled: true                # the agent starts it beside itself
      port: 15443                  # the one mTLS port peers dial
      redirect: 127.0.0.1:15080    # where the node NAT sends outbound cross-cluster TCP
      ranges: [10.1.0.0/16]        # this cluster's node addresses (the only inbound destinations)
      peers:
        - {cluster: ohio, address: gw.ohio.example.org:15443, ranges: [10.2.0.0/16]}

Probe traffic per period: each agent probes each of its ``N − 1`` peers once (one at a time), so with
``N`` agents a period moves at most ``N·(N−1)·(bulk_bytes + 2·echo_count·echo_bytes)`` bytes plus gRPC
framing — with the defaults and ``N = 4``: 12 × ≈4 MiB ≈ 48 MiB per 10 s (≈ 3.4 Mbit/s on average per
directed pair). Each bulk probe also stops after ``bulk_max_s`` seconds, so a slow link carries at most
``bandwidth × bulk_max_s`` per period. While the cluster trains (``busy``), no bulk probe is sent or
served: ``busy_mode: latency`` keeps the tiny echo probes (links stay fresh, bandwidth keeps its
smoothed value); ``pause`` stops probing altogether.

Advertised address: ``advertise`` if set; else the listen host with the bound port, unless the listen
host is a wildcard (``0.0.0.0``/``::``), in which case the local address the kernel would use to reach
the topology service (no packet is sent).

Identity towards the topology service and the scheduler: the certificate of ``tls_dir`` (its name is
the cluster) and/or the bearer ``token``; with either, the services bind the agent to its cluster.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from spiderflow.core.catalog import gpu_type
from spiderflow.core.errors import ValidationError
from spiderflow.formats import load_document
from spiderflow.gateway.protocol import GatewayConfig, gateway_config
from spiderflow.runtime import parse_hostport

__all__ = ["AgentConfig", "GpuDeclaration", "KubernetesConfig", "ProbeConfig", "SlurmConfig", "etcd_options",
           "load_config"]

BusyMode = Literal["latency", "pause"]
LauncherName = Literal["local", "slurm", "kubernetes"]


def _pos(name: str, value: float, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0 or (value == 0 and not zero):
        raise ValidationError(name, "must be " + ("≥ 0" if zero else "> 0"), value)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeConfig:
    """Probe sizes and timing (see the module docstring for the traffic they imply)."""

    period_s: float = 10.0
    echo_count: int = 5
    echo_bytes: int = 64
    bulk_bytes: int = 4 * 1024 * 1024
    bulk_max_s: float = 2.0
    chunk_bytes: int = 256 * 1024
    timeout_s: float = 5.0
    serve_cap_bytes: int = 64 * 1024 * 1024
    busy_mode: BusyMode = "latency"

    def __post_init__(self) -> None:
        for f in ("period_s", "bulk_max_s", "timeout_s"):
            _pos(f"probe.{f}", getattr(self, f))
        for f in ("echo_count", "bulk_bytes", "chunk_bytes", "serve_cap_bytes"):
            _pos(f"probe.{f}", getattr(self, f))
        _pos("probe.echo_bytes", self.echo_bytes, zero=True)
        if self.echo_bytes > 64 * 1024:
            raise ValidationError("probe.echo_bytes", "must be ≤ 65536 (a latency probe, not a bandwidth one)",
                                  self.echo_bytes)
        if self.chunk_bytes > self.bulk_bytes:
            raise ValidationError("probe.chunk_bytes", "must be ≤ probe.bulk_bytes", self.chunk_bytes)
        if self.busy_mode not in ("latency", "pause"):
            raise ValidationError("probe.busy_mode", "must be 'latency' or 'pause'", self.busy_mode)

    def traffic_per_period(self, agents: int) -> int:
        """Upper bound of probe bytes per period with ``agents`` agents (payload, without framing)."""
        return agents * (agents - 1) * (self.bulk_bytes + 2 * self.echo_count * self.echo_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuDeclaration:
    """An emulated cluster's GPUs: a catalog type and counts, optionally its throughput and memory."""

    gpu: str
    nodes: int = 1
    gpus_per_node: int = 1
    tflops: float | None = None
    memory_gib: float | None = None

    def __post_init__(self) -> None:
        gpu_type(self.gpu, field="gpus.gpu")
        for f in ("nodes", "gpus_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValidationError(f"gpus.{f}", "must be an integer ≥ 1", v)
        if self.tflops is not None:
            _pos("gpus.tflops", self.tflops)
        if self.memory_gib is not None:
            _pos("gpus.memory_gib", self.memory_gib)


def _opt_str(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValidationError(name, "must be a non-empty string", value)


def _str_list(name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise ValidationError(name, "must be a list of non-empty strings", value)
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmConfig:
    """The ``slurm`` launcher (:mod:`agent.launchers.slurm`): where and how batch jobs are submitted.

    ``partition``/``account``/``qos``/``time_limit`` (Slurm's formats, e.g. ``"04:00:00"``)/``constraint``
    go to ``sbatch`` when set; ``gpus``: one GPU per worker (``--gpus-per-task=1``), else
    ``cpus_per_task`` CPUs; ``sbatch_args``: more ``sbatch`` options (``["--exclusive"]``); ``python``: the
    workers' interpreter on the compute nodes (default: the agent's); ``slurm_conf``: ``SLURM_CONF`` of
    the Slurm commands; ``bin_dir``: where ``sbatch``/``srun``/``squeue``/``sacct``/``scancel`` are (default:
    ``PATH``); ``poll_s``: seconds between ``squeue`` polls; ``kill_wait_s``: how long a cancelled job may
    take to end before ``scancel --signal=KILL``; ``unreachable_s``: how long the Slurm controller may fail to
    answer ``squeue`` before the job is given up (cancelled, its stages failed)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = None
    constraint: str | None = None
    gpus: bool = True
    cpus_per_task: int = 1
    sbatch_args: tuple[str, ...] = ()
    python: str | None = None
    slurm_conf: str | None = None
    bin_dir: str | None = None
    poll_s: float = 1.0
    kill_wait_s: float = 30.0
    unreachable_s: float = 300.0

    def __post_init__(self) -> None:
        for f in ("partition", "account", "qos", "time_limit", "constraint", "python", "slurm_conf", "bin_dir"):
            _opt_str(f"slurm.{f}", getattr(self, f))
        if not isinstance(self.gpus, bool):
            raise ValidationError("slurm.gpus", "must be true or false", self.gpus)
        if isinstance(self.cpus_per_task, bool) or not isinstance(self.cpus_per_task, int) or self.cpus_per_task < 1:
            raise ValidationError("slurm.cpus_per_task", "must be an integer ≥ 1", self.cpus_per_task)
        object.__setattr__(self, "sbatch_args", _str_list("slurm.sbatch_args", self.sbatch_args))
        _pos("slurm.poll_s", self.poll_s)
        _pos("slurm.kill_wait_s", self.kill_wait_s)
        _pos("slurm.unreachable_s", self.unreachable_s)

    def command(self, name: str) -> str:
        """The path of Slurm command ``name`` (``bin_dir``/name, else the name for ``PATH``)."""
        return str(Path(self.bin_dir) / name) if self.bin_dir else name


@dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesConfig:
    """The ``kubernetes`` launcher (:mod:`agent.launchers.kubernetes`): an indexed Job per stage group.

    ``image``: the workers' image (SpiderFlow installed; ``python`` runs in it); ``namespace``,
    ``service_account``, ``node_selector``, ``tolerations`` (Kubernetes ``Toleration`` objects) go to
    every pod; ``gpu_resource``: the extended resource of one GPU (``nvidia.com/gpu``; with ``gpus: false``
    the pods ask for ``cpu_per_worker`` CPUs per worker instead); ``checkpoint_claim``: a
    PersistentVolumeClaim mounted at the agent's ``checkpoint_dir`` in every pod (the shared checkpoint
    file system); ``kubeconfig``/``context``: the API server (default: in-cluster configuration when the
    agent runs in a pod, else ``~/.kube/config``); ``poll_s``: seconds between state polls."""

    image: str
    namespace: str = "default"
    service_account: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    gpu_resource: str = "nvidia.com/gpu"
    gpus: bool = True
    cpu_per_worker: str = "1"
    python: str = "python3"
    checkpoint_claim: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    poll_s: float = 2.0

    def __post_init__(self) -> None:
        for f in ("image", "namespace", "gpu_resource", "cpu_per_worker", "python"):
            _opt_str(f"kubernetes.{f}", getattr(self, f))
        for f in ("service_account", "checkpoint_claim", "kubeconfig", "context"):
            _opt_str(f"kubernetes.{f}", getattr(self, f))
        if not isinstance(self.gpus, bool):
            raise ValidationError("kubernetes.gpus", "must be true or false", self.gpus)
        if not isinstance(self.node_selector, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.node_selector.items()):
            raise ValidationError("kubernetes.node_selector", "must map label names to strings", self.node_selector)
        if not isinstance(self.tolerations, list | tuple):
            raise ValidationError("kubernetes.tolerations", "must be a list of tolerations", self.tolerations)
        tolerations = tuple(self.tolerations)
        for i, t in enumerate(tolerations):
            if not isinstance(t, dict):
                raise ValidationError(f"kubernetes.tolerations[{i}]", "must be a mapping", t)
        object.__setattr__(self, "tolerations", tolerations)
        _pos("kubernetes.poll_s", self.poll_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Everything an agent needs (see the module docstring)."""

    cluster: str
    topology_service: str
    scheduler: str | None = None
    etcd: str | None = None
    work_dir: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    log_retention_days: float = 7.0
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    tls_dir: str | None = None
    etcd_tls_dir: str | None = None
    etcd_user: str | None = None
    token: str | None = field(default=None, repr=False)
    agent_id: str | None = None
    lease_ttl_s: int = 8
    profile_interval_s: float = 30.0
    profile_seconds: float = 0.5
    recalibrate_interval_s: float = 0.0
    gpus: GpuDeclaration | None = None
    free_gpus: int | None = None
    electricity_usd_per_kwh: float | None = None
    region: str = ""
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    launcher: LauncherName = "local"
    slurm: SlurmConfig | None = None
    kubernetes: KubernetesConfig | None = None
    gateway: GatewayConfig | None = None

    def __post_init__(self) -> None:
        if self.launcher not in ("local", "slurm", "kubernetes"):
            raise ValidationError("launcher", "must be 'local', 'slurm' or 'kubernetes'", self.launcher)
        if self.launcher == "kubernetes" and self.kubernetes is None:
            raise ValidationError("kubernetes", "is required with launcher: kubernetes (at least its image)")
        if not self.cluster or "/" in self.cluster or len(self.cluster) > 63:
            raise ValidationError("cluster", "must be a name of 1..63 characters without '/'", self.cluster)
        parse_hostport(self.topology_service, field="topology_service")
        parse_hostport(self.listen, field="listen")
        if self.scheduler is not None:  # one address, or every replica's, comma-separated
            from agent.control import parse_replicas

            parse_replicas(self.scheduler, field="scheduler")
            if self.etcd is not None:
                raise ValidationError("etcd", "must not be given with scheduler: an agent reaches the control "
                                      "plane's state through the scheduler replicas and holds no etcd credentials "
                                      "(direct etcd is a development-only mode of agents without a scheduler)",
                                      self.etcd)
        elif self.etcd is None:
            raise ValidationError("scheduler", "is required (the control plane: every scheduler replica, "
                                  "comma-separated)")
        else:
            parse_hostport(self.etcd, field="etcd")
        if isinstance(self.checkpoint_every, bool) or not isinstance(self.checkpoint_every, int) \
                or self.checkpoint_every < 0:
            raise ValidationError("checkpoint_every", "must be an integer ≥ 0 (0: no checkpoints)",
                                  self.checkpoint_every)
        if isinstance(self.log_retention_days, bool) or not isinstance(self.log_retention_days, (int, float)) \
                or self.log_retention_days < 0:
            raise ValidationError("log_retention_days", "must be a number ≥ 0 (0: keep logs forever)",
                                  self.log_retention_days)
        if self.advertise is not None:
            parse_hostport(self.advertise, field="advertise")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()
                                       or any(c.isspace() for c in self.token)):
            raise ValidationError("token", "must be a non-empty string without spaces", "<hidden>")
        if isinstance(self.lease_ttl_s, bool) or not isinstance(self.lease_ttl_s, int) or self.lease_ttl_s < 1:
            raise ValidationError("lease_ttl_s", "must be an integer ≥ 1", self.lease_ttl_s)
        _pos("profile_interval_s", self.profile_interval_s)
        _pos("profile_seconds", self.profile_seconds)
        _pos("recalibrate_interval_s", self.recalibrate_interval_s, zero=True)
        if self.free_gpus is not None:
            _pos("free_gpus", self.free_gpus, zero=True)
        if self.electricity_usd_per_kwh is not None:
            _pos("electricity_usd_per_kwh", self.electricity_usd_per_kwh, zero=True)
        for f in ("intra_node_gbps", "inter_node_gbps"):
            if getattr(self, f) is not None:
                _pos(f, getattr(self, f))
        if self.gateway is not None and self.gateway.enabled and not (self.gateway.tls_dir or self.tls_dir):
            raise ValidationError("gateway.tls_dir", "is required with gateway.enabled (or the agent's tls_dir): "
                                                     "the gateway serves mutual TLS only")


def work_dir_of(config: AgentConfig) -> Path:
    """The agent's work directory: ``work_dir``, else ``spiderflow-agent-<cluster>`` under the temp dir."""
    import tempfile

    if config.work_dir:
        return Path(config.work_dir)
    return Path(tempfile.gettempdir()) / f"spiderflow-agent-{config.cluster}"


def etcd_options(config: AgentConfig) -> dict[str, Any]:
    """The :class:`~spiderflow.store.etcd.EtcdStore` keyword arguments of ``config`` (``etcd_tls_dir``,
    ``etcd_user`` with the password from ``$SPIDERFLOW_ETCD_PASSWORD``); ValidationError naming the flag
    when a bundle file or the password is missing."""
    import argparse

    from spiderflow.security.tls import etcd_options as from_flags

    return from_flags(argparse.Namespace(etcd_tls_dir=config.etcd_tls_dir, etcd_user=config.etcd_user))


def _section(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValidationError(where, "must be a mapping", raw)
    known = {f.name for f in fields(cls)}
    for k in raw:
        if k not in known:
            raise ValidationError(f"{where}.{k}", "unknown key")
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING and f.name not in raw:
            raise ValidationError(f"{where}.{f.name}", "is required")
    return cls(**raw)


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> AgentConfig:
    """The configuration from ``path`` (may be None) with ``overrides`` (flags; None values ignored).
    ``overrides["probe"]`` / ``overrides["gpus"]`` are dicts merged into those sections."""
    raw: dict[str, Any] = {}
    if path is not None:
        doc = load_document(path)
        if doc is not None and not isinstance(doc, dict):
            raise ValidationError("config", "must be a mapping", type(doc).__name__)
        raw = dict(doc or {})
    probe = dict(raw.pop("probe", None) or {})
    probe.update({k: v for k, v in (overrides.pop("probe", None) or {}).items() if v is not None})
    gpus = raw.pop("gpus", None)
    gover = {k: v for k, v in (overrides.pop("gpus", None) or {}).items() if v is not None}
    if gover:
        gpus = {**(gpus or {}), **gover}
    slurm = raw.pop("slurm", None)
    kube = raw.pop("kubernetes", None)
    gateway = raw.pop("gateway", None)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    for required in ("cluster", "topology_service"):
        if not raw.get(required):
            raise ValidationError(required, "is required (flag or config file)")
    if not raw.get("scheduler") and not raw.get("etcd"):
        raise ValidationError("scheduler", "is required (flag or config file): the control plane's address, "
                              "every scheduler replica comma-separated")
    known = {f.name for f in fields(AgentConfig)}
    for k in raw:
        if k not in known:
            raise ValidationError(f"config.{k}", "unknown key")
    launcher = raw.pop("launcher", "local")
    cfg = AgentConfig(**raw)
    return replace(
        cfg,
        gateway=gateway_config(gateway) if gateway is not None else None,
        probe=_section(ProbeConfig, probe, "probe"),
        gpus=_section(GpuDeclaration, gpus, "gpus") if gpus else None,
        slurm=_section(SlurmConfig, slurm, "slurm") if slurm is not None else None,
        kubernetes=_section(KubernetesConfig, kube, "kubernetes") if kube is not None else None,
        launcher=launcher,
    )
