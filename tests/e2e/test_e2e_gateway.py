"""``spiderflow up --testbed --gateway``: the sample job trained across network namespaces whose router drops
every cluster-to-cluster TCP connection except to the gateway port. Workers, the rendezvous store and the
agents' probes reach the other clusters only through their clusters' gateways (node NAT to the local gateway,
mutual TLS between gateways with the clusters' agent certificates); the job reaches SUCCEEDED, each gateway
carried traffic both ways, and afterwards no process or namespace of the run is left. Needs root; a few
minutes of training, so ``heavy``."""

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

pytestmark = [pytest.mark.netns, pytest.mark.heavy, pytest.mark.timeout(420)]


_REASON = netns_skip_reason("sfgw-e2e")
if _REASON:
    pytest.skip(f"testbed needs root and network namespaces: {_REASON}", allow_module_level=True)


def _events(path: Path, event: str) -> list[dict[str, object]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            out.append(json.loads(line))
    return out


def test_a_job_trains_through_the_gateways_with_only_their_port_open(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    prefix = "sfw" + token[:5]
    mesh_dir = tmp_path / "mesh"
    env = {**os.environ, MARK: token, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "spiderflow.cli.main", "up", "--testbed", "--gateway", "--testbed-prefix", prefix,
         "--steps", "6", "--json", "--data-dir", str(mesh_dir), "--timeout", "300", "--no-dashboard"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    try:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        start = proc.stdout.find("\n{\n")
        summary, _ = json.JSONDecoder().raw_decode(proc.stdout[start + 1:])
        assert summary["state"] == "SUCCEEDED", summary
        assert summary["last_loss"] < summary["first_loss"]
        chain = summary["chain"]
        assert len(chain) >= 2, summary
        for cluster in chain:  # every cluster of the pipeline sent and received through its gateway
            log = mesh_dir / "agents" / cluster / "gateway" / "gateway.log"
            started = _events(log, "gateway.started")
            assert started and started[0]["port"] == 15443, log.read_text()[-2000:]
            stopped = _events(log, "gateway.stopped")
            assert stopped, log.read_text()[-2000:]
            assert int(stopped[-1]["bytes_out"]) > 0 and int(stopped[-1]["bytes_in"]) > 0, stopped[-1]  # type: ignore[call-overload]
            assert int(stopped[-1]["outbound"]) > 0 and int(stopped[-1]["inbound"]) > 0, stopped[-1]  # type: ignore[call-overload]
    finally:
        left = wait_no_marked_processes(token)
        assert not left, f"processes of the run survived it: {left}"
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [ln for ln in out.splitlines() if ln.startswith(f"{prefix}-")], "a namespace survived the run"
