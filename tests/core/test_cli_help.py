"""Every command documents itself: an example that parses, a help text for every option (with its default
where it has one), and help output that fits 80 columns."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import shlex
from collections.abc import Iterator

import pytest

from spiderflow.cli import commands
from spiderflow.cli.main import COMMAND_MODULES, build_parser


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                                        argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in dict(action.choices).items():
                yield from _walk(child, (*path, name))


def test_every_command_has_an_example_that_parses_and_help_for_every_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    root = build_parser()
    seen = 0
    for path, parser in _walk(root):
        seen += 1
        name = " ".join(path) or "spiderflow"
        assert parser.epilog and parser.epilog.startswith(("example", "examples:")), name
        for line in parser.epilog.splitlines():
            example = line.removeprefix("example:").strip()
            if not example.startswith(("spiderflow", "sudo spiderflow")):
                continue
            words = shlex.split(example.split(" > ")[0].split(" | ")[0])
            words = words[words.index("spiderflow") + 1:]
            try:
                root.parse_args(words)
            except SystemExit as e:  # argparse exits on a bad example
                raise AssertionError(f"{name}: the example does not parse: {example}") from e
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        text = parser.format_help()
        long = [line for line in text.splitlines() if len(line) > 80]
        assert not long, f"{name}: help lines over 80 columns: {long}"
    assert seen > 30


def test_help_shows_defaults_and_version(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    root = build_parser()
    plan = next(p for path, p in _walk(root) if path == ("plan",))
    assert "(default 256)" in plan.format_help()
    up = next(p for path, p in _walk(root) if path == ("up",))
    assert "(default: 8265)" in " ".join(up.format_help().split())
    with pytest.raises(SystemExit) as e:
        root.parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("spiderflow ")



def test_each_command_builds_the_parser_of_its_own_module_only() -> None:
    """``spiderflow COMMAND`` imports only the module :data:`COMMAND_MODULES` names for it: the table names every
    command the modules register, and the parser built for one command holds that module's commands, each
    with the same help as in the whole parser; ``serve SERVICE`` keeps the chosen service's options."""
    registered: dict[str, str] = {}
    for info in pkgutil.iter_modules(commands.__path__):
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
        registered.update(dict.fromkeys(sub.choices, info.name))
    assert registered == COMMAND_MODULES
    full = {path: p.format_help() for path, p in _walk(build_parser()) if path}
    for command, module in COMMAND_MODULES.items():
        only = {path: p.format_help() for path, p in _walk(build_parser(command)) if path}
        assert {path[0] for path in only} == {c for c, m in COMMAND_MODULES.items() if m == module}, command
        if command != "serve":
            assert only == {path: text for path, text in full.items() if path[0] in {p[0] for p in only}}, command
    served = {path: p.format_help() for path, p in _walk(build_parser("serve", "topology")) if path}
    assert served[("serve", "topology")] == full[("serve", "topology")]
