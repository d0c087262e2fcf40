"""What every command shares (aftgen/cli/common.py): errors as one line and an exit code, option groups added
to a command's own parameters, and the checks of its inputs before any work."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from aftgen.cli.common import DEBUG_VARIABLE, command, require_file, whole_numbers, with_options
from aftgen.errors import AftgenError

runner = CliRunner()


def one_command(func) -> typer.Typer:
    app = typer.Typer()
    app.command()(func)
    return app


@pytest.mark.parametrize(
    "raised, code, line",
    [
        (AftgenError("no such corpus"), 2, "error: no such corpus"),
        (KeyboardInterrupt(), 130, "interrupted"),
        (BrokenPipeError(), 0, None),
    ],
    ids=["aftgen error", "ctrl-c", "reader gone"],
)
def test_a_commands_own_errors_are_one_line_and_an_exit_code(raised, code, line, monkeypatch):
    import aftgen.cli.common as common

    monkeypatch.setattr(common, "quiet_stdout", lambda: None)  # the runner's stdout is no real descriptor

    @command
    def run() -> None:
        raise raised

    result = runner.invoke(one_command(run), [])
    assert result.exit_code == code and not isinstance(result.exception, type(raised)), result.exception
    assert result.stderr.strip().splitlines() == ([line] if line else [])


def test_anything_unexpected_is_one_line_with_a_log_and_debug_shows_the_traceback(monkeypatch):
    @command
    def run() -> None:
        raise RuntimeError("boom")

    monkeypatch.delenv(DEBUG_VARIABLE, raising=False)
    result = runner.invoke(one_command(run), [])
    (line,) = result.stderr.strip().splitlines()
    logged = re.fullmatch(r"error: internal error: RuntimeError: boom \(traceback in (\S+); --debug shows it\)", line)
    assert result.exit_code == 1 and logged, line
    assert "RuntimeError: boom" in Path(logged.group(1)).read_text()
    Path(logged.group(1)).unlink()
    monkeypatch.setenv(DEBUG_VARIABLE, "1")
    assert isinstance(runner.invoke(one_command(run), []).exception, RuntimeError)


def test_an_option_group_joins_the_commands_own_options_and_is_made_afresh_for_each_build():
    group = {"width": (Annotated[int, typer.Option("--width")], 8)}
    got = []

    @with_options(lambda: dict(group))
    @command
    def run(name: str, **shared) -> None:
        got.append((name, shared))

    assert runner.invoke(one_command(run), ["king", "--width", "3"]).exit_code == 0
    group["depth"] = (Annotated[int, typer.Option("--depth")], 2)  # a later build of the command sees it
    assert runner.invoke(one_command(run), ["queen"]).exit_code == 0
    assert got == [("king", {"width": 3}), ("queen", {"width": 8, "depth": 2})]


def test_whole_numbers_are_positive_and_comma_separated():
    assert whole_numbers("1024,4096", "--lengths") == (1024, 4096)
    with pytest.raises(AftgenError, match="--lengths takes whole numbers, comma-separated, got '1k'"):
        whole_numbers("1k", "--lengths")
    with pytest.raises(AftgenError, match="--lengths takes numbers >= 1, got '8,0'"):
        whole_numbers("8,0", "--lengths")


def test_an_input_that_is_missing_or_not_a_file_is_refused_naming_what_was_wanted(tmp_path):
    (tmp_path / "text.txt").write_text("KING: hail")
    require_file(tmp_path / "text.txt", "corpus")
    require_file(None, "corpus")  # an input not given is the command's to handle
    with pytest.raises(AftgenError, match=r"nope\.txt: no such corpus$"):
        require_file(tmp_path / "nope.txt", "corpus")
    with pytest.raises(AftgenError, match="is a folder, not a file: give the path of a corpus$"):
        require_file(tmp_path, "corpus")
