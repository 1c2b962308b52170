"""The agent process: one per cluster.

Life cycle (:meth:`Agent.run`):

1. Serve the Agent gRPC service (:mod:`agent.service`) on ``listen``; work out the address peers dial
   (:mod:`agent.config`, "Advertised address").
2. Profile the cluster once (:mod:`agent.profiler`; a declared cluster skips device discovery; a CPU
   cluster also calibrates its training efficiency ``mfu`` and per-layer overhead ``layer_overhead_ms``).
3. **Register**: grant a lease of ``lease_ttl_s`` with keep-alive and create ``clusters/<cluster>``
   (:class:`agent.registration.Registration`) under it. If the key is taken (a previous instance whose
   lease has not expired yet), retry every second until it is free. If the lease is lost (etcd
   unreachable for a TTL), register again with a new lease. On shutdown the lease is revoked, so the
   cluster leaves the graph at once; if the process dies, it leaves within the TTL.
4. **Report the profile** to the topology service after each registration and every
   ``profile_interval_s``. **Re-measure** the devices (:meth:`Agent.recalibrate`) on ``SIGHUP``
   (:meth:`Agent.request_recalibration`) and every ``recalibrate_interval_s`` (0, the default: only on
   request), always at an idle moment, and report the new figures at once: a machine's speed drifts
   (clocks, thermal limits, co-tenants on a shared host), and the planner prices plans on the last report.
5. **Probe** every ``probe.period_s`` (with a per-agent jitter of up to 10 %): peers are the other
   registrations (their addresses); each is probed in turn (:mod:`agent.probe`), then all measurements go to the
   topology service in one ReportLinks. A target the service does not know (its lease just expired) is
   dropped and the report retried once. A peer that registers between rounds (watched) and that
   this agent holds no measurement of is probed and reported at once, so a joining cluster's links reach
   the graph within a probe of its registration rather than up to a period later.

Identity: a certificate (``tls_dir``) and/or a bearer ``token`` (sent with every ReportProfile and
ReportLinks). When the topology service refuses the agent's identity (UNAUTHENTICATED: no or an unknown
token or certificate; PERMISSION_DENIED: a token or certificate of another cluster, or not an agent's),
retrying cannot help: the agent logs ``agent.refused`` with the reason, deregisters and stops; its
:attr:`Agent.refused` is the error (``spiderflow agent`` then exits with code 5).

State: the registration, its lease, peers' addresses (and, for the executor, assignments, rendezvous and
checkpoint manifests) go through the control plane's ``Control`` API on the ``scheduler`` replicas
(:class:`agent.remote_store.RemoteStore`), authorised against the agent's cluster identity: the agent holds
no etcd credentials. Development only: an agent without a ``scheduler`` (one that measures and reports its
cluster but runs no stages) may use ``etcd`` directly (``etcd_tls_dir`` / ``etcd_user``,
:func:`agent.config.etcd_options`); no shipped configuration does.

Busy (training): :meth:`Agent.set_busy` (the executor calls it when stages start and stop). While busy
no bulk probe is sent or served (an in-flight one is cut short); with ``busy_mode = "latency"`` echo
probes go on (latency-only refreshes keep the links fresh), with ``"pause"`` probing stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import structlog
from google.protobuf import timestamp_pb2  # type: ignore[import-untyped]

from agent.config import AgentConfig, etcd_options, work_dir_of
from agent.probe import Ingress, ProbeResult, probe_peer
from agent.profiler import DeviceProfile, profile_cpu, profile_devices
from agent.registration import PeerAddress, Registration
from agent.service import AgentService
from agent.workers import WorkerBoard
from spiderflow import joblogs, metrics
from spiderflow.core.domain import Cluster
from spiderflow.core.errors import (
    AlreadyExistsError,
    PermissionDeniedError,
    SpiderFlowError,
    UnauthenticatedError,
    ValidationError,
)
from spiderflow.proto.agent.v1 import agent_pb2, agent_pb2_grpc
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc import convert
from spiderflow.rpc.errors import domain_errors
from spiderflow.rpc.server import RpcServer, open_channel, serve
from spiderflow.runtime import parse_hostport
from spiderflow.security.auth import bearer_metadata
from spiderflow.store import keys
from spiderflow.store.base import Compare, CompareFailedError, EventType, Lease, Put, Store

__all__ = ["VERSION", "Agent", "build_cluster"]

log = structlog.get_logger(__name__)

VERSION = "0.1.0"
REGISTER_WARN_EVERY_S = 30.0
"""While registration keeps failing (retried every second), warn at the first failure and then this often."""
_WILDCARDS = {"0.0.0.0", "::", ""}


def _ts(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def build_cluster(config: AgentConfig, measured: DeviceProfile | None) -> Cluster:
    """The :class:`Cluster` this agent reports: declared GPUs (``config.gpus``) or the measured ones
    (with the calibrated ``mfu``, ``layer_overhead_ms`` and ``optimizer_ms_per_layer`` when measured), plus
    the configured price, region, free GPUs and intra/inter-node bandwidths."""
    extra: dict[str, Any] = {}
    for f in ("electricity_usd_per_kwh", "intra_node_gbps", "inter_node_gbps", "free_gpus"):
        if getattr(config, f) is not None:
            extra[f] = getattr(config, f)
    decl = config.gpus
    if decl is not None:
        tflops = decl.tflops if decl.tflops is not None else (measured.tflops if measured else None)
        memory = decl.memory_gib if decl.memory_gib is not None else (measured.memory_gib if measured else None)
        # the calibrated mfu and overhead belong to the measured TFLOPS only, not to declared ones
        calibrated = measured is not None and decl.tflops is None
        mfu = measured.mfu if calibrated and measured is not None else None
        overhead = measured.layer_overhead_ms if calibrated and measured is not None else 0.0
        optimizer = measured.optimizer_ms_per_layer if calibrated and measured is not None else 0.0
        return Cluster(name=config.cluster, gpu=decl.gpu, nodes=decl.nodes, gpus_per_node=decl.gpus_per_node,
                       tflops=tflops, mfu=mfu, memory_gib=memory, layer_overhead_ms=overhead,
                       optimizer_ms_per_layer=optimizer, region=config.region, **extra)
    if measured is None:
        raise ValidationError("gpus", "neither declared nor measured")
    return Cluster(name=config.cluster, gpu=measured.gpu, nodes=1, gpus_per_node=measured.count,
                   tflops=measured.tflops, mfu=measured.mfu, memory_gib=measured.memory_gib,
                   layer_overhead_ms=measured.layer_overhead_ms,
                   optimizer_ms_per_layer=measured.optimizer_ms_per_layer, region=config.region,
                   **extra)


def _measure(config: AgentConfig) -> DeviceProfile | None:
    """Profile as the config asks: nothing for a declared non-cpu type with its figures, the CPU for a
    declared ``cpu``, the local devices otherwise."""
    decl = config.gpus
    if decl is None:
        return profile_devices(seconds=config.profile_seconds)
    if decl.gpu == "cpu" and decl.tflops is None:
        return profile_cpu(seconds=config.profile_seconds)  # matmul TFLOPS and calibrated mfu
    return None


def _local_address_towards(host: str, port: int) -> str:
    """The local IP the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


