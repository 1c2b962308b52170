"""The registration record an agent keeps in etcd: ``clusters/<cluster>`` under the agent's lease.

This record is the contract between an agent and everyone who reads it (the topology service, peers
discovering whom to probe, the scheduler looking for the agent that runs a cluster's stages). A cluster
*exists* exactly while its registration key exists; the key is attached to the agent's lease, so it goes
away by itself within the lease TTL after the agent dies.

Value: a JSON object ::

    {"cluster": "virginia", "agent_id": "virginia-1f3a...", "principal": "virginia-1f3a...",
     "address": "10.77.0.2:41007", "version": "0.1.0", "pid": 1234, "host": "node-1",
     "started_at": 1763790000.0}

``principal`` is the identity the topology service authorises reports against. Without certificates it
equals ``agent_id`` (the instance id the agent sends with every report); with mTLS (``--tls-dir``) it is
the cluster named by the agent's client certificate, which the service compares with the certificate's
name instead — the record and the authorisation rule stay the same.

Peers see less: through the control plane (:mod:`agent.remote_store`) an agent reads other clusters'
registrations reduced to ``{"cluster", "address"}`` (:class:`PeerAddress`), all it needs to probe them.

Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from spiderflow.core.errors import ValidationError

__all__ = ["PeerAddress", "Registration"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    """One agent's registration of its cluster (see the module docstring)."""

    cluster: str
    agent_id: str
    principal: str
    address: str
    version: str = ""
    pid: int = 0
    host: str = ""
    started_at: float = 0.0

    def __post_init__(self) -> None:
        for name in ("cluster", "agent_id", "principal", "address"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValidationError(f"registration.{name}", "must be a non-empty string", value)
        if not isinstance(self.started_at, int | float) or not math.isfinite(self.started_at):
            raise ValidationError("registration.started_at", "must be a finite number", self.started_at)

    def encode(self) -> bytes:
        """The JSON value stored in etcd."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, value: bytes) -> Registration:
        """Parse a stored value; :class:`ValidationError` (field ``registration``) when malformed."""
        try:
            doc = json.loads(value.decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise ValidationError("registration", f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValidationError("registration", "must be a JSON object", type(doc).__name__)
        known = {k: doc[k] for k in cls.__dataclass_fields__ if k in doc}
        try:
            return cls(**known)
        except TypeError as e:
            raise ValidationError("registration", str(e)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerAddress:
    """What an agent learns of a peer's registration: its cluster and the address to probe."""

    cluster: str
    address: str

    @classmethod
    def decode(cls, value: bytes) -> PeerAddress:
        """The cluster and address of a stored registration (full or reduced); :class:`ValidationError`
        (field ``registration``) when malformed."""
        try:
            doc = json.loads(value.decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise ValidationError("registration", f"not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValidationError("registration", "must be a JSON object", type(doc).__name__)
        for name in ("cluster", "address"):
            if not isinstance(doc.get(name), str) or not doc[name]:
                raise ValidationError(f"registration.{name}", "must be a non-empty string", doc.get(name))
        return cls(cluster=doc["cluster"], address=doc["address"])
