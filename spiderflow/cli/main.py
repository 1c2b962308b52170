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
from spiderflow.core.errors import (
    NotFoundError,
    PermissionDeniedError,
    SpiderFlowError,
    UnauthenticatedError,
    UnavailableError,
    ValidationError,
)
from spiderflow.runtime import configure_logging

__all__ = ["COMMAND_MODULES", "build_parser", "main"]


def _fail(e: object) -> None:
    """One line on stderr, never wrapped or styled (scripts grep it)."""
    msg = " ".join(str(e).split())
    sys.stderr.write(f"error: {msg}\n" if msg != "interrupted" else "interrupted\n")
    sys.stderr.flush()


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default when it has one and the text does not already say it;
    descriptions and epilogs of one paragraph are wrapped to the terminal, those with line breaks (examples)
    are kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

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


COMMAND_MODULES: dict[str, str] = {
    "agent": "agent", "cancel": "jobs", "certs": "certs", "completion": "completion", "context": "context",
    "delete": "observe", "estimate": "estimate", "jobs": "jobs", "logs": "observe", "metrics": "observe",
    "model": "model", "plan": "plan", "profile": "profile", "serve": "serve", "simulate": "simulate",
    "status": "jobs", "submit": "jobs", "testbed": "testbed", "topology": "topology", "trace": "trace",
    "up": "up", "watch": "jobs",
}
"""The module of :mod:`spiderflow.cli.commands` that registers each command. ``spiderflow COMMAND ...`` imports
only that module (every command's imports would cost each CLI process about a second at start); the root
``--help`` and an unknown command build the whole parser, and so does ``completion`` when it renders a
script. A test checks the table against what the modules register."""


