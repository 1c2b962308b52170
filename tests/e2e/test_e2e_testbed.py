"""``spiderflow up --testbed``: the sample job trained across network namespaces with kernel-shaped links and
the delay relay. Agents listen on their namespace addresses, the rank-0 agent serves the rendezvous store
there, gloo binds ``GLOO_SOCKET_IFNAME`` (set by the testbed) and the job reaches SUCCEEDED; afterwards no
process of the run and no namespace of its testbed is left. With ``--cpus-per-gpu`` every cluster runs under
its own CPU quota, so each agent calibrates at that share. Needs root and network namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from e2e_harness import MARK, ROOT, wait_no_marked_processes
from testbed_fixtures import netns_skip_reason

from spiderflow.testbed.cpu import cpu_hierarchy

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


_REASON = netns_skip_reason("sfprobe-e2e")
if _REASON:
    pytest.skip(f"testbed needs root and network namespaces: {_REASON}", allow_module_level=True)


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def test_up_in_the_testbed_trains_across_namespaces(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    prefix = "sfe" + token[:5]  # a testbed of its own: other runs on this machine may have theirs up
    mesh_dir = tmp_path / "mesh"
    env = {**os.environ, MARK: token, "PYTHONPATH": str(ROOT)}
    cpu = ["--cpus-per-gpu", "0.4"] if cpu_hierarchy() is not None else []
    proc = subprocess.run(
        [sys.executable, "-m", "spiderflow.cli.main", "up", "--testbed", "--testbed-prefix", prefix, "--steps", "6",
         "--json", "--data-dir", str(mesh_dir), "--timeout", "200", *cpu,
         "--profile-seconds", "0.3"],  # a short calibration: nothing here depends on its precision
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=260,
    )
    try:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        start = proc.stdout.find("\n{\n")
        summary, _ = json.JSONDecoder().raw_decode(proc.stdout[start + 1:])
        assert summary["state"] == "SUCCEEDED", summary
        assert summary["last_loss"] < summary["first_loss"]
        published = [json.loads(line) for f in (mesh_dir / "logs").glob("agent-*.log")
                     for line in f.read_text().splitlines()
                     if line.startswith("{") and '"executor.rendezvous_published"' in line]
        assert len(published) == 1 and not published[0]["host"].startswith("127."), published
        if cpu:  # three agents calibrating at once on this host would get 2/3 of a core each without the quota
            shares = [json.loads(line)["share"] for f in (mesh_dir / "logs").glob("agent-*.log")
                      for line in f.read_text().splitlines()
                      if line.startswith("{") and '"agent.calibrated"' in line]
            assert len(shares) == 3 and all(0.3 <= s <= 0.46 for s in shares), shares
    finally:
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
        assert not _namespaces(f"{prefix}-"), "a namespace of the run's testbed survived it"
