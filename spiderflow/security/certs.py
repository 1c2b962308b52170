"""A development certificate authority and per-component certificates (``spiderflow certs init``).

Layout of a certificate directory ``DIR``::

    DIR/ca/ca.crt, ca.key           the CA (keep ca.key private; only ``certs init`` uses it)
    DIR/<bundle>/ca.crt             a copy of the CA certificate (to verify the other end)
    DIR/<bundle>/tls.crt, tls.key   the component's certificate and private key

One bundle per component, so every ``--tls-dir`` points at exactly one bundle:

=====================  =====================  ==============================================
bundle                 subject (OU / CN)      used by
=====================  =====================  ==============================================
``scheduler``          service / scheduler    ``spiderflow serve scheduler`` (server + client)
``planner``            service / planner      ``spiderflow serve planner``
``topology``           service / topology     ``spiderflow serve topology``
``agent-<cluster>``    agent / <cluster>      the agent of that cluster (server + client)
``tenant-<tenant>``    tenant / <tenant>      the CLI/SDK of that tenant
``admin``              admin / admin          the operator's CLI
``etcd-server``        etcd / etcd            etcd's client URL (``--cert-file``, ``--key-file``)
``etcd-client``        etcd / spiderflow      services and agents connecting to etcd
=====================  =====================  ==============================================

The two etcd bundles are signed by a second CA, ``DIR/etcd-ca/``, which is also their ``ca.crt``: etcd
trusts only certificates of that CA (``--trusted-ca-file``), so a tenant's or an agent's SpiderFlow
certificate does not open etcd, and an etcd client certificate names no SpiderFlow role (its OU is
``etcd``), so it opens no SpiderFlow service. With etcd authentication on, etcd takes the client
certificate's CN (``spiderflow``) as the user when a request carries no user/password token.

Every certificate is valid for both TLS server and client authentication and names ``localhost``,
``127.0.0.1``, ``::1``, its component name and the extra ``hosts`` as subject alternative names, so any
component can serve on loopback or under its compose service name. Keys are ECDSA P-256. The subject's
OU and CN make the caller's :class:`~spiderflow.security.identity.Principal`; the same principal is also
written as a ``spiderflow:<role>:<name>`` URI SAN.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spiderflow.errors import ValidationError
from spiderflow.security.identity import Principal, Role

__all__ = [
    "CA_CERT",
    "CERT",
    "ETCD_CLIENT",
    "ETCD_SERVER",
    "KEY",
    "SERVICES",
    "Bundle",
    "bundle_name",
    "init_certs",
    "issue",
    "principal_of_pem",
]

log = structlog.get_logger(__name__)

CA_CERT = "ca.crt"
CERT = "tls.crt"
KEY = "tls.key"
SERVICES = ("scheduler", "planner", "topology")
ETCD_SERVER = "etcd-server"
ETCD_CLIENT = "etcd-client"
_ETCD_CA = "etcd-ca"
_ETCD_OU = "etcd"
_VALID_DAYS = 365


@dataclass(frozen=True, slots=True, kw_only=True)
class Bundle:
    """One written bundle: its directory and the principal its certificate carries (None for the etcd
    bundles, which name no SpiderFlow role)."""

    path: Path
    principal: Principal | None
    subject: str = ""
    """``OU/CN`` of the certificate."""


def bundle_name(principal: Principal) -> str:
    """The bundle directory name of a principal (see the module table)."""
    if principal.role is Role.SERVICE:
        return principal.name
    if principal.role is Role.ADMIN:
        return "admin" if principal.name == "admin" else f"admin-{principal.name}"
    return f"{principal.role}-{principal.name}"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def _new_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SpiderFlow"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, principal: Principal, *,
          hosts: Sequence[str] = ()) -> tuple[bytes, bytes]:
    """A certificate for ``principal`` signed by the CA: ``(cert_pem, key_pem)``."""
    return _issue(ca_key, ca_cert, ou=str(principal.role), cn=principal.name,
                  dns=["localhost", principal.name, bundle_name(principal), *hosts],
                  uri=f"spiderflow:{principal.role}:{principal.name}", server=True)


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, *, ou: str, cn: str,
           dns: Sequence[str], uri: str | None, server: bool) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SpiderFlow"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou),
                         x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys(dns):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    sans += [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
    if uri:
        sans.append(x509.UniformResourceIdentifier(uri))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server \
        else [ExtendedKeyUsageOID.CLIENT_AUTH]
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=_VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _load_or_create_ca(directory: Path, name: str = "ca", common_name: str = "SpiderFlow development CA",
                       ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, bool]:
    ca_dir = directory / name
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / "ca.key"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValidationError(str(key_path), "is not an ECDSA private key")
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes()), False
    ca_dir.mkdir(parents=True, exist_ok=True)
    key, cert = _new_ca(common_name)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_path, _key_pem(key))
    return key, cert, True


def init_certs(directory: Path, *, clusters: Sequence[str] = (), tenants: Sequence[str] = (),
               hosts: Sequence[str] = (), admin: bool = True, etcd: bool = True,
               force: bool = False) -> list[Bundle]:
    """Create (or extend) a certificate directory: the CA if absent, then one bundle per service, cluster,
    tenant and the admin, and (``etcd``) the etcd CA with the ``etcd-server`` and ``etcd-client`` bundles.
    An existing bundle is kept unless ``force``; an existing CA is always reused, so running it again with a
    new ``--cluster`` adds that agent's bundle to the same trust domain. Returns the bundles written."""
    principals = [Principal(role=Role.SERVICE, name=s) for s in SERVICES]
    principals += [Principal(role=Role.AGENT, name=c) for c in clusters]
    principals += [Principal(role=Role.TENANT, name=t) for t in tenants]
    if admin:
        principals.append(Principal(role=Role.ADMIN, name="admin"))
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert, created = _load_or_create_ca(directory)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    written: list[Bundle] = []
    for p in principals:
        bdir = directory / bundle_name(p)
        if (bdir / CERT).exists() and not force:
            continue
        bdir.mkdir(parents=True, exist_ok=True)
        cert_pem, key_pem = issue(ca_key, ca_cert, p, hosts=hosts)
        (bdir / CA_CERT).write_bytes(ca_pem)
        (bdir / CERT).write_bytes(cert_pem)
        _write_private(bdir / KEY, key_pem)
        written.append(Bundle(path=bdir, principal=p, subject=f"{p.role}/{p.name}"))
    if etcd:
        written += _etcd_bundles(directory, hosts=hosts, force=force)
    log.info("certs.initialised", directory=str(directory), ca_created=created,
             bundles=[b.path.name for b in written])
    return written


