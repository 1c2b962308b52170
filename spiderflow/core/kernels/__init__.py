"""Compiled kernels of the pure core: the loops a decision spends most of its time in, as numba functions.

Contract of every kernel here:

* **Same numbers.** A kernel evaluates the same floating-point expressions, on the same operands and in the
  same order, as the formulation its module documents (kept in the tests as a plain numpy / Python
  reference and compared against it, bitwise, on random and recorded inputs). numba compiles in nopython
  mode without ``fastmath``: IEEE double arithmetic, no reassociation, no contraction into FMAs.
* **Pure.** Arrays and scalars in, arrays and scalars out (outputs written into arrays the caller passes);
  no I/O, no randomness, no global state. The typed Python wrappers that the cores call live next to the
  cores; they fix every argument's dtype and layout so one compiled specialisation serves every call.

Compilation happens once per install: ``cache=True`` stores the machine code in ``__pycache__`` next to the
kernel's module (or numba's user-wide cache, or ``NUMBA_CACHE_DIR``, where the package directory is
read-only) the first time a kernel runs, which takes one to a few seconds per kernel; a later process loads
it in milliseconds. :func:`warm` loads (or compiles) every kernel on tiny inputs. Policies call it when they
are constructed, so no placement decision pays the load; a service pays it once at start-up. numba
invalidates a cached kernel only when its own module changes, not a kernel it calls from another module:
the commands that run kernels and the test session first call :func:`spiderflow.kernel_cache.drop_stale`,
which drops every cached kernel when any kernel module's source changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from numba import njit

__all__ = ["kernel", "register_warmup", "warm"]

F = TypeVar("F", bound=Callable[..., Any])

_WARMUPS: list[Callable[[], None]] = []
_WARM = False


def kernel(fn: F) -> F:
    """``fn`` compiled by numba in nopython mode, cached on disk, with IEEE semantics (no ``fastmath``)."""
    return cast(F, njit(cache=True)(fn))


def register_warmup(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` (runs the module's kernels on tiny inputs) to be called by :func:`warm`."""
    _WARMUPS.append(fn)
    return fn


def warm() -> None:
    """Load (or, the first time after an install or a change, compile) every kernel; idempotent and cheap
    after the first call in a process."""
    global _WARM
    if _WARM:
        return
    from spiderflow.core.kernels import (  # noqa: F401  (each registers its warm-up)
        fallback,
        formulas,
        level2,
        scorer,
        search,
        timeline,
    )

    for fn in _WARMUPS:
        fn()
    _WARM = True
