"""The key layout: builders, validation and parsing."""

from __future__ import annotations

import pytest

from spiderflow.core.errors import CorruptRecordError, ValidationError
from spiderflow.store import keys

BUILT = [
    (keys.cluster_key("virginia"), keys.KeyKind.REGISTRATION),
    (keys.lease_owner_key(0x1F), keys.KeyKind.LEASE_OWNER),
    (keys.profile_key("virginia"), keys.KeyKind.PROFILE),
    (keys.link_key("virginia", "ohio"), keys.KeyKind.LINK),
    (keys.job_key("j1"), keys.KeyKind.JOB),
    (keys.job_key("alice~j1"), keys.KeyKind.JOB),
    (keys.request_key("r1"), keys.KeyKind.REQUEST),
    (keys.request_key("r1", "alice"), keys.KeyKind.REQUEST),
    (keys.allocation_key("ohio"), keys.KeyKind.ALLOCATION),
    (keys.assignment_key("ohio", "j1"), keys.KeyKind.ASSIGNMENT),
    (keys.wait_key("j1"), keys.KeyKind.WAIT),
    (keys.rendezvous_key("j1", 2), keys.KeyKind.RENDEZVOUS),
    (keys.checkpoint_key("j1"), keys.KeyKind.CHECKPOINT),
    (keys.metrics_key("j1", attempt=1, step=20), keys.KeyKind.METRICS),
    (keys.metrics_key("j1", attempt=1, step=20, stage=3), keys.KeyKind.METRICS),
    (keys.metrics_dropped_key("j1"), keys.KeyKind.METRICS_DROPPED),
    (keys.leader_key(keys.SCHEDULER, 0xABC), keys.KeyKind.LEADER),
]


def test_builders_live_under_root_and_parse_back() -> None:
    built = [k for k, _ in BUILT]
    assert all(k.startswith(keys.ROOT) for k in built)
    assert len(set(built)) == len(built)
    for key, kind in BUILT:
        assert keys.parse(key).kind is kind, key
    assert keys.parse(keys.link_key("a", "b")).peer == "b"
    assert keys.parse(keys.request_key("r1", "alice")).tenant == "alice"
    assert keys.parse(keys.request_key("r1")).tenant == "default"
    m = keys.parse(keys.metrics_key("j1", attempt=1, step=20, stage=3))
    assert (m.job, m.attempt, m.step, m.stage) == ("j1", 1, 20, 3)
    assert keys.parse(keys.leader_key(keys.TOPOLOGY, 0xABC)).lease == 0xABC
    assert keys.split(keys.link_key("a", "b"), keys.LINKS) == ["a", "b"]
    assert keys.link_key("a", "b").startswith(keys.links_from_prefix("a"))
    assert keys.assignment_key("c", "j").startswith(keys.assignments_prefix("c"))
    assert keys.metrics_dropped_key("j").startswith(keys.metrics_prefix("j"))
    assert keys.name_of(keys.job_key("j1"), keys.JOBS) == "j1"
    with pytest.raises(ValidationError):
        keys.name_of(keys.link_key("a", "b"), keys.LINKS)
    with pytest.raises(ValidationError):
        keys.split("/elsewhere/x", keys.JOBS)


@pytest.mark.parametrize("key", [
    "/elsewhere/jobs/j1", keys.ROOT + "plans/j1", keys.ROOT + "queue/0001/00000000000000000012/j1",
    keys.ROOT + "jobs/", keys.ROOT + "jobs/a/b", keys.ROOT + "jobs/..", keys.ROOT + "rendezvous/j1/01",
    keys.ROOT + "rendezvous/j1/x", keys.ROOT + "metrics/j1/1-20", keys.ROOT + "leases/XYZ",
    keys.ROOT + "leases/0", keys.ROOT + "requests/a/b/c", keys.ROOT + "elections/scheduler",
])
def test_a_key_no_builder_makes_is_refused_naming_it(key: str) -> None:
    with pytest.raises(CorruptRecordError) as e:
        keys.parse(key)
    assert e.value.key == key and e.value.field == "key" and key in str(e.value)


@pytest.mark.parametrize("bad", ["", "a/b", " a", "a "])
def test_bad_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValidationError):
        keys.cluster_key(bad)
    with pytest.raises(ValidationError):
        keys.link_key("ok", bad)
