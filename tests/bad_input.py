"""What the bad-input tests share: the CLI run in-process, the check that it failed in one error line, weights
rewritten, and arbitrary JSON."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from aftgen.checkpoint import WEIGHTS
from aftgen.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_error(result, message: str) -> None:
    """Exit 2, no exception escaped (no traceback), exactly one `error:` line, which says `message`."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(message, lines[0]), result.stderr
    assert "Traceback" not in result.output


def retensor(change):
    def edit(folder: Path) -> None:
        save_file(change(load_file(folder / WEIGHTS)), folder / WEIGHTS)

    return edit


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
