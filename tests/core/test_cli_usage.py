"""Usage errors of the ``spiderflow`` command: one line, exit 2, from the command that got the argument."""

from __future__ import annotations

import pytest

from spiderflow.cli.main import main


@pytest.mark.parametrize(("argv", "line"), [
    (["testbed", "set-link", "a", "b", "--bandwidth-mbit", "5"],
     "error: spiderflow testbed set-link: unrecognized arguments: --bandwidth-mbit 5 "
     "(see spiderflow testbed set-link --help)"),
    (["up", "--global-batch", "8"], "error: spiderflow up: unrecognized arguments: --global-batch 8 "
                                     "(see spiderflow up --help)"),
    (["jobs", "extra"], "error: spiderflow jobs: unrecognized arguments: extra (see spiderflow jobs --help)"),
    (["--bogus"], "error: spiderflow: unrecognized arguments: --bogus (options go after the command) "
                  "(see spiderflow --help)"),
    (["--jobs=3", "simulate"], "error: spiderflow: unrecognized arguments: --jobs=3 (options go after the command) "
                               "(see spiderflow --help)"),
    ([], "error: spiderflow: the following arguments are required: COMMAND (see spiderflow --help)"),
    (["trace", "generate", "--jobs", "x"], "error: spiderflow trace generate: argument --jobs: invalid int value: "
                                           "'x' (see spiderflow trace generate --help)"),
])
def test_usage_errors_name_the_command_that_got_the_argument(argv: list[str], line: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == line + "\n"
