"""gRPC credentials from a certificate bundle, and the security flags every service takes.

A bundle directory holds ``ca.crt``, ``tls.crt`` and ``tls.key`` (see :mod:`spiderflow.security.certs`).

Servers (``spiderflow serve scheduler|planner ...``):

* ``--tls-dir DIR``: mTLS. The server presents DIR's certificate and *requires* a client certificate
  signed by DIR's CA; the caller's identity is that certificate's subject (OU = role, CN = name).
* ``--insecure``: plaintext, explicitly. With ``--tokens`` callers still authenticate with bearer tokens;
  without it nobody is authenticated (development only).
* neither: plaintext is allowed **only when listening on loopback** (``127.0.0.0/8``, ``::1``,
  ``localhost``), which is how tests and ``spiderflow up`` run on one machine; any other address is refused
  at start with a one-line error naming both flags.
* ``--tokens FILE``: bearer tokens (:class:`~spiderflow.security.auth.TokenTable`), with TLS or without.

etcd (services that use etcd; :func:`etcd_options` gives the :class:`~spiderflow.store.etcd.EtcdStore`
keyword arguments):

* ``--etcd-user NAME`` (or ``$SPIDERFLOW_ETCD_USER``) with the password in ``$SPIDERFLOW_ETCD_PASSWORD``
  (never on the command line, where ``ps`` shows it); :func:`etcd_auth`.
* ``--etcd-tls-dir DIR`` (or ``$SPIDERFLOW_ETCD_TLS_DIR``): connect to etcd with TLS, verifying it against
  DIR's ``ca.crt`` and presenting DIR's ``tls.crt``/``tls.key`` when present (``spiderflow certs init``
  writes ``etcd-client/``); :func:`etcd_tls`. Both combine (etcd checks the certificate, then the user).

Clients (SDK, CLI): ``tls_dir`` argument, else ``$SPIDERFLOW_TLS_DIR``, else plaintext; a bearer token
from the ``token`` argument, else ``$SPIDERFLOW_TOKEN``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from spiderflow.core.errors import ValidationError
from spiderflow.security.auth import Authenticator, AuthInterceptor, TokenTable
from spiderflow.security.certs import CA_CERT, CERT, KEY, SERVER_CERT, SERVER_KEY
from spiderflow.store.tls import EtcdTLS

__all__ = [
    "ENV_ETCD_PASSWORD",
    "ENV_ETCD_TLS_DIR",
    "ENV_ETCD_USER",
    "ENV_TLS_DIR",
    "ENV_TOKEN",
    "ServerSecurity",
    "add_etcd_arguments",
    "add_server_arguments",
    "channel_credentials",
    "client_tls_dir",
    "client_token",
    "etcd_auth",
    "etcd_options",
    "etcd_tls",
    "is_loopback",
    "server_credentials",
    "server_security",
]

ENV_ETCD_PASSWORD = "SPIDERFLOW_ETCD_PASSWORD"
ENV_ETCD_TLS_DIR = "SPIDERFLOW_ETCD_TLS_DIR"
ENV_ETCD_USER = "SPIDERFLOW_ETCD_USER"
ENV_TLS_DIR = "SPIDERFLOW_TLS_DIR"
ENV_TOKEN = "SPIDERFLOW_TOKEN"


def _read(directory: Path, name: str) -> bytes:
    path = directory / name
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValidationError("--tls-dir", f"cannot read {path}: {e.strerror or e}", str(directory)) from None


def server_credentials(tls_dir: Path) -> grpc.ServerCredentials:
    """mTLS server credentials: DIR's serving certificate (``server.crt``/``server.key`` when the bundle
    has them, as an agent's does; else ``tls.crt``), client certificates required and verified against
    DIR's CA."""
    cert, key = (SERVER_CERT, SERVER_KEY) if (tls_dir / SERVER_CERT).exists() else (CERT, KEY)
    return grpc.ssl_server_credentials([(_read(tls_dir, key), _read(tls_dir, cert))],
                                       root_certificates=_read(tls_dir, CA_CERT), require_client_auth=True)


def channel_credentials(tls_dir: Path) -> grpc.ChannelCredentials:
    """Client credentials: verify the server against DIR's CA and present DIR's certificate."""
    return grpc.ssl_channel_credentials(root_certificates=_read(tls_dir, CA_CERT),
                                        private_key=_read(tls_dir, KEY), certificate_chain=_read(tls_dir, CERT))


