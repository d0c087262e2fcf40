"""`aftgen train`: the options of aftgen.training.options.TrainOptions on the command line."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from aftgen.cli.common import (
    CORPUS_OPTIONS,
    DATA_PANEL,
    HARDWARE_OPTIONS,
    HARDWARE_PANEL,
    MODEL_PANEL,
    TRAIN_PANEL,
    CorpusArgument,
    command,
    options_from,
    set_up_torch,
    with_options,
)
from aftgen.corpus import CorpusOptions
from aftgen.mixers import MIXERS
from aftgen.model import ACTIVATIONS
from aftgen.options import flag
from aftgen.training.options import FINE_TUNE_DEFAULTS, FINE_TUNE_STEPS
from aftgen.training.options import TrainOptions as Defaults
from aftgen.training.recipe import DEFAULT_BUDGET


def _option(help: str | None = None, panel: str | None = None, *names: str):
    return typer.Option(*names, help=help, rich_help_panel=panel)


def _defaults(name: str | None = None) -> str:
    """The default of an option the recipe sets (and fine-tuning's, where it has its own)."""
    fine_tuning = f"; fine-tuning: {FINE_TUNE_DEFAULTS[name]}" if name in FINE_TUNE_DEFAULTS else ""
    return f" Default: the recipe's{fine_tuning}."


@with_options(HARDWARE_OPTIONS | CORPUS_OPTIONS)
@command
def train(
    corpus: CorpusArgument,
    out: Annotated[Path | None, _option("Run folder (default runs/<corpus-stem>).")] = None,
    resume: Annotated[bool, _option("Continue the run in --out where it stopped.")] = Defaults.resume,
    overwrite: Annotated[bool, _option("Replace a run already in --out.")] = Defaults.overwrite,
    init_from: Annotated[
        str | None,
        _option(
            "Fine-tune this model (a checkpoint folder or OWNER/NAME\\[@REV] from the Hub): its tokenizer and "
            "architecture are kept, the optimiser starts fresh, and the defaults become "
            + ", ".join(f"{flag(name)} {value}" for name, value in FINE_TUNE_DEFAULTS.items())
            + ".",
            TRAIN_PANEL,
        ),
    ] = None,
    preset: Annotated[
        str | None, _option("tiny | small | medium | large." + _defaults(), MODEL_PANEL)
    ] = Defaults.preset,
    n_layer: Annotated[int | None, _option(None, MODEL_PANEL, "--layers")] = None,
    n_embd: Annotated[int | None, _option(None, MODEL_PANEL, "--width")] = None,
    n_head: Annotated[int | None, _option(None, MODEL_PANEL, "--heads")] = None,
    mixer: Annotated[
        str | None,
        _option(
            "Token mixer: " + " | ".join(f"{name} ({kind.about})" for name, kind in MIXERS.items()) + ".", MODEL_PANEL
        ),
    ] = None,
    window: Annotated[int | None, _option("AFT-local window s.", MODEL_PANEL)] = None,
    context_length: Annotated[int | None, _option("Training sequence length.", MODEL_PANEL)] = None,
    dropout: Annotated[float | None, _option(_defaults(), MODEL_PANEL)] = None,
    decay: Annotated[
        bool | None, _option("Learned decay beyond the window (off: the paper's AFT-local).", MODEL_PANEL)
    ] = None,
    activation: Annotated[
        str | None, _option("The MLP's: " + " | ".join(ACTIVATIONS) + "." + _defaults(), MODEL_PANEL)
    ] = None,
    max_steps: Annotated[
        int | None, _option(f"Step budget (default: none; fine-tuning: {FINE_TUNE_STEPS}).", TRAIN_PANEL)
    ] = None,
    max_time: Annotated[
        str | None,
        _option(
            f"Wall-time budget: 150, 90s, 10m, 1h. Default: {DEFAULT_BUDGET / 60:g}m unless --max-steps is given. "
            "A fresh run chooses its recipe (model size, regularisation, schedule) for its corpus and this budget.",
            TRAIN_PANEL,
        ),
    ] = None,
    batch_size: Annotated[int | None, _option(None, TRAIN_PANEL)] = None,
    lr: Annotated[float | None, _option("Peak learning rate." + _defaults("lr"), TRAIN_PANEL)] = None,
    warmup_steps: Annotated[int | None, _option(_defaults("warmup_steps"), TRAIN_PANEL)] = None,
    weight_decay: Annotated[float | None, _option(_defaults(), TRAIN_PANEL)] = None,
    grad_clip: Annotated[float, _option(None, TRAIN_PANEL)] = Defaults.grad_clip,
    optimizer: Annotated[
        str | None,
        _option(
            "adamw | muon (Muon for the blocks' matrices, AdamW for the rest)." + _defaults("optimizer"), TRAIN_PANEL
        ),
    ] = None,
    ema: Annotated[
        float | None,
        _option(
            "Check and publish an exponential moving average of the weights with this decay (e.g. 0.995); 0: off."
            + _defaults(),
            TRAIN_PANEL,
        ),
    ] = None,
    eval_interval: Annotated[
        int | None, _option("Steps between held-out evals and checkpoints." + _defaults("eval_interval"), TRAIN_PANEL)
    ] = None,
    eval_windows: Annotated[
        int | None, _option("Held-out windows each eval scores." + _defaults("eval_windows"), TRAIN_PANEL)
    ] = None,
    keep_best: Annotated[
        bool | None,
        _option(
            "Publish the weights that scored best on the held-out eval, not the latest." + _defaults("keep_best"),
            TRAIN_PANEL,
        ),
    ] = None,
    patience: Annotated[
        int | None,
        _option(
            "Stop after this many held-out evals without a new best (needs --keep-best); 0: run the whole budget."
            + _defaults(),
            TRAIN_PANEL,
        ),
    ] = None,
    weights_dtype: Annotated[
        str, _option("fp32 | fp16 | bf16: precision of model.safetensors (fp16 halves it).", TRAIN_PANEL)
    ] = Defaults.weights_dtype,
    seed: Annotated[int, _option(None, TRAIN_PANEL)] = Defaults.seed,
    vocab_size: Annotated[int | None, _option("Default: 1024 (fine-tuning: the base model's).", DATA_PANEL)] = None,
    tokenizer_type: Annotated[str | None, _option("bpe | unigram | char (default: bpe).", DATA_PANEL)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
    compile: Annotated[
        bool,
        _option("torch.compile the training model (falls back to eager).", HARDWARE_PANEL, "--compile/--no-compile"),
    ] = Defaults.compile,
    **shared,
) -> None:
    """Train a tokenizer and a model on text files and folders (each file a document); prints the run folder.

    The same command under `torchrun --nproc_per_node N -m aftgen train ...` trains on N processes.
    """
    from aftgen.training.loop import TrainingInterrupted
    from aftgen.training.loop import train as run_training
    from aftgen.training.options import TrainOptions

    given = locals() | shared
    options = options_from(TrainOptions, given, command=shlex.join(["aftgen", *sys.argv[1:]]))
    options.check()
    set_up_torch(shared["threads"])
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
    vocab_size: Annotated[int, _option(None, DATA_PANEL)] = CorpusOptions.vocab_size,
    tokenizer_type: Annotated[str, _option("bpe | unigram | char.", DATA_PANEL)] = CorpusOptions.tokenizer_type,
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
