"""The key layout: builders, validation and parsing."""

from __future__ import annotations

import pytest

from spiderflow.core.errors import ValidationError
from spiderflow.store import keys


def test_builders_live_under_root_and_parse_back() -> None:
    built = [
        keys.cluster_key("virginia"),
        keys.profile_key("virginia"),
        keys.link_key("virginia", "ohio"),
        keys.job_key("j1"),
        keys.plan_key("j1"),
        keys.allocation_key("ohio"),
        keys.assignment_key("ohio", "j1"),
        keys.report_key("j1", "ohio"),
        keys.checkpoint_key("j1"),
        keys.election_name(keys.SCHEDULER),
        keys.queue_key("j1", priority=3, arrival_ms=12),
    ]
    assert all(k.startswith(keys.ROOT) for k in built)
    assert len(set(built)) == len(built)
    assert keys.split(keys.link_key("a", "b"), keys.LINKS) == ["a", "b"]
    assert keys.link_key("a", "b").startswith(keys.links_from_prefix("a"))
    assert keys.assignment_key("c", "j").startswith(keys.assignments_prefix("c"))
    assert keys.report_key("j", "c").startswith(keys.reports_prefix("j"))
    assert keys.name_of(keys.job_key("j1"), keys.JOBS) == "j1"
    with pytest.raises(ValidationError):
        keys.name_of(keys.link_key("a", "b"), keys.LINKS)
    with pytest.raises(ValidationError):
        keys.split("/elsewhere/x", keys.JOBS)


@pytest.mark.parametrize("bad", ["", "a/b", " a", "a "])
def test_bad_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValidationError):
        keys.cluster_key(bad)
    with pytest.raises(ValidationError):
        keys.link_key("ok", bad)


def test_queue_keys_sort_by_priority_then_arrival() -> None:
    entries = [
        ("low-early", 0, 1),
        ("high-late", 9, 500),
        ("high-early", 9, 20),
        ("mid", 5, 0),
    ]
    ordered = sorted(keys.queue_key(j, priority=p, arrival_ms=a) for j, p, a in entries)
    assert [k.rsplit("/", 1)[1] for k in ordered] == ["high-early", "high-late", "mid", "low-early"]
    with pytest.raises(ValidationError):
        keys.queue_key("j", priority=10_000, arrival_ms=0)
