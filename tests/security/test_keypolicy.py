"""The agents' per-key policy (pure): which keys of the control plane's state an agent's cluster may touch; and
the per-cluster bound on the Control API's watches (an in-process server over the in-memory store)."""

from __future__ import annotations

import asyncio

import pytest

from spiderflow.core.errors import PermissionDeniedError, ValidationError
from spiderflow.security.keypolicy import Access, RuleKind, checkpoint_claim, decide
from spiderflow.store import keys


@pytest.mark.parametrize(("access", "key", "kind"), [
    (Access.LIST, keys.CLUSTERS, RuleKind.REGISTRATIONS),
    (Access.WATCH, keys.CLUSTERS, RuleKind.REGISTRATIONS),
    (Access.WRITE, keys.cluster_key("ohio"), RuleKind.OWN_REGISTRATION),
    (Access.CAS, keys.cluster_key("ohio"), RuleKind.OWN_REGISTRATION),
    (Access.WATCH, keys.cluster_key("ohio"), RuleKind.OWN_REGISTRATION),
    (Access.LIST, keys.assignments_prefix("ohio"), RuleKind.OWN_ASSIGNMENTS),
    (Access.READ, keys.assignment_key("ohio", "alice~j"), RuleKind.OWN_ASSIGNMENTS),
    (Access.WRITE, keys.rendezvous_key("alice~j", 3), RuleKind.RENDEZVOUS),
    (Access.DELETE, keys.rendezvous_key("alice~j", 3), RuleKind.RENDEZVOUS),
    (Access.READ, keys.checkpoint_key("alice~j"), RuleKind.CHECKPOINT),
    (Access.CAS, keys.checkpoint_key("alice~j"), RuleKind.CHECKPOINT),
])
def test_allowed_keys_and_what_the_server_still_checks(access: Access, key: str, kind: RuleKind) -> None:
    rule = decide("ohio", access, key)
    assert rule.kind is kind and rule.key == key
    if kind is RuleKind.RENDEZVOUS:
        assert (rule.job, rule.attempt) == ("alice~j", 3)
    if kind is RuleKind.CHECKPOINT:
        assert rule.job == "alice~j"
    assert rule.redact == (kind is RuleKind.REGISTRATIONS)


@pytest.mark.parametrize(("access", "key"), [
    (Access.WRITE, keys.profile_key("virginia")),
    (Access.WRITE, keys.profile_key("ohio")),  # profiles only through the topology service
    (Access.WRITE, keys.link_key("ohio", "virginia")),
    (Access.WRITE, keys.cluster_key("virginia")),
    (Access.READ, keys.cluster_key("virginia")),
    (Access.DELETE, keys.cluster_key("ohio")),  # the registration goes with its lease
    (Access.LIST, keys.assignments_prefix("virginia")),
    (Access.WATCH, keys.ASSIGNMENTS),
    (Access.WRITE, keys.assignment_key("ohio", "alice~j")),  # assignments are read-only
    (Access.READ, keys.job_key("alice~j")),
    (Access.LIST, keys.JOBS),
    (Access.LIST, keys.ROOT),
    (Access.WATCH, keys.ROOT),
    (Access.READ, keys.wait_key("alice~j")),
    (Access.WRITE, keys.allocation_key("ohio")),
    (Access.READ, keys.metrics_prefix("alice~j")),
    (Access.WRITE, keys.checkpoint_key("alice~j")),  # only compare-and-swap
    (Access.DELETE, keys.checkpoint_key("alice~j")),
    (Access.LIST, keys.RENDEZVOUS),
    (Access.WRITE, keys.RENDEZVOUS + "alice~j/01"),  # not canonical
    (Access.WRITE, keys.RENDEZVOUS + "alice~j/1/x"),
    (Access.WRITE, keys.RENDEZVOUS + "../1"),
    (Access.READ, keys.CLUSTERS + "ohio/../virginia"),
    (Access.READ, "/etc/passwd"),
    (Access.READ, keys.lease_owner_key(7)),
])
def test_everything_else_is_denied_naming_the_key(access: Access, key: str) -> None:
    with pytest.raises(PermissionDeniedError) as e:
        decide("ohio", access, key)
    assert key in str(e.value) and "agent:ohio" in str(e.value)


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValidationError, match="key"):
        decide("ohio", Access.READ, "")
    with pytest.raises(ValidationError, match="cluster"):
        decide("../x", Access.READ, keys.cluster_key("ohio"))
    assert checkpoint_claim(b'{"step": 3, "attempt": 2, "cluster": "ohio"}') == (2, "ohio")
    for bad, field in ((b"{", "value"), (b"[]", "value"), (b'{"cluster": "ohio"}', "value.attempt"),
                       (b'{"attempt": true, "cluster": "ohio"}', "value.attempt"),
                       (b'{"attempt": 1}', "value.cluster")):
        with pytest.raises(ValidationError) as e:
            checkpoint_claim(bad)
        assert e.value.field == field


async def test_open_watches_are_bounded_per_cluster() -> None:
    """One agent cannot exhaust a replica's watches: beyond the bound RESOURCE_EXHAUSTED, for that cluster
    only; a closed watch frees its place."""
    from agent.remote_store import RemoteStore
    from services.scheduler.control import ControlService
    from spiderflow.core.errors import ResourceExhaustedError
    from spiderflow.rpc.server import serve
    from spiderflow.store.memory import MemoryStore

    store = MemoryStore()
    server = await serve([ControlService(store, max_watches_per_cluster=2)])
    ohio, va = (RemoteStore(server.address, cluster=c, stream_retry_s=1) for c in ("ohio", "va"))
    try:
        first = await ohio.watch_prefix(keys.CLUSTERS).start()
        second = await ohio.watch_prefix(keys.assignments_prefix("ohio")).start()
        with pytest.raises(ResourceExhaustedError, match="agent:ohio has 2 watches open"):
            await ohio.watch_prefix(keys.CLUSTERS).start()
        other = await va.watch_prefix(keys.CLUSTERS).start()  # another cluster is not affected
        await first.aclose()
        for _ in range(50):  # the server sees the stream end
            try:
                third = await ohio.watch_prefix(keys.CLUSTERS).start()
                break
            except ResourceExhaustedError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("a closed watch did not free its place")
        for w in (second, other, third):
            await w.aclose()
    finally:
        await ohio.close()
        await va.close()
        await server.stop(grace_s=0)
        await store.close()
