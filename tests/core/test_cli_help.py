"""Every command documents itself: an example that parses, a help text for every option (with its default
where it has one), and help output that fits 80 columns."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator

import pytest

from spiderflow.cli.main import build_parser


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
