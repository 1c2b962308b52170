"""Entry point of the ``spiderflow`` command.

Command groups live in :mod:`spiderflow.cli.commands`; each module there exposes
``register(subparsers)`` and sets ``func`` on its parsers. Every domain error becomes a one-line message
on stderr and a documented exit code (see :mod:`spiderflow.cli.common`), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from spiderflow.cli import commands
from spiderflow.cli.common import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_PERMISSION,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
)
from spiderflow.errors import (
    NotFoundError,
    PermissionDeniedError,
    SpiderFlowError,
    UnauthenticatedError,
    UnavailableError,
    ValidationError,
)
from spiderflow.runtime import configure_logging

__all__ = ["build_parser", "main"]


def _fail(e: object) -> None:
    """One line on stderr, never wrapped or styled (scripts grep it)."""
    msg = " ".join(str(e).split())
    sys.stderr.write(f"error: {msg}\n" if msg != "interrupted" else "interrupted\n")
    sys.stderr.flush()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default when it has one and the text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings \
                or "default" in text.lower() or isinstance(action.default, list):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit code 2 (``--help`` still prints the full usage)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        msg = " ".join(message.split())
        self.exit(EXIT_USAGE, f"error: {self.prog}: {msg} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spiderflow")
    except PackageNotFoundError:
        return "0.1.0 (source tree)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the ``command`` about to run, commands it does not need may register
    lighter parsers (``serve`` skips importing the services)."""
    parser = _Parser(
        prog="spiderflow",
        description="Topology-aware scheduling of LLM training across decentralized GPU clusters.",
    )
    parser.add_argument("--version", action="version", version=f"spiderflow {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    from spiderflow.cli.commands import serve

    serve.LOAD_SERVICES = command is None or command in ("serve", "completion")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command parser records itself as ``args._parser``: the deepest one parsed wins, so an
    unrecognized argument is reported by the command it was given to."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                _name_commands(child)


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0].startswith("-") and words[0].split("=")[0] not in parser._option_string_actions:
        parser.error(f"unrecognized arguments: {words[0]} (options go after the command)")
    args, extra = parser.parse_known_args(argv)
    if extra:
        owner: argparse.ArgumentParser = getattr(args, "_parser", parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _unreachable(args: argparse.Namespace, e: UnavailableError) -> str:
    """An unreachable service, said with its address, where the address came from and what to do."""
    text = str(e)
    address = getattr(args, "_endpoint", None)
    if not address or not any(k in text.lower() for k in ("connect", "refused", "unavailable", "dns",
                                                            "deadline")):
        return text
    from spiderflow.contexts import current_context, resolve_endpoint

    source = resolve_endpoint("scheduler", getattr(args, "address", None)).source
    ctx = current_context() if source.startswith("context") else None
    hint = (f"the context {ctx!r} may be stale: spiderflow context list / use" if ctx
            else "start one with `spiderflow up --keep`, or pass --address HOST:PORT")
    return f"no SpiderFlow scheduler answers at {address} ({source}): {hint}"


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    command = words[0] if words and not words[0].startswith("-") else ""
    if command == "completion" and "--job-ids" in words:  # asked at every <TAB>: no service imports
        command = "completion-job-ids"
    parser = build_parser(command)
    args = _parse(parser, argv)
    # Quiet by default: library events at warning and above go to stderr; services and agents reconfigure.
    configure_logging(level="warning")
    try:
        code = args.func(args)
        return int(code or 0)
    except CliError as e:
        _fail(e)
        return e.code
    except ValidationError as e:
        _fail(e)
        return EXIT_USAGE
    except NotFoundError as e:
        _fail(e)
        return EXIT_NOT_FOUND
    except (PermissionDeniedError, UnauthenticatedError) as e:
        _fail(e)
        return EXIT_PERMISSION
    except UnavailableError as e:
        _fail(_unreachable(args, e))
        return EXIT_UNAVAILABLE
    except SpiderFlowError as e:
        _fail(e)
        return EXIT_FAILED
    except OSError as e:  # a file the command reads or writes: one line, not a traceback
        _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else e)
        return EXIT_FAILED
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
