"""Named endpoints ("contexts") in the client config file, and where a client's addresses come from.

The config file (``$SPIDERFLOW_CONFIG``, else ``~/.config/spiderflow/config.yaml``)::

    current-context: local
    contexts:
      local:                            # written by `spiderflow up`, removed when that mesh stops
        scheduler: 127.0.0.1:50051
        topology: 127.0.0.1:50052
        planner: 127.0.0.1:50053
        dashboard: http://127.0.0.1:8265/
        owner_pid: 12345                # the `up` process (a context whose owner died is stale)
      prod:
        scheduler: sched.example.org:443
        topology: topo.example.org:443
        tls_dir: ~/.spiderflow/certs/tenant-alice
    scheduler: 127.0.0.1:50051          # (older files) top-level addresses still work

An address comes from, in order: the command's ``--address`` (the SDK's argument), the environment
(``SPIDERFLOW_SCHEDULER``, ``SPIDERFLOW_TOPOLOGY``, ``SPIDERFLOW_PLANNER``), the context named by
``$SPIDERFLOW_CONTEXT`` or ``current-context``, the file's top-level keys, the defaults
(``127.0.0.1:50051``/``:50052``/``:50053``). An address without a port gets the service's default port
(``localhost`` means ``localhost:50051`` for the scheduler, never port 443).

Writers take an exclusive lock (``config.yaml.lock``) and replace the file atomically, so two ``up`` runs
never lose each other's context.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from spiderflow.core.errors import NotFoundError, ValidationError

__all__ = [
    "DEFAULT_ADDRESSES",
    "Endpoint",
    "Service",
    "add_context",
    "config_path",
    "current_context",
    "load_config",
    "remove_context",
    "resolve_endpoint",
    "state_dir",
    "use_context",
]

Service = Literal["scheduler", "topology", "planner"]
DEFAULT_ADDRESSES: dict[str, str] = {
    "scheduler": "127.0.0.1:50051", "topology": "127.0.0.1:50052", "planner": "127.0.0.1:50053",
}
_ENV = {"scheduler": "SPIDERFLOW_SCHEDULER", "topology": "SPIDERFLOW_TOPOLOGY", "planner": "SPIDERFLOW_PLANNER"}
CONTEXT_KEYS = ("scheduler", "topology", "planner", "dashboard", "tls_dir", "token", "owner_pid", "data_dir")


def config_path() -> Path:
    """The client config file."""
    return Path(os.environ.get("SPIDERFLOW_CONFIG", Path.home() / ".config" / "spiderflow" / "config.yaml"))


def state_dir() -> Path:
    """Where local state that outlives a mesh lives (``$SPIDERFLOW_STATE_DIR``, else
    ``$XDG_STATE_HOME/spiderflow``, else ``~/.local/state/spiderflow``): ``spiderflow up`` keeps its agents'
    work directories (workers' logs) under ``<state_dir>/agents``."""
    explicit = os.environ.get("SPIDERFLOW_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "spiderflow"


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """A resolved address and where it came from (for error messages: "no mesh at ADDR (SOURCE)")."""

    address: str
    source: str


def load_config(path: Path | None = None) -> dict[str, Any]:
    """The config file as a mapping (``{}`` when absent); ``ValidationError`` naming the file otherwise."""
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValidationError(str(path), f"cannot read the config file: {e}") from None
    if not isinstance(doc, dict):
        raise ValidationError(str(path), "must be a mapping (current-context, contexts, ...)")
    contexts = doc.get("contexts")
    if contexts is not None and not isinstance(contexts, dict):
        raise ValidationError(f"{path}: contexts", "must be a mapping name -> endpoints")
    return doc


def _contexts(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    raw = doc.get("contexts") or {}
    return {str(k): dict(v) for k, v in raw.items() if isinstance(v, dict)}


def current_context(doc: Mapping[str, Any] | None = None) -> str | None:
    """The context in use: ``$SPIDERFLOW_CONTEXT``, else the file's ``current-context``."""
    if os.environ.get("SPIDERFLOW_CONTEXT"):
        return os.environ["SPIDERFLOW_CONTEXT"]
    doc = load_config() if doc is None else doc
    name = doc.get("current-context")
    return str(name) if name else None


def _with_port(service: str, address: str) -> str:
    address = address.strip()
    if address.startswith("["):  # [v6]:port
        return address if "]:" in address else f"{address}:{DEFAULT_ADDRESSES[service].rsplit(':', 1)[1]}"
    if ":" not in address:
        return f"{address}:{DEFAULT_ADDRESSES[service].rsplit(':', 1)[1]}"
    return address


def resolve_endpoint(service: Service, explicit: str | None = None) -> Endpoint:
    """The address of ``service`` and its source (see the module docstring for the order)."""
    if explicit:
        return Endpoint(address=_with_port(service, explicit), source="--address")
    env = os.environ.get(_ENV[service])
    if env:
        return Endpoint(address=_with_port(service, env), source=f"${_ENV[service]}")
    path = config_path()
    doc = load_config(path)
    name = current_context(doc)
    if name:
        ctx = _contexts(doc).get(name)
        if ctx is None:
            raise NotFoundError(f"context {name!r} is not in {path} (spiderflow context list shows the known ones)")
        if isinstance(ctx.get(service), str):
            return Endpoint(address=_with_port(service, ctx[service]), source=f"context {name}")
    if isinstance(doc.get(service), str):
        return Endpoint(address=_with_port(service, doc[service]), source=str(path))
    return Endpoint(address=DEFAULT_ADDRESSES[service], source="default")


def context_value(key: str) -> str | None:
    """A setting (``tls_dir``, ``token``, ``dashboard``) of the context in use, if any."""
    doc = load_config()
    name = current_context(doc)
    if not name:
        return None
    value = _contexts(doc).get(name, {}).get(key)
    return str(value) if value is not None else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict[str, Any]]:
    """Read-modify-write the config file under an exclusive lock; the yielded dict is written back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = load_config(path)
        yield doc
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        os.replace(tmp, path)


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def add_context(base: str, values: Mapping[str, Any], *, make_current: bool = True) -> str:
    """Write a context named ``base`` (or ``base-2``, ``base-3``, ... when a live owner holds it; a context
    whose ``owner_pid`` is dead is replaced) and return its name; it becomes current unless
    ``make_current`` is False. The previous current context is remembered (``previous``) and restored by
    :func:`remove_context`."""
    path = config_path()
    with _locked(path) as doc:
        contexts = _contexts(doc)
        name, n = base, 1
        while name in contexts and _alive(contexts[name].get("owner_pid")) \
                and contexts[name].get("owner_pid") != values.get("owner_pid"):
            n += 1
            name = f"{base}-{n}"
        entry = {k: v for k, v in values.items() if k in CONTEXT_KEYS and v is not None}
        if make_current:
            prev = doc.get("current-context")
            if prev and prev != name:
                entry["previous"] = prev
            doc["current-context"] = name
        contexts[name] = entry
        doc["contexts"] = contexts
    return name


def remove_context(name: str) -> None:
    """Delete context ``name``; if it was current, its ``previous`` context (when still present) becomes
    current, else none is."""
    path = config_path()
    with _locked(path) as doc:
        contexts = _contexts(doc)
        gone = contexts.pop(name, None)
        doc["contexts"] = contexts
        if doc.get("current-context") == name:
            prev = (gone or {}).get("previous")
            if prev and prev in contexts:
                doc["current-context"] = prev
            else:
                doc.pop("current-context", None)


def use_context(name: str) -> None:
    """Make ``name`` the current context; ``NotFoundError`` when it is not in the file."""
    path = config_path()
    with _locked(path) as doc:
        if name not in _contexts(doc):
            raise NotFoundError(f"context {name!r} is not in {path} (spiderflow context list shows the known ones)")
        doc["current-context"] = name


def list_contexts() -> tuple[dict[str, dict[str, Any]], str | None]:
    """Every context and the current one's name."""
    doc = load_config()
    return _contexts(doc), current_context(doc)


def is_stale(ctx: Mapping[str, Any]) -> bool:
    """Whether a context written by ``spiderflow up`` outlived its mesh (its owner process is gone)."""
    return "owner_pid" in ctx and not _alive(ctx.get("owner_pid"))
