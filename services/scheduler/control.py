"""The ``Control`` service: the agents' only door to the control plane's state (agents hold no etcd
credentials).

Served by every scheduler replica beside the job API (the state is in etcd, so any replica answers and
an agent needs no leader; it lists every replica and goes round them, :mod:`agent.remote_store`). Each
call names one key (or a prefix for List and Watch); :func:`spiderflow.security.keypolicy.decide` says
whether the caller's cluster may touch it, and this module checks the state the rule depends on:

- **the caller's cluster**: its authenticated principal (``agent:<cluster>`` certificate or token); a
  request naming another cluster, or another role, is PERMISSION_DENIED. Without authentication
  (plaintext on loopback, development) the request's ``cluster`` is taken as given and the key policy
  still applies.
- **registrations**: a write of ``clusters/<own>`` must carry a registration of the caller's cluster under
  a lease granted to it; peers' registrations are listed and watched reduced to cluster and address.
- **leases**: granted here (etcd lease, no keep-alive on this side) with their owner recorded under
  ``leases/<id>`` attached to the lease itself; refreshed, revoked and written with only by their owner.
- **rendezvous / checkpoints**: the caller's assignment of the job (``assignments/<own>/<job>``) must
  exist and, where the key or the manifest names one, be of the same attempt.

A denied key is PERMISSION_DENIED naming it; a malformed key or value is INVALID_ARGUMENT naming the field.
At most :data:`MAX_WATCHES_PER_CLUSTER` Watch streams per cluster are open on one replica (RESOURCE_EXHAUSTED
beyond).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc.aio
import structlog

from spiderflow.core.errors import CorruptRecordError, PermissionDeniedError, ResourceExhaustedError, ValidationError
from spiderflow.proto.control.v1 import control_pb2, control_pb2_grpc
from spiderflow.rpc.errors import map_domain_errors
from spiderflow.security import ids
from spiderflow.security.identity import Role, current_principal
from spiderflow.security.keypolicy import Access, Rule, RuleKind, checkpoint_claim, decide
from spiderflow.store import keys, records
from spiderflow.store.base import CompactedError, Compare, CompareFailedError, EventType, KeyValue, Put, Store

__all__ = ["MAX_LEASE_TTL_S", "MAX_WATCHES_PER_CLUSTER", "ControlService"]

log = structlog.get_logger(__name__)

MAX_LEASE_TTL_S = 3600
"""The longest lease an agent may ask for (seconds)."""
MAX_WATCHES_PER_CLUSTER = 32
"""Open Watch streams per cluster on one replica (an agent needs four or five); RESOURCE_EXHAUSTED beyond, so one
agent cannot exhaust the replica's etcd watches."""
_MAX_VALUE_BYTES = 1 << 20


def _kv(kv: KeyValue) -> control_pb2.KeyValue:
    return control_pb2.KeyValue(key=kv.key, value=kv.value, create_revision=kv.create_revision,
                                mod_revision=kv.mod_revision, version=kv.version, lease=kv.lease)


def _redacted(value: bytes) -> bytes:
    """A peer's registration reduced to its cluster and address (b"" when unreadable)."""
    try:
        r = records.Registration.decode(value)
    except ValidationError:
        return b""
    return records.encode(records.peer_address(r))


def _owner(kv: KeyValue) -> str:
    """The cluster a ``leases/<id>`` key names ("" when it does not decode: no one holds the lease)."""
    try:
        return records.decode_as(kv.key, kv.value, records.LeaseOwner).cluster
    except CorruptRecordError as e:
        log.warning("control.bad_lease_owner", key=kv.key, error=e.reason)
        return ""


def _check_value(key: str, value: bytes) -> None:
    """An agent writes only a well-formed record of its key's kind: INVALID_ARGUMENT naming the field."""
    try:
        records.decode(key, value)
    except CorruptRecordError as e:
        raise ValidationError(f"value.{e.field}" if e.field != "value" else "value",
                              f"is not a {keys.parse(key).kind} record for {key}: {e.reason}", e.value) from None