def build_parser(command: str | None = None, service: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, given the ``command`` about to run (and for ``serve``, the
    ``service``), one holding only what that command needs: its own module's parsers (see
    :data:`COMMAND_MODULES`); ``serve`` then imports only the chosen service."""
    parser = _Parser(
        prog="spiderflow",
        description="Topology-aware scheduling of LLM training across decentralized GPU clusters.",
    )
    parser.add_argument("--version", action="version", version=f"spiderflow {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    from spiderflow.cli.commands import serve

    serve.LOAD_SERVICES = command is None or command in ("serve", "completion")
    serve.ONLY_SERVICE = service if command == "serve" and service in serve.SERVICES else None
    names = sorted(info.name for info in pkgutil.iter_modules(commands.__path__))
    if command in COMMAND_MODULES:
        names = [COMMAND_MODULES[command]]
    elif command == "completion-job-ids":
        names = ["completion"]
    for name in names:
        module = importlib.import_module(f"{commands.__name__}.{name}")
        module.register(sub)
    _name_commands(parser)
    _document(parser)
    return parser


EXAMPLES: dict[str, str] = {
    "": "spiderflow up",
    "agent": "spiderflow agent --cluster va --scheduler :50051 --topology-service :50052",
    "certs": "spiderflow certs init --dir certs --cluster virginia --tenant alice",
    "certs init": "spiderflow certs init --dir certs --cluster virginia --tenant alice",
    "jobs": "spiderflow jobs --state RUNNING --json",
    "status": "spiderflow status sample-1a2b3c --history",
    "watch": "spiderflow watch sample-1a2b3c",
    "cancel": "spiderflow cancel sample-1a2b3c --reason 'wrong batch size'",
    "plan": "spiderflow plan --topology aws-10-dtfm --model gpt3-6.7b --gpus 32",
    "serve planner": "spiderflow serve planner --listen 127.0.0.1:50053",
    "serve scheduler": "spiderflow serve scheduler --etcd 127.0.0.1:2379 --topology-service :50052",
    "serve topology": "spiderflow serve topology --etcd 127.0.0.1:2379 --listen 127.0.0.1:50052",
    "simulate": "spiderflow simulate --topology aws-10-dtfm --trace t.json --json r.json",
    "testbed": "sudo spiderflow testbed up --topology examples/topology-3.yaml",
    "testbed up": "sudo spiderflow testbed up --topology examples/topology-3.yaml",
    "testbed down": "sudo spiderflow testbed down",
    "testbed status": "spiderflow testbed status",
    "testbed exec": "sudo spiderflow testbed exec virginia -- ip addr",
    "testbed measure": "sudo spiderflow testbed measure",
    "testbed set-link": "sudo spiderflow testbed set-link va ohio --bandwidth-gbps 1 --latency-ms 5",
    "topology": "spiderflow topology show --png map.png",
    "topology validate": "spiderflow topology validate examples/topology-3.yaml",
    "topology generate": "spiderflow topology generate --clusters 64 --seed 1 --out topo64.json",
    "topology show": "spiderflow topology show --png map.png",
    "trace": "spiderflow trace generate --jobs 200 --seed 1 --out trace.json",
    "trace generate": "spiderflow trace generate --jobs 200 --seed 1 --out trace.json",
    "trace validate": "spiderflow trace validate trace.json",
    "up": "spiderflow up --clusters 4 --steps 60 --keep",
    "estimate": "spiderflow estimate --topology aws-10-dtfm --plan p.json --model gpt3-1.3b",
    "profile": "spiderflow profile --model llama3-8b --micro-batches 1,2 --out node.json",
    "model": "spiderflow model show llama3-8b",
    "model show": "spiderflow model show llama3-8b --json",
    "model list": "spiderflow model list",
}
"""An example per command (``spiderflow COMMAND --help`` ends with it) where its module gives none."""

OPTION_HELP: dict[str, str] = {
    "job_id": "job id (spiderflow jobs lists them)",
    "--tenant": "only this tenant's jobs",
    "--reason": "why, recorded in the job's history",
    "--log-format": "log lines as JSON or for a console (auto: JSON unless a terminal)",
    "--nodes": "nodes of the declared cluster (with --gpu)",
    "--gpus-per-node": "GPUs per node of the declared cluster (with --gpu)",
    "--memory-gib": "memory per GPU, GiB (with --gpu; default: the catalog's)",
    "--electricity": "electricity price, USD per kWh",
    "--intra-node-gbps": "bandwidth between GPUs of a node, Gbit/s",
    "--inter-node-gbps": "bandwidth between nodes of the cluster, Gbit/s",
    "--executor": "who runs placed jobs: the agents, or a simulated executor (tests)",
    "--sim-min-s": "simulated executor: shortest job run, seconds",
    "--sim-max-s": "simulated executor: longest job run, seconds",
    "--max-queued": "most PENDING and RESCHEDULING jobs; more are RESOURCE_EXHAUSTED",
    "--objective": "what the policies optimise: step time, dollars, or both",
    "--state-dir": "where the testbed keeps its state",
    "cluster": "cluster name (its network namespace)",
    "a": "one end of the link (cluster name)",
    "b": "the other end of the link (cluster name)",
    "--bandwidth-gbps": "the link's bandwidth, Gbit/s",
    "--latency-ms": "the link's one-way latency, ms",
    "file": "the file to check (JSON or YAML)",
    "--seed": "seed of the generator (same seed, same output)",
    "--kind": "shape: geo (random geometric), hub (hub and spoke) or mesh",
    "--lr": "peak learning rate (default 1e-3)",
    "--warmup-steps": "linear warm-up steps (default 0)",
    "--schedule": "learning-rate decay after warm-up (default constant)",
    "--weight-decay": "decoupled (AdamW) weight decay (default 0)",
    "--betas": "Adam's beta1,beta2 (default 0.9,0.95)",
    "--eps": "Adam's epsilon (default 1e-8)",
}
"""Help text of options and arguments whose command gives none."""


def _document(parser: argparse.ArgumentParser, path: str = "") -> None:
    """Give every command an example and every option a help text (see :data:`EXAMPLES`,
    :data:`OPTION_HELP`)."""
    if not parser.epilog and path in EXAMPLES:
        parser.epilog = f"example:\n  {EXAMPLES[path]}"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in dict(action.choices).items():
                _document(child, f"{path} {name}".strip())
        elif not action.help:
            key = action.option_strings[0] if action.option_strings else action.dest
            action.help = OPTION_HELP.get(key, action.help)


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
    service = words[1] if command == "serve" and len(words) > 1 else None
    parser = build_parser(command, service)
    args = _parse(parser, argv)
    # Quiet by default: library events at warning and above go to stderr; services and agents reconfigure.
    configure_logging(level="warning")
    if command in ("up", "plan", "simulate", "estimate") or service in ("scheduler", "planner"):  # kernels run
        from spiderflow.kernel_cache import drop_stale

        drop_stale()
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
