"""How an option is declared once: its name, default, allowed range and help, in a table that the command
line, the checks, the server and docs/reference.md all read (generation.controls.CONTROLS, serve.options.SERVE_OPTIONS).

This module sits at the bottom of the package: it imports nothing of aftgen's but its errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from aftgen.errors import AftgenError

# AFTConfig fields whose options are named for users rather than after the field.
RENAMED = {"n_layer": "--layers", "n_embd": "--width", "n_head": "--heads"}


def flag(name: str) -> str:
    """The command-line spelling of an option: `max_new_tokens` -> `--max-new-tokens`."""
    return RENAMED.get(name, "--" + name.replace("_", "-"))


@dataclass(frozen=True)
class Range:
    """The values an option allows: between `low` and `high` (None: unbounded), each end open or closed."""

    low: float
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        below = self.high is None or (value < self.high if self.open_high else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {_number(self.low)}"
        low, high = _number(self.low), _number(self.high)
        return f"in {'(' if self.open_low else '['}{low}, {high}{')' if self.open_high else ']'}"


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


POSITIVE = Range(0, open_low=True)
HARDWARE_PANEL = "Hardware"  # where every command that runs a model lists --device, --dtype and --threads
# Where `aftgen train` lists its options (aftgen.training.options declares them; `prepare` shares the data ones).
MODEL_PANEL, TRAIN_PANEL, DATA_PANEL = "Model size", "Training", "Data"


@dataclass(frozen=True)
class Option:
    """What a dataclass field declared with `option()` says beside its type and default: its help, the range
    its values must lie in (None: any), the panel `--help` lists it under, and how the command line spells it
    where `flag(name)` does not (`--compile/--no-compile`, `-m`) or reads it from the environment."""

    help: str
    range: Range | None = None
    panel: str | None = None
    flags: tuple[str, ...] = ()
    envvar: str | None = None


def option(default: Any, help: str, range: Range | None = None, panel: str | None = None, **spelling: Any) -> Any:
    """A dataclass field that is a command's option: its default here, the rest in the field's metadata."""
    return field(default=default, metadata={"option": Option(help, range, panel, **spelling)})


def declared(options: type) -> dict[str, tuple[object, object, Option]]:
    """{name: (type, default, Option)} of every field of the dataclass `options` declared with option()."""
    types = get_type_hints(options)
    return {f.name: (types[f.name], f.default, f.metadata["option"]) for f in fields(options) if "option" in f.metadata}


def check_ranges(options: object) -> None:
    """Refuse the first value outside its option's range (None, where an option takes it, means "not set")."""
    for name, (_, _, declaration) in declared(type(options)).items():
        value = getattr(options, name)
        if declaration.range is not None and value is not None and value not in declaration.range:
            raise AftgenError(f"{flag(name)} must be {declaration.range}, got {value}")


def reference_table(options: type) -> str:
    """The options of the dataclass `options` as a Markdown table, as docs/reference.md shows them."""
    rows = ["| option | default | allowed | meaning |", "|---|---|---|---|"]
    for name, (_, default, declaration) in declared(options).items():
        spelled = ", ".join(declaration.flags) if declaration.flags else flag(name)
        allowed = str(declaration.range) if declaration.range else ""
        shown = "" if default is None else str(default).lower() if isinstance(default, bool) else _number(default)
        cell = declaration.help.replace("|", "\\|")  # a table's cell holds no bare |
        rows.append(f"| `{spelled}` | {shown} | {allowed} | {cell} |")
    return "\n".join(rows) + "\n"