@map_domain_errors
class ControlService(control_pb2_grpc.ControlServicer):
    """The ``spiderflow.control.v1.Control`` servicer (module docstring)."""

    def __init__(self, store: Store, *, max_watches_per_cluster: int = MAX_WATCHES_PER_CLUSTER) -> None:
        self.store = store
        self.max_watches_per_cluster = max_watches_per_cluster
        self._watches: dict[str, int] = {}

    # -- who is calling, and may it ------------------------------------------------------------------

    @staticmethod
    def _cluster(claimed: str) -> str:
        principal = current_principal()
        if principal is None:  # development: no authentication, the request names the cluster
            if not claimed:
                raise ValidationError("cluster", "is required (the calling agent's cluster)")
            return ids.check_id("cluster", claimed)
        if principal.role is not Role.AGENT:
            raise PermissionDeniedError(f"{principal} is not an agent; the control API serves agents only")
        if claimed and claimed != principal.name:
            raise PermissionDeniedError(f"{principal} may not act for cluster {claimed!r}")
        return principal.name

    async def _assigned_attempt(self, cluster: str, job: str) -> int | None:
        """The attempt of ``job`` that ``cluster`` is assigned now, or None."""
        kv = await self.store.get(keys.assignment_key(cluster, job))
        if kv is None:
            return None
        try:
            return records.decode_as(kv.key, kv.value, records.Assignment).attempt
        except CorruptRecordError as e:
            log.warning("control.bad_assignment", key=kv.key, field=e.field, error=e.reason)
            return None

    async def _check(self, rule: Rule, cluster: str, access: Access) -> None:
        """The state checks of ``rule`` (assignments); PERMISSION_DENIED naming the key."""
        if rule.kind is RuleKind.RENDEZVOUS:
            current = await self._assigned_attempt(cluster, rule.job)
            if current is None or current != rule.attempt:
                raise PermissionDeniedError(f"agent:{cluster} may not {access} {rule.key}: its cluster is not "
                                            f"assigned attempt {rule.attempt} of job {rule.job}")
        elif rule.kind is RuleKind.CHECKPOINT:
            if await self._assigned_attempt(cluster, rule.job) is None:
                raise PermissionDeniedError(f"agent:{cluster} may not {access} {rule.key}: its cluster runs no "
                                            f"stage of job {rule.job}")

    async def _check_lease(self, cluster: str, lease: int, *, field: str = "lease") -> None:
        """PERMISSION_DENIED unless ``lease`` was granted to ``cluster`` (and is alive)."""
        if lease <= 0:
            raise ValidationError(field, "must be a lease granted to the caller", lease)
        owner = await self.store.get(keys.lease_owner_key(lease))
        if owner is None or _owner(owner) != cluster:
            raise PermissionDeniedError(f"agent:{cluster} holds no lease {lease:x}")

    def _visible(self, rule: Rule, cluster: str, key: str, value: bytes, lease: int) -> tuple[bool, bytes, int]:
        """Whether an item of a List/Watch under ``rule`` reaches the caller, with its value and lease."""
        if rule.kind is RuleKind.REGISTRATIONS:
            if key == keys.cluster_key(cluster):
                return True, value, lease
            return True, _redacted(value) if value else b"", 0
        if rule.kind in (RuleKind.OWN_REGISTRATION, RuleKind.RENDEZVOUS, RuleKind.CHECKPOINT):
            return key == rule.key, value, lease  # a key watched as a prefix: that key only
        return True, value, lease

    # -- reads ----------------------------------------------------------------------------------------

    async def Get(self, request: control_pb2.GetRequest,
                  context: grpc.aio.ServicerContext) -> control_pb2.GetResponse:
        cluster = self._cluster(request.cluster)
        rule = decide(cluster, Access.READ, request.key)
        await self._check(rule, cluster, Access.READ)
        kv = await self.store.get(request.key)
        return control_pb2.GetResponse(kv=_kv(kv)) if kv is not None else control_pb2.GetResponse()

    async def List(self, request: control_pb2.ListRequest,
                   context: grpc.aio.ServicerContext) -> control_pb2.ListResponse:
        cluster = self._cluster(request.cluster)
        rule = decide(cluster, Access.LIST, request.prefix)
        await self._check(rule, cluster, Access.LIST)
        items, rev = await self.store.get_prefix(request.prefix)
        resp = control_pb2.ListResponse(revision=rev)
        for kv in items:
            ok, value, lease = self._visible(rule, cluster, kv.key, kv.value, kv.lease)
            if ok:
                resp.kvs.append(control_pb2.KeyValue(key=kv.key, value=value, create_revision=kv.create_revision,
                                                     mod_revision=kv.mod_revision, version=kv.version, lease=lease))
        return resp

    async def Revision(self, request: control_pb2.RevisionRequest,
                       context: grpc.aio.ServicerContext) -> control_pb2.RevisionResponse:
        self._cluster(request.cluster)
        return control_pb2.RevisionResponse(revision=await self.store.revision())

    async def Watch(self, request: control_pb2.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[control_pb2.WatchResponse]:
        cluster = self._cluster(request.cluster)
        rule = decide(cluster, Access.WATCH, request.prefix)
        await self._check(rule, cluster, Access.WATCH)
        if request.start_revision < 0:
            raise ValidationError("start_revision", "must be ≥ 0 (0: from now)", request.start_revision)
        if self._watches.get(cluster, 0) >= self.max_watches_per_cluster:
            raise ResourceExhaustedError(f"agent:{cluster} has {self.max_watches_per_cluster} watches open on this "
                                         "replica already")
        self._watches[cluster] = self._watches.get(cluster, 0) + 1
        try:
            async with self.store.watch_prefix(request.prefix,
                                               start_revision=request.start_revision or None) as watch:
                yield control_pb2.WatchResponse()  # established: changes from here on are delivered
                async for ev in watch:
                    ok, value, lease = self._visible(rule, cluster, ev.key, ev.value, ev.lease)
                    if not ok:
                        continue
                    kind = (control_pb2.EVENT_TYPE_DELETE if ev.type is EventType.DELETE
                            else control_pb2.EVENT_TYPE_PUT)
                    yield control_pb2.WatchResponse(events=[control_pb2.WatchEvent(
                        type=kind, key=ev.key, value=value, mod_revision=ev.mod_revision,
                        create_revision=ev.create_revision, lease=lease)])
        except CompactedError as e:
            yield control_pb2.WatchResponse(compact_revision=max(1, e.compact_revision))
        finally:
            self._watches[cluster] -= 1
            if not self._watches[cluster]:
                del self._watches[cluster]

    # -- writes ---------------------------------------------------------------------------------------

    async def Put(self, request: control_pb2.PutRequest,
                  context: grpc.aio.ServicerContext) -> control_pb2.PutResponse:
        cluster = self._cluster(request.cluster)
        if len(request.value) > _MAX_VALUE_BYTES:
            raise ValidationError("value", f"must be at most {_MAX_VALUE_BYTES} bytes", len(request.value))
        if request.expected_mod_revision < 0:
            raise ValidationError("expected_mod_revision", "must be ≥ 0 (0: the key must be absent)",
                                  request.expected_mod_revision)
        rule = decide(cluster, Access.CAS if request.compare else Access.WRITE, request.key)
        access = Access.CAS if request.compare else Access.WRITE
        if rule.kind is RuleKind.OWN_REGISTRATION:
            try:
                reg = records.Registration.decode(request.value)
            except ValidationError as e:
                raise ValidationError("value", f"must be a registration: {e}") from None
            if reg.cluster != cluster:
                raise PermissionDeniedError(f"agent:{cluster} may not register cluster {reg.cluster!r} "
                                            f"under {request.key}")
            await self._check_lease(cluster, request.lease)
        elif rule.kind is RuleKind.CHECKPOINT:
            attempt, claimed = checkpoint_claim(request.value)
            current = await self._assigned_attempt(cluster, rule.job)
            if claimed != cluster or current is None or current != attempt:
                raise PermissionDeniedError(f"agent:{cluster} may not {access} {rule.key}: only a cluster running "
                                            f"job {rule.job} in its current attempt commits its checkpoint "
                                            f"(manifest of {claimed!r}, attempt {attempt})")
        else:
            await self._check(rule, cluster, access)
        if request.lease and rule.kind is not RuleKind.OWN_REGISTRATION:
            await self._check_lease(cluster, request.lease)
        _check_value(request.key, request.value)
        put = Put(key=request.key, value=request.value, lease=request.lease or None)
        if not request.compare:
            return control_pb2.PutResponse(succeeded=True, revision=await self.store.put(
                put.key, put.value, lease=put.lease))
        try:
            rev = await self.store.commit([Compare(key=request.key, mod_revision=request.expected_mod_revision)],
                                          [put])
        except CompareFailedError as e:
            return control_pb2.PutResponse(succeeded=False, current_mod_revision=e.current.get(request.key, 0))
        return control_pb2.PutResponse(succeeded=True, revision=rev)

    async def Delete(self, request: control_pb2.DeleteRequest,
                     context: grpc.aio.ServicerContext) -> control_pb2.DeleteResponse:
        cluster = self._cluster(request.cluster)
        rule = decide(cluster, Access.DELETE, request.key)
        await self._check(rule, cluster, Access.DELETE)
        return control_pb2.DeleteResponse(deleted=await self.store.delete(request.key))

    # -- leases -----------------------------------------------------------------------------------------

    async def GrantLease(self, request: control_pb2.GrantLeaseRequest,
                         context: grpc.aio.ServicerContext) -> control_pb2.GrantLeaseResponse:
        cluster = self._cluster(request.cluster)
        if not 1 <= request.ttl <= MAX_LEASE_TTL_S:
            raise ValidationError("ttl", f"must be 1..{MAX_LEASE_TTL_S} seconds", request.ttl)
        lease = await self.store.grant(int(request.ttl), keepalive=False)
        lease.detach()  # kept alive by the agent through KeepAlive, on any replica
        await self.store.put(keys.lease_owner_key(lease.id), records.encode(records.LeaseOwner(cluster=cluster)),
                             lease=lease.id)
        log.info("control.lease_granted", cluster=cluster, lease=lease.id, ttl=lease.ttl)
        return control_pb2.GrantLeaseResponse(lease=lease.id, ttl=lease.ttl)

    async def KeepAlive(self, request: control_pb2.KeepAliveRequest,
                        context: grpc.aio.ServicerContext) -> control_pb2.KeepAliveResponse:
        cluster = self._cluster(request.cluster)
        if request.lease <= 0:
            raise ValidationError("lease", "must be a lease granted to the caller", request.lease)
        owner = await self.store.get(keys.lease_owner_key(request.lease))
        if owner is None:
            return control_pb2.KeepAliveResponse(ttl=0)  # expired (its owner record went with it)
        if _owner(owner) != cluster:
            raise PermissionDeniedError(f"agent:{cluster} holds no lease {request.lease:x}")
        return control_pb2.KeepAliveResponse(ttl=await self.store.refresh_lease(request.lease))

    async def RevokeLease(self, request: control_pb2.RevokeLeaseRequest,
                          context: grpc.aio.ServicerContext) -> control_pb2.RevokeLeaseResponse:
        cluster = self._cluster(request.cluster)
        if request.lease <= 0:
            raise ValidationError("lease", "must be a lease granted to the caller", request.lease)
        owner = await self.store.get(keys.lease_owner_key(request.lease))
        if owner is None:
            return control_pb2.RevokeLeaseResponse(revoked=False)
        if _owner(owner) != cluster:
            raise PermissionDeniedError(f"agent:{cluster} holds no lease {request.lease:x}")
        return control_pb2.RevokeLeaseResponse(revoked=await self.store.revoke_lease(request.lease))
