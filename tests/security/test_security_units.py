"""Pure parts of spiderflow.security: principals, certificates, tokens, authorisation, rate limits, flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from spiderflow.core.errors import NotFoundError, PermissionDeniedError, UnauthenticatedError, ValidationError
from spiderflow.security import authz
from spiderflow.security.auth import Authenticator, TokenTable
from spiderflow.security.certs import CERT, init_certs, principal_of_pem
from spiderflow.security.identity import Principal, Role, parse_principal
from spiderflow.security.ratelimit import RateLimiter
from spiderflow.security.tls import add_server_arguments, is_loopback, server_security

ALICE = Principal(role=Role.TENANT, name="alice")
BOB = Principal(role=Role.TENANT, name="bob")
OHIO = Principal(role=Role.AGENT, name="ohio")
ADMIN = Principal(role=Role.ADMIN, name="ops")


def test_parse_principal() -> None:
    assert parse_principal("tenant:alice") == ALICE
    assert str(parse_principal("agent:ohio")) == "agent:ohio"
    for bad in ["alice", "king:alice", "tenant:", "tenant:a/b", "tenant:" + "x" * 64]:
        with pytest.raises(ValidationError):
            parse_principal(bad)


def test_certs_init_layout_and_identities(certs: Path) -> None:
    for bundle, principal in [("scheduler", "service:scheduler"), ("agent-ohio", "agent:ohio"),
                              ("tenant-alice", "tenant:alice"), ("admin", "admin:admin")]:
        files = sorted(p.name for p in (certs / bundle).iterdir())
        extra = ["server.crt", "server.key"] if bundle.startswith("agent-") else []
        assert files == sorted(["ca.crt", "tls.crt", "tls.key", *extra])
        assert (certs / bundle / "tls.key").stat().st_mode & 0o077 == 0
        assert str(principal_of_pem((certs / bundle / CERT).read_bytes())) == principal
    assert (certs / "ca" / "ca.key").exists()


def test_certs_init_again_reuses_the_ca(tmp_path: Path) -> None:
    first = init_certs(tmp_path, tenants=("alice",))
    ca = (tmp_path / "ca" / "ca.crt").read_bytes()
    again = init_certs(tmp_path, tenants=("alice", "carol"))
    assert [b.path.name for b in again] == ["tenant-carol"]
    assert len(first) == 7 and (tmp_path / "ca" / "ca.crt").read_bytes() == ca
    assert (tmp_path / "tenant-carol" / "ca.crt").read_bytes() == ca


def test_etcd_bundles_have_their_own_ca_and_no_spiderflow_role(tmp_path: Path) -> None:
    bundles = {b.path.name: b for b in init_certs(tmp_path, clusters=("virginia",))}
    assert bundles["etcd-server"].principal is None and bundles["etcd-client"].subject == "etcd/spiderflow"
    etcd_ca = (tmp_path / "etcd-ca" / "ca.crt").read_bytes()
    assert etcd_ca != (tmp_path / "ca" / "ca.crt").read_bytes()
    for name in ("etcd-server", "etcd-client"):
        assert (tmp_path / name / "ca.crt").read_bytes() == etcd_ca
        # An etcd client certificate opens no SpiderFlow service (no role), whatever CA it is checked against.
        assert principal_of_pem((tmp_path / name / CERT).read_bytes()) is None
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    client = x509.load_pem_x509_certificate((tmp_path / "etcd-client" / CERT).read_bytes())
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert [b.path.name for b in init_certs(tmp_path, clusters=("virginia",))] == []
    assert {b.path.name for b in init_certs(tmp_path / "plain", etcd=False)} == {
        "scheduler", "planner", "topology", "admin"}


def test_token_table(tmp_path: Path) -> None:
    f = tmp_path / "tokens.yaml"
    f.write_text("tokens:\n  alice-token-0123456789: tenant:alice\n  admin-token-0123456789: admin:ops\n")
    table = TokenTable.load(f)
    assert table.lookup("alice-token-0123456789") == ALICE and table.lookup("nope") is None
    auth = Authenticator(tokens=table)
    assert auth.authenticate([("authorization", "Bearer admin-token-0123456789")], None) == ADMIN
    for md in [[], [("authorization", "Bearer wrong-token-0123456789")], [("authorization", "Basic abc")]]:
        with pytest.raises(UnauthenticatedError):
            auth.authenticate(md, None)
    f.write_text("tokens:\n  short: tenant:alice\n")
    with pytest.raises(ValidationError):
        TokenTable.load(f)
    f.write_text("[1, 2]")
    with pytest.raises(ValidationError):
        TokenTable.load(f)


def test_certificate_identity(certs: Path) -> None:
    auth = Authenticator(certificates=True)
    pem = (certs / "agent-ohio" / CERT).read_bytes()
    assert auth.authenticate([], {"x509_pem_cert": [pem]}) == OHIO
    with pytest.raises(UnauthenticatedError):
        auth.authenticate([], {})
    with pytest.raises(UnauthenticatedError):  # tokens not configured: a bearer token is refused
        auth.authenticate([("authorization", "Bearer x" * 3)], {"x509_pem_cert": [pem]})


def test_submit_and_list_rules() -> None:
    assert authz.submit_tenant(None, "") == "" and authz.submit_tenant(ADMIN, "bob") == "bob"
    assert authz.submit_tenant(ALICE, "") == "alice" and authz.submit_tenant(ALICE, "alice") == "alice"
    assert authz.submit_tenant(ALICE, "default") == "alice"
    for who, tenant in [(ALICE, "bob"), (OHIO, "")]:
        with pytest.raises(PermissionDeniedError):
            authz.submit_tenant(who, tenant)
    assert authz.authorize_list(ALICE, "") == "alice" and authz.authorize_list(ADMIN, "") == ""
    for who, tenant in [(ALICE, "bob"), (OHIO, "")]:
        with pytest.raises(PermissionDeniedError):
            authz.authorize_list(who, tenant)


def test_visibility_rules() -> None:
    authz.require_visible(ALICE, "j", "alice", ["ohio"], write=True)
    authz.require_visible(ADMIN, "j", "alice", [], write=True)
    authz.require_visible(OHIO, "j", "alice", ["ohio"])
    with pytest.raises(NotFoundError, match="not found"):
        authz.require_visible(BOB, "j", "alice", ["ohio"])
    with pytest.raises(NotFoundError):
        authz.require_visible(Principal(role=Role.AGENT, name="oregon"), "j", "alice", ["ohio"])
    with pytest.raises(PermissionDeniedError):
        authz.require_visible(OHIO, "j", "alice", ["ohio"], write=True)


def test_report_and_plan_rules() -> None:
    assert authz.authorize_report(OHIO, "", "j", ["ohio"]) == "ohio"
    assert authz.authorize_report(None, "x", "j", []) == "x"
    for who, claimed, clusters in [(ALICE, "", ["ohio"]), (ADMIN, "", ["ohio"]), (OHIO, "virginia", ["ohio"]),
                                   (OHIO, "", ["virginia"])]:
        with pytest.raises(PermissionDeniedError):
            authz.authorize_report(who, claimed, "j", clusters)
    authz.authorize_plan(ALICE, "alice")
    authz.authorize_plan(ALICE, "")
    authz.authorize_plan(Principal(role=Role.SERVICE, name="scheduler"), "bob")
    for who, tenant in [(ALICE, "bob"), (OHIO, "")]:
        with pytest.raises(PermissionDeniedError):
            authz.authorize_plan(who, tenant)


def test_token_bucket() -> None:
    now = [0.0]
    rl = RateLimiter(rate=10.0, burst=3.0, max_keys=2, clock=lambda: now[0])
    assert [rl.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = rl.take("a")
    assert wait == pytest.approx(0.1)
    assert rl.take("b") == 0.0  # another client has its own bucket
    now[0] += 0.1
    assert rl.take("a") == 0.0 and rl.take("a") > 0
    rl.take("c")
    assert len(rl) == 2  # least recently used key forgotten
    assert RateLimiter(rate=0, burst=0).take("x") == 0.0


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_arguments(p)
    return p.parse_args(list(argv))


def test_server_flags(certs: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("scheduler")
    assert server_security(_args(), host="127.0.0.1").mode == "insecure"
    with pytest.raises(ValidationError, match=r"--tls-dir.*--insecure"):
        server_security(_args(), host="0.0.0.0")
    assert server_security(_args("--insecure"), host="0.0.0.0").credentials is None
    sec = server_security(_args("--tls-dir", str(certs / "scheduler")), host="0.0.0.0")
    assert sec.mode == "mtls" and sec.credentials is not None and sec.authenticating and sec.interceptors
    with pytest.raises(SystemExit):
        _args("--insecure", "--tls-dir", "x")
    with pytest.raises(ValidationError, match="cannot read"):
        server_security(_args("--tls-dir", str(certs / "missing")), host="127.0.0.1")


def test_etcd_flags_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spiderflow.security.tls import add_etcd_arguments, etcd_options
    from spiderflow.store.tls import EtcdTLS

    init_certs(tmp_path)
    client = tmp_path / "etcd-client"
    for var in ("SPIDERFLOW_ETCD_TLS_DIR", "SPIDERFLOW_ETCD_USER", "SPIDERFLOW_ETCD_PASSWORD"):
        monkeypatch.delenv(var, raising=False)

    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_etcd_arguments(p)
        return p.parse_args(list(argv))

    assert etcd_options(parse()) == {}
    tls = etcd_options(parse("--etcd-tls-dir", str(client)))["tls"]
    assert tls == EtcdTLS(ca=client / "ca.crt", cert=client / "tls.crt", key=client / "tls.key")
    with pytest.raises(ValidationError, match="--etcd-tls-dir"):
        etcd_options(parse("--etcd-tls-dir", str(tmp_path / "nope")))
    with pytest.raises(ValidationError, match="SPIDERFLOW_ETCD_PASSWORD"):
        etcd_options(parse("--etcd-user", "root"))
    # The environment gives the defaults; the password only ever comes from it.
    monkeypatch.setenv("SPIDERFLOW_ETCD_TLS_DIR", str(client))
    monkeypatch.setenv("SPIDERFLOW_ETCD_USER", "svc")
    monkeypatch.setenv("SPIDERFLOW_ETCD_PASSWORD", "pw")
    assert etcd_options(parse()) == {"username": "svc", "password": "pw", "tls": tls}
    assert etcd_options(parse("--etcd-user", "root"))["username"] == "root"


def test_etcd_tls_bundle_files(tmp_path: Path) -> None:
    from spiderflow.store.tls import EtcdTLS

    (tmp_path / "ca.crt").write_bytes(b"ca")
    only_ca = EtcdTLS.from_dir(tmp_path)  # server-verified TLS without a client certificate
    assert only_ca.cert is None and only_ca.read() == (b"ca", None, None)
    with pytest.raises(ValidationError):
        EtcdTLS.from_dir(tmp_path, require_cert=True)
    with pytest.raises(ValidationError):
        EtcdTLS(ca=tmp_path / "ca.crt", cert=tmp_path / "tls.crt")  # a certificate without its key
    with pytest.raises(ValidationError):
        EtcdTLS.from_dir(tmp_path / "missing")
    with pytest.raises(ValidationError):
        EtcdTLS(ca=tmp_path / "gone.crt").read()
