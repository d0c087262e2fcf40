"""`aftgen sample`, `prime` and `chat`: generation from the recurrent state, and state files."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from aftgen import layers
from aftgen.cli.common import (
    ENCODING_HELP,
    ERRORS_HELP,
    HARDWARE_OPTIONS,
    SAMPLE_PANEL,
    STATE_PANEL,
    ModelOption,
    check_destination,
    command,
    keep_undecodable_stdin,
    placement,
    require_file,
    with_options,
)
from aftgen.corpus import CorpusOptions
from aftgen.errors import AftgenError
from aftgen.files import read_text
from aftgen.generation.controls import CONTROLS, check_seed
from aftgen.generation.controls import SamplingOptions as Defaults
from aftgen.layers import BATCH_INVARIANT_HELP
from aftgen.options import flag
from aftgen.tokenizer import valid_text

if TYPE_CHECKING:
    from aftgen.constraints import Constraint


def _sampling(help: str, *names: str):
    return typer.Option(*names, help=help, rich_help_panel=SAMPLE_PANEL)


Seed = Annotated[int | None, _sampling("Random seed (with --load-state: replaces the saved generator).")]
MaxNewTokens = Annotated[int, _sampling("-1: until stopped.", "--max-new-tokens", "-n")]


def sampling_options() -> dict[str, tuple[object, object]]:
    """The options `sample` and `chat` share: -n, one per control in aftgen.generation.controls.CONTROLS, --seed.

    Made when typer builds the command, so a control added to CONTROLS before then is an option too.
    """
    controls = {
        name: (Annotated[control.type, _sampling(control.help)], control.default) for name, control in CONTROLS.items()
    }
    return {"max_new_tokens": (MaxNewTokens, Defaults.max_new_tokens), **controls, "seed": (Seed, Defaults.seed)}


SHAPE_LIMIT = 1 << 20  # bytes of a --json-schema or --grammar file


def shape_options() -> dict[str, tuple[object, object]]:
    """What the text must be (aftgen.constraints): one of a JSON schema, a regular expression, a grammar."""
    return {
        "json_schema": (Annotated[Path | None, _sampling("Write JSON that follows this schema (a file).")], None),
        "regex": (Annotated[str | None, _sampling("Write text that matches this regular expression.")], None),
        "grammar": (
            Annotated[Path | None, _sampling("Write text that follows this grammar (GBNF or Lark file).")],
            None,
        ),
    }


def generation_options() -> dict[str, tuple[object, object]]:
    return sampling_options() | shape_options() | HARDWARE_OPTIONS


def _constraint(shared: dict) -> Constraint | None:
    """The one of --json-schema, --regex and --grammar given, read (None: none is)."""
    from aftgen.constraints import Constraint

    given = [name for name in shape_options() if shared[name] is not None]
    if len(given) > 1:
        raise AftgenError(f"give one of --json-schema, --regex and --grammar, not {' and '.join(map(flag, given))}")
    if not given:
        return None
    name, value = given[0], shared[given[0]]
    if name == "regex":
        return Constraint("regex", valid_text(value, "--regex"))
    require_file(value, name.replace("_", " ") + " file")
    return Constraint(name, read_text(value, SHAPE_LIMIT, f"the {flag(name)} file"))


LoadState = Annotated[
    Path | None,
    typer.Option(help="Continue from a state file (sample --save-state, prime).", rich_help_panel=STATE_PANEL),
]
SaveState = Annotated[
    Path | None, typer.Option(help="Write the state after the run, to continue it later.", rich_help_panel=STATE_PANEL)
]
Compile = Annotated[
    bool,
    typer.Option(
        "--compile/--no-compile", help="Compile the step ahead of time (tens of seconds once, then from the cache)."
    ),
]
BatchInvariant = Annotated[
    bool | None,
    typer.Option(
        "--batch-invariant/--no-batch-invariant",
        help=f"With --compile: the step of `aftgen serve --batch-invariant`, and its text. {BATCH_INVARIANT_HELP}",
        show_default=False,
    ),
]


def _sampling_options(shared: dict, stop: list[str] | None, num_samples: int = 1) -> Defaults:
    given = {name: shared[name] for name in sampling_options()}
    stops = tuple(valid_text(text, "--stop") for text in stop or ())
    options = Defaults(**given, stop=stops, num_samples=num_samples, constraint=_constraint(shared))
    options.check()
    return options


def _load_for_generation(
    model: str | None,
    load_state: Path | None,
    compile_step: bool,
    batch_invariant: bool | None,
    where,
    constraint: Constraint | None = None,
):
    """(model, tokenizer, context or None, step function), telling stderr about the compile; `constraint`
    compiled for the tokenizer, so that one that cannot be is refused before any text."""
    from aftgen.api import load
    from aftgen.compiled.step import compile_step as compiled
    from aftgen.constraints import compiled as compiled_constraint
    from aftgen.state import load_state as read_state

    lm, tokenizer = load(model, where.device)
    lm.lower_weights(where.weights)
    if constraint is not None:  # refused before any text is written
        compiled_constraint(constraint, tokenizer)
    context = read_state(load_state, lm, tokenizer) if load_state else None
    step = lm.step
    if compile_step:
        invariant = layers.batch_invariant(batch_invariant, where.device, True).on
        step, note = compiled(lm, batch_invariant=invariant)
        print(f"step: {note}", file=sys.stderr)
    return lm, tokenizer, context, step


def _prompt_blocks(prompt: str, prompt_file: Path | None) -> Callable[[], Iterable[str]]:
    """--prompt, --prompt - (stdin) or --prompt-file, refused in one line unless UTF-8 text: a function giving its
    text block by block each time it is called (a file is read again each time, never held whole)."""
    if prompt_file is not None:
        from aftgen.corpus.sources import read_document, scan_file

        document = scan_file(prompt_file)  # checked as text once, before the model loads
        return lambda: read_document(document)
    if prompt == "-":
        keep_undecodable_stdin()
        text = valid_text(sys.stdin.read(), "stdin")
    else:
        text = valid_text(prompt, "--prompt")
    return lambda: [text]


@with_options(generation_options)
@command
def sample(
    model: ModelOption = None,
    prompt: Annotated[str, _sampling("Text to continue; '-' reads stdin.", "--prompt", "-p")] = "",
    prompt_file: Annotated[Path | None, _sampling("Read the prompt from a file.")] = None,
    stop: Annotated[list[str] | None, _sampling("End before this string (repeatable).")] = None,
    num_samples: Annotated[int, _sampling("Continuations of one prompt.")] = Defaults.num_samples,
    load_state: LoadState = None,
    save_state: SaveState = None,
    compile_step: Compile = False,
    batch_invariant: BatchInvariant = None,
    echo: Annotated[bool, typer.Option(help="Print the prompt before the continuation.")] = True,
    **shared,
) -> None:
    """Continue a prompt, streaming text to stdout as it is made."""
    from aftgen.generation.loop import sample_text
    from aftgen.generation.prompt import read_prompt
    from aftgen.state import save_state as write_state

    options = _sampling_options(shared, stop, num_samples)
    if save_state is not None and num_samples > 1:
        raise AftgenError("--save-state keeps one continuation; use it with --num-samples 1")
    require_file(load_state, "state file")
    check_destination(save_state)
    prompt_blocks = _prompt_blocks(prompt, prompt_file)
    where = placement(shared, generating=True)
    lm, tokenizer, context, step = _load_for_generation(
        model, load_state, compile_step, batch_invariant, where, options.constraint
    )
    with where.autocast():
        context = read_prompt(lm, tokenizer, prompt_blocks(), context, options.seed)
        # A run that will be continued keeps an unfinished last character for the next one.
        runs = sample_text(lm, tokenizer, context, options, step, final=save_state is None)
        _write_samples(runs, prompt_blocks if echo else lambda: (), save_state is None)
    if save_state is not None:
        write_state(save_state, context, lm, tokenizer)
        print(f"state saved to {save_state}", file=sys.stderr)


def _write_samples(runs, prompt_blocks: Callable[[], Iterable[str]], newline: bool) -> None:
    """Stream each continuation to stdout as it is made, after the prompt's blocks, separated by '---'."""
    for index, pieces in enumerate(runs):
        if index:
            sys.stdout.write("\n\n---\n\n")
        sys.stdout.writelines(prompt_blocks())
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        if newline:
            sys.stdout.write("\n")
        sys.stdout.flush()