def client_tls_dir(explicit: str | Path | None = None) -> Path | None:
    """The client's bundle: ``explicit``, else ``$SPIDERFLOW_TLS_DIR``, else None (plaintext)."""
    value = explicit or os.environ.get(ENV_TLS_DIR) or None
    return Path(value) if value else None


def client_token(explicit: str | None = None) -> str | None:
    """The client's bearer token: ``explicit``, else ``$SPIDERFLOW_TOKEN``, else None."""
    return explicit or os.environ.get(ENV_TOKEN) or None


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """``--tls-dir`` / ``--insecure`` (exclusive) and ``--tokens`` (see the module docstring)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tls-dir", help="certificate bundle (ca.crt, tls.crt, tls.key): serve mTLS")
    g.add_argument("--insecure", action="store_true",
                   help="serve plaintext (development; implied when listening on loopback)")
    p.add_argument("--tokens", help="bearer tokens file (token -> role:name); callers must authenticate")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSecurity:
    """What a service passes to :func:`spiderflow.rpc.server.serve` and uses for its own outgoing calls."""

    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    client_credentials: grpc.ChannelCredentials | None = None
    authenticating: bool = False
    mode: str = "insecure"


def server_security(args: argparse.Namespace, *, host: str) -> ServerSecurity:
    """The security of a service from its flags; raises ``ValidationError`` (one line naming both flags)
    when neither ``--tls-dir`` nor ``--insecure`` is given and ``host`` is not loopback."""
    tls_dir = getattr(args, "tls_dir", None)
    insecure = bool(getattr(args, "insecure", False))
    tokens_path = getattr(args, "tokens", None)
    if not tls_dir and not insecure and not is_loopback(host):
        raise ValidationError("--listen", f"{host} is not loopback: pass --tls-dir DIR (mTLS) or --insecure "
                                          "(plaintext) explicitly", host)
    tokens = TokenTable.load(Path(tokens_path)) if tokens_path else None
    if tls_dir:
        d = Path(tls_dir)
        auth = Authenticator(tokens=tokens, certificates=True)
        return ServerSecurity(credentials=server_credentials(d), interceptors=(AuthInterceptor(auth),),
                              client_credentials=channel_credentials(d), authenticating=True, mode="mtls")
    if tokens is not None:
        return ServerSecurity(interceptors=(AuthInterceptor(Authenticator(tokens=tokens)),), authenticating=True,
                              mode="tokens")
    return ServerSecurity(mode="insecure")


def add_etcd_arguments(p: argparse.ArgumentParser) -> None:
    """``--etcd-user`` (the password comes from ``$SPIDERFLOW_ETCD_PASSWORD``) and ``--etcd-tls-dir``."""
    p.add_argument("--etcd-user", default=os.environ.get(ENV_ETCD_USER) or None,
                   help=f"etcd user (default ${ENV_ETCD_USER}; password from ${ENV_ETCD_PASSWORD})")
    p.add_argument("--etcd-tls-dir", default=os.environ.get(ENV_ETCD_TLS_DIR) or None, metavar="DIR",
                   help="connect to etcd with TLS: DIR has ca.crt and the client certificate tls.crt/tls.key "
                        f"(spiderflow certs init writes etcd-client/; default ${ENV_ETCD_TLS_DIR})")


def etcd_auth(args: argparse.Namespace) -> dict[str, str]:
    """``{"username", "password"}`` for :class:`~spiderflow.store.etcd.EtcdStore` ({} without
    ``--etcd-user``); ``ValidationError`` when the user is given without a password."""
    user = getattr(args, "etcd_user", None)
    if not user:
        return {}
    password = os.environ.get(ENV_ETCD_PASSWORD)
    if not password:
        raise ValidationError("--etcd-user", f"needs the password in ${ENV_ETCD_PASSWORD}", user)
    return {"username": user, "password": password}


def etcd_tls(args: argparse.Namespace) -> EtcdTLS | None:
    """The TLS bundle of ``--etcd-tls-dir`` (None without it); ``ValidationError`` naming a missing file."""
    directory = getattr(args, "etcd_tls_dir", None)
    if not directory:
        return None
    try:
        return EtcdTLS.from_dir(directory)
    except ValidationError as e:
        raise ValidationError("--etcd-tls-dir", e.reason, directory) from None


def etcd_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments of :class:`~spiderflow.store.etcd.EtcdStore` from :func:`add_etcd_arguments`'s flags
    (user and password, TLS)."""
    options: dict[str, Any] = dict(etcd_auth(args))
    tls = etcd_tls(args)
    if tls is not None:
        options["tls"] = tls
    return options
