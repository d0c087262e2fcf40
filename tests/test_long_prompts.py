"""An output path that cannot be written is refused before any work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aftgen.cli import app

runner = CliRunner()


def _folder(path: Path) -> str:
    path.mkdir()
    return "a folder"


def _fifo(path: Path) -> str:
    os.mkfifo(path)
    return "a FIFO"


@pytest.mark.parametrize("make", [_folder, _fifo], ids=["folder", "fifo"])
@pytest.mark.parametrize(
    "command",
    [["sample", "-p", "KING:", "--save-state"], ["chat", "--save-state"], ["prime", "{text}", "--out"]],
    ids=["sample", "chat", "prime"],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, make, command):
    (tmp_path / "text.txt").write_text("KING: fair")
    target = tmp_path / "target"
    kind = make(target)
    args = [part.format(text=tmp_path / "text.txt") for part in command]
    # The model does not exist: the destination's error coming first shows that nothing was loaded or read.
    result = runner.invoke(app, [*args, str(target), "--model", str(tmp_path / "no-model")], input="KING: hail\n")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: {target} is {kind}, not a file: give the path of a file to write"
    ]
    assert result.stdout == ""