@with_options(HARDWARE_OPTIONS)
@command
def prime(
    text_file: Annotated[Path, typer.Argument(help="Text to read (any length: read in chunks, constant memory).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="State file to write.")],
    model: ModelOption = None,
    seed: Seed = None,
    encoding: Annotated[str, typer.Option(help=ENCODING_HELP)] = CorpusOptions.encoding,
    errors: Annotated[str, typer.Option(help=ERRORS_HELP)] = CorpusOptions.errors,
    compile_prefill: Annotated[
        bool,
        typer.Option(
            "--compile/--no-compile",
            help="torch.compile the chunk reader: seconds of warm-up, then faster reading of long texts.",
        ),
    ] = False,
    **hardware,
) -> None:
    """Read a text once into a state file that `sample`/`chat --load-state` start from."""
    from aftgen.compiled.functions import compile_prefill as compiled
    from aftgen.corpus.sources import read_document, scan_file
    from aftgen.generation.prompt import PROMPT_CHUNK, read_prompt
    from aftgen.model import tokens_read
    from aftgen.state import save_state as write_state

    check_seed(seed)
    check_destination(out)
    document = scan_file(text_file, encoding, errors)  # checked as text once, before the model loads
    where = placement(hardware, generating=True)
    lm, tokenizer, _, _ = _load_for_generation(model, None, False, False, where)
    prefill = None
    if compile_prefill:
        prefill, note = compiled(lm, PROMPT_CHUNK)
        print(f"prompt reading: {note}", file=sys.stderr)
    start = time.perf_counter()
    with where.autocast():
        context = read_prompt(lm, tokenizer, read_document(document, encoding, errors), None, seed, prefill)
    elapsed = time.perf_counter() - start
    write_state(out, context, lm, tokenizer)
    tokens = tokens_read(context.state)
    print(f"read {tokens:,} tokens in {elapsed:.1f} s ({tokens / elapsed:,.0f} tokens/s)", file=sys.stderr)
    print(out)


@with_options(generation_options)
@command
def chat(
    model: ModelOption = None,
    stop: Annotated[
        list[str] | None, _sampling("End a reply before this string (repeatable; default: a blank line).")
    ] = None,
    load_state: LoadState = None,
    save_state: SaveState = None,
    compile_step: Compile = False,
    batch_invariant: BatchInvariant = None,
    **shared,
) -> None:
    """Talk to a model: each line you type is read into the running state and the model answers.

    History is never re-read, so turns stay as fast as the first. Ctrl-C stops a reply, Ctrl-D ends.
    """
    from aftgen.chat import REPLY_END, run_chat
    from aftgen.state import save_state as write_state

    options = _sampling_options(shared, stop or [REPLY_END])
    require_file(load_state, "state file")
    check_destination(save_state)
    keep_undecodable_stdin()
    where = placement(shared, generating=True)
    lm, tokenizer, context, step = _load_for_generation(
        model, load_state, compile_step, batch_invariant, where, options.constraint
    )
    with where.autocast():
        context = run_chat(lm, tokenizer, options, context, step)
    if save_state is not None and context is not None:
        write_state(save_state, context, lm, tokenizer)
        print(f"state saved to {save_state}", file=sys.stderr)
