"""What every command shares: one-line errors, the hardware options, and options built from dataclasses."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from aftgen.corpus import CorpusOptions
from aftgen.corpus.sources import DECODE_ERRORS
from aftgen.device import DEVICE_HELP, DTYPE_HELP
from aftgen.errors import AftgenError
from aftgen.files import check_output, kind_of
from aftgen.hub import MODEL_HELP
from aftgen.options import DATA_PANEL, HARDWARE_PANEL, declared

SAMPLE_PANEL, STATE_PANEL = "Sampling", "State files"
DEBUG_VARIABLE = "AFTGEN_DEBUG"

DeviceOption = Annotated[str, typer.Option(help=DEVICE_HELP, rich_help_panel=HARDWARE_PANEL)]
DtypeOption = Annotated[str, typer.Option(help=DTYPE_HELP, rich_help_panel=HARDWARE_PANEL)]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        help="CPU threads (default: the physical cores, shared among torchrun's processes).",
        rich_help_panel=HARDWARE_PANEL,
    ),
]
ModelOption = Annotated[str | None, typer.Option("--model", "-m", help=MODEL_HELP)]

Options = TypeVar("Options")
Command = TypeVar("Command", bound=Callable)
# Where the model runs: every command that runs one takes these (as **hardware) and calls placement().
HARDWARE_OPTIONS = {"device": (DeviceOption, "auto"), "dtype": (DtypeOption, "auto"), "threads": (ThreadsOption, None)}
CorpusArgument = Annotated[list[Path], typer.Argument(help="Text files, or folders of them (each file a document).")]


ENCODING_HELP = "Text encoding of the input."
ERRORS_HELP = f"{' | '.join(DECODE_ERRORS)} undecodable bytes."


def _data(help: str | None = None, **extra):
    return typer.Option(help=help, rich_help_panel=DATA_PANEL, **extra)


# How a corpus is read and split: `train` and `prepare` take these, with aftgen.corpus.CorpusOptions' defaults.
CORPUS_OPTIONS = {
    "encoding": (Annotated[str, _data(ENCODING_HELP)], CorpusOptions.encoding),
    "errors": (Annotated[str, _data(ERRORS_HELP)], CorpusOptions.errors),
    "glob": (Annotated[str, _data("Which files in folders to read.")], CorpusOptions.glob),
    "held_out": (
        Annotated[
            str,
            _data(
                "Hold out at most this many characters, e.g. 500k, 2M: one file's last 10%, or whole documents "
                "making about 10% of several.",
                metavar="CHARS",
            ),
        ],
        str(CorpusOptions.held_out),
    ),
    "skip_bad_files": (
        Annotated[bool, _data("Skip binary, unreadable or undecodable files (with a warning) instead of stopping.")],
        CorpusOptions.skip_bad_files,
    ),
}


def with_options(group: dict | Callable[[], dict]) -> Callable[[Command], Command]:
    """Give a command a group of options several commands share, {name: (Annotated type, default)}, or
    a function making one: typer reads the parameters from the signature made here each time it builds
    the command (so a group made from a table has the table's entries of that moment), and the command
    takes them as **kwargs."""
    make = group if callable(group) else lambda: group

    def add(command: Command) -> Command:
        return _WithOptions(command, make)  # type: ignore[return-value]

    return add


class _WithOptions:
    """A command whose signature is its own parameters followed by its option group's (see with_options)."""

    def __init__(self, command: Callable, group: Callable[[], dict]):
        functools.update_wrapper(self, command)
        self.group = group

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self.__wrapped__, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
                  for name, (annotation, default) in self.group().items()]  # fmt: skip
        return signature.replace(parameters=[*own, *shared])