@dataclass
class _Peer:
    registration: PeerAddress
    channel: grpc.aio.Channel
    stub: agent_pb2_grpc.AgentStub


class Agent:
    """One cluster's agent (see the module docstring). ``store_factory(endpoint)`` builds the Store
    (EtcdStore by default); ``measure`` profiles the devices (replaceable in tests)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        store_factory: Callable[[str], Store] | None = None,
        measure: Callable[[AgentConfig], DeviceProfile | None] = _measure,
    ) -> None:
        self.config = config
        self.agent_id = config.agent_id or f"{config.cluster}-{uuid.uuid4().hex[:12]}"
        self._store_factory = store_factory
        self._measure = measure
        self._busy = False
        self._busy_changed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy_epoch = 0
        self._recalibrate_now = asyncio.Event()
        self._registered = asyncio.Event()
        self._lease: Lease | None = None
        self._server: RpcServer | None = None
        self._store: Store | None = None
        self._cluster: Cluster | None = None
        self._address = ""
        self._peers: dict[str, _Peer] = {}
        self._probes: dict[str, ProbeResult] = {}
        self._started_at = time.time()
        self._rng = random.Random(self.agent_id)
        self._topology_channel: grpc.aio.Channel | None = None
        self._topology: topology_pb2_grpc.TopologyStub | None = None
        self._profile_now = asyncio.Event()
        self._new_peer = asyncio.Event()
        self._ingress = Ingress()
        self.workers = WorkerBoard()
        """The workers of the attempts this cluster runs (the executor writes it; GetStatus and
        WatchWorkers read it)."""
        self.log = log.bind(cluster=config.cluster, agent_id=self.agent_id)
        self._metadata = bearer_metadata(config.token)
        self.refused: UnauthenticatedError | PermissionDeniedError | None = None
        """Why the topology service refused this agent's identity (the agent then stops), else None."""
        self._credentials: grpc.ChannelCredentials | None = None
        self._server_credentials: grpc.ServerCredentials | None = None
        if config.tls_dir:
            from spiderflow.security.tls import channel_credentials, server_credentials

            self._credentials = channel_credentials(Path(config.tls_dir))
            self._server_credentials = server_credentials(Path(config.tls_dir))

    # -- the executor's hook --------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while the cluster trains (bulk probes paused)."""
        return self._busy

    def set_busy(self, busy: bool) -> None:
        """Mark the cluster as training (True) or idle (False); see the module docstring."""
        if busy != self._busy:
            self._busy = busy
            self._busy_changed.set()
            if busy:
                self._busy_epoch += 1
                self._idle.clear()
            else:
                self._idle.set()
            self.log.info("agent.busy" if busy else "agent.idle")

    # -- AgentState for the servicer ------------------------------------------------------------------

    @property
    def serve_cap_bytes(self) -> int:
        return self.config.probe.serve_cap_bytes

    @property
    def ingress(self) -> Ingress:
        """Bulk probes being received (echo probes avoid overlapping them)."""
        return self._ingress

    @property
    def address(self) -> str:
        """The address peers dial (host:port); empty before :meth:`start`."""
        return self._address

    @property
    def cluster(self) -> Cluster | None:
        return self._cluster

    @property
    def registered(self) -> asyncio.Event:
        return self._registered

    def status(self) -> agent_pb2.GetStatusResponse:
        msg = agent_pb2.GetStatusResponse(agent_id=self.agent_id, address=self._address, training=self._busy,
                                          started_at=_ts(self._started_at))
        if self._cluster is not None:
            msg.cluster.CopyFrom(convert.cluster_to_proto(self._cluster))
        for peer, p in sorted(self._probes.items()):
            msg.probes.add(peer=peer, bandwidth_gbps=p.bandwidth_gbps or 0.0, latency_ms=p.latency_ms,
                           measured_at=_ts(p.measured_at))
        msg.workers.extend(self.workers.snapshot())
        return msg

    # -- life cycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve, profile, connect; returns once the Agent service is up (registration follows in
        :meth:`run`)."""
        host, port = parse_hostport(self.config.listen, field="listen")
        interceptors: list[grpc.aio.ServerInterceptor] = [metrics.RpcMetricsInterceptor()]
        if self._server_credentials is not None:  # mTLS: every caller is authenticated and its role checked
            from spiderflow.security.auth import Authenticator, AuthInterceptor

            interceptors.append(AuthInterceptor(Authenticator(certificates=True)))
        service = AgentService(self, work_dir=work_dir_of(self.config), cluster=self.config.cluster,
                               workers=self.workers)
        self._server = await serve([service], host=host, port=port, credentials=self._server_credentials,
                                   interceptors=interceptors)
        if self.config.advertise:
            self._address = self.config.advertise
        elif host in _WILDCARDS:
            th, tp = parse_hostport(self.config.topology_service, field="topology_service")
            self._address = f"{_local_address_towards(th, tp)}:{self._server.port}"
        else:
            self._address = self._server.address
        measured = await asyncio.to_thread(self._measure, self.config)
        self._cluster = build_cluster(self.config, measured)
        self._recalibrate_now.clear()  # a request made while measuring: this measurement answers it
        if self._store_factory is not None:
            self._store = self._store_factory(self.config.scheduler or self.config.etcd or "")
        elif self.config.scheduler:  # the control plane's Control API: no etcd credentials here
            from agent.remote_store import RemoteStore

            self._store = RemoteStore(self.config.scheduler, cluster=self.config.cluster,
                                      tls_dir=self.config.tls_dir, token=self.config.token)
        else:  # development only: an agent without a scheduler that only measures (agent.config)
            from spiderflow.store.etcd import EtcdStore

            assert self.config.etcd is not None
            self._store = EtcdStore(self.config.etcd, **etcd_options(self.config))
        self._topology_channel = open_channel(self.config.topology_service, credentials=self._credentials)
        self._topology = topology_pb2_grpc.TopologyStub(self._topology_channel)
        self.log.info("agent.started", address=self._address, gpu=self._cluster.gpu, gpus=self._cluster.total_gpus,
                      tflops=self._cluster.tflops, topology_service=self.config.topology_service,
                      control_plane=self.config.scheduler, etcd=self.config.etcd,
                      etcd_tls=bool(self.config.etcd_tls_dir),
                      etcd_user=self.config.etcd_user, token=bool(self.config.token))

    async def _log_retention_loop(self, stop: asyncio.Event) -> None:
        """Delete workers' logs past ``log_retention_days`` (:func:`spiderflow.joblogs.prune`), at start and
        hourly."""
        while not stop.is_set():
            try:
                gone = await asyncio.to_thread(joblogs.prune, work_dir_of(self.config),
                                               retention_days=self.config.log_retention_days)
            except OSError as e:
                self.log.warning("agent.log_prune_failed", error=str(e))
            else:
                if gone:
                    self.log.info("agent.logs_pruned", jobs=gone)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=3600.0)

    async def run(self, stop: asyncio.Event) -> None:
        """Register, report and probe until ``stop`` is set; then deregister and shut down."""
        if self._server is None:
            await self.start()
        tasks = [
            asyncio.create_task(self._register_loop(stop), name="agent-register"),
            asyncio.create_task(self._profile_loop(stop), name="agent-profile"),
            asyncio.create_task(self._recalibrate_loop(stop), name="agent-recalibrate"),
            asyncio.create_task(self._probe_loop(stop), name="agent-probe"),
            asyncio.create_task(self._peer_watch_loop(stop), name="agent-peer-watch"),
            asyncio.create_task(self._log_retention_loop(stop), name="agent-log-retention"),
        ]
        try:
            await stop.wait()
        finally:
            await _cancel_all(tasks)
            await self.close()

    async def close(self) -> None:
        """Revoke the registration lease, close channels, stop serving (idempotent)."""
        lease, self._lease = self._lease, None
        self._registered.clear()
        if lease is not None:
            with contextlib.suppress(SpiderFlowError):
                await lease.revoke()
        for p in self._peers.values():
            await p.channel.close()
        self._peers.clear()
        if self._topology_channel is not None:
            await self._topology_channel.close()
            self._topology_channel = None
        if self._store is not None:
            await self._store.close()
            self._store = None
        if self._server is not None:
            await self._server.stop(grace_s=1)
            self._server = None
        self.log.info("agent.stopped")

    # -- registration -----------------------------------------------------------------------------------

    async def _register_loop(self, stop: asyncio.Event) -> None:
        assert self._store is not None
        # With a certificate the topology service knows the caller by its cluster (the certificate's name).
        principal = self.config.cluster if self.config.tls_dir else self.agent_id
        reg = Registration(cluster=self.config.cluster, agent_id=self.agent_id, principal=principal,
                           address=self._address, version=VERSION, pid=os.getpid(), host=socket.gethostname(),
                           started_at=self._started_at)
        key = keys.cluster_key(self.config.cluster)
        failures, last_warned = 0, -math.inf
        kept: Lease | None = None  # a lease this agent lost track of, whose registration may still be alive
        while not stop.is_set():
            lease: Lease | None = None
            try:
                lease = await self._store.grant(self.config.lease_ttl_s)
                revision = await self._keep_registration(key, reg, kept, lease) if kept is not None else None
                if revision is None:
                    revision = await self._store.put_if_absent(key, reg.encode(), lease=lease)
                if kept is not None:  # the registration moved to the new lease (or is gone): drop the old one
                    with contextlib.suppress(SpiderFlowError):
                        await kept.revoke()
                    kept = None
            except (UnauthenticatedError, PermissionDeniedError) as e:  # the control plane refuses this identity
                if lease is not None:
                    with contextlib.suppress(SpiderFlowError):
                        await lease.revoke()
                self._refuse(e, stop, "Control (registration)")
                return
            except AlreadyExistsError:
                self.log.info("agent.registration_taken", key=key)
                if lease is not None:
                    with contextlib.suppress(SpiderFlowError):
                        await lease.revoke()
                await asyncio.sleep(1.0)
                continue
            except Exception as e:  # keep registering whatever went wrong (every second; warn every 30 s)
                failures += 1
                if time.monotonic() - last_warned >= REGISTER_WARN_EVERY_S:
                    self.log.warning("agent.register_failed", error=str(e), error_class=type(e).__name__,
                                     attempts=failures)
                    last_warned = time.monotonic()
                if lease is not None:
                    with contextlib.suppress(SpiderFlowError):
                        await lease.revoke()
                await asyncio.sleep(1.0)
                continue
            failures, last_warned = 0, -math.inf
            self._lease = lease
            self._registered.set()
            self._profile_now.set()
            self.log.info("agent.registered", lease=lease.id, ttl=lease.ttl, address=self._address)
            reason = await self._until_lost(lease, key, revision)
            self._registered.clear()
            self._lease = None
            self.log.warning("agent.registration_lost", reason=reason)
            if lease.lost.is_set():
                # Lost on this side only (etcd unreachable for a TTL): etcd may still hold the lease (it
                # extends every lease when it elects a leader again), so the registration is kept if it is
                # still there, moved to a new lease, instead of being revoked: a blip of etcd does not make
                # a healthy cluster leave the topology.
                kept = lease
            else:
                with contextlib.suppress(SpiderFlowError):
                    await lease.revoke()

    async def _keep_registration(self, key: str, reg: Registration, old: Lease, lease: Lease) -> int | None:
        """Move this agent's registration from ``old`` (lost on this side) to ``lease`` when etcd still
        holds it under ``old``: one compare-and-swap on the key's revision, so the key never disappears.
        Returns the new revision, or None when there is nothing to keep (then register afresh)."""
        assert self._store is not None
        kv = await self._store.get(key)
        if kv is None or kv.lease != old.id:
            return None
        try:
            revision = await self._store.commit([Compare(key=key, mod_revision=kv.mod_revision)],
                                                [Put(key=key, value=reg.encode(), lease=lease)], [])
        except CompareFailedError:
            return None
        self.log.info("agent.registration_kept", old_lease=old.id, lease=lease.id)
        return revision

    async def _until_lost(self, lease: Lease, key: str, revision: int) -> str:
        """Wait until the lease is lost or the registration key is deleted or overwritten by someone
        else; returns why."""
        assert self._store is not None
        store = self._store

        async def key_gone() -> str:
            try:
                async with store.watch_prefix(key, start_revision=revision + 1) as watch:
                    async for event in watch:
                        if event.key == key and (event.type is EventType.DELETE or event.lease != lease.id):
                            what = "deleted" if event.type is EventType.DELETE else "overwritten"
                            return f"registration key {what} by someone else"
            except SpiderFlowError as e:
                self.log.info("agent.registration_watch_failed", error=str(e))
            await asyncio.Event().wait()  # no watch: rely on the lease alone
            return ""

        lost = asyncio.create_task(lease.lost.wait())
        gone = asyncio.create_task(key_gone())
        try:
            done, _ = await asyncio.wait({lost, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_all([lost, gone])
        if gone in done and not lost.done():
            return gone.result()
        return lease.lost_reason or "lease lost"

    # -- profile ------------------------------------------------------------------------------------------

    async def _profile_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._registered.wait()
            try:
                await self.report_profile()
            except (UnauthenticatedError, PermissionDeniedError) as e:
                self._refuse(e, stop, "ReportProfile")
                return
            except Exception as e:  # keep reporting whatever went wrong
                self.log.warning("agent.profile_report_failed", error=str(e), error_class=type(e).__name__)
                await asyncio.sleep(1.0)
                continue
            self._profile_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._profile_now.wait(), self.config.profile_interval_s)

    def request_recalibration(self) -> None:
        """Re-measure the devices at the next idle moment (``SIGHUP``; :meth:`recalibrate`)."""
        self._recalibrate_now.set()

    async def recalibrate(self) -> bool:
        """Measure the devices again, as at start, and report the new figures at once. Only while idle: a
        measurement that a job's start overlaps (the cluster turned busy meanwhile) is discarded, since the
        job's workers took part of the devices, and a declared cluster measures nothing. Returns whether a
        new measurement replaced the reported figures."""
        if self._busy or self._cluster is None:
            return False
        epoch = self._busy_epoch
        t0 = time.monotonic()
        measured = await asyncio.to_thread(self._measure, self.config)
        if measured is None:
            return False
        if self._busy or epoch != self._busy_epoch:
            self.log.info("agent.recalibration_discarded", reason="the cluster turned busy while measuring")
            return False
        before = self._cluster
        self._cluster = build_cluster(self.config, measured)
        self._profile_now.set()
        self.log.info("agent.recalibrated", seconds=round(time.monotonic() - t0, 3),
                      tflops=self._cluster.tflops, previous_tflops=before.tflops, mfu=self._cluster.mfu,
                      previous_mfu=before.mfu, layer_overhead_ms=self._cluster.layer_overhead_ms,
                      previous_layer_overhead_ms=before.layer_overhead_ms)
        return True

    async def _recalibrate_loop(self, stop: asyncio.Event) -> None:
        interval = self.config.recalibrate_interval_s
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recalibrate_now.wait(), interval if interval > 0 else None)
            self._recalibrate_now.clear()
            await self._idle.wait()  # at the next idle moment
            try:
                await self.recalibrate()
            except Exception as e:  # keep the figures reported so far
                self.log.warning("agent.recalibration_failed", error=str(e), error_class=type(e).__name__)

    async def report_profile(self) -> int:
        """Send the profile now; returns the revision of the write."""
        assert self._topology is not None and self._cluster is not None
        req = topology_pb2.ReportProfileRequest(cluster=convert.cluster_to_proto(self._cluster),
                                                agent_id=self.agent_id, agent_address=self._address,
                                                measured_at=_ts(time.time()))
        with domain_errors():
            resp = await self._topology.ReportProfile(req, timeout=self.config.probe.timeout_s,
                                                      metadata=self._metadata)
        self.log.info("agent.profile_reported", revision=resp.revision)
        return int(resp.revision)

    def _refuse(self, error: UnauthenticatedError | PermissionDeniedError, stop: asyncio.Event, call: str) -> None:
        """The topology service or the control plane refused this agent's identity: log it once, remember it,
        stop the agent."""
        if self.refused is None:
            self.refused = error
            parts = ([f"certificate {self.config.tls_dir}"] if self.config.tls_dir else []) + \
                (["bearer token"] if self.config.token else [])
            identity = " and ".join(parts) or "no certificate or token"
            self.log.error("agent.refused", call=call, code=type(error).__name__, error=str(error),
                           identity=identity, hint="the topology service and the scheduler must map this agent's "
                           f"token or certificate to agent:{self.config.cluster} (--token / $SPIDERFLOW_TOKEN, "
                           "--tls-dir)")
        stop.set()

    # -- probing --------------------------------------------------------------------------------------------

    async def discover(self) -> list[PeerAddress]:
        """The other registered agents (their cluster and address, through the control plane), and channels
        to them kept up to date."""
        assert self._store is not None
        items, _ = await self._store.get_prefix(keys.CLUSTERS)
        regs: dict[str, PeerAddress] = {}
        for kv in items:
            try:
                r = PeerAddress.decode(kv.value)
            except ValidationError as e:
                self.log.warning("agent.bad_registration", key=kv.key, error=str(e))
                continue
            if r.cluster != self.config.cluster:
                regs[r.cluster] = r
        for name in list(self._peers):
            p = self._peers[name]
            if name not in regs or regs[name].address != p.registration.address:
                await p.channel.close()
                del self._peers[name]
        for name, r in regs.items():
            if name not in self._peers:
                ch = open_channel(r.address, credentials=self._credentials)
                self._peers[name] = _Peer(registration=r, channel=ch, stub=agent_pb2_grpc.AgentStub(ch))
        for name in list(self._probes):
            if name not in regs:
                del self._probes[name]
        return sorted(regs.values(), key=lambda r: r.cluster)

    async def probe_round(self, *, new_only: bool = False) -> list[ProbeResult]:
        """Probe every peer once (in a shuffled order) and report the results; returns them. With
        ``new_only`` only the peers this agent holds no measurement of are probed."""
        cfg = self.config.probe
        peers = await self.discover()
        if new_only:
            peers = [r for r in peers if r.cluster not in self._probes]
        self._rng.shuffle(peers)
        results: list[ProbeResult] = []
        for reg in peers:
            if self._busy and cfg.busy_mode == "pause":
                break
            peer = self._peers.get(reg.cluster)
            if peer is None:
                continue
            try:
                r = await probe_peer(peer.stub, source=self.config.cluster, peer=reg.cluster, config=cfg,
                                     busy=lambda: self._busy, ingress=self._ingress)
            except (grpc.aio.AioRpcError, ValueError) as e:
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                self.log.info("agent.probe_failed", peer=reg.cluster, address=reg.address, error=detail)
                metrics.observe_probe(self.config.cluster, reg.cluster, latency_ms=None, bandwidth_gbps=None)
                continue
            self._probes[reg.cluster] = r
            metrics.observe_probe(self.config.cluster, reg.cluster, latency_ms=r.latency_ms,
                                  bandwidth_gbps=r.bandwidth_gbps)
            results.append(r)
            self.log.debug("agent.probed", peer=reg.cluster, latency_ms=round(r.latency_ms, 3),
                           bandwidth_gbps=r.bandwidth_gbps, probe_bytes=r.probe_bytes)
        if results:
            await self.report_links(results)
        return results

    async def report_links(self, results: list[ProbeResult]) -> None:
        """Send measurements; a target the service does not know is dropped and the rest re-sent once."""
        assert self._topology is not None
        pending = list(results)
        for _attempt in range(2):
            req = topology_pb2.ReportLinksRequest(cluster=self.config.cluster, agent_id=self.agent_id)
            for r in pending:
                req.measurements.add(target=r.peer, bandwidth_gbps=r.bandwidth_gbps or 0.0, latency_ms=r.latency_ms,
                                     probe_bytes=r.probe_bytes if r.bandwidth_gbps else 0,
                                     rtt_samples=r.rtt_samples, measured_at=_ts(r.measured_at))
            try:
                with domain_errors():
                    resp = await self._topology.ReportLinks(req, timeout=self.config.probe.timeout_s,
                                                            metadata=self._metadata)
            except ValidationError as e:
                bad = _target_index(e.field)
                if bad is None or bad >= len(pending):
                    raise
                self.log.info("agent.peer_gone", peer=pending[bad].peer, error=str(e))
                pending = [r for i, r in enumerate(pending) if i != bad]
                if not pending:
                    return
                continue
            self.log.info("agent.links_reported", revision=resp.revision, accepted=resp.accepted,
                          rejected=list(resp.rejected), peers=len(pending))
            return

    async def _probe_loop(self, stop: asyncio.Event) -> None:
        period = self.config.probe.period_s
        next_full = time.monotonic()
        while not stop.is_set():
            await self._registered.wait()
            t0 = time.monotonic()
            full = t0 >= next_full
            if full:
                next_full = t0 + period + self._rng.uniform(0, 0.1 * period)
            self._new_peer.clear()
            if not (self._busy and self.config.probe.busy_mode == "pause"):
                try:
                    await self.probe_round(new_only=not full)
                except (UnauthenticatedError, PermissionDeniedError) as e:
                    self._refuse(e, stop, "ReportLinks")
                    return
                except Exception as e:  # keep probing whatever went wrong
                    self.log.warning("agent.probe_round_failed", error=str(e), error_class=type(e).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new_peer.wait(), max(0.0, next_full - time.monotonic()))

    async def _peer_watch_loop(self, stop: asyncio.Event) -> None:
        """Wake the probe loop when a peer registers that this agent has not measured yet, so a cluster
        that joins gets its links within a probe of joining instead of at the next full round."""
        assert self._store is not None
        store = self._store
        while not stop.is_set():
            await self._registered.wait()
            try:
                async with store.watch_prefix(keys.CLUSTERS) as watch:
                    self._new_peer.set()  # a peer that registered before the watch began is not missed
                    async for event in watch:
                        if event.type is not EventType.PUT:
                            continue
                        try:
                            peer = PeerAddress.decode(event.value).cluster
                        except ValidationError:
                            continue
                        if peer != self.config.cluster and peer not in self._probes:
                            self._new_peer.set()
            except Exception as e:  # the full rounds go on without the watch; retried every second
                self.log.info("agent.peer_watch_failed", error=str(e), error_class=type(e).__name__)
            await asyncio.sleep(1.0)


async def _cancel_all(tasks: list[asyncio.Task[Any]], *, patience_s: float = 1.0) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling again any that is still running after
    ``patience_s``: on Python 3.11 ``asyncio.wait_for`` (used by the etcd client) may swallow a
    cancellation that arrives as its inner call completes, and a single cancel would then be waited on
    forever."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=patience_s)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: an error of a task being shut down is not reported again


def _target_index(field: str) -> int | None:
    prefix = "measurements["
    if field.startswith(prefix) and field.endswith("].target"):
        inner = field[len(prefix):-len("].target")]
        return int(inner) if inner.isdigit() else None
    return None

