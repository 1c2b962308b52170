"""TLS material of an etcd connection: a CA to verify the other end and, optionally, a certificate and key
to present.

Both ends use it: :class:`~spiderflow.store.process.EtcdProcess` serves its client URL with it (``https``,
``--client-cert-auth`` when client certificates are required) and :class:`~spiderflow.store.etcd.EtcdStore`
connects with it. A bundle directory has the layout of :mod:`spiderflow.security.certs` (``ca.crt``,
``tls.crt``, ``tls.key``); ``spiderflow certs init`` writes ``etcd-server/`` and ``etcd-client/`` under
their own CA (``etcd-ca/``), so certificates of the SpiderFlow CA (tenants, agents) are no etcd clients.

Pure: paths and bytes only (no gRPC, no ssl).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spiderflow.core.errors import ValidationError

__all__ = ["CA_FILE", "CERT_FILE", "KEY_FILE", "EtcdTLS"]

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdTLS:
    """``ca`` verifies the peer; ``cert``/``key`` (both or neither) are presented to it."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValidationError("etcd tls", "needs both a certificate and its key, or neither",
                                  f"cert={self.cert} key={self.key}")

    @classmethod
    def from_dir(cls, directory: str | Path, *, require_cert: bool = False) -> EtcdTLS:
        """The bundle in ``directory``: ``ca.crt`` (required) and ``tls.crt``/``tls.key`` when both exist
        (required with ``require_cert``). ``ValidationError`` naming the missing file otherwise."""
        d = Path(directory)
        ca, cert, key = d / CA_FILE, d / CERT_FILE, d / KEY_FILE
        if not ca.is_file():
            raise ValidationError("etcd tls", f"{ca} does not exist", str(d))
        has_cert = cert.is_file() and key.is_file()
        if require_cert and not has_cert:
            raise ValidationError("etcd tls", f"{cert} and {key} must exist", str(d))
        return cls(ca=ca, cert=cert if has_cert else None, key=key if has_cert else None)

    def read(self) -> tuple[bytes, bytes | None, bytes | None]:
        """``(ca_pem, cert_pem, key_pem)``; ``ValidationError`` naming an unreadable file."""

        def load(path: Path | None) -> bytes | None:
            if path is None:
                return None
            try:
                return path.read_bytes()
            except OSError as e:
                raise ValidationError("etcd tls", f"cannot read {path}: {e.strerror or e}", str(path)) from None

        ca = load(self.ca)
        assert ca is not None
        return ca, load(self.cert), load(self.key)
