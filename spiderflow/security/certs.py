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
``planner``            service / planner      ``spiderflow serve planner`` (server + client)
``topology``           service / topology     ``spiderflow serve topology`` (server + client)
``agent-<cluster>``    agent / <cluster>      the agent of that cluster: ``tls.crt`` client only, and
                                              ``server.crt``/``server.key`` for its own server
``tenant-<tenant>``    tenant / <tenant>      the CLI/SDK of that tenant (client only)
``admin``              admin / admin          the operator's CLI (client only)
``etcd-server``        etcd / etcd            etcd's client URL (``--cert-file``, ``--key-file``)
``etcd-client``        etcd / spiderflow      services and agents connecting to etcd
=====================  =====================  ==============================================

The two etcd bundles are signed by a second CA, ``DIR/etcd-ca/``, which is also their ``ca.crt``: etcd
trusts only certificates of that CA (``--trusted-ca-file``), so a tenant's or an agent's SpiderFlow
certificate does not open etcd, and an etcd client certificate names no SpiderFlow role (its OU is
``etcd``), so it opens no SpiderFlow service. With etcd authentication on, etcd takes the client
certificate's CN (``spiderflow``) as the user when a request carries no user/password token.

Certificates by role (extended key usage and names):

- a **service** certificate is valid for TLS server and client authentication and names ``localhost``,
  ``127.0.0.1``, ``::1``, the service name and the extra ``hosts``;
- **tenant**, **admin** and **agent** certificates (``tls.crt``) are valid for client authentication only
  and name no host, so none of them can serve as a SpiderFlow service: a fake scheduler holding a tenant's
  certificate fails the TLS handshake of every client;
- the agent's own server presents ``server.crt`` (server authentication only, named ``agent-<cluster>``,
  ``localhost``, the loopback addresses and ``hosts``), which cannot authenticate a client.

Keys are ECDSA P-256, written with mode 0600 from their creation (never readable by others, not even
for an instant). The subject's OU and CN make the caller's :class:`~spiderflow.security.identity.Principal`;
the same principal is written as a ``spiderflow:<role>:<name>`` URI SAN, and a certificate whose URI SAN
disagrees with its subject names no principal.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spiderflow.core.errors import ValidationError
from spiderflow.security.identity import Principal, Role

__all__ = [
    "CA_CERT",
    "CERT",
    "ETCD_CLIENT",
    "ETCD_SERVER",
    "KEY",
    "SERVER_CERT",
    "SERVER_KEY",
    "SERVICES",
    "Bundle",
    "bundle_name",
    "init_certs",
    "issue",
    "issue_agent_server",
    "principal_of_pem",
]

log = structlog.get_logger(__name__)

CA_CERT = "ca.crt"
CERT = "tls.crt"
KEY = "tls.key"
SERVER_CERT = "server.crt"
"""The agent's serving certificate (server authentication only) next to its client ``tls.crt``."""
SERVER_KEY = "server.key"
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
    """Write a private key atomically with mode 0600 from its creation: a temporary file created 0600
    (``O_EXCL``) in the same directory, fsynced, then renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    """A certificate for ``principal`` signed by the CA: ``(cert_pem, key_pem)``. Services get server and
    client authentication and their host names; every other role client authentication only, no host."""
    service = principal.role is Role.SERVICE
    return _issue(ca_key, ca_cert, ou=str(principal.role), cn=principal.name,
                  dns=["localhost", principal.name, *hosts] if service else [],
                  uri=f"spiderflow:{principal.role}:{principal.name}", server=service, client=True)


def issue_agent_server(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, cluster: str, *,
                       hosts: Sequence[str] = ()) -> tuple[bytes, bytes]:
    """The serving certificate of ``cluster``'s agent (server authentication only)."""
    principal = Principal(role=Role.AGENT, name=cluster)
    return _issue(ca_key, ca_cert, ou=str(Role.AGENT), cn=cluster,
                  dns=["localhost", bundle_name(principal), *hosts],
                  uri=f"spiderflow:{principal.role}:{principal.name}", server=True, client=False)


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, *, ou: str, cn: str,
           dns: Sequence[str], uri: str | None, server: bool, client: bool = True) -> tuple[bytes, bytes]:
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
    if server:
        sans += [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
    if uri:
        sans.append(x509.UniformResourceIdentifier(uri))
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + \
        ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
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
        if p.role is Role.AGENT:
            server_pem, server_key = issue_agent_server(ca_key, ca_cert, p.name, hosts=hosts)
            (bdir / SERVER_CERT).write_bytes(server_pem)
            _write_private(bdir / SERVER_KEY, server_key)
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
    """The principal a (verified) certificate names: subject OU = role, CN = name, confirmed by its
    ``spiderflow:<role>:<name>`` URI SAN; ``None`` when the certificate carries no SpiderFlow role or the
    two disagree."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
        ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not ous or not cns:
            return None
        principal = Principal(role=Role(str(ous[0].value)), name=str(cns[0].value))
        try:
            uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
                .get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            return None
        if f"spiderflow:{principal.role}:{principal.name}" not in uris:
            return None
        return principal
    except (ValueError, ValidationError):
        return None
