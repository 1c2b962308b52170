"""Building and running SpiderFlow gRPC servers, and opening channels to them.

Every server built here has, besides its own services:

* gRPC health checking (``grpc.health.v1.Health``) with one status per service (the full service name,
  e.g. ``spiderflow.scheduler.v1.Scheduler``) and the overall status (``""``); all start SERVING and turn
  NOT_SERVING when a graceful stop begins, so load balancers drain the server first;
* server reflection (``grpc.reflection.v1alpha.ServerReflection``) for every service, so grpcurl and
  other tools work without ``.proto`` files;
* the same maximum message size for sending and receiving (:data:`DEFAULT_MAX_MESSAGE_BYTES`).

Usage::

    server = await serve([SchedulerServicer(...)], host="127.0.0.1", port=0)
    print(server.address)          # "127.0.0.1:43817" - port 0 picks a free port
    ...
    await server.stop(grace_s=5)   # NOT_SERVING, then finish in-flight calls for up to 5 s

or ``async with await serve(...) as server: ...``. The services are given as servicer instances of the
generated ``*Servicer`` base classes; the registration function and the full service name are found from
the generated modules (:func:`service_of`). TLS: pass ``grpc.ssl_server_credentials(...)`` as
``credentials`` (and ``grpc.ssl_channel_credentials(...)`` to :func:`open_channel`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import Any

import grpc
import grpc.aio
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "RpcServer",
    "Service",
    "channel_options",
    "open_channel",
    "serve",
    "service_of",
]

log = structlog.get_logger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default send/receive limit: a 256-cluster topology or a plan is far below it; bulk probe chunks too."""

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


@dataclass(frozen=True, slots=True, kw_only=True)
class Service:
    """One service to serve: the servicer, its full proto name and the generated registration function."""

    name: str
    servicer: object
    register: Callable[[object, grpc.aio.Server], None]


def service_of(servicer: object) -> Service:
    """The :class:`Service` of a servicer instance that derives from a generated ``XServicer`` class.

    The generated ``*_pb2_grpc`` module of that base class provides ``add_XServicer_to_server``; the
    matching ``*_pb2`` module's descriptor gives the full service name. Raises ``TypeError`` when the
    servicer derives from no generated servicer class.
    """
    if isinstance(servicer, Service):
        return servicer
    for base in type(servicer).__mro__:
        module: ModuleType | None = sys.modules.get(base.__module__)
        if module is None or not base.__module__.endswith("_pb2_grpc") or not base.__name__.endswith("Servicer"):
            continue
        register = getattr(module, f"add_{base.__name__}_to_server", None)
        pb2 = sys.modules.get(base.__module__[: -len("_grpc")])
        short = base.__name__[: -len("Servicer")]
        if register is None or pb2 is None or short not in pb2.DESCRIPTOR.services_by_name:
            continue
        return Service(name=pb2.DESCRIPTOR.services_by_name[short].full_name, servicer=servicer, register=register)
    raise TypeError(f"{type(servicer).__name__} does not derive from a generated gRPC servicer class")


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Channel/server options shared by both ends: message-size limits and keepalive pings that keep long
    streams (WatchJob, WatchTopology) alive through idle periods."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def open_channel(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` (``host:port``) with the default limits; TLS when ``credentials``
    are given, plaintext otherwise. ``options`` are appended (and override the defaults)."""
    opts = channel_options(max_message_bytes) + list(options)
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


@dataclass(kw_only=True)
class RpcServer:
    """A started server: its bound ``port``/``address``, health control and graceful stop."""

    server: grpc.aio.Server
    host: str
    port: int
    services: tuple[str, ...]
    health: HealthServicer
    _stopped: bool = field(default=False, repr=False)

    @property
    def address(self) -> str:
        """``host:port`` to dial (IPv6 hosts in brackets; a wildcard host becomes loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"

    async def set_serving(self, service: str, serving: bool) -> None:
        """Report ``service`` (a full name, or ``""`` for the whole server) as SERVING or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(service, status)

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Graceful stop: every service NOT_SERVING, refuse new calls, let in-flight calls finish for up to
        ``grace_s`` seconds (None waits for them), then cancel the rest. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        log.info("rpc.server_stopped", address=self.address, services=list(self.services))

    async def wait(self) -> None:
        """Block until the server terminates (after :meth:`stop`, or forever)."""
        await self.server.wait_for_termination()

    async def __aenter__(self) -> RpcServer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def serve(
    servicers: Sequence[object],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    credentials: grpc.ServerCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> RpcServer:
    """Create, bind and start a grpc.aio server for ``servicers`` (instances of generated ``*Servicer``
    classes, or :class:`Service` objects), with health and reflection for each.

    ``port=0`` binds a free port; the bound port is in the result. ``credentials`` switch to TLS (mTLS
    when they require client certificates). Raises ``OSError`` when the address cannot be bound (also
    when another process listens there: ``SO_REUSEPORT`` is disabled).
    """
    services = [service_of(s) for s in servicers]
    names = [s.name for s in services]
    if len(set(names)) != len(names):
        raise ValueError(f"a service is given twice: {names}")
    # SO_REUSEPORT off: a second server on a taken port must fail, not silently share the port.
    # Clients ping idle streams every 30 s (channel_options); the server must accept that rate, or it
    # answers GOAWAY "too_many_pings" and closes long WatchJob/WatchTopology streams after a few minutes.
    keepalive_policy = [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]
    server_options = [*channel_options(max_message_bytes), *keepalive_policy, ("grpc.so_reuseport", 0), *options]
    # the decode guard last, closest to the servicers: undecodable requests are INVALID_ARGUMENT (not
    # UNKNOWN), after the interceptors before it (authentication) have run; metrics, authentication and the
    # guard run as one interceptor (spiderflow.rpc.pipeline)
    from spiderflow.rpc.pipeline import fuse

    server = grpc.aio.server(options=server_options, interceptors=fuse(list(interceptors)))
    for s in services:
        s.register(s.servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*names, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    target = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_secure_port(target, credentials) if credentials else server.add_insecure_port(target)
    except RuntimeError as e:
        raise OSError(f"cannot bind {target}: {e}") from e
    if bound == 0:
        raise OSError(f"cannot bind {target}")
    await server.start()
    for name in names:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    result = RpcServer(server=server, host=host, port=bound, services=tuple(names), health=health)
    log.info("rpc.server_started", address=result.address, services=names, tls=credentials is not None)
    return result
