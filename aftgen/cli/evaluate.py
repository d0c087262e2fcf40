"""`aftgen eval`: a model's loss on a text file, in units that compare across tokenizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from aftgen.cli.common import (
    ENCODING_HELP,
    ERRORS_HELP,
    HARDWARE_OPTIONS,
    ModelOption,
    command,
    placement,
    with_options,
)
from aftgen.corpus import CorpusOptions


@with_options(HARDWARE_OPTIONS)
@command
def evaluate(
    file: Annotated[Path, typer.Argument(help="Text file to score.")],
    model: ModelOption = None,
    reset_every: Annotated[
        int, typer.Option(help="Cut the context into independent windows of N tokens (0: one stream).")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    encoding: Annotated[str, typer.Option(help=ENCODING_HELP)] = CorpusOptions.encoding,
    errors: Annotated[str, typer.Option(help=ERRORS_HELP)] = CorpusOptions.errors,
    **hardware,
) -> None:
    """Held-out loss of a model on a file of any size (read in chunks): nats/token, nats/char, bits/char, bits/byte."""
    from aftgen.api import load
    from aftgen.corpus.sources import scan_file
    from aftgen.evaluate import evaluate_file

    document = scan_file(file, encoding, errors)  # one clear error for anything that is not text, before loading
    where = placement(hardware)
    lm, tokenizer = load(model, where.device)
    with where.autocast():
        result = evaluate_file(lm, tokenizer, document, encoding, errors, reset_every=reset_every)
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        print(
            f"{result.nats_per_token:.4f} nats/token  {result.nats_per_char:.4f} nats/char  "
            f"{result.bits_per_char:.4f} bits/char  {result.bits_per_byte:.4f} bits/byte  "
            f"({result.tokens:,} tokens, {result.chars:,} chars)"
        )
