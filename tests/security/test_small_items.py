"""Regression tests of the smaller findings: workers inherit none of the agent's secrets, and a write
that fails half-way (a full disk) leaves no temporary file behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from spiderflow.runtime import write_ready_file
from spiderflow.security.secrets import SECRET_VARIABLES, worker_environment


def test_workers_get_none_of_the_agents_secrets() -> None:
    agent_env = {"PATH": "/usr/bin", "SPIDERFLOW_TOKEN": "agent-secret-0123456789",
                 "SPIDERFLOW_ETCD_PASSWORD": "pw", "SPIDERFLOW_ETCD_USER": "agent", "SPIDERFLOW_TLS_DIR": "/certs",
                 "SPIDERFLOW_ETCD_TLS_DIR": "/etcd", "ETCDCTL_PASSWORD": "pw2", "HOME": "/root"}
    env = worker_environment(agent_env, OMP_NUM_THREADS="1")
    assert env == {"PATH": "/usr/bin", "HOME": "/root", "OMP_NUM_THREADS": "1"}
    assert not SECRET_VARIABLES & env.keys()
    # The executor starts its workers with this environment (and nothing else copied from os.environ).
    source = (Path(__file__).resolve().parents[2] / "agent" / "executor.py").read_text()
    assert "worker_environment(os.environ" in source and "dict(os.environ" not in source


def _full_disk(path: Path) -> None:
    path.write_bytes(b"half a checkpoint")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_leaves_no_tmp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spiderflow.exec.checkpoint import _atomic_write_bytes

    target = tmp_path / "ckpt" / "shard.pt"
    with pytest.raises(OSError) as err:
        _atomic_write_bytes(target, _full_disk)
    assert err.value.errno == errno.ENOSPC
    assert list(tmp_path.rglob("*")) == [tmp_path / "ckpt"]  # no shard, no .tmp

    def full(self: Path, data: str, *args: object, **kwargs: object) -> int:
        Path.write_bytes(self, data[:3].encode())
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError):
        write_ready_file(tmp_path / "ready.json", address="127.0.0.1:1")
    assert not list(tmp_path.glob("ready*"))
