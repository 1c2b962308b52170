"""Agent configuration: file + flags, validation naming the field, the documented probe traffic bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.agent import build_cluster
from agent.config import ProbeConfig, etcd_options, load_config
from agent.profiler import DeviceProfile, catalog_name
from spiderflow.core.errors import ValidationError

BASE = {"cluster": "a", "topology_service": "127.0.0.1:1", "etcd": "127.0.0.1:2"}


def test_file_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text("cluster: a\ntopology_service: 127.0.0.1:1\netcd: 127.0.0.1:2\n"
                 "gpus: {gpu: A100-80G, nodes: 2, gpus_per_node: 8}\nprobe: {period_s: 3, bulk_bytes: 1048576}\n"
                 "electricity_usd_per_kwh: 0.2\n")
    cfg = load_config(f, {"listen": "127.0.0.2:0", "probe": {"period_s": 5.0, "echo_count": None},
                          "gpus": {"nodes": 4}, "free_gpus": 30})
    assert cfg.listen == "127.0.0.2:0" and cfg.probe.period_s == 5.0 and cfg.probe.bulk_bytes == 1 << 20
    assert cfg.probe.echo_count == 5
    assert cfg.gpus is not None and cfg.gpus.nodes == 4 and cfg.gpus.gpus_per_node == 8
    c = build_cluster(cfg, None)
    assert (c.gpu, c.total_gpus, c.free, c.tflops, c.electricity_usd_per_kwh) == ("A100-80G", 32, 30, None, 0.2)


def test_errors_name_the_field(tmp_path: Path) -> None:
    cases = [
        ({**BASE, "cluster": ""}, "cluster"),
        ({**BASE, "etcd": "nohostport"}, "etcd"),
        ({**BASE, "gpus": {"gpu": "B9000"}}, "gpus.gpu"),
        ({**BASE, "probe": {"bulk_bytes": -1}}, "probe.bulk_bytes"),
        ({**BASE, "probe": {"echo_bytes": 1 << 20}}, "probe.echo_bytes"),
        ({**BASE, "probe": {"colour": 1}}, "probe.colour"),
        ({"cluster": "a", "etcd": "127.0.0.1:2"}, "topology_service"),
    ]
    for overrides, field in cases:
        with pytest.raises(ValidationError) as info:
            load_config(None, dict(overrides))
        assert info.value.field == field, overrides


def test_measured_profile_becomes_the_cluster() -> None:
    cfg = load_config(None, dict(BASE))
    c = build_cluster(cfg, DeviceProfile(gpu="cpu", count=1, memory_gib=7.5, tflops=0.02, device_name="cpu"))
    assert (c.gpu, c.total_gpus, c.tflops, c.memory_gib) == ("cpu", 1, 0.02, 7.5)


def test_probe_traffic_bound() -> None:
    p = ProbeConfig(bulk_bytes=4 << 20, echo_count=5, echo_bytes=64)
    assert p.traffic_per_period(4) == 12 * ((4 << 20) + 640)
    assert p.traffic_per_period(1) == 0


def test_catalog_names() -> None:
    assert catalog_name("NVIDIA A100-SXM4-80GB", 79.2) == "A100-80G"
    assert catalog_name("NVIDIA A100-PCIE-40GB", 39.4) == "A100-40G"
    assert catalog_name("NVIDIA H100 80GB HBM3", 79.0) == "H100-80G"
    assert catalog_name("Tesla V100-SXM2-16GB", 15.8) == "V100-16G"
    with pytest.raises(ValidationError):
        catalog_name("Mystery Accelerator", 10)


def test_etcd_security_and_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """etcd TLS bundle and user from the configuration, the password only from the environment; the bearer
    token never shows in the configuration's repr (logs)."""
    from spiderflow.security.certs import init_certs

    init_certs(tmp_path / "certs", admin=False)
    client = str(tmp_path / "certs" / "etcd-client")
    cfg = load_config(None, {**BASE, "etcd_tls_dir": client, "etcd_user": "root",
                             "token": "agent-token-0123456789abcdef"})
    assert "agent-token" not in repr(cfg)
    monkeypatch.delenv("SPIDERFLOW_ETCD_PASSWORD", raising=False)
    with pytest.raises(ValidationError) as e:
        etcd_options(cfg)
    assert e.value.field == "--etcd-user" and "SPIDERFLOW_ETCD_PASSWORD" in str(e.value)
    monkeypatch.setenv("SPIDERFLOW_ETCD_PASSWORD", "pw-from-env")
    opts = etcd_options(cfg)
    assert (opts["username"], opts["password"]) == ("root", "pw-from-env")
    assert opts["tls"].ca == Path(client) / "ca.crt" and opts["tls"].cert == Path(client) / "tls.crt"
    assert etcd_options(load_config(None, dict(BASE))) == {}
    with pytest.raises(ValidationError) as e:
        etcd_options(load_config(None, {**BASE, "etcd_tls_dir": str(tmp_path / "missing")}))
    assert e.value.field == "--etcd-tls-dir"
    with pytest.raises(ValidationError) as e:
        load_config(None, {**BASE, "token": "has a space"})
    assert e.value.field == "token" and "space" not in str(e.value.value)


def test_an_agent_with_a_scheduler_takes_no_etcd() -> None:
    """Agents reach the control plane's state through the scheduler replicas; direct etcd is a
    development-only mode of agents without a scheduler."""
    base = {"cluster": "va", "topology_service": "127.0.0.1:1"}
    cfg = load_config(None, {**base, "scheduler": "127.0.0.1:2,127.0.0.1:3"})
    assert cfg.etcd is None and cfg.scheduler == "127.0.0.1:2,127.0.0.1:3"
    assert load_config(None, {**base, "etcd": "127.0.0.1:4"}).scheduler is None
    with pytest.raises(ValidationError) as e:
        load_config(None, {**base, "scheduler": "127.0.0.1:2", "etcd": "127.0.0.1:4"})
    assert e.value.field == "etcd"
    with pytest.raises(ValidationError) as e:
        load_config(None, base)
    assert e.value.field == "scheduler"
