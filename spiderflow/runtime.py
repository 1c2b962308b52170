"""Process plumbing shared by every service entry point: logging, signals, readiness files.

A service process runs until SIGINT/SIGTERM, then stops gracefully. ``--ready-file`` receives one JSON
document (``{"address": "host:port", "pid": ..., "metrics": "host:port"|null}``) once the server serves,
which is how ``spiderflow up`` and the tests learn a port chosen with ``--listen host:0``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

__all__ = ["configure_logging", "parse_hostport", "run_until_signalled", "stderr_logger_factory", "write_ready_file"]


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time of the write (not at configuration time), so a
    replaced stream (a test's capture, a redirected CLI) never leaves loggers writing to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def stderr_logger_factory() -> structlog.PrintLoggerFactory:
    """A structlog logger factory writing to the current ``sys.stderr`` at each write."""
    return structlog.PrintLoggerFactory(file=_CurrentStderr())  # type: ignore[arg-type]


def configure_logging(*, json_logs: bool | None = None, level: str = "info") -> None:
    """structlog: JSON lines in production (or when not on a TTY), readable on a TTY. Logs go to stderr."""
    if json_logs is None:
        json_logs = not sys.stderr.isatty() or os.environ.get("SPIDERFLOW_LOG_FORMAT", "") == "json"
    renderer: Any = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=stderr_logger_factory(),
        cache_logger_on_first_use=True,
    )


def parse_hostport(value: str, *, field: str = "address") -> tuple[str, int]:
    """``host:port`` → (host, port); ``ValidationError`` naming ``field`` otherwise."""
    from spiderflow.core.errors import ValidationError

    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValidationError(field, "must be host:port", value)
    return host.strip("[]"), int(port)


def write_ready_file(path: Path | None, **doc: Any) -> None:
    """Atomically write the readiness document (rename over a temp file)."""
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps({"pid": os.getpid(), **doc}))
        tmp.replace(path)
    except BaseException:  # a full disk: no partial temporary file is left
        tmp.unlink(missing_ok=True)
        raise


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``main(stop_event)`` in a fresh loop; SIGINT/SIGTERM set the event. Returns the exit code."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())
    return 0
