"""aftgen.serve.options: every serve option declared once (the CLI and docs/reference.md read it) and checked
at start-up in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import aftgen.options
from aftgen.cli import app
from aftgen.serve.options import ServeOptions

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def test_every_serve_option_is_declared_once_and_read_by_the_cli_and_the_reference():
    """Each field of ServeOptions is an option with its help and panel; `serve --help` lists each with the
    declared default, and docs/reference.md holds the table made from the same declaration."""
    declared = aftgen.options.declared(ServeOptions)
    assert set(declared) == {f.name for f in dataclasses.fields(ServeOptions)}
    command = typer.main.get_command(app).commands["serve"]
    by_name = {parameter.name: parameter for parameter in command.params}
    for name, (_, default, declaration) in declared.items():
        assert by_name[name].default == default and by_name[name].help == declaration.help, name
    reference = (Path(__file__).parents[2] / "docs" / "reference.md").read_text(encoding="utf-8")
    table = aftgen.options.reference_table(ServeOptions)
    assert table in reference, "docs/reference.md's serve options table is not the declaration's:\n" + table


def test_serve_refuses_bad_options_and_a_missing_extra_in_one_line(monkeypatch):
    result = CliRunner().invoke(app, ["serve", "--parallel", "0"])
    assert result.exit_code == 2 and "error: --parallel must be in [1, 4096], got 0" in result.output
    for option in ("--parallel", "--queue", "--max-prompt-tokens", "--prompt-chunk"):
        result = CliRunner().invoke(app, ["serve", option, str(1 << 64)])
        assert result.exit_code == 2 and f"error: {option} must be in [" in result.output, option
    real = __import__("importlib").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2 and "pip install 'aftgen[serve]'" in result.output


@pytest.fixture
def never_serve(monkeypatch) -> None:
    """A start-up check that lets bad options through fails the test instead of serving forever."""

    def serve(*args) -> None:
        pytest.fail("aftgen serve started")

    monkeypatch.setattr("aftgen.serve.server.serve", serve)


@pytest.mark.parametrize("key", ["", " secret ", "two words", "clé-秘密", "line\nbreak", "bell\x07", "tab\tkey",
                                 "byte\udcff"])  # fmt: skip
def test_serve_refuses_an_api_key_no_client_can_send_at_start_up(key, never_serve):
    """Printable ASCII without spaces only ("\udcff": how Python hands over a non-UTF-8 byte of argv)."""
    result = CliRunner().invoke(app, ["serve", "--api-key", key])
    assert result.exit_code == 2 and result.output.startswith("error: --api-key")
    assert len(result.output.splitlines()) == 1 and (not key or key not in result.output)  # a secret is not echoed


def test_serve_refuses_a_sessions_dir_that_holds_a_model(tiny_run, never_serve):
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_run), "--sessions-dir", str(tiny_run)])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1
    assert result.output.startswith("error: --sessions-dir") and "holds a model" in result.output
