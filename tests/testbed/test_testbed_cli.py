"""``spiderflow testbed`` refuses to run without root or tools: one line, exit code 2 (no root needed)."""

from __future__ import annotations

import os
import shutil

import pytest

from spiderflow.cli.main import main


@pytest.mark.parametrize(
    "argv",
    [
        ["testbed", "up", "--topology", "nonexistent.yaml"],
        ["testbed", "down"],
        ["testbed", "status", "--json"],
        ["testbed", "exec", "x", "--", "true"],
        ["testbed", "set-link", "a", "b", "--latency-ms", "3"],
    ],
)
def test_without_root_every_subcommand_says_so_in_one_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs root" in err


def test_missing_tool_is_reported_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else real(name))
    assert main(["testbed", "status"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'tc' is not installed" in err


def test_exec_needs_a_command(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("spiderflow.cli.commands.testbed._require_environment", lambda: None)
    assert main(["testbed", "exec", "x", "--"]) == 2
    assert "give a command" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "lots", "nan"])
@pytest.mark.parametrize("command", [["testbed", "up", "--topology", "t.yaml"], ["up", "--testbed"]])
def test_a_bad_cpu_share_is_a_one_line_usage_error(
    command: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*command, "--cpus-per-gpu", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cpus-per-gpu" in err and ("positive number" in err or "not a number" in err)


def test_a_cpu_share_without_the_testbed_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--cpus-per-gpu", "0.5", "--no-job"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--cpus-per-gpu needs --testbed" in err
