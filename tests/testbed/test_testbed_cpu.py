"""Per-cluster CPU quotas of the testbed (:mod:`spiderflow.testbed.cpu`): the pure encoding, the option's
validation, and a real cgroup that holds a cluster's processes, children included, to its share (root only)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from testbed_fixtures import leftovers_of_testbed, netns_skip_reason

from spiderflow.core.domain import Cluster, Link, Topology
from spiderflow.core.errors import ValidationError
from spiderflow.testbed import Testbed, cleanup
from spiderflow.testbed.cpu import (
    HALT_POLL_FILE,
    HALT_POLL_STATE,
    cpu_hierarchy,
    hold_halt_polling,
    quota_lines,
    release_halt_polling,
)


def _topology() -> Topology:
    return Topology(clusters=(Cluster(name="one", gpu="cpu", nodes=1, gpus_per_node=1),
                              Cluster(name="two", gpu="cpu", nodes=1, gpus_per_node=2)),
                    links=(Link(a="one", b="two", bandwidth_gbps=0.1, latency_ms=5),))


def test_quota_lines_encode_cores_per_period_for_both_cgroup_versions() -> None:
    assert quota_lines(0.4, version=1, period_us=10_000) == {"cpu.cfs_period_us": "10000",
                                                               "cpu.cfs_quota_us": "4000"}
    assert quota_lines(1.5, version=2, period_us=20_000) == {"cpu.max": "30000 20000"}
    assert quota_lines(0.01, version=1, period_us=10_000)["cpu.cfs_quota_us"] == "1000"  # the kernel's minimum


@pytest.mark.parametrize("cores", [0.0, -1.0, float("nan")])
def test_quota_lines_refuse_a_non_positive_share(cores: float) -> None:
    with pytest.raises(ValidationError, match="cpus_per_gpu"):
        quota_lines(cores, version=1)


def test_quota_lines_refuse_a_period_the_kernel_rejects() -> None:
    with pytest.raises(ValidationError, match="period_us"):
        quota_lines(0.5, version=2, period_us=500)


@pytest.mark.parametrize("cores", [0.0, -0.5, float("inf")])
def test_testbed_refuses_a_bad_cpu_share_before_creating_anything(cores: float) -> None:
    with pytest.raises(ValidationError, match="cpus_per_gpu"):
        Testbed(_topology(), prefix="sfcpubad", cpus_per_gpu=cores)


def test_cpu_limit_scales_with_the_clusters_workers() -> None:
    tb = Testbed(_topology(), prefix="sfcpuq", cpus_per_gpu=0.25)
    assert tb.cpu_limit("one") == 0.25 and tb.cpu_limit("two") == 0.5
    assert Testbed(_topology(), prefix="sfcpuq").cpu_limit("two") is None


def test_halt_polling_is_raised_by_the_first_holder_and_restored_by_the_last(tmp_path: Path) -> None:
    knob, state = tmp_path / "guest_halt_poll_ns", tmp_path / "state" / "halt-poll.json"
    knob.write_text("200000\n")
    assert hold_halt_polling("a", 10_000_000, knob=knob, state=state) == 10_000_000
    assert hold_halt_polling("b", 5_000_000, knob=knob, state=state) == 10_000_000  # never lowered
    assert knob.read_text() == "10000000"
    assert release_halt_polling("a", knob=knob, state=state) is False  # b still holds it
    assert knob.read_text() == "10000000"
    assert release_halt_polling("b", knob=knob, state=state) is True
    assert knob.read_text() == "200000" and not state.exists()
    assert release_halt_polling("b", knob=knob, state=state) is False  # idempotent


def test_a_host_without_guest_halt_polling_is_left_alone(tmp_path: Path) -> None:
    state = tmp_path / "halt-poll.json"
    assert hold_halt_polling("a", 10_000_000, knob=tmp_path / "absent", state=state) is None
    assert not state.exists()


_BUSY = textwrap.dedent("""
    import json, os, sys, time
    def spin(seconds):
        t, c = time.monotonic(), time.process_time()
        while time.monotonic() - t < seconds:
            pass
        return (time.process_time() - c) / (time.monotonic() - t)
    if sys.argv[1] == "child":
        print(json.dumps({"child": spin(2.0)}), flush=True)
    else:
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child"], stdout=subprocess.PIPE, text=True)
        mine = spin(2.0)
        print(json.dumps({"parent": mine, **json.loads(child.communicate()[0])}), flush=True)
""")


@pytest.mark.netns
def test_a_clusters_processes_and_their_children_share_its_quota(tmp_path: Path) -> None:
    reason = netns_skip_reason("sfcpuchk")
    if reason:
        pytest.skip(f"testbed needs root and network namespaces: {reason}")
    if cpu_hierarchy() is None:
        pytest.skip("no writable cgroup cpu controller here")
    state = tmp_path / "state"
    cleanup("sfcpu", state_dir=state)
    poll_before = HALT_POLL_FILE.read_text() if HALT_POLL_FILE.exists() else None
    others_hold = HALT_POLL_STATE.exists()  # another testbed on this machine holds halt-polling up
    tb = Testbed(_topology(), prefix="sfcpu", state_dir=state, cpus_per_gpu=0.3)
    tb.up()
    try:
        status = tb.status()
        assert [c["cpu_cores"] for c in status["clusters"]] == [0.3, 0.6]
        if poll_before is not None:  # a KVM guest: idle vCPUs poll for a quota period before halting
            assert status["guest_halt_poll_ns"] >= 10_000_000
            assert int(HALT_POLL_FILE.read_text()) >= 10_000_000
        r = tb.run("one", [sys.executable, "-c", _BUSY, "parent", _BUSY], timeout=30)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        # parent and child spin at once: together they get the cluster's 0.3 cores, not a core each
        assert 0.25 <= got["parent"] + got["child"] <= 0.36, got
        cgroup = subprocess.run([*tb.launch_prefix("two"), "cat", "/proc/self/cgroup"], capture_output=True,
                                text=True, timeout=10).stdout
        assert "sfcpu/sfcpu-two-" in cgroup, cgroup
        attached = Testbed.attach("sfcpu", state_dir=state)
        assert attached.launch_prefix("one") == tb.launch_prefix("one")
    finally:
        tb.down()
    assert leftovers_of_testbed("sfcpu") == []
    if poll_before is not None and not others_hold:
        assert HALT_POLL_FILE.read_text() == poll_before
