"""The `aftgen` command line: a thin layer over the library. Data on stdout, everything else on stderr."""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Annotated

import typer

from aftgen.errors import AftgenError

app = typer.Typer(
    help="Train Attention Free Transformer language models on any text and sample from them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

DEBUG = {"on": False}
MODEL_PANEL, TRAIN_PANEL, DATA_PANEL, SAMPLE_PANEL = "Model size", "Training", "Data", "Sampling"


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def command(func):
    """Turn the tool's own errors into one line and exit 2; anything unexpected into one line plus a log."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except AftgenError as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # reader went away: quietly stop
            raise typer.Exit(0) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:
            if DEBUG["on"]:
                raise
            fd, log_path = tempfile.mkstemp(prefix="aftgen-crash-", suffix=".log")
            with os.fdopen(fd, "w") as log:
                traceback.print_exc(file=log)
            fail(f"internal error: {type(exc).__name__}: {exc} (traceback in {log_path}; --debug shows it)", code=1)

    return wrapper


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks for internal errors.")] = False,
) -> None:
    DEBUG["on"] = debug


def _threads() -> None:
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


@app.command()
@command
def train(
    corpus: Annotated[Path, typer.Argument(help="UTF-8 text file to learn from.")],
    out: Annotated[Path | None, typer.Option(help="Run folder (default runs/<corpus-stem>).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out where it stopped.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace a run already in --out.")] = False,
    preset: Annotated[str, typer.Option(help="tiny | small | medium.", rich_help_panel=MODEL_PANEL)] = "small",
    n_layer: Annotated[int | None, typer.Option("--layers", rich_help_panel=MODEL_PANEL)] = None,
    n_embd: Annotated[int | None, typer.Option("--width", rich_help_panel=MODEL_PANEL)] = None,
    n_head: Annotated[int | None, typer.Option("--heads", rich_help_panel=MODEL_PANEL)] = None,
    mixer: Annotated[
        str | None,
        typer.Option(
            help="Token mixer: aft_local | aft_simple (no window) | aft_full (window = whole context; "
            "generation O(context) per token) | attention (softmax + KV cache, the baseline).",
            rich_help_panel=MODEL_PANEL,
        ),
    ] = None,
    window: Annotated[int | None, typer.Option(help="AFT-local window s.", rich_help_panel=MODEL_PANEL)] = None,
    context_length: Annotated[int | None, typer.Option(help="Training sequence length.", rich_help_panel=MODEL_PANEL)] = None,
    dropout: Annotated[float | None, typer.Option(rich_help_panel=MODEL_PANEL)] = None,
    decay: Annotated[
        bool | None, typer.Option(help="Learned decay beyond the window (off: the paper's AFT-local).", rich_help_panel=MODEL_PANEL)
    ] = None,
    max_steps: Annotated[int, typer.Option(rich_help_panel=TRAIN_PANEL)] = 5000,
    max_time: Annotated[str | None, typer.Option(help="Wall-time budget: 150, 90s, 10m, 1h.", rich_help_panel=TRAIN_PANEL)] = None,
    batch_size: Annotated[int | None, typer.Option(rich_help_panel=TRAIN_PANEL)] = None,
    lr: Annotated[float, typer.Option(help="Peak learning rate.", rich_help_panel=TRAIN_PANEL)] = 2e-3,
    warmup_steps: Annotated[int, typer.Option(rich_help_panel=TRAIN_PANEL)] = 100,
    weight_decay: Annotated[float, typer.Option(rich_help_panel=TRAIN_PANEL)] = 0.1,
    grad_clip: Annotated[float, typer.Option(rich_help_panel=TRAIN_PANEL)] = 1.0,
    eval_interval: Annotated[int, typer.Option(help="Steps between held-out evals and checkpoints.", rich_help_panel=TRAIN_PANEL)] = 250,
    seed: Annotated[int, typer.Option(rich_help_panel=TRAIN_PANEL)] = 1337,
    vocab_size: Annotated[int, typer.Option(rich_help_panel=DATA_PANEL)] = 1024,
    tokenizer_type: Annotated[str, typer.Option(help="bpe | unigram | char.", rich_help_panel=DATA_PANEL)] = "bpe",
    encoding: Annotated[str, typer.Option(help="Text encoding of the corpus.", rich_help_panel=DATA_PANEL)] = "utf-8",
    errors: Annotated[str, typer.Option(help="strict | replace | ignore undecodable bytes.", rich_help_panel=DATA_PANEL)] = "strict",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Train a tokenizer and a model on a text file; prints the run folder on stdout."""
    from aftgen.training import TrainingInterrupted, TrainOptions, parse_duration
    from aftgen.training import train as run_training

    options = TrainOptions(
        corpus=corpus, out=out, preset=preset, n_layer=n_layer, n_embd=n_embd, n_head=n_head, mixer=mixer,
        window=window, context_length=context_length, batch_size=batch_size, dropout=dropout, decay=decay, lr=lr,
        weight_decay=weight_decay, warmup_steps=warmup_steps, grad_clip=grad_clip, max_steps=max_steps,
        max_time=parse_duration(max_time) if max_time else None, eval_interval=eval_interval, seed=seed,
        vocab_size=vocab_size, tokenizer_type=tokenizer_type, encoding=encoding, errors=errors,
        resume=resume, overwrite=overwrite, command=shlex.join(["aftgen", *sys.argv[1:]]),
    )  # fmt: skip
    options.check()
    _threads()
    try:
        run = run_training(options, quiet=quiet)
    except TrainingInterrupted as stop:
        print(stop.out)
        raise typer.Exit(130) from None
    print(run)


@app.command()
@command
def sample(
    model: Annotated[str | None, typer.Option("--model", "-m", help="Checkpoint folder or Hub id (default: the shipped model).")] = None,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue; '-' reads stdin.", rich_help_panel=SAMPLE_PANEL)] = "",
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from a file.", rich_help_panel=SAMPLE_PANEL)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="-1: until stopped.", rich_help_panel=SAMPLE_PANEL)] = 200,
    temperature: Annotated[float, typer.Option(help="0: greedy.", rich_help_panel=SAMPLE_PANEL)] = 0.8,
    top_k: Annotated[int, typer.Option(help="Keep the k likeliest tokens (0: off).", rich_help_panel=SAMPLE_PANEL)] = 0,
    top_p: Annotated[float, typer.Option(help="Keep the smallest set reaching p.", rich_help_panel=SAMPLE_PANEL)] = 1.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p x the top probability.", rich_help_panel=SAMPLE_PANEL)] = 0.0,
    repeat_penalty: Annotated[float, typer.Option(rich_help_panel=SAMPLE_PANEL)] = 1.0,
    repeat_last_n: Annotated[int, typer.Option(rich_help_panel=SAMPLE_PANEL)] = 64,
    stop: Annotated[list[str] | None, typer.Option(help="End before this string (repeatable).", rich_help_panel=SAMPLE_PANEL)] = None,
    num_samples: Annotated[int, typer.Option(help="Continuations of one prompt.", rich_help_panel=SAMPLE_PANEL)] = 1,
    seed: Annotated[int | None, typer.Option(rich_help_panel=SAMPLE_PANEL)] = None,
    echo: Annotated[bool, typer.Option(help="Print the prompt before the continuation.")] = True,
) -> None:
    """Continue a prompt, streaming text to stdout as it is made."""
    from aftgen.api import load
    from aftgen.sampling import SamplingOptions, sample_text

    options = SamplingOptions(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=tuple(stop or ()),
    )  # fmt: skip
    options.check()
    if num_samples < 1:
        raise AftgenError(f"--num-samples must be >= 1, got {num_samples}")
    if prompt_file is not None:
        from aftgen.data import read_text

        prompt = read_text(prompt_file)
    elif prompt == "-":
        prompt = sys.stdin.read()
    _threads()
    lm, tokenizer = load(model)
    for index, pieces in enumerate(sample_text(lm, tokenizer, prompt, options, num_samples)):
        if index:
            sys.stdout.write("\n\n---\n\n")
        if echo:
            sys.stdout.write(prompt)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()


@app.command("eval")
@command
def evaluate(
    file: Annotated[Path, typer.Argument(help="Text file to score.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Checkpoint folder or Hub id.")] = None,
    reset_every: Annotated[int, typer.Option(help="Cut the context into independent windows of N tokens (0: one stream).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    encoding: Annotated[str, typer.Option()] = "utf-8",
    errors: Annotated[str, typer.Option()] = "strict",
) -> None:
    """Held-out loss of a model on a file: nats/token, nats/char, bits/char, bits/byte."""
    from aftgen.api import load
    from aftgen.data import read_text
    from aftgen.evaluate import evaluate_text

    if reset_every < 0:
        raise AftgenError(f"--reset-every must be >= 0, got {reset_every}")
    text = read_text(file, encoding, errors)
    _threads()
    lm, tokenizer = load(model)
    result = evaluate_text(lm, tokenizer, text, reset_every=reset_every)
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        print(
            f"{result.nats_per_token:.4f} nats/token  {result.nats_per_char:.4f} nats/char  "
            f"{result.bits_per_char:.4f} bits/char  {result.bits_per_byte:.4f} bits/byte  "
            f"({result.tokens:,} tokens, {result.chars:,} chars)"
        )
