"""Ctrl-C on a command that follows a server stream (``watch``, ``submit --watch``, ``logs --follow``).

The command does not wait for ``KeyboardInterrupt`` to surface from inside the blocked gRPC iterator (it can
be raised in, and lost by, gRPC's own code, and the command then never ends): while the stream is followed,
SIGINT cancels the call, the iteration stops at once, and the command reports the interruption::

    stream = sf.watch(job_id)
    with cancel_on_interrupt(stream) as interrupted:
        for event in stream:
            ...
    if interrupted():
        ...  # say so, exit 130
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Protocol

__all__ = ["Cancellable", "cancel_on_interrupt"]


class Cancellable(Protocol):
    """What :func:`cancel_on_interrupt` stops: a stream with a thread-safe ``cancel()``."""

    def cancel(self) -> None: ...


@contextlib.contextmanager
def cancel_on_interrupt(stream: Cancellable) -> Iterator[Callable[[], bool]]:
    """Within the block, SIGINT cancels ``stream`` instead of raising ``KeyboardInterrupt``; yields a function
    telling whether that happened. The previous handler is restored on the way out. The handler is installed
    even where the process started with SIGINT ignored (a background job of a non-interactive shell, a
    child of ``nohup ... &``): ``kill -INT`` must still stop the command, as it stops ``spiderflow up``.
    Outside the main thread (where Python cannot install handlers) the block runs unchanged."""
    fired = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield fired.is_set
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        fired.set()
        # from a thread: the handler runs on the main thread, possibly inside the gRPC iterator's own
        # bookkeeping, which it must not re-enter
        threading.Thread(target=stream.cancel, name="cancel-stream", daemon=True).start()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield fired.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
