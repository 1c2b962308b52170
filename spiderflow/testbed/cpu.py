"""CPU limits of the testbed's clusters: one cgroup per cluster namespace with a CFS bandwidth quota.

On one host the emulated clusters share its cores, so without limits a cluster's compute rate is whatever the
other clusters leave it: an agent calibrating while three others calibrate gets half a core of a 2-core host,
and a job's worker on the same cluster, later, gets most of a core when the other clusters are idle. A real
cluster's devices are its own. With ``cpus_per_gpu`` the testbed gives each cluster a quota of
``cpus_per_gpu × total_gpus`` cores (its "GPUs" are CPU workers): every process started in the cluster (its
agent, the agent's workers) runs in the cluster's cgroup and gets at most that share, whatever the other
clusters do. The quota is enforced per period (:data:`DEFAULT_PERIOD_US`: short, so a throttled worker waits
a few milliseconds, not a tenth of a second, before it may send its next message).

Contract
--------
* :func:`cpu_hierarchy` finds the cgroup file system with the ``cpu`` controller: cgroup v2 (``cpu.max``) or
  v1 (``cpu.cfs_quota_us``/``cpu.cfs_period_us``); ``None`` when neither is writable here.
* :func:`quota_lines` is the pure part: the files and values that encode a quota.
* :func:`create_group` makes ``<root>/spiderflow-testbed/<prefix>/<name>`` with the quota;
  :func:`remove_groups` removes a prefix's groups (their processes must have exited; it waits briefly for
  exiting ones). :func:`join_prefix` is the argv prefix that moves a command into a group before it runs.

Idle cores of a virtual machine
-------------------------------
A throttled or waiting worker leaves its core idle. In a KVM guest an idle vCPU halts, the hypervisor
deschedules it, and the worker resumes on cold caches: measured on the 2-vCPU development VM, one transformer
block (h=128, 256 tokens, forward + backward) took 6.3 ms of CPU alone, 6.7-8.2 ms under a 0.4-core quota
(10 ms or 5 ms period), and 21.8 vs 27.3 ms at 1,024 tokens. A pipeline stage waits for messages all the
time, so it ran 1.2-1.5× slower per CPU second than the agent's calibration loop. With the guest's
halt-polling (the ``haltpoll`` cpuidle governor) allowed to poll for up to a quota period before halting,
the same block took 6.4 and 21.9 ms under the quota. :func:`hold_halt_polling` raises
``guest_halt_poll_ns`` for the lifetime of the testbeds that ask for it (shared by all of them through
:data:`HALT_POLL_STATE`; the first one remembers the value it found, the last one restores it). On a host
without guest halt-polling (bare metal, other hypervisors) it does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from spiderflow.core.errors import PreconditionError, ValidationError

__all__ = [
    "DEFAULT_PERIOD_US",
    "HALT_POLL_FILE",
    "HALT_POLL_STATE",
    "CpuGroup",
    "CpuHierarchy",
    "cpu_hierarchy",
    "create_group",
    "hold_halt_polling",
    "join_prefix",
    "quota_lines",
    "release_halt_polling",
    "remove_groups",
]

DEFAULT_PERIOD_US = 10_000
"""CFS period of a cluster's quota (10 ms; the kernel's default is 100 ms). A pipeline stage whose quota runs
out waits for the next period, so the period bounds how long a message can sit behind a throttled worker."""

_BASE = "spiderflow-testbed"
_V2_CANDIDATES = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
_V1_CANDIDATES = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"))


@dataclass(frozen=True, slots=True)
class CpuHierarchy:
    """A mounted cgroup file system whose ``cpu`` controller this process may use (``version`` 1 or 2)."""

    root: Path
    version: int

    def base(self, prefix: str) -> Path:
        return self.root / _BASE / prefix


@dataclass(frozen=True, slots=True)
class CpuGroup:
    """One cluster's cgroup: ``path``, its quota in ``cores`` per ``period_us``."""

    path: Path
    cores: float
    period_us: int

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"


def quota_lines(cores: float, *, version: int, period_us: int = DEFAULT_PERIOD_US) -> dict[str, str]:
    """The cgroup files and values that limit a group to ``cores`` cores (CFS bandwidth, per ``period_us``)."""
    if not (cores > 0):
        raise ValidationError("cpus_per_gpu", f"must be positive cores, got {cores!r}")
    if not 1_000 <= period_us <= 1_000_000:
        raise ValidationError("period_us", f"must be 1,000..1,000,000 µs, got {period_us}")
    quota = max(1_000, round(cores * period_us))  # the kernel's smallest quota is 1 ms
    if version == 2:
        return {"cpu.max": f"{quota} {period_us}"}
    if version == 1:
        return {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota)}
    raise ValueError(f"cgroup version {version}")


