"""The agent's ``gateway:`` section and the gateway as the agent's supervised child process (real processes on
loopback: started, restarted after it is killed, stopped)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from agent.config import load_config
from spiderflow.core.errors import ValidationError
from spiderflow.gateway.process import GatewayProcess
from spiderflow.gateway.protocol import GatewayConfig, GatewayPeer
from spiderflow.security.certs import init_certs

pytestmark = pytest.mark.timeout(90)

BASE = {"cluster": "east", "topology_service": "127.0.0.1:1", "etcd": "127.0.0.1:2"}


def _write(tmp: Path, doc: dict[str, object]) -> Path:
    path = tmp / "agent.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_agent_config_carries_its_gateway(tmp_path: Path) -> None:
    gw = {"enabled": True, "ranges": ["10.1.0.0/16"], "tls_dir": "/certs/agent-east",
          "peers": [{"cluster": "west", "address": "gw.west:15443", "ranges": ["10.2.0.0/16"]}]}
    cfg = load_config(_write(tmp_path, {**BASE, "gateway": gw}), {})
    assert cfg.gateway is not None and cfg.gateway.enabled and cfg.gateway.peer_for("10.2.0.9") is not None
    assert load_config(_write(tmp_path, BASE), {}).gateway is None


@pytest.mark.parametrize(("gateway", "field"), [
    ({"enabled": True, "ranges": ["10.1.0.0/16"]}, "gateway.tls_dir"),  # mutual TLS only
    ({"enabled": True, "tls_dir": "/c"}, "gateway.ranges"),
    ({"enabled": True, "tls_dir": "/c", "ranges": ["10.1.0.0/16"], "peers": [{"cluster": "w"}]},
     "gateway.peers[0].address"),
    ({"port": "x"}, "gateway.port"),
])
def test_a_bad_gateway_section_names_the_field(tmp_path: Path, gateway: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        load_config(_write(tmp_path, {**BASE, "gateway": gateway}), {})
    assert e.value.field == field


async def test_the_agent_keeps_its_gateway_running_and_stops_it(tmp_path: Path) -> None:
    init_certs(tmp_path / "certs", clusters=["east"], etcd=False, admin=False)
    config = GatewayConfig(enabled=True, port=0, listen_host="127.0.0.1", redirect="127.0.0.1:0",
                           ranges=("127.0.1.0/24",),
                           peers=(GatewayPeer(cluster="west", address="127.0.0.1:1", ranges=("127.0.2.0/24",)),))
    gw = GatewayProcess(cluster="east", config=config, tls_dir=tmp_path / "certs" / "agent-east",
                        work_dir=tmp_path / "work")
    ready = await gw.start()
    assert int(ready["port"]) > 0  # type: ignore[call-overload]
    stop = asyncio.Event()
    supervisor = asyncio.ensure_future(gw.supervise(stop))
    first = gw.proc
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    for _ in range(200):  # restarted after a 1 s backoff
        await asyncio.sleep(0.05)
        if gw.proc is not first and gw.ready_file.exists():
            break
    assert gw.proc is not first and gw.restarts == 1
    second = gw.proc
    assert second is not None
    stop.set()
    await asyncio.wait_for(supervisor, timeout=15)
    assert second.returncode is not None  # stopped with the agent
    assert "gateway.stopped" in (tmp_path / "work" / "gateway" / "gateway.log").read_text()


async def test_a_gateway_that_cannot_start_fails_the_agent_with_its_reason(tmp_path: Path) -> None:
    from spiderflow.core.errors import UnavailableError

    config = GatewayConfig(enabled=True, port=0, redirect="127.0.0.1:0", ranges=("127.0.1.0/24",))
    gw = GatewayProcess(cluster="east", config=config, tls_dir=tmp_path / "missing", work_dir=tmp_path / "work")
    with pytest.raises(UnavailableError, match=r"gateway of east did not start: .*gateway.tls_dir: has no ca.crt"):
        await gw.start()


def test_the_documented_gateway_section_loads(tmp_path: Path) -> None:
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "gateway:" in b and "launcher:" not in b]
    assert len(blocks) == 1
    path = tmp_path / "agent.yaml"
    path.write_text("cluster: jureca\ntopology_service: c:1\netcd: e:2\n" + blocks[0])
    cfg = load_config(path, {})
    assert cfg.gateway is not None and cfg.gateway.enabled and cfg.gateway.port == 15443
    assert cfg.gateway.peer_for("10.41.0.1").cluster == "gke-us-central"  # type: ignore[union-attr]
