"""The topology service's reads and writes in the Store (etcd in production, MemoryStore in unit tests).

- :meth:`TopologyRepo.read` — a consistent view of registrations, profiles and links at one revision
  (:meth:`~spiderflow.store.base.Store.get_prefixes`: one etcd transaction of three ranges).
- :meth:`TopologyRepo.report_profile` / :meth:`TopologyRepo.report_links` — authorise the caller, fold
  the report into the stored smoothing state and write it in one transaction guarded by the
  registration's and the records' ``mod_revision`` (so an agent that lost its registration meanwhile
  cannot write, and two replicas never lose each other's samples); retried on conflict.
- :meth:`TopologyRepo.collect_stale_links` — delete link records older than ``link_max_age_s``.

Authorisation (:func:`services.topology.identity.authorize`): the cluster must be registered, and an
authenticated agent reports only about the cluster its principal names; an unauthenticated caller's
``agent_id`` must equal the ``principal`` of the cluster's registration (:mod:`agent.registration`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from services.topology.graph import (
    GraphConfig,
    LinkRecord,
    Measurement,
    ProfileRecord,
    Snapshot,
    apply_measurement,
    apply_profile,
    assemble,
    validate_measurements,
)
from services.topology.identity import Caller, authorize
from spiderflow.core.domain import Cluster
from spiderflow.core.errors import CorruptRecordError, UnavailableError, ValidationError
from spiderflow.store import keys, records
from spiderflow.store.base import Compare, CompareFailedError, KeyValue, Put, Store
from spiderflow.store.keys import KeyKind
from spiderflow.store.records import Registration

__all__ = ["LinksOutcome", "RawState", "TopologyRepo", "record_of"]

log = structlog.get_logger(__name__)

_PREFIXES = (keys.CLUSTERS, keys.PROFILES, keys.LINKS)


@dataclass(frozen=True, slots=True, kw_only=True)
class RawState:
    """Decoded records at ``revision`` (malformed records are skipped and logged)."""

    registrations: dict[str, Registration]
    profiles: dict[str, ProfileRecord]
    links: dict[tuple[str, str], LinkRecord]
    revision: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LinksOutcome:
    revision: int
    accepted: int
    rejected: tuple[str, ...]


def record_of(key: str, value: bytes | None, state: RawState) -> None:
    """Apply one stored key's new value (None = deleted) to ``state`` (in place); keys of other kinds are
    ignored, a record that does not decode is logged with its key and field and skipped."""
    if not key.startswith(_PREFIXES):
        return
    try:
        k = keys.parse(key)
        if k.kind is KeyKind.REGISTRATION:
            if value is None:
                state.registrations.pop(k.cluster, None)
            else:
                state.registrations[k.cluster] = records.decode_as(key, value, Registration)
        elif k.kind is KeyKind.PROFILE:
            if value is None:
                state.profiles.pop(k.cluster, None)
            else:
                state.profiles[k.cluster] = records.decode_as(key, value, ProfileRecord)
        elif k.kind is KeyKind.LINK:
            pair = (k.cluster, k.peer)
            if value is None:
                state.links.pop(pair, None)
            else:
                state.links[pair] = records.decode_as(key, value, LinkRecord)
    except CorruptRecordError as e:
        log.warning("topology.bad_record", key=key, field=e.field, error=e.reason)


class TopologyRepo:
    """Reads and writes of the topology service (see the module docstring). ``clock`` gives the
    service's wall time in seconds (injectable for tests); ``attempts`` bounds retries."""

    def __init__(self, store: Store, config: GraphConfig, *, clock: Callable[[], float] = time.time,
                 attempts: int = 8) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.attempts = attempts

    # -- reads --------------------------------------------------------------------------------------

    async def read(self) -> RawState:
        """A consistent :class:`RawState`: the three prefixes read atomically at one revision."""
        items, revision = await self.store.get_prefixes(_PREFIXES)
        state = RawState(registrations={}, profiles={}, links={}, revision=revision)
        for prefix in _PREFIXES:
            for kv in items.get(prefix, []):
                record_of(kv.key, kv.value, state)
        return state

    async def snapshot(self) -> Snapshot:
        """The current snapshot (assembled at the service's current time)."""
        state = await self.read()
        return self.assemble(state)

    def assemble(self, state: RawState) -> Snapshot:
        return assemble(state.registrations, state.profiles, state.links, revision=state.revision,
                        now=self.clock(), config=self.config)

    async def _registration(self, cluster: str, caller: Caller, *, field: str) -> KeyValue:
        kv = await self.store.get(keys.cluster_key(cluster))
        if kv is None:
            raise ValidationError(field, "unknown cluster: no agent has registered it (or its lease expired)",
                                  cluster)
        try:
            reg = Registration.decode(kv.value, key=kv.key)
        except ValidationError as e:
            raise ValidationError(field, f"the cluster's registration is malformed: {e.reason}", cluster) from None
        authorize(reg, caller)
        return kv

    # -- writes -------------------------------------------------------------------------------------

    async def report_profile(self, cluster: Cluster, caller: Caller, *, agent_address: str,
                             measured_at: float) -> int:
        """Store a reported profile; returns the revision of the write."""
        key = keys.profile_key(cluster.name)
        for _ in range(self.attempts):
            reg = await self._registration(cluster.name, caller, field="cluster.name")
            prev_kv = await self.store.get(key)
            prev = None
            if prev_kv is not None:
                try:
                    prev = ProfileRecord.decode(prev_kv.value, key=prev_kv.key)
                except ValidationError:
                    prev = None
            record, accepted = apply_profile(prev, cluster, agent_id=caller.agent_id, agent_address=agent_address,
                                             measured_at=measured_at, now=self.clock(), config=self.config)
            try:
                rev = await self.store.commit(
                    [Compare(key=reg.key, mod_revision=reg.mod_revision),
                     Compare(key=key, mod_revision=prev_kv.mod_revision if prev_kv else 0)],
                    [Put(key=key, value=record.encode())],
                )
            except CompareFailedError:
                continue
            log.info("topology.profile_reported", cluster=cluster.name, agent_id=caller.agent_id, revision=rev,
                     gpu=cluster.gpu, gpus=cluster.total_gpus, free_gpus=cluster.free,
                     tflops=record.cluster.tflops, tflops_accepted=accepted)
            return rev
        raise UnavailableError(f"topology: profile of {cluster.name} kept conflicting; retry")

    async def report_links(self, source: str, caller: Caller, raw: Sequence[Measurement]) -> LinksOutcome:
        """Validate and store a link report from ``source``; every target must be registered."""
        if not source:
            raise ValidationError("cluster", "is required")
        measurements = validate_measurements(source, raw)
        for _ in range(self.attempts):
            reg = await self._registration(source, caller, field="cluster")
            # Two range reads per report, whatever the number of peers.
            registered = {kv.key: kv for kv in (await self.store.get_prefix(keys.CLUSTERS))[0]}
            stored = {kv.key: kv for kv in (await self.store.get_prefix(keys.links_from_prefix(source)))[0]}
            compares = [Compare(key=reg.key, mod_revision=reg.mod_revision)]
            puts: list[Put] = []
            rejected: list[str] = []
            now = self.clock()
            for i, m in enumerate(measurements):
                target_kv = registered.get(keys.cluster_key(m.target))
                if target_kv is None:
                    raise ValidationError(f"measurements[{i}].target",
                                          "unknown cluster: no agent has registered it", m.target)
                compares.append(Compare(key=target_kv.key, mod_revision=target_kv.mod_revision))
                key = keys.link_key(source, m.target)
                prev_kv = stored.get(key)
                prev = None
                if prev_kv is not None:
                    try:
                        prev = LinkRecord.decode(prev_kv.value, key=prev_kv.key)
                    except ValidationError:
                        prev = None
                compares.append(Compare(key=key, mod_revision=prev_kv.mod_revision if prev_kv else 0))
                record, accepted = apply_measurement(prev, source, m, now=now, config=self.config)
                if not accepted:
                    rejected.append(m.target)
                if record is not None:
                    puts.append(Put(key=key, value=record.encode()))
            try:
                rev = await self.store.commit(compares, puts) if puts else await self.store.revision()
            except CompareFailedError as e:
                log.info("topology.links_conflict", cluster=source, keys=list(e.keys))
                continue
            log.info("topology.links_reported", cluster=source, agent_id=caller.agent_id, revision=rev,
                     measured=len(measurements), rejected=rejected)
            return LinksOutcome(revision=rev, accepted=len(measurements) - len(rejected), rejected=tuple(rejected))
        raise UnavailableError(f"topology: links of {source} kept conflicting; retry")

    async def collect_stale_links(self) -> int:
        """Delete link records not updated for ``link_max_age_s`` (guarded by their ``mod_revision``, so a
        fresh write wins). Returns how many were deleted."""
        items, _ = await self.store.get_prefix(keys.LINKS)
        now = self.clock()
        deleted = 0
        for kv in items:
            try:
                rec = LinkRecord.decode(kv.value, key=kv.key)
            except ValidationError:
                continue
            if now - rec.updated_at >= self.config.link_max_age_s:
                try:
                    await self.store.delete_if(kv.key, kv.mod_revision)
                except CompareFailedError:
                    continue
                deleted += 1
                log.info("topology.link_aged_out", src=rec.src, dst=rec.dst, age_s=round(now - rec.updated_at, 1))
        return deleted
