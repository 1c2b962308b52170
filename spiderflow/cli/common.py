"""Shared CLI plumbing: exit codes, one-line errors, JSON/table output.

Exit codes: ``0`` success; ``1`` the operation ran and failed (job failed, unschedulable);
``2`` bad arguments or bad input (a file that does not validate); ``3`` a service is unavailable;
``4`` not found; ``5`` permission denied; ``130`` interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table

__all__ = [
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PERMISSION",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "CliError",
    "check_outputs",
    "console",
    "csv_ints",
    "err_console",
    "fit_table",
    "output_dir",
    "output_file",
    "print_json",
    "run_interruptible",
]

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_NOT_FOUND = 4
EXIT_PERMISSION = 5

console = Console()
err_console = Console(stderr=True)


class CliError(Exception):
    """Raised by a command to end with a one-line message and an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def output_file(flag: str, path: Path) -> Path:
    """Check, before any work, that ``path`` can be written as a file (its directory is created): a
    :class:`CliError` (usage) naming ``flag`` otherwise, so a long run never ends unable to save."""
    if path.is_dir():
        raise CliError(f"{flag}: {path} is a directory", EXIT_USAGE)
    _make_dir(flag, path.parent)
    if path.exists() and not os.access(path, os.W_OK):
        raise CliError(f"{flag}: {path} is not writable", EXIT_USAGE)
    return path


def output_dir(flag: str, path: Path) -> Path:
    """Create the directory ``path`` (and its parents) now, or a :class:`CliError` (usage) naming ``flag``."""
    if path.exists() and not path.is_dir():
        raise CliError(f"{flag}: {path} exists and is not a directory", EXIT_USAGE)
    _make_dir(flag, path)
    return path


def check_outputs(parser: argparse.ArgumentParser, files: dict[str, Path | None],
                  dirs: dict[str, Path | None] | None = None) -> None:
    """:func:`output_file` / :func:`output_dir` for a script's arguments (``None``: not given); a failure
    is the parser's usage error (exit 2), before the script does any work."""
    try:
        for flag, path in files.items():
            if path is not None:
                output_file(flag, path)
        for flag, path in (dirs or {}).items():
            if path is not None:
                output_dir(flag, path)
    except CliError as e:
        parser.error(str(e))


def _make_dir(flag: str, d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"{flag}: cannot create the directory {d}: {e.strerror or e}", EXIT_USAGE) from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise CliError(f"{flag}: the directory {d} is not writable", EXIT_USAGE)


def print_json(obj: Any) -> None:
    """Write ``obj`` as one JSON document on stdout (no rich markup, machine-readable)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def csv_ints(*, minimum: int) -> Callable[[str], list[int]]:
    """An argparse ``type`` for a comma-separated list of integers, each at least ``minimum`` (empty items
    are skipped; an empty list is allowed). A bad item is a usage error naming it, not a traceback."""

    def parse(text: str) -> list[int]:
        out: list[int] = []
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            try:
                value = int(item)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r} is not an integer") from None
            if value < minimum:
                raise argparse.ArgumentTypeError(f"{value} is below the minimum {minimum}")
            out.append(value)
        return out

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type`` for a finite number > 0 (a bad value is a usage error naming it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number (got {text!r})")
    return value


def fit_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], *,
              keep: Collection[str] = (), fold: Collection[str] = (), width: int | None = None,
              show_header: bool = True) -> Table:
    """A table that fits ``width`` (default: the console's; 80 when piped without ``$COLUMNS``): no cell
    of a column outside ``fold`` is ever wrapped or cut (ids, figures); ``fold`` columns wrap their text
    down to 12 characters; while that is still too wide, the rightmost columns outside ``keep`` are
    dropped (and the title says how many)."""
    width = width or console.width
    cols = list(columns)
    natural = {c: max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)}

    def need(cs: list[str]) -> int:
        return sum(min(natural[c], 12) if c in fold else natural[c] for c in cs) + 3 * len(cs) + 1

    dropped: list[str] = []
    while need(cols) > width:
        victims = [c for c in cols if c not in keep]
        if not victims:
            break
        dropped.append(victims[-1])
        cols.remove(victims[-1])
    if dropped and title:
        title = f"{title} (hidden at {width} columns: {', '.join(reversed(dropped))})"
    table = Table(title=title, show_header=show_header, title_justify="left")
    for c in cols:
        if c in fold:
            table.add_column(c, overflow="fold", min_width=min(natural[c], 12))
        else:
            table.add_column(c, no_wrap=True, min_width=natural[c], overflow="ignore")
    index = [columns.index(c) for c in cols]
    for r in rows:
        table.add_row(*(r[i] for i in index))
    return table


def run_interruptible(fn: Callable[[], T], *, what: str) -> T:
    """Run ``fn`` so that Ctrl-C (SIGINT) or SIGTERM stops the command at once, whatever ``fn`` runs.

    Solvers may take over the process's SIGINT handler while they run (CP-SAT does, and then swallows the
    signal), so the signals are not left to handlers: they are blocked, ``fn`` runs in a worker thread, and
    this thread takes them with ``sigtimedwait``. On one, ``interrupted: <what> stopped`` goes to stderr and
    the process exits with code 130 at once (``fn`` holds no resource that outlives the process)."""
    signals = {signal.SIGINT, signal.SIGTERM}
    result: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # re-raised in the calling thread
            error.append(e)

    # A shell starts background jobs with SIGINT ignored, and an ignored signal is discarded even while
    # blocked: handle both (the handlers never run while blocked; sigtimedwait takes the signal first).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        worker = threading.Thread(target=work, name="spiderflow-work", daemon=True)
        worker.start()
        while worker.is_alive():
            if signal.sigtimedwait(signals, 0.1) is not None:
                sys.stdout.flush()
                sys.stderr.write(f"\ninterrupted: {what} stopped\n")
                sys.stderr.flush()
                os._exit(130)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    if error:
        raise error[0]
    return result[0]
