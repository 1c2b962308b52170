"""Gateways on the emulated testbed (root only): the router drops cluster-to-cluster TCP except to the gateway
port; each namespace's NAT sends its cross-cluster TCP to its own gateway, which crosses over mutual TLS.
A direct connection (one the NAT leaves alone) is dropped; the same kind of connection through the gateways
passes with the pair's latency; gloo's all_reduce and point-to-point run across the two namespaces."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from testbed_fixtures import leftovers_of_testbed, netns_skip_reason

from spiderflow.core.domain import Cluster, Link, Topology
from spiderflow.gateway.protocol import config_to_dict
from spiderflow.security.certs import init_certs
from spiderflow.testbed import Testbed
from spiderflow.testbed.probe import wait_listening

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

_REASON = netns_skip_reason("sfgw-check")
if _REASON:
    pytest.skip(f"testbed needs root and network namespaces: {_REASON}", allow_module_level=True)

PY = sys.executable
A, B = "east", "west"
GW, REDIRECT = 15443, 15080
ECHO_PORT, DIRECT_PORT = 5201, 5202
LATENCY_MS = 10.0


def start_gateways(tb: Testbed, certs: Path, work: Path) -> list[subprocess.Popen[bytes]]:
    """One ``python -m spiderflow.gateway`` per cluster namespace, each waited for (ready file)."""
    procs = []
    ready = []
    for c in tb.topology.names:
        cfg = work / f"gateway-{c}.json"
        cfg.write_text(json.dumps({"cluster": c, "gateway": config_to_dict(
            tb.gateway_config(c, tls_dir=str(certs / f"agent-{c}")))}))
        r = work / f"gateway-{c}.ready"
        ready.append(r)
        log = open(work / f"gateway-{c}.log", "wb")  # noqa: SIM115 - kept open for the process
        procs.append(tb.exec(c, [PY, "-m", "spiderflow.gateway", "--config", str(cfg), "--ready-file", str(r),
                                 "--log-format", "json"], stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 30
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline, [p.poll() for p in procs]
        assert all(p.poll() is None for p in procs), (work / f"gateway-{A}.log").read_text()[-2000:]
        time.sleep(0.05)
    return procs


@pytest.fixture(scope="module")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    work = tmp_path_factory.mktemp("gw")
    certs = work / "certs"
    init_certs(certs, clusters=[A, B], etcd=False, admin=False)
    topo = Topology(clusters=tuple(Cluster(name=n, gpu="cpu", nodes=1, gpus_per_node=1) for n in (A, B)),
                    links=(Link(a=A, b=B, bandwidth_gbps=0.2, latency_ms=LATENCY_MS),))
    prefix = "sfg" + uuid.uuid4().hex[:5]
    tb = Testbed(topo, prefix=prefix, gateway_port=GW, gateway_redirect_port=REDIRECT)
    tb.up()
    try:
        start_gateways(tb, certs, work)
        for port in (ECHO_PORT, DIRECT_PORT):
            tb.exec(B, [PY, "-m", "spiderflow.testbed.probe", "serve", "--port", str(port), "--lifetime", "300"])
        for port in (ECHO_PORT, DIRECT_PORT):
            wait_listening(tb.address(B), port)  # from the host: not through the router's firewall
        yield tb
    finally:
        tb.down()
        assert leftovers_of_testbed(prefix) == []


def _connect(tb: Testbed, src: str, dst: str, port: int, timeout: float) -> str:
    script = textwrap.dedent(f"""
        import socket, time
        t = time.monotonic()
        try:
            s = socket.create_connection(("{tb.address(dst)}", {port}), timeout={timeout})
            s.sendall(b'{{"mode": "echo"}}\\n' + b"x" * 100)
            got = b""
            while len(got) < 100:
                got += s.recv(100)
            print("ok", round((time.monotonic() - t) * 1000, 1))
        except OSError as e:
            print("failed", type(e).__name__)
    """)
    return tb.run(src, [PY, "-c", script], timeout=timeout + 20).stdout.strip()


def test_only_the_gateway_port_crosses_and_gateways_carry_the_rest(testbed: Testbed) -> None:
    # a connection the NAT leaves alone (as from a host without the node rule) goes direct: dropped
    testbed.bypass_gateway(A, DIRECT_PORT)
    assert _connect(testbed, A, B, DIRECT_PORT, timeout=2.0) == "failed TimeoutError"
    # the same kind of connection through the gateways: passes, with the link's round trip and the TLS setup
    result = _connect(testbed, A, B, ECHO_PORT, timeout=10.0)
    assert result.startswith("ok"), result
    r = testbed.run(A, [PY, "-m", "spiderflow.testbed.probe", "rtt", testbed.address(B), str(ECHO_PORT),
                        "--count", "7"], timeout=60)
    assert r.returncode == 0, r.stderr
    rtt = statistics.median(json.loads(r.stdout)["rtt_ms"])
    assert 2 * LATENCY_MS - 1 <= rtt <= 2 * LATENCY_MS + 15, rtt  # the relay still delays gateway traffic


GLOO = textwrap.dedent("""
    import os, sys, datetime, torch, torch.distributed as dist
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://" + sys.argv[2], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    big = torch.arange(2_000_000, dtype=torch.float32) if rank == 0 else torch.empty(2_000_000)
    if rank == 0:
        dist.send(big, 1)
    else:
        dist.recv(big, 0)
    ok = bool((t == 3).all()) and float(big[-1]) == 1_999_999.0
    print("ok" if ok else "wrong", float(t[0]), float(big[-1]))
    dist.destroy_process_group()
""")


def test_gloo_all_reduce_and_p2p_cross_the_gateways(testbed: Testbed) -> None:
    store = f"{testbed.address(A)}:29611"
    procs = [testbed.exec(c, [PY, "-c", GLOO, str(rank), store], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for rank, c in enumerate((A, B))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=100)
        outs.append(out.decode().strip())
        assert p.returncode == 0, err.decode()[-3000:]
    assert all(o.startswith("ok") for o in outs), outs
