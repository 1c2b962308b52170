"""Pure graph logic: smoothing, report validation, snapshot assembly, ageing and diffs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.registration import Registration
from services.topology.graph import (
    ChangeKind,
    GraphConfig,
    LinkRecord,
    Measurement,
    ProfileRecord,
    apply_changes,
    apply_measurement,
    apply_profile,
    assemble,
    diff,
    validate_measurements,
)
from services.topology.smoothing import Closeness, Outcome, Series, SmoothingConfig, observe
from spiderflow.core.domain import Cluster
from spiderflow.core.errors import ValidationError

CFG = SmoothingConfig(alpha=0.5, outlier_ratio=2.0, shift_after=2)


def test_ewma_and_outlier_rejection() -> None:
    s, out = observe(None, 100.0, CFG, Closeness.RATIO)
    assert out is Outcome.STARTED and s.value == 100.0
    s, out = observe(s, 120.0, CFG, Closeness.RATIO)
    assert out is Outcome.SMOOTHED and s.value == pytest.approx(110.0)
    s2, out = observe(s, 1000.0, CFG, Closeness.RATIO)
    assert out is Outcome.REJECTED and s2.value == pytest.approx(110.0) and s2.pending == 1
    s3, out = observe(s2, 105.0, CFG, Closeness.RATIO)  # back to normal: the spike is forgotten
    assert out is Outcome.SMOOTHED and s3.pending == 0


def test_level_shift_after_agreeing_outliers() -> None:
    s = Series(value=400.0, samples=5)
    s, out = observe(s, 50.0, CFG, Closeness.RATIO)
    assert out is Outcome.REJECTED
    s, out = observe(s, 54.0, CFG, Closeness.RATIO)
    assert out is Outcome.SHIFTED and s.value == pytest.approx(54.0) and s.pending == 0
    # A link re-shaped from 50 to 200 Mbit/s: the first probe after the change reads low (its TCP window
    # was sized for the old rate). It proves the change with the next one, but the new level is the newest.
    s = Series(value=0.0476, samples=9)
    s, out = observe(s, 0.106, CFG, Closeness.RATIO)
    assert out is Outcome.REJECTED and s.value == pytest.approx(0.0476)
    s, out = observe(s, 0.195, CFG, Closeness.RATIO)
    assert out is Outcome.SHIFTED and s.value == pytest.approx(0.195)
    # On a loaded testbed two probes read low (100 and 103 Mbit/s) before the window had grown: the shift
    # lands on 103, and the next sample, further up, is the new level (it is not averaged with 103).
    s = Series(value=0.0476, samples=9)
    for x, want in ((0.100, Outcome.REJECTED), (0.1034, Outcome.SHIFTED), (0.1878, Outcome.SHIFTED)):
        s, out = observe(s, x, CFG, Closeness.RATIO)
        assert out is want
    assert s.value == pytest.approx(0.1878) and s.settling == 0
    s, out = observe(s, 0.1934, CFG, Closeness.RATIO)  # settled: smoothed again
    assert out is Outcome.SMOOTHED and s.value == pytest.approx((0.1878 + 0.1934) / 2)
    # After a shift, a sample back toward the old level is smoothed, and only one sample settles.
    s = Series(value=0.0476, samples=9)
    s, _ = observe(s, 0.19, CFG, Closeness.RATIO)
    s, _ = observe(s, 0.20, CFG, Closeness.RATIO)
    assert s.settling == 1
    s, out = observe(s, 0.18, CFG, Closeness.RATIO)
    assert out is Outcome.SMOOTHED and s.value == pytest.approx(0.19) and s.settling == 0
    s, out = observe(s, 0.21, CFG, Closeness.RATIO)
    assert out is Outcome.SMOOTHED and s.value == pytest.approx(0.20)
    # Disagreeing outliers do not make a shift: each restarts the pending run.
    s = Series(value=100.0)
    s, _ = observe(s, 10.0, CFG, Closeness.RATIO)
    s, out = observe(s, 1000.0, CFG, Closeness.RATIO)
    assert out is Outcome.REJECTED and s.pending == 1 and s.value == 100.0


def test_absolute_test_has_a_floor_for_small_latencies() -> None:
    cfg = SmoothingConfig(alpha=0.5, outlier_ratio=2.0, outlier_floor=5.0)
    s = Series(value=0.1)
    _, out = observe(s, 2.0, cfg, Closeness.ABSOLUTE)  # loopback jitter: 20x, but below the floor
    assert out is Outcome.SMOOTHED
    _, out = observe(Series(value=20.0), 80.0, cfg, Closeness.ABSOLUTE)
    assert out is Outcome.REJECTED


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=1e4), min_size=1, max_size=30))
def test_smoothed_value_stays_within_the_samples(xs: list[float]) -> None:
    s: Series | None = None
    for x in xs:
        s, _ = observe(s, x, CFG, Closeness.RATIO)
    assert s is not None
    assert min(xs) * (1 - 1e-9) <= s.value <= max(xs) * (1 + 1e-9)


def test_validate_measurements_names_the_field() -> None:
    ok = validate_measurements("a", [Measurement(target="b", bandwidth_gbps=1.0, latency_ms=0.0, probe_bytes=10)])
    assert ok[0].bandwidth_gbps == 1.0
    refresh = validate_measurements("a", [Measurement(target="b", bandwidth_gbps=0.0, latency_ms=3.0)])
    assert refresh[0].bandwidth_gbps is None
    bw0, lat0 = "measurements[0].bandwidth_gbps", "measurements[0].latency_ms"
    bad = [
        ([Measurement(target="b", bandwidth_gbps=-1.0, latency_ms=1.0, probe_bytes=1)], bw0),
        ([Measurement(target="b", bandwidth_gbps=math.inf, latency_ms=1.0, probe_bytes=1)], bw0),
        ([Measurement(target="b", bandwidth_gbps=0.0, latency_ms=1.0, probe_bytes=1)], bw0),
        ([Measurement(target="b", bandwidth_gbps=1.0, latency_ms=math.nan, probe_bytes=1)], lat0),
        ([Measurement(target="", bandwidth_gbps=1.0, latency_ms=1.0)], "measurements[0].target"),
        ([Measurement(target="b", bandwidth_gbps=1.0, latency_ms=1.0),
          Measurement(target="b", bandwidth_gbps=1.0, latency_ms=1.0)], "measurements[1].target"),
        ([Measurement(target="b", bandwidth_gbps=1.0, latency_ms=1.0, probe_bytes=-1)], "measurements[0].probe_bytes"),
    ]
    for ms, field in bad:
        with pytest.raises(ValidationError) as info:
            validate_measurements("a", ms)
        assert info.value.field == field


def _reg(name: str) -> Registration:
    return Registration(cluster=name, agent_id=f"{name}-1", principal=f"{name}-1", address="127.0.0.1:1")


def _profile(name: str, now: float = 0.0) -> ProfileRecord:
    rec, _ = apply_profile(None, Cluster(name=name, gpu="cpu", nodes=1, gpus_per_node=1, tflops=0.1),
                           agent_id=f"{name}-1", agent_address="127.0.0.1:1", measured_at=now, now=now,
                           config=GraphConfig())
    return rec


def _link(src: str, dst: str, now: float, bw: float = 1.0) -> LinkRecord:
    rec, ok = apply_measurement(None, src, Measurement(target=dst, bandwidth_gbps=bw, latency_ms=2.0, probe_bytes=1),
                                now=now, config=GraphConfig())
    assert rec is not None and ok
    return rec


def test_records_round_trip() -> None:
    p = _profile("a", 5.0)
    assert ProfileRecord.decode(p.encode()) == p
    link = _link("a", "b", 7.0)
    assert LinkRecord.decode(link.encode()) == link
    r = _reg("a")
    assert Registration.decode(r.encode()) == r
    with pytest.raises(ValidationError):
        LinkRecord.decode(b"{}")


def test_assemble_needs_registration_and_profile_and_ages_links() -> None:
    cfg = GraphConfig(link_max_age_s=10.0)
    regs = {n: _reg(n) for n in ("a", "b", "c")}
    profiles = {n: _profile(n) for n in ("a", "b", "d")}  # c unprofiled, d unregistered
    links = {("a", "b"): _link("a", "b", 0.0), ("b", "a"): _link("b", "a", 8.0), ("a", "d"): _link("a", "d", 8.0)}
    snap = assemble(regs, profiles, links, revision=42, now=12.0, config=cfg)
    assert snap.topology.names == ("a", "b") and snap.revision == 42
    assert [(x.a, x.b) for x in snap.topology.links] == [("b", "a")]  # a->b aged out, d is gone
    assert all(x.directed for x in snap.topology.links)
    assert [s.name for s in snap.clusters] == ["a", "b"] and snap.links[0].updated_at == 8.0


def test_stale_link_restarts_its_smoothing() -> None:
    cfg = GraphConfig(link_max_age_s=10.0)
    old = _link("a", "b", 0.0, bw=1.0)
    rec, ok = apply_measurement(old, "a", Measurement(target="b", bandwidth_gbps=50.0, latency_ms=2.0, probe_bytes=1),
                                now=20.0, config=cfg)
    assert ok and rec is not None and rec.bandwidth.value == 50.0 and rec.bandwidth.samples == 1


def test_diff() -> None:
    cfg = GraphConfig()
    regs = {n: _reg(n) for n in ("a", "b")}
    profiles = {n: _profile(n) for n in ("a", "b")}
    one = assemble(regs, profiles, {("a", "b"): _link("a", "b", 0.0)}, revision=1, now=0.0, config=cfg).topology
    assert [c.kind for c in diff(None, one)] == [ChangeKind.CLUSTER_UPSERTED, ChangeKind.CLUSTER_UPSERTED,
                                                 ChangeKind.LINK_UPSERTED]
    assert diff(one, one) == []
    del regs["b"]
    two = assemble(regs, profiles, {("a", "b"): _link("a", "b", 0.0)}, revision=2, now=0.0, config=cfg).topology
    changes = diff(one, two)
    assert [(c.kind, c.name, c.a, c.b) for c in changes] == [
        (ChangeKind.LINK_REMOVED, "", "a", "b"), (ChangeKind.CLUSTER_REMOVED, "b", "", "")]


_NAMES = ("a", "b", "c", "d", "e")


@st.composite
def _topologies(draw: st.DrawFn) -> object:
    from spiderflow.core.domain import Link, Topology

    names = sorted(draw(st.sets(st.sampled_from(_NAMES), max_size=5)))
    clusters = tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=draw(st.integers(1, 3))) for n in names)
    pairs = [(a, b) for a in names for b in names if a != b]
    chosen = sorted(draw(st.sets(st.sampled_from(pairs), max_size=len(pairs)))) if pairs else []
    links = tuple(Link(a=a, b=b, bandwidth_gbps=draw(st.sampled_from([0.1, 1.0, 10.0])), latency_ms=1.0,
                       directed=True) for a, b in chosen)
    return Topology(clusters=clusters, links=links)


@settings(max_examples=80, deadline=None)
@given(_topologies(), _topologies())
def test_applying_the_diff_gives_the_new_topology(old: object, new: object) -> None:
    from spiderflow.core.domain import Topology

    assert isinstance(old, Topology) and isinstance(new, Topology)
    got = apply_changes(old, diff(old, new))
    assert got.clusters == new.clusters and got.links == new.links


def _report(prev: ProfileRecord | None, tflops: float, mfu: float | None, overhead: float = 0.0,
            gpu: str = "cpu") -> tuple[ProfileRecord, bool]:
    return apply_profile(prev, Cluster(name="c", gpu=gpu, nodes=1, gpus_per_node=1, tflops=tflops, mfu=mfu,
                                       layer_overhead_ms=overhead),
                         agent_id="c-1", agent_address="127.0.0.1:1", measured_at=0.0, now=0.0, config=GraphConfig())


def test_a_plain_tflops_report_is_smoothed() -> None:
    first, _ = _report(None, 100.0, None)
    second, ok = _report(first, 120.0, None)
    assert ok and second.cluster.tflops == pytest.approx(106.0)  # α = 0.3


def test_a_calibrated_report_is_taken_whole() -> None:
    """``mfu`` and the fixed costs were fitted against the reported ``tflops``: the set moves together, so the
    rate the cost model prices (``tflops × mfu``) is the one measured."""
    first, _ = _report(None, 0.080, 0.40, overhead=5.0)
    second, ok = _report(first, 0.070, 0.35, overhead=6.0)
    c = second.cluster
    assert ok and (c.tflops, c.mfu, c.layer_overhead_ms) == (0.070, 0.35, 6.0)
    assert second.tflops is not None and second.tflops.value == 0.070 and second.tflops.samples == 2
    # an outlier (> 2× off) keeps the previous set whole, until agreeing samples confirm the change
    held, ok = _report(second, 0.200, 0.9, overhead=1.0)
    assert not ok and (held.cluster.tflops, held.cluster.mfu, held.cluster.layer_overhead_ms) == (0.070, 0.35, 6.0)
    shifted, ok = _report(held, 0.201, 0.9, overhead=1.0)
    assert ok and (shifted.cluster.tflops, shifted.cluster.mfu, shifted.cluster.layer_overhead_ms) == (0.201, 0.9, 1.0)