def declared_options(options: type) -> dict[str, tuple[object, object]]:
    """The fields of a dataclass declared with aftgen.options.option(), as a group of options for with_options."""
    group = {}
    for name, (kind, default, declaration) in declared(options).items():
        spelling = {"rich_help_panel": declaration.panel, "envvar": declaration.envvar}
        group[name] = (Annotated[kind, typer.Option(*declaration.flags, help=declaration.help, **spelling)], default)
    return group


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def command(func):
    """Turn the tool's own errors into one line and exit 2; anything unexpected into one line plus a log. The
    command also learns its name as typed (`bench serve`), for other processes to see (set_up_torch)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        global _running
        context = kwargs.pop(_CONTEXT, None)
        _running = context.command_path.partition(" ")[2] if context else _running
        try:
            return func(*args, **kwargs)
        except AftgenError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            quiet_stdout()  # reader went away: quietly stop
            raise typer.Exit(0) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            if _debugging():
                raise
            fail(f"internal error: {type(exc).__name__}: {exc} (traceback in {_crash_log()}; --debug shows it)", 1)

    wrapper.__signature__ = _with_context(inspect.signature(func, eval_str=True))
    return wrapper


_CONTEXT = "_context"  # the parameter typer hands each command's context in (command adds it)
_running = "python"  # the command this process runs, as typed; "python" where aftgen runs as a library


def _with_context(signature: inspect.Signature) -> inspect.Signature:
    """`signature` with a typer.Context parameter for typer to fill (it creates no option for it)."""
    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    context = inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=typer.Context)
    return signature.replace(parameters=[*parameters[:at], context, *parameters[at:]])


def quiet_stdout() -> None:
    """Point stdout at /dev/null once its reader has gone (`aftgen sample | head -1`), so that nothing written or
    flushed later fails again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _debugging() -> bool:
    """Whether `aftgen --debug` (or AFTGEN_DEBUG=1) asked for tracebacks."""
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def _crash_log() -> str:
    fd, path = tempfile.mkstemp(prefix="aftgen-crash-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        traceback.print_exc(file=log)
    return path


def options_from(cls: type[Options], parameters: dict, **overrides) -> Options:
    """The dataclass `cls` built from a command's parameters (its `locals()`) of the same names. The
    CLI's defaults are the dataclass's own, so every option and default has one home."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: value for name, value in parameters.items() if name in names} | overrides)


def set_up_torch(threads: int | None = None, reserve: int = 0, busy: bool = True) -> None:
    """Set torch's CPU threads (this command's share of the cores, see aftgen.cores) and keep freed memory
    for reuse; called before any torch work, since torch fixes its threads on first use."""
    from aftgen import cores

    if threads is not None and threads < 1:
        raise AftgenError(f"--threads must be >= 1, got {threads}")
    cores.set_up(_running, threads, reserve, busy)


def placement(hardware: dict, reserve: int = 0, busy: bool = True, generating: bool = False):
    """Threads first, then the device and dtype (HARDWARE_OPTIONS): one call for every command that runs a model;
    `generating` for those that generate text (device.resolve)."""
    from aftgen.device import resolve

    set_up_torch(hardware["threads"], reserve, busy)
    return resolve(hardware["device"], hardware["dtype"], generating=generating)


def require_file(path: Path | None, what: str) -> None:
    """Refuse a missing input file, or a folder, FIFO or device in its place, before any work (its contents
    are checked when read)."""
    if path is not None and not path.is_file():
        if not path.exists():
            raise AftgenError(f"{path}: no such {what}")
        raise AftgenError(f"{path} is {kind_of(path.stat().st_mode)}, not a file: give the path of a {what}")


def check_destination(path: Path | None) -> None:
    """Refuse an output file's path that is a folder, FIFO or device before any work, not when the work is done and
    its result is to be written there."""
    if path is not None:
        check_output(path)


def keep_undecodable_stdin() -> None:
    """Read stdin as Python reads the command line: bytes that are not UTF-8 come through as lone surrogates
    for aftgen.tokenizer.valid_text to refuse in one line (in a UTF-8 locale a read would raise instead)."""
    if isinstance(sys.stdin, io.TextIOWrapper):  # not a StringIO put in its place
        sys.stdin.reconfigure(errors="surrogateescape")


def whole_numbers(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated list of positive whole numbers, as an option gives it ("1024,4096")."""
    try:
        numbers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise AftgenError(f"{option} takes whole numbers, comma-separated, got '{text}'") from None
    if min(numbers) < 1:
        raise AftgenError(f"{option} takes numbers >= 1, got '{text}'")
    return numbers


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