def _writable(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def cpu_hierarchy() -> CpuHierarchy | None:
    """The cgroup hierarchy with a usable ``cpu`` controller, or ``None`` (the reason is then that no
    hierarchy lists it writable: an unprivileged container, or cgroup v2 without ``cpu`` delegated)."""
    for root in _V2_CANDIDATES:
        controllers = root / "cgroup.controllers"
        with contextlib.suppress(OSError):
            if "cpu" in controllers.read_text().split() and _writable(root):
                return CpuHierarchy(root, 2)
    for root in _V1_CANDIDATES:
        if (root / "cpu.cfs_quota_us").exists() and _writable(root):
            return CpuHierarchy(root, 1)
    return None


def _enable_v2(path: Path, stop: Path) -> None:
    """Delegate the cpu controller down to ``path``'s children (cgroup v2: every ancestor's subtree_control)."""
    chain = [p for p in (path, *path.parents) if p == stop or stop in p.parents]
    for p in reversed(chain):
        with contextlib.suppress(OSError):
            if "cpu" not in (p / "cgroup.subtree_control").read_text().split():
                (p / "cgroup.subtree_control").write_text("+cpu")


def create_group(hierarchy: CpuHierarchy, prefix: str, name: str, cores: float, *,
                 period_us: int = DEFAULT_PERIOD_US) -> CpuGroup:
    """Create (or reset) ``name``'s group under testbed ``prefix`` limited to ``cores`` cores."""
    lines = quota_lines(cores, version=hierarchy.version, period_us=period_us)
    path = hierarchy.base(prefix) / name
    try:
        path.mkdir(parents=True, exist_ok=True)
        if hierarchy.version == 2:
            _enable_v2(path.parent, hierarchy.root)
        for fname, value in lines.items():
            (path / fname).write_text(value)
    except OSError as e:
        raise PreconditionError(f"cannot limit CPU with cgroup {path}: {e.strerror or e}") from e
    return CpuGroup(path, cores, period_us)


def remove_groups(hierarchy: CpuHierarchy, prefix: str, *, wait_s: float = 3.0) -> list[str]:
    """Remove testbed ``prefix``'s groups (children first). A group whose processes are still exiting is
    retried for up to ``wait_s``; one still busy after that is left and not reported."""
    base = hierarchy.base(prefix)
    if not base.is_dir():
        return []
    removed: list[str] = []
    deadline = time.monotonic() + wait_s
    for path in [*sorted(p for p in base.iterdir() if p.is_dir()), base]:
        while True:
            try:
                path.rmdir()
                removed.append(f"cgroup {path}")
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
    with contextlib.suppress(OSError):
        base.parent.rmdir()  # the shared parent, once no testbed uses it
    return removed


def join_prefix(group: CpuGroup) -> list[str]:
    """argv prefix that moves the command into ``group`` before it starts (its children inherit the group)."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs_file)]


HALT_POLL_FILE = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
"""The KVM guest's longest halt-poll, ns (the ``haltpoll`` cpuidle governor; absent elsewhere)."""

HALT_POLL_STATE = Path("/run/spiderflow-testbed/halt-poll.json")
"""Which testbeds hold halt-polling raised, and the value to restore when the last one lets go."""


@contextlib.contextmanager
def _locked_state(state: Path) -> Iterator[dict[str, object]]:
    state.parent.mkdir(parents=True, exist_ok=True)
    with open(state.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data: dict[str, object] = json.loads(state.read_text()) if state.exists() else {}
        except (OSError, ValueError):
            data = {}
        yield data
        if data.get("holders"):
            state.write_text(json.dumps(data))
        else:
            with contextlib.suppress(FileNotFoundError):
                state.unlink()


def _holders(data: dict[str, object]) -> list[str]:
    raw = data.get("holders")
    return [h for h in raw if isinstance(h, str)] if isinstance(raw, list) else []


def hold_halt_polling(holder: str, poll_ns: int, *, knob: Path = HALT_POLL_FILE,
                      state: Path = HALT_POLL_STATE) -> int | None:
    """Let idle vCPUs poll for up to ``poll_ns`` before halting while ``holder`` (a testbed prefix) runs:
    raises the guest's ``guest_halt_poll_ns`` to at least ``poll_ns`` and records the holder. Returns the
    value now in force, or ``None`` when this host has no guest halt-polling (nothing is changed)."""
    if not knob.exists():
        return None
    with _locked_state(state) as data:
        current = int(knob.read_text().strip())
        holders = _holders(data)
        if not holders:
            data["original"] = current
        if holder not in holders:
            holders.append(holder)
        data["holders"] = holders
        if current < poll_ns:
            try:
                knob.write_text(str(int(poll_ns)))
            except OSError as e:
                data["holders"] = [h for h in holders if h != holder]
                raise PreconditionError(f"cannot raise {knob}: {e.strerror or e}") from e
            current = int(poll_ns)
        return current


def release_halt_polling(holder: str, *, knob: Path = HALT_POLL_FILE, state: Path = HALT_POLL_STATE) -> bool:
    """``holder`` no longer needs halt-polling; the last holder restores the value the first one found.
    Returns True when it restored it."""
    if not state.exists():
        return False
    with _locked_state(state) as data:
        holders = [h for h in _holders(data) if h != holder]
        data["holders"] = holders
        original = data.get("original")
        if holders or not isinstance(original, int) or not knob.exists():
            return False
        with contextlib.suppress(OSError):
            knob.write_text(str(original))
            return True
        return False