def _etcd_bundles(directory: Path, *, hosts: Sequence[str], force: bool) -> list[Bundle]:
    """The etcd CA (``etcd-ca/``), etcd's server bundle and the client bundle, under that CA."""
    ca_key, ca_cert, _ = _load_or_create_ca(directory, _ETCD_CA, "SpiderFlow development etcd CA")
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    written: list[Bundle] = []
    for name, cn, server in ((ETCD_SERVER, "etcd", True), (ETCD_CLIENT, "spiderflow", False)):
        bdir = directory / name
        if (bdir / CERT).exists() and not force:
            continue
        bdir.mkdir(parents=True, exist_ok=True)
        cert_pem, key_pem = _issue(ca_key, ca_cert, ou=_ETCD_OU, cn=cn, dns=["localhost", "etcd", name, *hosts],
                                   uri=None, server=server)
        (bdir / CA_CERT).write_bytes(ca_pem)
        (bdir / CERT).write_bytes(cert_pem)
        _write_private(bdir / KEY, key_pem)
        written.append(Bundle(path=bdir, principal=None, subject=f"{_ETCD_OU}/{cn}"))
    return written


@lru_cache(maxsize=4096)
def principal_of_pem(pem: bytes) -> Principal | None:
    """The principal a (verified) certificate names: subject OU = role, CN = name; ``None`` when the
    certificate carries no SpiderFlow role."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
        ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not ous or not cns:
            return None
        return Principal(role=Role(str(ous[0].value)), name=str(cns[0].value))
    except (ValueError, ValidationError):
        return None
