"""The agent's client of the control plane's job API: reports reach whichever scheduler replica answers.

Every scheduler replica answers every RPC (the job state is in etcd), so an agent needs no leader: it
needs *a* replica. :class:`ReplicaReporter` holds a channel to each configured replica (``scheduler`` in
the agent's configuration: ``host:port`` or a comma-separated list) and sends each report to the replica
that answered last; when that one is unreachable (UNAVAILABLE, or no answer before the call's timeout)
it tries the next, going round the list with exponential backoff (``backoff_s`` doubling up to
``max_backoff_s``) until ``give_up_s`` has passed. Reports are idempotent on the server (a report of an
older attempt, or an outcome of a job that already ended, is answered ``accepted=false, stop=true`` and
changes nothing), so delivering one more than once is safe: outcomes are delivered at least once and
applied once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import grpc.aio
import structlog

from spiderflow.core.errors import UnavailableError
from spiderflow.proto.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from spiderflow.rpc.errors import domain_errors
from spiderflow.rpc.server import open_channel
from spiderflow.runtime import parse_hostport
from spiderflow.security.auth import bearer_metadata

__all__ = ["ReplicaReporter", "parse_replicas"]

log = structlog.get_logger(__name__)


def parse_replicas(value: str, *, field: str = "scheduler") -> list[str]:
    """``host:port[,host:port...]`` → the addresses (ValidationError naming ``field``)."""
    out = [a.strip() for a in value.split(",") if a.strip()]
    if not out:
        parse_hostport("", field=field)
    for a in out:
        parse_hostport(a, field=field)
    return list(dict.fromkeys(out))


class ReplicaReporter:
    """:class:`agent.executor.Reporter` over every scheduler replica (module docstring)."""

    def __init__(self, addresses: str | Sequence[str], *, timeout_s: float = 10.0, tls_dir: str | None = None,
                 token: str | None = None, backoff_s: float = 0.2, max_backoff_s: float = 5.0,
                 give_up_s: float = 120.0) -> None:
        self.addresses = parse_replicas(addresses) if isinstance(addresses, str) else list(addresses)
        credentials = None
        if tls_dir:
            from spiderflow.security.tls import channel_credentials

            credentials = channel_credentials(Path(tls_dir))
        self._channels = [open_channel(a, credentials=credentials) for a in self.addresses]
        self._stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in self._channels]
        self._timeout = timeout_s
        self._metadata = bearer_metadata(token)
        self._current = 0
        self.backoff_s, self.max_backoff_s, self.give_up_s = backoff_s, max_backoff_s, give_up_s

    @property
    def current(self) -> str:
        """The replica the next report goes to first."""
        return self.addresses[self._current]

    async def report(self, request: scheduler_pb2.ReportProgressRequest) -> tuple[bool, bool]:
        deadline = time.monotonic() + self.give_up_s
        delay = self.backoff_s
        tried = 0
        while True:
            i = self._current
            try:
                with domain_errors():
                    resp = await self._stubs[i].ReportProgress(request, timeout=self._timeout,
                                                               metadata=self._metadata)
                return bool(resp.accepted), bool(resp.stop)
            except UnavailableError as e:
                log.info("agent.replica_unavailable", replica=self.addresses[i], error=str(e)[:200])
            except grpc.aio.AioRpcError as e:  # DEADLINE_EXCEEDED and codes without a domain meaning
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    raise
            self._current = (i + 1) % len(self._stubs)
            tried += 1
            if time.monotonic() >= deadline:
                raise UnavailableError(f"no scheduler replica of {','.join(self.addresses)} answered within "
                                       f"{self.give_up_s:g} s")
            if tried % len(self._stubs) == 0:  # went round every replica: back off before the next round
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(self.max_backoff_s, delay * 2)

    async def close(self) -> None:
        for c in self._channels:
            await c.close()
