"""EtcdProcess: start/stop/restart/suspend/resume of a real etcd child, and cleanup."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from spiderflow.core.errors import UnavailableError
from spiderflow.store.etcd import EtcdStore
from spiderflow.store.process import EtcdProcess

pytestmark = pytest.mark.timeout(60)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_close_kills_and_removes_temp_dir() -> None:
    proc = EtcdProcess().start()
    pid = proc.pid
    assert pid is not None and proc.running and proc.data_dir.is_dir()
    base = proc.data_dir.parent
    proc.suspend()
    assert _state(pid) == "T"
    proc.close()  # also works on a stopped child
    assert _gone(pid) and not base.exists() and not proc.running
    proc.close()  # idempotent


def test_restart_keeps_data_and_ports() -> None:
    with EtcdProcess() as proc:
        endpoint = proc.endpoint

        async def put_then_get() -> bytes:
            store = EtcdStore(proc.endpoint, request_timeout=2.0)
            try:
                await store.put("/k", b"kept")
                first = proc.pid
                proc.restart()
                assert proc.pid != first and proc.endpoint == endpoint
                for _ in range(100):
                    try:
                        kv = await store.get("/k")
                        break
                    except UnavailableError:
                        await asyncio.sleep(0.05)
                assert kv is not None
                return kv.value
            finally:
                await store.close()

        assert asyncio.run(put_then_get()) == b"kept"


def test_given_data_dir_is_kept(tmp_path: Path) -> None:
    data = tmp_path / "etcd-data"
    proc = EtcdProcess(data_dir=data).start()
    pid = proc.pid
    assert pid is not None
    proc.suspend()
    proc.resume()
    assert _state(pid) in ("S", "R")
    proc.close()
    assert _gone(pid) and (data / "member").is_dir()


def test_failed_start_reports_the_log_and_leaves_no_process() -> None:
    proc = EtcdProcess(extra_args=["--no-such-flag"])
    try:
        with pytest.raises(UnavailableError, match="did not become healthy"):
            proc.start(timeout=3.0)
        assert not proc.running
    finally:
        proc.close()


def test_fixture_gives_a_running_etcd(etcd: EtcdProcess) -> None:
    assert etcd.running and etcd.endpoint.startswith("127.0.0.1:")


async def test_tls_etcd_serves_https_only_and_keeps_it_across_restarts(tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    from spiderflow.core.errors import ValidationError
    from spiderflow.security.certs import init_certs
    from spiderflow.store.tls import EtcdTLS

    init_certs(tmp_path, admin=False)
    with pytest.raises(ValidationError):  # a CA alone cannot serve TLS
        EtcdProcess(tls=EtcdTLS(ca=tmp_path / "etcd-server" / "ca.crt"))
    proc = EtcdProcess(tls=EtcdTLS.from_dir(tmp_path / "etcd-server", require_cert=True))
    try:
        proc.start()
        assert proc.url == f"https://{proc.endpoint}" and proc.tls is not None
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP is not served
            urllib.request.urlopen(f"http://{proc.endpoint}/health", timeout=2).read()
        store = EtcdStore(proc.endpoint, tls=EtcdTLS.from_dir(tmp_path / "etcd-client"))
        try:
            await store.put("/k", b"1")
            proc.restart()  # same port, still TLS, data kept
            assert proc.url.startswith("https://")
            kv = await store.get("/k")
            assert kv is not None and kv.value == b"1"
        finally:
            await store.close()
    finally:
        proc.close()
