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

The record types and their encoding live in :mod:`spiderflow.store.records` (with every other stored
record); this module names them for the agent.

Pure: no I/O.
"""

from __future__ import annotations

from spiderflow.store.records import PeerAddress, Registration

__all__ = ["PeerAddress", "Registration"]
