"""`aftgen train`: the options declared in aftgen.training.options.TrainOptions on the command line."""

from __future__ import annotations

import os
import shlex
import sys
from typing import Annotated, get_args

import typer

from aftgen.cli.common import (
    CORPUS_OPTIONS,
    HARDWARE_OPTIONS,
    CorpusArgument,
    command,
    declared_options,
    options_from,
    set_up_torch,
    with_options,
)
from aftgen.corpus import CorpusOptions
from aftgen.options import DATA_PANEL
from aftgen.tokenizer import TOKENIZER_TYPES
from aftgen.training.options import TrainOptions


def _train_options() -> dict:
    """TrainOptions' declared options, as `aftgen train` takes them: --max-time as text (a duration, "10m")."""
    group = declared_options(TrainOptions)
    declared_type, default = group["max_time"]
    group["max_time"] = (Annotated[str | None, get_args(declared_type)[1]], default)
    return HARDWARE_OPTIONS | CORPUS_OPTIONS | group


@with_options(_train_options)
@command
def train(
    corpus: CorpusArgument,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    **given,
) -> None:
    """Train a tokenizer and a model on text files and folders (each file a document); prints the run folder.

    The same command under `torchrun --nproc_per_node N -m aftgen train ...` trains on N processes.
    """
    from aftgen.training.loop import TrainingInterrupted
    from aftgen.training.loop import train as run_training

    options = options_from(TrainOptions, given | {"corpus": corpus}, command=shlex.join(["aftgen", *sys.argv[1:]]))
    set_up_torch(given["threads"])
    main_process = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 prints the run folder
    try:
        run = run_training(options, quiet=quiet)
    except TrainingInterrupted as stop:
        if main_process:
            print(stop.out)
        raise typer.Exit(130) from None
    if main_process:
        print(run)


@with_options(CORPUS_OPTIONS)
@command
def prepare(
    corpus: CorpusArgument,
    vocab_size: Annotated[int, typer.Option(rich_help_panel=DATA_PANEL)] = CorpusOptions.vocab_size,
    tokenizer_type: Annotated[
        str, typer.Option(help=" | ".join(TOKENIZER_TYPES) + ".", rich_help_panel=DATA_PANEL)
    ] = CorpusOptions.tokenizer_type,
    workers: Annotated[int | None, typer.Option(help="Encoding processes (default: one per core).")] = None,
    **shared,
) -> None:
    """Prepare a corpus ahead of training (tokenizer, held-out split, token files); prints the cache folder.

    `aftgen train` with the same paths and data options then starts at once: before a torchrun job, for example.
    """
    from aftgen.corpus import prepare_corpus

    prepared = prepare_corpus(corpus, options_from(CorpusOptions, locals() | shared))
    summary = prepared.summary
    print(
        f"prepared: {summary['train_tokens']:,} training tokens, {summary['held_out_tokens']:,} held-out tokens, "
        f"vocabulary {prepared.tokenizer.vocab_size}",
        file=sys.stderr,
    )
    print(prepared.folder)
