"""``spiderflow completion bash|zsh`` (scripts exercised in the real shells), ``topology show --png``
(drawn from a live topology service with real agents, and from lat/lon), one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from spiderflow.cli.commands.completion import render
from spiderflow.cli.commands.topology import draw_map
from spiderflow.core.domain import Cluster, Link, Topology
from spiderflow.procs import ManagedProcess, spiderflow_argv
from spiderflow.proto.topology.v1 import topology_pb2, topology_pb2_grpc
from spiderflow.rpc import convert
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(spiderflow_argv(*args), capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"})


# ----------------------------------------------------------------------------- completion
def test_bash_completion_completes_commands_options_choices_and_files(tmp_path: Path) -> None:
    out = cli("completion", "bash")
    assert out.returncode == 0, out.stderr
    script = tmp_path / "spiderflow.bash"
    script.write_text(out.stdout)
    (tmp_path / "map-1.png").write_bytes(b"")
    driver = textwrap.dedent(f"""\
        source {script}
        t() {{ COMP_WORDS=("$@"); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); _spiderflow; echo "${{COMPREPLY[*]}}"; }}
        t spiderflow top
        t spiderflow serve ""
        t spiderflow topology show --
        t spiderflow topology generate --kind ""
        t spiderflow topology generate --kind geo --o
        t spiderflow topology show --png {tmp_path}/map-
        t spiderflow completion ""
        t spiderflow --help topology sh
        complete -p spiderflow
        """)
    r = subprocess.run(["bash", "--norc", "-c", driver], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "topology"
    assert lines[1].split() == ["planner", "scheduler", "topology"]
    assert {"--png", "--json", "--topology-service"} <= set(lines[2].split())
    assert lines[3].split() == ["geo", "hub", "mesh"]
    assert lines[4] == "--out"
    assert lines[5] == f"{tmp_path}/map-1.png"
    assert lines[6].split() == ["bash", "zsh", "fish"]
    assert lines[7] == "show"
    assert "-F _spiderflow spiderflow" in lines[8]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
def test_zsh_completion_offers_described_commands_options_choices_and_files(tmp_path: Path) -> None:
    script = tmp_path / "_spiderflow"
    script.write_text(render("zsh"))
    assert subprocess.run(["zsh", "-n", str(script)], capture_output=True).returncode == 0
    # The completion builtins are replaced by stubs that print what would be offered.
    driver = textwrap.dedent(f"""\
        autoload -U compinit && compinit -u -d {tmp_path}/zcompdump
        source {script}
        compadd() {{ [[ $1 == -- ]] && shift; print -r -- "compadd $*"; }}
        _describe() {{ print -r -- "describe ${{(j:|:)${{(P)4}}}}"; }}
        _files() {{ print -r -- "files"; }}
        _message() {{ print -r -- "message $*"; }}
        t() {{ words=("$@"); CURRENT=${{#words}}; _spiderflow; }}
        t spiderflow topology ""
        t spiderflow topology show --
        t spiderflow serve scheduler --executor ""
        t spiderflow topology show --png ""
        t spiderflow topology validate ""
        """)
    r = subprocess.run(["zsh", "-f", "-c", driver], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("describe validate:check a topology file") and "|show:show the live graph" in lines[0]
    assert lines[1].startswith("compadd") and {"--png", "--json"} <= set(lines[1].split())
    assert lines[2] == "compadd agents sim"
    assert lines[3:] == ["files", "files"]


def test_completion_of_an_unknown_shell_exits_2() -> None:
    r = cli("completion", "tcsh")
    assert r.returncode == 2 and r.stdout == "" and "invalid choice: 'tcsh'" in r.stderr


# ----------------------------------------------------------------------------- topology show --png
def test_draw_map_places_clusters_at_lat_lon(tmp_path: Path) -> None:
    topo = Topology(
        clusters=(Cluster(name="virginia", gpu="A100-80G", nodes=2, gpus_per_node=8, lat=38.9, lon=-77.4),
                  Cluster(name="frankfurt", gpu="H100-80G", nodes=1, gpus_per_node=8, lat=50.1, lon=8.7),
                  Cluster(name="tokyo", gpu="V100-32G", nodes=4, gpus_per_node=8, lat=35.7, lon=139.7)),
        links=(Link(a="virginia", b="frankfurt", bandwidth_gbps=0.4, latency_ms=40),
               Link(a="frankfurt", b="tokyo", bandwidth_gbps=0.05, latency_ms=120, directed=True),
               Link(a="tokyo", b="frankfurt", bandwidth_gbps=0.1, latency_ms=120, directed=True)),
    )
    out = tmp_path / "geo.png"
    draw_map(topo, out)
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000
    empty = tmp_path / "empty.png"
    draw_map(Topology(clusters=()), empty)
    assert empty.read_bytes().startswith(PNG_MAGIC)


def _live_links(address: str) -> int:
    """How many directed links the topology service at ``address`` has measured (0 when it does not answer)."""
    channel = grpc.insecure_channel(address)
    try:
        resp = topology_pb2_grpc.TopologyStub(channel).GetTopology(  # type: ignore[no-untyped-call]
            topology_pb2.GetTopologyRequest(), timeout=5)
    except grpc.RpcError:
        return 0
    finally:
        channel.close()
    return len(convert.topology_from_proto(resp.topology).links) if resp.topology.clusters else 0


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """etcd, the topology service and three agents on loopback; yields the service address once all six
    directed links are measured."""
    tmp = tmp_path_factory.mktemp("live")
    etcd = EtcdProcess()
    procs: list[ManagedProcess] = []
    try:
        etcd.start()
        service = ManagedProcess("topology", spiderflow_argv(
            "serve", "topology", "--listen", "127.0.0.1:0", "--etcd", etcd.endpoint, "--log-format", "json"),
            log_dir=tmp).start()
        procs.append(service)
        agents = [ManagedProcess(f"agent-{name}", spiderflow_argv(
            "agent", "--cluster", name, "--etcd", etcd.endpoint, "--topology-service", service.address,
            "--listen", "127.0.0.1:0", "--gpu", "A100-80G", "--nodes", "1", "--gpus-per-node", gpus,
            "--probe-period", "1", "--probe-bytes", "262144", "--probe-chunk-bytes", "65536",
            "--probe-max-s", "1", "--probe-echoes", "3", "--log-format", "json"), log_dir=tmp)
            for name, gpus in (("virginia", "16"), ("ohio", "8"), ("oregon", "4"))]
        for agent in agents:  # side by side: their interpreter starts overlap
            procs.append(agent.spawn())
        for agent in agents:
            agent.wait_ready(timeout=60)
        # Polled in this process (a CLI process per poll would cost a second of CPU each): the tests below
        # run the CLI against the measured graph.
        deadline = time.monotonic() + 45
        while (links := _live_links(service.address)) < 6:
            assert time.monotonic() < deadline, f"{links} directed links measured"
            time.sleep(0.3)
        yield service.address
    finally:
        for p in procs[1:]:  # the agents stop side by side, then the service
            p.signal(signal.SIGTERM)
        for p in reversed(procs):
            p.stop(grace_s=5)
        etcd.close()
    assert not any(p.alive() for p in procs) and not etcd.running


def test_topology_show_png_draws_the_live_map(live: str, tmp_path: Path) -> None:
    out = tmp_path / "map.png"
    r = cli("topology", "show", "--topology-service", live, "--png", str(out))
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in " ".join(r.stdout.split()) and "3 clusters" in r.stdout
    assert out.read_bytes().startswith(PNG_MAGIC) and out.stat().st_size > 10_000
    # With --json the document is printed as well (and stays machine-readable).
    out2 = tmp_path / "map2.png"
    r = cli("topology", "show", "--topology-service", live, "--png", str(out2), "--json")
    assert r.returncode == 0 and out2.exists()
    assert {c["name"] for c in json.loads(r.stdout)["clusters"]} == {"virginia", "ohio", "oregon"}


def test_topology_show_finds_the_service_in_the_config_file_spiderflow_up_writes(live: str, tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"topology: {live}\n")
    env = {k: v for k, v in os.environ.items() if k != "SPIDERFLOW_TOPOLOGY"}
    r = subprocess.run(spiderflow_argv("topology", "show", "--json"), capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "SPIDERFLOW_CONFIG": str(config)})
    assert r.returncode == 0, r.stderr
    assert {c["name"] for c in json.loads(r.stdout)["clusters"]} == {"virginia", "ohio", "oregon"}


def test_topology_show_errors_are_one_line_with_exit_2(live: str, tmp_path: Path) -> None:
    r = cli("topology", "show", "--topology-service", live, "--png", str(tmp_path / "no" / "such" / "dir.png"))
    assert r.returncode == 2 and r.stderr.startswith("error: --png") and len(r.stderr.strip().splitlines()) == 1
    r = cli("topology", "show", "--address", "nonsense:port")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --address: ")
    r = cli("serve", "topology", "--metrics-listen", "nowhere", "--etcd", "127.0.0.1:1")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --metrics-listen")


def test_up_refuses_zero_clusters_in_one_line() -> None:
    r = cli("up", "--clusters", "0")
    err = r.stderr.strip()
    assert r.returncode == 2 and err.startswith("error: --clusters: must be between 1 and") and "\n" not in err
