"""``spiderflow up`` puts the services on the clients' default ports when they are free, and on any free
port otherwise (also when a preferred port is taken between the check and the bind)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from spiderflow import mesh as mesh_mod
from spiderflow.core.errors import UnavailableError
from spiderflow.mesh import LocalMesh, sample_topology


def test_a_port_is_used_only_while_nothing_listens_on_it() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert mesh_mod._port_if_free(port) == 0
    assert mesh_mod._port_if_free(port) == port
    assert mesh_mod._port_if_free(0) == 0


@pytest.mark.parametrize(("race", "ports"), [(False, [7]), (True, [7, 0])])
def test_a_service_falls_back_to_any_port_when_its_preferred_one_is_taken(
        race: bool, ports: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh_mod, "_port_if_free", lambda port: port)
    tried: list[int] = []

    class Proc:
        address, pid = "127.0.0.1:1", 1

        def __init__(self, port: int) -> None:
            self.port = port

        def wait_ready(self, timeout: float) -> Proc:
            if race and self.port:
                raise UnavailableError("scheduler exited with 1 before it was ready: address in use")
            return self

        def stop(self, grace_s: float) -> None:
            pass

    def spawn(self: LocalMesh, name: str, port: int, args: Sequence[str]) -> Proc:
        tried.append(port)
        return Proc(port)

    monkeypatch.setattr(LocalMesh, "_spawn_service", spawn)
    m = LocalMesh(sample_topology(1), workdir=tmp_path, service_ports={"scheduler": 7})
    m._service("scheduler")
    assert tried == ports and "scheduler" in m.services


def test_services_started_side_by_side_are_stopped_when_one_of_them_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stopped: list[str] = []

    class Proc:
        address, pid = "127.0.0.1:1", 1

        def __init__(self, name: str) -> None:
            self.name = name

        def wait_ready(self, timeout: float) -> Proc:
            if self.name == "topology":
                raise UnavailableError("topology exited with 1 before it was ready")
            return self

        def stop(self, grace_s: float) -> None:
            stopped.append(self.name)

    def spawn(self: LocalMesh, name: str, port: int, args: Sequence[str]) -> Proc:
        return Proc(name)

    monkeypatch.setattr(LocalMesh, "_spawn_service", spawn)
    m = LocalMesh(sample_topology(1), workdir=tmp_path)
    with pytest.raises(UnavailableError, match="topology exited"):
        m._services(("topology", ()), ("planner", ()))
    assert m.services == {} and stopped == ["topology", "planner"]
