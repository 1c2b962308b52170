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
    # Every launcher starts its workers with this environment (agent.launchers.base.worker_env).
    from agent.launchers.base import worker_env

    with pytest.MonkeyPatch.context() as mp:
        for k, v in agent_env.items():
            mp.setenv(k, v)
        launched = worker_env("127.0.0.1", {"SPIDERFLOW_RANK_OFFSET": "0"})
    assert not SECRET_VARIABLES & launched.keys() and "ETCDCTL_PASSWORD" not in launched
    assert launched["SPIDERFLOW_RANK_OFFSET"] == "0" and launched["PATH"] == "/usr/bin"


def test_a_full_disk_leaves_no_tmp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

    from spiderflow.core.catalog import model_preset
    from spiderflow.exec.checkpoint import write_manifest_file
    from spiderflow.exec.spec import CheckpointManifest, ShardInfo

    def no_space(self: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalFileSystem, "mv", no_space)
    manifest = CheckpointManifest(job_id="j", step=3, model=model_preset("gpt-tiny"), root=str(tmp_path / "ckpt"),
                                  shards=(ShardInfo(first_layer=0, last_layer=model_preset("gpt-tiny").layers - 1,
                                                    path="x"),))
    (tmp_path / "ckpt" / "step-00000003").mkdir(parents=True)
    with pytest.raises(OSError) as err:
        write_manifest_file(manifest, tmp_path / "ckpt")
    assert err.value.errno == errno.ENOSPC
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []  # no manifest, no .tmp
    monkeypatch.undo()

    def full(self: Path, data: str, *args: object, **kwargs: object) -> int:
        Path.write_bytes(self, data[:3].encode())
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError):
        write_ready_file(tmp_path / "ready.json", address="127.0.0.1:1")
    assert not list(tmp_path.glob("ready*"))
