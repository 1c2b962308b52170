"""The Store: SpiderFlow's state in etcd behind one small interface.

See :mod:`spiderflow.store.base` for the contract, :mod:`spiderflow.store.keys` for the key layout and
:mod:`spiderflow.store.records` for the stored records (one codec), :mod:`spiderflow.store.watch` for the
resumable watch both remote stores share.
``EtcdStore`` (real) and ``MemoryStore`` (unit tests) implement it; ``EtcdProcess`` runs a local etcd.
``EtcdStore`` is imported lazily so the pure parts import no gRPC. :class:`EtcdTLS` names the TLS files of an
etcd connection (both ends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spiderflow.store.base import (
    CompactedError,
    Compare,
    CompareFailedError,
    EventType,
    KeyValue,
    LeaderInfo,
    Leadership,
    Lease,
    NotLeaderError,
    Observation,
    Put,
    Store,
    Watch,
    WatchEvent,
    absent,
    unchanged,
)
from spiderflow.store.memory import MemoryStore
from spiderflow.store.tls import EtcdTLS

if TYPE_CHECKING:
    from spiderflow.store.etcd import EtcdStore
    from spiderflow.store.process import EtcdProcess

__all__ = [
    "CompactedError",
    "Compare",
    "CompareFailedError",
    "EtcdProcess",
    "EtcdStore",
    "EtcdTLS",
    "EventType",
    "KeyValue",
    "LeaderInfo",
    "Leadership",
    "Lease",
    "MemoryStore",
    "NotLeaderError",
    "Observation",
    "Put",
    "Store",
    "Watch",
    "WatchEvent",
    "absent",
    "unchanged",
]


def __getattr__(name: str) -> Any:
    if name == "EtcdStore":
        from spiderflow.store.etcd import EtcdStore

        return EtcdStore
    if name == "EtcdProcess":
        from spiderflow.store.process import EtcdProcess

        return EtcdProcess
    raise AttributeError(name)
