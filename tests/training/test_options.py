"""The training options (aftgen/training/options.py): declared once, read by the command line and the reference."""

from __future__ import annotations


def test_every_train_option_is_declared_once_and_read_by_the_cli_and_the_reference():
    """`train --help` lists each declared option with its declared default and help, the options whose values
    come from a table list that table, and docs/reference.md holds the table made from the same declaration."""
    from pathlib import Path

    import typer

    from aftgen.cli import app
    from aftgen.options import declared, reference_table
    from aftgen.training.options import CHOICES, TrainOptions

    options = declared(TrainOptions)
    command = typer.main.get_command(app).commands["train"]
    by_name = {parameter.name: parameter for parameter in command.params}
    for name, (_, default, declaration) in options.items():
        assert by_name[name].default == default and by_name[name].help == declaration.help, name
    for name, allowed in CHOICES.items():
        assert all(value in options[name][2].help for value in allowed), name
    reference = (Path(__file__).parents[2] / "docs" / "reference.md").read_text(encoding="utf-8")
    assert reference_table(TrainOptions) in reference, "docs/reference.md's training options are not the declaration's"
