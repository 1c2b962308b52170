"""Shared CLI plumbing: exit codes, one-line errors, JSON/table output.

Exit codes: ``0`` success; ``1`` the operation ran and failed (job failed, unschedulable);
``2`` bad arguments or bad input (a file that does not validate); ``3`` a service is unavailable;
``4`` not found; ``5`` permission denied; ``130`` interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

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
    "output_dir",
    "output_file",
    "print_json",
]

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
